"""Ablation runner: loss-aggregation variants x seeds on a built-in task, then plots and a table.

    python bench/ablation.py                              # arithmetic: 4 modes x 3 seeds, ~5 min
    python bench/ablation.py --seeds 0 --out bench/results/modes_seed0    # one seed
    python bench/ablation.py --dataset chain              # 6 variants x 3 seeds, ~22 min
    python bench/ablation.py --dataset chain --plot-only  # re-plot existing runs

A variant is a --loss-aggregation mode, optionally with `:no-std` (--no-adv-std: advantages not
divided by the group's reward std, Dr. GRPO's other change); by default the four modes, and for
chain also seq_mean:no-std and constant:no-std (TASK_VARIANTS). Each run is the real CLI (`python
nanoareal.py --dataset D --loss-aggregation MODE [--no-adv-std] --seed S --run-dir
OUT/VARIANT-sS` plus the task's recommended flags, TASK_FLAGS, and any flag this script does not
know, which goes to nanoareal.py and overrides them), so the numbers are what a user gets. Runs go
`--parallel` at a time (1 torch thread each). Output in --out (default bench/results/ablation for
arithmetic, bench/results/ablation_<task> otherwise):
- ablation.png: held-out greedy accuracy vs step per variant (mean over seeds, shaded min-max);
- lengths.png: mean response length of correct and of incorrect samples per training step (and
  the reward's scratchpad share, when it reports one, and the share of responses cut at
  --max-new-tokens, when there are any) for the plain modes, mean over seeds;
- lengths_no_std.png: the same for seq_mean vs constant with and without the std division;
- ablation.md: final accuracy, gain, steps to +25 points, lengths early and late, the share of
  truncated responses, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
TASK_FLAGS = {  # the recommended run of each built-in task; flags given to this script win
    "arithmetic": [],
    # responses up to 18 tokens + <eos>; 32 prompts x 8 samples keep a run near 2 minutes
    "chain": ["--model", "assets/tiny-chain", "--max-new-tokens", "32",
              "--prompts-per-step", "32"],
}
TASK_VARIANTS = {  # default --variants: chain's lengths vary, so Dr. GRPO's pair is worth a run
    "arithmetic": list(MODES),
    "chain": [*MODES, "seq_mean:no-std", "constant:no-std"],
}
WINDOW = 10  # steps averaged for the table's "early" (first) and "late" (last) lengths


def variant_flags(variant: str) -> list[str]:
    """"seq_mean:no-std" -> ["--loss-aggregation", "seq_mean", "--no-adv-std"]."""
    mode, _, option = variant.partition(":")
    return ["--loss-aggregation", mode] + (["--no-adv-std"] if option == "no-std" else [])


def check_variant(variant: str) -> str:
    mode, _, option = variant.partition(":")
    if mode not in MODES or option not in ("", "no-std"):
        raise argparse.ArgumentTypeError(f"{variant!r}: expected MODE or MODE:no-std, MODE one "
                                         f"of {', '.join(MODES)}")
    return variant


def label(variant: str) -> str:
    return variant.replace(":no-std", " --no-adv-std")


def run_dir(out: Path, variant: str, seed: int) -> Path:
    return out / f"{variant.replace(':no-std', '-nostd')}-s{seed}"


def merge_flags(preset: list[str], extra: list[str]) -> list[str]:
    """The task's preset flags, minus those `extra` sets again, then `extra`."""
    given = {f.split("=")[0] for f in extra if f.startswith("--")}
    out, i = [], 0
    while i < len(preset):
        has_value = i + 1 < len(preset) and not preset[i + 1].startswith("--")
        if preset[i] not in given:
            out += preset[i : i + 1 + has_value]
        i += 1 + has_value
    return out + extra


def launch(out: Path, variant: str, seed: int, flags: list[str]) -> subprocess.Popen:
    d = run_dir(out, variant, seed)
    shutil.rmtree(d, ignore_errors=True)  # this bench's own output: a rerun replaces it
    d.mkdir(parents=True)
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), *variant_flags(variant), "--seed",
           str(seed), "--run-dir", str(d), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    log = open(d / "stdout.log", "w")
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    p.started = time.time()  # type: ignore[attr-defined]
    p.key = (variant, seed)  # type: ignore[attr-defined]
    return p


PROGRESS = re.compile(r"[^\r\n|]*\d+%\|[^|]*\|[^\]\r\n]*\]")  # tqdm bars, the trainer's and HF's


def trim_log(path: Path) -> None:
    """Drop progress bars from a run's stdout.log, keeping the logged lines and any error."""
    text = PROGRESS.sub("\n", path.read_text(errors="replace"))
    lines = [line.strip() for line in re.split(r"[\r\n]+", text)]
    path.write_text("\n".join(line for line in lines if line) + "\n")


