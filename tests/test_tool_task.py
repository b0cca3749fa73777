"""The calc task (`--dataset calc`), where a tool genuinely helps: its generator, the shipped
calculator (an --env like a user's), the shipped warm start (assets/tiny-calc), which calls the
calculator sometimes and is right far more often with it than without, its builder, and a short
CLI run through configs/calc.toml.

Rebuild the model with `OMP_NUM_THREADS=1 python scripts/make_calc_model.py --out assets/tiny-calc`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm

import nanoareal as N
import tasks
from rollout import HFEngine, SamplingParams, mix_seed, run_episodes
from tasks import last_number, make_calc_task

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "assets" / "tiny-calc"
ENV = "assets/tiny-calc/calculator.py:Calculator"
INFO = json.loads((MODEL_DIR / "build_info.json").read_text())
sys.path.insert(0, str(ROOT / "scripts"))
import make_calc_model  # noqa: E402


@pytest.fixture(scope="module")
def split():
    return make_calc_task()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(MODEL_DIR)


def test_split_is_deterministic_disjoint_and_right(split):
    train, heldout = split
    assert (train, heldout) == make_calc_task()
    assert (len(train), len(heldout)) == (2 * 90 * 90 - 256, 256)
    prompts = [r["prompt"] for r in train + heldout]
    assert len(set(prompts)) == len(prompts)
    assert {"+", "*"} <= {r["prompt"][2] for r in heldout}  # both ops held out
    for row in heldout:
        a, b = int(row["prompt"][:2]), int(row["prompt"][3:5])
        assert row["answer"] == str(a + b if row["prompt"][2] == "+" else a * b)
    assert tasks.load_dataset("calc", None, "auto", "prompt") == (train, heldout)


def test_the_task_brings_its_model_and_the_config_adds_the_tool():
    cfg = N.parse_config(["--dataset", "calc"])
    assert Path(cfg.model).name == "tiny-calc" and cfg.env is None  # no tool: calls unanswered
    assert (cfg.max_new_tokens, cfg.reward) == (16, "last_number")
    cfg = N.parse_config(["--config", str(ROOT / "configs" / "calc.toml")])
    assert (cfg.dataset, cfg.env) == ("calc", ENV)


def test_calculator_answers_calls_and_refuses_the_rest(tok):
    calc = tasks.load_plugin("--env", str(ROOT / ENV))({"prompt": "37*48=", "answer": "1776"})
    assert calc.step("[37*48]") == "1776" and calc.step("[12+30]") == "42"
    assert calc.step("1[99*99]") == "9801"  # the call that ends the turn
    for junk in ("[37*]", "[37-4]", "37*48]", "[]", "[a+b]"):
        assert calc.step(junk) == "?"
    tools = tasks.load_env(str(ROOT / ENV), tok, False)
    assert tools.stop_ids == [tok.convert_tokens_to_ids("]")]
    assert tok.decode(tools.encode("1776?")) == "1776?"  # every reply is in the vocabulary


def test_shipped_files_are_what_the_builder_wrote():
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size < 5 * 2**20
    sha = hashlib.sha256((MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert sha == INFO["model_safetensors_sha256"]
    assert INFO["args"] == vars(make_calc_model.parse_args([]))  # the plain command


def test_shipped_model_calls_the_tool_sometimes_and_is_right_more_often_with_it(split, tok):
    """64 held-out prompts x 2 samples (temperature 1, fixed seeds) through the trainer's own
    episode code: some calls, mostly right; head answers mostly wrong; the same samples without
    the calculator (calls unanswered) far less often right. Room for RL: call more."""
    torch.set_num_threads(1)
    engine, tools = HFEngine(str(MODEL_DIR)), make_calc_model.calc_tools(tok)
    rows = [r for r in split[1][:64] for _ in range(2)]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    seeds = [mix_seed(7, i) >> 1 for i in range(len(rows))]
    sampling = SamplingParams(16, 1.0, stop_token_ids=[tok.eos_token_id])
    verdicts = {}
    for name, t in (("tool", tools), ("none", None)):
        outs = run_episodes(engine, prompts, sampling, seeds, t, rows)
        texts = tok.batch_decode([o.output_ids for o in outs], skip_special_tokens=True)
        verdicts[name] = [(x.startswith("["), last_number(x, r)[1]["correct"])
                          for x, r in zip(texts, rows)]
    calls = [ok for called, ok in verdicts["tool"] if called]
    head = [ok for called, ok in verdicts["tool"] if not called]
    assert 0.1 <= len(calls) / len(rows) <= 0.6
    assert sum(calls) / len(calls) >= 0.7 and sum(head) / len(head) <= 0.1
    acc = {k: sum(ok for _, ok in v) / len(rows) for k, v in verdicts.items()}
    assert acc["tool"] >= acc["none"] + 0.1, acc


def test_builder_replays_its_first_sft_steps(split):
    """The build's first steps from scratch reproduce build_info.json (1e-4: other CPUs' rounding;
    a change of recipe moves the losses by far more)."""
    args = make_calc_model.parse_args([])
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tok = make_calc_model.build_tokenizer(make_calc_model.CALC_CHARS)
    assert tok.get_vocab() == INFO["vocab"]
    model = make_calc_model.build_model(tok)
    steps = make_calc_model.sft_steps(model, tok, split[0], args)
    losses = [next(steps) for _ in range(4)]  # 4 of the 10 recorded: a recipe change shows
    assert losses == pytest.approx(INFO["first_losses"][:4], abs=1e-4)


def test_builder_runs_end_to_end_in_a_tiny_config(tmp_path, monkeypatch, split):
    """The whole script (SFT, the evaluations through run_episodes, save, build_info, README) with
    a stop rule that holds at the first evaluation, on 16 held-out prompts."""
    monkeypatch.setattr(make_calc_model, "make_calc_task", lambda seed: (split[0], split[1][:16]))
    monkeypatch.setattr(sys, "argv", ["make_calc_model.py", "--out", str(tmp_path), "--batch-size",
                                      "16", "--eval-every", "2", "--min-call-acc", "0",
                                      "--min-acc", "0"])
    make_calc_model.main()
    info = json.loads((tmp_path / "build_info.json").read_text())
    assert info["sft_steps"] == 2 and set(info["heldout"]) >= {"greedy", "sampled_tool"}
    assert "| greedy, calculator |" in (tmp_path / "README.md").read_text()
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path).num_parameters() == INFO["n_params"]


def test_two_step_cli_run_with_the_calculator_logs_tool_calls(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--config", "configs/calc.toml",
           "--steps", "2", "--prompts-per-step", "8", "--eval-every", "2", "--run-dir",
           str(run_dir)]
    proc = warm.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2 and all(0 < r["env/tool_calls"] < 1 for r in steps)
    assert all(r["env/errors"] == 0 for r in steps)
    # greedy held-out with the calculator, as the builder measured it
    assert abs(rows[0]["eval/accuracy"] - INFO["heldout"]["greedy"]["all"]["acc"]) <= 0.02
