"""The calculator of the `calc` task (`--dataset calc`), an --env like a user's:

    python nanoareal.py --dataset calc --env assets/tiny-calc/calculator.py:Calculator

The policy calls it by writing "[37*48]" ("]" ends its turn); the calculator appends the value,
"1776", and the policy goes on (tiny-calc learned to end its answer there, so the last number of
the episode is the calculator's). Anything else between the brackets gets "?" (a wrong call is the
policy's mistake to learn from, not an error of the environment).
"""

from __future__ import annotations

import re

CALL = re.compile(r"\[(\d{1,6})([+*])(\d{1,6})\]$")  # the call that ends the turn


class Calculator:
    stop = ["]"]  # one token in tiny-calc's character vocabulary

    def __init__(self, row: dict):
        """One per episode; stateless, so the row is not needed (every call is answered alike)."""

    def step(self, turn: str) -> str | None:
        """The value of the "[a+b]" or "[a*b]" ending `turn` (non-negative integers), else "?"."""
        if (m := CALL.search(turn)) is None:
            return "?"
        a, b = int(m[1]), int(m[3])
        return str(a + b if m[2] == "+" else a * b)
