"""Full fine-tuning vs LoRA on a CPU at a realistic shape: peak memory (the process's max RSS) and
the training step's time (train_on_samples: packed forward + backward + AdamW, no generation) of a
random-init SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9/3 heads, vocab 49152), each
variant in a fresh child process, printed side by side as a markdown table.

    python bench/bench_lora.py                          # full vs LoRA r=8, fp32, 2 steps after 1
    python bench/bench_lora.py --ranks 0 1 8 32 --dtype bfloat16 --steps 3
    python bench/bench_lora.py --tiny                   # the test's shape (seconds)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, fix_threads

import nanoareal as N
from rollout import Completion, Sample

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def save_model(out: Path, shape: dict) -> str:
    """A random-init Llama of `shape` (seeded) in `out`; weights only, no tokenizer needed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True,
                                 **shape)).save_pretrained(out)
    return str(out)


def child(model: str, rank: int, dtype: str, steps: int, warmup: int, prompts: int, group: int,
          prompt_len: int, new_tokens: int) -> dict:
    """One variant: load as the trainer does, train on a fixed synthetic batch, time each step."""
    import random

    import torch.distributed as dist

    import loss as L

    fix_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = N.validate_config(N.Config(model=model, lora_rank=rank, dtype=dtype, warmup_steps=0,
                                     prompts_per_step=prompts, group_size=group,
                                     max_new_tokens=new_tokens), 1)
    model, _, _, optimizer = N.load_models(cfg, N.torch.device("cpu"), N.Ranks())
    vocab, rng = model.module.config.vocab_size, random.Random(0)
    samples = [Sample(g, [rng.randrange(3, vocab) for _ in range(prompt_len)],
                      Completion([rng.randrange(3, vocab) for _ in range(new_tokens)],
                                 [-1.0] * new_tokens, "length"), advantage=(-1.0) ** k)
               for g in range(prompts) for k in range(group)]
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg, N.Ranks())
        times.append(time.perf_counter() - t0)
    params, size = list(model.module.parameters()), lambda t: t.numel() * t.element_size()
    state = sum(size(p) * (1 + p.requires_grad) for p in params) + sum(  # weights, grads, AdamW
        size(t) for s in optimizer.state.values() for t in s.values() if t.dim())
    return {"trainable": sum(p.numel() for p in params if p.requires_grad),
            "params": sum(p.numel() for p in params), "state_gib": state / 2**30,
            "step_s": times[warmup:], "peak_gib": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 8], help="0: full fine-tuning")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model: the test's shape")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = (["prompts", "group", "prompt_len", "new_tokens"], ["steps", "warmup"])
    if args.child:
        rank, model = args.child.split(":", 1)
        print(json.dumps(child(model, int(rank), args.dtype, args.steps, args.warmup,
                               *(getattr(args, k) for k in shape[0]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = save_model(Path(tmp), TINY if args.tiny else SMOLLM2)
        flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in sum(shape, [])]
        rows = []
        for rank in args.ranks:  # a fresh process each: its max RSS is its own peak
            out = subprocess.run([sys.executable, __file__, "--child", f"{rank}:{model}",
                                  "--dtype", args.dtype, *flags], capture_output=True, text=True,
                                 cwd=ROOT, check=True)
            rows.append((rank, json.loads(out.stdout.strip().splitlines()[-1])))
    print(f"\n{args.prompts} prompts x {args.group} samples, {args.prompt_len}-token prompts, "
          f"{args.new_tokens} new tokens, {args.dtype}, 1 thread; step = train_on_samples "
          f"(median (min-max) of {args.steps} after {args.warmup})\n")
    print("| variant | trainable params | of all | weights + grads + AdamW GiB | peak RSS GiB "
          "| step s |")
    print("|---|---|---|---|---|---|")
    for rank, r in rows:
        t = r["step_s"]
        print(f"| {'full' if rank == 0 else f'LoRA r={rank}'} | {r['trainable']:,} | "
              f"{r['trainable'] / r['params']:.2%} | {r['state_gib']:.3f} | {r['peak_gib']:.2f} | "
              f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f}) |")


if __name__ == "__main__":
    main()
