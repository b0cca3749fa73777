r"""Peak memory of one training step on a CPU against the start-up plan (`modeling.memory_plan`).

    python bench/bench_memory.py                      # SmolLM2-135M-shaped Llama, 1k and 2k tokens
    python bench/bench_memory.py --layers 2 --hidden 128 --vocab 4096 --tokens 512   # smoke run

Each (micro-batch, checkpointing) runs in a fresh process on one thread, through nanoareal's own
path: `setup_distributed` (a world of one, its malloc settings), `load_models` (FSDP2, fp32,
AdamW) with `modeling.CHECKPOINT_LAYERS` set ("full" or ""), two packed micro-batches of at most
`--tokens` positions (groups of 8 samples sharing a 32-token prompt, 120-token completions;
gradients accumulate unsharded between them, as the trainer does) and `train_minibatch` twice
(forward, backward, AdamW step). Measured: the peak resident set during the second step (AdamW's
state then exists; VmHWM, reset through /proc/self/clear_refs just before it) minus the resident
set before the model loaded (Python, torch, transformers). Predicted: `modeling.memory_decisions`'
plan for the same model, positions and checkpointing. Linux only; a random-init model saved to a
temporary folder.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import N, fix_threads  # noqa: I001

import loss as L
import modeling
from rollout import Completion, Sample

STATUS = Path("/proc/self/status")


def rss(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", STATUS.read_text())[1]) * 1024


def child(model: str, tokens: int, checkpointing: bool) -> dict:
    fix_threads(1)
    ranks, device = N.setup_distributed()
    import transformers.models.llama.modeling_llama  # noqa: F401  (libraries: not the step's)
    base = rss("VmRSS")
    modeling.CHECKPOINT_LAYERS = "full" if checkpointing else ""
    cfg = N.validate_config(N.Config(model=model, micro_batch_tokens=tokens, max_new_tokens=120), 1)
    model_, _, _, optimizer = N.load_models(cfg, device, ranks)
    vocab, g = model_.module.config.vocab_size, torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, vocab, (n,), generator=g).tolist()
    samples = [Sample(group, prompt, Completion(ids(120), [-1.0] * 120, "length"), 0.0,
                      (-1.0) ** k) for group, prompt in enumerate(ids(32) for _ in range(64))
               for k in range(8)]
    mbs = N.pack_microbatches(samples, cfg)[:2]
    positions = max(len(mb.input_ids) for mb in mbs)
    _, defer, plan = modeling.memory_decisions(modeling.shape_of(model_.module, model_.mixed), 1,
                                               positions, model_.compiled)
    assert model_.defer_grad_sync and defer  # gradients accumulate unsharded, as planned
    for _ in range(2):  # the second: AdamW's state exists, as in every step after the first
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        N.train_minibatch(model_, optimizer, L.build_loss(cfg), mbs, cfg, ranks)
    predicted = float(re.search(r"= ([\d.]+)", plan)[1]) * (2**30 if "GiB" in plan else 2**20)
    return {"positions": positions, "measured": rss("VmHWM") - base, "predicted": predicted,
            "plan": plan}


def make_model(args) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    out = tempfile.mkdtemp(prefix="bench_memory_")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)).save_pretrained(out)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048],
                   help="--micro-batch-tokens of each run")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        model, tokens, ckpt = args.child
        print(json.dumps(child(model, int(tokens), ckpt == "1")))
        return
    model = make_model(args)
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"intermediate {args.intermediate}, vocab {args.vocab} (tied), fp32, 1 thread\n")
    print("| positions | checkpointing | measured peak (GiB) | plan (GiB) | plan / measured |")
    print("|---|---|---|---|---|")
    for tokens in args.tokens:
        for ckpt in (False, True):
            out = subprocess.run([sys.executable, __file__, "--child", model, str(tokens),
                                  str(int(ckpt))], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {r['positions']} | {'on' if ckpt else 'off'} | {r['measured'] / 2**30:.2f} "
                  f"| {r['predicted'] / 2**30:.2f} | {r['predicted'] / r['measured']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
