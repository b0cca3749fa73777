"""What the user sees: the command line in (flags and --config TOML, a mistake is one line), the
console and metrics.jsonl (+ wandb) out, rank 0 only."""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@dataclass
class LogConfig:
    """The logging flags. The trainer's Config inherits them: they are --flags like the rest."""

    # logging
    log_every: int = 1
    """Print a console line every N steps (metrics.jsonl gets every step)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (WANDB_MODE=offline works without a network)."""
    wandb_run_name: str | None = None
    """Weights & Biases run name (default: wandb's own)."""


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


def print0(*args, **kwargs) -> None:
    if rank() == 0:
        print(*args, **kwargs, flush=True)


class Logger:
    """metrics.jsonl (one JSON line per step, appended and flushed), wandb when a project is given,
    and the console: a progress bar only when stdout is a terminal, so a log file gets clean
    lines. Rank 0 only."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int, log_every: int = 1,
                 wandb_project: str | None = None, wandb_run_name: str | None = None,
                 config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.total, self.log_every = total_steps, log_every
        self.active = rank() == 0
        self.wandb = self.bar = None
        if not self.active:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=wandb_run_name, config=config)
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, leave=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics: a metrics.jsonl line, wandb, and a console line every log_every steps
        (and for the step-0 eval)."""
        if not self.active:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step} | metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if step == 0:
            self.line(f"step 0/{self.total}  eval {metrics.get('eval/accuracy', 0.0):.3f}")
            return
        if step % self.log_every == 0:
            self.line(format_line(step, self.total, metrics))
        if self.bar is not None:
            self.bar.update(1)

    def line(self, text: str) -> None:
        """A console line (above the progress bar when there is one)."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone (decisions about shared files), its result on every rank; a
    UserError it raises is raised on every rank, so all stop together."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn(*args))]
        except UserError as e:
            box = [("error", str(e))]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise UserError(value)
    return value


def reduce_sums(local: dict) -> dict:
    """Every rank's metric sums added up in ONE collective (ranks may hold different keys: a
    reward's own metrics); a string value (an error message) keeps the first one seen."""
    import torch.distributed as dist

    gathered = [local]
    if dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
    out: dict = {}
    for part in gathered:
        for k, v in part.items():
            out[k] = out.get(k, v) if isinstance(v, str) else out.get(k, 0.0) + float(v)
    return out


def step_metrics(m: dict, train_stats: dict, times: tuple, lr: float) -> dict:
    """The step's metrics.jsonl line from the summed metrics, the training stats and (t0, t1, t2,
    t3): step start, rollout done, training done, weights synced."""
    t0, t1, t2, t3 = times
    n = max(m.get("n_samples", 0), 1)
    metrics = {"reward": m.get("reward_sum", 0.0) / n}
    if m.get("judged", 0) > 0:
        metrics["accuracy"] = m["correct_sum"] / m["judged"]
    for kind in ("correct", "incorrect"):  # mean response length of correct / incorrect samples
        if m.get(f"len_{kind}_n", 0) > 0:
            metrics[f"response_len/{kind}"] = m[f"len_{kind}_sum"] / m[f"len_{kind}_n"]
    tokens = max(m.get("denom_tokens", 0.0), 1)
    metrics |= {
        "response_len": m.get("response_len_sum", 0) / n,
        "truncated_frac": m.get("truncated_sum", 0) / n,
        "zero_adv_frac": m.get("zero_adv_sum", 0) / n,
        "zero_var_groups": m.get("zero_var_groups", 0),
        "entropy": m.get("entropy_sum", 0.0) / tokens,
        "logprob_mismatch": m.get("mismatch_sum", 0.0) / tokens,
        "grad_norm": train_stats["grad_norm"], "skipped_steps": train_stats["skipped_steps"],
        "reward_errors": m.get("reward_errors", 0), "lr": lr,
        "tokens_per_s": (m.get("response_len_sum", 0) + m.get("trained_tokens", 0))
        / max(t3 - t0, 1e-9),
        "train_positions": m.get("positions", 0),
        "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
    }
    # loss terms by name, "loss" = their weighted total, "x/y" stats
    for k, v in train_stats.items():
        if k not in ("grad_norm", "skipped_steps"):
            metrics["loss/total" if k == "loss" else k if "/" in k else f"loss/{k}"] = v
    for k in m:  # the reward's own metrics
        if k.startswith("reward/") and k.endswith("_sum"):
            metrics[k.removesuffix("_sum")] = m[k] / max(m[k.removesuffix("_sum") + "_n"], 1)
    return metrics


def format_line(step: int, total: int, m: dict[str, float]) -> str:
    """The console line of a step, at most 120 columns; metrics.jsonl has everything else."""
    parts = [f"step {step}/{total}", f"reward {m['reward']:.3f}"]
    if "accuracy" in m:
        parts.append(f"acc {m['accuracy']:.3f}")
    parts += [f"len {m['response_len']:.1f}",
              f"loss {m.get('loss/total', m.get('loss/policy', 0.0)):+.4f}",
              f"clip {m.get('policy/clip_frac', 0.0):.3f}", f"gnorm {m['grad_norm']:.3g}",
              f"{m['time/step']:.2f}s/step"]
    if "eval/accuracy" in m:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    line = "  ".join(parts)
    return line if len(line) <= 120 else line[:117] + "..."


def quiet_libraries() -> None:
    """No progress bars or info chatter from transformers and the hub: a log file gets our lines
    only, and a user error stays one line."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------- the command line
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
