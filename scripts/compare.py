"""Compare runs: held-out metrics, reward and response lengths vs step (each variant's seeds as a
mean line and a min-max band) and a markdown table of final metrics, mean ± std over seeds.

    python scripts/compare.py runs/ppo_vs_gspo                     # a study of scripts/ablate.py
    python scripts/compare.py runs/a-s0 runs/a-s1 runs/b-s0        # runs: a = a-s0 + a-s1, b
    python scripts/compare.py ppo=runs/x,runs/y gspo=runs/z --out runs/cmp   # named groups

An argument is a study directory (its runs, grouped by the variants of its study.json), a folder
of run directories, one run directory (grouped with the others of its name less a trailing
-s<seed>), or NAME=DIR,DIR,... Writes to --out (default: the one study directory given, else
./compare): eval.png (every eval/* metric), train.png (reward, response length, of correct and
of incorrect responses, share cut at --max-new-tokens, tool calls per episode with --env, the
reward's own reward/* shares; trailing means), offpolicy.png when rollouts were stale (the
log-prob gap, the importance weights' mean and max, the share a correction capped or masked),
eval_cost.png (eval/accuracy against what it cost: the run's summed `time/step`, its rollout,
teacher and training time with evals and saves left out, and its summed `generated_tokens`; the
mean over seeds of both axes at each eval) and compare.md, the table, also printed: final held-out
metrics, training metrics averaged over the last steps, steps reached, wall time per run (from
study.json) and, for each `--reach` threshold, the steps and summed `time/step` seconds to the
first eval at or above it (mean over seeds; "n/m" when only n of m seeds got there).

    python scripts/compare.py bench/results/distill --reach 0.6 0.8
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path
from typing import NoReturn

SEED = re.compile(r"-s\d+$")  # the seed suffix of ablate.py's run directories
WINDOW = 10  # last steps averaged for the table's training metrics
SMOOTH = 5  # trailing steps averaged in train.png: per-step training metrics are noisy
LEGEND_INSIDE = 6  # more variants than this: the legend beside the figure, not over a panel
TRAIN_KEYS = ("reward", "response_len", "response_len/correct", "response_len/incorrect",
              "truncated_frac", "env/tool_calls")  # each where some run logs it (--env: tools)
# plotted (offpolicy.png) and tabled when some run trains on stale rollouts (--max-staleness)
OFFPOLICY_KEYS = ("logprob_mismatch", "importance_weight/mean", "importance_weight/max",
                  "policy/behave_capped_frac")


def fail(message: str) -> NoReturn:
    print(f"compare: {message}", file=sys.stderr)
    sys.exit(2)


def collect(args: list[str]) -> dict[str, list[Path]]:
    """{variant: its run directories} from the command line's arguments."""
    groups: dict[str, list[Path]] = {}
    for arg in args:
        name, eq, dirs = arg.partition("=")
        d = Path(arg)
        if eq and not d.exists():
            groups.setdefault(name, []).extend(Path(x) for x in dirs.split(",") if x)
        elif (d / "study.json").is_file():
            study = json.loads((d / "study.json").read_text())
            for run, rec in study["runs"].items():
                if (d / run / "metrics.jsonl").is_file():  # a run not started yet has no curve
                    groups.setdefault(rec["variant"], []).append(d / run)
        elif (d / "metrics.jsonl").is_file():
            groups.setdefault(SEED.sub("", d.name), []).append(d)
        elif runs := sorted(p.parent for p in d.glob("*/metrics.jsonl")):
            for run in runs:
                groups.setdefault(SEED.sub("", run.name), []).append(run)
        else:
            fail(f"{arg}: no metrics.jsonl there (not a run, a folder of runs, a study, nor "
                 "NAME=DIR,DIR)")
    for run in (r for rs in groups.values() for r in rs):
        if not (run / "metrics.jsonl").is_file():
            fail(f"{run}: not a run directory (no metrics.jsonl)")
    return groups


def read_rows(run: Path) -> list[dict]:
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # an empty line, or one cut by a kill
            pass
    return rows


