"""The head's log-probs: fp32 logits from half GEMMs in forward and backward (modeling.HeadLogprobs;
the sampler's head_logits).

References are plain autograd on upcast copies. The GPU path (torch.mm with out_dtype, whose kernels
are CUDA/XPU only) runs here on a CPU through a dispatch mode that supplies aten::mm.dtype with the
checks of torch's cuda/Blas.cpp `_mm_dtype_out_cuda`, and records every op it sees.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

import attention
import modeling

torch.set_num_threads(1)
N, D, V = 24, 16, 300  # tokens, hidden size, vocabulary: no two equal, so shapes tell tensors apart
HALF = (torch.float16, torch.bfloat16)
ARGS = (0.7, 0.5, 30.0)  # temperature, logit scale, final softcap


def head_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = (torch.randn(*s, generator=g) for s in ((N, D), (V, D), (V,)))
    return (hidden.to(dtype), (weight * 1.5).to(dtype), bias.to(dtype),
            torch.randint(V, (N,), generator=g))


def reference(hidden, weight, bias, targets, temperature, scale, softcap):
    """Log-probs and entropies by plain autograd."""
    logits = F.linear(hidden, weight, bias) * scale
    logits = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    logp = (logits / temperature).log_softmax(-1)
    return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def run(fn, inputs, targets):
    """[log-probs, entropies, grad hidden, grad weight, grad bias] of a mix of log-probs and
    entropies through `fn`, on copies of `inputs`."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    lp, ent = fn(*inputs, targets, *ARGS)
    mix = torch.randn(2, N, generator=torch.Generator().manual_seed(1))
    ((lp * mix[0]).sum() + (ent * mix[1]).sum()).backward()
    return [lp, ent] + [x.grad for x in inputs]


def fused(hidden, weight, bias, targets, temperature=1.0, scale=1.0, softcap=None,
          entropy_grad=True, chunk=modeling.HEAD_CHUNK, keep=0):
    """The head as policy_logprobs runs it: its logits kept for backward up to `keep` bytes
    (default: none, its forward again in backward)."""
    return modeling.HeadLogprobs.apply(hidden, weight, bias, targets, temperature, scale, softcap,
                                       chunk, entropy_grad, keep)


KEEP = {"recomputed": 0, "kept": 1 << 40}


@pytest.fixture
def fresh_probe():
    """mm_out_dtype_runs caches its probe per (device, dtype): forget it around a test that
    changes which kernels exist."""
    modeling.mm_out_dtype_runs.cache_clear()
    yield
    modeling.mm_out_dtype_runs.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_head_logprobs_and_gradients_equal_an_upcast_fp32_reference(dtype):
    *inputs, targets = head_inputs(dtype)
    got = run(fused, inputs, targets)
    want = run(reference, [x.float() for x in inputs], targets)
    for g, w in zip(got[:2], want[:2]):  # fp32 logits: rounding them to half errs by ~1e-2
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for g, w, name in zip(got[2:], want[2:], ("hidden", "weight", "bias")):
        assert g.dtype == dtype, name  # half gradients, within half rounding of the fp32 ones
        assert (g.float() - w).norm() / w.norm() < torch.finfo(dtype).eps, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_samplers_head_logits_equal_a_plain_linear_in_fp32_at_least(dtype):
    """head_logits (the sampler's, forward only): fp32 logits of a half head, fp64 of an fp64."""
    *inputs, _ = head_inputs(dtype)
    got = modeling.head_logits(*inputs)
    want = F.linear(*[x.to(got.dtype) for x in inputs])
    assert got.dtype == torch.promote_types(dtype, torch.float32)
    tol = {torch.float64: 1e-13}.get(dtype, 2e-6)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("transform", [(1.0, 1.0, None), ARGS, (1.3, 2.0, 3.0)],
                         ids=["plain", "T0.7-scale0.5-cap30", "T1.3-scale2-cap3"])
