"""Build assets/tiny-chain, the warm start for the chain task (`--dataset chain`): a ~1M-parameter
Llama that answers short chains with the bare digit and long ones with a scratchpad of running
values, and gets about a third of the held-out problems right.

    OMP_NUM_THREADS=1 python scripts/make_chain_model.py --out assets/tiny-chain    # ~90 s, 1 core

Model, tokenizer and save format are scripts/make_tiny_model.py's (imported from it). Steps:
1. supervised warm start on the TRAIN split of `tasks.make_chain_task`: each time a problem with k
   operations is drawn, its target is the scratchpad ("3 7 4<eos>") with probability
   p(k) = p_min + (p_max - p_min) (k - 1) / 7, else the bare answer ("4<eos>"); loss on the
   response and <eos> only. The mix depends on k so that the greedy format depends on the problem
   (with one constant mix it is a global coin flip that changes between evaluations) and a GRPO
   group of 8 samples usually holds both formats;
2. every --eval-every steps, greedy decoding of the 256 held-out prompts; stop at the first
   evaluation whose accuracy lies in [--stop-low, --stop-high] once the greedy scratchpads are
   right step by step (value j right given value j-1 right) at least --min-step-acc of the time:
   the scratchpad is then worth choosing, and GRPO has room to learn to choose it;
3. save_pretrained (safetensors) of model + tokenizer, build_info.json (the first SFT losses, the
   evaluation trajectory, the final evaluation, the weights' sha256) and README.md.

Deterministic for a given --seed on a given machine: a rebuild writes a byte-identical
model.safetensors. torch's CPU kernels round differently on other instruction sets, so another
CPU may drift late in training and stop at another step; tests/test_chain_task.py replays the
first SFT steps against build_info.json, which any machine reproduces to rounding.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from make_tiny_model import (  # noqa: E402
    build_model,
    build_tokenizer,
    greedy_complete,
    save_model,
    sft_loop,
)

from tasks import (  # noqa: E402
    CHAIN_MAX_OPS,
    chain_scratchpad,
    chain_values,
    last_number,
    make_chain_task,
)

FIRST_LOSSES = 10  # SFT losses recorded in build_info.json for the replay test


def num_ops(prompt: str) -> int:
    """k, the number of operations of a chain prompt."""
    return len(chain_values(prompt)) - 1


def p_scratch(k: int, args: argparse.Namespace) -> float:
    """Probability that a drawn problem with k operations gets the scratchpad target."""
    return args.p_min + (args.p_max - args.p_min) * (k - 1) / (CHAIN_MAX_OPS - 1)


def sft_batch(tok, rows: list[dict], scratch: list[bool]) -> dict[str, torch.Tensor]:
    """Right-padded "prompt + target<eos>" rows; labels are -100 on the prompt and the padding."""
    ids, labels = [], []
    for row, s in zip(rows, scratch, strict=True):
        p = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        target = chain_scratchpad(row["prompt"]) if s else row["answer"]
        a = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids.append(p + a)
        labels.append([-100] * len(p) + a)
    width, pad = max(map(len, ids)), tok.pad_token_id
    return {"input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in ids]),
            "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])}


def sft_steps(model, tok, train: list[dict], args: argparse.Namespace) -> Iterator[float]:
    """make_tiny_model.sft_loop on `train`, a scratchpad target with p_scratch(ops)."""
    return sft_loop(model, train, args, lambda rows, rng: sft_batch(
        tok, rows, [rng.random() < p_scratch(num_ops(r["prompt"]), args) for r in rows]))


def step_accuracy(completion: str, prompt: str) -> tuple[int, int]:
    """(right, judged) scratchpad steps: value j is judged when values 0..j-1 were right, so one
    slip is counted once; a bare answer has no steps."""
    got, want = completion.split(), chain_values(prompt)
    right = judged = 0
    if len(got) < 2:
        return 0, 0
    for j in range(1, min(len(got), len(want))):
        if got[j - 1] != str(want[j - 1]):
            break
        judged += 1
        right += got[j] == str(want[j])
    return right, judged


def evaluate(model, tok, rows: list[dict]) -> dict:
    """Greedy held-out statistics: accuracy (the `last_number` reward), the share of scratchpads
    and the accuracy of each format, per-step scratchpad accuracy, response lengths in tokens
    (characters + <eos>) and accuracy by k."""
    model.eval()
    comps = greedy_complete(model, tok, [r["prompt"] for r in rows], max_new_tokens=32,
                            kv_cache=True)
    scores = [last_number(c, r) for c, r in zip(comps, rows, strict=True)]
    ok = [s[1]["correct"] for s in scores]
    scr = [bool(s[1]["scratchpad"]) for s in scores]
    lens = [len(c) + 1 for c in comps]
    steps = [step_accuracy(c, r["prompt"]) for c, r in zip(comps, rows)]
    by_k: dict[int, list[bool]] = {}
    for c, r in zip(ok, rows):
        by_k.setdefault(num_ops(r["prompt"]), []).append(c)
    n, n_scr = len(rows), sum(scr)
    mean_len = sum(lens) / n
    return {
        "acc": sum(ok) / n,
        "scratch_frac": n_scr / n,
        "acc_scratch": round(sum(c for c, s in zip(ok, scr) if s) / max(n_scr, 1), 4),
        "acc_direct": round(sum(c for c, s in zip(ok, scr) if not s) / max(n - n_scr, 1), 4),
        "step_acc": round(sum(s[0] for s in steps) / max(sum(s[1] for s in steps), 1), 4),
        "len_mean": round(mean_len, 3),
        "len_std": round((sum((x - mean_len) ** 2 for x in lens) / n) ** 0.5, 3),
        "len_min": min(lens),
        "len_max": max(lens),
        "acc_by_k": {k: round(sum(v) / len(v), 3) for k, v in sorted(by_k.items())},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-chain")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=0, help="seed of make_chain_task's split")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--p-min", type=float, default=0.1, help="scratchpad share of the SFT "
                    "targets for 1 operation (rising linearly to --p-max for 8)")
    ap.add_argument("--p-max", type=float, default=0.9)
    ap.add_argument("--stop-low", type=float, default=0.25,
                    help="stop at the first eval in [low, high] (and --min-step-acc)")
    ap.add_argument("--stop-high", type=float, default=0.45)
    ap.add_argument("--min-step-acc", type=float, default=0.75,
                    help="greedy per-step scratchpad accuracy required before stopping")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, heldout = make_chain_task(seed=args.task_seed)
    tok = build_tokenizer()
    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}  params {n_params:,}  train {len(train)}  heldout {len(heldout)}")

    t0 = time.perf_counter()
    first_losses: list[float] = []
    trajectory: list[dict] = []
    ev: dict = {}
    for step, loss in enumerate(sft_steps(model, tok, train, args), 1):
        if step <= FIRST_LOSSES:
            first_losses.append(loss)
        if step % args.eval_every == 0:
            ev = evaluate(model, tok, heldout)
            trajectory.append({"step": step, "loss": round(loss, 4)} | ev)
            print(f"step {step:4d}  loss {loss:.4f}  heldout {ev['acc']:.3f}  scratch "
                  f"{ev['scratch_frac']:.2f}  step_acc {ev['step_acc']:.3f}  len "
                  f"{ev['len_mean']:.1f}  by k {list(ev['acc_by_k'].values())}  "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
            if ev["step_acc"] >= args.min_step_acc:
                if args.stop_low <= ev["acc"] <= args.stop_high:
                    break
                if ev["acc"] > args.stop_high:
                    raise SystemExit(f"overshot: heldout {ev['acc']:.3f} > {args.stop_high}")
        if step >= args.max_steps:
            raise SystemExit(f"did not stop inside [{args.stop_low}, {args.stop_high}] in "
                             f"{args.max_steps} steps")
    sft_seconds = time.perf_counter() - t0

    save_model(model, tok, args.out)
    with open(os.path.join(args.out, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    info = {
        "command": f"OMP_NUM_THREADS=1 python scripts/make_chain_model.py --out {args.out}",
        "args": vars(args),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "vocab": dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])),  # by id
        "n_params": n_params,
        "sft_steps": step,
        "sft_seconds": round(sft_seconds, 1),
        "heldout_acc": ev["acc"],
        "heldout": ev,
        "first_losses": first_losses,
        "trajectory": trajectory,
        "model_safetensors_sha256": sha,
    }
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    by_k = ", ".join(f"{v:.2f}" for v in ev["acc_by_k"].values())
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(
            "# tiny-chain: nanoareal's warm start for `--dataset chain`\n\n"
            f"Built by `{info['command']}` (torch {torch.__version__}, "
            f"{info['cpu_capability']} CPU kernels); details in build_info.json.\n\n"
            f"LlamaForCausalLM, {n_params:,} parameters (hidden 128, 4 layers, 4 heads / 2 KV "
            "heads), float32; the character tokenizer of tiny-arith, <pad>="
            f"{tok.pad_token_id}, <eos>={tok.eos_token_id}, no bos.\n"
            f"SFT on the train split of `make_chain_task()` for {step} steps of batch "
            f"{args.batch_size}: scratchpad targets for {args.p_min:.0%} of 1-operation "
            f"problems rising to {args.p_max:.0%} of 8-operation ones, stopped inside the "
            f"held-out band [{args.stop_low}, {args.stop_high}] once scratchpad steps were "
            f"{args.min_step_acc:.0%} right.\n\n"
            f"Held-out greedy (256 prompts, last number == answer): accuracy {ev['acc']:.3f}, "
            f"by k = 1..8: {by_k}. {ev['scratch_frac']:.0%} of the responses are scratchpads "
            f"(accuracy {ev['acc_scratch']:.2f}, per step {ev['step_acc']:.2f}), the rest bare "
            f"digits (accuracy {ev['acc_direct']:.2f}); response length "
            f"{ev['len_mean']:.1f} ± {ev['len_std']:.1f} tokens ({ev['len_min']} to "
            f"{ev['len_max']}).\n\n"
            "Prompt `3+4*2            =` (18 characters), no special tokens; a response is "
            "`4<eos>` or `3 7 4<eos>`.\n"
        )
    print(f"saved {args.out}: step {step}, heldout {ev['acc']:.3f}, sft {sft_seconds:.1f}s, "
          f"sha256 {sha}")


if __name__ == "__main__":
    main()
