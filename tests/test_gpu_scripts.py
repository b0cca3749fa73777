"""The GPU scripts' CPU-safe parts, so that they cannot rot between GPU runs:
tests/gpu/check_sglang.py imports, answers --help, skips cleanly without CUDA or sglang, its
trainer-side log-probs run through the trainer's own functions (checked against the hf engine),
and its GRPO command names only flags the trainer has."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang_standin import save_tiny_llama

torch.set_num_threads(1)
SCRIPT = Path(__file__).resolve().parent / "gpu" / "check_sglang.py"


@pytest.fixture(scope="module")
def check_sglang():
    spec = importlib.util.spec_from_file_location("check_sglang", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_sglang_answers_help_without_a_gpu():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "logprob parity" in proc.stdout and "--model" in proc.stdout


def test_check_sglang_exits_0_with_a_skipped_line_without_cuda(check_sglang, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_sglang.main(["--model", "unused"]) == 0
    assert capsys.readouterr().out == "check_sglang: skipped (no CUDA device)\n"


def test_check_sglangs_trainer_logprobs_equal_the_hf_engines_on_cpu(check_sglang, tmp_path):
    from transformers import AutoModelForCausalLM

    from rollout import HFEngine

    model_dir = save_tiny_llama(tmp_path)
    model = check_sglang.trainer_model(AutoModelForCausalLM.from_pretrained(model_dir))
    prompts = [[3 + i, 13, 4 + i, 14] for i in range(3)]
    mean, mx, n = check_sglang.parity(HFEngine(model_dir), model, prompts, 0.7, [0, 1, 2],
                                      max_new_tokens=8)
    assert n > 3 and mx < 1e-5


def test_check_sglangs_grpo_command_names_only_flags_the_trainer_has(check_sglang):
    import nanoareal

    cmd = check_sglang.grpo_command("model", "data.jsonl", 20, "runs/x")
    flags = {a[2:].replace("-", "_") for a in cmd if a.startswith("--")}
    assert flags <= {f.name for f in dataclasses.fields(nanoareal.Config)}
