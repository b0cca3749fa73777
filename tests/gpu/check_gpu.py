"""One-shot GPU check of nanoareal: correctness of the GPU paths and the numbers that matter, in
one command on a machine with one CUDA GPU (not collected by pytest: no test_ prefix).

    python tests/gpu/check_gpu.py                 # ~3-5 minutes on one H200
    python tests/gpu/check_gpu.py --device cpu --num-layers 1 --quick     # a smoke run anywhere

It needs torch (CUDA), transformers, safetensors and tyro, and nothing from the network: the
model is a randomly initialised Qwen2.5-0.5B-shaped causal LM (24 layers, 152k vocabulary) saved
with the shipped character tokenizer, and the prompts are the built-in arithmetic task's. SGLang
and flash-attn are used when installed and skipped otherwise (tests/gpu/check_sglang.py covers
SGLang). Everything goes through the trainer's own functions: modeling.load_model (FSDP2 on NCCL in
a world of one, bf16 compute with fp32 master weights), pack_microbatches, Model.logprobs,
train_on_samples, the HF rollout engine and its weight sync.

Checks (exit code 1 if one fails), then measurements, printed as markdown (and written to --out):
1. attention: every packed attention path this GPU can run (flash_attn when installed,
   torch_varlen, sdpa) on GRPO groups sharing their prompt, forward and backward, against the
   truth (HF's per-sequence forward and backward in fp32), beside HF's own per-sequence forward
   in the compute dtype as the yardstick: a path may err no more than 3x what HF does (log-probs
   and gradients), and far less than a negative control (the completions' shared prompt hidden);
2. fp32 logits from bf16 hidden states (modeling.HeadLogprobs: torch.mm out_dtype where it runs)
   against an fp32 matmul of the same bf16 values, forward and backward, and the memory it takes
   (no fp32 copy of the 152k x 896 head);
3. the hf engine's sampler: the same tokens on the GPU as on the CPU (its int32 hash's wrapping);
4. training forward+backward FLOP/s and MFU (bench/bench_flops.py's count and peak);
5. full GRPO steps (rollout -> reward -> advantages -> train -> weight sync): the step-time split,
   tokens/s, peak GPU memory and weight-sync time.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the check); cpu runs the same code small, as a smoke test")
    p.add_argument("--num-layers", type=int, default=None,
                   help="fewer decoder layers than Qwen2.5-0.5B's 24 (same width and vocabulary)")
    p.add_argument("--quick", action="store_true",
                   help="small batches and one measured step: a smoke run, not a measurement")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps measured after one warm-up")
    p.add_argument("--checks-only", action="store_true",
                   help="the attention and head checks alone, no GRPO steps or FLOP/s")
    p.add_argument("--out", default=None, help="also write the report to this markdown file")
    return p.parse_args()


def build_model(num_layers: int | None, init_range: float, vocab: int | None = None) -> str:
    """A random Qwen2.5-0.5B-shaped model directory with the shipped character tokenizer (its 18
    ids are a subset of the 152k vocabulary; decoding skips the rest); `vocab` shrinks the
    vocabulary for a CPU smoke run."""
    import shutil

    from bench_flops import QWEN25_05B
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix="check_gpu_qwen05_")
    layers = {"num_hidden_layers": num_layers} if num_layers else {}
    layers |= {"vocab_size": vocab} if vocab else {}
    config = AutoConfig.for_model(**(QWEN25_05B | layers), initializer_range=init_range,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "assets" / "tiny-arith" / name, Path(out) / name)
    return out


def groups(vocab: int, n_groups: int, size: int, prompt_len: int, completion_len: int):
    """GRPO-shaped samples (rollout.Sample): n_groups prompts, `size` completions each, random
    ids."""
    from rollout import Completion, Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n_groups):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(size):
            n = int(torch.randint(completion_len // 2, completion_len + 1, (1,), generator=g))
            ids = torch.randint(2, vocab, (n,), generator=g).tolist()
            out.append(Sample(k, prompt, Completion(ids, [-1.0] * n, "length"),
                              advantage=1.0, row=k))
    return out


def reference_logprobs(model, samples) -> tuple[torch.Tensor, dict]:
    """Per-sequence forward of the model's own attention (no packing): the completion tokens'
    log-probs, concatenated in sample order, and the gradient of their sum by parameter name."""
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion.output_ids], device=model.device)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = logits.log_softmax(-1)[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        lp[len(s.prompt_ids) - 1 :].sum().backward()
        out.append(lp[len(s.prompt_ids) - 1 :].detach())
    return torch.cat(out).cpu(), named_grads(model)


def named_grads(model) -> dict[str, torch.Tensor]:
    """Parameter gradients in fp32 by HF name (FSDP's DTensors gathered, wrappers' names cut)."""
    return {n.replace("_checkpoint_wrapped_module.", ""): getattr(p.grad, "full_tensor",
                                                                  lambda g=p.grad: g)().float()
            for n, p in model.named_parameters() if p.grad is not None}


def grad_error(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over all of want's parameters together."""
    num = sum(float((got[n] - w).pow(2).sum()) for n, w in want.items())
    return (num / sum(float(w.pow(2).sum()) for w in want.values())) ** 0.5


