"""nanoareal: a minimal GRPO trainer (work in progress; the loop lands with the next commits)."""

from __future__ import annotations

import random

# -----------------------------------------------------------------------------
# data: the built-in arithmetic task (generated, never downloaded)


def make_arithmetic_task(seed: int = 0, max_operand: int = 50, heldout_size: int = 256):
    """All sums a+b with 0 <= a, b < max_operand, split deterministically into (train, heldout).

    Each item is {"prompt": "12+34=", "answer": "46"}. The split depends only on `seed`, so the
    SFT warm-start, every GRPO run and every test see the same held-out set.
    """
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(pairs)
    items = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return items[heldout_size:], items[:heldout_size]
