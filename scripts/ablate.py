r"""Run a study: named variants x seeds of nanoareal.py, in parallel on the cores, one run directory
each; then scripts/compare.py plots them and writes the table.

    python scripts/ablate.py bench/studies/modes_arithmetic.toml     # 4 modes x 3 seeds, ~5 min
    python scripts/ablate.py bench/studies/modes_chain.toml          # 6 variants x 3 seeds, ~22 min
    python scripts/ablate.py --variant ppo="--policy-loss ppo" --variant gspo="--policy-loss gspo" \
        --seeds 0 1 --out runs/ppo_vs_gspo -- --config my.toml --steps 50   # base flags after --
    python scripts/compare.py runs/ppo_vs_gspo                       # plots and table of a study

A study file (TOML) holds `seeds = [0, 1]`, optionally `out = "runs/x"`, a `[base]` table of flags
and one `[variants.NAME]` table per variant, its keys written as in a --config file (`lr = 3e-5`,
`mask-truncated = true`); a variant or the base may also be one string of flags (`gspo = "--policy-
loss gspo"` under `[variants]`). --variant, --seeds, --out and the flags after `--` add to the file
or override it. Run NAME-sS is `python nanoareal.py <base> <variant> --seed S --run-dir OUT/NAME-
sS`, with OMP_NUM_THREADS = cores / --jobs, its output appended to OUT/NAME-sS/log.txt; the flags of
each variant with a run to start go through nanoareal's own parser first. A rerun skips the runs
that the same command finished (last step in metrics.jsonl, final/ written) and restarts the others:
nanoareal resumes them from their newest checkpoint. A failed run does not stop the others (exit
status 1 at the end). OUT/study.json records the variants, flags, seeds and each run's wall time.
--dry-run checks every variant's flags and prints the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.2  # how often running runs are checked for an exit
LOG_TAIL = 6  # lines of a failed run's log shown at the end
NAME = re.compile(r"[A-Za-z0-9_.+-]+")  # a variant's name is part of its run directories' names
OWN_FLAGS = ("--seed", "--run-dir")  # set per run here


def shown(path: Path | str) -> str:
    """A path as a user would type it here: relative below the working directory."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def fail(message: str) -> NoReturn:
    print(f"ablate: {message}", file=sys.stderr)
    sys.exit(2)


def as_flags(value, where: str) -> list[str]:
    """A table of flags as in a --config file ({"lr": 3e-5, "mask-truncated": True}), or a string of
    them, -> nanoareal.py's argv."""
    if isinstance(value, str):
        return shlex.split(value)
    if not isinstance(value, dict):
        fail(f"{where}: expected a table of flags or a string of them, got {value!r}")
    flags = []
    for key, v in value.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(v, bool):
            flags.append(flag if v else "--no-" + flag[2:])
        else:
            flags += [flag, *map(str, v if isinstance(v, list) else [v])]
    return flags


def load_study(args) -> tuple[list[str], dict[str, list[str]], list[int], Path]:
    """(base flags, {variant: flags}, seeds, out) from the study file and the command line."""
    import tomllib

    study = {}
    if args.study:
        try:
            study = tomllib.loads(Path(args.study).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            fail(f"{args.study}: {e}")
        if unknown := sorted(set(study) - {"base", "variants", "seeds", "out"}):
            fail(f"{args.study}: unknown key {unknown[0]!r} (keys: base, variants, seeds, out)")
    base = as_flags(study.get("base", {}), "[base]") + args.base
    variants = {n: as_flags(f, f"[variants.{n}]") for n, f in study.get("variants", {}).items()}
    for spec in args.variant:
        name, eq, flags = spec.partition("=")
        if not eq:
            fail(f"--variant {spec!r}: expected NAME=\"FLAGS\"")
        variants[name] = shlex.split(flags)
    variants = variants or {"base": []}  # seeds of the base alone
    for name in (n for n in variants if not NAME.fullmatch(n)):
        fail(f"variant name {name!r}: use letters, digits and _.+- (it names directories)")
    for where, flags in [("the base", base), *((f"variant {n}", f) for n, f in variants.items())]:
        if own := [f for f in flags if f.split("=")[0] in OWN_FLAGS]:
            fail(f"{where}: {own[0]} is set per run by ablate.py (use --seeds, --out)")
    seeds = args.seeds or study.get("seeds", [0])
    out = args.out or study.get("out") or f"runs/{Path(args.study).stem if args.study else 'study'}"
    return base, variants, seeds, Path(out)


def check(commands: dict[str, list[str]]) -> None:
    """Each variant's flags through nanoareal's own parser: a mistake is one line naming the
    variant, before any run starts."""
    if not commands:
        return  # nothing to start: no need to import torch
    sys.path.insert(0, str(ROOT))
    import cli
    import nanoareal

    for name, argv in commands.items():
        try:
            nanoareal.parse_config(argv)
        except cli.UserError as e:
            fail(f"variant {name}: {e}")
        except SystemExit:  # tyro's own refusal, printed above
            fail(f"variant {name}: nanoareal.py refused its flags: {shlex.join(argv)}")


def last_row(d: Path, key: str = "step") -> dict:
    """The last metrics.jsonl line holding `key` ({} if none, or a line cut by a kill)."""
    try:
        rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
    except (OSError, ValueError):
        return {}
    return next((r for r in reversed(rows) if key in r), {})


def finished(d: Path) -> bool:
    """The run reached the last step of its config.json (its latest command's) and wrote final/
    (which an evaluation-only run, --steps 0, has not)."""
    try:
        steps = json.loads((d / "config.json").read_text())["steps"]
    except (OSError, ValueError, KeyError):
        return False
    return last_row(d).get("step", -1) >= steps and (steps == 0 or (d / "final").is_dir())


def plan(base: list[str], variants: dict[str, list[str]], seeds: list[int], out: Path):
    """{run: (variant, seed, command)} and the study's record, merged with OUT/study.json's: a run
    finished by the same command is skipped."""
    runs = {f"{v}-s{s}": (v, s, [sys.executable, str(ROOT / "nanoareal.py"), *base, *f, "--seed",
                                 str(s), "--run-dir", str(out / f"{v}-s{s}")])
            for s in seeds for v, f in variants.items()}
    path = out / "study.json"
    study = json.loads(path.read_text()) if path.exists() else {"variants": {}, "runs": {}}
    study |= {"base": base, "variants": study["variants"] | variants,
              "seeds": sorted(set(study.get("seeds", [])) | set(seeds))}
    for name, (v, s, cmd) in runs.items():
        old = study["runs"].get(name, {"wall_s": 0.0})
        same = old.get("command") == cmd[1:] and finished(out / name)
        study["runs"][name] = old | {"variant": v, "seed": s, "command": cmd[1:],
                                     "status": "finished" if same else "unfinished"}
    return runs, study


def save(study: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.tmp").write_text(json.dumps(study, indent=1))
    (out / "study.tmp").replace(out / "study.json")  # compare.py may read it meanwhile


def launch(cmd: list[str], d: Path, threads: int) -> subprocess.Popen:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "log.txt", "a") as log:  # appended: an interrupted attempt's lines stay
        log.write(f"# {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
        log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS=str(threads)))


