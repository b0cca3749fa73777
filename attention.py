"""Attention over packed rows: 1-D runs of tokens from many sequences, their `segments` [R, 4]
saying who attends to what. A segment (q_start, q_len, ctx_start, ctx_len) is q_len tokens that
attend causally to ctx_len earlier tokens of the row (a shared prompt's prefix), then to
themselves. Three paths compute the same attention:

- plain: one segment at a time, its keys gathered and masked (the reference: read it first);
- padded: segments copied into rows of slots, rows of similar widths run together by SDPA;
- varlen: a varlen kernel (flash-attn, or PyTorch's own) on bf16 on a GPU.

Ulysses context parallel: each rank runs a contiguous 1/N of a row; all-to-alls trade tokens for
heads around the kernel, so attention sees whole sequences (Swap; modeling's Model.logprobs splits
the row and gathers it back, by a Swap too)."""

import functools
import inspect
import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

# the padded path: short segments sharing a context (a group's completions and their prompt)
# share one row of at most this many slots: a CPU's sdpa costs per row, and 8 x 10 slots cost
# more than 32
GROUP_ROW_SLOTS = 64


@dataclass
class Bucket:
    """Rows of `width` slots that one kernel call runs, from slot `first` of the grid. A copied
    context fills the first `lead` slots of each row: keys alone, no query computed there."""

    first: int
    rows: int
    width: int
    lead: int
    mask: Tensor | None = None  # [rows, 1, width - lead, width] who sees whom; None: causal


@dataclass(frozen=True)
class Layout:
    """A packed row's attention, built on the host once per micro-batch. `path` says which parts
    are set: "varlen" (k_index, cu_q, cu_k, max_q, max_k), "padded" (grid, out, pos, buckets)
    or "plain" (the segments alone)."""

    segments: list  # [[q_start, q_len, ctx_start, ctx_len], ...]: ints (FSDP2 moves tensors)
    path: str
    kernel: object = None  # the varlen kernel
    cp_group: object = None  # the ranks that share the row (Ulysses)
    # each segment's keys, in order: its context's, then its own
    k_index: Tensor | None = None
    cu_q: Tensor | None = None  # where each segment's queries start (and the end)
    cu_k: Tensor | None = None  # where each segment's keys start in k_index (and the end)
    max_q: int = 0
    max_k: int = 0
    grid: Tensor | None = None  # slot -> the token it holds (padding slots read token 0)
    out: Tensor | None = None  # token -> the slot of its query
    pos: Tensor | None = None  # slot -> its position in its sequence (windows)
    buckets: list[Bucket] = field(default_factory=list)

    def to(self, device) -> "Layout":
        """The index tensors (the buckets' masks too) on `device`."""
        move = lambda x: x.to(device, non_blocking=True) if isinstance(x, Tensor) else x
        moved = {f.name: move(getattr(self, f.name)) for f in fields(self)}
        moved["buckets"] = [replace(b, mask=move(b.mask)) for b in self.buckets]
        return Layout(**moved)


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
    in_order = (q_start == torch.cumsum(q_len, 0) - q_len).all()
    if int(q_len.sum()) != num_tokens or not in_order:
        raise ValueError(
            f"segments must cover the {num_tokens} tokens of the row in order, got "
            f"{segments.tolist()}"
        )
    later = (ctx_len > 0) & (ctx_start + ctx_len > q_start)
    if ((ctx_start < 0) | later | (ctx_len < 0)).any():
        raise ValueError(
            f"a segment's context must be earlier tokens of the row, got {segments.tolist()}"
        )


def attention_layout(
    segments: Tensor,
    num_tokens: int,
    device: torch.device | None = None,
    kernel=None,
    cp_group=None,
    plain: bool = False,
) -> Layout:
    """The row's Layout on `device` for a varlen `kernel`, else for the padded path (`plain`:
    the reference path, nothing built)."""
    check_segments(segments, num_tokens)
    if plain:
        return Layout(segments.tolist(), "plain", cp_group=cp_group)
    if kernel is not None:
        return varlen_layout(segments, kernel, cp_group).to(device)
    return padded_layout(segments, num_tokens, cp_group).to(device)


