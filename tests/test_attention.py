"""Packed attention by segments: whole sequences, shared prompts, sliding windows and softcaps,
on every path (the plain reference, the padded batch, and the varlen encoding run through
references of flash-attn's and PyTorch's documented kernel semantics), and the choice of path.

Every check is against the plain HF model run on one sequence at a time (its own attention), in
float64.
"""

import functools
import random
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference import whole
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

import attention
import loss as L
import modeling
import nanoareal as N
from rollout import Completion, Sample

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "assets" / "tiny-arith")
GEMMA2 = dict(vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
              attn_logit_softcapping=0.05, final_logit_softcapping=0.5, query_pre_attn_scalar=8,
              max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def tiny_model(family: str = "llama"):
    """The shipped Llama, or a tiny random Gemma 2 whose sliding window (4) is shorter than the
    sequences and whose softcaps are small enough to bend random-init logits."""
    torch.manual_seed(0)
    AttentionInterface.register("packed", attention.packed_attention)
    if family == "llama":
        return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64).eval()
    config = AutoConfig.for_model("gemma2", **GEMMA2)
    return AutoModelForCausalLM.from_config(config).double().eval()


def per_sequence_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(completion_t | prompt, completion_<t) from one plain forward of the sequence."""
    full = torch.tensor(prompt + completion)
    logits = model(input_ids=full[None], use_cache=False).logits[0].log_softmax(-1)
    p = len(prompt)
    return logits[p - 1 : len(full) - 1].gather(-1, full[p:, None]).squeeze(-1)


def random_samples(seed: int, groups: int = 5) -> list[Sample]:
    """Groups of 1-4 samples, prompts of 1-7 tokens (a 1-token prompt has an empty shared
    prefix), two groups with the same prompt (they share one copy too), completions of 1-6
    tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 18) for _ in range(n)] for n in (1, 5, 7, 2, 5)][:groups]
    prompts[4 % groups] = list(prompts[1 % groups])
    samples = []
    for g, prompt in enumerate(prompts):
        for _ in range(rng.randint(1, 4)):
            out = [rng.randrange(1, 18) for _ in range(rng.randint(1, 6))]
            completion = Completion(out, [-rng.random() for _ in out], "stop")
            samples.append(Sample(g, list(prompt), completion, advantage=rng.uniform(-1, 1)))
    return samples


@pytest.fixture
def exact_rmsnorm(monkeypatch):
    """Llama's and Gemma 2's RMSNorms compute in float32 even for float64 inputs, so a gradient
    summed over many samples before the norm (a shared prompt) and one summed after it (separate
    copies) differ by float32 rounding (~1e-7 relative). With the norms in float64 the two layouts
    must agree to float64 rounding, which is what we check."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def rms(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    monkeypatch.setattr(LlamaRMSNorm, "forward",
                        lambda self, x: self.weight * rms(x, self.variance_epsilon))
    monkeypatch.setattr(Gemma2RMSNorm, "forward",
                        lambda self, x: rms(x, self.eps) * (1 + self.weight))


def _reference(q, k, v, cu_q, cu_k, scale, window: tuple[int, int], softcap: float = 0.0):
    """A varlen kernel's documented semantics, one segment at a time: q [Tq, H, D], k/v [Tk, Hkv,
    D]; query head h uses KV head h // (H / Hkv); window (left, right) aligned to the bottom-right
    corner: query i of Lq sees key j of Lk iff i + Lk - Lq - left <= j <= i + Lk - Lq + right
    (-1: unbounded); softcap > 0 turns a score s into softcap * tanh(s / softcap)."""
    out = []
    for i in range(len(cu_q) - 1):
        qs = q[cu_q[i] : cu_q[i + 1]]
        ks, vs = (x[cu_k[i] : cu_k[i + 1]] for x in (k, v))
        ks, vs = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (ks, vs))
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lq, lk = len(qs), len(ks)
        diag = torch.arange(lq)[:, None] + lk - lq  # each query's own key
        j = torch.arange(lk)[None]
        keep = (j <= diag + window[1]) if window[1] >= 0 else torch.ones(lq, lk, dtype=bool)
        if window[0] >= 0:
            keep = keep & (j >= diag - window[0])
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep, float("-inf"))
                                .softmax(-1), vs))
    return torch.cat(out)


def flash_attn_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), softcap=0.0):
    """flash_attn_varlen_func (flash-attn 2.6+): causal=True means window_size[1] = 0."""
    assert dropout_p == 0.0 and max(cu_seqlens_q.diff()) <= max_seqlen_q
    assert max(cu_seqlens_k.diff()) <= max_seqlen_k
    window = (window_size[0], 0 if causal else window_size[1])
    return _reference(q, k, v, cu_seqlens_q, cu_seqlens_k,
                      softmax_scale or q.shape[-1] ** -0.5, window, softcap)


def torch_varlen_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                           return_aux=None, scale=None, window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn as torch 2.11 defines it: no enable_gqa, so query
    and key must have equal head counts; window_size (-1, 0) is causal."""
    assert query.shape[1] == key.shape[1], "varlen_attn without enable_gqa needs equal heads"
    return _reference(query, key, value, cu_seq_q, cu_seq_k, scale or query.shape[-1] ** -0.5,
                      window_size)