def run_all(runs: dict, todo: list[str], study: dict, out: Path, jobs: int) -> list[str]:
    """The runs of `todo`, `jobs` at a time, a line as each ends -> the names of those that failed.
    Ctrl-C: the runs save a checkpoint (nanoareal's SIGINT), a rerun resumes them."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    print(f"ablate: {len(runs) - len(todo)} of {len(runs)} runs in {out} finished (skipped), "
          f"{len(todo)} to run, {jobs} at a time, {threads} thread(s) each; logs in "
          f"{out}/<run>/log.txt", flush=True)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    failed, done = [], 0
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name = todo.pop(0)
                running[name] = (launch(runs[name][2], out / name, threads), time.time())
            time.sleep(POLL_S)
            for name, (proc, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                done += 1
                ok = proc.returncode == 0 and finished(out / name)
                rec = study["runs"][name]
                rec |= {"wall_s": rec["wall_s"] + time.time() - t0, "exit": proc.returncode,
                        "status": "finished" if ok else "failed"}
                save(study, out)
                acc = last_row(out / name, "eval/accuracy").get("eval/accuracy")
                print(f"[{done}/{done + len(todo) + len(running)}] {name}: "
                      f"{'ok' if ok else f'FAILED (exit {proc.returncode})'} in "
                      f"{time.time() - t0:.0f} s" + ("" if acc is None else
                                                     f", eval/accuracy {acc:.3f}"), flush=True)
                failed += [] if ok else [name]
    except KeyboardInterrupt:
        for proc, _ in running.values():
            proc.send_signal(signal.SIGINT)
        for name, (proc, t0) in running.items():
            proc.wait()
            study["runs"][name]["wall_s"] += time.time() - t0
        save(study, out)
        print(f"ablate: interrupted; rerun the same command to resume {', '.join(running)}")
        sys.exit(130)
    return failed


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, usage="%(prog)s [study.toml] [options] [-- "
                                "nanoareal.py flags of the base]",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a study file (TOML), see above")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="FLAGS"',
                   help="a named variant: nanoareal.py flags added to the base (repeatable)")
    p.add_argument("--seeds", nargs="+", type=int, help="seeds of every variant (default 0)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at a time")
    p.add_argument("--out", help="the study's directory (default runs/<study file's name>)")
    p.add_argument("--dry-run", action="store_true", help="check the flags, print the commands")
    args = p.parse_args(argv[:cut])
    args.base = argv[cut + 1 :]
    base, variants, seeds, out = load_study(args)
    runs, study = plan(base, variants, seeds, out)
    todo = [n for n in runs if study["runs"][n]["status"] != "finished"]
    check({runs[n][0]: runs[n][2][2:] for n in (runs if args.dry_run else todo)})
    if args.dry_run:
        for name, (_, _, cmd) in runs.items():
            print(f"{name} ({study['runs'][name]['status']}): python "
                  f"{shlex.join([shown(cmd[1]), *cmd[2:]])}")
        return
    save(study, out)
    failed = run_all(runs, todo, study, out, max(1, min(args.jobs, len(todo) or 1)))
    for name in failed:
        tail = (out / name / "log.txt").read_text(errors="replace").splitlines()[-LOG_TAIL:]
        print(f"FAILED {name} (exit {study['runs'][name]['exit']}), the end of "
              f"{out / name / 'log.txt'}:\n    " + "\n    ".join(tail), file=sys.stderr)
    print(f"ablate: {len(runs) - len(failed)} of {len(runs)} runs finished; compare them with: "
          f"python {shown(Path(__file__).parent / 'compare.py')} {out}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
