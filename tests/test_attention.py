"""Packed attention by segments: whole sequences, shared prompts, and the flash-attn varlen encoding
of the same rows.

Every check is against the plain HF model run on one sequence at a time (its own sdpa attention),
in float64.
"""

import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AttentionInterface, AutoModelForCausalLM

import attention
import loss as L
import nanoareal as N

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "assets" / "tiny-arith")


def tiny_model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64)
    AttentionInterface.register("packed", attention.packed_attention)
    return model


def per_sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(completion_t | prompt, completion_<t) from one plain forward of the whole sequence."""
    full = torch.tensor(prompt + completion)
    logits = model(input_ids=full[None], use_cache=False).logits[0].log_softmax(-1)
    p = len(prompt)
    return logits[p - 1 : len(full) - 1].gather(-1, full[p:, None]).squeeze(-1)


def random_samples(seed: int, groups: int = 5) -> list[N.Sample]:
    """Groups of 1-4 samples, prompts of 1-7 tokens (a 1-token prompt has an empty shared prefix),
    two groups with the same prompt (they share one copy too), completions of 1-6 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 18) for _ in range(n)] for n in (1, 5, 7, 2, 5)][:groups]
    prompts[4 % groups] = list(prompts[1 % groups])
    samples = []
    for g, prompt in enumerate(prompts):
        for _ in range(rng.randint(1, 4)):
            out = [rng.randrange(1, 18) for _ in range(rng.randint(1, 6))]
            completion = N.Completion(out, [-rng.random() for _ in out], "stop")
            samples.append(N.Sample(g, list(prompt), completion, advantage=rng.uniform(-1, 1)))
    return samples


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """Llama's RMSNorm computes in float32 even for float64 inputs, so a gradient summed over many
    samples before the norm (a shared prompt) and one summed after it (separate copies) differ by
    float32 rounding (~1e-7 relative). With the norm in float64 the two layouts must agree to
    float64 rounding, which is what we check."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1,
                                                           keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one in this process (load_model shards with FSDP2), gone afterwards: other tests
    start their own."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def flash_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0,
                           softmax_scale=None, causal=False):
    """flash_attn_varlen_func's documented semantics, one segment at a time: q [Tq, H, D], k/v [Tk,
    Hkv, D]; query head h uses KV head h // (H / Hkv); with causal=True the mask is aligned to
    the bottom-right corner (query i of Lq may see key j of Lk iff j <= i + Lk - Lq)."""
    assert dropout_p == 0.0 and causal
    out = []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
        ks, vs = (x[cu_seqlens_k[i] : cu_seqlens_k[i + 1]] for x in (k, v))
        assert len(qs) <= max_seqlen_q and len(ks) <= max_seqlen_k
        rep = q.shape[1] // k.shape[1]
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * (softmax_scale or q.shape[-1] ** -0.5)
        lq, lk = len(qs), len(ks)
        keep = torch.arange(lk)[None] <= torch.arange(lq)[:, None] + lk - lq
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep,
                                                                   float("-inf")).softmax(-1), vs))
    return torch.cat(out)


def test_whole_sequences_equal_per_sequence_forward_and_gradients():
    """Without shared prompts (segments from position_ids restarts) each sequence attends only to
    itself."""
    model = tiny_model()
    seqs = [torch.randint(3, 15, (n,)) for n in (5, 9, 1, 3, 7)]
    packed, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
    weight = model.model.layers[0].self_attn.q_proj.weight
    ref = torch.cat([model.model(input_ids=s[None],
                                 use_cache=False).last_hidden_state[0] for s in seqs])
    g_ref = torch.autograd.grad(ref.square().sum(), weight)[0]
    model.set_attn_implementation("packed")
    layout = attention.attention_layout(attention.segments_from_positions(pos), packed.shape[1])
    out = model.model(input_ids=packed, position_ids=pos, use_cache=False,
                      layout=layout).last_hidden_state[0]
    g = torch.autograd.grad(out.square().sum(), weight)[0]
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-10)


def test_packing_with_shared_prompts_feeds_each_prompt_once_per_micro_batch():
    cfg = N.Config(micro_batch_tokens=10)
    s = lambda g, prompt, out: N.Sample(
        g, prompt, N.Completion(out, [-0.1 * (i + 1) for i in range(len(out))], "stop"),
        advantage=0.5)
    samples = [s(0, [5, 6, 7], [8, 9]), s(0, [5, 6, 7], [10]), s(1, [4, 4], [3, 3, 3, 1])]
    (mb,) = N.pack_microbatches(samples, cfg)  # 10 positions instead of 12: fits one micro-batch
    # prefix [5 6] once; tails [7 8] and [7] at positions 2..; then group 1: prefix [4], tail [4 3 3
    # 3]
    assert mb["input_ids"][0].tolist() == [5, 6, 7, 8, 7, 4, 4, 3, 3, 3]
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3, 4]
    assert mb["targets"].tolist() == [6, 7, 8, 9, 10, 4, 3, 3, 3, 1]
    assert mb["loss_mask"].tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1, 1]
    assert mb["seq_ids"].tolist() == [-1, -1, 0, 0, 1, -1, 2, 2, 2, 2]
    assert mb["behave_logprobs"][2:5].tolist() == pytest.approx([-0.1, -0.2, -0.1])
    assert mb["segments"].tolist() == [[0, 2, 0, 0], [2, 2, 0, 2], [4, 1, 0, 2], [5, 1, 0, 0],
                                       [6, 4, 5, 1]]
    # a group cut by the budget: the next micro-batch carries its own copy of the prompt
    cut = N.pack_microbatches(samples, N.Config(micro_batch_tokens=5))
    assert [m["input_ids"][0].tolist() for m in cut] == [[5, 6, 7, 8, 7], [4, 4, 3, 3, 3]]
    small = N.pack_microbatches(samples[:2], N.Config(micro_batch_tokens=4))
    assert [m["input_ids"][0].tolist() for m in small] == [[5, 6, 7, 8], [5, 6, 7]]
    assert small[1]["segments"].tolist() == [[0, 2, 0, 0], [2, 1, 0, 2]]


@pytest.mark.parametrize("flash", [False, True], ids=["sdpa", "flash-varlen-reference"])
def test_shared_prompt_logprobs_and_gradients_equal_per_sequence_forwards(flash, monkeypatch,
                                                                          exact_rmsnorm):
    model = tiny_model()
    # the GPU encoding (packed queries, gathered keys, bottom-right causal) against flash's
    # semantics
    if flash:
        # load_model sets this on a GPU when flash-attn imports
        model.flash_varlen = flash_varlen_reference
        monkeypatch.setattr(attention, "HALF", (torch.float64,))
    samples = random_samples(0)
    # the far end of backward: every layer's gradient flows into it
    weight = model.model.embed_tokens.weight
    ref = torch.cat([per_sequence_logprobs(model, s.prompt_ids,
                                           s.completion.output_ids) for s in samples])
    g_ref = torch.autograd.grad((ref * torch.linspace(-1, 1, len(ref), dtype=ref.dtype)).sum(),
                                weight)[0]
    model.set_attn_implementation("packed")
    for budget in (64, 12):  # one micro-batch; groups cut across micro-batches
        mbs = N.pack_microbatches(samples, N.Config(micro_batch_tokens=budget, share_prompts=True))
        assert (budget == 64) == (len(mbs) == 1)
        got = []
        for mb in mbs:
            logprobs, _ = N.policy_logprobs(model, mb["input_ids"], mb["position_ids"],
                                            mb["targets"],
                                            segments=mb["segments"])
            got.append(logprobs[mb["seq_ids"] >= 0])
        got = torch.cat(got)
        g = torch.autograd.grad((got * torch.linspace(-1, 1, len(got), dtype=got.dtype)).sum(),
                                weight)[0]
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(g, g_ref, atol=1e-10, rtol=1e-10)


def test_attention_layout_rejects_segments_that_do_not_tile_the_row():
    with pytest.raises(ValueError, match="cover the 5 tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [3, 2, 0, 0]]), 5)
    with pytest.raises(ValueError, match="cover the 5 tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [2, 2, 0, 2]]), 5)
    with pytest.raises(ValueError, match="context must be earlier tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [2, 3, 1, 2]]), 5)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean"])
def test_training_step_with_shared_prompts_equals_whole_sequences(mode, one_rank_group,
                                                                  exact_rmsnorm):
    """train_on_samples end to end (packing, FSDP2, LossReduction, clip, optimizer): the same
    gradient with and without shared prompts, for micro-batches that cut groups apart; fewer
    positions computed."""
    samples = random_samples(1)
    results = {}
    for share in (False, True):
        cfg = N.Config(micro_batch_tokens=16, share_prompts=share, loss_aggregation=mode,
                       grad_clip=1e9,
                       dtype="float64", model=TINY, eps_high=0.28, entropy_coef=0.01)
        model = N.load_model(cfg, torch.device("cpu"), N.Ranks())
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # parameter change = -gradient
        reduction = L.build_loss(cfg)
        sums, stats = N.train_on_samples(model, None, optimizer, reduction, samples, cfg,
                                         torch.device("cpu"),
                                         N.Ranks())
        grads = [b - p.detach().full_tensor() for b, p in zip(before, model.parameters())]
        results[share] = ({"sums": sums, "reported": stats, "grad_norm": stats["grad_norm"]}, grads)
    (plain, g_plain), (shared, g_shared) = results[False], results[True]
    assert shared["sums"]["positions"] < plain["sums"]["positions"]
    assert shared["sums"]["trained_tokens"] == plain["sums"]["trained_tokens"]
    assert shared["sums"]["denom_tokens"] == plain["sums"]["denom_tokens"]
    for key in ("entropy_sum", "mismatch_sum"):
        assert shared["sums"][key] == pytest.approx(plain["sums"][key], rel=1e-10)
    for key, value in plain["reported"].items():
        assert shared["reported"][key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    assert shared["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-9)
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9)