def run_all(out: Path, variants: list[str], seeds: list[int], parallel: int,
            flags: list[str]) -> dict:
    pending = [(v, s) for s in seeds for v in variants]
    running: list[subprocess.Popen] = []
    walls: dict[tuple[str, int], float] = {}
    while pending or running:
        while pending and len(running) < parallel:
            running.append(launch(out, *pending.pop(0), flags))
        time.sleep(1)
        for p in list(running):
            if p.poll() is not None:
                running.remove(p)
                walls[p.key] = time.time() - p.started
                trim_log(run_dir(out, *p.key) / "stdout.log")
                for bulky in ("checkpoints", "final"):  # the plots need metrics.jsonl only
                    shutil.rmtree(run_dir(out, *p.key) / bulky, ignore_errors=True)
                status = "ok" if p.returncode == 0 else f"FAILED (exit {p.returncode}, see log)"
                print(f"{label(p.key[0]):24s} seed {p.key[1]}: {walls[p.key]:6.1f} s {status}",
                      flush=True)
    path = out / "walls.json"  # merged, so seeds can be (re)run separately
    known = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(known | {run_dir(out, v, s).name: w
                                        for (v, s), w in walls.items()}))
    return walls


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one metric, over the rows that log it."""
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_curve(path: Path) -> tuple[list[int], list[float]]:
    return curve(read_rows(path), "eval/accuracy")


def window_mean(rows: list[dict], key: str, first: int, last: int) -> float | None:
    """Mean of a per-step metric over steps first..last (None if no step logs it)."""
    vals = [r[key] for r in rows if key in r and first <= r["step"] <= last]
    return sum(vals) / len(vals) if vals else None


def mean_over(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{sum(known) / len(known):.1f}" if known else "—"


def summarize(out: Path, variants: list[str], seeds: list[int]) -> str:
    walls = json.loads((out / "walls.json").read_text()) if (out / "walls.json").exists() else {}
    lines = ["| variant | final held-out acc (mean ± std) | gain over step 0 | steps to +25 points "
             f"| len correct, steps 1-{WINDOW} → last {WINDOW} | len incorrect, steps "
             f"1-{WINDOW} → last {WINDOW} | truncated responses (% per seed) | wall time (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for variant in variants:
        finals, gains, reach, wall, cut = [], [], [], [], []
        lens: dict[str, list] = {"correct": [], "incorrect": []}
        for seed in seeds:
            rows = read_rows(run_dir(out, variant, seed) / "metrics.jsonl")
            steps, acc = curve(rows, "eval/accuracy")
            finals.append(acc[-1])
            gains.append(acc[-1] - acc[0])
            hit = [s for s, a in zip(steps, acc) if a >= acc[0] + 0.25]
            reach.append(str(hit[0]) if hit else "—")
            wall.append(walls.get(run_dir(out, variant, seed).name, float("nan")))
            last = max(r["step"] for r in rows)
            cut.append(100 * window_mean(rows, "truncated_frac", 1, last))  # equal-size steps
            for kind in lens:
                key = f"response_len/{kind}"
                lens[kind].append((window_mean(rows, key, 1, WINDOW),
                                   window_mean(rows, key, last - WINDOW + 1, last)))
        mean = sum(finals) / len(finals)
        std = (sum((f - mean) ** 2 for f in finals) / max(len(finals) - 1, 1)) ** 0.5
        cells = [f"{mean_over([e for e, _ in v])} → {mean_over([la for _, la in v])}"
                 for v in lens.values()]
        lines.append(f"| `{label(variant)}` | {mean:.3f} ± {std:.3f} | "
                     f"{sum(gains) / len(gains):+.3f} | {', '.join(reach)} | {cells[0]} | "
                     f"{cells[1]} | {', '.join(f'{c:.2f}' for c in cut)} | "
                     f"{', '.join(f'{w:.0f}' for w in wall)} |")
    return "\n".join(lines)


def style(variant: str) -> dict:
    """One colour per mode; its --no-adv-std variant dashed in the same colour."""
    colors = {m: f"C{i}" for i, m in enumerate(MODES)}
    return {"color": colors[variant.split(":")[0]], "ls": "--" if ":" in variant else "-"}


def plot(out: Path, variants: list[str], seeds: list[int], task: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for variant in variants:
        curves = [eval_curve(run_dir(out, variant, s) / "metrics.jsonl") for s in seeds]
        steps = curves[0][0]
        n = min(len(c[1]) for c in curves)
        accs = [c[1][:n] for c in curves]
        mean = [sum(a[i] for a in accs) / len(accs) for i in range(n)]
        st = style(variant)
        ax.plot(steps[:n], mean, marker="o", ms=3, label=label(variant), **st)
        if len(seeds) > 1:
            lo = [min(a[i] for a in accs) for i in range(n)]
            hi = [max(a[i] for a in accs) for i in range(n)]
            ax.fill_between(steps[:n], lo, hi, color=st["color"], alpha=0.12)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out greedy accuracy")
    seeds_txt = f"mean and min-max over seeds {seeds}" if len(seeds) > 1 else f"seed {seeds[0]}"
    name = "the built-in a+b task" if task == "arithmetic" else f"the {task} task"
    ax.set_title(f"nanoareal on {name} ({seeds_txt})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "ablation.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def smooth(values: list[float], width: int) -> list[float]:
    """Trailing moving average over `width` steps (fewer at the start)."""
    return [sum(values[max(0, i - width + 1) : i + 1]) / len(values[max(0, i - width + 1) : i + 1])
            for i in range(len(values))]


def plot_lengths(out: Path, variants: list[str], seeds: list[int], path: Path,
                 width: int = 5) -> Path | None:
    """Per training step, mean over seeds: response length of correct and of incorrect samples
    (tokens, <eos> included) and, when the reward reports it, the share of scratchpads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {v: [read_rows(run_dir(out, v, s) / "metrics.jsonl") for s in seeds] for v in variants}
    panels = [("response_len/correct", "length of correct responses", "tokens"),
              ("response_len/incorrect", "length of incorrect responses", "tokens"),
              ("reward/scratchpad", "scratchpad responses", "share of all responses"),
              ("truncated_frac", "responses cut at --max-new-tokens", "share of all responses")]
    panels = [p for p in panels if all(curve(rows, p[0])[0] for rs in runs.values()
                                       for rows in rs)
              and (p[0] != "truncated_frac" or any(any(curve(rows, p[0])[1])
                                                   for rs in runs.values() for rows in rs))]
    if not panels:
        return None  # runs from before the trainer logged these metrics
    ncols = 2 if len(panels) == 4 else len(panels)  # 4 panels: 2 x 2, readable in a README
    nrows = len(panels) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 3.6 * nrows + 0.4),
                             squeeze=False)
    axes = axes.ravel()
    for ax, (key, title, unit) in zip(axes, panels):
        for variant, rs in runs.items():
            per_step: dict[int, list[float]] = {}
            for rows in rs:
                for step, v in zip(*curve(rows, key)):
                    per_step.setdefault(step, []).append(v)
            steps = sorted(per_step)
            mean = [sum(per_step[s]) / len(per_step[s]) for s in steps]
            ax.plot(steps, smooth(mean, width), label=label(variant), **style(variant))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"training samples per step: mean over seeds {seeds}, trailing {width}-step "
                 "average", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="arithmetic", choices=sorted(TASK_FLAGS),
                   help="the built-in task to train on")
    p.add_argument("--model", help="model directory (default: the task's shipped warm start)")
    p.add_argument("--out", type=Path, help="results directory (default: "
                   "bench/results/ablation, or bench/results/ablation_<task>)")
    p.add_argument("--variants", "--modes", nargs="+", type=check_variant,
                   help="MODE or MODE:no-std (with --no-adv-std), MODE one of " + ", ".join(MODES)
                   + " (default: TASK_VARIANTS of the task)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--plot-only", action="store_true")
    args, extra = p.parse_known_args()  # anything else goes to nanoareal.py, e.g. --steps 4
    args.variants = args.variants or TASK_VARIANTS[args.dataset]
    default_out = "ablation" if args.dataset == "arithmetic" else f"ablation_{args.dataset}"
    out = args.out or ROOT / "bench" / "results" / default_out
    out.mkdir(parents=True, exist_ok=True)
    if args.model:
        extra = ["--model", args.model, *extra]
    flags = ["--dataset", args.dataset, *merge_flags(TASK_FLAGS[args.dataset], extra)]
    if not args.plot_only:
        print("nanoareal.py flags:", " ".join(flags), flush=True)
        run_all(out, args.variants, args.seeds, args.parallel, flags)
    table = summarize(out, args.variants, args.seeds)
    (out / "ablation.md").write_text(table + "\n")
    print(table)
    print(f"plot: {plot(out, args.variants, args.seeds, args.dataset)}")
    plain = [v for v in args.variants if ":" not in v]
    std_pairs = [v for v in ("seq_mean", "seq_mean:no-std", "constant", "constant:no-std")
                 if v in args.variants]
    for subset, name in ((plain, "lengths.png"), (std_pairs, "lengths_no_std.png")):
        if subset and (subset is plain or any(":" in v for v in subset)):
            path = plot_lengths(out, subset, args.seeds, out / name)
            if path:
                print(f"plot: {path}")


if __name__ == "__main__":
    main()
