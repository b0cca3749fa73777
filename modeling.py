"""How nanoareal runs a Hugging Face causal LM: packed rows (1-D runs of tokens from many sequences,
their `segments` saying who attends to what) on every attention path, Ulysses context parallel (a
rank runs a contiguous 1/N of a row), log-probs from the model's own head in vocabulary chunks. A
model is body + head + the head's transform; `check_model` refuses a family it misreproduces."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import socket
from dataclasses import replace
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from cli import UserError, why

HALF = (torch.float16, torch.bfloat16)  # the varlen kernels' dtypes; fp32 takes the padded path
# padded path: short segments sharing a context (a group's completions and their prompt) share one
# row of at most this many slots: a CPU's sdpa costs per row, and 8 x 10 slots cost more than 32
GROUP_ROW_SLOTS = 64
# selective checkpointing keeps these ops' outputs (a layer's matmuls and attention kernel)
KEPT_OPS = tuple(getattr(torch.ops.aten, op).default for op in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, op))
# model_type prefix -> (the config field that scales its head's logits, whether it divides by it)
HEAD_SCALES = {"granite": ("logits_scaling", True), "cohere": ("logit_scale", False),
               "hyperclovax": ("logits_scaling", False), "falcon_h1": ("lm_head_multiplier", False)}
# LoRA: alpha fixed (alpha/r shrinks as r grows: one lr suits every rank; with Adam alpha and lr are
# one knob); every linear layer of the decoder, never the head (read as head.weight: bypassed)
LORA_ALPHA, LORA_TARGETS = 32, "all-linear"
HEAD_CHUNK, HEAD_ROWS = 1024, (16, 256)  # the head's fp32 logits: rows at once; a pass's CPU/GPU
HEAD_KEEP = 1 << 29  # bytes of logits kept from forward to backward (else a GEMM reruns them)
BIG_WEIGHT = 10**5  # the CPU engine packs weights of this many elements for oneDNN (pack_weights)
NO_RERUN_UP_TO = 0.8  # a GPU checkpoints no layer while the plan without it is <= this share

# -----------------------------------------------------------------------------
# attention layouts and kernels
def segments_from_positions(position_ids: Tensor) -> Tensor:
    """Segments [R, 4] (start, len, 0, 0) of a row of whole sequences (positions restart at 0)."""
    start = torch.nonzero(position_ids.flatten() == 0).flatten()
    length = torch.diff(start, append=start.new_tensor([position_ids.numel()]))
    return F.pad(torch.stack([start, length], 1), (0, 2))


def check_segments(segments: Tensor, num_tokens: int) -> None:
    """A packed row's segments [R, 4] are on the host (packing makes them there: a copy from a
    device would sync), cover its num_tokens tokens in order, and take context from earlier ones."""
    if segments.device.type != "cpu":
        raise ValueError(f"segments must be a CPU tensor, got one on {segments.device}")
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    if int(q_len.sum()) != num_tokens or (q_start != torch.cumsum(q_len, 0) - q_len).any():
        raise ValueError(f"segments must cover the {num_tokens} tokens of the row in order, got "
                         f"{segments.tolist()}")
    if ((ctx_start < 0) | ((ctx_len > 0) & (ctx_start + ctx_len > q_start)) | (ctx_len < 0)).any():
        raise ValueError("a segment's context must be earlier tokens of the row, got "
                         f"{segments.tolist()}")


def attention_layout(segments: Tensor, num_tokens: int, device: torch.device | None = None,
                     kernel=None, cp_group=None) -> dict:
    """Index tensors for segment_attention, built once per micro-batch on the CPU (no GPU sync for
    the sizes). A row (q_start, q_len, ctx_start, ctx_len) of `segments` [R, 4]: q_len tokens attend
    causally to ctx_len earlier tokens (a shared prompt prefix), then to themselves. Varlen:
    `k_index`, `cu_q`, `cu_k` (bottom-right causal). Padded: rows of slots (`grid`: slot -> token,
    `out`: token -> its query slot, `pos`: a slot's position in its sequence), `mask` [rows, 1,
    slots, slots] if a row holds several segments (else causal). `cp_group`: who shares the row."""
    check_segments(segments, num_tokens)
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    row_len = ctx_len + q_len
    j = torch.arange(int(row_len.max()))[None]
    src = torch.where(j < ctx_len[:, None], ctx_start[:, None] + j,
                      q_start[:, None] + j - ctx_len[:, None])
    index = {"k_index": src[j < row_len[:, None]], "cu_q": F.pad(q_len.cumsum(0), (1, 0)).int(),
             "cu_k": F.pad(row_len.cumsum(0), (1, 0)).int()}
    rows, size, masked = _padded_rows(segments.tolist(), int(row_len.max()) <= GROUP_ROW_SLOTS)
    # buckets (first slot, rows, width, lead) of rows longest first, copied contexts' apart (their
    # first `lead` slots: keys alone, no query computed), one kernel call each: a row of L slots
    # in a bucket W wide costs W^2, not L^2, so a bucket takes rows down to W / sqrt(2) (short: 1)
    rows, size = zip(*sorted(zip(rows, size), key=lambda r: (r[0][0][3], -r[1])))
    buckets, slots = [], 0
    for row, width in zip(rows, size):
        lead, wide = 0 if row[0][3] else row[0][1], buckets[-1][2] if buckets else 0
        if not buckets or (lead > 0) != (buckets[-1][3] > 0) or 2 * width * width < wide * wide \
                and wide > GROUP_ROW_SLOTS:
            buckets.append([slots, 0, width, lead])
        buckets[-1][1], slots = buckets[-1][1] + 1, slots + buckets[-1][2]
        buckets[-1][3] = min(buckets[-1][3], lead)
    size, buckets = torch.tensor(size), [tuple(b) for b in buckets]
    start, length, seg, query = (torch.tensor(x) for x in zip(*sum(rows, [])))
    n = torch.arange(int(length.sum()))
    tok = torch.repeat_interleave(start - torch.cumsum(length, 0) + length, length) + n
    seg, query, row = (torch.repeat_interleave(x, y) for x, y in (
        (seg, length), (query, length), (torch.arange(len(rows)), size)))
    first = torch.tensor([f + i * w for f, k, w, _ in buckets for i in range(k)])  # row's 1st slot
    flat = first[row] + n - (torch.cumsum(size, 0) - size)[row]
    grid, pos = torch.zeros(2, slots, dtype=torch.long)  # padding slots read token 0
    grid[flat] = tok
    pos[flat] = torch.where(query, ctx_len[seg] + tok - q_start[seg], tok - ctx_start[seg])
    out = torch.empty(num_tokens, dtype=torch.long).index_put_((tok[query],), flat[query])
    index |= {"grid": grid, "out": out, "pos": pos}
    if masked:  # rows of several segments: a query sees its context and its own past
        owner = torch.full((slots,), -1).index_put_((flat[query],), seg[query])
        of_token = torch.repeat_interleave(torch.arange(len(segments)), q_len)
        real = torch.zeros(slots, dtype=torch.bool).index_fill_(0, flat, True)
        index["mask"] = [_row_mask(owner[f : f + k * w].view(k, w, 1), grid[f : f + k * w].view(
            k, 1, w), real[f : f + k * w].view(k, 1, w), of_token, ctx_start, ctx_len)
                         for f, k, w, _ in buckets]
    index["tail"] = [torch.ones(w, w, dtype=bool).tril()[a:] if a else None for *_, w, a in buckets]
    return {"mask": None} | {k: [m if m is None else m.to(device, non_blocking=True) for m in v]
                             if isinstance(v, list) else v.to(device, non_blocking=True)
                             for k, v in index.items()} | {
        "buckets": buckets, "max_q": int(q_len.max()), "max_k": int(row_len.max()),
        "kernel": kernel, "cp_group": cp_group}


def _padded_rows(segments: list, short: bool) -> tuple[list, list, bool]:
    """(rows, their sizes, whether any needs a mask) of the padded path: a row holds pieces (first
    token, length, segment, is query), a copied context keys only. A segment whose context starts a
    context-free one (its prompt) joins its row: while rows are `short`, several (a mask then);
    else the first whose context is all of it (still causal)."""
    rows, size, host, masked = [], [], {}, False
    for i, (qs, ql, cs, cl) in enumerate(segments):
        r = host.get(cs) if cl else None
        if r is not None and cl <= rows[r][0][1] and (size[r] + ql <= GROUP_ROW_SLOTS if short
                                                      else size[r] == cl):
            masked |= size[r] != cl  # its context is not all the row before it
            rows[r].append((qs, ql, i, True))
            size[r] += ql
            continue
        host.update({} if cl else {qs: len(rows)})
        rows.append([(cs, cl, i, False)] * (cl > 0) + [(qs, ql, i, True)])
        size.append(cl + ql)
    return rows, size, masked


def _row_mask(own, key, real, of_token, ctx_start, ctx_len) -> Tensor:
    """[rows, 1, slots, slots]: a query slot (of segment `own`) sees its context and its own past;
    padding and a copied context's slots see themselves alone."""
    o = own.clamp(min=0)
    sees = ((of_token[key] == own) & (key <= key.transpose(1, 2))
            | (key >= ctx_start[o]) & (key < ctx_start[o] + ctx_len[o])) & real & (own >= 0)
    return (sees | torch.eye(key.shape[-1], dtype=torch.bool))[:, None]


