"""scripts/ablate.py and scripts/compare.py through their command lines, on tiny runs of the real
nanoareal.py. One study (2 variants x 2 seeds x 2 steps, 2 runs at a time) is shared by the tests
of this file, which run in order: run, rerun, resume, compare."""

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import warm

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled"}
RUNS = ["ppo-s0", "gspo-s0", "ppo-s1", "gspo-s1"]
STUDY = """seeds = [0, 1]
[base]
prompts-per-step = 8
group-size = 4
eval-k = 2
ckpt-every = 1
[variants.ppo]
policy-loss = "ppo"
"""


def script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return warm.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=cwd,
                    capture_output=True, text=True, timeout=300, env=ENV)


def ablate(cwd: Path) -> subprocess.CompletedProcess:
    """The study: a file (base flags, one variant as a table) + a variant and base flags given on
    the command line."""
    return script("ablate.py", "study.toml", "--variant", "gspo=--policy-loss gspo", "--out", "out",
                  "--jobs", "2", "--", "--steps", "2", "--eval-every", "1", cwd=cwd)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def table_rows(md: Path) -> dict[str, dict[str, str]]:
    """compare.md -> {variant: {column: cell}}."""
    lines = [[c.strip() for c in line.strip("|").split("|")] for line in
             md.read_text().splitlines()]
    return {r[0].strip("`"): dict(zip(lines[0], r)) for r in lines[2:]}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    cwd = tmp_path_factory.mktemp("study")
    (cwd / "study.toml").write_text(STUDY)
    return cwd, ablate(cwd)


def test_a_study_runs_each_variant_and_seed_as_the_real_cli_in_its_own_run_directory(study):
    cwd, proc = study
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("0 of 4 runs in out finished (skipped), 4 to run, 2 at a time, 1 thread(s) each"
            in proc.stdout)
    assert proc.stdout.count(": ok in ") == 4 and "[4/4]" in proc.stdout
    record = json.loads((cwd / "out" / "study.json").read_text())
    assert record["variants"] == {"ppo": ["--policy-loss", "ppo"],
                                  "gspo": ["--policy-loss", "gspo"]}
    assert record["seeds"] == [0, 1] and list(record["runs"]) == RUNS
    for name in RUNS:
        run, rec = cwd / "out" / name, record["runs"][name]
        config = json.loads((run / "config.json").read_text())
        variant, seed = name.split("-s")
        assert (config["policy_loss"], config["seed"], config["eval_k"]) == (variant, int(seed), 2)
        assert [r["step"] for r in rows(run)] == [0, 1, 2] and (run / "final").is_dir()
        assert "eval/pass@2" in rows(run)[-1]
        assert rec["status"] == "finished" and rec["wall_s"] > 0 and rec["seed"] == int(seed)
        assert rec["command"][-4:] == ["--seed", seed, "--run-dir", f"out/{name}"]
        assert (run / "log.txt").read_text().startswith("# 20")  # the command, then its output


