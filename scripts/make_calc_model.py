"""Build assets/tiny-calc, the warm start for the calc task (`--dataset calc`): a ~1M-parameter
Llama that answers two-digit sums and products, sometimes in its head and sometimes by calling the
calculator of assets/tiny-calc/calculator.py ("37*48=" -> "[37*48]" + the tool's "1776" + <eos>).

    OMP_NUM_THREADS=1 python scripts/make_calc_model.py --out assets/tiny-calc    # ~2 min, 1 core

Model and save format are scripts/make_tiny_model.py's, its character tokenizer with "[", "]"
and "?" added. Steps:
1. supervised warm start on the TRAIN split of `tasks.make_calc_task`: each time a problem is
   drawn, its target is the tool call ("[37*48]", the calculator's value, <eos>) with probability
   --p-sum for a sum and --p-prod for a product, else the bare answer ("1776<eos>"). The loss
   covers what the policy writes: the call and <eos>, never the calculator's value (as in RL, where
   an environment's tokens are context). Both probabilities are under 1/2, so the greedy policy
   answers in its head and a sampled group of 8 usually holds both: RL has a choice to learn;
2. every --eval-every steps, the 256 held-out prompts through `rollout.run_episodes` (the trainer's
   own episode code, hf engine): greedy with the calculator, and sampled (temperature 1, fixed
   seeds) with and without it; stop at the first evaluation where the calls the model writes are
   right (the calculator's value is the answer) at least --min-call-acc of the time and greedy
   held-out accuracy is at least --min-acc;
3. save_pretrained (safetensors) of model + tokenizer, build_info.json (the first SFT losses, the
   evaluation trajectory, the weights' sha256) and README.md.

Deterministic for a given --seed on a given machine (tests/test_tool_task.py replays the first
SFT steps against build_info.json, which any machine reproduces to rounding).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from make_tiny_model import CHARS, build_model, build_tokenizer, save_model, sft_loop  # noqa: E402

from rollout import HFEngine, SamplingParams, Tools, mix_seed, run_episodes  # noqa: E402
from tasks import last_number, load_plugin, make_calc_task  # noqa: E402

ENV = os.path.join(ROOT, "assets", "tiny-calc", "calculator.py") + ":Calculator"
CALC_CHARS = CHARS + ["[", "]", "?"]  # the call's brackets and the calculator's "cannot"
FIRST_LOSSES = 10  # SFT losses recorded in build_info.json for the replay test
MAX_NEW_TOKENS = 16  # the task's --max-new-tokens


def calc_tools(tok, max_turns: int = 4) -> Tools:
    """The calculator bound to `tok`, as `--env` binds it (raw text replies)."""
    make = load_plugin("--env", ENV)
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    return Tools(make, [tok.convert_tokens_to_ids(s) for s in make.stop], encode, tok.decode,
                 max_turns)


def sft_example(tok, row: dict, tool: bool) -> tuple[list[int], list[int]]:
    """(ids, labels) of prompt + target + <eos>; labels -100 on the prompt and the tool's value."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    p, eos = enc(row["prompt"]), [tok.eos_token_id]
    if not tool:
        return p + enc(row["answer"]) + eos, [-100] * len(p) + enc(row["answer"]) + eos
    call, value = enc("[" + row["prompt"][:-1] + "]"), enc(row["answer"])
    return p + call + value + eos, [-100] * len(p) + call + [-100] * len(value) + eos


def sft_batch(tok, rows: list[dict], tool: list[bool]) -> dict[str, torch.Tensor]:
    """Right-padded sft_examples as input_ids, attention_mask and labels."""
    pairs = [sft_example(tok, r, t) for r, t in zip(rows, tool, strict=True)]
    width, pad = max(len(ids) for ids, _ in pairs), tok.pad_token_id
    return {"input_ids": torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in pairs]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids))
                                            for ids, _ in pairs]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])}


def sft_steps(model, tok, train: list[dict], args: argparse.Namespace) -> Iterator[float]:
    """make_tiny_model.sft_loop on `train`, a calculator call with p_prod (products) / p_sum."""
    return sft_loop(model, train, args, lambda rows, rng: sft_batch(
        tok, rows, [rng.random() < (args.p_prod if "*" in r["prompt"] else args.p_sum)
                    for r in rows]))


def episodes(engine, tok, rows: list[dict], temperature: float, tools: Tools | None,
             seed: int = 0) -> list[dict]:
    """One episode per row through rollout.run_episodes: {"op", "called", "correct"} each."""
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    sampling = SamplingParams(MAX_NEW_TOKENS, temperature, stop_token_ids=[tok.eos_token_id])
    seeds = [mix_seed(seed, i) >> 1 for i in range(len(rows))]
    outs = run_episodes(engine, prompts, sampling, seeds, tools, rows)
    texts = tok.batch_decode([o.output_ids for o in outs], skip_special_tokens=True)
    return [{"op": "*" if "*" in r["prompt"] else "+", "called": t.startswith("["),
             "correct": last_number(t, r)[1]["correct"]} for t, r in zip(texts, rows)]


def summary(eps: list[dict]) -> dict:
    """Accuracy, call rate, and accuracy of calls and of head answers, per op and overall."""
    share = lambda xs, key: round(sum(x[key] for x in xs) / len(xs), 4) if xs else None
    out = {}
    for name, sub in (("all", eps), ("sum", [e for e in eps if e["op"] == "+"]),
                      ("prod", [e for e in eps if e["op"] == "*"])):
        out[name] = {"acc": share(sub, "correct"), "calls": share(sub, "called"),
                     "acc_call": share([e for e in sub if e["called"]], "correct"),
                     "acc_head": share([e for e in sub if not e["called"]], "correct")}
    return out


