"""Checkpoints, resume and failure handling (issue 6): a run killed at any moment and resumed equals
the run that was never killed; bad steps, bad rewards, empty batches and dead ranks end or
continue cleanly; impossible options fail before any work starts. The end-to-end tests run the
real CLI (through tests/support/fault_runner.py, which injects the faults) and kill it with
SIGKILL."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm
from test_staleness import AFTER_UPDATES, ONE_STEP

import checkpoint
import nanoareal as N
import tasks
from cli import UserError

ROOT = Path(__file__).resolve().parents[1]
# 4 steps of 8 prompts x 4 samples, a checkpoint every 2 steps, eval at steps 0, 2 and 4
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "2",
        "--steps", "4",
        "--ckpt-every", "2"]
NOISE = ("time/", "gen_tokens_per_s", "train_tokens_per_s", "env/seconds")  # wall-clock


# -----------------------------------------------------------------------------
# helpers: start the CLI in its own session, wait for a fault's marker file, SIGKILL the whole
# process tree


def start(args: list[str], run_dir: Path, nproc: int = 1,
          faults: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               NANOAREAL_FAULTS=json.dumps(faults or {}))
    script = [str(ROOT / "tests" / "support" / "fault_runner.py"), *args, "--run-dir", str(run_dir)]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}",
               *script]
    log = open(f"{run_dir}.log", "w")
    proc = warm.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                      start_new_session=True)
    proc.run_dir, proc.started = run_dir, time.time()  # kill_9 finds the ranks by their pid files
    return proc


def log_of(run_dir: Path) -> str:
    return Path(f"{run_dir}.log").read_text()[-4000:]


def wait(proc: subprocess.Popen, timeout: float = 300) -> int | None:
    """The exit code, or None (after killing everything) when the run hangs."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_9(proc)
        return None


def finish(proc: subprocess.Popen, run_dir: Path) -> None:
    assert wait(proc) == 0, log_of(run_dir)


def run(args: list[str], run_dir: Path, nproc: int = 1) -> None:
    finish(start(args, run_dir, nproc), run_dir)


