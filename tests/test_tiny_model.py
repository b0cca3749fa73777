"""The shipped warm-start model (assets/tiny-arith) loads with Auto* classes and sits in the
GRPO-able band.

Rebuild it with `python scripts/make_tiny_model.py --out assets/tiny-arith`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tasks import make_arithmetic_task

MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-arith"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_dir_is_small():
    size = sum(p.stat().st_size for p in MODEL_DIR.iterdir())
    assert size < 20 * 2**20
    assert (MODEL_DIR / "model.safetensors").exists()


def test_tokenizer_round_trip(tok):
    ids = tok("12+34=46")["input_ids"]
    assert len(ids) == len("12+34=46")  # one token per char, no bos/eos added
    assert tok.decode(ids) == "12+34=46"
    assert tok.decode(ids + [tok.eos_token_id, tok.pad_token_id],
                      skip_special_tokens=True) == "12+34=46"
    assert tok("12+34=46", add_special_tokens=True)["input_ids"] == ids
    assert tok.decode(tok(" 7 + 8 = 15")["input_ids"]) == " 7 + 8 = 15"  # spaces survive
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    assert tok.bos_token_id is None
    assert {c for c in "0123456789+=" if tok.convert_tokens_to_ids(c) == tok.unk_token_id} == set()


def test_model_config(model, tok):
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id == model.generation_config.pad_token_id
    assert model.dtype == torch.float32
    n_params = sum(p.numel() for p in model.parameters())
    assert 5e5 <= n_params <= 3e6


def _build_script():
    """scripts/make_tiny_model.py as a module: its greedy decoder is what measured build_info's
    accuracy."""
    import importlib.util

    path = MODEL_DIR.parents[1] / "scripts" / "make_tiny_model.py"
    spec = importlib.util.spec_from_file_location("make_tiny_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_heldout_accuracy_in_band(model, tok):
    _, heldout = make_arithmetic_task()
    assert len(heldout) == 256
    completions = _build_script().greedy_complete(model, tok, [it["prompt"] for it in heldout])
    acc = sum(c == it["answer"] for c, it in zip(completions, heldout, strict=True)) / len(heldout)
    assert 0.20 <= acc <= 0.50, acc  # warm, but leaves GRPO room to add 25+ points
    info = json.loads((MODEL_DIR / "build_info.json").read_text())
    assert abs(acc - info["heldout_acc"]) <= 0.02  # matches what the build script measured