@pytest.mark.parametrize("keep", KEEP.values(), ids=KEEP.keys())
def test_fused_head_equals_log_softmax_gather_and_entropy_values_and_gradients(
        dtype, entropy_grad, transform, keep, monkeypatch):
    """HeadLogprobs (fp32 logits, kept from forward or recomputed, and overwritten by their
    gradient in backward) against plain autograd of log_softmax(softcap(scale (h W^T + b)) / T):
    the target's log-prob, the entropy, and the gradients of a mix of both (the entropy's only
    when it has one), across chunks (5 rows) and elementwise blocks (3 rows) that do not divide
    the 24 rows."""
    monkeypatch.setattr(modeling, "HEAD_ROWS", (3, 3))
    *inputs, targets = head_inputs(dtype)
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    lp, ent = fused(*inputs, targets, *transform, entropy_grad, 5, keep)
    assert lp.dtype == ent.dtype == torch.promote_types(dtype, torch.float32)
    assert ent.requires_grad == entropy_grad
    mix = torch.randn(2, N, generator=torch.Generator().manual_seed(1), dtype=lp.dtype)
    ((lp * mix[0]).sum() + (ent * mix[1]).sum() * entropy_grad).backward()
    up = [x.detach().to(lp.dtype).requires_grad_() for x in inputs]
    want_lp, want_ent = reference(*up, targets, *transform)
    ((want_lp * mix[0]).sum() + (want_ent * mix[1]).sum() * entropy_grad).backward()
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]
    torch.testing.assert_close(lp, want_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, want_ent, rtol=tol, atol=tol)
    for x, w, name in zip(inputs, up, ("hidden", "weight", "bias")):
        assert x.grad.dtype == dtype, name  # half: within half rounding of the fp32 gradient
        err = (x.grad.to(w.dtype) - w.grad).norm() / w.grad.norm()
        assert err < (torch.finfo(dtype).eps if dtype in HALF else tol), name