def wait_for(path: Path, proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"exited before {path.name}:\n{log_of(run_dir)}"
        if time.monotonic() > deadline:
            kill_9(proc)
            raise AssertionError(f"no {path.name} after {timeout}s")
        time.sleep(0.1)


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out, todo = out + kids, todo + kids
    return out


def kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun (or python) and every worker: torchrun starts each worker in a session of
    its own (and a warm worker is its zygote's child), so the tree and the ranks' pid files are
    collected first, then everything is killed at once, as a machine failure would."""
    ranks = [int(p.read_text()) for p in Path(proc.run_dir).glob("pid.rank*")
             if p.stat().st_mtime >= proc.started]  # this run's, not an earlier one's
    for pid in {proc.pid, *descendants(proc.pid), *ranks}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(30)


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISE)} for r in rows]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    # loads through safetensors
    return AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()


def assert_same_run(a: Path, b: Path) -> None:
    assert metrics(a) == metrics(b)
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def checkpoints(run_dir: Path) -> list[str]:
    return [p.name for p in checkpoint.complete_checkpoints(run_dir)]


# -----------------------------------------------------------------------------
# exact continuation


def test_one_process_killed_mid_step_resumes_to_the_same_metrics_and_parameters(tmp_path):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    finish(start(FAST, ref, faults={"constants": {"checkpoint.KEEP_CHECKPOINTS": 1}}), ref)
    # keeping 1 deleted step 2 once step 4 was complete
    assert checkpoints(ref) == ["step_000004"]
    assert [r["step"] for r in metrics(ref)] == [0, 1, 2, 3, 4]

    # step index 2: the step after checkpoint 2
    proc = start(FAST, run_dir, faults={"pause_in_step": 2})
    wait_for(run_dir / "in_step_2.rank0", proc, run_dir)
    kill_9(proc)
    assert checkpoints(run_dir) == ["step_000002"]
    run(FAST, run_dir)  # --resume auto
    assert "resumed from" in log_of(run_dir) and "step_000002" in log_of(run_dir)
    assert_same_run(ref, run_dir)  # also: no line duplicated or lost, eval at step 0 not repeated


def test_with_rollouts_two_steps_ahead_a_kill_and_a_rerun_end_like_the_uninterrupted_run(
        tmp_path):
    """--max-staleness 2: the checkpoint of step 2 carries the batches of steps 3 and 4, already
    generated by the policies of steps 1 and 2 (loop indices 2 and 3); SIGKILL while the batch of
    loop index 4 is generated, then the same command."""
    args = [*FAST, "--max-staleness", "2", "--steps", "5"]
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    run(args, ref)
    proc = start(args, run_dir, faults={"pause_in_step": 4})
    wait_for(run_dir / "in_step_4.rank0", proc, run_dir)
    kill_9(proc)
    assert checkpoints(run_dir) == ["step_000002"]
    assert sorted(p.name for p in (run_dir / "checkpoints" / "step_000002").glob("ahead_*")) == [
        "ahead_rank0.pt"]
    run(args, run_dir)
    assert "resumed from step 2" in log_of(run_dir)
    assert [r["policy_version"] for r in metrics(run_dir) if "reward" in r] == [0, 0, 0, 1, 2]
    assert_same_run(ref, run_dir)


NOISY_REWARD = """import random
import numpy as np
def noisy(completion, row):
    draw = random.random() + float(np.random.rand())
    return draw, {"correct": completion.strip() == row["answer"]}
"""


def test_a_reward_drawing_random_numbers_gives_identical_runs_resumes_and_two_ranks(tmp_path):
    """A reward that calls random.random() and numpy (weighted with a format term): two runs of
    one command, a run killed mid-step and resumed, and runs moving between 1 and 2 ranks all log
    the same rewards and gradient norms: its random state is seeded per sample by (seed, step,
    slot, k) (unseeded, each warm run's own reseeded random would differ from step 1 on)."""
    (tmp_path / "noisy.py").write_text(NOISY_REWARD)
    args = [*FAST, "--reward", f"{tmp_path}/noisy.py:noisy,0.5*format"]
    ref, again, run_dir, two = (tmp_path / n for n in ("ref", "again", "run", "two"))
    run(args, ref)
    run(args, again)
    assert_same_run(ref, again)
    proc = start(args, run_dir, faults={"pause_in_step": 2})
    wait_for(run_dir / "in_step_2.rank0", proc, run_dir)
    kill_9(proc)
    run(args, run_dir)
    assert "resumed from" in log_of(run_dir)
    assert_same_run(ref, run_dir)
    rows = [r for r in metrics(ref) if "reward" in r]
    for r in rows:  # each term logged apart, their weighted sum the reward
        assert r["reward"] == pytest.approx(r["reward/noisy"] + 0.5 * r["reward/format"])
        assert 0.5 < r["reward/noisy"] < 1.5
    # across world sizes: one rank holds a plain model, two an FSDP2-sharded one (DTensors); a
    # checkpoint of either resumes on the other
    back = tmp_path / "back"
    for run_dir, nprocs in ((two, (1, 2)), (back, (2, 1))):
        run([*args, "--steps", "2"], run_dir, nproc=nprocs[0])
        run(args, run_dir, nproc=nprocs[1])
        assert "resumed from" in log_of(run_dir)
        for a, b in zip(rows, [r for r in metrics(run_dir) if "reward" in r], strict=True):
            # the same draws: their means differ only by the order the ranks sum them in
            assert {k: b[k] for k in ("reward", "reward/noisy", "reward/format", "accuracy")
                    } == pytest.approx({k: a[k] for k in (
                        "reward", "reward/noisy", "reward/format", "accuracy")}, rel=1e-12)
            tolerance = ONE_STEP if a["step"] == 1 else AFTER_UPDATES  # test_staleness.py's
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], **tolerance), a["step"]


@pytest.fixture(scope="module")
def two_rank_chain(tmp_path_factory):
    """Two ranks: an uninterrupted run, and a run that (a) loses rank 1 mid-step, (b) resumes and is
    SIGKILLed whole in the middle of saving checkpoint 4, (c) resumes again and finishes."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    ref, run_dir, out = tmp / "ref", tmp / "run", {}
    proc = start(FAST, run_dir, nproc=2, faults={"pause_in_step": 2, "pause_ranks": [1]})
    wait_for(run_dir / "in_step_2.rank1", proc, run_dir)
    time.sleep(1.0)  # rank 0 runs on into the step's first collective and waits there for rank 1
    t0 = time.monotonic()
    os.kill(int((run_dir / "pid.rank1").read_text()), signal.SIGKILL)
    out["exit_code"] = wait(proc, 90)
    out["exit_seconds"] = time.monotonic() - t0
    out["after_dead_rank"] = checkpoints(run_dir)

    proc = start(FAST, run_dir, nproc=2, faults={"pause_in_save": 4})
    wait_for(run_dir / "in_save_4", proc, run_dir)
    kill_9(proc)
    out["after_killed_save"] = checkpoints(run_dir)
    out["tmp_dirs"] = sorted(p.name for p in (run_dir / "checkpoints").glob("*.tmp"))

    run(FAST, run_dir, nproc=2)
    run(FAST, ref, nproc=2)
    return ref, run_dir, out


def test_when_one_rank_dies_mid_step_the_whole_run_exits_within_a_minute(two_rank_chain):
    _, _, out = two_rank_chain
    assert out["exit_code"] not in (None, 0)
    assert out["exit_seconds"] < 60
    assert out["after_dead_rank"] == ["step_000002"]


def test_a_checkpoint_save_killed_midway_is_never_resumed_from(two_rank_chain):
    _, run_dir, out = two_rank_chain
    assert out["tmp_dirs"] == ["step_000004.tmp"] and out["after_killed_save"] == ["step_000002"]
    assert "resumed from" in log_of(run_dir) and "step_000002" in log_of(run_dir)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # cleaned up by the resume


def test_two_ranks_killed_and_resumed_match_the_uninterrupted_run_in_metrics_and_parameters(
        two_rank_chain):
    ref, run_dir, _ = two_rank_chain
    assert [r["step"] for r in metrics(ref)] == [0, 1, 2, 3, 4]
    assert_same_run(ref, run_dir)
    assert checkpoints(run_dir) == checkpoints(ref) == ["step_000002", "step_000004"]


def test_sigterm_to_one_rank_stops_both_after_a_checkpoint_and_the_rerun_matches(two_rank_chain,
                                                                                tmp_path):
    """A scheduler's SIGTERM reaching rank 1 alone: both ranks finish the step, save, print one
    line and exit 143; the rerun resumes there and ends like the uninterrupted run."""
    ref, _, _ = two_rank_chain
    run_dir = tmp_path / "run"
    proc = start(FAST, run_dir, nproc=2)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists() or \
            len((run_dir / "metrics.jsonl").read_text().splitlines()) < 2:  # eval 0 and step 1
        assert proc.poll() is None and time.monotonic() < deadline, log_of(run_dir)
        time.sleep(0.02)
    os.kill(int((run_dir / "pid.rank1").read_text()), signal.SIGTERM)
    assert wait(proc, 120) not in (None, 0), log_of(run_dir)  # torchrun: a worker exited 143
    log = log_of(run_dir)
    stopped_at = len(metrics(run_dir)) - 1
    assert 1 <= stopped_at < 4 and log.count("exitcode  : 143") == 2, log
    assert log.count(f"interrupted by SIGTERM at step {stopped_at}: saved ") == 1, log
    assert checkpoints(run_dir)[-1] == f"step_{stopped_at:06d}"
    run(FAST, run_dir, nproc=2)
    assert f"resumed from step {stopped_at}" in log_of(run_dir)
    assert_same_run(ref, run_dir)


# -----------------------------------------------------------------------------
# guard rails, all in one faulty two-rank run with --zero-variance filter: step index 0: every
# reward raises (all rewards 0, every group constant: both ranks' batches are empty)
#   step index 1: the first reward call on each rank hangs past REWARD_TIMEOUT_S (0.5 here)
#   step index 2: rank 1's rewards are all 0 (its batch is empty, rank 0's is not)
# step index 3 on: NaN advantages, so non-finite losses; MAX_BAD_STEPS 2 stops the run after step
# index 4


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("faulty") / "run"
    faults = {"reward_raise_at": 0, "reward_hang_at": 1, "constant_reward_at": 2,
              "constant_ranks": [1],
              "nan_from_step": 3, "constants": {"tasks.REWARD_TIMEOUT_S": 0.5,
                                                "nanoareal.MAX_BAD_STEPS": 2,
                                                "checkpoint.KEEP_CHECKPOINTS": 0}}
    args = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "0", "--steps", "6",
            "--ckpt-every", "1", "--zero-variance", "filter"]
    code = wait(start(args, run_dir, nproc=2, faults=faults))  # None: it hung
    return run_dir, code, {r["step"]: r for r in metrics(run_dir)}


def test_a_reward_that_raises_or_exceeds_its_timeout_scores_zero_and_is_counted(faulty_run):
    _, _, rows = faulty_run
    # 8 prompts x 4 samples, all raised
    assert rows[1]["reward_errors"] == 32 and rows[1]["reward"] == 0
    # one hung call per rank, each cut at 0.5 s (it sleeps 30 s)
    assert rows[2]["reward_errors"] == 2
    assert rows[3]["reward_errors"] == 0


def test_a_batch_emptied_by_the_zero_variance_filter_skips_the_step_on_every_rank_without_hanging(
        faulty_run):
    _, code, rows = faulty_run
    assert code is not None  # no hang (it ends with the bad-steps error below)
    assert rows[1]["zero_var_groups"] == 8
    assert rows[1]["grad_norm"] == 0 and rows[1]["skipped_steps"] == 0
    assert rows[3]["grad_norm"] > 0 and rows[3]["skipped_steps"] == 0  # rank 1 empty, rank 0 trains


def test_non_finite_steps_are_skipped_and_stop_the_run_after_max_bad_steps_keeping_checkpoints(
        faulty_run):
    run_dir, code, rows = faulty_run
    assert code not in (None, 0)
    assert "2 steps in a row had a non-finite loss or grad norm" in log_of(run_dir)
    assert sorted(rows) == [1, 2, 3, 4, 5]  # stopped after the second bad step, before step 6
    assert [rows[s]["skipped_steps"] for s in (3, 4, 5)] == [0, 1, 1]
    assert checkpoints(run_dir) == ["step_000001", "step_000002", "step_000003"]  # none after bad
    last_good = run_dir / "checkpoints" / "step_000003"
    assert f"last good checkpoint: {last_good}" in log_of(run_dir)


def test_a_reward_call_that_raises_hangs_or_is_not_finite_scores_zero_and_the_rest_still_run():
    def reward(text, row):
        if text == "raise":
            raise ValueError("bad input")
        if text == "hang":
            time.sleep(5)
        return float("nan") if text == "nan" else float(text == row["answer"])

    t0 = time.monotonic()
    rows = [{"answer": a} for a in ["1", "1", "1", "2", "1", "4"]]
    scores = tasks.compute_rewards(reward, ["1", "raise", "hang", "2", "nan", "3"], rows,
                                   timeout=0.3, seeds=range(6))
    assert [s.reward for s in scores] == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # a failed call has no verdict, and says why
    assert [s.correct for s in scores] == [True, None, None, True, None, False]
    assert [s.reward_error is not None for s in scores] == [False, True, True, False, True, False]
    assert scores[1].reward_error == "ValueError: bad input" and "0.3s" in scores[2].reward_error
    assert time.monotonic() - t0 < 2


# -----------------------------------------------------------------------------
# the pieces of a checkpoint


def test_only_renamed_directories_with_meta_json_count_as_checkpoints_newest_last(tmp_path):
    root = tmp_path / "checkpoints"
    for name, meta in [("step_000010", True), ("step_000002", True), ("step_000020.tmp", True),
                       ("step_000030", False)]:
        (root / name).mkdir(parents=True)
        if meta:
            (root / name / "meta.json").write_text("{}")
    assert checkpoints(tmp_path) == ["step_000002", "step_000010"]


def test_resume_cuts_metrics_back_to_the_checkpoint_step_and_drops_a_line_cut_by_the_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s,
                                        "x": s}) + "\n" for s in range(5)) + '{"step": 5, "x"')
    checkpoint.truncate_metrics(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    assert not list(tmp_path.glob("*.tmp"))


def test_rng_states_round_trip_through_a_weights_only_load(tmp_path):
    import numpy as np

    random.seed(1), torch.manual_seed(1), np.random.seed(1)
    torch.save(checkpoint.rng_states(), tmp_path / "rng.pt")
    expected = random.random(), torch.rand(3), np.random.rand()
    checkpoint.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = random.random(), torch.rand(3), np.random.rand()
    assert expected[0] == got[0] and torch.equal(expected[1], got[1]) and expected[2] == got[2]


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_a_checkpoint_unpickles_nothing_but_plain_data(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    good = {"w": torch.arange(4.0), "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "foreach": None}]}
    dcp.save(good, checkpoint_id=tmp_path / "good", no_dist=True)
    loaded = {"w": torch.zeros(4), "groups": [{"lr": 0.0, "betas": (0.0, 0.0), "foreach": False}]}
    dcp.load(loaded, storage_reader=checkpoint.SafeReader(tmp_path / "good"),
             planner=checkpoint.SafeLoadPlanner(),
             no_dist=True)
    assert torch.equal(loaded["w"], good["w"]) and loaded["groups"] == good["groups"]

    dcp.save({"w": torch.arange(4.0), "groups": [{"lr": Evil()}]}, checkpoint_id=tmp_path / "evil",
             no_dist=True)
    # DCP wraps it in a CheckpointException(BaseException)
    with pytest.raises(BaseException) as refused:
        dcp.load({"w": torch.zeros(4), "groups": [{"lr": 0.0}]},
                 storage_reader=checkpoint.SafeReader(tmp_path / "evil"),
                 planner=checkpoint.SafeLoadPlanner(), no_dist=True)
    assert "Weights only load failed" in str(refused.value) + repr(refused.value)
    (tmp_path / "good" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        checkpoint.SafeReader(tmp_path / "good").read_metadata()


# -----------------------------------------------------------------------------
# config validation: before any work starts, one line naming the flags


def _bad_options(tmp: Path) -> list[tuple[list[str], int, str]]:
    (tmp / "step_000004.tmp").mkdir(exist_ok=True)  # a save that never finished
    return [
        (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "0"], 1,
         "--loss-aggregation-divisor"),
        (["--loss-aggregation-divisor", "8"], 1,
         "--loss-aggregation-divisor is only used by --loss-aggregation"),
        (["--group-size", "1"], 1, "--group-size 1: a sample alone"),
        (["--group-size", "1", "--adv-estimator", "rloo"], 1, "--group-size 1: a sample alone"),
        (["--cp-size", "3"], 2, "--cp-size 3 must divide the number of ranks"),
        (["--correction", "behave", "--correction-threshold", "2"], 1,
         "--correction-threshold: --correction behave has none"),
        (["--max-staleness", "-1"], 1, "--max-staleness -1: must be >= 0"),
        (["--resume", str(tmp / "nope")], 1, "--resume .* is not a complete checkpoint"),
        (["--resume", str(tmp / "step_000004.tmp")], 1, "--resume .* is not a complete checkpoint"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_impossible_options_fail_in_one_line_naming_the_flags(case, tmp_path):
    args, world, message = _bad_options(tmp_path)[case]
    with pytest.raises(UserError, match=message) as e:
        N.validate_config(N.parse_config(args), world=world)
    assert "\n" not in str(e.value) and str(e.value).startswith("config error:")


def test_a_micro_batch_budget_below_the_longest_prompt_plus_max_new_tokens_fails_at_start_up():
    def load(budget: int):
        cfg = N.parse_config(["--micro-batch-tokens", str(budget), "--max-new-tokens", "8"])
        return tasks.load_data(cfg)

    assert max(map(len, load(14).prompts)) == 6  # the longest arithmetic prompt: 6 + 8 fits
    with pytest.raises(UserError, match=r"longest prompt \+ --max-new-tokens is 14 tokens, over "
                                        r"--micro-batch-tokens \(13\)"):
        load(13)


def test_a_sequence_longer_than_the_models_context_fails_at_start_up_naming_both_numbers():
    """tiny-arith was trained on 64 positions: the hf engine would run past them silently, and
    SGLang would reject the request mid-run (it serves prompt + max_new_tokens up to the context
    less tasks.SGLANG_CONTEXT_MARGIN, 2, whole)."""
    load = lambda new: tasks.load_data(N.Config(
        model=str(ROOT / "assets" / "tiny-arith"), dataset="arithmetic", reward="exact_match",
        max_new_tokens=new, micro_batch_tokens=4096))
    assert tasks.SGLANG_CONTEXT_MARGIN == 2
    assert load(56).prompts  # 6 + 56 = 62 = 64 - 2 fits
    with pytest.raises(UserError, match=r"is 63 tokens, over the model's context length \(64\) "
                                        r"less 2"):
        load(57)