def test_a_rerun_skips_the_finished_runs_and_starts_none(study):
    cwd, _ = study
    before = {n: ((cwd / "out" / n / "log.txt").read_text(),
                  (cwd / "out" / n / "metrics.jsonl").stat().st_mtime_ns) for n in RUNS}
    proc = ablate(cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 of 4 runs in out finished (skipped), 0 to run" in proc.stdout
    assert ": ok in " not in proc.stdout
    assert before == {n: ((cwd / "out" / n / "log.txt").read_text(),
                          (cwd / "out" / n / "metrics.jsonl").stat().st_mtime_ns) for n in RUNS}


def test_an_unfinished_run_resumes_and_a_failed_one_is_reported_without_stopping_others(study):
    """gspo-s1 killed after step 1 (no step 2, no final/): the same command resumes it. ppo-s0 is
    unfinished too, but its directory now holds another run (lr differs): nanoareal refuses it,
    the end says so with its log's last lines, exit 1; the two finished runs are not touched."""
    cwd, _ = study
    out = cwd / "out"
    killed = out / "gspo-s1"
    shutil.rmtree(killed / "final")
    shutil.rmtree(killed / "checkpoints" / "step_000002")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    (killed / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    config = json.loads((out / "ppo-s0" / "config.json").read_text())
    (out / "ppo-s0" / "config.json").write_text(json.dumps(config | {"lr": 0.5}))
    shutil.rmtree(out / "ppo-s0" / "final")
    untouched = {n: (out / n / "log.txt").read_text() for n in ("gspo-s0", "ppo-s1")}
    wall = json.loads((out / "study.json").read_text())["runs"]["gspo-s1"]["wall_s"]

    proc = ablate(cwd)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "2 of 4 runs in out finished (skipped), 2 to run" in proc.stdout
    assert "gspo-s1: ok in" in proc.stdout and "ppo-s0: FAILED (exit 2)" in proc.stdout
    assert "FAILED ppo-s0 (exit 2), the end of out/ppo-s0/log.txt:" in proc.stderr
    assert "holds another run" in proc.stderr and "lr" in proc.stderr
    log = (killed / "log.txt").read_text()
    headers = [line for line in log.splitlines() if line.startswith("# 20")]
    assert len(headers) == 2 and headers[0].split(" ", 3)[3] == headers[1].split(" ", 3)[3]
    assert "resumed from step 1" in log.split(headers[1])[1]
    assert [r["step"] for r in rows(killed)] == [0, 1, 2] and (killed / "final").is_dir()
    assert untouched == {n: (out / n / "log.txt").read_text() for n in untouched}
    record = json.loads((out / "study.json").read_text())["runs"]
    assert record["gspo-s1"]["wall_s"] > wall and record["gspo-s1"]["status"] == "finished"
    assert record["ppo-s0"]["status"] == "failed" and record["ppo-s0"]["exit"] == 2


def test_a_bad_variant_flag_is_one_line_naming_it_before_any_run_starts(tmp_path):
    proc = script("ablate.py", "--variant", "ok=--lr 1e-4", "--variant", "typo=--policy-los gspo",
                  "--out", "out", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "out").exists()
    assert proc.stderr.strip().splitlines() == [
        "ablate: variant typo: unknown flag --policy-los (did you mean --policy-loss?)"]


def test_a_variant_name_that_cannot_name_a_directory_or_a_per_run_flag_is_one_line(tmp_path):
    for args, line in ((["--variant", "a/b=--lr 1e-4"], "ablate: variant name 'a/b': use "),
                       (["--variant", "a=--seed 3"], "ablate: variant a: --seed is set per run"),
                       (["--", "--run-dir", "x"], "ablate: the base: --run-dir is set per run")):
        proc = script("ablate.py", *args, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(line) and not list(tmp_path.iterdir())


def test_compare_writes_plots_and_a_table_of_the_runs_final_metrics_mean_and_std(study):
    cwd, _ = study
    proc = script("compare.py", "out", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for png in ("eval.png", "train.png"):
        assert (cwd / "out" / png).read_bytes()[:4] == b"\x89PNG"
    table = table_rows(cwd / "out" / "compare.md")
    assert list(table) == ["ppo", "gspo"] and proc.stdout.startswith("| variant |")
    walls = json.loads((cwd / "out" / "study.json").read_text())["runs"]
    for variant, cells in table.items():
        runs = [rows(cwd / "out" / f"{variant}-s{s}") for s in (0, 1)]
        last = lambda r, k: [x[k] for x in r if k in x][-1]
        window = lambda r, k: statistics.mean([x[k] for x in r if k in x][-10:])
        assert cells["runs"] == "2" and cells["steps"] == "2"
        for key in ("eval/accuracy", "eval/mean@2", "eval/pass@2"):
            assert cells[f"{key} (final)"] == mean_std([last(r, key) for r in runs])
        for key in ("reward", "response_len", "truncated_frac"):
            assert cells[f"{key} (last 10 steps)"] == mean_std([window(r, key) for r in runs])
        assert cells["wall time per run (s)"] == ", ".join(
            f"{walls[f'{variant}-s{s}']['wall_s']:.0f}" for s in (0, 1))


def test_compare_says_when_each_variant_first_reached_an_accuracy_and_at_what_cost(study):
    """--reach T: the mean step of the first eval at or above T and the summed time/step up to it
    (evals at steps 0 and 2: T = 0 is reached at step 0, at no cost; T = 2 never)."""
    cwd, _ = study
    proc = script("compare.py", "out", "--out", "reach", "--reach", "0", "2", cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (cwd / "reach" / "eval_cost.png").read_bytes()[:4] == b"\x89PNG"
    for cells in table_rows(cwd / "reach" / "compare.md").values():
        assert cells["steps / s to 0"] == "0 / 0" and cells["steps / s to 2"] == "— / —"


def test_compare_groups_run_directories_by_name_or_as_named_groups(study, tmp_path):
    cwd, _ = study
    out = cwd / "out"
    proc = script("compare.py", str(out / "gspo-s0"), str(out / "gspo-s1"), str(out / "ppo-s1"),
                  "mixed=" + ",".join(str(out / n) for n in ("ppo-s0", "gspo-s1")), "--out",
                  str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = table_rows(tmp_path / "compare.md")
    assert [(v, c["runs"]) for v, c in table.items()] == [("gspo", "2"), ("ppo", "1"),
                                                           ("mixed", "2")]
    final = lambda n: [r["eval/accuracy"] for r in rows(out / n) if "eval/accuracy" in r][-1]
    assert table["ppo"]["eval/accuracy (final)"] == f"{final('ppo-s1'):.3f}"
    assert table["mixed"]["eval/accuracy (final)"] == mean_std([final("ppo-s0"),
                                                                final("gspo-s1")])
    bad = script("compare.py", str(tmp_path / "nothing"), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nothing" in bad.stderr


def test_the_bench_studies_are_the_old_default_studies():
    """bench/studies: arithmetic, the four modes; chain, those and seq_mean/constant without the
    std division (--adv-estimator dr_grpo, once --adv-std none); seeds 0-2 (chain 0-1), 100 steps,
    the chain task's own model and flags."""
    spec = importlib.util.spec_from_file_location("ablate", ROOT / "scripts" / "ablate.py")
    ablate_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate_mod)
    modes = {m: ["--loss-aggregation", m] for m in ("token_mean", "seq_mean", "prompt_mean",
                                                     "constant")}
    no_std = {f"{m}-nostd": ["--loss-aggregation", m, "--adv-estimator", "dr_grpo"]
              for m in ("seq_mean", "constant")}
    import nanoareal

    for task, variants, want_seeds in (("arithmetic", modes, [0, 1, 2]),
                                       ("chain", modes | no_std, [0, 1])):
        args = Namespace(study=str(ROOT / "bench" / "studies" / f"modes_{task}.toml"), variant=[],
                         seeds=None, out=None, base=[])
        base, found, seeds, out = ablate_mod.load_study(args)
        assert (base, found, seeds) == (["--dataset", task], variants, want_seeds)
        assert out == Path(f"bench/results/modes_{task}")
        ablate_mod.check({v: base + f for v, f in found.items()})  # nanoareal takes them
        assert {nanoareal.parse_config(base + f).steps for f in found.values()} == {100}
    cfg = nanoareal.parse_config(["--dataset", "chain"])
    assert (Path(cfg.model).name, cfg.max_new_tokens, cfg.prompts_per_step) == ("tiny-chain", 32,
                                                                               32)


def test_every_bench_study_loads_and_nanoareal_takes_each_variant():
    """Each TOML in bench/studies: its variants (base flags first) parse as nanoareal flags."""
    spec = importlib.util.spec_from_file_location("ablate", ROOT / "scripts" / "ablate.py")
    ablate_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ablate_mod)
    studies = sorted((ROOT / "bench" / "studies").glob("*.toml"))
    assert {p.stem for p in studies} >= {"modes_arithmetic", "modes_chain", "staleness",
                                         "staleness_minibatches"}
    for path in studies:
        args = Namespace(study=str(path), variant=[], seeds=None, out=None, base=[])
        base, found, seeds, out = ablate_mod.load_study(args)
        assert found and seeds and out == Path("bench/results") / path.stem, path
        ablate_mod.check({v: base + f for v, f in found.items()})