class MmOutDtypeDevice(TorchDispatchMode):
    """A device with aten::mm.dtype: its kernel as torch's CUDA one checks and computes it (half
    or same-dtype inputs, fp32 accumulation, out_dtype output); every op dispatched is recorded as
    (op, output dtypes and shapes, input dtypes and shapes)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func is torch.ops.aten.mm.dtype:
            a, b, out_dtype = args
            if a.dtype != b.dtype:
                raise RuntimeError("input dtypes must be the same")
            if out_dtype != a.dtype and not (out_dtype == torch.float32 and a.dtype in HALF):
                raise RuntimeError("out_dtype must be the same as input dtype or fp32 for "
                                   "fp16/bf16 inputs")
            out = (a.float() @ b.float()).to(out_dtype)
        else:
            out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((func, [(o.dtype, tuple(o.shape)) for o in outs
                                if isinstance(o, torch.Tensor)],
                         [(t.dtype, tuple(t.shape)) for t in tensors]))
        return out


def test_without_an_mm_out_dtype_kernel_the_probe_says_so_and_the_head_upcasts(fresh_probe):
    """torch 2.13's CPU has no aten::mm.dtype kernel: the probe must fail cleanly, and the head
    take the upcast path (the tests above ran it)."""
    assert not modeling.mm_out_dtype_runs(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(NotImplementedError):
        x = torch.ones(1, 1, dtype=torch.bfloat16)
        torch.mm(x, x, out_dtype=torch.float32)


@pytest.mark.parametrize("keep", KEEP.values(), ids=KEEP.keys())
def test_where_mm_out_dtype_runs_the_head_uses_it_both_ways_and_never_copies_the_weight(
        fresh_probe, monkeypatch, keep):
    monkeypatch.setattr(modeling, "HEAD_ROWS", (5, 5))  # blocks [5, V]: no shape of a [D, V] tensor
    *inputs, targets = head_inputs(torch.bfloat16)
    head = functools.partial(fused, keep=keep)
    plain = run(head, inputs, targets)  # the upcast path, as on this CPU
    modeling.mm_out_dtype_runs.cache_clear()
    with MmOutDtypeDevice() as device:
        got = run(head, inputs, targets)
        assert not modeling.mm_out_dtype_runs(torch.device("cpu"), torch.float32)  # halves only
    bf16, fp32 = torch.bfloat16, torch.float32
    gemms = [(ins, outs[0][0]) for func, outs, ins in device.ops if func is torch.ops.aten.mm.dtype]
    logits = ([(bf16, (N, D)), (bf16, (D, V))], fp32)
    assert gemms == [([(bf16, (1, 1))] * 2, fp32),  # the probe, once
                     *[logits] * (1 + (keep == 0)),  # forward (then its recompute in backward)
                     ([(bf16, (N, V)), (bf16, (V, D))], fp32),  # grad hidden: a sum over V
                     ([(bf16, (V, N)), (bf16, (N, D))], bf16)]  # grad weight: a sum over N
    assert not [op for op in device.ops if op[0] in (torch.ops.aten.mm.default,
                                                     torch.ops.aten.addmm.default)]
    assert not [op for op in device.ops  # no fp32 copy of the weight, nor a [V, D] fp32 grad
                if any(d == fp32 and s in ((V, D), (D, V)) for d, s in op[1])]
    for g, w in zip(got, plain):
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same fp32 accumulation


def test_policy_logprobs_of_an_fp32_model_equal_its_own_forward_values_and_gradients():
    """Log-probs, entropies and their gradients through the chunked, fused head of a tiny
    fp32 Llama with tied embeddings (the head's weight gradient adds to the embedding's), against
    its own per-sequence forward's log_softmax; with `scored`, the head on those positions alone
    (the rest 0, read by nothing): the same values there and the same gradients."""
    config = AutoConfig.for_model("llama", vocab_size=V, hidden_size=D, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    AttentionInterface.register("packed", attention.packed_attention)
    model = AutoModelForCausalLM.from_config(config).eval()
    seqs = [torch.randint(V, (n,)).tolist() for n in (9, 6)]
    ids = sum((s[:-1] for s in seqs), [])
    pos = sum((list(range(len(s) - 1)) for s in seqs), [])
    targets = torch.tensor(sum((s[1:] for s in seqs), []))
    mix = torch.randn(2, len(ids))

    def objective(lp, ent):
        model.zero_grad()
        ((lp * mix[0]).sum() + (ent * mix[1]).sum()).backward()
        return [p.grad.clone() for p in model.parameters()]

    for scored in (None, torch.tensor([2, 3, 4, 9, 10, 12])):
        keep = torch.ones(len(ids)) if scored is None else \
            torch.zeros(len(ids)).index_fill_(0, scored, 1.0)
        mix.mul_(keep)
        model.set_attn_implementation("packed")
        lp, ent = modeling.policy_logprobs(model, torch.tensor([ids]), torch.tensor([pos]),
                                           targets, temperature=0.8, chunk=5, scored=scored)
        grads = objective(lp, ent)
        model.set_attn_implementation("eager")
        logp = torch.cat([model(input_ids=torch.tensor([s[:-1]]), use_cache=False).logits[0]
                          for s in seqs]).div(0.8).log_softmax(-1)
        want = (logp.gather(-1, targets[:, None])[:, 0] * keep, -(logp.exp() * logp).sum(-1) * keep)
        assert lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, want[1], rtol=1e-5, atol=1e-5)
        for g, w in zip(grads, objective(*want)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("keep", [N * V * 4, N * V * 4 - 1], ids=["fits", "one-byte-short"])
def test_the_head_keeps_its_logits_up_to_keep_bytes_and_a_second_backward_recomputes_them(keep):
    """Logits of at most `keep` bytes stay from forward to backward: one logits GEMM in all, not
    two. Backward overwrites them, so a retained graph's later backwards rerun the GEMM, and their
    gradients equal the first's."""
    *inputs, targets = head_inputs(torch.float32)
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    with MmOutDtypeDevice() as device:
        lp, ent = fused(*inputs, targets, *ARGS, keep=keep)
        (lp.sum() + ent.sum()).backward(retain_graph=True)
        first = [x.grad.clone() for x in inputs]
        gemms = len(device.ops)
        for _ in range(2):
            for x in inputs:
                x.grad = None
            (lp.sum() + ent.sum()).backward(retain_graph=True)
            for x, g in zip(inputs, first):
                torch.testing.assert_close(x.grad, g, rtol=1e-6, atol=1e-7)
    logit_gemms = [i for i, (func, outs, _) in enumerate(device.ops)
                   if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out)
                   and outs[0][1] == (N, V)]
    kept = keep >= N * V * 4
    assert sum(i < gemms for i in logit_gemms) == (1 if kept else 2)
    assert sum(i >= gemms for i in logit_gemms) == 2


