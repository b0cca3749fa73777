"""Packing: rollout samples -> micro-batches of at most a token budget, with no padding.

A micro-batch is one packed row of many sequences (loss.MicroBatch): per-token tensors aligned
with the *predicted* token (position j of a sequence predicts token j+1; a sequence's last token
is never fed, it predicts nothing) and `segments` [R, 4] saying who attends to what (modeling.py).
With shared prompts a micro-batch feeds each prompt prefix (the prompt minus its last token) once
and each sample only its tail, at positions p-1.., attending to that copy. Exact: under causal
attention the prefix's hidden states depend on the prefix alone, and backward sums every sample's
gradient into the one copy. A sample is anything with .group, .prompt_ids, .advantage and
.completion (.output_ids, .logprobs, .finish_reason).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

import loss
from loss import MicroBatch

FLOAT_COLUMNS = ("loss_mask", "advantages", "behave_logprobs", "loss_weight", "norm_weight")


def pack_microbatches(samples: list, mode: str, divisor: float | None, budget: int,
                      mask_truncated: bool = False, share_prompts: bool = True
                      ) -> list[MicroBatch]:
    """Micro-batches of at most `budget` fed positions. The mode's weights come from the whole
    mini-batch's metadata before any split, which makes any split exact (rule 2 of loss.py's
    contract); with mask_truncated a response cut at the length limit counts nowhere."""
    dropped = [mask_truncated and s.completion.finish_reason == "length" for s in samples]
    denom = torch.tensor([0.0 if d else len(s.completion.output_ids)
                          for s, d in zip(samples, dropped)], dtype=torch.float64)
    weights, norm_weights = loss.response_weights(
        mode, denom, torch.tensor([s.group for s in samples], dtype=torch.long), divisor)
    keys = [tuple(s.prompt_ids[:-1]) if share_prompts else i for i, s in enumerate(samples)]
    return [build_microbatch([samples[i] for i in idx], [keys[i] for i in idx],
                             weights[idx].tolist(), norm_weights[idx].tolist(),
                             [dropped[i] for i in idx], share_prompts)
            for idx in split_by_budget(samples, keys, budget)]


def split_by_budget(samples: list, keys: list, budget: int) -> list[list[int]]:
    """Greedy cut of the samples, in order, into micro-batches of at most `budget` fed positions
    (a shared prefix costs its first sample only). The caller checked that each one fits."""
    batches, current, used, prefixes = [], [], 0, set()
    for i, (s, key) in enumerate(zip(samples, keys)):
        r = len(s.completion.output_ids)
        n = len(s.prompt_ids) + r - 1
        cost = r if key in prefixes else n
        if used + cost > budget:
            batches.append(current)
            current, used, prefixes, cost = [], 0, set(), n
        current.append(i)
        used += cost
        prefixes.add(key)
    return batches + [current] if current else batches


def build_microbatch(samples: list, keys: list, weights: list[float], norm_weights: list[float],
                     dropped: list[bool], share: bool) -> MicroBatch:
    """One packed micro-batch: each sample's fed positions after its prompt prefix's (fed once per
    key with `share`), and the segments that say who attends to what."""
    cols: dict[str, list] = defaultdict(list)
    segments, prefix_at = [], {}  # key -> (start, length) of its prefix's copy in this batch
    for k, s in enumerate(samples):
        full, p = s.prompt_ids + s.completion.output_ids, len(s.prompt_ids)
        head, ctx = (p - 1, prefix_at.get(keys[k])) if share else (0, (0, 0))
        if ctx is None:  # the prompt's first sample here: its prefix is fed, predicting nothing
            ctx = prefix_at[keys[k]] = (len(cols["input_ids"]), p - 1)
            if p > 1:
                segments.append((ctx[0], p - 1, 0, 0))
                extend(cols, full[: p - 1], range(p - 1), full[1:p], [-1] * (p - 1))
        # positions head..p+r-2: the prompt's (predicting prompt tokens: no loss), the response's
        r = len(s.completion.output_ids)
        n, fed_prompt = p + r - 1 - head, p - 1 - head
        if n:
            segments.append((len(cols["input_ids"]), n, *ctx))
            extend(cols, full[head:-1], range(head, p + r - 1), full[head + 1 :],
                   [-1] * fed_prompt + [k] * r,
                   loss_mask=[0.0] * fed_prompt + [0.0 if dropped[k] else 1.0] * r,
                   behave_logprobs=[0.0] * fed_prompt + s.completion.logprobs,
                   advantages=[s.advantage] * n, loss_weight=[weights[k]] * n,
                   norm_weight=[norm_weights[k]] * n)
    return to_microbatch(cols, segments)


def extend(cols: dict[str, list], ids, positions, targets, seq_ids, **floats: list[float]) -> None:
    """Append positions to a micro-batch's columns; a float column not given is 0 (a prefix: no
    loss, weights or advantages)."""
    for key, values in zip(("input_ids", "position_ids", "targets", "seq_ids"),
                           (ids, positions, targets, seq_ids)):
        cols[key] += values
    for key in FLOAT_COLUMNS:
        cols[key] += floats.get(key, [0.0] * len(ids))


def to_microbatch(cols: dict[str, list], segments: list) -> MicroBatch:
    ints = {k: torch.tensor(cols[k], dtype=torch.long)
            for k in ("input_ids", "position_ids", "targets", "seq_ids")}
    floats = {k: torch.tensor(cols[k], dtype=torch.float32) for k in FLOAT_COLUMNS}
    return MicroBatch(**ints, **floats, denom_mask=floats["loss_mask"].clone(),
                      segments=torch.tensor(segments, dtype=torch.long).view(-1, 4))


def even_out(mbs: list[MicroBatch], group=None) -> list[MicroBatch]:
    """The same number of micro-batches on every rank of `group` (FSDP2 all-gathers per forward):
    a rank with fewer adds ones of a single masked token."""
    n = int(loss.all_reduce_vector(torch.tensor([len(mbs)]), group, op=dist.ReduceOp.MAX))
    cols: dict[str, list] = defaultdict(list)
    extend(cols, [0], [0], [0], [-1])
    return mbs + [to_microbatch(cols, [(0, 1, 0, 0)]) for _ in range(n - len(mbs))]