def torch_varlen_gqa_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                               return_aux=None, scale=None, window_size=(-1, -1),
                               enable_gqa=False, seqused_k=None, block_table=None,
                               num_splits=None):
    """varlen_attn as torch 2.12-2.13 define it: with enable_gqa, fewer KV heads than query heads
    (query head h reads KV head h // (H / Hkv)), never repeated in memory."""
    assert (query.shape[1] == key.shape[1]) or enable_gqa, "fewer KV heads need enable_gqa"
    return _reference(query, key, value, cu_seq_q, cu_seq_k, scale or query.shape[-1] ** -0.5,
                      window_size)


def torch_2_10_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                      return_aux=None):
    """torch 2.10's signature: no scale, no window_size (causal only as is_causal)."""
    raise AssertionError("choose_attention must not pick torch 2.10's varlen_attn")


@pytest.fixture
def fresh_varlen_probe():
    """varlen_gqa caches its probe of varlen_attn per (device, dtype): forget it around a test that
    swaps varlen_attn for a reference."""
    attention.varlen_gqa.cache_clear()
    yield
    attention.varlen_gqa.cache_clear()


def use_path(path: str, monkeypatch) -> dict:
    """attention_layout's keywords that run packed attention on `path`: the varlen ones through
    their reference kernels (on float64, which the real kernels would refuse: the encoding is what
    is under test; kernels dispatch on the layout's path, not on the dtype), plain the reference
    path, sdpa the padded one."""
    if path == "sdpa":
        return {}
    if path == "plain":
        return {"plain": True}
    if path == "flash_attn":
        fake = types.ModuleType("flash_attn")
        fake.flash_attn_varlen_func = flash_attn_varlen_reference
        monkeypatch.setitem(sys.modules, "flash_attn", fake)
        return {"kernel": attention._flash_attn_kernel}
    import torch.nn.attention.varlen as varlen  # torch_varlen (torch 2.11), torch_varlen_gqa (2.12)

    monkeypatch.setattr(varlen, "varlen_attn", torch_varlen_reference if path ==
                        "torch_varlen" else torch_varlen_gqa_reference)
    return {"kernel": attention._torch_varlen_kernel}


def test_whole_sequences_equal_per_sequence_forward_and_gradients():
    """Without shared prompts (segments from position_ids restarts) each sequence attends only
    to itself."""
    model = tiny_model()
    seqs = [torch.randint(3, 15, (n,)) for n in (5, 9, 1, 3, 7)]
    packed, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
    weight = model.model.layers[0].self_attn.q_proj.weight
    ref = torch.cat([model.model(input_ids=s[None], use_cache=False).last_hidden_state[0]
                     for s in seqs])
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
    s = lambda g, prompt, out: Sample(
        g, prompt, Completion(out, [-0.1 * (i + 1) for i in range(len(out))], "stop"),
        advantage=0.5)
    samples = [s(0, [5, 6, 7], [8, 9]), s(0, [5, 6, 7], [10]), s(1, [4, 4], [3, 3, 3, 1])]
    (mb,) = N.pack_microbatches(samples, cfg)  # 10 positions instead of 12: one micro-batch
    # prefix [5 6] once; tails [7 8] and [7] at positions 2..; group 1: prefix [4], tail [4 3 3 3]
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 7, 4, 4, 3, 3, 3]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 2, 0, 1, 2, 3, 4]
    assert mb.targets.tolist() == [6, 7, 8, 9, 10, 4, 3, 3, 3, 1]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1, 1]
    assert mb.seq_ids.tolist() == [-1, -1, 0, 0, 1, -1, 2, 2, 2, 2]
    assert mb.behave_logprobs[2:5].tolist() == pytest.approx([-0.1, -0.2, -0.1])
    assert mb.segments.tolist() == [[0, 2, 0, 0], [2, 2, 0, 2], [4, 1, 0, 2], [5, 1, 0, 0],
                                       [6, 4, 5, 1]]
    # a group cut by the budget: the next micro-batch carries its own copy of the prompt
    cut = N.pack_microbatches(samples, N.Config(micro_batch_tokens=5))
    assert [m.input_ids.tolist() for m in cut] == [[5, 6, 7, 8, 7], [4, 4, 3, 3, 3]]
    small = N.pack_microbatches(samples[:2], N.Config(micro_batch_tokens=4))
    assert [m.input_ids.tolist() for m in small] == [[5, 6, 7, 8], [5, 6, 7]]
    assert small[1].segments.tolist() == [[0, 2, 0, 0], [2, 1, 0, 2]]


