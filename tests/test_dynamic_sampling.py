"""Dynamic sampling (issue 45, --zero-variance resample): a slot whose group's rewards are all equal
draws a fresh prompt and samples again, up to --max-resample rounds; the batch is a function of
(seed, step), the same split over any number of ranks, rerun or resumed, with rollouts ahead."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import logs
import nanoareal as N
import rollout
import tasks

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--prompts-per-step", "16", "--group-size", "4", "--steps", "3", "--eval-every", "0",
         "--zero-variance", "resample", "--max-resample", "3"]


@pytest.fixture(scope="module")
def setup():
    cfg = N.validate_config(N.resolve_config(N.Config(
        prompts_per_step=16, group_size=4, zero_variance="resample", max_resample=3)), 1)
    data = tasks.load_data(cfg)
    engine = rollout.HFEngine(cfg.model)
    return cfg, data, engine, tasks.load_reward(cfg.reward)


def batch(setup, step: int, ranks: N.Ranks | None = None) -> list:
    cfg, data, engine, reward = setup
    ranks = ranks or N.Ranks()
    return N.rollout_batch(engine, data, reward, step, cfg, ranks)


def key(s) -> tuple:
    return (s.group, s.row, s.round, s.seed, tuple(s.completion.output_ids), s.reward)


def test_a_flat_group_is_drawn_again_until_its_rewards_differ(setup):
    cfg = setup[0]
    plain = N.rollout_batch(setup[2], setup[1], setup[3], 0,
                            N.replace(cfg, zero_variance="keep"), N.Ranks())
    flat = N.flat_groups(plain)
    assert flat, "the step needs groups without signal for this test to bite"
    got = batch(setup, 0)
    assert sorted({s.group for s in got}) == list(range(16))
    assert all(len([s for s in got if s.group == g]) == 4 for g in range(16))
    redrawn = {s.group for s in got if s.round > 0}
    assert redrawn == flat  # exactly the flat slots drew again, the others kept round 0
    for s in got:  # round 0 groups are the plain batch's, untouched
        if s.group not in flat:
            assert key(s) in {key(p) for p in plain}
    rounds = {g: max(s.round for s in got if s.group == g) for g in redrawn}
    left = N.flat_groups(got)
    assert all(rounds[g] == 3 for g in left)  # a slot still flat used every round
    assert len(left) < len(flat)
    discarded = sum(s.discarded_tokens for s in got)
    assert discarded >= 4 * sum(rounds.values())  # every round thrown away had 4 answers


class SlowEngine:
    """The engine, each generate call taking WAIT seconds more."""

    WAIT = 0.2

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.WAIT)
        return self.engine.generate(*args, **kwargs)


def test_gen_tokens_per_s_is_every_round_s_tokens_over_every_round_s_seconds(setup):
    """generated_tokens counts the tokens of every round (those resampled away too): gen_s, its
    denominator, is every round's generation time summed, not one round's."""
    cfg, data, engine, reward = setup
    slow = SlowEngine(engine)
    got = N.rollout_batch(slow, data, reward, 0, cfg, N.Ranks())
    assert slow.calls >= 2, "the step needs a resampling round for this test to bite"
    sums = N.rollout_sums(got, N.Ranks())
    assert sums["gen_s"] >= SlowEngine.WAIT * slow.calls
    metrics = logs.step_metrics(sums, {}, {"train": 1.0}, 1e-6, 1)
    generated = sum(len(s.completion.output_ids) + s.discarded_tokens for s in got)
    assert metrics["generated_tokens"] == generated
    assert metrics["gen_tokens_per_s"] <= generated / (SlowEngine.WAIT * slow.calls)


def test_the_batch_is_a_function_of_seed_and_step_on_any_number_of_ranks(setup):
    whole = [key(s) for s in batch(setup, 1)]
    assert whole == [key(s) for s in batch(setup, 1)]  # rerun
    halves = [key(s) for r in range(2) for s in batch(setup, 1, N.Ranks(r, 2, r, 2))]
    assert sorted(halves) == sorted(whole)


def run(tmp_path, name, *extra, nproc=1):
    out = tmp_path / name
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), *FLAGS, *extra, "--run-dir", str(out)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if "reward" in x]


def test_a_resampling_run_with_rollouts_ahead_is_the_same_on_one_rank_and_two(tmp_path):
    """--max-staleness 1: rounds happen on the rollout side; rewards, extra samples and tokens
    generated are those of a one-rank run on two."""
    one = run(tmp_path, "one", "--max-staleness", "1")
    two = run(tmp_path, "two", "--max-staleness", "1", nproc=2)
    exact = ("reward", "zero_var_groups", "resample/resampled_frac", "generated_tokens")
    for a, b in zip(one, two, strict=True):
        assert {k: a[k] for k in exact} == {k: b[k] for k in exact}
    assert sum(x["resample/resampled_frac"] for x in one) > 0