def varlen_layout(segments: Tensor, kernel, cp_group) -> Layout:
    """k_index gathers each segment's keys: its context (a shared prefix), then itself;
    cu_q and cu_k delimit each segment's queries and keys (bottom-right causal)."""
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    row_len = ctx_len + q_len
    return Layout(
        segments.tolist(),
        "varlen",
        kernel,
        cp_group,
        # runs (ctx_start, ctx_len), (q_start, q_len) of each segment in turn
        k_index=_runs(segments[:, [2, 0]].flatten(), segments[:, [3, 1]].flatten()),
        cu_q=F.pad(q_len.cumsum(0), (1, 0)).int(),
        cu_k=F.pad(row_len.cumsum(0), (1, 0)).int(),
        max_q=int(q_len.max()),
        max_k=int(row_len.max()),
    )


def _runs(start: Tensor, length: Tensor) -> Tensor:
    """Each run's indices, one run after another: start[0], ..., start[0] + length[0] - 1, then
    start[1], ..."""
    shift = torch.repeat_interleave(start - torch.cumsum(length, 0) + length, length)
    return torch.arange(int(length.sum())) + shift


def padded_layout(segments: Tensor, num_tokens: int, cp_group) -> Layout:
    """Rows of slots (a row: pieces of the token stream, copied contexts as keys), sorted into
    buckets: rows longest first, copied contexts' apart, one kernel call per bucket. A row of L
    slots in a bucket W wide costs W^2, not L^2, so a bucket takes rows down to W / sqrt(2)."""
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    # rows that fit GROUP_ROW_SLOTS may hold several segments
    short = int((ctx_len + q_len).max()) <= GROUP_ROW_SLOTS
    rows, size, masked = _padded_rows(segments.tolist(), short)
    buckets = _buckets(rows, size)
    pieces = sum(rows, [])
    start, length, seg, query = (torch.tensor(x) for x in zip(*pieces))
    slots = sum(b.rows * b.width for b in buckets)
    # every piece's tokens, and the slot each goes to: its row's first slot + its offset
    tok = _runs(start, length)
    seg, query = (torch.repeat_interleave(x, length) for x in (seg, query))
    first = torch.tensor([b.first + i * b.width for b in buckets for i in range(b.rows)])
    flat = _runs(first, torch.tensor(size))
    grid, pos = torch.zeros(2, slots, dtype=torch.long)
    grid[flat] = tok
    pos[flat] = torch.where(query, ctx_len[seg] + tok - q_start[seg], tok - ctx_start[seg])
    out = torch.empty(num_tokens, dtype=torch.long)
    out[tok[query]] = flat[query]
    if masked:  # rows of several segments: a query sees its context and its own past
        # a slot's owner: its query's segment, -2 a copied context's key, -1 padding
        owner = torch.full((slots,), -1)
        owner[flat] = torch.where(query, seg, -2)
        of_token = torch.repeat_interleave(torch.arange(len(segments)), q_len)
        buckets = [
            replace(b, mask=_row_mask(b, owner, grid, of_token, ctx_start, ctx_len))
            for b in buckets
        ]
    else:  # one segment a row: causal, past a copied context bottom-right causal
        buckets = [
            replace(b, mask=torch.ones(b.width, b.width, dtype=torch.bool).tril()[b.lead :])
            if b.lead
            else b
            for b in buckets
        ]
    return Layout(
        segments.tolist(),
        "padded",
        None,
        cp_group,
        grid=grid,
        out=out,
        pos=pos,
        buckets=buckets,
    )


def _padded_rows(segments: list, short: bool) -> tuple[list, list, bool]:
    """(rows, their sizes, whether any needs a mask) of the padded path, sorted: a row holds
    pieces (first token, length, segment, is query), a copied context keys only. A segment whose
    context starts a context-free one (its prompt) joins its row: while rows are `short`, several
    (a mask then); else the first whose context is all of it (still causal)."""
    rows = []
    size = []
    host = {}
    masked = False
    for i, (qs, ql, cs, cl) in enumerate(segments):
        r = host.get(cs) if cl else None
        fits = r is not None and cl <= rows[r][0][1]
        if fits and short:
            fits = size[r] + ql <= GROUP_ROW_SLOTS
        elif fits:
            fits = size[r] == cl
        if fits:
            masked |= size[r] != cl  # its context is not all the row before it
            rows[r].append((qs, ql, i, True))
            size[r] += ql
            continue
        if not cl:  # a prompt: segments of its context may join its row
            host[qs] = len(rows)
        copied = [(cs, cl, i, False)] if cl else []
        rows.append(copied + [(qs, ql, i, True)])
        size.append(cl + ql)
    # copied contexts' rows first (their first piece is no query), each kind longest first
    order = sorted(range(len(rows)), key=lambda r: (rows[r][0][3], -size[r]))
    return [rows[r] for r in order], [size[r] for r in order], masked