@pytest.mark.parametrize("family, path, row_slots", [  # torch varlen_attn has no softcap
    ("llama", "sdpa", 64), ("llama", "sdpa", 12), ("llama", "sdpa", 1), ("llama", "flash_attn", 64),
    ("llama", "torch_varlen", 64), ("llama", "torch_varlen_gqa", 64), ("llama", "plain", 64),
    ("gemma2", "sdpa", 64), ("gemma2", "sdpa", 12), ("gemma2", "sdpa", 1),
    ("gemma2", "flash_attn", 64), ("gemma2", "plain", 64)])
def test_shared_prompt_logprobs_and_gradients_equal_per_sequence_forwards(family, path, row_slots,
                                                                          monkeypatch,
                                                                          exact_rmsnorm,
                                                                          fresh_varlen_probe):
    """Every path, with a plain causal mask (Llama) and with a sliding window shorter than the
    sequences and attention and final logit softcaps (Gemma 2), equals the model's own eager
    forward of each sequence alone (sdpa for Llama; Gemma 2 has only eager, whose softmax runs in
    float32 even for float64 inputs, hence its looser tolerance). The padded path with a group's
    completions in their prompt's row (64 slots), some of them (12: others copy the prompt into
    rows of their own) and the first alone (1: long rows, plain causal)."""
    monkeypatch.setattr(attention, "GROUP_ROW_SLOTS", row_slots)
    model = tiny_model(family)
    samples = random_samples(0)
    weight = model.get_input_embeddings().weight  # the far end of backward: every layer flows in
    model.set_attn_implementation("sdpa" if family == "llama" else "eager")
    tol = 1e-10 if family == "llama" else 1e-6
    ref = torch.cat([per_sequence_logprobs(model, s.prompt_ids, s.completion.output_ids)
                     for s in samples])
    g_ref = torch.autograd.grad((ref * torch.linspace(-1, 1, len(ref), dtype=ref.dtype)).sum(),
                                weight)[0]
    model.set_attn_implementation("packed")
    how = use_path(path, monkeypatch)
    for budget in (64, 12):  # one micro-batch; groups cut across micro-batches
        mbs = N.pack_microbatches(samples, N.Config(micro_batch_tokens=budget))
        assert (budget == 64) == (len(mbs) == 1)
        got = []
        for mb in mbs:
            layout = attention.attention_layout(mb.segments, len(mb.input_ids), **how)
            assert layout.path == {"sdpa": "padded", "plain": "plain"}.get(path, "varlen")
            logprobs, _ = modeling.policy_logprobs(model, mb.input_ids[None],
                                                   mb.position_ids[None], mb.targets,
                                                   layout=layout)
            got.append(logprobs[mb.seq_ids >= 0])
        got = torch.cat(got)
        g = torch.autograd.grad((got * torch.linspace(-1, 1, len(got), dtype=got.dtype)).sum(),
                                weight)[0]
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        torch.testing.assert_close(g, g_ref, atol=tol, rtol=tol)


def test_windows_and_softcaps_change_the_result_so_the_test_above_can_fail(monkeypatch):
    """The Gemma 2 case would pass vacuously if its window and softcaps did nothing."""
    model = tiny_model("gemma2")
    model.set_attn_implementation("packed")
    assert modeling.check_model(model, GEMMA2["vocab_size"]) is None
    full = attention.segment_attention
    for drop in ("window", "softcap"):
        keep = lambda *a, drop=drop: full(*a[:6], None if drop == "window" else a[6],
                                          None if drop == "softcap" else a[7])
        monkeypatch.setattr(attention, "segment_attention", keep)
        assert "disagrees" in modeling.check_model(model, GEMMA2["vocab_size"]), drop
    monkeypatch.setattr(attention, "segment_attention", full)
    monkeypatch.setattr(modeling, "head_transform", lambda config: (1.0, None))
    assert "disagrees" in modeling.check_model(model, GEMMA2["vocab_size"])


