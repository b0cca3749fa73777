"""Packing: rollout samples -> micro-batches of at most a token budget, with no padding. A
micro-batch is one packed row of many sequences (loss.MicroBatch): per-token tensors aligned with
the *predicted* token (position j of a sequence predicts token j+1; a sequence's last token is never
fed, it predicts nothing) and `segments` [R, 4] saying who attends to what (attention.py). With
shared prompts a micro-batch feeds each prompt prefix (the prompt minus its last token) once and
each sample only its tail, at positions p-1.., attending to that copy. Exact: under causal attention
the prefix's hidden states depend on the prefix alone, and backward sums every sample's gradient
into the one copy. Only the policy's tokens train (an episode's env tokens are context)."""

from collections import defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist

import loss
from loss import MicroBatch
from rollout import Sample

INT_COLUMNS = ("input_ids", "position_ids", "targets", "seq_ids", "segments")
FLOAT_COLUMNS = ("loss_mask", "advantages", "behave_logprobs", "loss_weight", "norm_weight")


def pack_microbatches(
    samples: list[Sample],
    mode: str,
    divisor: float | None,
    budget: int,
    mask_truncated: bool = False,
    share_prompts: bool = True,
) -> list[MicroBatch]:
    """Micro-batches of at most `budget` fed positions, cut in order as evenly as `cuts` can (a
    shared prefix costs its first sample in each). The mode's weights are the whole mini-batch's, so
    any split is exact (loss.py's rule 2); mask_truncated: a cut response counts nowhere. A
    sample's seq_id is its index in `samples`."""
    masks = [loss_mask(s, mask_truncated) for s in samples]
    weights, norm_weights = (
        x.tolist() for x in mode_weights([sum(m) for m in masks], samples, mode, divisor)
    )
    # a prompt's samples share a key (their prompt prefix), or each has its own
    spans = [
        (
            tuple(s.prompt_ids[:-1]) if share_prompts else i,
            len(s.prompt_ids),
            len(s.completion.output_ids),
        )
        for i, s in enumerate(samples)
    ]
    starts = set(cuts(spans, budget)[1:])
    mbs, cols = [], defaultdict(list)
    prefix_at = {}  # key -> its prefix's context
    for i, (s, (key, p, r)) in enumerate(zip(samples, spans)):
        full = s.prompt_ids + s.completion.output_ids
        if i in starts:
            mbs.append(to_microbatch(cols))
            cols, prefix_at = defaultdict(list), {}
        # fed from 0 attending to nothing, or from p-1 attending to the prompt's prefix
        head, ctx = 0, (0, 0)
        if share_prompts:
            head, ctx = p - 1, prefix_at.get(key)
        # the prompt's first sample here: its prefix is fed, predicting nothing
        if ctx is None:
            ctx = prefix_at[key] = (len(cols["input_ids"]), p - 1)
            if p > 1:
                feed(cols, full, 0, p - 1)
        # positions head..p+r-2: the prompt's (predicting prompt tokens: no loss), the response's
        stop = p + r - 1  # the last token predicts nothing: never fed
        n = stop - head
        if n:
            feed(
                cols,
                full,
                head,
                stop,
                ctx,
                seq_ids=[i] * r,
                loss_mask=masks[i],
                advantages=s.token_advantages or [s.advantage] * r,
                behave_logprobs=s.completion.logprobs,
                loss_weight=[weights[i]] * n,
                norm_weight=[norm_weights[i]] * n,
            )
    return mbs + [to_microbatch(cols)] if samples else []


def loss_mask(s: Sample, mask_truncated: bool) -> list[float]:
    """A response's loss (and denominator) mask: its policy's tokens, none if mask_truncated and
    cut by the length (DAPO)."""
    c = s.completion
    if mask_truncated and c.finish_reason == "length":
        return [0.0] * len(c.output_ids)
    policy = c.policy_mask or [1] * len(c.output_ids)
    return [float(x) for x in policy]


