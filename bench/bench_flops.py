r"""Achieved FLOP/s of nanoareal's training forward+backward against the measured matmul peak.

    python bench/bench_flops.py                 # CPU, 1 thread, the shipped tiny model, fp32
    python bench/bench_flops.py --device cuda --model qwen2.5-0.5b   # GPU: random-init
                                                # Qwen2.5-0.5B, bf16 mixed precision
    python bench/bench_flops.py --steps 2 --warmup 1 --seqs 64        # smoke run
    python bench/bench_flops.py --model qwen2.5-0.5b --num-layers 1 --seqs 8 --prompt-len 16 \
        --completion-len 8                      # the GPU model's path (152k vocabulary) on a CPU

The model goes through nanoareal's own path: `modeling.load_model` (FSDP2, world of one; on CUDA
bf16 mixed precision and flash-attn varlen when installed, else the packed per-sequence sdpa) and
`Model.logprobs` on packed micro-batches, then `backward()` of the summed log-probs. Timed:
forward + backward of every micro-batch of a batch of `--seqs` sequences of `--prompt-len +
--completion-len` tokens (no optimizer).

FLOPs per batch (stated, not measured), the work the packed rows actually need:
    6 * N * T  +  12 * n_layers * d_attn * P
N = weights of every matmul (decoder layers + lm_head; embeddings are a lookup), T = positions
fed (groups of 8 samples share their prompt, so a prompt is fed once per micro-batch), d_attn =
heads * head_dim, P = causal (query, key) pairs: a segment of q tokens after c context tokens has
q*c + q(q+1)/2. The first term is the dense forward (2NT) + backward (4NT); the second is QK^T
and AV (2 * 2 * d_attn per pair and layer, forward) x 3. Peak: a timed square matmul (fp32 on CPU
with the same thread count, bf16 on GPU), 2 n^3 / t.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from common import N, Sample, fix_threads, fmt_spread, load_policy, summarize  # noqa: I001

from rollout import Completion

QWEN25_05B = dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, hidden_act="silu")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, dtype, n: int, reps: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def matmul_weights(model) -> tuple[int, int]:
    """(decoder, head) weights that a position multiplies: the decoder layers' 2-D weights and the
    lm_head's (tied or not, its matmul runs; the input embedding is a lookup)."""
    head = model.get_output_embeddings().weight
    decoder = sum(p.numel() for n, p in model.named_parameters()
                  if p.dim() == 2 and "embed_tokens" not in n and p is not head)
    return decoder, head.numel()


def causal_pairs(segments: torch.Tensor) -> int:
    """(query, key) pairs a packed batch's attention needs: a segment of q tokens after c context
    tokens (segments [R, 4]: start, q, ..., c) attends q*c + q(q+1)/2."""
    q, c = segments[:, 1], segments[:, 3]
    return int((q * c + q * (q + 1) // 2).sum())


def model_dir(name: str, num_layers: int | None, vocab: int | None = None) -> str:
    if name != "qwen2.5-0.5b":
        return name
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix="bench_qwen05_")
    layers = {"num_hidden_layers": num_layers} if num_layers else {}
    layers |= {"vocab_size": vocab} if vocab else {}
    config = AutoConfig.for_model(**(QWEN25_05B | layers))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="assets/tiny-arith",
                   help="a model directory, or qwen2.5-0.5b (random init)")
    p.add_argument("--seqs", type=int, default=None,
                   help="sequences per batch (default 512 CPU, 64 GPU)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="default 6 CPU (the arithmetic task), 256 GPU")
    p.add_argument("--completion-len", type=int, default=None, help="default 3 CPU, 768 GPU")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="default: nanoareal's Config on CPU, 16384 GPU")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=None,
                   help="qwen2.5-0.5b only: fewer layers (same width and 152k vocabulary), e.g. "
                   "a CPU smoke run")
    p.add_argument("--peak-n", type=int, default=None,
                   help="matmul size for the peak (default 2048 CPU, 8192 GPU)")
    args = p.parse_args()
    gpu = args.device == "cuda"
    fix_threads(1)
    seqs = args.seqs or (64 if gpu else 512)
    plen, clen = args.prompt_len or (256 if gpu else 6), args.completion_len or (768 if gpu else 3)
    name = args.model if not gpu or args.model != "assets/tiny-arith" else "qwen2.5-0.5b"
    budget = args.micro_batch_tokens or (16384 if gpu else N.Config.micro_batch_tokens)
    cfg = N.Config(model=model_dir(name, args.num_layers), micro_batch_tokens=budget)
    ranks, device = N.setup_distributed(cfg.cp_size)
    model = load_policy(cfg, device, ranks)
    hf = model.module.config
    vocab = hf.vocab_size

    # a packed batch of identical-length sequences in GRPO groups of 8 (one prompt each), through
    # nanoareal's packing
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (plen,), generator=g).tolist() for _ in range(-(-seqs // 8))]
    samples = [Sample(i // 8, prompts[i // 8],
                      Completion(torch.randint(2, vocab, (clen,), generator=g).tolist(),
                                 [-1.0] * clen, "length"),
                      advantage=1.0) for i in range(seqs)]
    mbs = N.pack_microbatches(samples, cfg)
    T = sum(mb.input_ids.numel() for mb in mbs)

    n_matmul = sum(matmul_weights(model.module))
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    d_attn = hf.num_attention_heads * head_dim
    L = plen + clen
    pairs = causal_pairs(torch.cat([mb.segments for mb in mbs]))
    flops = 6 * n_matmul * T + 12 * hf.num_hidden_layers * d_attn * pairs

    def fwd_bwd():
        for mb in mbs:
            logprobs, _ = model.logprobs(mb, cfg.temperature, grad=True,
                                         entropy_grad=cfg.entropy_coef != 0)
            logprobs.sum().backward()
        model.module.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup + args.steps):
        sync(device)
        t = time.perf_counter()
        fwd_bwd()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    peak_dtype = torch.bfloat16 if gpu else torch.float32
    peak = matmul_peak(device, peak_dtype, args.peak_n or (8192 if gpu else 2048), 20 if gpu else 3)
    achieved = [flops / t for t in times]
    med = summarize(achieved)[0]
    layers = f", {args.num_layers} layer(s)" if args.num_layers else ""
    name = f"Qwen2.5-0.5B config{layers}, random init" if cfg.model != args.model else args.model
    where = torch.cuda.get_device_name() if gpu else f"CPU, {torch.get_num_threads()} thread"
    print(f"\n## Training forward+backward FLOP/s: {name}, {where}, attention "
          f"{model.attention}, median (min-max) of {args.steps} steps\n")
    print("| quantity | value |")
    print("|---|---|")
    print(f"| matmul weights N | {n_matmul / 1e6:.2f} M |")
    print(f"| batch | {seqs} seqs x {L} tokens, groups of 8: {T} positions fed in {len(mbs)} "
          "micro-batch(es) |")
    print(f"| FLOPs per batch (6NT + attention) | {flops / 1e9:.2f} GFLOP |")
    print(f"| forward+backward time | {fmt_spread(times)} s |")
    print(f"| achieved | {fmt_spread(achieved, 1e-9, 2)} GFLOP/s |")
    print(f"| measured matmul peak ({str(peak_dtype).split('.')[-1]}) | {peak / 1e9:.2f} GFLOP/s |")
    print(f"| share of peak (MFU) | {100 * med / peak:.1f}% |")


if __name__ == "__main__":
    main()
