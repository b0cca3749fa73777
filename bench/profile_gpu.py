"""Where a GPU step's time goes, on a random-init Qwen2.5-0.5B-shaped model (152k vocabulary):
the HF engine's decode and the trainer's forward+backward, with torch.profiler's top operators.

    python bench/profile_gpu.py --out bench/results/gpu_profile.md     # one CUDA GPU, ~2 minutes
    python bench/profile_gpu.py --device cpu --num-layers 1 --vocab 1024 --rows 8 --tokens 4 \
        --seqs 8 --prompt-len 8 --completion-len 8                     # a smoke run on a CPU

1. decode: HFEngine.generate of `--tokens` new tokens for `--rows` rows (groups of 8 sharing a
   16-token prompt, no stop token: every row runs to the end): ms per decode step, and the
   sampler's share (sample_tokens alone on logits of that shape);
2. train: forward+backward of `--seqs` packed sequences (bench_flops.py's batch) under each
   activation-checkpointing choice (none, selective, every layer): time and peak memory;
3. the operators that take the most device time in each (one profiled decode of 16 tokens, one
   profiled forward+backward without checkpointing).
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
from bench_flops import model_dir, sync
from common import N, load_policy  # noqa: I001  (puts the repository on the path)

import modeling
import rollout
from rollout import Completion, Sample


def timed(fn, device, reps: int = 1) -> float:
    """Seconds per call of fn(), the device synchronised around it."""
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t) / reps


def top_ops(fn, device, rows: int = 15) -> str:
    """torch.profiler's table of the operators that take the most (self) device time in fn()."""
    from torch.profiler import ProfilerActivity, profile
    gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * gpu) as prof:
        fn()
        sync(device)
    key = "self_cuda_time_total" if gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def decode(path: str, device, rows: int, tokens: int) -> tuple[list[str], str]:
    engine = rollout.HFEngine(path, device, torch.bfloat16 if device.type == "cuda" else None,
                              batch_size=rows)
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (16,), generator=g).tolist() for _ in range(-(-rows // 8))]
    prompts = [prompts[i // 8] for i in range(rows)]
    run = lambda n: engine.generate(prompts, rollout.SamplingParams(n), list(range(rows)))
    run(4)  # kernels, allocator
    step = timed(lambda: run(tokens), device) / tokens
    logits = torch.randn(rows, vocab, device=device)
    seeds = torch.arange(rows)
    sampler = timed(lambda: rollout.sample_tokens(logits, rollout.SamplingParams(tokens), seeds,
                                                  3), device, reps=10)
    lines = [f"| decode step ({rows} rows, {tokens} new tokens, 16-token prompts) | "
            f"{1e3 * step:.1f} ms ({rows / step:.0f} tokens/s) |",
            f"| of which the sampler (sample_tokens on [{rows}, {vocab}] logits) | "
            f"{1e3 * sampler:.1f} ms ({100 * sampler / step:.0f}%) |"]
    return lines, top_ops(lambda: run(16), device)


def forward_backward(model, mbs, cfg) -> None:
    for mb in mbs:
        logprobs, _ = model.logprobs(mb, cfg.temperature, grad=True,
                                     entropy_grad=cfg.entropy_coef != 0)
        logprobs.sum().backward()
    model.module.zero_grad(set_to_none=True)


def train(path: str, device, ranks, seqs: int, plen: int, clen: int) -> tuple[list[str], str]:
    from transformers import AutoConfig
    cfg = N.Config(model=path, micro_batch_tokens=16384)
    vocab, g = AutoConfig.from_pretrained(path).vocab_size, torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(-(-seqs // 8))]
    mbs = N.pack_microbatches([Sample(i // 8, prompts[i // 8], Completion(
        torch.randint(2, vocab, (clen,), generator=g).tolist(), [-1.0] * clen, "length"),
        advantage=1.0) for i in range(seqs)], cfg)
    positions = sum(mb.input_ids.numel() for mb in mbs)
    out, table, default = [], "", modeling.CHECKPOINT_LAYERS
    for choice in ("", "selective", "full"):
        modeling.CHECKPOINT_LAYERS = choice
        model = load_policy(cfg, device, ranks)
        fwd_bwd = functools.partial(forward_backward, model, mbs, cfg)
        fwd_bwd()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = timed(fwd_bwd, device, reps=2)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
        out.append(f"| forward+backward, checkpointing {choice or 'none'} ({positions} "
                   f"positions in {len(mbs)} micro-batches) | {t:.3f} s, peak {peak:.1f} GiB |")
        if not choice:  # the work itself, no rerun (a GPU's choice where memory allows)
            table = top_ops(fwd_bwd, device)
        del model, fwd_bwd
    modeling.CHECKPOINT_LAYERS = default
    return out, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--num-layers", type=int, default=None, help="fewer than Qwen2.5-0.5B's 24")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (smoke runs)")
    p.add_argument("--rows", type=int, default=512, help="decode rows (64 prompts x 8)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens a decode runs")
    p.add_argument("--seqs", type=int, default=64, help="sequences trained (groups of 8)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--completion-len", type=int, default=768)
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (use --device cpu for a smoke run)")
        return
    path = model_dir("qwen2.5-0.5b", args.num_layers, args.vocab)
    ranks, device = N.setup_distributed()
    rows, decode_ops = decode(path, device, args.rows, args.tokens)
    train_rows, train_ops = train(path, device, ranks, args.seqs, args.prompt_len,
                                  args.completion_len)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    report = "\n".join([f"## Where a GPU step's time goes: {where}, torch {torch.__version__}", "",
                        "| phase | time |", "|---|---|", *rows, *train_rows, "",
                        "### decode (16 tokens), top operators", "```", decode_ops, "```", "",
                        "### forward+backward, top operators", "```", train_ops, "```"])
    print(report, flush=True)
    if args.out:
        Path(args.out).write_text(report + "\n")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