def _buckets(rows: list, size: list) -> list[Bucket]:
    """Consecutive rows (sorted) in buckets of similar widths; a copied-context row's bucket
    leads with the shortest of its rows' contexts."""
    buckets = []
    slots = 0
    for row, width in zip(rows, size):
        lead = 0 if row[0][3] else row[0][1]  # a copied context first: its length
        new = not buckets or (lead > 0) != (buckets[-1].lead > 0)
        if not new and buckets[-1].width > GROUP_ROW_SLOTS:
            new = 2 * width * width < buckets[-1].width ** 2
        if new:
            buckets.append(Bucket(slots, 0, width, lead))
        last = buckets[-1]
        last.rows += 1
        last.lead = min(last.lead, lead)
        slots += last.width
    return buckets


def _row_mask(b: Bucket, owner, grid, of_token, ctx_start, ctx_len) -> Tensor:
    """[rows, 1, slots, slots]: a query slot (of segment `owner` >= 0) sees its context and its own
    past; padding (owner -1) and a copied context's slots (-2) see themselves alone."""
    part = slice(b.first, b.first + b.rows * b.width)
    own = owner[part].view(b.rows, b.width, 1)
    key = grid[part].view(b.rows, 1, b.width)
    o = own.clamp(min=0)
    own_past = (of_token[key] == own) & (key <= key.transpose(1, 2))
    in_ctx = (key >= ctx_start[o]) & (key < ctx_start[o] + ctx_len[o])
    # padding is no key; a slot holding no query (padding, a copied context) sees no key
    key_real = own.transpose(1, 2) != -1
    sees = (own_past | in_ctx) & key_real & (own >= 0)
    return (sees | torch.eye(b.width, dtype=torch.bool))[:, None, b.lead :]


# -----------------------------------------------------------------------------
# the three paths: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D]; `window` as HF's sliding_window
# (the last `window` keys, itself included), `softcap` as Gemma 2's
def plain_attention(
    q,
    k,
    v,
    segments: list,
    scaling: float,
    dropout: float,
    window: int | None,
    softcap: float | None,
) -> Tensor:
    """The reference path: each segment's queries against its context's keys, then its own up to
    themselves, one segment at a time; a key at position j is seen from position i if j <= i
    (and i - j < window); scores softcapped."""
    out = []
    for q_start, q_len, ctx_start, ctx_len in segments:
        keys = [*range(ctx_start, ctx_start + ctx_len), *range(q_start, q_start + q_len)]
        # positions in the sequence
        i = torch.arange(q_len, device=q.device)[:, None] + ctx_len
        j = torch.arange(len(keys), device=q.device)[None]
        sees = j <= i
        if window:
            sees = sees & (i - j < window)
        queries = q[:, q_start : q_start + q_len]
        heads = _masked_attention(
            queries, k[:, keys], v[:, keys], sees, scaling, dropout, softcap
        )
        out.append(heads.transpose(0, 1))
    return torch.cat(out)


def _masked_attention(q, k, v, sees, scaling, dropout, softcap) -> Tensor:
    """softmax(x) v, dropout on the weights, with x = softcap tanh(q k^T scaling / softcap) where
    a query `sees` a key, else -inf; heads at dim -3, each KV head repeated for its queries."""
    copies = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(copies, -3)
    v = v.repeat_interleave(copies, -3)
    scores = q @ k.transpose(-1, -2) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    weights = F.dropout(scores.masked_fill(~sees, float("-inf")).softmax(-1), dropout)
    return weights @ v


