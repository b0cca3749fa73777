"""Bounded staleness (--max-staleness K): the batch of step s is sampled by the weights at the start
of step max(0, s - K), exactly, generated while earlier steps train; a run stays a function of
(seed, K). Exact resume with K = 2 is in test_checkpoint.py; the corrections' formulas are in
test_loss.py (SURROGATE_CONFIGS)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
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
# How far the policy's float statistics (entropy, losses, importance weights, grad norm, clip
# share) may differ between two runs that sum the same gradients in another order (ranks,
# micro-batches, another CPU's kernels). Step 1 trains the same weights: float32 rounding, ~1e-7
# relative, compared as one step's gradient is (test_nanoareal.py). After an update they drift:
# AdamW divides each coordinate's step by its own RMS, so a coordinate whose gradient cancels down
# to its rounding moves by a different amount (up to lr) in the two runs, and later gradients are
# taken at those different weights. Log-probs then differ by a delta that grows several-fold an
# update (1 vs 2 ranks at --lr 1e-3: 2e-7, 8e-7, 1e-5, 4e-5 after 1..4 updates here, 1.4e-4 after
# 4 on a faster AVX-512 host), and every statistic moves by about delta relative: an importance
# weight is exp(log-ratio), its max the token that moved most. 1e-3 is 7x the worst seen, and 10x
# below what a real mismatch moves (a sample, an advantage or a token lost: 1/T ~ 1e-2 of a mean).
ONE_STEP = {"rel": 1e-5, "abs": 1e-7}
AFTER_UPDATES = {"rel": 1e-3, "abs": 1e-6}
POLICY_STATS = ("entropy", "loss/", "importance_weight/", "grad_norm", "policy/")
# the trainer-vs-sampler gap measures beside logprob_mismatch (loss.mismatch_sums):
# float noise of how the engine batched the prompts, not compared across world sizes; the
# rejected shares (mismatch/rejected_*) are counts and are
GAPS = ("mismatch/k3", "mismatch/log_ppl_gap", "mismatch/seq_ratio_")


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
        assert got["logprob_mismatch"] < 1e-5  # the engine samples by the updated weights


def samples(run_dir: Path) -> dict[tuple[int, int], list[dict]]:
    """samples.jsonl by (step, group): rank 0's first groups, which are others on 2 ranks."""
    groups = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        groups.setdefault((row["step"], row["group"]), []).append(row)
    return groups


@pytest.fixture(scope="module")
def k2_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k2")
    args = [*FAST, "--steps", "5", "--max-staleness", "2"]
    runs = [run_cli(tmp, "a", *args), run_cli(tmp, "b", *args), run_cli(tmp, "c", *args,
                                                                         nproc=2)]
    return runs, [samples(tmp / name) for name in "abc"]


def test_each_step_trains_on_the_batch_of_the_policy_k_steps_back(k2_runs):
    rows = k2_runs[0][0]
    assert [r["policy_version"] for r in rows] == [0, 0, 0, 1, 2]  # max(0, s - 2), s = step - 1
    assert [r["staleness"] for r in rows] == [0, 1, 2, 2, 2]
    # the first step trains on the weights that sampled it; later ones on newer weights, so the
    # importance weights the corrections see leave 1 exactly when staleness does
    assert rows[0]["importance_weight/max"] == pytest.approx(1.0, abs=1e-4)
    assert all(r["importance_weight/max"] > 1.01 for r in rows[1:])
    assert rows[0]["logprob_mismatch"] < 1e-5 < rows[2]["logprob_mismatch"]