def series(rows: list[dict], key: str, smooth: int = 1) -> dict[int, float]:
    """{step: value} of one metric, a trailing mean over `smooth` logged steps."""
    pts = [(r["step"], r[key]) for r in rows if key in r]
    return {s: statistics.mean(v for _, v in pts[max(0, i - smooth + 1) : i + 1])
            for i, (s, _) in enumerate(pts)}


def wall(run: Path) -> float | None:
    study = run.parent / "study.json"
    rec = json.loads(study.read_text())["runs"].get(run.name, {}) if study.is_file() else {}
    return rec.get("wall_s")


def cumulative(rows: list[dict], key: str) -> dict[int, float]:
    """{step: the sum of `key` over the logged steps up to it} (0 at step 0)."""
    total, out = 0.0, {0: 0.0}
    for row in rows:
        total += row.get(key, 0.0) if row["step"] > 0 else 0.0
        out[row["step"]] = total
    return out


def reached(rows: list[dict], threshold: float) -> tuple[int, float] | None:
    """(step, summed time/step) of the first eval/accuracy at or above `threshold`, else None."""
    spent = cumulative(rows, "time/step")
    for row in rows:
        if row.get("eval/accuracy", -math.inf) >= threshold:
            return row["step"], spent[row["step"]]
    return None


def mean_of_reached(hits: list) -> str:
    got = [h for h in hits if h is not None]
    if not got:
        return "—"
    text = f"{statistics.mean(got):.0f}"
    return text if len(got) == len(hits) else f"{text} ({len(got)}/{len(hits)})"


def cell(values: list[float | None]) -> str:
    v = [x for x in values if x is not None]
    if not v:
        return "—"
    return f"{statistics.mean(v):.3f}" + (f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else "")