def buckets(layout: attention.Layout) -> list[tuple[int, int, int, int]]:
    """The layout's buckets as (first slot, rows, width, lead)."""
    return [(b.first, b.rows, b.width, b.lead) for b in layout.buckets]


def row_masked(layout: attention.Layout) -> bool:
    """Whether any bucket has a row mask (rows of several segments), not just causal rows: a
    bucket's mask is None (causal) or, past a copied prefix of `lead` slots, the bottom-right
    triangle of its query slots."""
    plain = lambda b: torch.ones(b.width, b.width, dtype=torch.bool).tril()[b.lead:]
    return any(b.mask is not None and not (b.lead and b.mask.equal(plain(b)))
               for b in layout.buckets)


def test_a_prompt_and_the_completions_sharing_it_fill_one_padded_row():
    """The packing example above: rows [5 6 | 7 8 | 7] and [4 | 4 3 3 3]; a completion sees its
    prompt's prefix and itself, never a sibling; positions restart per sequence."""
    segments = torch.tensor([[0, 2, 0, 0], [2, 2, 0, 2], [4, 1, 0, 2], [5, 1, 0, 0], [6, 4, 5, 1]])
    layout = attention.attention_layout(segments, 10)
    assert layout.path == "padded" and layout.grid.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert layout.pos.view(2, 5).tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 4]]
    assert buckets(layout) == [(0, 2, 5, 0)] and layout.buckets[0].mask.shape == (2, 1, 5, 5)
    assert layout.buckets[0].mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0],
                                                          [1, 1, 1, 0, 0], [1, 1, 1, 1, 0],
                                                          [1, 1, 0, 0, 1]]
    # rows of 5 slots: a third completion copies the prefix into a row of its own
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "GROUP_ROW_SLOTS", 5)
        layout = attention.attention_layout(torch.cat([segments[:3], torch.tensor([[5, 2, 0, 2]])]),
                                            7)
    # rows with a copied prefix come first, in buckets of their own (their lead: the prefix's slots)
    assert layout.grid.tolist() == [0, 1, 5, 6, 0, 1, 2, 3, 4]
    assert layout.out[5] == 2 and buckets(layout) == [(0, 1, 4, 2), (4, 1, 5, 0)]
    with pytest.MonkeyPatch.context() as mp:  # long rows: the first completion joins its prompt
        mp.setattr(attention, "GROUP_ROW_SLOTS", 2)  # (plain causal), the next copies the prompt
        layout = attention.attention_layout(segments[:3], 5)
    # no row masks: the copied prefix's row bottom-right causal (its query slots), the other causal
    assert not row_masked(layout) and layout.grid.tolist() == [0, 1, 4, 0, 1, 2, 3]
    assert buckets(layout) == [(0, 1, 3, 2), (3, 1, 4, 0)]
    single = attention.attention_layout(torch.tensor([[0, 3, 0, 0], [3, 2, 0, 0]]), 5)
    assert not row_masked(single) and buckets(single) == [(0, 2, 3, 0)]  # a row each: causal
    assert single.buckets[0].mask is None


def sdpa_query_shapes(monkeypatch) -> list:
    """The query shape of every F.scaled_dot_product_attention call from now on (it still runs)."""
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(
        a[0].shape) or sdpa(*a, **kw))
    return calls


