"""GPU check of the SGLang rollout backend against the real SGLang (not collected by pytest: no
test_ prefix).

One command, on a machine with one CUDA GPU and `pip install -e .[gpu]` (sglang):

    python tests/gpu/check_sglang.py --model Qwen/Qwen2.5-0.5B-Instruct [--dataset
    gsm8k_train.jsonl]

It checks, in order, and prints one line each:
1. logprob parity: SGLang's behaviour log-probs of its own samples vs the trainer's recomputation
   (nanoareal.policy_logprobs, bf16, same temperature): mean and max |diff|;
2. weight-sync round trip through the colocated engine (release -> resume weights ->
   update_weights_from_tensor buckets -> resume KV cache -> flush): after perturbing the
   trainer's weights, SGLang's log-probs follow them;
3. a 20-step GRPO run through nanoareal's CLI with `--rollout-backend sglang` on GSM8K-format
   JSONL (a small synthetic file is written when --dataset is not given, so the check runs
   offline). Exits 0 with a "skipped" line when there is no CUDA or no sglang.
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


def trainer_logprobs(model, prompt, completion, temperature):
    import torch

    import nanoareal

    full = prompt + completion.output_ids
    ids = torch.tensor([full], device="cuda")
    pos = torch.arange(len(full), device="cuda")[None]
    tgt = torch.tensor(full[1:] + [0], device="cuda")
    with torch.no_grad():
        lp, _ = nanoareal.policy_logprobs(model, ids, pos, tgt, temperature)
    return lp[len(prompt) - 1 : len(full) - 1].float().cpu()


def parity(engine, model, prompts, temperature, seeds):
    import torch

    from rollout import SamplingParams

    outs = engine.generate(prompts, SamplingParams(128, temperature), seeds)
    diffs = torch.cat([(trainer_logprobs(model, p, c, temperature) - torch.tensor(c.logprobs)).abs()
                       for p, c in zip(prompts, outs)])
    return float(diffs.mean()), float(diffs.max()), int(diffs.numel())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-0.5B-Instruct")
    ap.add_argument("--dataset", default=None,
                    help="GSM8K-format JSONL ({prompt|messages, answer})")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--run-dir", default="runs/check_sglang")
    args = ap.parse_args()
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

    from rollout import SGLangEngine

    model_dir = args.model if os.path.isdir(args.model) else snapshot_download(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is 17 * 23?", "Name three prime numbers above 50.",
                 "Explain GRPO in one sentence.",
                 "Write a haiku about GPUs."]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                     tokenize=False)
             for q in questions]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    seeds = list(range(len(prompts)))

    # the engine first: SGLang sizes its KV cache from the free memory at start
    engine = SGLangEngine(model_dir, gpu_id=0, mem_fraction=0.4, bucket_mb=256, device="cuda")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ok = True
    for t in (1.0, 0.7):
        mean, mx, n = parity(engine, model, prompts, t, seeds)
        print(f"[1] logprob parity T={t}: mean |diff| {mean:.4f}, max |diff| {mx:.4f} over {n} "
              "tokens")
        ok &= mean < 0.05

    with torch.no_grad():  # a visible change: noise on every weight matrix
        g = torch.Generator(device="cuda").manual_seed(0)
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=g, device="cuda",
                                   dtype=torch.float32).to(p.dtype) * 2e-3)
    stale_mean, _, _ = parity(engine, model, prompts, 1.0, seeds)
    engine.release_memory()
    engine.resume_memory()
    engine.update_weights(model)
    mean, mx, n = parity(engine, model, prompts, 1.0, seeds)
    print(f"[2] weight sync: before sync mean |diff| {stale_mean:.4f}; after: mean {mean:.4f}, max "
          f"{mx:.4f}")
    ok &= mean < 0.05 and mean < stale_mean
    engine.shutdown()
    del model
    torch.cuda.empty_cache()

    os.makedirs(os.path.dirname(os.path.abspath(args.run_dir)), exist_ok=True)
    data = args.dataset or synthetic_gsm8k(args.run_dir + "_data.jsonl")
    cmd = [sys.executable, os.path.join(ROOT, "nanoareal.py"), "--rollout-backend", "sglang",
           "--model", model_dir,
           "--dataset", data, "--reward", "gsm8k", "--chat-template", "--steps", str(args.steps),
           "--prompts-per-step", "16", "--group-size", "8", "--max-new-tokens", "256",
           "--eval-every", "0", "--run-dir", args.run_dir, "--lr", "1e-6"]
    print("[3] " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT)
    rows = []
    metrics = os.path.join(args.run_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        rows = [json.loads(line) for line in open(metrics) if "reward" in line]
    print(f"[3] {args.steps}-step run: exit {r.returncode}, {len(rows)} steps logged, "
          f"reward first/last {rows[0]['reward'] if rows else float('nan'):.3f}/"
          f"{rows[-1]['reward'] if rows else float('nan'):.3f}")
    ok &= r.returncode == 0 and len(rows) == args.steps
    print("check_sglang: " + ("OK" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
