"""The command line: flags and a --config TOML in, one-line errors and exit codes out."""

import difflib
import faulthandler
import json
import os
import sys
import time
import tomllib
import typing

import torch.distributed as dist

T = typing.TypeVar("T")
# under torchrun, a non-zero rank waits this long for rank 0 to report
ERROR_FILE_WAIT_S = 3.0


class UserError(Exception):
    """A mistake in the user's input: one line on stderr, exit code 2, no traceback."""


class Stopped(Exception):
    """The run stopped early on purpose (a signal, bad steps): its message, then exit `code`."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def why(e: BaseException) -> str:
    """An exception as one short line, for a UserError: its type and its message's first line
    (200 characters at most)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def parse(cls: type[T], argv: list[str], preset) -> T:
    """Flags -> a `cls` dataclass (tyro: each field's docstring is its --help). Later layers win:
    the dataclass's defaults, `preset(dataset)` (a built-in task's flags), --config's, argv."""
    import tyro

    args = argv
    if "--config" in argv:
        path = [*argv, ""][argv.index("--config") + 1]
        try:
            with open(path, "rb") as f:
                args = as_flags(cls, tomllib.load(f), f"--config {path}") + args
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise UserError(f"--config {path}: {e}") from None
    check_flags(cls, args)
    dataset = cls.dataset
    for i, arg in enumerate(args):  # the last --dataset (check_flags gave it one value)
        flag, _, value = arg.partition("=")
        if flag == "--dataset":
            dataset = value or args[i + 1]
    return tyro.cli(cls, args=as_flags(cls, preset(dataset), "a built-in task") + args)


def as_flags(cls: type, values: dict, where: str) -> list[str]:
    """{"top_k": 5, "mask_truncated": True} -> ["--top-k", "5", "--mask-truncated"]."""
    hints, flags = typing.get_type_hints(cls), []
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in hints or name == "config":
            raise UserError(f"{where}: unknown key {key!r} (keys are the flags of --help)")
        flag = name.replace("_", "-")
        if _base(hints[name]) is not bool:
            flags += [f"--{flag}", *map(str, value if isinstance(value, list) else [value])]
        elif isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            raise UserError(f"{where}: {key} = {value!r} must be true or false")
    return flags


def _base(hint):  # a field's type without its "| None": bool, int, float, str, list, Literal
    args = typing.get_args(hint)
    return next(a for a in args if a is not type(None)) if type(None) in args else hint


def check_flags(cls: type, args: list[str]) -> None:
    """Refuse, in one line, what tyro would: it reports parse errors only as multi-line boxes."""
    known = {
        f"--{n.replace('_', '-')}": _base(t) for n, t in typing.get_type_hints(cls).items()
    }
    known |= {f"--no-{k[2:]}": bool for k, t in known.items() if t is bool}
    i = 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        i += 1
        # a flag's values run up to the next --flag (none after --flag=value)
        values = [inline] if inline else []
        while not inline and i < len(args) and not args[i].startswith("--"):
            values.append(args[i])
            i += 1
        if flag in ("-h", "--help"):
            return
        kind = known.get(flag)
        if kind is None:
            near = difflib.get_close_matches(flag, known, n=1)
            hint = f"did you mean {near[0]}?" if near else "see --help"
            raise UserError(f"unknown flag {flag} ({hint})")
        many = typing.get_origin(kind) is list
        count = "one or more values" if many else "one value"
        if kind is bool:
            count = "no value"
        if (kind is bool) != (not values) or (not many and len(values) > 1):
            got = f"{flag} takes {count}, got {len(values)}: {' '.join(values)}"
            raise UserError(got.rstrip(": "))
        choices = [str(c) for c in typing.get_args(kind)]
        if typing.get_origin(kind) is typing.Literal and values[0] not in choices:
            raise UserError(f"{flag} {values[0]}: choose one of {', '.join(choices)}")
        number = {int: "an int", float: "a number"}.get(kind)
        for value in values if number else []:
            try:
                kind(value)
            except ValueError:
                raise UserError(f"{flag} {value}: not {number}") from None


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def on_rank0(fn, *args, share: bool = True):
    """fn(*args) on rank 0 alone (shared files, a whole model on the host); its UserError raised
    on every rank; its result on every rank, or with share=False on rank 0 alone (None
    elsewhere: a model is not sent)."""
    out = None
    if rank() == 0:
        try:
            out = fn(*args)
        except UserError as e:  # sent as it is (it pickles)
            out = e
    box = [out if share or isinstance(out, UserError) else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise box[0]
    return out if rank() == 0 else box[0]


def run(main, argv: list[str] | None) -> int:
    """main(argv) -> the exit status: 0; 2 after a UserError (one line); a Stopped's own code."""
    faulthandler.enable()  # a rank that aborts in C++ (gloo, NCCL) still prints Python stacks
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read once, at hub import
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
    """Hand the error to torchrun, whose summary shows the root cause's error file once, last."""
    if not (path := os.environ.get("TORCHELASTIC_ERROR_FILE")):
        return False
    # rank 0 first: torchrun stops the rest
    time.sleep(0 if rank() == 0 else ERROR_FILE_WAIT_S)
    info = {"py_callstack": message, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": info}}, f)
        return True
    except OSError:
        return False


def exit_now(code: int) -> None:
    """Exit now: the teardown's GC of FSDP state after the groups' shutdown aborted 1 in 60 runs."""
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