def test_a_copied_prefix_computes_keys_alone_and_attention_stays_exact(monkeypatch):
    """Long rows (past GROUP_ROW_SLOTS): a completion's row holds a copy of its prompt's prefix
    for keys; its kernel call computes the completion's queries alone (a bottom-right causal
    mask), and the output equals each segment's own attention over its context and itself."""
    monkeypatch.setattr(attention, "GROUP_ROW_SLOTS", 2)
    segments = torch.tensor([[0, 5, 0, 0], [5, 3, 0, 5], [8, 4, 0, 5], [12, 2, 0, 5]])
    layout = attention.attention_layout(segments, 14)
    assert buckets(layout) == [(0, 2, 9, 5), (18, 1, 8, 0)]
    q, k, v = torch.randn(4, 14, 8, dtype=torch.float64), *torch.randn(2, 2, 14, 8,
                                                                       dtype=torch.float64)
    calls = sdpa_query_shapes(monkeypatch)
    out = attention.segment_attention(q, k, v, layout)
    assert [c[2] for c in calls] == [9 - 5, 8]  # the copied rows: 4 query slots, not 9
    varlen = attention.attention_layout(segments, 14, kernel=attention._torch_varlen_kernel)
    kk, vv = (x.transpose(0, 1).index_select(0, varlen.k_index) for x in (k, v))
    want = _reference(q.transpose(0, 1), kk, vv, varlen.cu_q, varlen.cu_k, 8**-0.5, (-1, 0))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_long_rows_of_uneven_lengths_go_in_buckets_of_similar_widths(monkeypatch):
    """Padded rows of 40, 12 and 3 slots (past GROUP_ROW_SLOTS): three buckets, 55 slots instead
    of 3 x 40, one SDPA call each; the output equals each sequence's own causal attention."""
    monkeypatch.setattr(attention, "GROUP_ROW_SLOTS", 8)
    lengths = (12, 40, 3)
    segments = torch.tensor([[s, n, 0, 0] for s, n in zip((0, 12, 52), lengths)])
    layout = attention.attention_layout(segments, 55)
    assert buckets(layout) == [(0, 1, 40, 0), (40, 1, 12, 0), (52, 1, 3, 0)]
    assert all(b.mask is None for b in layout.buckets)  # one sequence a row: causal
    assert layout.grid.tolist() == [*range(12, 52), *range(12), 52, 53, 54]
    q, k, v = torch.randn(4, 55, 8, dtype=torch.float64), *torch.randn(2, 2, 55, 8,
                                                                       dtype=torch.float64)
    calls = sdpa_query_shapes(monkeypatch)
    out = attention.segment_attention(q, k, v, layout)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    want = _reference(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cu, cu, 8**-0.5,
                      (-1, 0))
    assert [c[2] for c in calls] == [40, 12, 3]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def test_a_varlen_layout_builds_nothing_of_the_padded_path(monkeypatch):
    """With a varlen kernel the layout is its index alone: no padded rows, buckets or [w, w]
    masks are built (long copied-prefix rows made one lower triangle each, moved to the GPU)."""
    monkeypatch.setattr(attention, "GROUP_ROW_SLOTS", 2)
    monkeypatch.setattr(attention, "_padded_rows", lambda *a: pytest.fail("padded rows built"))
    segments = torch.tensor([[0, 5, 0, 0], [5, 3, 0, 5], [8, 4, 0, 5]])
    layout = attention.attention_layout(segments, 12, kernel=attention._torch_varlen_kernel)
    assert (layout.path, layout.kernel) == ("varlen", attention._torch_varlen_kernel)
    assert (layout.grid, layout.out, layout.pos, layout.buckets) == (None, None, None, [])
    assert layout.k_index.tolist() == [*range(5), *range(5), 5, 6, 7, *range(5), 8, 9, 10, 11]
    assert layout.cu_k.tolist() == [0, 5, 13, 22] and (layout.max_q, layout.max_k) == (5, 9)


# a row of shared prompts: a group of three completions and a one-token one on a 5-token prefix,
# a group on a 2-token prefix, one on the first token of a 3-token prefix
SHARED_ROW = torch.tensor([[0, 5, 0, 0], [5, 3, 0, 5], [8, 6, 0, 5], [14, 1, 0, 5], [15, 2, 0, 0],
                           [17, 4, 15, 2], [21, 3, 0, 0], [24, 2, 21, 1]])


@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 0.5), (3, 0.5)],
                         ids=["causal", "window", "softcap", "window-softcap"])
@pytest.mark.parametrize("row_slots", [64, 6, 1])
def test_plain_attention_equals_the_padded_path_and_a_varlen_kernel(window, softcap, row_slots,
                                                                    monkeypatch):
    """The plain path (each segment's keys gathered and masked, one segment at a time) against the
    padded one (completions in their prompt's row: 64 slots; some copying the prompt: 6; long
    rows: 1) and the varlen encoding through flash-attn's reference kernel, on a row of shared
    prompts, with a sliding window shorter than the sequences and a softcap: values and the
    gradients of q, k and v, in float64. The window and softcap change the result."""
    monkeypatch.setattr(attention, "GROUP_ROW_SLOTS", row_slots)
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_reference
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    T = int(SHARED_ROW[:, 1].sum())
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(h, T, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    mix = torch.randn(T, 4, 8, generator=g, dtype=torch.float64)

    def run(layout, window=window, softcap=softcap):
        q, k, v = (x.clone().requires_grad_() for x in qkv)
        out = attention.segment_attention(q, k, v, layout, 8**-0.5, 0.0, window, softcap)
        (out * mix).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    plain = attention.attention_layout(SHARED_ROW, T, plain=True)
    padded = attention.attention_layout(SHARED_ROW, T)
    varlen = attention.attention_layout(SHARED_ROW, T, kernel=attention._flash_attn_kernel)
    assert (plain.path, padded.path, varlen.path) == ("plain", "padded", "varlen")
    want = run(plain)
    for layout in (padded, varlen):
        for got, w, name in zip(run(layout), want, ("out", "q", "k", "v")):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12, msg=f"{layout.path} {name}")
    if window or softcap:
        assert not torch.allclose(run(plain, None, None)[0], want[0], rtol=1e-3, atol=1e-3)


