"""What the user sees: the console, metrics.jsonl, samples.jsonl and wandb, written by rank 0."""

import itertools
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from cli import rank

SAMPLE_GROUPS = 2  # prompt groups written to samples.jsonl per sampled step
SAMPLED_STEPS = 100  # about this many steps of a run write samples, evenly spread
# metric -> (numerator, denominator) of the step's summed counters (every rank, each sample once)
MEANS = {
    "reward": ("reward", "samples"),
    "accuracy": ("correct", "judged"),
    "response_len/correct": ("len_correct", "correct"),
    "response_len/incorrect": ("len_incorrect", "incorrect"),
    "response_len": ("response_tokens", "samples"),
    "truncated_frac": ("truncated", "samples"),
    "zero_adv_frac": ("zero_adv", "samples"),
    "entropy": ("entropy", "denom_tokens"),
    "logprob_mismatch": ("mismatch", "loss_tokens"),
    "policy_version": ("version", "samples"),
    "importance_weight/mean": ("importance_weight", "denom_tokens"),
    "mismatch/k3": ("mismatch_k3", "loss_tokens"),
    "mismatch/log_ppl_gap": ("log_ppl_gap", "responses"),
    "mismatch/rejected_token_frac": ("rejected", "loss_tokens"),
    "mismatch/rejected_seq_frac": ("rejected_responses", "responses"),
    "resample/resampled_frac": ("resampled", "samples"),
}
# counters reduced by max over ranks, not summed (the step's extremes)
MAXIMA = {"importance_weight_max", "gen_s", "seq_log_ratio_max", "seq_log_ratio_min_max"}


def print0(text: str) -> None:
    if rank() == 0:
        print(text, flush=True)


