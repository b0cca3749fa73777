"""GPU check of the SGLang rollout backend against the real SGLang (not collected by pytest: no
test_ prefix; tests/test_gpu_scripts.py runs its CPU-safe parts).

One command, on a machine with one CUDA GPU and `pip install -e .[gpu]` (sglang):

    python tests/gpu/check_sglang.py --model Qwen/Qwen2.5-0.5B-Instruct [--dataset train.jsonl]

It prints one line per check:
1. logprob parity: SGLang's behaviour log-probs of its own samples against the trainer's
   recomputation (modeling.policy_logprobs, bf16, same temperature): mean and max |diff|;
2. weight-sync round trip through the colocated engine (release -> resume weights ->
   update_weights_from_tensor buckets -> resume KV cache -> flush): after the trainer's weights
   are perturbed, SGLang's log-probs follow them;
3. a GRPO run through nanoareal's CLI with `--rollout-backend sglang` on GSM8K-format JSONL (a
   small synthetic file is written without --dataset, so the check runs offline).
Exits 0 with a "skipped" line when there is no CUDA or no sglang.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def synthetic_gsm8k(path: str, n: int = 512) -> str:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
            q = (f"Tom has {a} apples. He buys {b} more and then gives away {c}. How many apples "
                 "does he have now?")
            f.write(json.dumps({"prompt": q + " End with '#### <number>'.",
                                "answer": f"#### {a + b - c}"}) + "\n")
    return path


def grpo_command(model_dir: str, data: str, steps: int, run_dir: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "nanoareal.py"), "--rollout-backend", "sglang",
            "--model", model_dir, "--dataset", data, "--reward", "gsm8k", "--chat-template",
            "--steps", str(steps), "--prompts-per-step", "16", "--group-size", "8",
            "--max-new-tokens", "256", "--eval-every", "0", "--run-dir", run_dir, "--lr", "1e-6"]


def trainer_model(module):
    """An HF `module` as the trainer runs it, a modeling.Model: packed rows, on the attention path
    and kernel the trainer picks on this device."""
    from transformers import AttentionInterface

    import attention
    import modeling

    AttentionInterface.register("packed", attention.packed_attention)
    module.set_attn_implementation("packed")
    device = next(module.parameters()).device
    path, kernel, _ = attention.choose_attention("auto", device, module.dtype in modeling.HALF,
                                                 softcap=False)
    return modeling.Model(module.eval(), device, path, kernel)


def trainer_logprobs(model, prompt: list[int], completion, temperature: float):
    """The trainer's log-probs of a completion's tokens (modeling.policy_logprobs on the row's
    layout for the model's kernel)."""
    import torch

    import attention
    import modeling

    full = prompt + completion.output_ids
    positions = torch.arange(len(full))
    layout = attention.attention_layout(attention.segments_from_positions(positions), len(full),
                                        model.device, model.kernel)
    with torch.no_grad():
        lp, _ = modeling.policy_logprobs(model.module, torch.tensor([full], device=model.device),
                                         positions.to(model.device)[None],
                                         torch.tensor(full[1:] + [0], device=model.device),
                                         temperature, layout=layout)
    return lp[len(prompt) - 1 : len(full) - 1].float().cpu()


def parity(engine, model, prompts, temperature, seeds, max_new_tokens: int = 128):
    """(mean |diff|, max |diff|, tokens) between the engine's log-probs and the trainer's."""
    import torch

    from rollout import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_new_tokens, temperature), seeds)
    diffs = torch.cat([(trainer_logprobs(model, p, c, temperature) - torch.tensor(c.logprobs)).abs()
                       for p, c in zip(prompts, outs)])
    return float(diffs.mean()), float(diffs.max()), int(diffs.numel())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    ap.add_argument("--dataset", default=None, help="GSM8K-format JSONL ({prompt, answer} rows)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-dir", default="runs/check_sglang")
    args = ap.parse_args(argv)
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("no CUDA device")
        import sglang  # noqa: F401
    except ImportError as e:
        print(f"check_sglang: skipped ({e})")
        return 0

    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout

    model_dir = args.model if os.path.isdir(args.model) else snapshot_download(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 17 * 23?", "Name three prime numbers above 50.",
                 "Explain GRPO in one sentence.", "Write a haiku about GPUs."]
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for q in questions]
    seeds = list(range(len(prompts)))

    # the engine first: SGLang sizes its KV cache from the free memory at start; it starts
    # released, holding no weights (version -1): the trainer's are pushed before it generates
    rollout.SYNC_BUCKET_MB = 256
    engine = rollout.SGLangEngine(model_dir, device="cuda", mem_fraction_static=0.4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    model = trainer_model(model)
    engine.update_weights(model.module, 0)
    ok = True
    for t in (1.0, 0.7):
        mean, mx, n = parity(engine, model, prompts, t, seeds)
        print(f"[1] logprob parity T={t}: mean |diff| {mean:.4f}, max |diff| {mx:.4f} over {n} "
              "tokens")
        ok &= mean < 0.05

    with torch.no_grad():  # a visible change: noise on every weight matrix
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in model.module.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, device="cuda",
                                   dtype=torch.float32).to(p.dtype) * 2e-3)
    stale_mean, _, _ = parity(engine, model, prompts, 1.0, seeds)
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights(model.module, 1)
    mean, mx, n = parity(engine, model, prompts, 1.0, seeds)
    print(f"[2] weight sync: before sync mean |diff| {stale_mean:.4f}; after: mean {mean:.4f}, max "
          f"{mx:.4f}")
    ok &= mean < 0.05 and mean < stale_mean
    engine.shutdown()
    del model
    torch.cuda.empty_cache()

    os.makedirs(os.path.dirname(os.path.abspath(args.run_dir)), exist_ok=True)
    data = args.dataset or synthetic_gsm8k(args.run_dir + "_data.jsonl")
    cmd = grpo_command(model_dir, data, args.steps, args.run_dir)
    print("[3] " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT)
    metrics = os.path.join(args.run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics) if "reward" in line] \
        if os.path.exists(metrics) else []
    nan = float("nan")
    print(f"[3] {args.steps}-step run: exit {r.returncode}, {len(rows)} steps logged, reward "
          f"first/last {rows[0]['reward'] if rows else nan:.3f}/"
          f"{rows[-1]['reward'] if rows else nan:.3f}")
    ok &= r.returncode == 0 and len(rows) == args.steps
    print("check_sglang: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
