"""Bounded staleness (--max-staleness K): the batch of step s is sampled by the weights at the start
of step max(0, s - K), exactly, generated while earlier steps train; a run stays a function of
(seed, K). Exact resume with K = 2 is in test_checkpoint.py; the corrections' formulas are in
test_loss.py (SURROGATE_CONFIGS)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest
import warm

import rollout

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "0", "--warmup-steps",
        "0", "--lr", "1e-3"]
NOISE = ("time/", "gen_tokens_per_s", "train_tokens_per_s")
# the default run's first steps at fe94f92, the synchronous loop before --max-staleness existed
# (the metrics it logged then; floats to 1e-6)
SYNCHRONOUS = [
    {"step": 1, "reward": 0.201171875, "response_len": 2.994140625, "grad_norm": 1.946097493,
     "loss/policy": 0.000486651979, "entropy": 0.871507260},
    {"step": 2, "reward": 0.15625, "response_len": 2.970703125, "grad_norm": 2.637802124,
     "loss/policy": -0.001897969581, "entropy": 0.864960379},
    {"step": 3, "reward": 0.216796875, "response_len": 3.015625, "grad_norm": 2.180922508,
     "loss/policy": 0.002882669627, "entropy": 0.833422014},
]


def run_cli(tmp_path: Path, name: str, *args: str, nproc: int = 1) -> list[dict]:
    run_dir = tmp_path / name
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), *args, "--run-dir", str(run_dir)]
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}", *cmd[1:]]
    out = warm.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISE)} for r in rows if "reward" in r]


def test_k0_is_the_synchronous_loop_it_replaced(tmp_path):
    rows = run_cli(tmp_path, "k0", "--steps", "3", "--eval-every", "0", "--max-staleness", "0")
    for got, want in zip(rows, SYNCHRONOUS, strict=True):
        assert {k: got[k] for k in want} == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert got["policy_version"] == got["step"] - 1 and got["staleness"] == 0


@pytest.fixture(scope="module")
def k2_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k2")
    args = [*FAST, "--steps", "5", "--max-staleness", "2"]
    return [run_cli(tmp, "a", *args), run_cli(tmp, "b", *args), run_cli(tmp, "c", *args,
                                                                         nproc=2)]


def test_each_step_trains_on_the_batch_of_the_policy_k_steps_back(k2_runs):
    rows = k2_runs[0]
    assert [r["policy_version"] for r in rows] == [0, 0, 0, 1, 2]  # max(0, s - 2), s = step - 1
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2]
    # the first step trains on the weights that sampled it; later ones on newer weights, so the
    # importance weights the corrections see leave 1 exactly when staleness does
    assert rows[0]["importance_weight/max"] == pytest.approx(1.0, abs=1e-4)
    assert all(r["importance_weight/max"] > 1.01 for r in rows[1:])
    assert rows[0]["logprob_mismatch"] < 1e-5 < rows[2]["logprob_mismatch"]


def test_a_stale_run_is_a_function_of_seed_and_k_on_any_number_of_ranks(k2_runs):
    one, again, two_ranks = k2_runs
    assert one == again
    for a, b in zip(one, two_ranks, strict=True):
        for k, v in a.items():
            if not k.startswith(("train_positions", "logprob_mismatch")):  # layout, float noise
                assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def test_the_batch_ahead_is_generated_while_the_step_trains():
    """Batch 1 cannot finish until the main thread (which 'trains' step 0) says so: if the queue
    generated it inline instead of on its own thread, take(0) would never return."""
    trained, started = threading.Event(), threading.Event()

    def make_batch(step: int) -> list[int]:
        if step == 1:
            started.set()
            assert trained.wait(10), "batch 1 was generated before step 0 could train"
        return [step]

    rollouts = rollout.Rollouts(make_batch, 1, True, {})
    assert rollouts.take(0) == [0]
    assert started.wait(10)  # batch 1 runs meanwhile, sampled by the weights of step 0
    trained.set()
    assert rollouts.wait() == {1: [1]} and rollouts.take(1) == [1]
    rollouts.close()
    assert "overlapped with training" in rollout.Rollouts(make_batch, 1, True, {}).describe()


def test_an_engine_that_cannot_overlap_keeps_the_semantics_and_says_so():
    """Colocated SGLang shares the GPU with the trainer: batches up to s + K are generated inline,
    by the same weights they would have had."""
    made = []
    rollouts = rollout.Rollouts(lambda s: made.append(s) or [s], 2, False, {0: [0]})
    assert rollouts.take(0) == [0] and made == [1, 2]  # batch 0 came from a checkpoint
    assert rollouts.take(1) == [1] and made == [1, 2, 3]
    assert "not overlapped" in rollouts.describe()