def test_attention_plain_loads_a_model_on_the_reference_path_with_equal_results(
        one_rank_group, tmp_path, monkeypatch, exact_rmsnorm):
    """modeling.ATTENTION = "plain" (a path to compare with) loads a Model whose log-probs run
    plain_attention and equal the padded path's, values and gradients, on micro-batches of shared
    prompts of a Gemma 2 with a sliding window and softcaps, in float64."""
    path = tmp_path / "gemma2"
    tiny_model("gemma2").save_pretrained(path)
    cpu = torch.device("cpu")
    cfg = N.Config(model=str(path), dtype="float64", micro_batch_tokens=64)
    assert attention.choose_attention("plain", cpu, False, True) == ("plain", None, "as requested")
    fast = modeling.load_model(cfg, cpu)
    monkeypatch.setattr(modeling, "ATTENTION", "plain")
    reference = modeling.load_model(cfg, cpu)
    assert (fast.attention, reference.attention, reference.kernel) == ("sdpa", "plain", None)
    assert "attention: plain (as requested)" in reference.summary
    calls, plain_attention = [], attention.plain_attention
    monkeypatch.setattr(attention, "plain_attention",
                        lambda *a, **k: calls.append(1) or plain_attention(*a, **k))
    mbs = N.pack_microbatches(random_samples(0), N.Config(micro_batch_tokens=12))
    assert len(mbs) > 1 and any((mb.segments[:, 3] > 0).any() for mb in mbs)  # shared prompts
    results = []
    for model in (fast, reference):
        model.module.zero_grad()
        out = []
        for mb in mbs:
            lp, ent = model.logprobs(mb, 0.7, grad=True, entropy_grad=True)
            mix = torch.linspace(-1, 1, len(lp), dtype=lp.dtype)
            ((lp * mix).sum() + (ent * mix.flip(0)).sum()).backward()
            out += [lp.detach(), ent.detach()]
        results.append(out + [p.grad.clone() for p in model.module.parameters()])
        assert bool(calls) == (model is reference)
    assert len(calls) == 2 * len(mbs)  # each of its 2 layers, every micro-batch
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_attention_layout_rejects_segments_that_do_not_tile_the_row():
    with pytest.raises(ValueError, match="cover the 5 tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [3, 2, 0, 0]]), 5)
    with pytest.raises(ValueError, match="cover the 5 tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [2, 2, 0, 2]]), 5)
    with pytest.raises(ValueError, match="context must be earlier tokens"):
        attention.attention_layout(torch.tensor([[0, 2, 0, 0], [2, 3, 1, 2]]), 5)


def test_attention_path_is_the_fastest_that_can_run_and_an_impossible_request_is_an_error(
        monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert attention.choose_attention("auto", cpu, True, False)[0] == "sdpa"
    assert attention.choose_attention("auto", gpu, False, False)[0] == "sdpa"  # fp32 compute
    with pytest.raises(ValueError, match="--attention flash_attn cannot run here: .*bf16"):
        attention.choose_attention("flash_attn", cpu, True, False)
    # flash-attn-4 installs a `flash_attn` namespace without the v2 varlen function
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    path, kernel, why = attention.choose_attention("auto", gpu, True, False)
    assert (path, kernel) == ("torch_varlen", attention._torch_varlen_kernel)
    assert "no flash_attn_varlen_func" in why
    assert attention.choose_attention("auto", gpu, True, True)[0] == "sdpa"  # softcapping model
    with pytest.raises(ValueError, match="--attention torch_varlen .*softcaps"):
        attention.choose_attention("torch_varlen", gpu, True, True)
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_reference
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert attention.choose_attention("auto", gpu, True, True)[0] == "flash_attn"


def test_torch_varlen_runs_only_where_varlen_attn_takes_a_scale_and_window(monkeypatch):
    """torch 2.10's varlen_attn has no scale/window_size (2.8-2.9 have no module): auto falls
    back to the padded path, saying why, and asking for it is an error naming the torch."""
    import torch.nn.attention.varlen as varlen

    gpu = torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    for fn in (torch_varlen_reference, torch_varlen_gqa_reference):
        monkeypatch.setattr(varlen, "varlen_attn", fn)
        assert attention.choose_attention("auto", gpu, True, False)[0] == "torch_varlen"
    monkeypatch.setattr(varlen, "varlen_attn", torch_2_10_varlen)
    path, kernel, why = attention.choose_attention("auto", gpu, True, False)
    assert (path, kernel) == ("sdpa", None) and "varlen_attn has no scale/window_size" in why
    with pytest.raises(ValueError, match="torch_varlen cannot run here: torch .* no scale"):
        attention.choose_attention("torch_varlen", gpu, True, False)


def torch_varlen_native_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                            return_aux=None, scale=None, window_size=(-1, -1)):
    """A varlen_attn without enable_gqa whose kernel takes fewer KV heads as they are (FA2's)."""
    return _reference(query, key, value, cu_seq_q, cu_seq_k, scale or query.shape[-1] ** -0.5,
                      window_size)


def torch_varlen_wrong_gqa(query, key, value, *args, **kw):
    """One that accepts fewer KV heads but reads them wrong (query head h -> KV head h % Hkv)."""
    key, value = (x.repeat(1, query.shape[1] // x.shape[1], 1) for x in (key, value))
    return torch_varlen_reference(query, key, value, *args, **kw)


@pytest.mark.parametrize("fn, passed", [
    (torch_varlen_reference, (4, None)), (torch_varlen_gqa_reference, (2, True)),
    (torch_varlen_native_gqa, (2, None)), (torch_varlen_wrong_gqa, (4, None))],
    ids=["refuses", "enable_gqa", "takes them", "reads them wrong"])
def test_torch_varlen_gets_kv_heads_unrepeated_wherever_its_kernel_takes_them(monkeypatch, fn,
                                                                              passed,
                                                                              fresh_varlen_probe):
    """A probe (once per device and dtype) decides: enable_gqa where it exists (torch 2.12+), none
    where the kernel takes fewer KV heads as they are, else repeated (7x the K/V memory at 14:2)."""
    import torch.nn.attention.varlen as varlen

    seen = []

    @functools.wraps(fn)  # its signature is fn's: the kernel probes it
    def recording(q, k, *args, **kw):
        seen.append((k.shape[1], kw.get("enable_gqa")))
        return fn(q, k, *args, **kw)
    monkeypatch.setattr(varlen, "varlen_attn", recording)
    q, k, v = torch.randn(4, 5, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)  # [H, T, D]
    layout = attention.attention_layout(torch.tensor([[0, 5, 0, 0]]), 5,
                                        kernel=attention._torch_varlen_kernel)
    for _ in range(2):
        seen.clear()
        out = attention._torch_varlen_kernel(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), layout, 8 ** -0.5, 0.0, None, None)
        assert seen[-1] == passed
    assert len(seen) == 1  # probed once
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(0, 1))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean"])
def test_training_step_with_shared_prompts_equals_whole_sequences(mode, one_rank_group,
                                                                  exact_rmsnorm, monkeypatch):
    """train_on_samples end to end (packing, FSDP2, LossReduction, clip, optimizer): the same
    gradient with and without shared prompts, for micro-batches that cut groups apart; fewer
    positions computed."""
    samples = random_samples(1)
    results = {}
    for share in (False, True):
        monkeypatch.setattr(N, "SHARE_PROMPTS", share)
        cfg = N.Config(micro_batch_tokens=16, loss_aggregation=mode,
                       grad_clip=1e9, dtype="float64", model=TINY, eps_high=0.28,
                       entropy_coef=0.01)
        model = modeling.load_model(cfg, torch.device("cpu"))
        params = list(model.module.parameters())
        before = [whole(p.detach()).clone() for p in params]
        optimizer = torch.optim.SGD(params, lr=1.0)  # parameter change = -gradient
        sums, stats = N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg,
                                         N.Ranks())
        grads = [b - whole(p.detach()) for b, p in zip(before, params)]
        results[share] = (sums, stats, grads)
    (plain, plain_stats, g_plain), (shared, shared_stats, g_shared) = results[False], results[True]
    assert shared["positions"] < plain["positions"]
    assert shared["trained_tokens"] == plain["trained_tokens"]
    assert shared["denom_tokens"] == plain["denom_tokens"]
    for key in ("entropy", "mismatch"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-10)
    for key, value in plain_stats.items():
        assert shared_stats[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    for a, b in zip(g_plain, g_shared):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-9)


def test_the_fsdp_method_is_given_a_layout_made_on_the_host(one_rank_group, monkeypatch):
    """On a GPU, FSDP2's root pre-forward moves every tensor argument of the root's forward to the
    device (_fsdp_state's _root_pre_forward, for cuda/xpu/hpu only, so a CPU run never sees it;
    Model.logprobs runs policy_logprobs as that forward: as_root_forward): segments passed as such
    arrive there and check_segments rejects them, as the first H200 run did. Model.logprobs builds
    the layout from the host's segments before the call; the log-probs equal policy_logprobs' own
    from the segments where a response is scored, 0 on a prompt's prefix."""
    cpu = torch.device("cpu")
    cfg = N.Config(micro_batch_tokens=64, dtype="float64", model=TINY)
    model = modeling.load_model(cfg, cpu)
    (mb,) = N.pack_microbatches(random_samples(3, groups=3), cfg)
    calls, method = [], modeling.policy_logprobs  # what Model.logprobs runs as the root's forward
    monkeypatch.setattr(modeling, "policy_logprobs",
                        lambda *a, **k: calls.append(k) or method(*a, **k))
    got, _ = model.logprobs(mb, cfg.temperature, grad=False,
                            entropy_grad=cfg.entropy_coef != 0)
    (kwargs,) = calls
    layout = kwargs["layout"]
    assert "segments" not in kwargs and isinstance(layout, attention.Layout)
    assert layout.path == "padded" and layout.grid.device == cpu
    assert layout.segments == mb.segments.tolist()  # ints: FSDP2 moves tensors, not these
    want, _ = method(model.module, mb.input_ids[None], mb.position_ids[None], mb.targets,
                     segments=mb.segments)
    torch.testing.assert_close(got, want.where(mb.seq_ids >= 0, 0.0), rtol=1e-14, atol=0)
    assert (mb.seq_ids < 0).sum() > 0 and kwargs["scored"].tolist() == \
        (mb.seq_ids >= 0).nonzero()[:, 0].tolist()


def test_bf16_head_logits_are_not_rounded_to_bf16():
    """Under bf16 compute the head's matmul returns fp32 logits: rounding logits of ~+-20 to bf16
    (8 bits of mantissa) errs by up to ~0.06 in log-prob, more than the ratio clip tolerates."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=gen).bfloat16()
    weight = (torch.randn(4096, 32, generator=gen) * 1.5).bfloat16()
    targets = torch.randint(4096, (64,), generator=gen)
    exact = (hidden.double() @ weight.double().T).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    got, _ = modeling.HeadLogprobs.apply(hidden, weight, None, targets, 1.0, 1.0, None,
                                         modeling.HEAD_CHUNK, True, 0)
    rounded = (hidden @ weight.T).double().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    assert got.dtype == torch.float32
    assert (got.double() - exact).abs().max() < 1e-4
    assert (rounded - exact).abs().max() > 1e-2  # what rounding the logits first would cost


def test_seq_ids_number_the_mini_batchs_responses_across_its_micro_batches():
    """seq_ids index the responses in the packed list, the whole mini-batch's, not a micro-batch's
    own (GSPO's per-sequence ratio sums by them; a mismatch rejection reweighs by them over every
    micro-batch): each micro-batch holds consecutive ones, every response once, on its tokens."""
    s = lambda g, prompt, out: Sample(g, prompt, Completion(out, [-0.1] * len(out), "stop"))
    samples = [s(g, [4 + g, 5, 6], [7 + g % 2] * (1 + g % 3)) for g in range(6)]
    mbs = N.pack_microbatches(samples, N.Config(micro_batch_tokens=9))
    assert len(mbs) >= 2
    seen = []
    for mb in mbs:
        ids = mb.seq_ids[mb.seq_ids >= 0].unique().tolist()
        assert ids == list(range(ids[0], ids[0] + len(ids))), ids
        for i in ids:
            assert mb.targets[mb.seq_ids == i].tolist() == samples[i].completion.output_ids
        seen += ids
    assert seen == list(range(len(samples)))
