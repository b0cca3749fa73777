"""torchrun worker for tests/test_context_parallel.py (also runs as plain `python`, a world of one).

For every --cp size and every model directory it runs nanoareal's own code path:
setup_distributed (the (dp, cp) mesh), load_models, Model.logprobs, pack_microbatches (this
data-parallel rank's groups only), train_minibatch, LossReduction. Rank 0 saves, with torch.save
to --out: the logits and log-probs of one fixed packed row, and per aggregation mode (all four
for the first model, token_mean for the others) the full gradient of every parameter (taken where
the optimizer would step), the reported loss terms and FSDP2's reduce-scatters in the step; and
how many whole copies of a model each rank loaded (rank 0's, on the host, which others shard).
--checkpoint-layers: activation checkpointing of the decoder layers. --episodes: multi-turn
responses, environment spans inside (what the loss must leave out of every sum and count).
--compile: the decoder layers compiled (--compile, however small the model).
"""

import argparse
import os
import random
import sys
from dataclasses import replace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
torch.set_num_threads(1)

from reference import GradCapture  # noqa: E402

import attention  # noqa: E402
import loss as L  # noqa: E402
import modeling  # noqa: E402
import nanoareal as na  # noqa: E402
import packing  # noqa: E402
from rollout import Completion, Sample  # noqa: E402

MODES = ["token_mean", "seq_mean", "prompt_mean", "constant"]
# 3 packed sequences, 13 tokens (not a multiple of 2 or 4)
ROW_IDS = [[3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 6, 10, 11]]
ROW_POS = [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1]]


def make_samples(vocab: int, episodes: bool = False) -> list:
    """Groups of uneven sizes, prompts and responses of uneven lengths; one group of one; a
    zero-advantage group. episodes: each response is 1-2 policy turns with an environment span
    after the first (interior when a second follows) and maybe after the second, as
    rollout.run_episodes makes them (policy_mask 0 and behaviour log-prob 0 there)."""
    rng = random.Random(0)
    samples = []
    for g, size in enumerate([3, 2, 3, 1, 3, 2]):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 5))]
        rewards = [float(rng.random() < 0.5) for _ in range(size)] if g != 4 else [1.0] * size
        adv = L.group_advantages(torch.tensor(rewards), torch.full((size,), g), "grpo", 1).tolist()
        for k in range(size):
            mask = [m for turn in range(rng.randint(1, 2)) for m in [1] * rng.randint(1, 3)
                    + [0] * rng.randint(1 - turn, 2)] if episodes else None
            out = [rng.randrange(2, vocab) for _ in range(len(mask) if mask else rng.randint(1, 6))]
            logprobs = [-2.0 - rng.random() for _ in out]
            if mask:
                logprobs = [lp if m else 0.0 for lp, m in zip(logprobs, mask)]
            samples.append(Sample(g, prompt, Completion(out, logprobs, "stop", mask),
                                  rewards[k], adv[k]))
    return samples


