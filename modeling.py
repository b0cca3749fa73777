"""Attention plumbing: packed rows attended by segments, on every path, and Ulysses context
parallel.

A packed row is a 1-D run of tokens from many sequences. `segments` [R, 4] says who attends to
what: row r = (q_start, q_len, ctx_start, ctx_len), its q_len tokens attend causally to the
ctx_len context tokens (a shared prompt prefix) and then to themselves. `attention_layout` turns
that into index tensors once per micro-batch; `packed_attention` is registered with transformers
and runs every layer's attention with them.

Under context parallel (Ulysses) each rank runs the model on a contiguous 1/N of the row;
attention all-to-alls from "my tokens, all heads" to "all tokens, my heads", attends over the
whole row and all-to-alls back. Nothing here holds state: the layout (and the CP group) travel
with each forward call.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)  # flash-attn's dtypes; fp32 activations take the sdpa path


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segments of a row of whole sequences (position_ids restart at 0 at each): [R, 4] rows
    (start, len, 0, 0)."""
    pos = position_ids.flatten()
    start = torch.nonzero(pos == 0).flatten()
    length = torch.diff(start, append=start.new_tensor([len(pos)]))
    zero = torch.zeros_like(start)
    return torch.stack([start, length, zero, zero], 1)


def attention_layout(segments: torch.Tensor, num_tokens: int, device: torch.device | None = None,
                     flash=None, cp_group=None) -> dict:
    """Index tensors for segment_attention, built once per micro-batch and used by every layer.

    An attention row of segment r is its context followed by its own tokens. Two encodings of the
    same rows: `grid` (row-major [R, max_len] slots -> token, for a padded sdpa batch) + `out`
    (token -> the slot holding its own output), and `k_index`/`cu_q`/`cu_k` for a varlen kernel,
    whose causal mask is aligned bottom-right (queries are the last q_len keys of their row).
    Built on the CPU (a few hundred integers; no GPU sync for the sizes) and moved to `device`.
    `flash`: flash_attn_varlen_func, used for half-precision inputs; `cp_group`: the
    context-parallel group when the row is split across ranks (then num_tokens is the whole row).
    """
    device = device or segments.device
    segments = segments.cpu()
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    if int(q_len.sum()) != num_tokens or (q_start != torch.cumsum(q_len, 0) - q_len).any():
        raise ValueError(f"segments must cover the {num_tokens} tokens of the row in order, got "
                         f"{segments.tolist()}")
    if ((ctx_start < 0) | ((ctx_len > 0) & (ctx_start + ctx_len > q_start)) | (ctx_len < 0)).any():
        raise ValueError("a segment's context must be earlier tokens of the row, got "
                         f"{segments.tolist()}")
    row_len = ctx_len + q_len
    max_len = int(row_len.max())
    j = torch.arange(max_len)[None]
    src = torch.where(j < ctx_len[:, None], ctx_start[:, None] + j,
                      q_start[:, None] + j - ctx_len[:, None])
    valid = j < row_len[:, None]
    seg = torch.repeat_interleave(torch.arange(len(segments)), q_len)
    zero = segments.new_zeros(1)
    # padding slots (after each row's real slots, so the causal mask hides them) read token 0:
    # any real token works, its outputs are dropped and no real query sees it (so no gradient)
    index = {"grid": torch.where(valid, src, 0).flatten(),
             "out": seg * max_len + ctx_len[seg] + torch.arange(num_tokens) - q_start[seg],
             "k_index": src[valid], "cu_q": torch.cat([zero, torch.cumsum(q_len, 0)]).int(),
             "cu_k": torch.cat([zero, torch.cumsum(row_len, 0)]).int()}
    sizes = {"rows": len(segments), "max_len": max_len, "max_q": int(q_len.max())}
    tensors = {k: v.to(device, non_blocking=True) for k, v in index.items()}
    return tensors | sizes | {"flash": flash, "cp_group": cp_group}


def segment_attention(q, k, v, layout: dict, scaling=None, dropout: float = 0.0):
    """Attention of a packed row by segments: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D].

    flash-attn varlen (GPU, half precision): queries stay packed, each segment's keys are
    gathered (its context then itself) and the bottom-right causal mask does the rest. Otherwise
    sdpa over a padded [R, H, max_len, D] batch of the rows with a plain causal mask: cost ~ R *
    max_len^2 instead of T^2 for a mask over the whole row. Context tokens shared by several rows
    are gathered into each; index_select's backward sums their gradients."""
    if layout["flash"] is not None and q.dtype in HALF:
        keys = layout["k_index"]
        kt, vt = k.transpose(0, 1).index_select(0, keys), v.transpose(0, 1).index_select(0, keys)
        return layout["flash"](q.transpose(0, 1), kt, vt, layout["cu_q"], layout["cu_k"],
                               layout["max_q"], layout["max_len"], dropout_p=dropout,
                               softmax_scale=scaling, causal=True)
    rows, length, grid = layout["rows"], layout["max_len"], layout["grid"]

    def to_grid(x):  # [h, T, D] -> [rows, h, max_len, D]
        x = x.transpose(0, 1).index_select(0, grid)
        return x.view(rows, length, x.shape[1], x.shape[2]).transpose(1, 2)

    out = F.scaled_dot_product_attention(to_grid(q), to_grid(k), to_grid(v), is_causal=True,
                                         dropout_p=dropout, scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).reshape(rows * length, q.shape[0], q.shape[2])
    return out.index_select(0, layout["out"])


