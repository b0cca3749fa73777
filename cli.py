"""The command line: flags and a --config TOML in, one-line errors and exit codes out."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A mistake in the user's input (a flag, a file, a value): one line on stderr and exit code 2,
    no traceback. Tracebacks are kept for real bugs."""


def why(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line, for a UserError: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__


class Stopped(Exception):
    """The run stopped early on purpose (a signal, too many bad steps): its message is printed
    (rank 0) and the process exits with `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def _torchrun_error_file(message: str) -> bool:
    """Under torchrun, hand the error to torchrun instead of printing it: its failure summary
    (printed after every worker exits) ends with the root cause's error file, so the message
    shows once and last rather than above 40 lines of summary. Every rank finds the same config
    error; rank 0 reports it, and another rank only when rank 0 did not fail (torchrun stops the
    others as soon as one fails, so they wait a moment first)."""
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    if rank() != 0:
        time.sleep(3.0)
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


def run(main, argv: list[str] | None) -> int:
    """main(argv) with its exit status: 0, or 2 after a UserError (one line on stderr, rank 0),
    or a Stopped's code after its message. The process group is destroyed either way."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank that aborts in C++ (gloo, NCCL) still prints Python stacks
    # before huggingface_hub is first imported: it reads this once, at import
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        main(argv)
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


def rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def parse_flags(cls: type[T], argv: list[str]) -> T:
    """Flags and a --config TOML -> a `cls` dataclass. The TOML's values go through the same
    parser as flags, so a wrong type or an unknown key is the same one-line error there."""
    flowing_help()
    defaults = cls()
    if "--config" in argv:  # a TOML file supplies defaults, the command line overrides them
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else ""
        defaults = _tyro_cli(cls, _toml_as_flags(cls, path), defaults, f"--config {path}: ")
    return _tyro_cli(cls, argv, defaults, "")


def _toml_as_flags(cls: type, path: str) -> list[str]:
    import tomllib

    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"--config {path}: {e}") from None
    fields, flags = cls.__dataclass_fields__, []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in fields or name == "config":
            raise UserError(f"--config {path}: unknown key {key!r} (keys are the flags of --help)")
        flag = "--" + name.replace("_", "-")
        if fields[name].type in ("bool", bool):
            if not isinstance(value, bool):
                raise UserError(f"--config {path}: {key} = {value!r} must be true or false")
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, *map(str, value if isinstance(value, list) else [value])]
    return flags


def _tyro_cli(cls: type[T], args: list[str], defaults: T, prefix: str) -> T:
    """tyro.cli, with its boxed error message turned into one line (--help still prints)."""
    import tyro

    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(cls, args=args, default=defaults)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        # tyro prints a rich box, or plain text between rules: keep the text, drop the title
        lines = [line.strip().strip("│╭╮╰╯").strip() for line in captured.getvalue().splitlines()]
        parts = [line for line in lines if line and not set(line) <= set("─-")][1:]
        end = next((k for k, line in enumerate(parts)
                    if line.startswith(("For full", "Argument", "Perhaps"))), None)
        hint = None
        if end is not None and parts[end].startswith("Perhaps"):
            hint = next((p.split()[0] for p in parts[end + 1:] if p.startswith("--")), None)
        message = " ".join(parts[:end]) or "cannot parse the command line"
        raise UserError(prefix + message + (f" (did you mean {hint}?)" if hint else "")) from None


def flowing_help() -> None:
    """tyro keeps the line breaks of a field docstring whose continuation lines are indented (it
    expects dedented text): clean each docstring first, so --help shows one flowing paragraph."""
    import tyro

    strings = getattr(tyro, "_strings", None)
    join = getattr(strings, "remove_single_line_breaks", None)
    if join is not None and not getattr(join, "flowing", False):
        strings.remove_single_line_breaks = lambda text: join(inspect.cleandoc(text))
        strings.remove_single_line_breaks.flowing = True