def segment_attention(q, k, v, layout: dict, scaling: float | None = None, dropout: float = 0.0,
                      window: int | None = None, softcap: float | None = None):
    """Attention of a packed row by segments: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D]; `window` as
    HF's sliding_window (the last `window` keys, itself included), `softcap` as Gemma 2's. A varlen
    kernel gathers each segment's keys (context, then itself), else a padded [rows, H, slots, D]
    batch (cost ~ rows * slots^2, not T^2); index_select sums a copied context's gradients."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    if layout["kernel"] is not None and q.dtype in HALF:
        k, v = (x.transpose(0, 1).index_select(0, layout["k_index"]) for x in (k, v))
        return layout["kernel"](q.transpose(0, 1), k, v, layout, scaling, dropout, window, softcap)
    outs = [_padded_attention(q, k, v, layout["grid"][f : f + n * w], layout["pos"][f : f + n * w]
            .view(n, w), mask, lead, tail, scaling, dropout, window, softcap) for (f, n, w, lead),
            mask, tail in zip(layout["buckets"], layout["mask"] or [None] * len(layout["buckets"]),
                              layout["tail"])]
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, layout["out"])


def _padded_attention(q, k, v, grid, pos, mask, lead, tail, scaling, dropout, window, softcap):
    """One bucket of rows of slots (`grid`: slot -> token, `pos` [rows, slots]): q [H, T, D], k/v
    [Hkv, T, D] -> [rows * slots, H, D]; no query in the `lead` slots (0s), `tail` the others'."""
    rows, width = pos.shape
    q, k, v = (x.transpose(0, 1).index_select(0, grid).unflatten(0, (rows, width))
               .transpose(1, 2) for x in (q, k, v))  # [h, T, D] -> [rows, h, slots, D]
    if window is None and softcap is None:
        bias = mask[:, :, lead:] if mask is not None else tail
        out = F.pad(F.scaled_dot_product_attention(q[:, :, lead:], k, v, attn_mask=bias, is_causal=
            bias is None, dropout_p=dropout, scale=scaling, enable_gqa=True), (0, 0, lead, 0))
    else:  # a window is a band of positions: a query at p sees keys at p - window < p' <= p
        keep = q.new_ones(width, width, dtype=torch.bool).tril() if mask is None else mask
        if window is not None:
            keep = keep & (pos[:, None, :, None] - pos[:, None, None, :] < window)
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        scores = (q @ k.transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out = F.dropout(scores.masked_fill(~keep, float("-inf")).softmax(-1), dropout) @ v
    return out.transpose(1, 2).flatten(0, 1)


def packed_attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, layout=None,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention "packed": q [1, H, T, D], k/v [1, Hkv, T, D] -> ([1, T, H, D], None);
    the row in `layout` (attention_mask is None); under CP, T is this rank's chunk (Ulysses)."""
    if layout is None:
        raise RuntimeError("packed attention needs the row's layout: call policy_logprobs")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    args, group = (scaling, dropout, sliding_window or None, softcap or None), layout["cp_group"]
    if group is None:
        return segment_attention(q[0], k[0], v[0], layout, *args)[None], None
    n = dist.get_world_size(group)
    if k.shape[1] % n:  # too few KV heads to split: repeat each, every rank gets the ones it needs
        k, v = (x.repeat_interleave(n // math.gcd(x.shape[1], n), 1) for x in (k, v))
    q, k, v = (_Swap.apply(x, group, 1, 2) for x in (q, k, v))
    out = segment_attention(q[0], k[0], v[0], layout, *args)  # [S, H/N, D]
    return _Swap.apply(out.transpose(0, 1)[None], group, 2, 1).transpose(1, 2), None


def _flash_attn_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """flash-attn 2 (>= 2.6): bottom-right causal; window_size=(w-1, 0) keeps the last w keys."""
    from flash_attn import flash_attn_varlen_func
    return flash_attn_varlen_func(q, k, v, layout["cu_q"], layout["cu_k"], layout["max_q"],
                                  layout["max_k"], dropout_p=dropout, softmax_scale=scaling,
                                  causal=True, window_size=(window - 1 if window else -1, 0),
                                  softcap=softcap or 0.0)


@functools.cache
def _params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _torch_varlen_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """PyTorch's bundled FA2 varlen_attn: flash-attn's window_size and bottom-right causal mask."""
    from torch.nn.attention.varlen import varlen_attn
    if softcap or dropout:
        raise NotImplementedError("torch varlen_attn has no softcap or dropout")
    gqa = k.shape[1] != q.shape[1]
    if gqa and "enable_gqa" not in _params(varlen_attn):  # torch < 2.12: repeat the KV heads
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        gqa = False
    return varlen_attn(q, k, v, layout["cu_q"], layout["cu_k"], layout["max_q"], layout["max_k"],
                       scale=scaling, window_size=(window - 1 if window else -1, 0),
                       **({"enable_gqa": True} if gqa else {}))


def choose_attention(requested: str, device: torch.device, half: bool, softcap: bool
                     ) -> tuple[str, object, str]:
    """(path, kernel, why) for --attention: a varlen kernel (flash-attn, else PyTorch's) for half
    compute on a GPU, else the padded path; one requested that cannot run here raises ValueError."""
    reasons = {}
    if device.type != "cuda" or not half:
        reasons["flash_attn"] = reasons["torch_varlen"] = "it needs bf16/fp16 compute on a GPU"
    else:
        try:
            import flash_attn
            if not hasattr(flash_attn, "flash_attn_varlen_func"):  # flash-attn-4's namespace
                raise ImportError("this flash_attn has no flash_attn_varlen_func (flash-attn 2)")
        except Exception as e:  # an ABI mismatch raises ImportError or OSError
            reasons["flash_attn"] = f"flash-attn is not usable ({type(e).__name__}: {e})"
        try:  # torch 2.10's varlen_attn has neither scale nor window_size; 2.8-2.9 none at all
            from torch.nn.attention.varlen import varlen_attn
            if not {"scale", "window_size"} <= _params(varlen_attn):
                reasons["torch_varlen"] = f"torch {torch.__version__}'s varlen_attn has no " \
                    "scale/window_size (torch >= 2.11)"
        except ImportError:
            reasons["torch_varlen"] = f"torch {torch.__version__} has no nn.attention.varlen"
        if softcap:
            reasons.setdefault("torch_varlen", "the model softcaps attention logits")
    kernels = {"flash_attn": _flash_attn_kernel, "torch_varlen": _torch_varlen_kernel}
    if requested != "auto":
        if requested in reasons:
            raise ValueError(f"--attention {requested} cannot run here: {reasons[requested]}")
        return requested, kernels.get(requested), "as requested"
    path = next((p for p in kernels if p not in reasons), "sdpa")
    skipped = {} if path == "flash_attn" else reasons  # only paths before `path` have reasons
    if len(skipped) > 1 and len(set(skipped.values())) == 1:  # one reason for all: say it once
        return path, kernels.get(path), f"not {' nor '.join(skipped)}: {reasons['flash_attn']}"
    return path, kernels.get(path), "; ".join(f"not {k}: {v}" for k, v in skipped.items())


class _Swap(torch.autograd.Function):
    """Dim `split` in N blocks, block i to CP rank i, those received joined along `join`: heads for
    tokens [B, H, S/N, D] -> [B, H/N, S, D] is (1, 2); the way back, (2, 1), is the backward."""
    @staticmethod
    def forward(ctx, x, group, split: int, join: int):
        ctx.args = group, join, split
        x = x.unflatten(split, (dist.get_world_size(group), -1)).movedim(split, 0).contiguous()
        out = torch.empty_like(x)  # x contiguous first: empty_like copies a view's strides
        dist.all_to_all_single(out, x, group=group)
        return out.movedim(0, join).flatten(join, join + 1)

    @staticmethod
    def backward(ctx, grad):
        return _Swap.apply(grad, *ctx.args), None, None, None


class GatherSequence(torch.autograd.Function):
    """[..., T/N] per CP rank -> [..., T] on every CP rank. Every rank's loss reads all T values:
    the gradient of this rank's slice is the *sum* over the group of the incoming gradients."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad := grad.contiguous().clone(), group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), -1)[dist.get_rank(ctx.group)], None


def row_inputs(ids, pos, targets, segments, device, kernel=None, group=None) -> tuple[dict, dict]:
    """A packed row -> (policy_logprobs' ids, positions [1, T], targets [T] and scored index on
    `device`, the row's layout), built on the host. A CP `group` (Ulysses): this rank's contiguous
    1/N of the row, padded to a multiple of N by a segment of its own (gather_row cuts). A target
    of -1 is read by nothing: not scored (a prompt's prefix), so the head skips it."""
    T, n, r = len(ids), *((dist.get_world_size(group), dist.get_rank(group)) if group else (1, 0))
    pad = -T % n
    ids, targets = F.pad(ids, (0, pad)), F.pad(targets, (0, pad), value=-1)
    pos = torch.cat([pos, torch.arange(pad)])
    if pad:
        segments = torch.cat([segments, segments.new_tensor([[T, pad, 0, 0]])])
    mine = slice(r * (T + pad) // n, (r + 1) * (T + pad) // n)
    chunk = {"input_ids": ids[mine][None], "position_ids": pos[mine][None],
             "targets": targets[mine], "scored": (targets[mine] >= 0).nonzero()[:, 0]}
    return ({k: v.to(device) for k, v in chunk.items()},
            attention_layout(segments, T + pad, device, kernel=kernel, cp_group=group))


def gather_row(logprobs, entropy, group, num_tokens: int) -> tuple:
    """Every CP rank's chunk of log-probs and entropies -> the whole row's, on every CP rank."""
    return GatherSequence.apply(torch.stack([logprobs, entropy]), group)[:, :num_tokens].unbind()


# -----------------------------------------------------------------------------
# the model: body, head, log-probs
def check_model_source(name: str) -> None:
    """--model is a model directory (config.json, tokenizer files) or a cached or reachable hub id:
    a wrong path is one line at once, not a minute of retries against an unreachable hub."""
    path, bad = Path(name).expanduser(), lambda problem: UserError(f"--model {name}: {problem}")
    if path.exists():
        if not (path / "config.json").is_file():
            raise bad("not a model directory (it has no config.json)")
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((path / f).is_file() for f in files):
            raise bad(f"no tokenizer files there (none of {', '.join(files)}); save the tokenizer "
                      "with the model")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not an org/name id
        raise bad("no such directory")
    try:
        from huggingface_hub import try_to_load_from_cache
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # not a valid repo id either
        raise bad("no such directory, nor a Hugging Face hub id") from None
    where = f"no such directory, and {name!r} is not in the local Hugging Face cache"
    if {os.environ.get(v, "0") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")} - {"0", ""}:
        raise bad(f"{where} (HF_HUB_OFFLINE is set)")
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        raise bad(f"{where}, and {host} cannot be reached to download it") from None


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, heads_divisor: int,
                   attention: str, half: bool, check: bool = True, shard=lambda model: None,
                   lora: tuple[int, str | None] = (0, None)):
    """(model, which attention runs): an HF causal LM in `dtype`, dropout off (its log-probs must be
    the sampler's), on packed rows with the fastest kernel that can (`half`: bf16 compute), checked
    against its own forward (`check`), else a UserError on every rank. No rank holds a whole copy on
    `device`: each `shard`s a meta-device model (FSDP2), then takes its shards of the weights rank 0
    read on the host, tensor by tensor. `lora`: apply_lora's (rank, adapter), before `shard`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    AttentionInterface.register("packed", torch.compiler.disable(packed_attention))
    full, error = None, [None]
    if not dist.is_initialized() or dist.get_rank() == 0:  # (a config error: no group needed)
        try:
            full = _load_checked(path, dtype, heads_divisor, check)
            apply_lora(full, *lora)  # rank 0's adapters (initial or loaded) go to every rank
        except UserError as e:
            error = [str(e)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise UserError(error[0])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
            path, use_cache=False), dtype=dtype, attn_implementation="packed")
    described = apply_lora(model, *lora)
    shard(model)
    model.to_empty(device=device).eval().tie_weights()  # to_empty unties a plain model; no dropout
    set_model_state_dict(model, {} if full is None else full.state_dict(), options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    mine = {} if full is None else dict(full.named_buffers())
    for name, buffer in model.named_buffers():  # some are in no state dict (RoPE's inv_freq)
        dist.broadcast(buffer.copy_(mine[name]) if mine else buffer, src=0)
    text = model.config.get_text_config()
    try:
        kind, model.attention_kernel, reason = choose_attention(
            attention, device, half, bool(getattr(text, "attn_logit_softcapping", None)))
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    return model, f"{described}attention: {kind}{f' ({reason})' if reason else ''}"


def _load_checked(path: str, dtype: torch.dtype, heads_divisor: int, check: bool):
    """Rank 0's whole model, on the host; a UserError if it cannot run here."""
    from transformers import AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_cache=False,
                                                     attn_implementation="packed").eval()
    except (OSError, ValueError) as e:  # no weights, an unknown architecture, ...
        raise UserError(f"--model {path}: cannot load a causal LM ({why(e)})") from None
    text = model.config.get_text_config()
    if text.num_attention_heads % heads_divisor:  # each CP rank attends with H/N whole heads
        raise UserError(f"config error: --cp-size {heads_divisor} must divide the model's "
                        f"{text.num_attention_heads} attention heads")
    if check and (problem := check_model(model, text.vocab_size)):
        raise UserError(f"--model {path} ({text.model_type}) is not supported: {problem}")
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one, innermost first: modules of the classes the model never
    splits (`_no_split_modules`), else the children of its longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return (blocks or list(max(lists, key=len, default=[])))[::-1]


def memory_plan(params: int, trainable: int, layers: int, hidden: int, intermediate: int,
                kv_dim: int, vocab: int, world: int, tokens: int, checkpointing: bool | str, *,
                tied: bool = False, master_bytes: int = 4, frozen_bytes: int | None = None,
                compute_bytes: int = 2, engine_generating: float = 0.0,
                engine_training: float = 0.0, grads_unsharded: bool = False) -> dict[str, float]:
    """Peak bytes per rank of a training step of a decoder LM FSDP2-sharded over `world` ranks (one
    in full precision: plain), by part, and "total". `params` all parameters, `trainable` those
    with gradients and AdamW state (in `master_bytes`), the rest in `frozen_bytes` (LoRA's base);
    `tokens` a micro-batch's positions on this rank. Activations saved per token and layer: the
    RMSNorms' fp32 inputs and outputs, q, k, v, attention output, o_proj input, the MLP's gate,
    SiLU, up and product; checkpointed, each layer's input (`checkpointing` "selective", compiled
    layers: and what its matmuls and attention return), plus one layer rerun. "gathered": FSDP2's
    unsharded params and grads (two layers, the root); `grads_unsharded`: whole grads until the
    step. The engine holds `engine_generating` while it generates, `engine_training` else."""
    frozen_bytes = master_bytes if frozen_bytes is None else frozen_bytes
    fsdp = world > 1 or compute_bytes != master_bytes  # load_model's rule: ranks, or bf16 compute
    root = vocab * hidden * (1 if tied else 2)
    layer = tokens * (8 * hidden + compute_bytes * (5 * hidden + 2 * kv_dim + 4 * intermediate))
    kept = {"selective": 5 * hidden + 2 * kv_dim + 2 * intermediate}.get(checkpointing, hidden)
    saved = layers * tokens * kept * compute_bytes if checkpointing else layers * layer
    plan = {"weights": (trainable * master_bytes + (params - trainable) * frozen_bytes) / world,
            "grads": trainable * master_bytes * (1 / world + (grads_unsharded and fsdp)),
            "adamw": 2 * trainable * master_bytes / world,
            "activations": saved + layer * (2 if checkpointing else 1),
            "head": (max(4, compute_bytes) + compute_bytes % 4) * vocab * min(tokens, max(
                HEAD_CHUNK, HEAD_KEEP // (max(4, compute_bytes) * vocab))),  # kept, or a chunk
            "gathered": fsdp * 2 * compute_bytes * (2 * (params - root) / layers + root)}
    plan["engine"] = max(engine_generating, engine_training)
    plan["total"] = max(plan["weights"] + plan["adamw"] + engine_generating,
                        sum(plan.values()) - plan["engine"] + engine_training)
    return plan


def adamw(params: list, **kwargs) -> torch.optim.AdamW:
    """Fused AdamW (CPU: 33 ms a step looped, 8 foreach, 5), its state made now as its first step
    would, before any activation: made in their freed memory, the next step's fault in afresh."""
    optimizer = torch.optim.AdamW(params, fused=True, **kwargs)
    for p in params:
        optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                              "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


def checkpoint_layers(model: torch.nn.Module, selective: bool = False, from_elements: int = 0):
    """Activation checkpointing: each decoder layer keeps only its inputs for backward and runs
    its forward again there; `selective` also keeps what KEPT_OPS return, so the rerun is the
    elementwise work alone (norms, RoPE, activation, products). Non-reentrant, inside FSDP2's
    hooks (they gather the layer's weights for the rerun too); a CP all-to-all inside reruns on
    every rank alike (equal chunks: row_inputs). Exact: no dropout, a rerun op computes what it did.
    A layer input under `from_elements` runs as is (135M shape, 764 positions: 12% faster)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as keeping
    kw = {"context_fn": functools.partial(keeping, list(KEPT_OPS))} if selective else {}
    for layer in decoder_layers(model):
        layer.forward = functools.partial(_maybe_rerun, layer.forward, from_elements, kw)


def compile_layers(model: torch.nn.Module, device: torch.device, from_params: int) -> str | None:
    """torch.compile each decoder layer (dynamic shapes, attention eager): inductor fuses its
    elementwise work and reruns it in backward (as selective checkpointing). None, or why not."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    if sum(p.numel() for m in decoder_layers(model) for p in m.parameters()) < from_params:
        return f"eager (decoder layers under {from_params / 1e6:g}M parameters)"
    try:  # a CPU's C++ compiler (CXX, else g++; raises if none); a GPU's triton ships with torch
        get_cpp_compiler() if device.type == "cpu" else None
    except Exception as e:
        return f"eager ({e})"
    torch._dynamo.config.suppress_errors = True  # what fails to compile runs eager (a warning)
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def _maybe_rerun(forward, from_elements: int, kw: dict, *args, **kwargs):
    if (args[0] if args else kwargs["hidden_states"]).numel() < from_elements:
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kw, **kwargs)


def startup_memory(model, world: int, tokens: int, checkpointing: bool | str | None, mixed: bool,
                   gpu: tuple[int, int] | None = None, engine_releases: bool = False,
                   frozen_copies: int = 0) -> tuple[str, bool, bool | str]:
    """(the plan's line, whether gradients may stay unsharded until the optimizer step (where that
    fits), `checkpointing` (None: True unless the GPU holds the plan without it)). `gpu`: (free,
    total) bytes before the weights loaded (None: a CPU, print only), the rest the engine's: all of
    it while generating, none in training if `engine_releases`. A UserError if nothing fits."""
    text, params = model.config.get_text_config(), list(model.parameters())
    capacity, engine = (gpu[1], gpu[1] - gpu[0]) if gpu else (None, 0.0)
    heads, hidden = text.num_attention_heads, text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    frozen = [p for p in params if not p.requires_grad]  # LoRA's base: its KL reference too
    n = sum(p.numel() for p in params) * (1 + frozen_copies * (not frozen))
    shape = (n, sum(p.numel() for p in params if p.requires_grad),
             text.num_hidden_layers, hidden, getattr(text, "intermediate_size", None) or 4 * hidden,
             (getattr(text, "num_key_value_heads", None) or heads) * head_dim, text.vocab_size,
             world, tokens)
    master = next((p for p in params if p.requires_grad), params[0]).element_size()
    kw = {"tied": bool(getattr(text, "tie_word_embeddings", False)), "master_bytes": master,
          "frozen_bytes": (frozen or params)[0].element_size(),
          "compute_bytes": 2 if mixed else master, "engine_generating": engine,
          "engine_training": 0.0 if engine_releases else engine}
    plain = getattr(model, "why_eager", "") is None and "selective"  # compiled: as selective
    raw = memory_plan(*shape, plain, grads_unsharded=True, **kw)
    if checkpointing is None:
        checkpointing = capacity is None or raw["total"] > NO_RERUN_UP_TO * capacity
    deferred, synced = (memory_plan(*shape, checkpointing or plain, grads_unsharded=g, **kw)
                        for g in (True, False))
    defer = capacity is None or deferred["total"] <= capacity
    plan = deferred if defer else synced  # one line, in GiB (MiB when small)
    unit, scale = ("GiB", 2**30) if plan["total"] >= 2**30 or capacity else ("MiB", 2**20)
    f = lambda b: f"{b / scale:.1f}"
    line = " + ".join(f"{k} {f(v)}" for k, v in plan.items() if k != "total" and v) + (
        f" ({f(raw['activations'])} without checkpointing)" if checkpointing else "") + \
        f" = {f(plan['total'])}" + (f" of {f(capacity)}" if capacity else "") + f" {unit}"
    if plan["total"] > (capacity or math.inf):
        raise UserError(f"config error: this will not fit: {line}; lower --micro-batch-tokens "
                        "(activations), raise --cp-size, or use more GPUs (weights, grads and "
                        "AdamW are sharded over ranks)")
    return f"memory per rank (plan): {line}", defer, checkpointing


def head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) a family's forward applies to its lm_head output: logits * scale, then
    softcap * tanh(logits / softcap). check_model catches a family that applies something else."""
    text = config.get_text_config()
    kind = getattr(text, "model_type", "") or ""
    field, divide = next((v for k, v in HEAD_SCALES.items() if kind.startswith(k)), (None, False))
    value = getattr(text, field, None) if field else None
    scale = 1.0 if not value else 1.0 / value if divide else float(value)
    return scale, getattr(text, "final_logit_softcapping", None) or None


def policy_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0,
                    chunk: int = HEAD_CHUNK, segments: Tensor | None = None,
                    layout: dict | None = None, entropy_grad: bool = True,
                    scored: Tensor | None = None):
    """(log pi(target_t | prefix), entropy) [T] of a packed row by `segments` (default: one sequence
    per run of positions from 0) or its CP `layout`; entropy_grad=False: no entropy graph.
    `scored`: the positions read (an index, default all): the head runs there alone, the rest 0."""
    if layout is None:
        segments = segments_from_positions(position_ids.cpu()) if segments is None else segments
        layout = attention_layout(segments, input_ids.shape[-1], input_ids.device,
                                  kernel=getattr(model, "attention_kernel", None))
    hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              layout=layout).last_hidden_state[0]
    if scored is not None:  # TRL's logits_to_keep: a shared prompt's prefix predicts nothing read
        hidden, targets = hidden[scored], targets[scored]
    head = model.get_output_embeddings()
    out = HeadLogprobs.apply(hidden, head.weight, getattr(head, "bias", None), targets,
                             temperature, *head_transform(model.config), chunk, entropy_grad,
                             HEAD_KEEP if torch.is_grad_enabled() else 0)
    return out if scored is None else tuple(
        x.new_zeros(input_ids.shape[-1]).index_copy(0, scored, x) for x in out)


class HeadLogprobs(torch.autograd.Function):
    """(log p_t(y_t), H_t) [T] from hidden [T, d] and the head: x = softcap(scale (hW^T + b)) / T
    in fp32 at least (bf16 logits err by ~0.06 at 20, more than the ratio clip tolerates), log p =
    log_softmax(x), H = -sum_v p_v log p_v. x [T, V] is kept for backward if at most `keep` bytes
    (else a GEMM reruns it); there d/dx = g_lp (onehot(y) - p) - g_H p (log p + H), times scale / T
    (1 - tanh^2 under a softcap), overwrites it for two GEMMs. Exact; without `h_grad`: no d/dH."""
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temp, scale, softcap, chunk, h_grad, keep):
        ctx.set_materialize_grads(False)
        up = torch.promote_types(hidden.dtype, torch.float32)
        kept = ctx.kept = [] if len(hidden) * len(weight) * up.itemsize <= keep else None  # x stays
        ctx.args = temp, scale, softcap, chunk if kept is None else max(len(hidden), 1)
        lp_out, entropy = (hidden.new_empty(len(hidden), dtype=up) for _ in range(2))
        for rows, x in _head_blocks(hidden, weight, bias, *ctx.args, kept=kept):
            lp = torch.log_softmax(x, -1)
            lp_out[rows] = lp.gather(-1, targets[rows, None])[:, 0]
            entropy[rows] = -torch.linalg.vecdot(torch.exp(lp, out=x if kept is None else None), lp)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy if h_grad else None)
        ctx.mark_non_differentiable(*[] if h_grad else [entropy])
        return lp_out, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        (temperature, scale, softcap, _), need = ctx.args, ctx.needs_input_grad
        g_lp, g_h = (None if g is None else g * (scale / temperature) for g in (g_lp, g_h))
        grads = [torch.zeros_like(x) if n else None for x, n in zip((hidden, weight, bias), need)]
        for rows, x in _head_blocks(hidden, weight, bias, *ctx.args, grads, ctx.kept):
            cap = (x * (temperature / softcap)).square_().neg_().add_(1) if softcap else 1.0
            lp = torch.log_softmax(x, -1)
            p = torch.exp(lp, out=x)  # d/dx over x: -p (g_lp + g_H (log p + H)), + g_lp at y
            k = 0 if g_h is None else lp.add_(entropy[rows, None]).mul_(g_h[rows, None])
            p.mul_(k if g_lp is None else k + g_lp[rows, None]).neg_()
            if g_lp is not None:
                p.scatter_add_(-1, targets[rows, None], g_lp[rows, None])
            p.mul_(cap)  # d softcap tanh(u / softcap) / du = 1 - tanh^2
        return *grads, *[None] * 7


def _head_blocks(hidden, weight, bias, temperature, scale, softcap, chunk, grads=None, kept=None):
    """(rows, x) HEAD_ROWS rows at a time: logits x = softcap(scale z) / T in place in z = hW^T + b
    (fp32 at least), `chunk` rows at a time in one buffer (1024 x 150k: 0.6 GB), or `kept` (forward
    appends z, backward pops it). With `grads` [hidden, weight, bias]: once the caller overwrote a
    chunk by d/dz, its half GEMMs where they run: d hidden (a sum over V) out in fp32 (cuBLAS may
    split-K a half output in bf16), d weight in its dtype (fp32/64 accumulated in place)."""
    up, buf, again = torch.promote_types(hidden.dtype, torch.float32), None, not (grads and kept)
    for i in range(0, len(hidden), chunk):
        h = hidden[i : i + chunk]
        z = buf = kept.pop(0) if not again else _mm(h, weight.t(), up) if buf is None or not \
            h.dtype == weight.dtype == up else torch.mm(h, weight.t(), out=buf[: len(h)])  # fp32
        if again and bias is not None:
            z.add_(bias)
        for j in range(0, len(h), rows := HEAD_ROWS[h.device.type != "cpu"]):
            x = z[j : j + rows]  # below: the model's ops, then / T (kept logits had them)
            x = x if not again else (x.mul_(scale).div_(softcap).tanh_().mul_(softcap) if softcap
                                     else x.mul_(scale)).div_(temperature)
            yield slice(i + j, i + j + len(x)), x
        if kept is not None and grads is None:
            kept.append(z)  # forward's (one chunk): backward's x
        g = z.to(hidden.dtype) if grads else None
        if grads and grads[0] is not None:
            grads[0][i : i + len(h)] = _mm(g, weight, up)
        if grads and grads[1] is not None:
            grads[1].addmm_(g.t(), h) if g.dtype == up else grads[1].add_(_mm(g.t(), h, g.dtype))
        if grads and grads[2] is not None:
            grads[2].add_(z.sum(0))


@functools.cache
def mm_out_dtype_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32) runs here (torch 2.13: CUDA and XPU kernels
    for fp16/bf16 inputs, no CPU one). Probed once, without autograd: mm.dtype has no derivative."""
    try:
        x = torch.ones(1, 1, device=device, dtype=dtype)
        return dtype in HALF and torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except Exception:  # NotImplementedError: no kernel on this device; TypeError: an older torch
        return False


def _mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b accumulated in fp32 at least, as out_dtype: a half GEMM where it runs, else upcast."""
    if a.dtype == b.dtype and mm_out_dtype_runs(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    up = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    return (a.to(up) @ b.to(up)).to(out_dtype)


def pack_weights(weights: list[Tensor], rows: int) -> dict[int, Tensor]:
    """{id(W): oneDNN's copy of W, reordered once for `rows`-row inputs} of the big fp32 weights of
    the CPU engine's model for one generate call (the trainer changes them every step). A few-row
    matmul on a plain W re-blocks W at every call, a pass over it as long as the product: 135M
    shape, 16 rows, 2 threads: 2x the decode's matmuls. {} where oneDNN is absent: F.linear."""
    ok = [w for w in weights if w.device.type == "cpu" and w.dtype == torch.float32
          and w.dim() == 2 and w.numel() >= BIG_WEIGHT]
    return {id(w): torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
            for w in (ok if torch.backends.mkldnn.is_available() else [])}


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: dict | None = None):
    """F.linear(x, W, b), on W's packed copy where `packed` holds one (the same rows to ~1e-6)."""
    w = (packed or {}).get(id(weight))
    return F.linear(x, weight, bias) if w is None or x.dtype != weight.dtype else \
        torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, packed: dict | None = None
                ) -> Tensor:
    """The sampler's logits hW^T (+ b) [n, V] in fp32 at least by a half GEMM where one runs."""
    logits = linear(hidden, weight, None, packed) if hidden.dtype == weight.dtype == torch.float32 \
        else _mm(hidden, weight.t(), torch.promote_types(hidden.dtype, torch.float32))
    return logits if bias is None else logits + bias


def check_model(model, vocab_size: int) -> str | None:
    """None if our packed forward of the (unsharded) model equals its own eager one on two samples
    sharing a prompt, past a small window (every attention keyword and head transform), else why."""
    if model.config._attn_implementation != "packed":
        return "its attention does not go through transformers' AttentionInterface"
    n = min(max(16, (getattr(model.config.get_text_config(), "sliding_window", None) or 0) + 8), 64)
    p, g = n // 2, torch.Generator().manual_seed(0)
    prompt, tails = (torch.randint(vocab_size, (k,), generator=g).tolist() for k in (p, n))
    tails = [tails[:p], tails[p:][: n // 3]]
    tensor = functools.partial(torch.tensor, device=next(model.parameters()).device)
    ids = prompt[:-1] + sum((prompt[-1:] + t[:-1] for t in tails), [])
    pos = list(range(p - 1)) + sum((list(range(p - 1, p - 1 + len(t))) for t in tails), [])
    segments = torch.tensor([[0, p - 1, 0, 0], [p - 1, len(tails[0]), 0, p - 1],
                             [p - 1 + len(tails[0]), len(tails[1]), 0, p - 1]])
    try:
        with torch.no_grad():
            ours, _ = policy_logprobs(model, tensor([ids]), tensor([pos]),
                                      tensor(prompt[1:] + tails[0] + tails[1]), segments=segments)
            model.set_attn_implementation("eager")
            theirs = []
            for k, t in enumerate(tails):
                s = tensor(prompt + t)
                lp = model(input_ids=s[None], use_cache=False).logits[0].float().log_softmax(-1)
                theirs.append(lp[:-1].gather(-1, s[1:, None]).squeeze(-1)[0 if k == 0 else p - 1 :])
    except Exception as e:  # e.g. an attention keyword packed_attention does not implement
        return f"its forward fails under nanoareal's packed attention ({type(e).__name__}: {e})"
    finally:
        model.set_attn_implementation("packed")
    diff = float((ours.float() - torch.cat(theirs).float()).abs().max())
    tol = 0.1 if next(model.parameters()).dtype in HALF else 1e-4  # bf16 (LoRA's base): ~0.03
    return None if diff <= tol else (  # 1e-4 for fp64 too: eager softmaxes in fp32; NaN fails
        f"nanoareal's packed forward disagrees with the model's own by {diff:.2g} in log-prob (an "
        "attention or head feature this model uses is not reproduced)")


# -----------------------------------------------------------------------------
# LoRA (peft): adapters on the decoder's linear layers, the base frozen in the compute dtype
def adapter_config(path: str | Path | None) -> dict | None:
    """A PEFT adapter directory's adapter_config.json (None: `path` is not one)."""
    file = Path(path or "") / "adapter_config.json"
    return json.loads(file.read_text()) if path and file.is_file() else None


def check_lora(rank: int, adapter: str | None, model: str) -> None:
    """--lora-rank, and --lora-adapter against --model (its base), before anything loads."""
    found = adapter_config(adapter) or {}
    problem = f"--lora-rank {rank}: must be >= 0 (0: full fine-tuning)" if rank < 0 else (
        "--lora-rank needs peft: pip install peft (or nanoareal[lora])") if rank and not \
        find_spec("peft") else None
    if adapter and (found.get("peft_type") != "LORA" or found.get("use_dora")):
        problem = f"--lora-adapter {adapter} is not a PEFT LoRA adapter directory (nor DoRA)"
    elif adapter and found["r"] != rank:
        problem = f"--lora-adapter {adapter} has rank {found['r']}, not --lora-rank {rank}"
    elif adapter and (base := found.get("base_model_name_or_path") or "") != model and not (
            Path(base).exists() and Path(base).resolve() == Path(model).resolve()):
        problem = f"--lora-adapter {adapter} is an adapter of {base!r}, not of --model {model}"
    if problem:
        raise UserError(f"config error: {problem}")


class WithoutAdapters:
    """A LoRA model with its adapters off, the frozen base: the KL penalty's reference policy for
    free (no second copy). peft's own switch also flips requires_grad, which FSDP2 must not see."""
    def __init__(self, model):
        self.model, self.attention_kernel = model, getattr(model, "attention_kernel", None)

    def policy_logprobs(self, *args, **kwargs):
        layers = [m for m in self.model.modules() if hasattr(m, "_disable_adapters")]
        try:
            for m in layers:
                m._disable_adapters = True
            return self.model.policy_logprobs(*args, **kwargs)
        finally:
            for m in layers:
                m._disable_adapters = False


def apply_lora(model, rank: int, adapter: str | None = None) -> str:
    """LoRA adapters injected into `model` (B = 0: unchanged), or `adapter`'s config and weights;
    the base frozen, adapters trainable, fp32 at least. Returns a line ending "; " (rank 0: "")."""
    if not rank:
        return ""
    import peft
    config = peft.LoraConfig.from_pretrained(adapter) if adapter else peft.LoraConfig(
        r=rank, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, lora_dropout=0.0)
    peft.inject_adapter_in_model(replace(config, inference_mode=False), model)
    if isinstance(model.get_output_embeddings(), peft.tuners.lora.LoraLayer):
        raise UserError("LoRA on lm_head is refused: the log-probs read head.weight (bypassing it)")
    for p in (trainable := [p for p in model.parameters() if p.requires_grad]):
        p.data = p.data.to(torch.promote_types(p.dtype, torch.float32))
    if adapter and not next(model.parameters()).is_meta:
        load_adapter(model, adapter)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return (f"LoRA r={rank} alpha={config.lora_alpha}: {sum(p.numel() for p in trainable):,} "
            f"trainable, {frozen:,} frozen in {next(model.parameters()).dtype}; ")


def merge_lora(named, model):
    """(name, full tensor) of `model`'s state, in state_dict order -> the plain model's: W + (alpha
    / r) B A for each layer peft adapted, one layer at a time (never a second full model)."""
    held, scales = {}, {name: m.scaling["default"] for name, m in model.named_modules()
                        if isinstance(getattr(m, "scaling", None), dict)}  # alpha / r by layer
    for name, t in named:
        layer, _, kind = name.replace(".base_layer.", ".lora_W.").partition(".lora_")
        if layer not in scales:
            yield name, t
        elif name.endswith(".base_layer.bias"):
            yield f"{layer}.bias", t
        elif len(parts := held.pop(layer, {}) | {kind[0]: t}) < 3:
            held[layer] = parts
        else:  # in fp64, rounded once to the base's dtype
            w, a, b = (parts[k].double() for k in "WAB")
            yield f"{layer}.weight", torch.addmm(w, b, a, alpha=scales[layer]).to(parts["W"].dtype)


def save_adapter(tensors: dict, config, base: str, out_dir: Path) -> None:
    """Adapters (full tensors, our names) in PEFT's format: adapter_model.safetensors and
    adapter_config.json naming `base` (PeftModel.from_pretrained and --model load it)."""
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model." + k.replace(".default.", "."): v.contiguous()
               for k, v in tensors.items()}, str(out_dir / "adapter_model.safetensors"))
    base = str(Path(base).resolve()) if Path(base).exists() else base
    replace(config, base_model_name_or_path=base).save_pretrained(str(out_dir))


def load_adapter(model, path: str) -> None:
    """A PEFT adapter's weights into `model`'s injected adapters; a UserError if they do not fit."""
    from safetensors.torch import load_file
    own = {k: p for k, p in model.named_parameters() if ".lora_" in k}
    theirs = {k.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v
              for k, v in load_file(str(Path(path) / "adapter_model.safetensors")).items()}
    if bad := [k for k in own.keys() | theirs.keys()
               if k not in own or k not in theirs or own[k].shape != theirs[k].shape]:
        raise UserError(f"--lora-adapter {path} does not fit this base model ({len(bad)} tensors "
                        f"missing or of another shape, e.g. {bad[0]})")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(theirs[k])
