"""Rules 1, 3, 5, 6 of loss.py's contract across processes: the trainer's step
(nanoareal.train_minibatch) under FSDP2 on gloo (2 ranks) against one process, one micro-batch.

One torchrun launch (tests/support/fsdp_loss_worker.py) runs every case; rank 0 saves the
results and each test below checks one case. Float32 model: agreement 1e-5 relative to the
largest reference gradient.
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import subprocess
import sys

import fsdp_loss_worker as W
import pytest
import torch
import torch.distributed as dist
import warm
from fsdp_loss_worker import CASES, ZERO_CASE

import loss as L

torch.set_num_threads(1)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "results.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
           "127.0.0.1",
           "--master_port", str(free_port()), "tests/support/fsdp_loss_worker.py", str(out)]
    try:
        proc = warm.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    # a hang (mismatched collectives) must fail, not block CI
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun worker timed out (hang?)\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, (f"worker failed\nSTDOUT\n{proc.stdout[-4000:]}\n"
                                  f"STDERR\n{proc.stderr[-8000:]}")
    return torch.load(out, weights_only=False)


def assert_grads_match(grads: dict, ref: dict) -> None:
    assert grads.keys() == ref.keys()
    scale = max(float(g.abs().max()) for g in ref.values())
    assert scale > 0
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("fsdp_")])
def test_fsdp2_two_ranks_equal_one_process_one_microbatch(results, case):
    """Groups span the two ranks, ranks hold different numbers of real micro-batches (padded with
    empty ones), and FSDP2's averaging is undone by the divide factor (gradients reduce-scattered
    once, after the last micro-batch, as the trainer defers them) or by loss * world."""
    r = results["cases"][case]
    assert_grads_match(r["grads"], r["ref_grads"])
    for term, value in r["ref_reported"].items():
        assert r["reported"][term] == pytest.approx(value, rel=1e-5, abs=1e-7), term
    assert r["begin_step_all_reduces"] == 1 and r["reported_all_reduces"] == 1


def test_fsdp_layouts_really_are_uneven_and_cut_through_a_group(results):
    (real0, total0), (real1,
                      total1) = results["cases"]["fsdp_token_mean_divide_factor_1"]["microbatches"]
    assert real0 != real1 and total0 == total1 == max(real0, real1)
    one_each = results["cases"]["fsdp_token_mean_one_microbatch_per_rank"]["microbatches"]
    assert one_each == [(1, 1), (1, 1)]


@pytest.mark.parametrize("case", [c for c in CASES if c.startswith("cp2_")])
def test_cp2_full_sequence_loss_with_cp_factor_equals_cp1(results, case):
    """Rule 5, second option: both ranks compute the loss of every full (gathered) sequence;
    cp_factor=2 in Z makes CP=2 equal CP=1, whether the normalizers come from the CP group's
    first rank (the trainer's step) or from each CP rank's own half of the tokens."""
    r = results["cases"][case]
    for got in (r, r["halves"]):
        assert_grads_match(got["grads"], r["ref_grads"])
        for term, value in r["ref_reported"].items():
            assert got["reported"][term] == pytest.approx(value, rel=1e-5, abs=1e-7), term


def test_zero_global_normalizer_under_fsdp_gives_zero_finite_grads_without_hang(results):
    """The contract's backward of every micro-batch gives finite zero gradients; the trainer's
    step, with nothing to learn, runs none and steps no optimizer; neither hangs."""
    r = results["cases"][ZERO_CASE]
    contract = r["contract"]
    assert contract["grads"].keys() == results["cases"]["fsdp_seq_mean_divide_factor_1"][
        "ref_grads"].keys()
    for name, g in contract["grads"].items():
        assert torch.isfinite(g).all() and g.abs().max() == 0, name
    for reported in (contract["reported"], r["reported"]):
        assert reported["loss"] == 0.0 and all(math.isfinite(v) for v in reported.values())
    assert r["grads"] is None and r["reported"]["updated"] == 0.0


def test_m2po_mask_across_ranks_equals_single_process_mask(results):
    m = results["m2po"]
    single = L.m2po_mask(m["prox"], m["behave"], m["loss_mask"], threshold=0.03)
    assert torch.equal(m["new"], single)
    assert 0 < (m["loss_mask"] - m["new"]).sum() < m["loss_mask"].sum()  # the threshold did bite


@pytest.mark.parametrize("mode", list(L.MODES))
def test_episodes_two_ranks_train_on_the_policys_tokens_only_equal_padded_reference(results, mode):
    """Multi-turn episodes (interior environment spans, pi_behave junk there) packed by packing.py
    from each Completion's policy_mask, micro-batches cutting through groups, on 2 ranks: the
    whole step's gradient and reported values equal the padded reference whose masks hold the
    environment's tokens out of every numerator and denominator."""
    r = results["cases"][f"episodes_{mode}"]
    assert_grads_match(r["grads"], r["ref_grads"])
    for term, value in r["ref_reported"].items():
        assert r["reported"][term] == pytest.approx(value, rel=1e-5, abs=1e-7), term
    per_mb = r["samples_per_microbatch"]
    assert sum(n for counts in per_mb for n in counts if n > 0) == 15
    assert max(len(c) for c in per_mb) > 2  # several micro-batches per rank
    assert cuts_a_group(per_mb)


def cuts_a_group(per_mb: list[list[int]]) -> bool:
    """Whether some micro-batch boundary falls between two episodes of one group (ranks hold
    make_episodes' samples in order; a sequence itself is never split, so a boundary between a
    group's episodes is as deep as a cut can go; padding micro-batches count 0)."""
    groups, first, cut = [s["group"] for s in W.make_episodes()], 0, False
    for counts in per_mb:
        ends = list(itertools.accumulate(n for n in counts if n > 0))
        cut |= any(groups[first + e - 1] == groups[first + e] for e in ends[:-1])
        first += ends[-1]
    return cut


@pytest.mark.parametrize("mode", list(L.MODES))
def test_episodes_one_rank_train_on_the_policys_tokens_only_equal_padded_reference(mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=W.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, attn_implementation="sdpa")).float()
        episodes = W.make_episodes()
        W.add_policy_logprobs(model, episodes)
        assert any(0.0 in s["m"][: s["m"].index(1.0, s["m"].index(0.0))] for s in episodes
                   if 0.0 in s["m"] and 1.0 in s["m"][s["m"].index(0.0):])  # interior spans
        case = W.SURROGATE_OF_MODE[mode]
        with W.surrogate_params(case["policy_loss"], case.get("params", {})):
            got = W.run_episode_case(model, episodes, mode)
            ref_grads, ref_reported = W.reference(model, episodes, mode, case)
    finally:
        dist.destroy_process_group()
    assert_grads_match(got["grads"], ref_grads)
    for term, value in ref_reported.items():
        assert got["reported"][term] == pytest.approx(value, rel=1e-5, abs=1e-7), term
    assert cuts_a_group(got["samples_per_microbatch"])
