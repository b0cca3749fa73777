"""LossReduction bookkeeping as a share of the training step (target: <= 2%).

    python bench/bench_bookkeeping.py      # default task: one rollout batch of 64 prompts x 8
    python bench/bench_bookkeeping.py --steps 2 --warmup 1 --prompts-per-step 8

One rollout batch from nanoareal's engine is trained on `warmup + steps` times with
`train_on_samples` (packing, forward, backward, clip, AdamW). Process CPU time (robust to other
processes on a shared machine) is attributed to:
- response_weights: the per-response mode weights computed once per mini-batch in
  `pack_microbatches`;
- begin_step: every micro-batch's normalizers, validation, and the one all_reduce of Z;
- per-micro-batch overhead in `reduction(numerators, stats)`: all of the call (checking the
  terms, accumulating each numerator and the stats, 1/Z scaling): `train_minibatch` computes the
  numerators before it;
- reported(): the one all_reduce of numerators and stats. The surrogate itself (ratio, clip,
  the masked weighted sums of `loss.masked_sum`) is the loss, not bookkeeping; it is shown for
  context.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from common import L, N, NanoRun, fix_threads, fmt_spread, make_config, summarize  # noqa: I001


class Clock:
    """Accumulates process CPU time of wrapped calls; nested wrapped calls are subtracted from their
    callers."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self._stack: list[float] = []

    def wrap(self, name, fn):
        def timed(*a, **k):
            self._stack.append(0.0)
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                dt = time.process_time() - t
                inner = self._stack.pop()
                self.total[name] = self.total.get(name, 0.0) + dt - inner
                if self._stack:
                    self._stack[-1] += dt
        return timed

    def reset(self):
        self.total = {}


def instrument(reduction: L.LossReduction, clock: Clock, policy_loss: str):
    """Wrap the LossReduction of this run (instance attributes), and as module attributes
    L.response_weights and the loss itself: the surrogate (L.SURROGATES[policy_loss].fn, read by
    train_minibatch at each step) and L.masked_sum."""
    reduction.begin_step = clock.wrap("begin_step", reduction.begin_step)
    reduction.reported = clock.wrap("reported", reduction.reported)
    call = clock.wrap("call_overhead", type(reduction).__call__.__get__(reduction))
    surrogate = L.SURROGATES[policy_loss]
    L.SURROGATES[policy_loss] = dataclasses.replace(surrogate,
                                                    fn=clock.wrap("loss_fn", surrogate.fn))
    L.masked_sum = clock.wrap("loss_fn", L.masked_sum)
    L.response_weights = clock.wrap("response_weights", L.response_weights)
    return call


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--loss-aggregation", default="token_mean")
    args = p.parse_args()
    fix_threads(1)
    nano = NanoRun(make_config(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                               loss_aggregation=args.loss_aggregation,
                               warmup_steps=0, eval_every=0))
    samples = nano.rollout(0)
    clock = Clock()
    call = instrument(nano.reduction, clock, nano.cfg.policy_loss)
    # reduction(numerators, stats) in train_minibatch calls the instance: route it through the
    # timed bound __call__
    nano.reduction.__class__ = type("TimedReduction", (type(nano.reduction),),
                                    {"__call__": lambda self, *a, **k: call(*a, **k)})

    rows = []
    for i in range(args.warmup + args.steps):
        clock.reset()
        t = time.process_time()
        nano.train(samples)
        step = time.process_time() - t
        if i >= args.warmup:
            rows.append((step, dict(clock.total)))
    keys = ["response_weights", "begin_step", "call_overhead", "reported"]
    book = [sum(r[1].get(k, 0.0) for k in keys) / r[0] for r in rows]
    n_mbs = len(N.pack_microbatches(samples, nano.cfg))

    print(f"\n## LossReduction bookkeeping, {args.loss_aggregation}, {len(samples)} samples in "
          f"{n_mbs} micro-batch(es) of <= {nano.cfg.micro_batch_tokens} tokens, CPU time, "
          f"median (min-max) of {args.steps} steps\n")
    print("| part | ms per step | share of the training step |")
    print("|---|---|---|")
    print(f"| training step (train_on_samples) | {fmt_spread([r[0] for r in rows], 1e3, 1)} | 100% "
          "|")
    for k in keys:
        print(f"| {k} | {fmt_spread([r[1].get(k, 0.0) for r in rows], 1e3, 2)} | "
              f"{fmt_spread([r[1].get(k, 0.0) / r[0] for r in rows], 100, 2)}% |")
    print(f"| **bookkeeping total** | {fmt_spread([b * r[0] for b, r in zip(book, rows)], 1e3, 2)} "
          f"| **{fmt_spread(book, 100, 2)}%** |")
    print(f"| (the surrogate loss itself, not bookkeeping) | "
          f"{fmt_spread([r[1].get('loss_fn', 0.0) for r in rows], 1e3, 2)} | "
          f"{fmt_spread([r[1].get('loss_fn', 0.0) / r[0] for r in rows], 100, 2)}% |")
    print(f"\ntarget <= 2%: {'met' if summarize(book)[0] <= 0.02 else 'MISSED'}")


if __name__ == "__main__":
    main()
