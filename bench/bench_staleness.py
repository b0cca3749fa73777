"""End-to-end step time of the default task with rollouts one step ahead (--max-staleness 1)
against the synchronous loop (K = 0), and against TRL's GRPOTrainer given the same two cores.

    python bench/bench_staleness.py                 # 2 rounds of 12 steps per K, ~3 min
    python bench/bench_staleness.py --steps 2 --warmup 1 --rounds 1 --prompts-per-step 8  # smoke

nanoareal runs as the real CLI, one process per K and round, OMP_NUM_THREADS=1: with K = 1 the hf
engine generates (and scores) the next batch in a forked rollout process while the trainer
trains, so the two cores each run one torch thread. The runs alternate K = 0, 1, 1, 0, ... (a
machine that drifts slower or faster favours neither) and the steps of all rounds are pooled.
TRL runs alone in every round too, with 1 torch thread and with 2 (the same cores, used its way;
on small machines 2 threads can be slower), and its faster setting counts. Times are the median
of time/step in metrics.jsonl (nanoareal) and of the interval between TRL's optimizer steps; both
exclude start-up, evaluation and checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nanoareal_steps(k: int, args) -> list[dict]:
    """The measured steps' time/* of one run with --max-staleness k."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_staleness_k{k}_"))
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--steps", str(args.warmup + args.steps),
           "--max-staleness", str(k), "--eval-every", "0", "--prompts-per-step",
           str(args.prompts_per_step), "--run-dir", str(run_dir)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise SystemExit(f"nanoareal K={k} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r][args.warmup:]


def medians(rows: list[dict]) -> dict[str, float]:
    return {key: statistics.median(r[f"time/{key}"] for r in rows)
            for key in ("step", "rollout", "train", "sync")}


def trl_step_times(args, threads: int) -> list[float]:
    """TRL's GRPOTrainer on the same task and model (bench_vs_trl's set-up), alone."""
    import torch
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_vs_trl import build_trl
    from common import NanoRun, make_config

    nano = NanoRun(make_config(prompts_per_step=args.prompts_per_step, warmup_steps=0,
                               eval_every=0))
    trainer = build_trl(argparse.Namespace(trl_micro_batch=64), nano, args.warmup + args.steps)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **kw):
            times.append(time.perf_counter() - self.t)

    trainer.add_callback(Clock())
    torch.set_num_threads(threads)
    trainer.train()
    return times[args.warmup:]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs per K, alternating")
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--skip-trl", action="store_true")
    args = p.parse_args()
    runs: dict[int, list[list[dict]]] = {0: [], 1: []}
    trl_runs: dict[int, list[float]] = {} if args.skip_trl else {1: [], 2: []}
    for r in range(args.rounds):  # nanoareal's runs and TRL's in every round: drift hits both
        for k in (0, 1) if r % 2 == 0 else (1, 0):
            runs[k].append(nanoareal_steps(k, args))
        for n in sorted(trl_runs, reverse=r % 2 == 1):
            trl_runs[n] += trl_step_times(args, n)
    k0, k1 = (medians(sum(runs[k], [])) for k in (0, 1))
    by_round = [medians(b)["step"] / medians(a)["step"] for a, b in zip(runs[0], runs[1])]
    trl = {n: statistics.median(t) for n, t in trl_runs.items()}
    print(f"\n## Rollouts one step ahead: {args.prompts_per_step} prompts x 8 samples, default "
          f"task, 2 cores, median of {args.rounds} x {args.steps} steps per K (each run after "
          f"{args.warmup} warm-up)\n")
    print("| | step (s) | rollout left on the step's path (s) | train (s) | sync (s) | vs K=0 |")
    print("|---|---|---|---|---|---|")
    for name, t in (("nanoareal K=0 (1 thread)", k0),
                    ("nanoareal K=1 (1 thread + a 1-thread rollout process)", k1)):
        print(f"| {name} | {t['step']:.3f} | {t['rollout']:.3f} | {t['train']:.3f} | "
              f"{t['sync']:.3f} | {t['step'] / k0['step']:.2f}x |")
    for n, t in trl.items():
        print(f"| TRL {__import__('trl').__version__} GRPOTrainer ({n} thread{'s' * (n > 1)}) | "
              f"{t:.3f} | | | | {t / k0['step']:.2f}x |")
    print(f"\nK=1 vs K=0: {k1['step'] / k0['step']:.2f}x the step time (target <= 0.8x; by round "
          f"{', '.join(f'{x:.2f}x' for x in by_round)})" + (
        f"; nanoareal K=1 vs TRL's faster run: {min(trl.values()) / k1['step']:.2f}x faster end "
        "to end (target >= 3x)" if trl else ""))


if __name__ == "__main__":
    main()
