"""How nanoareal runs a Hugging Face causal LM: packed rows attended by segments on every attention
path, Ulysses context parallel, and log-probs from the model's own head in vocabulary chunks.

A packed row is a 1-D run of tokens from many sequences. `segments` [R, 4] says who attends to
what: row r = (q_start, q_len, ctx_start, ctx_len), its q_len tokens attend causally to the
ctx_len context tokens (a shared prompt prefix) and then to themselves. `attention_layout` turns
that into index tensors once per micro-batch; `packed_attention`, registered with transformers,
runs every layer's attention with them, honouring the layer's sliding window and logit softcap.

Under context parallel (Ulysses) each rank runs the model on a contiguous 1/N of the row; attention
all-to-alls from "my tokens, all heads" to "all tokens, my heads", attends over the whole row and
all-to-alls back. Nothing here holds state: the layout (and the CP group) travel with each call.

Any *ForCausalLM is run as body (`model.base_model`) + head (`model.get_output_embeddings()`, its
bias included) + the head's transform (logit scaling, final softcapping). `check_model` runs a
model both ways, ours and its own forward, at start: a family whose semantics this file does not
reproduce is refused in one line instead of training on wrong log-probs.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

HALF = (torch.float16, torch.bfloat16)  # the varlen kernels' dtypes; fp32 takes the padded path
ATTENTION_PATHS = ("auto", "flash_attn", "torch_varlen", "sdpa")

# -----------------------------------------------------------------------------
# attention layouts and kernels


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segments of a row of whole sequences (position_ids restart at 0 at each): [R, 4] rows
    (start, len, 0, 0)."""
    pos = position_ids.flatten()
    start = torch.nonzero(pos == 0).flatten()
    length = torch.diff(start, append=start.new_tensor([len(pos)]))
    zero = torch.zeros_like(start)
    return torch.stack([start, length, zero, zero], 1)