class Logger:
    """JSON lines appended; a progress bar only on a terminal, so a log file gets clean lines."""

    def __init__(self, cfg, start_step: int):
        """The run's config (its run_dir, steps, wandb_project); the step it starts at."""
        self.run_dir, self.total, self.active = Path(cfg.run_dir), cfg.steps, rank() == 0
        self.wandb = self.bar = None
        if not self.active:  # rank 0: nanoareal.resume wrote its config.json in run_dir
            return
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project, name=self.run_dir.name, config=vars(cfg)
            )
        if sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, initial=start_step, dynamic_ncols=True, leave=False
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.active:
            return
        self._append("metrics.jsonl", [{"step": step} | metrics])
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.line(format_line(step, self.total, metrics))
        if self.bar is not None and step > 0:
            self.bar.update(1)

    def log_samples(self, step: int, samples: list, tokenizer) -> None:
        """Every total/SAMPLED_STEPS steps: a few groups of the step's samples (sample_rows) to
        samples.jsonl and, as a table, to wandb."""
        if not self.active or not samples or step % max(1, self.total // SAMPLED_STEPS):
            return
        rows = sample_rows(samples, tokenizer)
        self._append("samples.jsonl", [{"step": step} | r for r in rows])
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self.wandb.log({"samples": table}, step=step)

    def _append(self, name: str, lines: list[dict]) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write("".join(json.dumps(line) + "\n" for line in lines))

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print0(text)

    def close(self, last_eval: dict | None = None) -> None:
        if last_eval:
            self.line(
                "final held-out " + "  ".join(f"{k} {v:.3f}" for k, v in last_eval.items())
            )
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def reduce_metrics(sums: dict) -> dict:
    """All ranks' counters (keys may differ) summed in ONE collective (MAXIMA: max; str: first)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    return merge(gathered)


def merge(parts: list[dict]) -> dict:
    """Counters summed key by key (MAXIMA: max; str: the first)."""
    total = {}
    for part in parts:
        for k, v in part.items():
            if isinstance(v, str):
                total.setdefault(k, v)
            elif k in MAXIMA:
                total[k] = max(total.get(k, v), v)
            else:
                total[k] = total.get(k, 0.0) + float(v)
    return total


def step_metrics(sums: dict, stats: dict, times: dict, lr: float, step: int) -> dict:
    """The step's metrics.jsonl line: MEANS of the summed counters, training stats, phase times."""
    sums = Counter(sums)  # a counter no rank reported reads 0
    metrics = {name: sums[n] / sums[d] for name, (n, d) in MEANS.items() if sums[d] > 0}
    metrics["staleness"] = step - 1 - metrics.get("policy_version", step - 1)
    metrics |= {
        "importance_weight/max": sums["importance_weight_max"],
        "zero_var_groups": sums["zero_var_groups"],
        "reward_errors": sums["reward_errors"],
        "lr": lr,
    }
    # StepMetrics starts them at -inf: a step without responses has none
    extremes = {
        "mismatch/seq_ratio_max": sums["seq_log_ratio_max"],
        "mismatch/seq_ratio_min": -sums["seq_log_ratio_min_max"],
    }
    metrics |= {k: math.exp(v) for k, v in extremes.items() if math.isfinite(v)}
    # with those of groups resampled away
    generated = sums["response_tokens"] + sums["discarded_tokens"]
    metrics["generated_tokens"] = generated
    metrics["gen_tokens_per_s"] = generated / max(sums["gen_s"], 1e-9)
    metrics["train_tokens_per_s"] = sums["trained_tokens"] / max(times["train"], 1e-9)
    metrics["train_positions"] = sums["positions"]
    # a loss term's value under loss/, "loss" itself as loss/total
    for k, v in stats.items():
        if k == "loss":
            k = "loss/total"
        elif "/" not in k and k not in ("grad_norm", "skipped_steps"):
            k = f"loss/{k}"
        metrics[k] = v
    # x with an "x#n" partner: a mean over its reporters (a new metric adds {x: v, "x#n": 1})
    metrics |= {k: sums[k] / max(sums[k + "#n"], 1) for k in sums if k + "#n" in sums}
    return metrics | {f"time/{k}": v for k, v in times.items()}


def sample_rows(samples: list, tokenizer) -> list[dict]:
    """The first SAMPLE_GROUPS groups of a step's samples, readable: for samples.jsonl and wandb."""
    groups = sorted({s.group for s in samples})[:SAMPLE_GROUPS]
    rows = []
    for s in (s for s in samples if s.group in groups):
        c = s.completion
        row = {
            "group": s.group,
            "prompt": tokenizer.decode(s.prompt_ids),
            "completion": tokenizer.decode(c.output_ids),
            "reward": s.reward,
            "advantage": s.advantage,
            "correct": s.correct,
            "finish_reason": c.finish_reason,
            "length": len(c.output_ids),
            "version": s.version,
        }
        if c.policy_mask is not None:  # an episode's turns: [who, text]
            runs = itertools.groupby(zip(c.output_ids, c.policy_mask), lambda x: x[1])
            row["turns"] = [
                ["policy" if who else "env", tokenizer.decode([t for t, _ in run])]
                for who, run in runs
            ]
        rows.append(row)
    return rows


def format_line(step: int, total: int, m: dict[str, float]) -> str:
    """The console line of a step, at most 120 columns; metrics.jsonl has everything else."""
    evals = "  ".join(
        f"{'eval' if k == 'eval/accuracy' else k[5:]} {v:.3f}"
        for k, v in m.items()
        if k.startswith("eval/")
    )
    if "reward" not in m:  # the step-0 (or evaluate-only) line: held-out metrics only
        return f"step {step}/{total}  {evals}"
    parts = [f"step {step}/{total}", f"reward {m['reward']:.3f}"]
    if "accuracy" in m:
        parts.append(f"acc {m['accuracy']:.3f}")
    parts += [
        f"len {m.get('response_len', 0.0):.1f}",
        f"loss {m.get('loss/total', 0.0):+.4f}",
        f"clip {m.get('policy/clip_frac', 0.0):.3f}",
        f"gnorm {m['grad_norm']:.3g}",
        f"{m['time/step']:.2f}s/step",
    ]
    if evals:
        parts.append(evals)
    line = "  ".join(parts)
    return line if len(line) <= 120 else line[:117] + "..."


def quiet_libraries() -> None:
    """No progress bars or chatter from transformers and the hub: a user error stays one line."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