def packed_logprobs(model, mbs, cfg, hide_prompt: bool = False,
                    grad: bool = False) -> torch.Tensor:
    """The trainer's packed forward (a modeling.Model's), completion tokens only, in sample order
    (pack order); grad: their sum's backward too."""
    out = []
    for mb in mbs:
        if hide_prompt:  # negative control: completions no longer see their shared prompt
            segments = mb.segments.clone()
            segments[:, 2:] = 0
            mb = replace(mb, segments=segments)
        logprobs, _ = model.logprobs(mb, cfg.temperature, grad=grad,
                                     entropy_grad=cfg.entropy_coef != 0)
        completion = logprobs.float()[(mb.seq_ids >= 0).to(model.device)]
        if grad:
            completion.sum().backward()
        out.append(completion.detach().cpu())
    return torch.cat(out)


def check_attention(model_dir: str, device: torch.device, ranks, quick: bool) -> list[str]:
    """Every packed path in the compute dtype against the truth (HF's per-sequence forward and
    backward in fp32), beside HF's own per-sequence forward in the compute dtype: a path is right
    if it errs no more than 3x HF does (plus 1e-3 of the control), log-probs and gradients."""
    from common import load_policy
    from transformers import AutoConfig, AutoModelForCausalLM

    import attention
    import modeling
    import nanoareal as N

    half = device.type == "cuda"
    dtype = torch.bfloat16 if half else torch.float32
    refs = {}
    samples = groups(AutoConfig.from_pretrained(model_dir).vocab_size, 2 if quick else 4, 4, 64,
                     32 if quick else 192)
    for d in dict.fromkeys((torch.float32, dtype)):
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=d,
                                                         attn_implementation="sdpa").to(device)
        refs[d] = reference_logprobs(reference, samples)
        del reference
    (want, want_g), (hf, hf_g) = refs[torch.float32], refs[dtype]
    hf_err, hf_gerr = (hf - want).abs(), grad_error(hf_g, want_g)
    rows = [f"| HF per-sequence sdpa ({str(dtype)[6:]}) | yardstick | {hf_err.mean():.2e} / "
            f"{hf_err.max():.2e} | 0 / 0 | {hf_gerr:.2e} | |"]
    failed = []
    for path in ("flash_attn", "torch_varlen", "sdpa"):  # every --attention path but auto
        try:
            attention.choose_attention(path, device, half, softcap=False)
        except ValueError as e:
            rows.append(f"| {path} | not available here: {e} | | | | |")
            continue
        modeling.ATTENTION = path  # the trainer's constant, forced path by path
        cfg = N.validate_config(N.Config(model=model_dir, dtype="bfloat16" if half else "float32"),
                                1)
        model = load_policy(cfg, device, ranks)
        mbs = N.pack_microbatches(samples, cfg)
        got = packed_logprobs(model, mbs, cfg, grad=True)
        grads = named_grads(model.module)
        gerr, g_hf = grad_error(grads, want_g), grad_error(grads, hf_g)
        with torch.no_grad():
            control = packed_logprobs(model, mbs, cfg, hide_prompt=True)
        err, ctl = (got - want).abs(), (control - want).abs()
        ok = bool(err.mean() <= 3 * hf_err.mean() + 1e-3 * ctl.mean()
                  and gerr <= 3 * hf_gerr + 1e-3)
        failed += [] if ok else [path]
        rows.append(f"| {path} | {'ok' if ok else 'FAILED'} | {err.mean():.2e} / {err.max():.2e} "
                    f"| {(got - hf).abs().mean():.2e} / {g_hf:.2e} | {gerr:.2e} "
                    f"| {ctl.mean():.2e} |")
        del model
    modeling.ATTENTION = "auto"
    print_table(f"attention paths ({str(dtype)[6:]}) vs HF's per-sequence fp32 forward and "
                f"backward ({len(samples)} samples in groups of 4 sharing a 64-token prompt)",
                ["path", "result", "log-prob abs error mean / max", f"vs HF {str(dtype)[6:]}: "
                 "log-prob mean abs delta / gradient rel.", "gradient rel. error",
                 "control mean error"], rows)
    return [f"attention path {p} disagrees with the HF forward" for p in failed]