def attention_layout(segments: torch.Tensor, num_tokens: int, device: torch.device | None = None,
                     kernel=None, cp_group=None) -> dict:
    """Index tensors for segment_attention, built once per micro-batch and used by every layer.

    An attention row of segment r is its context followed by its own tokens; a token's slot in
    its row is its position in its sequence (the context is the whole prompt prefix). Two
    encodings of the same rows: `grid` (row-major [R, max_len] slots -> token, for a padded
    batch) + `out` (token -> the slot holding its own output), and `k_index`/`cu_q`/`cu_k` for a
    varlen kernel, whose causal mask is aligned bottom-right (queries are the last q_len keys of
    their row). Built on the CPU (a few hundred integers; no GPU sync for the sizes) and moved to
    `device`. `kernel`: a varlen kernel (load_kernel) for half-precision inputs; `cp_group`: the
    context-parallel group when the row is split across ranks (num_tokens is then the whole row).
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
    return tensors | sizes | {"kernel": kernel, "cp_group": cp_group}


def segment_attention(q, k, v, layout: dict, scaling: float | None = None, dropout: float = 0.0,
                      window: int | None = None, softcap: float | None = None):
    """Attention of a packed row by segments: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D]. `window`:
    a query sees only the last `window` keys of its row, itself included (HF's sliding_window);
    `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).

    A varlen kernel (GPU, half precision): queries stay packed, each segment's keys are gathered
    (its context, then itself) and the bottom-right causal mask does the rest. Otherwise a padded
    [R, H, max_len, D] batch of the rows with a causal mask: cost ~ R * max_len^2 instead of T^2.
    Context tokens shared by several rows are gathered into each; index_select's backward sums
    their gradients."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    if layout["kernel"] is not None and q.dtype in HALF:
        keys = layout["k_index"]
        kt, vt = k.transpose(0, 1).index_select(0, keys), v.transpose(0, 1).index_select(0, keys)
        return layout["kernel"](q.transpose(0, 1), kt, vt, layout, scaling, dropout, window,
                                softcap)
    rows, length, grid = layout["rows"], layout["max_len"], layout["grid"]

    def to_grid(x):  # [h, T, D] -> [rows, h, max_len, D]
        x = x.transpose(0, 1).index_select(0, grid)
        return x.view(rows, length, x.shape[1], x.shape[2]).transpose(1, 2)

    q, k, v = to_grid(q), to_grid(k), to_grid(v)
    if window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                             scale=scaling, enable_gqa=True)
    else:  # the slots of a row are positions, so the window is a band of the causal mask
        i = torch.arange(length, device=q.device)
        keep = i[None, :] <= i[:, None]
        if window is not None:
            keep = keep & (i[:, None] - i[None, :] < window)
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        scores = (q @ k.transpose(-1, -2)) * scaling
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        out = F.dropout(probs, dropout) @ v
    out = out.transpose(1, 2).reshape(rows * length, out.shape[1], out.shape[3])
    return out.index_select(0, layout["out"])


def packed_attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, layout=None,
                     sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention (registered as "packed"): q [1, H, T, D], k/v [1, Hkv, T, D] ->
    ([1, T, H, D], None). transformers passes attention_mask=None to a registered function; the
    row's layout comes in `layout`, each layer's own sliding window and softcap as keywords. Under
    context parallel (layout["cp_group"]) T is this rank's chunk: Ulysses all-to-alls around it."""
    if layout is None:
        raise RuntimeError("packed attention needs the row's layout: call policy_logprobs")
    if s_aux is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    args = (scaling, dropout, sliding_window or None, softcap or None)
    group = layout["cp_group"]
    if group is None:
        return segment_attention(q[0], k[0], v[0], layout, *args)[None], None
    n = dist.get_world_size(group)
    if k.shape[1] % n:  # too few KV heads to split: repeat each, every rank gets the ones it needs
        rep = n // math.gcd(k.shape[1], n)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = (_seq_to_heads(x, group) for x in (q, k, v))
    out = segment_attention(q[0], k[0], v[0], layout, *args)  # [S, H/N, D]
    return _heads_to_seq(out.transpose(0, 1)[None], group).transpose(1, 2), None


def _flash_attn_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """flash-attn 2 (>= 2.6): bottom-right causal; window_size=(w-1, 0) keeps the last w keys."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, layout["cu_q"], layout["cu_k"], layout["max_q"],
                                  layout["max_len"], dropout_p=dropout, softmax_scale=scaling,
                                  causal=True, window_size=(window - 1 if window else -1, 0),
                                  softcap=softcap or 0.0)


def _torch_varlen_kernel(q, k, v, layout, scaling, dropout, window, softcap):
    """torch.nn.attention.varlen.varlen_attn (PyTorch's bundled FlashAttention-2): window_size
    (-1, 0) is causal, (w-1, 0) a causal window of w keys, both aligned bottom-right as in
    flash-attn (its FA2 mask: key j is visible to query i iff j <= i + Lk - Lq). No softcap and no
    dropout: choose_attention never picks it for a model that needs them."""
    from torch.nn.attention.varlen import varlen_attn

    if softcap or dropout:
        raise NotImplementedError("torch varlen_attn has no softcap or dropout")
    if k.shape[1] != q.shape[1]:  # GQA: repeat the KV heads (older torch has no enable_gqa)
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    return varlen_attn(q, k, v, layout["cu_q"], layout["cu_k"], layout["max_q"],
                       layout["max_len"], scale=scaling,
                       window_size=(window - 1 if window else -1, 0))


def choose_attention(requested: str, device: torch.device, half: bool, softcap: bool
                     ) -> tuple[str, object, str]:
    """(path, kernel, why) for --attention: a varlen kernel for half-precision compute on a GPU
    (flash-attn, else PyTorch's own), the padded per-segment path otherwise. A requested path that
    cannot run here raises ValueError saying why; auto says what it skipped."""
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
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            reasons["torch_varlen"] = f"torch {torch.__version__} has no nn.attention.varlen"
        if softcap:
            reasons.setdefault("torch_varlen", "the model softcaps attention logits")
    kernels = {"flash_attn": _flash_attn_kernel, "torch_varlen": _torch_varlen_kernel}
    if requested != "auto":
        if requested in reasons:
            raise ValueError(f"--attention {requested} cannot run here: {reasons[requested]}")
        return requested, kernels.get(requested), "as requested"
    path = next((p for p in ("flash_attn", "torch_varlen") if p not in reasons), "sdpa")
    order = ATTENTION_PATHS.index
    skipped = {k: v for k, v in reasons.items() if order(k) < order(path)}
    if len(set(skipped.values())) == 1 and len(skipped) > 1:
        reason = next(iter(skipped.values()))
        return path, kernels.get(path), f"not {' nor '.join(skipped)}: {reason}"
    return path, kernels.get(path), "; ".join(f"not {k}: {v}" for k, v in skipped.items())


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
    """[..., T/N] per CP rank -> [..., T] on every CP rank. Every rank's loss reads all T values,
    so the gradient of this rank's slice is the *sum* over the group of the incoming gradients,
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


def ulysses_chunk(ids, pos, targets, segments, group, device, kernel=None) -> tuple[tuple, dict]:
    """This CP rank's contiguous 1/N of a packed row -> ((ids [1, T/N], positions [1, T/N],
    targets [T/N]) on `device`, the layout of the whole row). The row is padded to a multiple of
    N with a segment of its own, which no real token attends to; gather_row cuts it off."""
    T, n, r = len(ids), dist.get_world_size(group), dist.get_rank(group)
    pad = -T % n
    ids, targets = F.pad(ids, (0, pad)), F.pad(targets, (0, pad))
    pos = torch.cat([pos, torch.arange(pad)])
    if pad:
        segments = torch.cat([segments, segments.new_tensor([[T, pad, 0, 0]])])
    mine = slice(r * (T + pad) // n, (r + 1) * (T + pad) // n)
    layout = attention_layout(segments, T + pad, device, kernel=kernel, cp_group=group)
    return (ids[mine][None].to(device), pos[mine][None].to(device),
            targets[mine].to(device)), layout


def gather_row(logprobs, entropy, group, num_tokens: int) -> tuple:
    """Every CP rank's chunk of log-probs and entropies -> the whole row's, on every CP rank."""
    full = GatherSequence.apply(torch.stack([logprobs, entropy]), group)[:, :num_tokens]
    return full[0], full[1]


# -----------------------------------------------------------------------------
# the model: body, head, log-probs


def check_model_source(name: str) -> None:
    """--model must be a model directory (config.json in it) or a hub id that can be fetched: a
    wrong path is one line at once, not a minute of retries against a hub that cannot be reached
    (a hub id already in the local cache works offline)."""
    import os
    import socket
    from pathlib import Path
    from urllib.parse import urlparse

    from cli import UserError

    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {name}: not a model directory (it has no config.json)")
        tokenizer_files = ("tokenizer.json", "tokenizer.model", "vocab.json",
                           "tokenizer_config.json")
        if not any((path / f).is_file() for f in tokenizer_files):
            raise UserError(f"--model {name}: no tokenizer files there (none of "
                            f"{', '.join(tokenizer_files)}); save the tokenizer with the model")
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not an org/name id
        raise UserError(f"--model {name}: no such directory")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # not a valid repo id either
        raise UserError(f"--model {name}: no such directory, nor a Hugging Face hub id") from None
    where = f"no such directory, and {name!r} is not in the local Hugging Face cache"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get(
            "TRANSFORMERS_OFFLINE", "0") not in ("0", ""):
        raise UserError(f"--model {name}: {where} (HF_HUB_OFFLINE is set)")
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        raise UserError(f"--model {name}: {where}, and {host} cannot be reached to download "
                        "it") from None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks FSDP2 shards one by one: the modules whose class the model marks as never to be
    split (`_no_split_modules`: its decoder layers), else the children of its longest ModuleList.
    Innermost first, as fully_shard needs."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        blocks = list(max(lists, key=len)) if lists else []
    return blocks[::-1]


def head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) that a family's forward applies to its lm_head output: logits * scale,
    then softcap * tanh(logits / softcap). Families not listed apply neither; check_model catches
    one that applies something else."""
    text = config.get_text_config()
    kind = getattr(text, "model_type", "") or ""
    scale = 1.0
    if kind.startswith("granite") and getattr(text, "logits_scaling", None):
        scale = 1.0 / text.logits_scaling  # Granite divides
    elif kind.startswith("cohere") and getattr(text, "logit_scale", None):
        scale = float(text.logit_scale)
    elif kind.startswith("hyperclovax") and getattr(text, "logits_scaling", None):
        scale = float(text.logits_scaling)  # HyperCLOVA X multiplies
    elif kind == "falcon_h1" and getattr(text, "lm_head_multiplier", None):
        scale = float(text.lm_head_multiplier)
    return scale, getattr(text, "final_logit_softcapping", None) or None


def policy_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0,
                    chunk: int = 1024, segments: torch.Tensor | None = None,
                    layout: dict | None = None):
    """log pi(target_t | prefix) and the entropy at every position of a packed row -> ([T], [T]).

    `segments` is the row's attention layout (pack_microbatches); without it, every run of
    position_ids from 0 is a sequence of its own. Context parallel passes the whole row's `layout`
    instead. Logits exist only `chunk` tokens at a time and are recomputed in backward
    (activation checkpointing), so a 150k vocabulary never holds fp32 logits for a whole
    micro-batch.
    """
    if layout is None:
        if segments is None:
            segments = segments_from_positions(position_ids.cpu())
        layout = attention_layout(segments, input_ids.shape[-1], input_ids.device,
                                  kernel=getattr(model, "attention_kernel", None))
    hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              layout=layout).last_hidden_state[0]
    head = model.get_output_embeddings()
    scale, softcap = head_transform(model.config)
    out = [torch.utils.checkpoint.checkpoint(chunk_logprobs, hidden[i : i + chunk], head.weight,
                                             getattr(head, "bias", None), targets[i : i + chunk],
                                             temperature, scale, softcap, use_reentrant=False)
           for i in range(0, hidden.shape[0], chunk)]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def chunk_logprobs(hidden, weight, bias, targets, temperature: float = 1.0, scale: float = 1.0,
                   softcap: float | None = None):
    """Log-probs of `targets` and entropies from hidden states [n, d] and the head, in fp32 at
    least. Half-precision inputs are multiplied with a float32 result: logits rounded to bf16
    would err by ~0.06 at a logit of 20, far more than the ratio clip's 0.2 tolerates near 1."""
    if hidden.dtype in (torch.float16, torch.bfloat16):
        logits = _matmul_fp32(hidden, weight.t())
        logits = logits + bias.float() if bias is not None else logits
    else:
        logits = F.linear(hidden, weight, bias)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    logz = torch.logsumexp(logits, -1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logprobs, entropy


_MM_OUT_DTYPE: dict[torch.device, bool] = {}


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for half-precision a, b with a float32 result: on CUDA, torch.mm's out_dtype (the
    half inputs, fp32 accumulation and output, no fp32 copy of a 150k x d weight); elsewhere, or
    where that op is missing, by upcasting the inputs."""
    if a.is_cuda:
        if a.device not in _MM_OUT_DTYPE:
            try:
                x = torch.ones(2, 2, device=a.device, dtype=a.dtype, requires_grad=True)
                torch.mm(x, x, out_dtype=torch.float32).sum().backward()
                _MM_OUT_DTYPE[a.device] = True
            except Exception:
                _MM_OUT_DTYPE[a.device] = False
        if _MM_OUT_DTYPE[a.device]:
            return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def check_model(model, vocab_size: int) -> str | None:
    """Run the (unsharded) model both ways on two samples sharing a prompt: our packed, shared-
    prompt forward and its own per-sequence forward (eager attention). None when they agree, else
    why not, in words. Long enough to cross a small sliding window, and it calls every attention
    keyword and head transform the model uses, so an unsupported one surfaces here, at start."""
    if model.config._attn_implementation != "packed":
        return "its attention does not go through transformers' AttentionInterface"
    text = model.config.get_text_config()
    window = getattr(text, "sliding_window", None)
    n = min(max(16, (window or 0) + 8), 64)
    g = torch.Generator().manual_seed(0)
    prompt, tails = (torch.randint(vocab_size, (k,), generator=g).tolist() for k in (n // 2, n))
    tails = [tails[: n // 2], tails[n // 2 :][: n // 3]]
    seqs = [prompt + t for t in tails]
    p, device = len(prompt), next(model.parameters()).device
    ids = prompt[:-1] + sum((prompt[-1:] + t[:-1] for t in tails), [])
    pos = list(range(p - 1)) + sum((list(range(p - 1, p - 1 + len(t))) for t in tails), [])
    targets = prompt[1:] + sum((t for t in tails), [])
    segments = torch.tensor([[0, p - 1, 0, 0], [p - 1, len(tails[0]), 0, p - 1],
                             [p - 1 + len(tails[0]), len(tails[1]), 0, p - 1]])
    implementation = model.config._attn_implementation
    try:
        with torch.no_grad():
            ours, _ = policy_logprobs(model, torch.tensor([ids], device=device),
                                      torch.tensor([pos], device=device),
                                      torch.tensor(targets, device=device), segments=segments)
            model.set_attn_implementation("eager")
            theirs = []
            for k, s in enumerate(seqs):
                logits = model(input_ids=torch.tensor([s], device=device), use_cache=False).logits
                lp = logits[0].float().log_softmax(-1)[:-1].gather(-1, torch.tensor(
                    s[1:], device=device)[:, None]).squeeze(-1)
                theirs.append(lp if k == 0 else lp[p - 1 :])
    except Exception as e:  # e.g. an attention keyword packed_attention does not implement
        return f"its forward fails under nanoareal's packed attention ({type(e).__name__}: {e})"
    finally:
        model.set_attn_implementation(implementation)
    diff = float((ours.float() - torch.cat(theirs).float()).abs().max())
    if not diff <= 1e-4:  # eager attention's softmax runs in fp32 even for fp64 models
        return (f"nanoareal's packed forward disagrees with the model's own by {diff:.2g} in "
                "log-prob (an attention or head feature this model uses is not reproduced)")
    return None
