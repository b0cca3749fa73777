"""docs/gpu.md's table of what fits, computed by the trainer's own `modeling.memory_plan`.

    python scripts/memory_table.py            # print the table
    python scripts/memory_table.py --write    # rewrite it in docs/gpu.md (between its markers)

tests/test_memory.py fails when docs/gpu.md's table differs from this output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import modeling  # noqa: E402
from rollout import SGLANG_MEM_FRACTION  # noqa: E402

DOC = ROOT / "docs" / "gpu.md"
BEGIN, END = "<!-- memory table: scripts/memory_table.py -->", "<!-- end of memory table -->"
TOKENS = 16384  # the micro-batch the activation columns show
LORA_RANK = 8  # the LoRA rows' --lora-rank (the adapters are ~0.3% of a 7B model: r barely matters)
GIB = 2**30
# name: (layers, hidden, intermediate, query heads, kv heads, head dim, vocab, tied, qkv bias)
MODELS = {"Qwen2.5-0.5B": (24, 896, 4864, 14, 2, 64, 151936, True, True),
          "Qwen2.5-1.5B": (28, 1536, 8960, 12, 2, 128, 151936, True, True),
          "Qwen2.5-7B": (28, 3584, 18944, 28, 4, 128, 152064, False, True),
          "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128, 128256, False, False)}


def parameters(layers, hidden, inter, heads, kv, head_dim, vocab, tied, bias) -> int:
    """A Llama/Qwen2 decoder's parameter count: attention, SwiGLU MLP, two norms a layer."""
    attn = hidden * heads * head_dim * 2 + 2 * hidden * kv * head_dim
    attn += (heads + 2 * kv) * head_dim if bias else 0
    return layers * (attn + 3 * hidden * inter + 2 * hidden) + vocab * hidden * (1 + (not tied)) \
        + hidden


def lora_parameters(rank, layers, hidden, inter, heads, kv, head_dim, *_) -> int:
    """LoRA's adapters on every linear layer of the decoder: r x (in + out) each."""
    q, k = heads * head_dim, kv * head_dim
    return rank * layers * (2 * (hidden + q) + 2 * (hidden + k) + 3 * (hidden + inter))


def plan(shape: tuple, world: int, tokens: int, checkpointing: bool, gpu_gib: float = 0,
         grads_unsharded: bool = False, lora: int = 0) -> dict[str, float]:
    """The trainer's plan in bf16 compute (fp32 master weights); `checkpointing`: every layer
    ("full") or none; `lora`: rank of adapters on a bf16 base (frozen, no master copy). The
    in-process engine holds its share of the GPU while it generates, nothing while released."""
    layers, hidden, inter, _, kv, head_dim, vocab, tied, _ = shape
    n = parameters(*shape)
    trainable = lora_parameters(lora, *shape) if lora else n
    model = modeling.Shape(n + trainable * (lora > 0), trainable, layers, hidden, inter,
                           kv * head_dim, vocab, tied=tied, master_bytes=4, frozen_bytes=2,
                           compute_bytes=2)
    return modeling.memory_plan(model, world, tokens, "full" if checkpointing else "",
                                engine=(SGLANG_MEM_FRACTION * gpu_gib * GIB, 0.0),
                                grads_unsharded=grads_unsharded)


def largest_fit(shape: tuple, world: int, gpu_gib: float, lora: int = 0) -> str:
    """The largest power-of-two --micro-batch-tokens (1k to 128k) that fits, checkpointed, with
    gradients reduce-scattered every micro-batch (the trainer defers them only where that fits)."""
    fits = [t for t in (2**k for k in range(10, 18))
            if plan(shape, world, t, True, gpu_gib, lora=lora)["total"] <= gpu_gib * GIB]
    return "no" if not fits else f"{fits[-1] // 1024}k" + ("+" if fits[-1] == 2**17 else "")


def table() -> str:
    gib = lambda b: f"{b / GIB:.1f}"
    rows = ["| model | params | GPUs | weights + grads + AdamW | activations at 16k tokens, "
            "checkpointed (not) | 80 GiB | 141 GiB |", "|---|---|---|---|---|---|---|"]
    for name, shape in MODELS.items():
        for world, lora in ((1, 0), (8, 0), (1, LORA_RANK)):
            p, raw = (plan(shape, world, TOKENS, ck, lora=lora) for ck in (True, False))
            state = p["weights"] + p["grads"] + p["adamw"]
            rows.append(f"| {name}{f' LoRA r={lora}' if lora else ''} | "
                        f"{parameters(*shape) / 1e9:.2f}B | {world} | {gib(state)} | "
                        f"{gib(p['activations'])} ({gib(raw['activations'])}) | "
                        f"{largest_fit(shape, world, 80, lora)} | "
                        f"{largest_fit(shape, world, 141, lora)} |")
    return "\n".join(rows) + "\n"


def document() -> str:
    text = DOC.read_text()
    head, rest = text.split(BEGIN + "\n", 1)
    return head + BEGIN + "\n" + table() + END + rest.split(END, 1)[1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table in docs/gpu.md")
    if ap.parse_args().write:
        DOC.write_text(document())
    else:
        print(table(), end="")