def segment_attention(
    q,
    k,
    v,
    layout: Layout,
    scaling: float | None = None,
    dropout: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """The row's attention on its layout's path. Varlen gathers each segment's keys (context, then
    itself); padded runs each bucket of rows of slots (cost ~ rows * slots^2, not T^2);
    index_select sums a copied context's gradients."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    args = (scaling, dropout, window, softcap)
    if layout.path == "plain":
        return plain_attention(q, k, v, layout.segments, *args)
    if layout.path == "varlen":
        k, v = (x.transpose(0, 1).index_select(0, layout.k_index) for x in (k, v))
        return layout.kernel(q.transpose(0, 1), k, v, layout, *args)
    outs = [_padded_attention(q, k, v, layout, b, *args) for b in layout.buckets]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, layout.out)


def _padded_attention(q, k, v, layout: Layout, b: Bucket, scaling, dropout, window, softcap):
    """One bucket's rows of slots -> [rows * slots, H, D]; no query in the `lead` slots (zeros
    there)."""
    part = slice(b.first, b.first + b.rows * b.width)
    grid = layout.grid[part]
    pos = layout.pos[part].view(b.rows, b.width)
    # [h, T, D] -> [rows, h, slots, D]
    q, k, v = (
        x.transpose(0, 1).index_select(0, grid).unflatten(0, pos.shape).transpose(1, 2)
        for x in (q, k, v)
    )
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(
            q[:, :, b.lead :],
            k,
            v,
            attn_mask=b.mask,
            is_causal=b.mask is None,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=True,
        )
        out = F.pad(out, (0, 0, b.lead, 0))
    else:  # a window is a band of positions: a query at p sees keys at p - window < p' <= p
        if b.mask is None:
            keep = q.new_ones(b.width, b.width, dtype=torch.bool).tril()
        else:
            keep = F.pad(b.mask, (0, 0, b.lead, 0), value=True)  # lead rows: never read
        if window is not None:
            keep = keep & (pos[:, None, :, None] - pos[:, None, None, :] < window)
        out = _masked_attention(q, k, v, keep, scaling, dropout, softcap)
    return out.transpose(1, 2).flatten(0, 1)


def packed_attention(
    module,
    q,
    k,
    v,
    attention_mask,
    scaling=None,
    dropout=0.0,
    layout=None,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """transformers attention "packed": q [1, H, T, D], k/v [1, Hkv, T, D] -> ([1, T, H, D], None);
    the row in `layout` (attention_mask is None); under CP, T is this rank's chunk (Ulysses)."""
    if layout is None:
        raise RuntimeError("packed attention needs the row's layout: call policy_logprobs")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    args = (scaling, dropout, sliding_window or None, softcap or None)
    group = layout.cp_group
    if group is None:
        return segment_attention(q[0], k[0], v[0], layout, *args)[None], None
    n = dist.get_world_size(group)
    # too few KV heads to split: repeat each, every rank gets the ones it needs
    if k.shape[1] % n:
        copies = n // math.gcd(k.shape[1], n)
        k = k.repeat_interleave(copies, 1)
        v = v.repeat_interleave(copies, 1)
    q, k, v = (Swap.apply(x, group, 1, 2) for x in (q, k, v))
    out = segment_attention(q[0], k[0], v[0], layout, *args)  # [S, H/N, D]
    out = Swap.apply(out.transpose(0, 1)[None], group, 2, 1)  # [1, H, S/N, D]
    return out.transpose(1, 2), None