def mode_weights(
    counts, samples: list[Sample], mode: str, divisor: float | None
) -> loss.Pair:
    """The mode's per-response (w_i, nw_i) in float64, from the responses' M_i and groups."""
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    M = torch.as_tensor(counts, dtype=torch.float64)
    return loss.response_weights(mode, M, groups, divisor)


def reweigh(
    mbs: list[MicroBatch], samples: list[Sample], mode: str, divisor: float | None
) -> list[MicroBatch]:
    """The mode's weights again after tokens left the denominators (a mismatch correction's
    rejection): M_i summed over every micro-batch, by seq_id (an index into `samples`)."""
    counts = torch.zeros(len(samples), dtype=torch.float64)
    for mb in mbs:
        mine = mb.seq_ids >= 0
        counts.index_add_(0, mb.seq_ids[mine], mb.denom_mask[mine].double())
    # seq_id -1 (a prompt's positions) reads the appended 0
    w, nw = (
        torch.cat([x, x.new_zeros(1)]).float()
        for x in mode_weights(counts, samples, mode, divisor)
    )
    return [replace(mb, loss_weight=w[mb.seq_ids], norm_weight=nw[mb.seq_ids]) for mb in mbs]


def cuts(spans: list[tuple], budget: int) -> list[int]:
    """Where micro-batches start, for spans (prompt key, prompt length, response length): as many
    as greedy filling to `budget` makes, at the smallest budget that needs no more: the memory
    peak is the largest micro-batch (4 x 4 answers of 512: 3710/3773/1087 -> 3198/3198/2111)."""

    def greedy(cap: int) -> list[int]:
        starts, used, seen = [], 0, set()
        for i, (key, p, r) in enumerate(spans):
            cost = r if key in seen else p + r - 1
            if not starts or used + cost > cap:
                starts.append(i)
                used, seen = 0, set()
                cost = p + r - 1
            used += cost
            seen.add(key)
        return starts

    n, lo, hi = len(greedy(budget)), 1, budget
    while lo < hi:  # hi always cuts into at most n
        mid = (lo + hi) // 2
        if len(greedy(mid)) <= n:
            hi = mid
        else:
            lo = mid + 1
    return greedy(hi)


def feed(
    cols: dict[str, list],
    full: list[int],
    start: int,
    stop: int,
    ctx: tuple = (0, 0),
    **given: list,
) -> dict[str, list]:
    """Append positions start..stop-1 of the sequence `full` as one segment attending to `ctx`
    (start, length). A column given covers the segment's last positions (a response's); the
    ones before (a prompt predicting itself, a prefix) get seq_id -1 and 0: no loss, weights."""
    n = stop - start
    cols["segments"].append((len(cols["input_ids"]), n, *ctx))
    cols["input_ids"] += full[start:stop]
    cols["position_ids"] += range(start, stop)
    cols["targets"] += full[start + 1 : stop + 1]
    for key in ("seq_ids",) + FLOAT_COLUMNS:
        values = given.get(key, [])
        padding = -1 if key == "seq_ids" else 0.0
        cols[key] += [padding] * (n - len(values)) + values
    return cols


def to_microbatch(cols: dict[str, list]) -> MicroBatch:
    t = {
        k: torch.tensor(cols[k], dtype=torch.float32 if k in FLOAT_COLUMNS else torch.long)
        for k in INT_COLUMNS + FLOAT_COLUMNS
    }
    t["segments"] = t["segments"].view(-1, 4)  # [R, 4], also when empty
    return MicroBatch(**t, denom_mask=t["loss_mask"].clone())


def even_out(mbs: list[MicroBatch]) -> list[MicroBatch]:
    """The same number of micro-batches on every rank (FSDP2 all-gathers per forward): a rank
    with fewer adds ones of a single masked token."""
    most = loss.all_reduce_vector(torch.tensor([len(mbs)]), op=dist.ReduceOp.MAX)
    single = lambda: to_microbatch(feed(defaultdict(list), [0, 0], 0, 1))
    return mbs + [single() for _ in range(int(most) - len(mbs))]
