"""What the user sees: the console, metrics.jsonl and wandb, written by rank 0 only."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cli import UserError, rank


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