def check_sampler(device: torch.device) -> list[str]:
    """The hf engine's counter-based sampler picks the same tokens here as on the CPU: its int32
    hash relies on products wrapping mod 2^32, which the CPU tests check and this device must too
    (a [64, 152k] draw at three positions, two temperatures; top-p's cumsum may round differently
    on a GPU and move a boundary token, so it is left out)."""
    import rollout

    g = torch.Generator().manual_seed(0)
    logits, seeds = torch.randn(64, 151936, generator=g), torch.arange(64) * 7919 + 2**31 - 64
    rows, bad = [], 0
    for sampling in (rollout.SamplingParams(8, 1.0), rollout.SamplingParams(8, 0.7)):
        for position in (0, 7, 511):
            want = rollout.sample_tokens(logits, sampling, seeds, position)[0]
            got = rollout.sample_tokens(logits.to(device), sampling, seeds, position)[0].cpu()
            bad += int((got != want).sum())
        rows.append(f"| T {sampling.temperature} | "
                    f"{3 * len(seeds)} | {bad} |")
    print_table(f"sampler on {device.type} vs the CPU (the same seeds and logits)",
                ["sampling", "draws", "different tokens so far"], rows)
    return [] if bad == 0 else [f"sampler: {bad} tokens differ from the CPU's"]


def check_fp32_logits(device: torch.device) -> list[str]:
    import modeling

    if device.type != "cuda":
        return []
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(1024, 896, device=device, generator=g).bfloat16().requires_grad_()
    w = torch.randn(151936, 896, device=device, generator=g).bfloat16().requires_grad_()
    used = "torch.mm out_dtype" if modeling.mm_out_dtype_runs(h.device, h.dtype) else "upcast"
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    y = torch.randint(w.shape[0], (h.shape[0],), device=device, generator=g)
    got, _ = modeling.HeadLogprobs.apply(h, w, None, y, 1.0, 1.0, None, modeling.HEAD_CHUNK, False,
                                         modeling.HEAD_KEEP)  # the logits it keeps under grad
    got.sum().backward()  # the training head: its backward's GEMMs
    extra = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    grads = h.grad.float(), w.grad.float()
    h32, w32 = (x.detach().float().requires_grad_() for x in (h, w))
    want = (h32 @ w32.t()).log_softmax(-1).gather(-1, y[:, None])[:, 0]
    want.sum().backward()
    rel = [float((a - b).abs().max() / b.abs().max()) for a, b in
           zip((got, *grads), (want, h32.grad, w32.grad))]
    print_table("fp32 head log-probs from bf16 (1024 tokens x the 152k x 896 head)",
                ["kernel", "dtype", "max rel. error log-probs / d hidden / d weight",
                 "peak extra memory"],
                [f"| {used} | {got.dtype} | {rel[0]:.1e} / {rel[1]:.1e} / {rel[2]:.1e} | "
                 f"{extra:.0f} MiB (an fp32 head copy alone: {w.numel() * 4 / 2**20:.0f} MiB) |"])
    ok = got.dtype == torch.float32 and max(rel) < 2e-2
    return [] if ok else [f"fp32 logits: dtype {got.dtype}, relative errors {rel}"]


def measure_flops(device: torch.device, num_layers: int | None, quick: bool) -> None:
    """bench/bench_flops.py in a process of its own (its own process group and model)."""
    cmd = [sys.executable, str(ROOT / "bench" / "bench_flops.py"), "--device", device.type,
           "--model", "qwen2.5-0.5b"]
    cmd += ["--num-layers", str(num_layers)] if num_layers else []
    cmd += ["--steps", "1", "--warmup", "1", "--seqs", "8", "--prompt-len", "16",
            "--completion-len", "16", "--peak-n", "512"] if quick else []
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    print(out.stdout.strip() if out.returncode == 0 else f"bench_flops failed:\n{out.stderr}")


