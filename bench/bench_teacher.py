r"""On-policy distillation's cost at real shapes (issue 45): the teacher's scoring of a batch
(`nanoareal.teacher_logprobs`: the samples packed, a no_grad forward per micro-batch, the head's
log-probs of every sampled token) side by side with the GRPO training step on the same batch
(`nanoareal.train_on_samples`: forward + backward + AdamW), in one child process per length.

    python bench/bench_teacher.py                      # 135M student, 360M teacher, 32/128 tokens
    python bench/bench_teacher.py --tiny --steps 1     # smoke run

Shapes: the student SmolLM2-135M's (hidden 576, 30 layers, 9/3 heads), the teacher SmolLM2-360M's
(hidden 960, 32 layers, 15/5 heads, intermediate 2560), both random-init with SmolLM2's vocabulary
(49152, tied). Answers run to the length; the FLOPs are 2 N T for a forward (N: the body's matmul
parameters, T positions fed) plus the head's 2 V d per scored token, 3x that for a training step."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train_phase import SHAPES  # noqa: E402

SHAPES = SHAPES | {
    "smollm2-360m": dict(model_type="llama", hidden_size=960, intermediate_size=2560,
                         num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                         vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu"),
    "tiny-teacher": dict(model_type="llama", hidden_size=96, intermediate_size=192,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True)}


def model_dir(shape: str) -> str:
    out = Path(tempfile.gettempdir()) / f"bench_teacher_{shape}"
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        config = AutoConfig.for_model(**SHAPES[shape])
        AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    return str(out)


def body_flops(module, positions: int, scored: int) -> float:
    """A forward's FLOPs: 2 N_body T + 2 V d H (the head on the H scored positions)."""
    hf = module.config
    n_body = sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2
                 and "embed_tokens" not in n and "lm_head" not in n)
    return 2 * n_body * positions + 2 * hf.vocab_size * hf.hidden_size * scored


def child(a) -> dict:
    import torch

    import loss as L
    import modeling
    import nanoareal as N
    from rollout import Completion, Sample
    cfg = N.validate_config(N.Config(model=model_dir(a.student), prompts_per_step=a.prompts,
                                     group_size=a.group, max_new_tokens=a.length), 1)
    ranks, device = N.setup_distributed(cfg.cp_size)
    torch.set_num_threads(a.threads)
    model, _, _, optimizer = N.load_models(cfg, device, ranks)
    teacher = modeling.load_model(N.replace(cfg, model=model_dir(a.teacher)), device,
                                  trainable=False)
    vocab, g = model.module.config.vocab_size, torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    lp = -float(torch.tensor(vocab).log())
    samples = [Sample(i // a.group, prompts[i // a.group], Completion(
        torch.randint(2, vocab, (a.length,), generator=g).tolist(), [lp] * a.length, "length"),
        advantage=float(torch.randn((), generator=g))) for i in range(a.prompts * a.group)]
    mbs = N.pack_microbatches(samples, cfg)
    positions = sum(len(mb.input_ids) for mb in mbs)
    scored = sum(int((mb.seq_ids >= 0).sum()) for mb in mbs)
    reduction, times = L.build_loss(cfg), {"teacher": [], "step": []}
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        N.teacher_logprobs(teacher, samples, cfg)
        t1 = time.perf_counter()
        N.train_on_samples(model, None, optimizer, reduction, samples, cfg, ranks)
        if i >= a.warmup:
            times["teacher"].append(t1 - t)
            times["step"].append(time.perf_counter() - t1)
    x = torch.randn(a.peak_n, a.peak_n)
    x @ x
    t = time.perf_counter()
    for _ in range(3):
        x @ x
    peak = 6 * a.peak_n**3 / (time.perf_counter() - t)
    return {"times": times, "positions": positions, "peak": peak,
            "teacher_flops": body_flops(teacher.module, positions, scored),
            "step_flops": 3 * body_flops(model.module, positions, scored),
            "teacher_params": sum(p.numel() for p in teacher.module.parameters()),
            "student_params": sum(p.numel() for p in model.module.parameters())}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--teacher", default="smollm2-360m", choices=list(SHAPES))
    p.add_argument("--tiny", action="store_true", help="tiny shapes, short answers (smoke)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peak-n", type=int, default=2048)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)))
        return
    if a.tiny:
        a.student, a.teacher, a.lengths, a.peak_n = "tiny", "tiny-teacher", [8], 256
    root = Path(__file__).resolve().parents[1]
    print(f"## teacher scoring vs the GRPO training step: {a.student} student, {a.teacher} "
          f"teacher, {a.prompts} x {a.group}, {a.prompt_len}-token prompts, {a.threads} "
          f"thread(s), median of {a.steps} steps\n")
    print("| answer | positions | teacher s | of peak | step s | of peak | teacher / step |")
    print("|---|---|---|---|---|---|---|")
    for length in a.lengths:
        keys = ("student", "teacher", "prompts", "group", "prompt_len", "threads", "steps",
                "warmup", "peak_n")
        cmd = [sys.executable, __file__, "--child", "--length", str(length)] + [
            f"--{k.replace('_', '-')}={getattr(a, k)}" for k in keys]
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), WANDB_MODE="disabled",
                   PYTHONPATH=str(root))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
        r = json.loads(line[7:])
        teacher, step = (statistics.median(r["times"][k]) for k in ("teacher", "step"))
        print(f"| {length} | {r['positions']} | {teacher:.2f} | "
              f"{r['teacher_flops'] / teacher / r['peak']:.0%} | {step:.2f} | "
              f"{r['step_flops'] / step / r['peak']:.0%} | {teacher / step:.2f} |", flush=True)
    print(f"\nteacher {r['teacher_params'] / 1e6:.0f}M parameters, student "
          f"{r['student_params'] / 1e6:.0f}M; matmul peak {r['peak'] / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