def row_logits(model, model_dir: str, dtype, ranks):
    """Logits [T, V] of the fixed row. Without CP: plain transformers (eager attention, which
    finds the packed sequences in position_ids when use_cache=False), independent of nanoareal's
    attention. With CP: each rank runs its chunk of the FSDP-sharded model, then the chunks are
    gathered."""
    ids, pos = torch.tensor(ROW_IDS), torch.tensor(ROW_POS)
    with torch.no_grad():
        if ranks.cp_size == 1:
            from transformers import AutoModelForCausalLM

            plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                         attn_implementation="eager").eval()
            return plain(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        T, n = ids.shape[1], ranks.cp_size
        pad = -T % n
        ids, pos = torch.nn.functional.pad(ids, (0, pad)), torch.cat([pos,
                                                                      torch.arange(pad)[None]], 1)
        mine = slice(ranks.cp_rank * (T + pad) // n, (ranks.cp_rank + 1) * (T + pad) // n)
        layout = attention.attention_layout(attention.segments_from_positions(pos), T + pad,
                                            cp_group=ranks.cp_group)
        logits = model.module(input_ids=ids[:, mine], position_ids=pos[:, mine], use_cache=False,
                              layout=layout).logits[0]
        parts = [torch.empty_like(logits) for _ in range(n)]
        dist.all_gather(parts, logits.contiguous(), group=ranks.cp_group)
        return torch.cat(parts)[:T]


class CountReduceScatters:
    """Counts FSDP2's gradient reduce-scatters (torch 2.13 calls dist.reduce_scatter_single)."""

    def __enter__(self):
        self.count, self.real = 0, dist.reduce_scatter_single

        def counted(*args, **kwargs):
            self.count += 1
            return self.real(*args, **kwargs)
        dist.reduce_scatter_single = counted
        return self

    def __exit__(self, *exc):
        dist.reduce_scatter_single = self.real


def run(cfg0, device, ranks, model_dir: str, dtype, modes: list[str], episodes: bool = False,
        teacher: str | None = None) -> dict:
    model = na.load_models(cfg0, device, ranks)[0]
    torch._dynamo.config.suppress_errors = False  # compiled: a failure fails, never runs eager
    vocab = model.module.config.vocab_size
    pos = torch.tensor(ROW_POS[0])
    row = L.MicroBatch(input_ids=torch.tensor(ROW_IDS[0]), position_ids=pos,
                       targets=torch.tensor(ROW_IDS[0][1:] + [0]),
                       segments=attention.segments_from_positions(pos))
    logprobs, entropy = model.logprobs(row, cfg0.temperature,
                                       entropy_grad=cfg0.entropy_coef != 0)
    result = {"logits": row_logits(model, model_dir, dtype, ranks), "logprobs": logprobs,
              "entropy": entropy, "modes": {}, "compiled": model.compiled}
    samples = make_samples(vocab, episodes)
    # as main(): whole groups per DP rank
    groups = sorted({s.group for s in samples})[ranks.dp_rank :: ranks.dp_size]
    mine = [s for s in samples if s.group in groups]
    if teacher:  # a sharded teacher's per-token advantages, then a sequence-level correction
        cfg0 = replace(cfg0, teacher=teacher, distill_coef=0.5, correction="geo_mis",
                       correction_threshold=3.5)
        scorer = modeling.load_model(replace(cfg0, model=teacher), device, ranks.world,
                                     ranks.cp_group, trainable=False)
        na.set_advantages(mine, cfg0, ranks, scorer)
        result["token_advantages"] = [s.token_advantages for s in mine]
    for mode in modes:
        cfg = na.validate_config(replace(cfg0, loss_aggregation=mode,
                                         loss_aggregation_divisor=None), ranks.world)
        mbs = packing.even_out(na.pack_microbatches(mine, cfg))
        if teacher:  # pi_prox's forward, the rejection out of m and d, the mode's weights again
            mbs = na.minibatch(model, None, mine, cfg)
            result.setdefault("rejected", {})[mode] = sum(float(mb.rejected.sum()) for mb in mbs
                                                          if mb.rejected is not None)
        reduction = L.build_loss(cfg, cp_factor=ranks.cp_size)
        capture = GradCapture(model)
        with CountReduceScatters() as rs:
            na.train_minibatch(model, capture, reduction, mbs, cfg, ranks)
        result["modes"][mode] = {"grads": capture.grads, "reported": reduction.reported(),
                                 "num_microbatches": len(mbs), "reduce_scatters": rs.count}
    return result


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", required=True)
    ap.add_argument("--cp", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--checkpoint-layers", action="store_true")
    ap.add_argument("--episodes", action="store_true", help="responses with environment spans")
    ap.add_argument("--compile", action="store_true", help="compile the tiny models' layers")
    ap.add_argument("--teacher", help="distil from this model, the loss geo-MIS corrected")
    args = ap.parse_args(argv)
    modeling.CHECKPOINT_LAYERS = "full" if args.checkpoint_layers else ""
    if args.compile:  # (a torchrun child only: pytest's own process keeps the trainer's default)
        modeling.COMPILE_FROM = 0
    dtype = getattr(torch, args.dtype)
    cfg0 = na.parse_config(["--micro-batch-tokens", "16", "--entropy-coef", "0.01", "--grad-clip",
                            "1e9", "--max-new-tokens", "6", "--cp-size", str(args.cp),
                            "--dtype", args.dtype])
    ranks, device = na.setup_distributed(cfg0.cp_size)
    cfg = na.validate_config(cfg0, ranks.world)
    from transformers import AutoModelForCausalLM  # count whole copies loaded on this rank
    loads, real = [], AutoModelForCausalLM.from_pretrained.__func__
    own = vars(AutoModelForCausalLM).get("from_pretrained")  # restored after (pytest runs this)
    AutoModelForCausalLM.from_pretrained = classmethod(
        lambda cls, *a, **k: loads.append(a[0]) or real(cls, *a, **k))
    # every aggregation mode on the first model; the others (e.g. KV-head replication) need only one
    results = {os.path.basename(m): run(replace(cfg, model=m), device, ranks, m, dtype,
                                        MODES if i == 0 else MODES[:1], args.episodes,
                                        args.teacher)
               for i, m in enumerate(args.models)}
    if own is None:
        del AutoModelForCausalLM.from_pretrained
    else:
        AutoModelForCausalLM.from_pretrained = own
    whole = [None] * ranks.world
    dist.all_gather_object(whole, len(loads))
    if ranks.rank == 0:
        torch.save({"models": results, "whole_copies": whole}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # then exit without interpreter teardown, as nanoareal.py does (a rare gloo abort there)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