def packed_attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, layout=None,
                     **kwargs):
    """transformers attention (registered as "packed"): q [1, H, T, D], k/v [1, Hkv, T, D] ->
    ([1, T, H, D], None). transformers passes attention_mask=None to a registered function; the
    row's layout comes in `layout`. Under context parallel (layout["cp_group"]) T is this rank's
    chunk: Ulysses all-to-alls around the attention."""
    if layout is None:
        raise RuntimeError("packed attention needs the row's layout: call the model through "
                           "policy_logprobs")
    group = layout["cp_group"]
    if group is None:
        return segment_attention(q[0], k[0], v[0], layout, scaling, dropout)[None], None
    n = dist.get_world_size(group)
    if k.shape[1] % n:  # too few KV heads to split: repeat each, every rank gets the ones it needs
        rep = n // math.gcd(k.shape[1], n)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = (_seq_to_heads(x, group) for x in (q, k, v))
    out = segment_attention(q[0], k[0], v[0], layout, scaling, dropout)  # [S, H/N, D]
    return _heads_to_seq(out.transpose(0, 1)[None], group).transpose(1, 2), None


class _AllToAll(torch.autograd.Function):
    """Block i of dim 0 goes to CP rank i. Exchanging blocks twice is the identity, so backward
    is the same op."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # before empty_like: it copies a permuted view's strides, which the collective ignores
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.group), None


def _seq_to_heads(x, group):  # [B, H, S/N, D] -> [B, H/N, S, D]
    n = dist.get_world_size(group)
    x = _AllToAll.apply(x.unflatten(1, (n, -1)).movedim(1, 0), group)  # N head blocks -> N chunks
    return x.movedim(0, 2).flatten(2, 3)


def _heads_to_seq(x, group):  # [B, H/N, S, D] -> [B, H, S/N, D]
    n = dist.get_world_size(group)
    x = _AllToAll.apply(x.unflatten(2, (n, -1)).movedim(2, 0), group)  # N chunks -> N head blocks
    return x.movedim(0, 1).flatten(1, 2)


class GatherSequence(torch.autograd.Function):
    """[..., T/N] per CP rank -> [..., T] on every CP rank. Every rank's loss reads all T values, so
    the gradient of this rank's slice is the *sum* over the group of the incoming gradients,
    sliced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), -1)[dist.get_rank(ctx.group)], None


def ulysses_chunk(ids, pos, targets, segments, group, device, flash=None) -> tuple[tuple, dict]:
    """This CP rank's contiguous 1/N of a packed row -> ((ids [1, T/N], positions [1, T/N], targets
    [T/N]) on `device`, the layout of the whole row). The row is padded to a multiple of N with a
    segment of its own, which no real token attends to; gather_row cuts its outputs off."""
    T, n, r = len(ids), dist.get_world_size(group), dist.get_rank(group)
    pad = -T % n
    ids, targets = F.pad(ids, (0, pad)), F.pad(targets, (0, pad))
    pos = torch.cat([pos, torch.arange(pad)])
    if pad:
        segments = torch.cat([segments, segments.new_tensor([[T, pad, 0, 0]])])
    mine = slice(r * (T + pad) // n, (r + 1) * (T + pad) // n)
    layout = attention_layout(segments, T + pad, device, flash=flash, cp_group=group)
    return (ids[mine][None].to(device), pos[mine][None].to(device),
            targets[mine].to(device)), layout


def gather_row(logprobs, entropy, group, num_tokens: int) -> tuple:
    """Every CP rank's chunk of log-probs and entropies -> the whole row's, on every CP rank."""
    full = GatherSequence.apply(torch.stack([logprobs, entropy]), group)[:, :num_tokens]
    return full[0], full[1]


def policy_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0,
                    chunk: int = 1024, segments: torch.Tensor | None = None,
                    layout: dict | None = None):
    """log pi(target_t | prefix) and the entropy at every position of a packed row -> ([T], [T]).

    `segments` is the row's attention layout (pack_microbatches); without it, every run of
    position_ids from 0 is a sequence of its own. Context parallel passes the whole row's `layout`
    instead. Logits exist only `chunk` tokens at a time and are recomputed in backward (activation
    checkpointing), so a 150k vocabulary never holds fp32 logits for a whole micro-batch.
    """
    if layout is None:
        if segments is None:
            segments = segments_from_positions(position_ids.cpu())
        layout = attention_layout(segments, input_ids.shape[-1], input_ids.device,
                                            flash=getattr(model, "flash_varlen", None))
    hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         layout=layout).last_hidden_state[0]
    weight = model.lm_head.weight
    out = [torch.utils.checkpoint.checkpoint(_chunk_logprobs, hidden[i : i + chunk], weight,
                                             targets[i : i + chunk], temperature,
                                             use_reentrant=False)
           for i in range(0, hidden.shape[0], chunk)]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    temperature: float):
    logits = hidden @ weight.T
    half = logits.dtype in (torch.float16, torch.bfloat16)
    logits = (logits.float() if half else logits) / temperature  # softmax in fp32 at least
    logz = torch.logsumexp(logits, -1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logprobs, entropy


def load_flash_varlen():
    """flash_attn_varlen_func, or None when flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func
