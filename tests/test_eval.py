"""Evaluation as papers report it (greedy accuracy, mean@k, pass@k), evaluation without training
of any model directory, export or checkpoint, and the samples a run writes for a person to read."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import warm

import nanoareal as N
import tasks
from rollout import Completion

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--prompts-per-step", "8", "--group-size", "4", "--warmup-steps", "0", "--lr", "1e-3"]


class ScriptedEngine:
    """Answers prompt i with a right answer for the first RIGHT[i] of its samples (seed order), and
    greedily right for the even prompts."""

    version = 0
    RIGHT = [0, 1, 3, 5, 8]

    def generate(self, prompts, sampling, seeds):
        out, seen = [], {}
        for p in prompts:
            i = p[0]
            j = seen[i] = seen.get(i, -1) + 1
            ok = i % 2 == 0 if sampling.temperature == 0 else j < self.RIGHT[i]
            out.append(Completion([1 if ok else 2], [0.0], "stop"))
        return out


def test_pass_at_k_and_mean_at_k_are_the_unbiased_estimators(one_rank_group):
    """Against the definition itself: pass@k is the share of the C(n, k) subsets of k samples that
    hold a right answer, mean@n the share of right samples, both averaged over prompts."""
    n = 8
    tokenizer = types.SimpleNamespace(batch_decode=lambda ids, **kw: ["right" if x == [1] else
                                                                      "wrong" for x in ids])
    rows = [{"prompt": "q", "answer": "right"} for _ in ScriptedEngine.RIGHT]
    data = tasks.Data(tokenizer, [], [], [(r, [i]) for i, r in enumerate(rows)], [0])
    cfg = types.SimpleNamespace(max_new_tokens=8, temperature=1.0, eval_k=n, seed=0)
    got = tasks.evaluate(ScriptedEngine(), data, tasks.exact_match, cfg, 0, 1)
    assert set(got) == {"eval/accuracy", f"eval/mean@{n}", "eval/pass@2", "eval/pass@4",
                        f"eval/pass@{n}"}
    assert got["eval/accuracy"] == pytest.approx(3 / 5)  # prompts 0, 2, 4
    for k in (2, 4, n):
        subsets = [[any(c) for c in itertools.combinations([j < r for j in range(n)], k)]
                   for r in ScriptedEngine.RIGHT]
        want = sum(sum(s) / len(s) for s in subsets) / len(subsets)
        assert got[f"eval/pass@{k}"] == pytest.approx(want, rel=1e-12), k
    assert got[f"eval/mean@{n}"] == pytest.approx(sum(ScriptedEngine.RIGHT) / (n * 5))


def cli(*args: str) -> subprocess.CompletedProcess:
    out = warm.run([sys.executable, str(ROOT / "nanoareal.py"), *args], cwd=ROOT,
                   capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    cli(*SMALL, "--steps", "2", "--eval-every", "1", "--ckpt-every", "1", "--run-dir",
        str(run_dir))
    return run_dir


def test_evaluate_only_a_checkpoint_or_an_export_writes_eval_metrics_and_touches_no_run(
        trained, tmp_path):
    before = snapshot(trained)
    step1 = trained / "checkpoints" / "step_000001"
    out = cli("--steps", "0", "--model", str(step1), "--eval-k", "4", "--run-dir",
              str(tmp_path / "e1"))
    assert "evaluating step 1" in out.stdout
    (row,) = lines(tmp_path / "e1" / "metrics.jsonl")
    evals = {r["step"]: r["eval/accuracy"] for r in lines(trained / "metrics.jsonl")
             if "eval/accuracy" in r}
    assert row["step"] == 1 and row["eval/accuracy"] == evals[1]  # the same greedy answers
    assert {"eval/mean@4", "eval/pass@2", "eval/pass@4"} <= set(row)
    assert row["eval/mean@4"] <= row["eval/pass@2"] <= row["eval/pass@4"]
    cli("--steps", "0", "--model", str(trained / "final"), "--run-dir", str(tmp_path / "e2"))
    (row,) = lines(tmp_path / "e2" / "metrics.jsonl")
    assert row == {"step": 0, "eval/accuracy": evals[2]}  # the export holds step 2's weights
    for written in ("checkpoints", "final"):
        assert not (tmp_path / "e1" / written).exists()
    assert snapshot(trained) == before


def test_an_evaluation_by_default_gets_its_own_run_directory(trained, tmp_path):
    """--steps 0 without --run-dir must not land in (and truncate) the run it evaluates."""
    cfg = N.parse_config(["--steps", "0", "--model", str(trained / "checkpoints" /
                                                         "step_000001")])
    train = N.parse_config([*SMALL, "--steps", "2"])
    assert cfg.run_dir != train.run_dir and "-eval-" in cfg.run_dir


def test_a_run_writes_a_few_readable_groups_per_sampled_step(trained):
    rows = lines(trained / "samples.jsonl")
    assert sorted({r["step"] for r in rows}) == [1, 2]
    for step in (1, 2):
        groups = [r for r in rows if r["step"] == step]
        assert len({r["group"] for r in groups}) == 2 and len(groups) == 8  # 2 groups of 4
    r = rows[0]
    assert set(r) == {"step", "group", "prompt", "completion", "reward", "advantage", "correct",
                      "finish_reason", "length", "version"}
    assert r["prompt"].endswith("=") and r["finish_reason"] in ("stop", "length")


def test_samples_are_rate_limited_to_about_a_hundred_steps_of_a_run(tmp_path, monkeypatch):
    import logs
    from logs import SAMPLED_STEPS, Logger

    monkeypatch.setattr(logs, "sample_rows", lambda samples, tokenizer: [{"group": 0}])
    logger = Logger(types.SimpleNamespace(run_dir=tmp_path, steps=1000, wandb_project=None), 0)
    for s in range(1, 1001):
        logger.log_samples(s, ["a sample"], None)
    due = [r["step"] for r in lines(tmp_path / "samples.jsonl")]
    assert len(due) == SAMPLED_STEPS and due[:2] == [10, 20]
    assert torch.tensor(due).diff().unique().tolist() == [10]


def test_evaluating_a_jsonl_dataset_alone_evaluates_that_file(tmp_path):
    """--steps 0 --dataset rows.jsonl (no --eval-dataset) evaluates rows.jsonl: here the built-in
    arithmetic task's held-out rows, so the accuracy is the built-in eval's at step 0."""
    _, heldout = tasks.make_arithmetic_task()
    path = tmp_path / "heldout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in heldout))
    assert N.parse_config(["--steps", "0", "--dataset", str(path)]).eval_dataset == str(path)
    assert N.parse_config(["--steps", "1", "--dataset", str(path)]).eval_dataset is None
    cli("--steps", "0", "--dataset", str(path), "--run-dir", str(tmp_path / "e"))
    (row,) = lines(tmp_path / "e" / "metrics.jsonl")
    shipped = json.loads((ROOT / "assets" / "tiny-arith" / "build_info.json").read_text())
    assert row == {"step": 0, "eval/accuracy": pytest.approx(shipped["heldout_acc"])}
