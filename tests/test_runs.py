"""A user's runs are never lost and a user's mistakes are one line (issue 13). Every test here runs
the real CLI: the mistakes table (exit code 2, one stderr line, nothing on disk touched), run
directories (two different commands keep both runs, the same command resumes, --resume fresh
moves the old run aside, resuming an older checkpoint sets the newer ones aside), SIGINT mid-run
then a rerun that ends exactly like an uninterrupted run, and each way a checkpoint can be
broken."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import warm

import checkpoint
import modeling

ROOT = Path(__file__).resolve().parents[1]
CLI = str(ROOT / "nanoareal.py")
MODEL = str(ROOT / "assets" / "tiny-arith")
# a small run: 8 prompts x 4 samples a step, 16 held-out rows
SMALL = ["--model", MODEL, "--prompts-per-step", "8", "--group-size", "4", "--eval-every", "2"]
NOISE = ("time/", "gen_tokens_per_s", "train_tokens_per_s")  # wall-clock: differs between runs


def cli(args: list[str], cwd: Path, env: dict | None = None, nproc: int = 1,
        timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, CLI, *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", CLI, *args]
    return warm.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                    env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(NOISE)} for r in rows]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with a hash of its bytes: what 'nothing changed on disk' compares."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# -----------------------------------------------------------------------------
# every mistake one line


# --env classes that break the contract (tasks.load_env): the tiny model's vocabulary is 18 ids
ENVS = """
class ZeroTurns:
    stop = ["="]
    max_turns = 0
    def __init__(self, row): pass
    def step(self, text): return None

class FarStop:
    stop = ["=", 18]
    def __init__(self, row): pass
    def step(self, text): return None

class TakesTokenizer:
    stop = ["="]
    def __init__(self, row, tokenizer): pass
    def step(self, text): return None

class StepTakesState:
    stop = ["="]
    def __init__(self, row): pass
    def step(self, text, state): return None