def test_a_stale_run_is_a_function_of_seed_and_k_on_any_number_of_ranks(k2_runs):
    (one, again, two_ranks), (samples_one, samples_again, samples_two) = k2_runs
    assert one == again and samples_one == samples_again
    common = samples_one.keys() & samples_two.keys()  # group 0 of every step, at least
    assert {step for step, _ in common} == {r["step"] for r in one}
    assert all(samples_two[key] == samples_one[key] for key in common)  # texts, rewards, versions
    for a, b in zip(one, two_ranks, strict=True):
        tolerance = ONE_STEP if a["step"] == 1 else AFTER_UPDATES
        for k, v in a.items():
            if k.startswith(("train_positions", "logprob_mismatch", *GAPS)):  # layout, noise
                continue
            if k.startswith(POLICY_STATS):
                assert b[k] == pytest.approx(v, **tolerance), (a["step"], k)
            else:  # counts, rewards, lengths, versions, lr: decided by seeds and integers
                assert b[k] == v, (a["step"], k)


def test_staleness_without_a_named_correction_learns_on_the_default_task(tmp_path):
    """--max-staleness 1 and nothing else gets --correction auto = behave, the correction
    docs/studies.md shows holding (at its lr 2e-4 none fell to 0.09-0.22 by step 20, behave rose
    to 0.41-0.52, from the warm start's 0.328): the run learns."""
    run_dir = tmp_path / "auto"
    run_cli(tmp_path, "auto", "--steps", "20", "--max-staleness", "1", "--lr", "2e-4",
            "--eval-every", "20")
    assert json.loads((run_dir / "config.json").read_text())["correction"] == "behave"
    evals = [json.loads(line)["eval/accuracy"] for line in
             (run_dir / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in line]
    assert evals[0] == pytest.approx(0.328, abs=1e-3) and evals[-1] >= 0.39, evals


def test_the_batch_ahead_is_generated_while_the_step_trains():
    """Batch 1 cannot finish until the main thread (which 'trains' step 0) says so: if the queue
    generated it inline instead of on its own thread, take(0) would never return."""
    trained, started = threading.Event(), threading.Event()

    def make_batch(step: int) -> list[int]:
        if step == 1:
            started.set()
            assert trained.wait(10), "batch 1 was generated before step 0 could train"
        return [step]

    rollouts = rollout.Rollouts(make_batch, 1, "thread", {})
    assert rollouts.take(0) == [0]
    assert started.wait(10)  # batch 1 runs meanwhile, sampled by the weights of step 0
    trained.set()
    assert rollouts.wait() == {1: [1]} and rollouts.take(1) == [1]
    rollouts.close()
    assert "overlapped with training" in rollout.Rollouts(make_batch, 1, "thread", {}).describe()


def test_an_engine_that_cannot_overlap_keeps_the_semantics_and_says_so():
    """Colocated SGLang shares the GPU with the trainer: batches up to s + K are generated inline,
    by the same weights they would have had."""
    made = []
    rollouts = rollout.Rollouts(lambda s: made.append(s) or [s], 2, "", {0: [0]})
    assert rollouts.take(0) == [0] and made == [1, 2]  # batch 0 came from a checkpoint
    assert rollouts.take(1) == [1] and made == [1, 2, 3]
    assert "not overlapped" in rollouts.describe()


# -----------------------------------------------------------------------------
# the rollout process (the hf engine on a CPU): a forked child that shares the engine's weights


def test_the_batch_ahead_is_made_by_another_process_while_the_step_trains(tmp_path):
    """Batch 1 waits for a file the parent writes once it has 'trained' step 0; it reports the pid
    that made it: not the trainer's."""
    def make_batch(step: int) -> list[int]:
        if step == 1:
            (tmp_path / "started").touch()
            for _ in range(6000):
                if (tmp_path / "trained").exists():
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("batch 1 was made before step 0 could train")
        return [step, os.getpid()]

    rollouts = rollout.Rollouts(make_batch, 1, "process", {})
    assert "(a rollout process)" in rollouts.describe()
    assert rollouts.take(0)[0] == 0
    for _ in range(6000):
        if (tmp_path / "started").exists():
            break
        time.sleep(0.01)
    (tmp_path / "trained").touch()
    (step, pid), = rollouts.wait().values()
    assert step == 1 and pid != os.getpid()
    assert rollouts.take(1) == [1, pid]
    rollouts.close()


def test_the_rollout_process_sees_each_weight_update_and_makes_what_the_trainer_would(tmp_path):
    """An engine (tied embeddings: they must stay tied in shared memory) forked once; weights
    written by update_weights afterwards reach the child, with their version: its batches equal
    the same engine generating in the trainer's own process."""
    from sglang_standin import save_tiny_llama
    from transformers import AutoModelForCausalLM

    path = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    engine, local = rollout.HFEngine(path), rollout.HFEngine(path)
    assert engine.overlaps == "process"
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    sampling = rollout.SamplingParams(6, 1.0, stop_token_ids=[1])
    prompts, seeds = [[3, 13, 4, 14], [5, 13, 6, 14]] * 4, list(range(8))

    def make(e, step):
        return [e.version, [c.output_ids for c in e.generate(prompts, sampling, seeds)]]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a trainer that ran OpenMP threads before the fork: no hang after
    torch.randn(256, 256) @ torch.randn(256, 256)
    rollouts = rollout.Rollouts(lambda s: make(engine, s), 1, "process", {})
    torch.set_num_threads(threads)
    taken: list = []
    waiter = threading.Thread(target=lambda: taken.append(rollouts.take(0)), daemon=True)
    waiter.start(), waiter.join(60)
    assert taken, "the rollout process hangs (OpenMP threads after a fork)"
    first = taken[0]
    assert first == make(local, 0)
    rollouts.wait()
    torch.manual_seed(1)
    trained = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    for e in (engine, local):
        e.update_weights(trained, 1)
    assert rollouts.take(1) == first  # made ahead, before the update
    got = rollouts.take(2)
    assert got == make(local, 2) and got[0] == 1 and got != first
    rollouts.close()


def test_a_rollout_process_that_dies_or_fails_is_replaced_or_reported(tmp_path):
    """A child killed (SIGTERM to the whole job) leaves the trainer making the batches, the same
    ones; an error in make_batch comes back as an error with the child's traceback; a child whose
    trainer is gone (kill -9) exits on its own."""
    def make_batch(step: int) -> list[int]:
        if step == 2:
            (tmp_path / "pid").write_text(str(os.getpid()))
            time.sleep(30)  # killed meanwhile
        if step == 7:
            raise ValueError("a broken reward")
        return [step]

    rollouts = rollout.Rollouts(make_batch, 2, "process", {})
    assert rollouts.take(0) == [0]
    for _ in range(6000):
        if (tmp_path / "pid").exists() and (tmp_path / "pid").read_text():  # (written, not just
            break  # created: write_text does both, and this loop can run between them)
        time.sleep(0.01)
    os.kill(int((tmp_path / "pid").read_text()), signal.SIGTERM)
    (tmp_path / "pid").unlink()  # the trainer's own make_batch(2) sleeps too: shorten it
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "sleep", lambda s: None)
        assert [rollouts.take(s) for s in range(1, 5)] == [[1], [2], [3], [4]]
    rollouts.close()
    rollouts = rollout.Rollouts(make_batch, 1, "process", {5: [5]})
    assert rollouts.take(5) == [5] and rollouts.take(6) == [6]
    with pytest.raises(RuntimeError, match="(?s)rollout process failed on step 7.*a broken reward"):
        rollouts.take(7)
    rollouts.close()
    orphan = subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True,
                            cwd=ROOT, timeout=60)
    child = int(orphan.stdout.split()[-1])
    for _ in range(3000):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"the rollout process {child} outlived its trainer")


ORPHAN = """
import os, signal, time, rollout
rollouts = rollout.Rollouts(lambda s: [os.getpid()], 1, "process", {})
rollouts.take(0)
print(rollouts.wait()[1][0], flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
