"""The command line: flags and a --config TOML in, one-line errors and exit codes out.

tyro turns the flat Config dataclass into flags, with each field's docstring as its help. Its own
parse errors are multi-line boxes, and its public API has no way to get them as one line, so
`check_flags` checks the command line against the dataclass first (unknown flags, missing or
malformed values, choices) and says what is wrong in one line; tyro then parses what passed.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import time
import types
import typing
from dataclasses import fields
from typing import Literal, TypeVar, Union

T = TypeVar("T")
ERROR_FILE_WAIT_S = 3.0  # under torchrun, a non-zero rank waits this long for rank 0 to report


class UserError(Exception):
    """A mistake in the user's input (a flag, a file, a value): one line on stderr and exit code 2,
    no traceback. Tracebacks are kept for real bugs."""


class Stopped(Exception):
    """The run stopped early on purpose (a signal, too many bad steps): its message is printed
    (rank 0) and the process exits with `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def why(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line, for a UserError: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__


# -----------------------------------------------------------------------------
# flags and TOML


def parse(cls: type[T], argv: list[str], preset=lambda dataset: {}) -> T:
    """Flags -> a `cls` dataclass. Defaults come in layers, later ones winning: the dataclass's,
    `preset(dataset)` (a built-in task's own flags), the --config TOML's keys, the command line."""
    import tyro

    args = _toml_as_flags(cls, argv) + list(argv)
    check_flags(cls, args)
    dataset = next((a.partition("=")[2] or args[i + 1] for i, a in reversed(list(enumerate(args)))
                    if a.partition("=")[0] == "--dataset"), getattr(cls, "dataset", None))
    return tyro.cli(cls, args=as_flags(cls, preset(dataset), "a built-in task") + args)


def _toml_as_flags(cls: type, argv: list[str]) -> list[str]:
    import tomllib

    if "--config" not in argv:
        return []
    i = argv.index("--config")
    path = argv[i + 1] if i + 1 < len(argv) else ""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"--config {path}: {e}") from None
    return as_flags(cls, values, f"--config {path}")


def as_flags(cls: type, values: dict, where: str) -> list[str]:
    """{"max_new_tokens": 32, "adv_std": False} -> ["--max-new-tokens", "32", "--no-adv-std"]."""
    hints, flags = typing.get_type_hints(cls), []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in hints or name == "config":
            raise UserError(f"{where}: unknown key {key!r} (keys are the flags of --help)")
        flag = "--" + name.replace("_", "-")
        if _base(hints[name]) is bool:
            if not isinstance(value, bool):
                raise UserError(f"{where}: {key} = {value!r} must be true or false")
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, *map(str, value if isinstance(value, list) else [value])]
    return flags


def _base(hint):
    """A field's type without its Optional: bool, int, float, str, a list or a Literal."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (Union, types.UnionType) and len(args) == 1:
        return _base(args[0])
    return hint


def check_flags(cls: type, args: list[str]) -> None:
    """One line naming the first thing tyro would refuse: an unknown flag (with the nearest one),
    a missing or extra value, a value of the wrong type or outside the choices."""
    hints = typing.get_type_hints(cls)
    known = {"--" + f.name.replace("_", "-"): _base(hints[f.name]) for f in fields(cls)}
    known |= {"--no-" + k[2:]: bool for k, t in list(known.items()) if t is bool}
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        values = [inline] if inline else []
        while i + 1 < len(args) and not args[i + 1].startswith("--") and not inline:
            values, i = values + [args[i + 1]], i + 1
        i += 1
        if flag in ("-h", "--help"):
            return
        if flag not in known:
            near = difflib.get_close_matches(flag, known, n=1)
            raise UserError(f"unknown flag {flag}" + (f" (did you mean {near[0]}?)" if near else
                                                       " (see --help)"))
        _check_values(flag, known[flag], values)


def _check_values(flag: str, kind, values: list[str]) -> None:
    count = "no value" if kind is bool else "one or more values" if typing.get_origin(kind) is \
        list else "one value"
    if (kind is bool) != (not values) or (count == "one value" and len(values) != 1):
        raise UserError(f"{flag} takes {count}, got {len(values)}: {' '.join(values)}".rstrip(": "))
    if typing.get_origin(kind) is Literal and values[0] not in map(str, typing.get_args(kind)):
        raise UserError(f"{flag} {values[0]}: choose one of "
                        f"{', '.join(map(str, typing.get_args(kind)))}")
    if kind in (int, float):
        for value in values:
            try:
                kind(value)
            except ValueError:
                raise UserError(f"{flag} {value}: not {'an int' if kind is int else 'a number'}"
                                ) from None


# -----------------------------------------------------------------------------
# running main: exit codes, torchrun's error file


def rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def run(main, argv: list[str] | None) -> int:
    """main(argv) with its exit status: 0, or 2 after a UserError (one line on stderr, rank 0),
    or a Stopped's code after its message. The process group is destroyed either way."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts in C++ (gloo, NCCL) still prints Python stacks
    # before huggingface_hub is first imported: it reads this once, at import
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        main(sys.argv[1:] if argv is None else argv)
        return 0
    except UserError as e:
        message = str(e) if str(e).startswith(("error", "config error")) else f"error: {e}"
        if not _torchrun_error_file(message) and rank() == 0:
            print(message, file=sys.stderr, flush=True)
        return 2
    except Stopped as e:
        if rank() == 0:
            print(e, file=sys.stderr if e.code == 1 else sys.stdout, flush=True)
        return e.code
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _torchrun_error_file(message: str) -> bool:
    """Under torchrun, hand the error to torchrun instead of printing it: its failure summary ends
    with the root cause's error file, so the message shows once and last rather than above 40 lines
    of summary. Rank 0 reports; another rank only when rank 0 did not fail (torchrun stops the
    others as soon as one fails, so they wait a moment first)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    if rank() != 0:
        time.sleep(ERROR_FILE_WAIT_S)
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
        return True
    except OSError:
        return False


def exit_now(code: int) -> None:
    """Exit with `code`, skipping the interpreter's teardown. Everything is written, fsynced or
    closed by then; the teardown garbage-collects what still references the process groups (FSDP
    state, device mesh) after their backends were shut down, and about 1 in 60 finished 2-rank
    gloo runs aborted there ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
