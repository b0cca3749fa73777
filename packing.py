"""Packing: rollout samples -> micro-batches of at most a token budget, with no padding. A
micro-batch is one packed row of many sequences (loss.MicroBatch): per-token tensors aligned with
the *predicted* token (position j of a sequence predicts token j+1; a sequence's last token is never
fed, it predicts nothing) and `segments` [R, 4] saying who attends to what (modeling.py). With
shared prompts a micro-batch feeds each prompt prefix (the prompt minus its last token) once and
each sample only its tail, at positions p-1.., attending to that copy. Exact: under causal attention
the prefix's hidden states depend on the prefix alone, and backward sums every sample's gradient
into the one copy. A sample is anything with .group, .prompt_ids, .advantage and .completion
(.output_ids, .logprobs, .finish_reason, .policy_mask: only policy tokens train)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

import loss
from loss import MicroBatch

INT_COLUMNS = ("input_ids", "position_ids", "targets", "seq_ids")
FLOAT_COLUMNS = ("loss_mask", "advantages", "behave_logprobs", "loss_weight", "norm_weight")


def pack_microbatches(samples: list, mode: str, divisor: float | None, budget: int,
                      mask_truncated: bool = False, share_prompts: bool = True) -> list[MicroBatch]:
    """Micro-batches of at most `budget` fed positions, cut in order as evenly as `cuts` can (a
    shared prefix costs its first sample in each). The mode's weights are the whole mini-batch's, so
    any split is exact (loss.py's rule 2); mask_truncated: a cut response counts nowhere."""
    dropped = [mask_truncated and s.completion.finish_reason == "length" for s in samples]
    masks = [[0.0 if d else float(x) for x in s.completion.policy_mask or [1] * len(
        s.completion.output_ids)] for s, d in zip(samples, dropped)]  # env tokens are context
    denom = torch.tensor([sum(m) for m in masks], dtype=torch.float64)
    weights, norm_weights = (w.tolist() for w in loss.response_weights(
        mode, denom, torch.tensor([s.group for s in samples], dtype=torch.long), divisor))
    keys = [tuple(s.prompt_ids[:-1]) if share_prompts else i for i, s in enumerate(samples)]
    starts = set(cuts([(k, len(s.prompt_ids), len(s.completion.output_ids))
                       for k, s in zip(keys, samples)], budget)[1:])
    mbs, cols, first, prefix_at = [], defaultdict(list), 0, {}  # prefix_at: key -> its prefix's ctx
    for i, (s, key) in enumerate(zip(samples, keys)):
        full, p = s.prompt_ids + s.completion.output_ids, len(s.prompt_ids)
        r = len(full) - p
        if i in starts:
            mbs, cols, first, prefix_at = mbs + [to_microbatch(cols)], defaultdict(list), i, {}
        head, ctx = (p - 1, prefix_at.get(key)) if share_prompts else (0, (0, 0))
        if ctx is None:  # the prompt's first sample here: its prefix is fed, predicting nothing
            ctx = prefix_at[key] = (len(cols["input_ids"]), p - 1)
            if p > 1:
                feed(cols, full, 0, p - 1)
        # positions head..p+r-2: the prompt's (predicting prompt tokens: no loss), the response's
        n, fed_prompt = p + r - 1 - head, p - 1 - head
        if n:
            feed(cols, full, head, p + r - 1, ctx, [-1] * fed_prompt + [i - first] * r,
                 loss_mask=[0.0] * fed_prompt + masks[i], advantages=[s.advantage] * n,
                 behave_logprobs=[0.0] * fed_prompt + s.completion.logprobs,
                 loss_weight=[weights[i]] * n, norm_weight=[norm_weights[i]] * n)
    return mbs + [to_microbatch(cols)] if samples else []


def cuts(spans: list[tuple], budget: int) -> list[int]:
    """Where micro-batches start, for spans (prompt key, prompt length, response length): as many
    as greedy filling to `budget` makes, at the smallest budget that needs no more: the memory
    peak is the largest micro-batch (4 x 4 answers of 512: 3710/3773/1087 -> 3198/3198/2111)."""
    def greedy(cap: int) -> list[int]:
        starts, used, seen = [], 0, set()
        for i, (key, p, r) in enumerate(spans):
            if not starts or used + (r if key in seen else p + r - 1) > cap:
                starts, used, seen = starts + [i], 0, set()
            used += r if key in seen else p + r - 1
            seen.add(key)
        return starts
    n, lo, hi = len(greedy(budget)), 1, budget
    while lo < hi:  # hi always cuts into at most n
        lo, hi = (lo, mid) if len(greedy(mid := (lo + hi) // 2)) <= n else (mid + 1, hi)
    return greedy(hi)


def feed(cols: dict[str, list], full: list[int], start: int, stop: int, ctx: tuple = (0, 0),
         seq_ids: list[int] | None = None, **floats: list[float]) -> dict[str, list]:
    """Append positions start..stop-1 of the sequence `full` as one segment attending to `ctx`
    (start, length); seq_ids not given are -1, floats 0 (a prefix: no loss, weights, advantages)."""
    cols["segments"].append((len(cols["input_ids"]), stop - start, *ctx))
    cols["input_ids"] += full[start:stop]
    cols["position_ids"] += range(start, stop)
    cols["targets"] += full[start + 1 : stop + 1]
    cols["seq_ids"] += seq_ids or [-1] * (stop - start)
    for key in FLOAT_COLUMNS:
        cols[key] += floats.get(key, [0.0] * (stop - start))
    return cols


def to_microbatch(cols: dict[str, list]) -> MicroBatch:
    t = {k: torch.tensor(cols[k], dtype=torch.float32 if k in FLOAT_COLUMNS else torch.long)
         for k in INT_COLUMNS + FLOAT_COLUMNS}
    return MicroBatch(**t, denom_mask=t["loss_mask"].clone(),
                      segments=torch.tensor(cols["segments"], dtype=torch.long).view(-1, 4))


def even_out(mbs: list[MicroBatch], group=None) -> list[MicroBatch]:
    """The same number of micro-batches on every rank of `group` (FSDP2 all-gathers per forward):
    a rank with fewer adds ones of a single masked token."""
    n = int(loss.all_reduce_vector(torch.tensor([len(mbs)]), group, op=dist.ReduceOp.MAX))
    return mbs + [to_microbatch(feed(defaultdict(list), [0, 0], 0, 1)) for _ in range(n - len(mbs))]