# -----------------------------------------------------------------------------
# varlen kernels: (q [Tq, H, D], k/v [Tk, Hkv, D], layout, scaling, dropout, window, softcap)
def _flash_attn_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """flash-attn 2 (>= 2.6): bottom-right causal; window_size=(w-1, 0) keeps the last w keys."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q,
        k,
        v,
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1 if window else -1, 0),
        softcap=softcap or 0.0,
    )


def _torch_varlen_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """PyTorch's bundled FA2 varlen_attn: flash-attn's window_size and bottom-right causal mask."""
    from torch.nn.attention.varlen import varlen_attn

    if softcap or dropout:
        raise NotImplementedError("torch varlen_attn has no softcap or dropout")
    gqa = varlen_gqa(q.device, q.dtype) if k.shape[1] != q.shape[1] else {}
    if gqa is None:  # this torch's kernel takes equal head counts alone: repeat the KV heads
        copies = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(copies, 1)
        v = v.repeat_interleave(copies, 1)
        gqa = {}
    return varlen_attn(
        q,
        k,
        v,
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        scale=scaling,
        window_size=(window - 1 if window else -1, 0),
        **gqa,
    )


@functools.cache
def varlen_gqa(device: torch.device, dtype: torch.dtype) -> dict | None:
    """How torch's varlen_attn takes fewer KV heads than query heads, probed once per device and
    dtype: the keywords to pass ({"enable_gqa": True} from torch 2.12, {} where its kernel takes
    them as they are), or None where it computes them wrong or refuses them (repeat them)."""
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, heads, 8, generator=g).to(device, dtype) for heads in (4, 2, 2))
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    causal = {"window_size": (-1, 0)}
    gqa = (
        {"enable_gqa": True}
        if "enable_gqa" in inspect.signature(varlen_attn).parameters
        else {}
    )
    try:
        kk, vv = (x.repeat_interleave(2, 1) for x in (k, v))
        want = varlen_attn(q, kk, vv, cu, cu, 3, 3, **causal)
        got = varlen_attn(q, k, v, cu, cu, 3, 3, **causal, **gqa)
    except Exception:  # it refuses unequal head counts
        return None
    return gqa if torch.allclose(got.float(), want.float(), atol=1e-2) else None


KERNELS = {"flash_attn": _flash_attn_kernel, "torch_varlen": _torch_varlen_kernel}


def choose_attention(
    requested: str, device: torch.device, half: bool, softcap: bool
) -> tuple[str, object, str]:
    """(path, kernel, why) for `requested` (auto, a KERNELS name, sdpa or plain): a varlen kernel
    (flash-attn, else PyTorch's) for half compute on a GPU, else the padded path (sdpa); one
    requested that cannot run here raises ValueError."""
    reasons = _kernel_problems(device, half, softcap)
    if requested != "auto":
        if requested in reasons:
            raise ValueError(f"--attention {requested} cannot run here: {reasons[requested]}")
        return requested, KERNELS.get(requested), "as requested"
    path = next((p for p in KERNELS if p not in reasons), "sdpa")
    skipped = {} if path == "flash_attn" else reasons  # only paths before `path` have reasons
    why = "; ".join(f"not {k}: {v}" for k, v in skipped.items())
    # one reason for all: say it once
    if len(skipped) > 1 and len(set(skipped.values())) == 1:
        why = f"not {' nor '.join(skipped)}: {reasons['flash_attn']}"
    return path, KERNELS.get(path), why


def _kernel_problems(device: torch.device, half: bool, softcap: bool) -> dict[str, str]:
    """Why each varlen kernel cannot run here (none: it can)."""
    if device.type != "cuda" or not half:
        return dict.fromkeys(KERNELS, "it needs bf16/fp16 compute on a GPU")
    reasons = {}
    try:
        import flash_attn

        if not hasattr(flash_attn, "flash_attn_varlen_func"):  # flash-attn-4's namespace
            raise ImportError("this flash_attn has no flash_attn_varlen_func (flash-attn 2)")
    except Exception as e:  # an ABI mismatch raises ImportError or OSError
        reasons["flash_attn"] = f"flash-attn is not usable ({type(e).__name__}: {e})"
    try:  # torch 2.10's varlen_attn has neither scale nor window_size; 2.8-2.9 none at all
        from torch.nn.attention.varlen import varlen_attn

        if not {"scale", "window_size"} <= inspect.signature(varlen_attn).parameters.keys():
            reasons["torch_varlen"] = (
                f"torch {torch.__version__}'s varlen_attn has no "
                "scale/window_size (torch >= 2.11)"
            )
    except ImportError:
        reasons["torch_varlen"] = f"torch {torch.__version__} has no nn.attention.varlen"
    if softcap:
        reasons.setdefault("torch_varlen", "the model softcaps attention logits")
    return reasons


# -----------------------------------------------------------------------------
# Ulysses context parallel
class Swap(torch.autograd.Function):
    """Dim `split` in N blocks, block i to CP rank i, those received joined along `join`: heads for
    tokens [B, H, S/N, D] -> [B, H/N, S, D] is (1, 2); the way back, (2, 1), is the backward. N
    copies of x along `split` (split = join) gather every rank's x on every rank; the backward
    sums the gradients each rank's reader sends back."""

    @staticmethod
    def forward(ctx, x, group, split: int, join: int):
        ctx.args = group, join, split
        n = dist.get_world_size(group)
        x = x.unflatten(split, (n, -1)).movedim(split, 0).contiguous()
        out = torch.empty_like(x)  # x contiguous first: empty_like copies a view's strides
        dist.all_to_all_single(out, x, group=group)
        return out.movedim(0, join).flatten(join, join + 1)

    @staticmethod
    def backward(ctx, grad):
        return Swap.apply(grad, *ctx.args), None, None, None