"""


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working directory holding another run (results and config.json) and the broken inputs
    the mistakes table points at."""
    box = tmp_path_factory.mktemp("mistakes")
    other = box / "runs" / "other"
    (other / "checkpoints" / "step_000001").mkdir(parents=True)
    (other / "checkpoints" / "step_000001" / "meta.json").write_text('{"step": 1}')
    (other / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (other / "config.json").write_text(json.dumps({"dataset": "arithmetic", "seed": 1}))
    (box / "not_a_model").mkdir()
    (box / "not_a_model" / "notes.txt").write_text("no config.json here")
    (box / "no_tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(MODEL) / name, box / "no_tokenizer" / name)
    (box / "steps_ten.toml").write_text('steps = "ten"\n')
    (box / "unknown_key.toml").write_text("stepz = 3\n")
    (box / "broken.toml").write_text("steps = \n")
    (box / "messages.jsonl").write_text(json.dumps(
        {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    (box / "letters.jsonl").write_text(json.dumps({"prompt": "what is love", "answer": "2"}) + "\n")
    (box / "blank.jsonl").write_text(json.dumps({"prompt": "", "answer": "2"}) + "\n")
    (box / "ok.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (box / "reward.py").write_text("def score(completion, row):\n    return 1.0\n")
    (box / "hf_home").mkdir()  # an empty Hugging Face cache
    adapter = {"peft_type": "LORA", "r": 2, "lora_alpha": 32, "target_modules": "all-linear",
               "base_model_name_or_path": MODEL}  # a LoRA adapter of the shipped model
    for name, text in (("arith_adapter", json.dumps(adapter)),
                       ("truncated_adapter", json.dumps(adapter)[:40]),  # a copy cut short
                       ("incomplete_adapter", json.dumps(  # no lora_alpha, no target_modules
                           {k: adapter[k] for k in ("peft_type", "r", "base_model_name_or_path")}
                       ))):
        (box / name).mkdir()
        (box / name / "adapter_config.json").write_text(text)
    (box / "envs.py").write_text(ENVS)
    return box



CPU_ONLY = not torch.cuda.is_available()
# (flags, what the one line must say, only meaningful on a machine without a GPU)
MISTAKES = [
    (["--model", "{box}/missing/model"], "no such directory", False),
    (["--model", "{box}/not_a_model"], "no config.json", False),
    (["--model", "{box}/no_tokenizer"], "no tokenizer files", False),
    (["--model", "Qwen/Qwen2.5-0.5B"], "not in the local Hugging Face cache", False),
    (["--lr", "-1"], "--lr", False),
    (["--grad-clip", "-1"], "--grad-clip", False),
    (["--max-staleness", "-2"], "--max-staleness", False),
    (["--correction-threshold", "2"], "--correction-threshold: --correction none has none", False),
    (["--temperature", "0"], "--temperature", False),
    (["--group-size", "1"], "--group-size", False),
    (["--steps", "ten"], "--steps", False),
    (["--stepz", "3"], "did you mean --steps", False),
    (["--config", "{box}/steps_ten.toml"], "--steps", False),
    (["--config", "{box}/unknown_key.toml"], "unknown key 'stepz'", False),
    (["--config", "{box}/broken.toml"], "broken.toml", False),
    (["--config", str(ROOT / "configs" / "qwen2.5-0.5b-gsm8k.toml")], "needs a GPU", True),
    (["--cp-size", "3"], "--cp-size 3", False),
    (["--rollout-backend", "sglang_deterministic"], "needs a GPU", True),
    (["--rollout-backend", "sglang"], "needs a GPU", True),
    (["--dataset", "{box}/messages.jsonl"], "chat template", False),
    (["--dataset", "{box}/letters.jsonl"], "cannot encode", False),
    (["--dataset", "{box}/blank.jsonl"], "row 1's prompt is empty", False),
    (["--dataset", "{box}/missing.jsonl"], "missing.jsonl", False),
    (["--eval-dataset", "{box}/ok.jsonl"], "--eval-dataset", False),
    (["--micro-batch-tokens", "8"], "over --micro-batch-tokens (8)", False),
    (["--reward", "{box}/missing.py:score"], "no such file", False),
    (["--reward", "{box}/reward.py:nope"], "no function 'nope'", False),
    (["--run-dir", "runs/other"], "holds another run", False),
    (["--resume", "{box}/not_a_model"], "--resume", False),
    (["--eval-k", "-1"], "--eval-k", False),
    (["--lora-rank", "-1"], "--lora-rank -1", False),
    (["--ppo-epochs", "0"], "--ppo-epochs 0", False),
    (["--overlong-buffer", "9"], "--overlong-buffer 9: must be in [0, --max-new-tokens]",
     False),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]", False),
    (["--top-k", "0"], "--top-k 0: use -1 (all) or >= 1", False),
    (["--env", "{box}/envs.py:ZeroTurns"], "its .max_turns must be an int >= 1, got 0", False),
    (["--lora-adapter", "{box}/not_a_model"], "is not a PEFT adapter directory", False),
    (["--model", str(ROOT / "assets" / "tiny-chain"), "--lora-adapter", "{box}/arith_adapter"],
     "is an adapter of", False),  # an adapter for another base
    # issue 43 item 12: adapter configs cut short or missing fields, as --lora-adapter or --model
    (["--lora-adapter", "{box}/truncated_adapter"], "not a readable adapter config", False),
    (["--model", "{box}/truncated_adapter"], "not a readable adapter config", False),
    (["--lora-adapter", "{box}/incomplete_adapter"],
     "incomplete LoRA adapter config (no valid lora_alpha, target_modules)", False),
    (["--model", "{box}/incomplete_adapter"],
     "incomplete LoRA adapter config (no valid lora_alpha, target_modules)", False),
    # an env whose stop no policy can ever sample, or that does not fit the contract: at start
    (["--env", "{box}/envs.py:FarStop"],
     "stop token id 18 is outside the tokenizer's vocabulary of 18 ids", False),
    (["--env", "{box}/envs.py:TakesTokenizer"],
     "TakesTokenizer(row) must take the dataset row as its one argument, not (row, tokenizer)",
     False),
    (["--env", "{box}/envs.py:StepTakesState"], "StepTakesState(row).step(text) must take the "
     "turn's text as its one argument, not (self, text, state)", False),
]


def test_every_mistake_is_one_line_exit_code_2_and_touches_nothing_on_disk(sandbox):
    """The first two mistakes as their own `python nanoareal.py` processes, the rest through the
    CLI's entry in one process (tests/support/cli_cases.py: one import of torch, not one each)."""
    before = snapshot(sandbox)
    env = {"HF_HOME": str(sandbox / "hf_home"), "HF_HUB_OFFLINE": "1"}
    cases = [[a.format(box=sandbox) for a in flags] + ([] if "--steps" in flags else
                                                       ["--steps", "1"])
             for flags, _, cpu_only in MISTAKES if CPU_ONLY or not cpu_only]
    driver = subprocess.run([sys.executable, str(ROOT / "tests" / "support" / "cli_cases.py")],
                            input=json.dumps(cases[2:]), cwd=sandbox, capture_output=True,
                            text=True, timeout=300,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **env))
    assert driver.returncode == 0, driver.stderr[-3000:]
    imported, *results = json.loads(driver.stdout.splitlines()[-1])
    assert imported["import"] == ""
    with ThreadPoolExecutor(2) as pool:  # the real process: exit status, interpreter, imports
        results = [*pool.map(lambda args: cli(args, sandbox, env, timeout=120), cases[:2]),
                   *(subprocess.CompletedProcess([], r["code"], r["stdout"], r["stderr"])
                     for r in results)]
    expected = [says for _, says, cpu_only in MISTAKES if CPU_ONLY or not cpu_only]
    wrong = []  # every case that goes wrong, not only the first
    for args, says, out in zip(cases, expected, results, strict=True):
        lines = out.stderr.strip().splitlines()
        if out.returncode != 2 or len(lines) != 1:
            wrong.append((args, out.returncode, out.stderr[-3000:]))
        elif says not in lines[0] or "Traceback" in out.stdout:
            wrong.append((args, says, lines[0]))
        elif not lines[0].startswith(("error", "config error")):
            wrong.append((args, lines[0]))
    assert not wrong, "\n".join(map(str, wrong))
    assert snapshot(sandbox) == before  # no file written, changed or removed
    assert sorted(p.name for p in (sandbox / "runs").iterdir()) == ["other"]  # no new run dirs


def test_a_config_error_under_torchrun_is_shown_once_and_last(tmp_path):
    out = cli(["--cp-size", "3", "--steps", "1"], tmp_path, nproc=2, timeout=120)
    message = "config error: --cp-size 3 must divide the number of ranks (2)"
    text = out.stdout + out.stderr
    assert out.returncode != 0 and text.count(message) == 1, text[-3000:]
    # torchrun's failure summary ends with the root cause, which carries the message
    tail = [line for line in out.stderr.strip().splitlines() if line.strip("=")][-1]
    assert tail.strip() == f"traceback : {message}", out.stderr[-2000:]


# -----------------------------------------------------------------------------
# run directories: another command never writes into a run; the same command resumes it


def test_the_two_headline_commands_in_a_row_keep_both_runs_and_a_rerun_resumes(tmp_path):
    first = cli([*SMALL, "--steps", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = cli([*SMALL, "--steps", "2", "--loss-aggregation", "prompt_mean"], tmp_path,
                 nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2, runs  # runs/arithmetic-token_mean-s0-<hash>, ...-prompt_mean-...
    assert {r.name.split("-")[1] for r in runs} == {"token_mean", "prompt_mean"}
    for run in runs:
        assert [m["step"] for m in metrics(run)] == [0, 1, 2]
        assert (run / "final" / "model.safetensors").is_file()
    token_mean = next(r for r in runs if "token_mean" in r.name)
    before = metrics(token_mean)

    # the first command again, longer (--steps does not change the run): it continues the run
    again = cli([*SMALL, "--steps", "3"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 2" in again.stdout
    assert len(list((tmp_path / "runs").iterdir())) == 2
    assert metrics(token_mean)[:3] == before and metrics(token_mean)[3]["step"] == 3

    # starting it over (--resume fresh) moves the old run aside, never deletes it
    fresh = cli([*SMALL, "--steps", "1", "--resume", "fresh"], tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    aside = token_mean.with_name(token_mean.name + ".old-1")
    assert metrics(aside)[:3] == before and len(metrics(aside)) == 4  # kept whole
    assert [m["step"] for m in metrics(token_mean)] == [0, 1]

    # a run with nothing left to train still writes its export (one killed mid-export lacks it)
    shutil.rmtree(token_mean / "final")
    done = cli([*SMALL, "--steps", "1"], tmp_path)
    assert done.returncode == 0 and "nothing left to train" in done.stdout, done.stderr[-3000:]
    assert (token_mean / "final" / "model.safetensors").is_file()


# -----------------------------------------------------------------------------
# preemption: SIGINT finishes the step, saves, says how to resume; the rerun equals a run that
# was never interrupted


def test_sigint_mid_run_saves_and_the_rerun_ends_like_an_uninterrupted_run(tmp_path):
    args = [*SMALL, "--steps", "6"]
    ref = cli([*args, "--run-dir", str(tmp_path / "ref")], tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]

    run_dir = tmp_path / "run"
    proc = warm.Popen([sys.executable, CLI, *args, "--run-dir", str(run_dir)], cwd=tmp_path,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or \
            len((run_dir / "metrics.jsonl").read_text().splitlines()) < 3:  # eval 0, steps 1-2
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    stopped_at = len(metrics(run_dir)) - 1
    assert 2 <= stopped_at < 6
    assert out.strip().splitlines()[-1] == (
        f"interrupted by SIGINT at step {stopped_at}: saved {run_dir}/checkpoints/"
        f"step_{stopped_at:06d}; rerun the same command to resume from step {stopped_at}")

    rerun = cli([*args, "--run-dir", str(run_dir)], tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in rerun.stdout
    assert metrics(run_dir) == metrics(tmp_path / "ref")


# -----------------------------------------------------------------------------
# a broken newest checkpoint is named, set aside and the one before is used


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("broken") / "run"
    out = cli([*SMALL, "--steps", "2", "--ckpt-every", "1", "--run-dir", str(run_dir)],
              run_dir.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir)] == ["step_000001",
                                                                          "step_000002"]
    return run_dir


def _truncate_a_shard(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


CORRUPTIONS = {
    "truncated shard": (_truncate_a_shard, "is truncated"),
    "empty meta.json": (lambda c: (c / "meta.json").write_text(""), "meta.json"),
    "invalid meta.json": (lambda c: (c / "meta.json").write_text('{"step": '), "meta.json"),
    "meta.json without a step": (lambda c: (c / "meta.json").write_text("[]"), "no step"),
    "missing shard": (lambda c: sorted(c.glob("*.distcp"))[0].unlink(), "is missing"),
    "missing .metadata": (lambda c: (c / ".metadata").unlink(), ".metadata"),
    "missing rng state": (lambda c: (c / "rng_rank0.pt").unlink(), "rng_rank0.pt is missing"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_each_corruption_of_the_newest_checkpoint_is_named_set_aside_and_skipped(
        two_checkpoints, tmp_path, corruption, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    corrupt, why = CORRUPTIONS[corruption]
    newest = run_dir / "checkpoints" / "step_000002"
    corrupt(newest)
    found = checkpoint.newest_usable(run_dir)
    said = capsys.readouterr().out.splitlines()
    assert found == run_dir / "checkpoints" / "step_000001"
    assert len(said) == 1 and str(newest) in said[0] and why in said[0], said
    assert not newest.exists() and (run_dir / "checkpoints" / "step_000002.broken").is_dir()


def test_the_cli_resumes_from_the_checkpoint_before_a_broken_one(two_checkpoints, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    _truncate_a_shard(run_dir / "checkpoints" / "step_000002")
    out = cli([*SMALL, "--steps", "2", "--ckpt-every", "1", "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    warning = [line for line in out.stdout.splitlines() if "unreadable" in line]
    assert len(warning) == 1 and "step_000002" in warning[0] and "truncated" in warning[0]
    assert "resumed from step 1" in out.stdout
    assert metrics(run_dir) == metrics(two_checkpoints)  # step 2 trained again, identically
    assert (run_dir / "checkpoints" / "step_000002.broken").is_dir()  # set aside, not deleted


def test_resuming_an_older_checkpoint_sets_the_newer_ones_aside(two_checkpoints, tmp_path):
    """A new timeline from step 1: step 2 of the old one is renamed (kept, never deleted), so a
    later auto-resume cannot jump back onto it while metrics.jsonl holds the new timeline."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    old = run_dir / "checkpoints" / "step_000002"
    out = cli([*SMALL, "--steps", "1", "--resume", str(run_dir / "checkpoints" / "step_000001"),
               "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"set aside {old}" in out.stdout and "resumed from step 1" in out.stdout
    assert not old.exists() and old.with_name("step_000002.abandoned").is_dir()
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir)] == ["step_000001"]


def test_resuming_the_same_older_checkpoint_twice_keeps_both_abandoned_timelines(
        two_checkpoints, tmp_path):
    """The second time, step_N.abandoned is taken: the newer checkpoint becomes .abandoned-1."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    older = run_dir / "checkpoints" / "step_000001"
    first = run_dir / "checkpoints" / "step_000002.abandoned"
    first.mkdir()
    assert checkpoint.choose_resume(run_dir, str(older), True) == str(older)
    assert first.is_dir() and (run_dir / "checkpoints" / "step_000002.abandoned-1").is_dir()
    assert [p.name for p in checkpoint.complete_checkpoints(run_dir)] == ["step_000001"]


# -----------------------------------------------------------------------------
# a LoRA run's checkpoint given without --lora-rank brings its rank (issue 43 item 12)


PLAIN = [*SMALL, "--eval-every", "1", "--ckpt-every", "1"]  # no --lora-rank
LORA = [*PLAIN, "--lora-rank", "2"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A LoRA run of 2 steps, a checkpoint and an eval after each."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    out = cli([*LORA, "--steps", "2", "--run-dir", str(run_dir)], run_dir.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def test_a_lora_checkpoint_given_as_model_without_lora_rank_evaluates_with_its_rank(lora_run,
                                                                                   tmp_path):
    """--model naming a LoRA run's checkpoint, --steps 0, no --lora-rank: the evaluation adopts
    the checkpoint's rank (a model without adapters could not load its state: a traceback)."""
    out = cli([*PLAIN, "--steps", "0", "--model", str(lora_run / "checkpoints" / "step_000001"),
               "--run-dir", str(tmp_path / "eval")], tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "evaluating step 1" in out.stdout and "LoRA r=2 " in out.stdout, out.stdout[-2000:]
    assert json.loads((tmp_path / "eval" / "config.json").read_text())["lora_rank"] == 2
    evals = {r["step"]: r["eval/accuracy"] for r in metrics(lora_run)}
    assert metrics(tmp_path / "eval") == [{"step": 1, "eval/accuracy": evals[1]}]


def test_a_lora_checkpoint_given_without_lora_rank_resumes_as_the_uninterrupted_run(lora_run,
                                                                                  tmp_path):
    """--resume (into its own run) or --model (into another) naming a LoRA run's checkpoint, no
    --lora-rank: the run continues with the checkpoint's rank, and LoRA's flags with it (its
    default --lr), exactly as the run that was never stopped."""
    run_dir = tmp_path / "run"
    out = cli([*LORA, "--steps", "1", "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = cli([*PLAIN, "--steps", "2", "--resume", str(run_dir / "checkpoints" / "step_000001"),
               "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 1" in out.stdout and "LoRA r=2 " in out.stdout
    assert metrics(run_dir) == metrics(lora_run)

    again = tmp_path / "again"
    out = cli([*PLAIN, "--steps", "2", "--model", str(lora_run / "checkpoints" / "step_000001"),
               "--run-dir", str(again)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step 1" in out.stdout and "LoRA r=2 " in out.stdout
    assert metrics(again) == [r for r in metrics(lora_run) if r["step"] == 2]


@pytest.mark.parametrize("value, offline", [("1", True), ("TRUE", True), ("yes", True),
                                            ("0", False), ("false", False), ("", False)])
def test_hf_offline_is_read_as_huggingface_hub_reads_it(monkeypatch, tmp_path, value, offline):
    """HF_HUB_OFFLINE=false is online (huggingface_hub's truthy values are 1/on/yes/true)."""
    from cli import UserError
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://127.0.0.1")  # online: refused at once
    with pytest.raises(UserError) as refused:
        modeling.check_model_source("nobody/no-such-model")
    assert ("HF_HUB_OFFLINE is set" in str(refused.value)) == offline
    assert offline or "cannot be reached" in str(refused.value)
