"""Ablation runner: the four loss-aggregation modes x seeds on the default task, then a plot and a
table.

    python bench/ablation.py                                   # 4 modes x 3 seeds, default run
    length
    python bench/ablation.py --seeds 0 --out bench/results/modes_seed0   # the README's learning
    curve
    python bench/ablation.py --plot-only --out bench/results/ablation   # re-plot existing runs

Each run is the real CLI (`python nanoareal.py --loss-aggregation MODE --seed S --run-dir
OUT/MODE-sS`), so the numbers are what a user gets. Runs go `--parallel` at a time (1 torch
thread each). Writes OUT/ablation.png (held-out greedy accuracy vs step: mean over seeds, shaded
min-max) and OUT/ablation.md (final accuracy, steps to +25 points over the step-0 accuracy, wall
time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")


def run_dir(out: Path, mode: str, seed: int) -> Path:
    return out / f"{mode}-s{seed}"


def launch(out: Path, mode: str, seed: int, extra: list[str]) -> subprocess.Popen:
    d = run_dir(out, mode, seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").unlink(missing_ok=True)
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--loss-aggregation", mode, "--seed",
           str(seed),
           "--run-dir", str(d), "--resume", "none", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(d / "stdout.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    p.started = time.time()  # type: ignore[attr-defined]
    p.key = (mode, seed)  # type: ignore[attr-defined]
    return p


def run_all(out: Path, modes: list[str], seeds: list[int], parallel: int, extra: list[str]) -> dict:
    pending = [(m, s) for s in seeds for m in modes]
    running: list[subprocess.Popen] = []
    walls: dict[tuple[str, int], float] = {}
    while pending or running:
        while pending and len(running) < parallel:
            running.append(launch(out, *pending.pop(0), extra))
        time.sleep(1)
        for p in list(running):
            if p.poll() is not None:
                running.remove(p)
                walls[p.key] = time.time() - p.started
                status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode}, see log)"
                print(f"{p.key[0]:12s} seed {p.key[1]}: {walls[p.key]:6.1f} s {status}", flush=True)
    path = out / "walls.json"  # merged, so seeds can be (re)run separately
    known = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(known | {f"{m}-s{s}": w for (m, s), w in walls.items()}))
    return walls


def eval_curve(path: Path) -> tuple[list[int], list[float]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pts = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def summarize(out: Path, modes: list[str], seeds: list[int]) -> str:
    walls = json.loads((out / "walls.json").read_text()) if (out / "walls.json").exists() else {}
    lines = ["| mode | final held-out acc (mean ± std) | gain over step 0 | steps to +25 points | "
             "wall time (s) |",
             "|---|---|---|---|---|"]
    for mode in modes:
        finals, gains, reach, wall = [], [], [], []
        for seed in seeds:
            steps, acc = eval_curve(run_dir(out, mode, seed) / "metrics.jsonl")
            finals.append(acc[-1])
            gains.append(acc[-1] - acc[0])
            hit = [s for s, a in zip(steps, acc) if a >= acc[0] + 0.25]
            reach.append(str(hit[0]) if hit else "—")
            wall.append(walls.get(f"{mode}-s{seed}", float("nan")))
        mean = sum(finals) / len(finals)
        std = (sum((f - mean) ** 2 for f in finals) / max(len(finals) - 1, 1)) ** 0.5
        lines.append(f"| `{mode}` | {mean:.3f} ± {std:.3f} | {sum(gains) / len(gains):+.3f} | "
                     f"{', '.join(reach)} | "
                     f"{', '.join(f'{w:.0f}' for w in wall)} |")
    return "\n".join(lines)


def plot(out: Path, modes: list[str], seeds: list[int]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for mode in modes:
        curves = [eval_curve(run_dir(out, mode, s) / "metrics.jsonl") for s in seeds]
        steps = curves[0][0]
        n = min(len(c[1]) for c in curves)
        accs = [c[1][:n] for c in curves]
        mean = [sum(a[i] for a in accs) / len(accs) for i in range(n)]
        (line,) = ax.plot(steps[:n], mean, marker="o", ms=3, label=mode)
        if len(seeds) > 1:
            lo = [min(a[i] for a in accs) for i in range(n)]
            hi = [max(a[i] for a in accs) for i in range(n)]
            ax.fill_between(steps[:n], lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out greedy accuracy")
    seeds_txt = f"mean and min-max over seeds {seeds}" if len(seeds) > 1 else f"seed {seeds[0]}"
    ax.set_title(f"nanoareal on the built-in a+b task ({seeds_txt})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "ablation.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ablation")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--plot-only", action="store_true")
    args, extra = p.parse_known_args()  # anything else goes to nanoareal.py, e.g. --steps 4
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        run_all(args.out, args.modes, args.seeds, args.parallel, extra)
    table = summarize(args.out, args.modes, args.seeds)
    (args.out / "ablation.md").write_text(table + "\n")
    print(table)
    print(f"plot: {plot(args.out, args.modes, args.seeds)}")


if __name__ == "__main__":
    main()