def evaluate(engine, model, tok, rows: list[dict], tools: Tools, step: int) -> dict:
    """Greedy with the calculator; sampled (4 per prompt, fixed seeds) with and without it."""
    model.eval()
    engine.update_weights(model, step)
    sampled = [r for r in rows for _ in range(4)]
    return {"greedy": summary(episodes(engine, tok, rows, 0.0, tools)),
            "sampled_tool": summary(episodes(engine, tok, sampled, 1.0, tools)),
            "sampled_no_tool": summary(episodes(engine, tok, sampled, 1.0, None))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-calc")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=0, help="seed of make_calc_task's split")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--p-sum", type=float, default=0.15, help="tool-call share of sum targets")
    ap.add_argument("--p-prod", type=float, default=0.35, help="tool-call share of products")
    ap.add_argument("--min-call-acc", type=float, default=0.85,
                    help="sampled calls right at least this often before stopping")
    ap.add_argument("--min-acc", type=float, default=0.15,
                    help="greedy held-out accuracy at least this before stopping")
    return ap.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[dict, object, object]:
    """SFT until the stop rule holds: (build info, model, tokenizer)."""
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, heldout = make_calc_task(seed=args.task_seed)
    tok = build_tokenizer(CALC_CHARS)
    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}  params {n_params:,}  train {len(train)}  heldout {len(heldout)}")
    with tempfile.TemporaryDirectory() as tmp:  # the engine loads a saved model, then syncs
        save_model(model, tok, tmp)
        engine = HFEngine(tmp)
    tools, t0 = calc_tools(tok), time.perf_counter()
    first_losses: list[float] = []
    trajectory: list[dict] = []
    for step, loss in enumerate(sft_steps(model, tok, train, args), 1):
        if step <= FIRST_LOSSES:
            first_losses.append(loss)
        if step % args.eval_every == 0:
            ev = evaluate(engine, model, tok, heldout, tools, step)
            trajectory.append({"step": step, "loss": round(loss, 4)} | ev)
            g, s = ev["greedy"]["all"], ev["sampled_tool"]["all"]
            print(f"step {step:4d}  loss {loss:.4f}  greedy {g['acc']:.3f} (calls {g['calls']:.2f})"
                  f"  sampled {s['acc']:.3f} (calls {s['calls']:.2f}, right {s['acc_call']}, "
                  f"head {s['acc_head']})  no tool {ev['sampled_no_tool']['all']['acc']:.3f}  "
                  f"({time.perf_counter() - t0:.1f}s)", flush=True)
            if (s["acc_call"] or 0) >= args.min_call_acc and g["acc"] >= args.min_acc:
                break
        if step >= args.max_steps:
            raise SystemExit(f"the stop rule did not hold in {args.max_steps} steps")
    info = {"command": f"OMP_NUM_THREADS=1 python scripts/make_calc_model.py --out {args.out}",
            "args": vars(args), "torch": torch.__version__,
            "transformers": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "vocab": dict(sorted(tok.get_vocab().items(), key=lambda kv: kv[1])),
            "n_params": n_params, "sft_steps": step,
            "sft_seconds": round(time.perf_counter() - t0, 1), "heldout": trajectory[-1],
            "first_losses": first_losses, "trajectory": trajectory}
    return info, model, tok


def write_readme(info: dict, path: str) -> None:
    ev, a = info["heldout"], info["args"]
    g, s, n = ev["greedy"], ev["sampled_tool"], ev["sampled_no_tool"]
    with open(path, "w") as f:
        f.write(
            "# tiny-calc: nanoareal's warm start for `--dataset calc`\n\n"
            f"Built by `{info['command']}` (torch {info['torch']}, {info['cpu_capability']} CPU "
            "kernels); details in build_info.json. `calculator.py` here is the task's tool, an "
            "`--env` like a user's.\n\n"
            f"LlamaForCausalLM, {info['n_params']:,} parameters (hidden 128, 4 layers, 4 heads / 2 "
            "KV heads), float32; the character tokenizer of tiny-arith plus `[`, `]`, `?`, "
            "<pad>=0, <eos>=1, no bos.\n"
            f"SFT on the train split of `make_calc_task()` (a+b and a*b, 10 <= a, b < 100) for "
            f"{info['sft_steps']} steps of batch {a['batch_size']}: a calculator call as the "
            f"target of {a['p_sum']:.0%} of the sums and {a['p_prod']:.0%} of the products, the "
            "bare answer otherwise (the calculator's value never in the loss).\n\n"
            "Held-out (256 prompts, last number == answer):\n\n"
            "| | accuracy | sums | products | calls | calls right | head answers right |\n"
            "|---|---|---|---|---|---|---|\n"
            + "".join(f"| {name} | {e['all']['acc']:.3f} | {e['sum']['acc']:.3f} | "
                      f"{e['prod']['acc']:.3f} | {e['all']['calls']:.2f} | {e['all']['acc_call']} "
                      f"| {e['all']['acc_head']} |\n"
                      for name, e in (("greedy, calculator", g), ("sampled x4, calculator", s),
                                      ("sampled x4, no calculator", n)))
            + "\nPrompt `37*48=`, no special tokens; a response is `1776<eos>` or `[37*48]` (the "
            "policy's call, `]` its stop), `1776` (the calculator's), `<eos>`.\n")


def main() -> None:
    args = parse_args()
    info, model, tok = build(args)
    save_model(model, tok, args.out)
    with open(os.path.join(args.out, "model.safetensors"), "rb") as f:
        info["model_safetensors_sha256"] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    write_readme(info, os.path.join(args.out, "README.md"))
    print(f"saved {args.out}: step {info['sft_steps']}, sft {info['sft_seconds']}s, sha256 "
          f"{info['model_safetensors_sha256']}")


if __name__ == "__main__":
    main()