def test_policy_logprobs_keeps_the_heads_logits_only_where_a_backward_can_follow(monkeypatch):
    """HEAD_KEEP bytes with gradients on; none under no_grad (the reference's and the old policy's
    log-probs), where nothing would ever free them early."""
    config = AutoConfig.for_model("llama", vocab_size=V, hidden_size=D, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2)
    AttentionInterface.register("packed", attention.packed_attention)
    model = AutoModelForCausalLM.from_config(config)
    model.set_attn_implementation("packed")
    calls, apply = [], modeling.HeadLogprobs.apply
    monkeypatch.setattr(modeling.HeadLogprobs, "apply",
                        staticmethod(lambda *args: calls.append(args[-1]) or apply(*args)))
    ids = torch.randint(V, (1, 7))
    args = ids, torch.arange(7)[None], ids[0].roll(-1)
    modeling.policy_logprobs(model, *args)
    with torch.no_grad():
        modeling.policy_logprobs(model, *args)
    assert calls == [modeling.HEAD_KEEP, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_heads_gradients_over_many_chunks_are_rounded_once_not_per_chunk(dtype):
    """Recomputed in chunks of 2 rows (12 chunks), d weight and d bias are summed in fp32 and
    rounded to half once: as close to the fp32 reference as one chunk's (a half accumulator
    rounds at every chunk: ~sqrt(12) x the error)."""
    *inputs, targets = head_inputs(dtype)
    want = run(reference, [x.float() for x in inputs], targets)
    one = run(functools.partial(fused, chunk=N), inputs, targets)
    many = run(functools.partial(fused, chunk=2), inputs, targets)
    for k, name in ((3, "weight"), (4, "bias")):
        assert many[k].dtype == dtype, name
        err = [(g[k].float() - want[k]).norm() / want[k].norm() for g in (one, many)]
        assert err[1] <= 1.05 * err[0], \
            f"{name}: {err[1]:.2e} over {N // 2} chunks, {err[0]:.2e} in one"


def plain(hidden, weight, bias, targets, temperature=1.0, scale=1.0, softcap=None,
          entropy_grad=True):
    """modeling.plain_head, the head as written (autograd's backward), with fused's arguments."""
    return modeling.plain_head(hidden, weight, bias, targets, temperature, scale, softcap,
                               entropy_grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("transform", [(1.0, 1.0, None), ARGS, (1.3, 2.0, 3.0)],
                         ids=["plain", "T0.7-scale0.5-cap30", "T1.3-scale2-cap3"])
@pytest.mark.parametrize("keep", KEEP.values(), ids=KEEP.keys())
def test_plain_head_equals_the_chunked_head_values_and_gradients(dtype, entropy_grad, transform,
                                                                 keep, monkeypatch):
    """modeling.plain_head (every row's fp32 logits at once, autograd's backward) and HeadLogprobs
    (chunks of 5 rows, blocks of 3, logits kept or recomputed) compute the same log-probs and
    entropies (fp32 at least), with a graph for the entropy only when asked, and the same
    gradients: equal to each other in fp32/fp64, each within half rounding of the fp32 ones for
    a bf16 head."""
    monkeypatch.setattr(modeling, "HEAD_ROWS", (3, 3))
    *inputs, targets = head_inputs(dtype)
    mix = torch.randn(2, N, generator=torch.Generator().manual_seed(1),
                      dtype=torch.promote_types(dtype, torch.float32))
    results = []
    for head in (plain, functools.partial(fused, chunk=5, keep=keep)):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        lp, ent = head(*xs, targets, *transform, entropy_grad=entropy_grad)
        assert lp.dtype == ent.dtype == mix.dtype
        assert ent.requires_grad == entropy_grad
        ((lp * mix[0]).sum() + (ent * mix[1]).sum() * entropy_grad).backward()
        results.append([lp, ent, *(x.grad for x in xs)])
    tol = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]
    (want_lp, want_ent, *want_grads), (lp, ent, *grads) = results
    torch.testing.assert_close(lp, want_lp, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, want_ent, rtol=tol, atol=tol)
    up = [x.detach().float().requires_grad_() for x in inputs]
    ref_lp, ref_ent = reference(*up, targets, *transform)
    ((ref_lp * mix[0]).sum() + (ref_ent * mix[1]).sum() * entropy_grad).backward()
    for g, w, x, name in zip(grads, want_grads, up, ("hidden", "weight", "bias")):
        assert g.dtype == w.dtype == dtype, name
        if dtype in HALF:  # each a rounding of its own fp32 gradient to half
            for got in (g, w):
                assert (got.float() - x.grad).norm() / x.grad.norm() < torch.finfo(dtype).eps, name
        else:
            torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("scored", [None, [2, 3, 4, 9, 10, 12]], ids=["all", "scored"])
def test_fast_head_off_runs_policy_logprobs_through_the_plain_head_with_equal_results(
        scored, monkeypatch):
    """modeling.FAST_HEAD = False: policy_logprobs takes plain_head, never HeadLogprobs, and its
    log-probs, entropies and every parameter's gradient equal the chunked head's, for a float64
    Gemma 2 (final logit softcap) at temperature 0.8, on every position or the scored ones."""
    config = AutoConfig.for_model("gemma2", vocab_size=V, hidden_size=D, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, sliding_window=4,
                                  final_logit_softcapping=0.5, max_position_embeddings=64,
                                  pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    AttentionInterface.register("packed", attention.packed_attention)
    model = AutoModelForCausalLM.from_config(config).double().eval()
    model.set_attn_implementation("packed")
    assert modeling.head_transform(model.config) == (1.0, 0.5)
    seqs = [torch.randint(V, (n,)).tolist() for n in (9, 6)]
    ids = torch.tensor([sum((s[:-1] for s in seqs), [])])
    pos = torch.tensor([sum((list(range(len(s) - 1)) for s in seqs), [])])
    targets = torch.tensor(sum((s[1:] for s in seqs), []))
    scored = None if scored is None else torch.tensor(scored)
    mix = torch.randn(2, ids.shape[1], dtype=torch.float64)
    heads, fused_apply, plain_head = [], modeling.HeadLogprobs.apply, modeling.plain_head
    monkeypatch.setattr(modeling.HeadLogprobs, "apply", staticmethod(
        lambda *a: heads.append("fused") or fused_apply(*a)))
    monkeypatch.setattr(modeling, "plain_head", lambda *a: heads.append("plain") or plain_head(*a))
    results = []
    for fast in (True, False):
        monkeypatch.setattr(modeling, "FAST_HEAD", fast)
        model.zero_grad()
        lp, ent = modeling.policy_logprobs(model, ids, pos, targets, temperature=0.8,
                                           scored=scored, chunk=5)
        ((lp * mix[0]).sum() + (ent * mix[1]).sum()).backward()
        results.append([lp.detach(), ent.detach()] + [p.grad.clone() for p in model.parameters()])
    assert heads == ["fused", "plain"]
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
