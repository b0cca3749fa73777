"""The chain task (`--dataset chain`): its generator, its reward, the shipped warm start
(assets/tiny-chain) and a short CLI run that logs response lengths by correctness.

Rebuild the model with `OMP_NUM_THREADS=1 python scripts/make_chain_model.py --out
assets/tiny-chain`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
import warm

import nanoareal as N
import tasks
from tasks import chain_scratchpad, chain_values, last_number, make_chain_task

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "assets" / "tiny-chain"
INFO = json.loads((MODEL_DIR / "build_info.json").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
import make_chain_model  # noqa: E402


@pytest.fixture(scope="module")
def split():
    return make_chain_task()


def k_of(row: dict) -> int:
    return len(chain_values(row["prompt"])) - 1


# -----------------------------------------------------------------------------
# the generator


def test_running_values_by_hand():
    assert chain_values("3+4*2            =") == [3, 7, 4]  # 3+4 = 7, 7*2 = 14 -> 4
    assert chain_values("1*8+2+7*1*1") == [1, 8, 0, 7, 7, 7]
    assert chain_scratchpad("4*5*6+5*3*2*4*2+9=") == "4 0 0 5 5 0 0 0 9"


def test_split_is_deterministic_disjoint_and_balanced(split):
    train, heldout = split
    assert (train, heldout) == make_chain_task()
    assert (len(train), len(heldout)) == (17434, 256)
    prompts = [r["prompt"] for r in train]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & {r["prompt"] for r in heldout}
    for row in train[:2000] + heldout:
        assert len(row["prompt"]) == 18 and row["prompt"].endswith("=")
        assert row["answer"] == str(chain_values(row["prompt"])[-1])
        assert "*0" not in row["prompt"]
    # interleaved by k, so every --eval-size prefix of 8n rows has n of each k
    assert [k_of(r) for r in heldout[:16]] == list(range(1, 9)) * 2
    assert {k_of(r) for r in train} == set(range(1, 9))
    other_train, other_heldout = make_chain_task(seed=1)
    assert other_heldout != heldout and len(other_train) == len(train)


def test_the_trainer_uses_the_fixed_split_and_its_own_reward(split):
    # load_dataset takes no run seed: every --seed trains and evaluates on this one split
    assert tasks.load_dataset("chain", None, "auto", "prompt") == split
    assert N.Config(dataset="chain").reward == "last_number"
    assert tasks.load_reward("last_number") is last_number


# -----------------------------------------------------------------------------
# answer extraction and reward


@pytest.mark.parametrize("completion, correct, scratchpad", [
    ("1 8 0 7 7 7", True, True),     # a scratchpad: only its last value counts
    ("7", True, False),              # the bare answer
    (" 7 ", True, False),
    ("07", True, False),             # compared as integers
    ("1 8 0 7 7 6", False, True),    # a wrong final value
    ("7 7 7 7 6", False, True),      # the right value earlier does not help
    ("", False, False),              # no number at all
    ("+*= ", False, False),
    ("-7", False, False),
])
def test_last_number_judges_the_final_number_only(completion, correct, scratchpad):
    reward, metrics = last_number(completion, {"answer": "7"})
    assert reward == float(correct) and metrics == {"correct": correct,
                                                    "scratchpad": float(scratchpad)}
    assert last_number(completion, {"answer": 7})[0] == reward  # an integer answer too
    score = tasks.score_one(last_number, completion, {"answer": "7"})
    assert score.correct is correct and score.metrics == {"scratchpad": float(scratchpad)}


# -----------------------------------------------------------------------------
# the shipped warm start


@pytest.fixture(scope="module")
def model_and_tok():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    return (AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval(),
            AutoTokenizer.from_pretrained(MODEL_DIR))


def test_shipped_files_are_what_the_builder_wrote():
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size < 8 * 2**20
    sha = hashlib.sha256((MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert sha == INFO["model_safetensors_sha256"]
    defaults = vars(make_chain_model.parse_args([]))
    assert INFO["args"] == defaults  # built by the plain command, nothing tuned by hand


def test_heldout_accuracy_in_band_with_both_formats(model_and_tok, split):
    model, tok = model_and_tok
    assert tok.get_vocab() == make_chain_model.build_tokenizer().get_vocab() == INFO["vocab"]
    ev = make_chain_model.evaluate(model, tok, split[1])
    args = INFO["args"]
    assert args["stop_low"] <= ev["acc"] <= args["stop_high"]
    assert abs(ev["acc"] - INFO["heldout_acc"]) <= 0.02  # what the builder measured
    # lengths vary: bare digits (2 tokens) and scratchpads up to 18 tokens, and the scratchpad is
    # the better format, so GRPO has a reason to lengthen responses
    assert 0.2 <= ev["scratch_frac"] <= 0.8
    assert ev["len_min"] == 2 and ev["len_max"] >= 16 and ev["len_std"] > 4
    assert ev["acc_scratch"] > ev["acc_direct"] + 0.1


def test_builder_replays_its_first_sft_steps(split):
    """The build's first steps from scratch: same initialisation, batches, formats and updates
    as build_info.json recorded (bit-identical on the build machine; 1e-4 allows other CPUs'
    rounding, while any change of recipe moves the losses by far more)."""
    args = make_chain_model.parse_args([])
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tok = make_chain_model.build_tokenizer()
    model = make_chain_model.build_model(tok)
    steps = make_chain_model.sft_steps(model, tok, split[0], args)
    losses = [next(steps) for _ in INFO["first_losses"]]
    assert len(losses) == make_chain_model.FIRST_LOSSES
    assert losses == pytest.approx(INFO["first_losses"], abs=1e-4)
    assert losses[-1] < losses[0] - 0.5


# -----------------------------------------------------------------------------
# the CLI


def test_cli_help_names_the_task():
    proc = warm.run([sys.executable, str(ROOT / "nanoareal.py"), "--help"], cwd=ROOT,
                    env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                    text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"arithmetic,\s+chain", proc.stdout), proc.stdout


def test_two_step_cli_run_logs_lengths_by_correctness(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--dataset", "chain", "--model",
           str(MODEL_DIR), "--steps", "2", "--max-new-tokens", "32", "--prompts-per-step", "8",
           "--eval-every", "2", "--run-dir", str(run_dir)]
    proc = warm.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert len(evals) == 2
    # the trainer's greedy engine agrees with the builder's decoder on the 256 held-out rows
    assert abs(evals[0] - INFO["heldout_acc"]) <= 0.02
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["truncated_frac"] == 0  # 32 new tokens hold the longest scratchpad (18 + eos)
        assert 0 <= r["reward/scratchpad"] <= 1
        assert 2 <= r["response_len/correct"] <= 18
        assert 2 <= r["response_len/incorrect"] <= 18
        assert r["accuracy"] == r["reward"]


def test_the_task_brings_its_model_and_flags_unless_the_user_gives_them(tmp_path):
    """`--dataset chain` alone used to train the arithmetic model on the chain task."""
    import nanoareal as N

    cfg = N.parse_config(["--dataset", "chain"])
    assert Path(cfg.model).name == "tiny-chain"
    assert (cfg.max_new_tokens, cfg.prompts_per_step, cfg.reward) == (32, 32, "last_number")
    toml = tmp_path / "c.toml"
    toml.write_text('dataset = "chain"\nprompts_per_step = 16\n')
    cfg = N.parse_config(["--config", str(toml), "--max-new-tokens", "24"])
    assert Path(cfg.model).name == "tiny-chain"
    assert (cfg.max_new_tokens, cfg.prompts_per_step) == (24, 16)  # the user's flags win