def table(groups: dict[str, list[Path]], runs: dict[str, list[list[dict]]], eval_keys: list[str],
          train_keys: list[str], reach: list[float]) -> str:
    head = ["variant", "runs", "steps", *[f"{k} (final)" for k in eval_keys],
            *[f"{k} (last {WINDOW} steps)" for k in train_keys], "wall time per run (s)",
            *[f"steps / s to {t:g}" for t in reach]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in runs.items():
        finals = [[list(series(r, k).values())[-1:] or [None] for r in rs] for k in eval_keys]
        lasts = [[statistics.mean(v[-WINDOW:]) if (v := list(series(r, k).values())) else None
                  for r in rs] for k in train_keys]
        steps = sorted({max(row["step"] for row in r) for r in rs})
        walls = [wall(run) for run in groups[name]]
        cells = [f"`{name}`", str(len(rs)), ", ".join(map(str, steps)),
                 *[cell([v[0] for v in f]) for f in finals], *[cell(v) for v in lasts],
                 ", ".join("—" if w is None else f"{w:.0f}" for w in walls)]
        for t in reach:
            hits = [reached(r, t) for r in rs]
            steps_to = mean_of_reached([h and h[0] for h in hits])
            seconds_to = mean_of_reached([h and h[1] for h in hits])
            cells.append(f"{steps_to} / {seconds_to}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[list[dict]]], keys: list[str], path: Path, title: str,
         smooth: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    width = 4.6 * ncols if ncols > 1 else 7.0
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 3.4 * nrows + 0.5), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for i, (name, rs) in enumerate(runs.items()):
            curves = [c for r in rs if (c := series(r, key, smooth))]
            if not curves:
                continue
            steps = sorted(set().union(*curves))
            at = [[c[s] for c in curves if s in c] for s in steps]  # runs may end at other steps
            style = {"color": color(i, len(runs)), "ls": ("-", "--", ":", "-.")[i // 20 % 4]}
            ax.plot(steps, [statistics.mean(v) for v in at], label=name, lw=1.4,
                    marker="o" if smooth == 1 else None, ms=3, **style)
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at],
                                color=style["color"], alpha=0.15, lw=0)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    if len(runs) <= LEGEND_INSIDE:
        axes.flat[0].legend(fontsize=8)
    else:  # many variants would hide the first panel's curves: the legend goes beside the figure
        fig.legend(*axes.flat[0].get_legend_handles_labels(), fontsize=8, loc="center left",
                   bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def color(i: int, n: int):
    """Ten colours, or twenty lighter-paired ones for more variants (none repeats under 21)."""
    import matplotlib

    return f"C{i % 10}" if n <= 10 else matplotlib.colormaps["tab20"](i % 20)


def plot_cost(runs: dict[str, list[list[dict]]], path: Path) -> None:
    """eval/accuracy against summed time/step and summed generated_tokens, each variant's mean
    over its seeds (of both axes) at each eval step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_keys = [("time/step", "summed time/step (s)"), ("generated_tokens", "generated tokens")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, label) in zip(axes, axes_keys):
        for i, (name, rs) in enumerate(runs.items()):
            evals = [series(r, "eval/accuracy") for r in rs]
            spent = [cumulative(r, key) for r in rs]
            steps = sorted(set.intersection(*(set(e) for e in evals)))
            xs = [statistics.mean(c.get(s, math.nan) for c in spent) for s in steps]
            ys = [statistics.mean(e[s] for e in evals) for s in steps]
            ax.plot(xs, ys, label=name, lw=1.4, marker="o", ms=3, color=color(i, len(runs)),
                    ls=("-", "--", ":", "-.")[i // 20 % 4])
        ax.set_xlabel(label)
        ax.set_ylabel("eval/accuracy")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("held-out accuracy against its cost: means over each variant's seeds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="study directories, run directories or NAME=DIR,DIR")
    p.add_argument("--out", type=Path, help="where the plots and compare.md go")
    p.add_argument("--reach", type=float, nargs="*", default=[],
                   help="eval/accuracy thresholds: steps and seconds to the first eval at each")
    args = p.parse_args()
    groups = collect(args.runs)
    runs = {name: [read_rows(d) for d in dirs] for name, dirs in groups.items()}
    present = {k for rs in runs.values() for r in rs for row in r for k in row}
    eval_keys = sorted((k for k in present if k.startswith("eval/")),
                       key=lambda k: (k != "eval/accuracy", k))
    train_keys = [k for k in TRAIN_KEYS if k in present] + sorted(
        k for k in present if k.startswith("reward/"))
    stale = any(row.get("staleness", 0) > 0 for rs in runs.values() for r in rs for row in r)
    offpolicy_keys = [k for k in OFFPOLICY_KEYS if k in present] if stale else []
    study_dir = len(args.runs) == 1 and (Path(args.runs[0]) / "study.json").is_file()
    out = args.out or (Path(args.runs[0]) if study_dir else Path("compare"))
    out.mkdir(parents=True, exist_ok=True)
    text = table(groups, runs, eval_keys, train_keys + offpolicy_keys, args.reach)
    (out / "compare.md").write_text(text + "\n")
    print(text)
    seeds = "mean and min-max over each variant's runs"
    if eval_keys:
        plot(runs, eval_keys, out / "eval.png", f"held-out metrics: {seeds}", 1)
    if train_keys:
        plot(runs, train_keys, out / "train.png",
             f"training samples per step: {seeds}, trailing {SMOOTH}-step means", SMOOTH)
    costs = {"time/step", "generated_tokens"} <= present
    if "eval/accuracy" in eval_keys and costs:
        plot_cost(runs, out / "eval_cost.png")
    if offpolicy_keys:
        plot(runs, offpolicy_keys, out / "offpolicy.png", "pi_prox / pi_behave of the tokens "
             f"trained on (stale rollouts): {seeds}, trailing {SMOOTH}-step means", SMOOTH)
    print(f"compare: {out / 'compare.md'}" + "".join(
        f", {out / f}" for f in ("eval.png", "train.png", "offpolicy.png", "eval_cost.png")
        if (out / f).exists()))


if __name__ == "__main__":
    main()