def measure_grpo(model_dir: str, device: torch.device, ranks, steps: int, quick: bool) -> None:
    from bench_flops import sync
    from common import NanoRun, compile_note

    import nanoareal as N

    cfg = N.validate_config(N.Config(
        model=model_dir, prompts_per_step=8 if quick else 64, group_size=8,
        max_new_tokens=16 if quick else 512, micro_batch_tokens=16384, eval_every=0), 1)
    nano = NanoRun(cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(steps + 1):  # the first step warms up (kernels, allocator)
        sync(device)
        t = nano.step(step)
        sync(device)
        if step > 0:
            times.append(t)
    med = {k: statistics.median(t[k] for t in times) for k in times[0]}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    reserved = torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0
    params = sum(p.numel() for p in nano.model.module.parameters())
    rows = [f"| step | {med['time/step']:.2f} s |",
            f"| rollout (HF engine, {cfg.prompts_per_step} x {cfg.group_size} samples, up to "
            f"{cfg.max_new_tokens} new tokens) | {med['time/rollout']:.2f} s "
            f"({med['generated_tokens'] / med['time/rollout']:.0f} generated tokens/s) |",
            f"| train (fwd+bwd+AdamW on {med['real_tokens']:.0f} tokens) | "
            f"{med['time/train']:.2f} s ({med['real_tokens'] / med['time/train']:.0f} tokens/s) |",
            f"| weight sync ({params / 1e6:.0f} M parameters, FSDP gather -> engine copy) | "
            f"{med['time/sync']:.3f} s |",
            f"| peak GPU memory allocated / reserved | {peak:.1f} / {reserved:.1f} GiB |",
            f"| decoder layers (--compile) | {compile_note(nano.model)} |"]
    print_table(f"GRPO steps, median of {steps} (after one warm-up step)", ["phase", "time"],
                rows)


def print_table(title: str, header: list[str], rows: list[str]) -> None:
    print(f"\n### {title}\n\n| {' | '.join(header)} |\n|{'---|' * len(header)}")
    print("\n".join(rows), flush=True)


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (use --device cpu for a smoke run)")
        return 0
    import transformers

    import logs
    import nanoareal as N

    logs.quiet_libraries()
    t0 = time.perf_counter()
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    try:
        import flash_attn

        fa = f"flash-attn {flash_attn.__version__}"
    except Exception as e:
        fa = f"no flash-attn ({type(e).__name__})"
    print(f"## nanoareal GPU check: {where}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {fa}")
    ranks, device = N.setup_distributed()
    # a larger init spread than Qwen's 0.02 so that log-probs differ between positions: a wrong
    # attention layout then shows up clearly against the control
    model_dir = build_model(args.num_layers, init_range=0.1,
                            vocab=1024 if device.type == "cpu" else None)
    problems = []
    steps = 1 if args.quick else args.steps
    for name, stage in [("attention", lambda: check_attention(model_dir, device, ranks,
                                                                args.quick)),
                        ("fp32 logits", lambda: check_fp32_logits(device)),
                        ("sampler", lambda: check_sampler(device)),
                        ("GRPO steps", lambda: measure_grpo(model_dir, device, ranks, steps,
                                                           args.quick) or [])
                        ][:3 if args.checks_only else 4]:
        try:  # one stage's crash is reported and the others still run: device time is scarce
            problems += stage()
        except Exception:
            import traceback
            traceback.print_exc(file=sys.stdout)
            problems.append(f"{name} raised (traceback above)")
    torch.distributed.destroy_process_group()
    if device.type == "cuda" and not args.checks_only:  # a CPU: tests/test_bench.py runs it
        measure_flops(device, args.num_layers, args.quick)
    print(f"\n{'all checks passed' if not problems else 'FAILED: ' + '; '.join(problems)} "
          f"({time.perf_counter() - t0:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    if "--out" in sys.argv:  # tee the report into a file as well
        import contextlib
        import io

        buffer = io.StringIO()

        class Tee(io.TextIOBase):
            def write(self, s):
                sys.__stdout__.write(s)
                return buffer.write(s)

        with contextlib.redirect_stdout(Tee()):
            code = main()
        Path(sys.argv[sys.argv.index("--out") + 1]).write_text(buffer.getvalue())
    else:
        code = main()
    sys.exit(code)
