r"""The hf engine's generation at real shapes: its decode loop against an older version's (default:
the commit before the in-place KV cache) and HF `model.generate`, alternating in one process.

    python bench/bench_decode.py                          # SmolLM2-135M shape, 32/128/512 tokens
    python bench/bench_decode.py --model qwen2.5-0.5b --prompts 2
    python bench/bench_decode.py --new-tokens 8 --reps 1 --num-layers 2 --vocab 1024   # smoke

Random-init models of the real dimensions, fp32 on the CPU, `--prompts` prompts x `--samples`
samples (a group's prompt prefilled once by nanoareal, once per row by HF), `--prompt-len` random
prompt ids, every answer run to the length (no stop token; HF gets `min_new_tokens`). Timed: one
`generate` call each. FLOPs per token: 2 * N * rows (N = weights of every decoder matmul + the
head) and the attention's 4 * heads * head_dim * context per row and layer, plus the prefill's
spread over the tokens. "Allowed": the same matmuls timed alone at the decode's shapes ([rows,
d_in] @ [d_in, d_out] for every weight, the attention's batched GEMVs; the prefill's likewise),
so "share" is generation's time against what those shapes allow on this machine and threads.
`decode_time` is a plain function another benchmark can import.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_flops import QWEN25_05B  # noqa: E402

import rollout  # noqa: E402

BASELINE = "9acb01d"  # main before the in-place KV cache and the in-place sampler
SMOLLM2_135M = dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, hidden_act="silu")
SHAPES = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-0.5b": QWEN25_05B}


def build_model(name: str, **overrides) -> str:
    """A random-init model of `name`'s dimensions saved to a temporary directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = tempfile.mkdtemp(prefix=f"bench_decode_{name}_")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**(SHAPES[name] | overrides)))
    model.save_pretrained(out)
    return out


def old_module(name: str, rev: str):
    """`name`.py as it was at `rev`, imported as a module of its own."""
    path = Path(tempfile.mkdtemp(prefix="bench_decode_old_")) / f"{name}_{rev}.py"
    path.write_text(subprocess.run(["git", "show", f"{rev}:{name}.py"], cwd=ROOT, check=True,
                                   capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = sys.modules[path.stem] = importlib.util.module_from_spec(spec)  # dataclasses look
    spec.loader.exec_module(module)
    return module


def old_rollout(rev: str = BASELINE):
    """rollout.py as it was at `rev`, calling that revision's modeling.py (its head's API)."""
    module = old_module("rollout", rev)
    module.modeling = old_module("modeling", rev)
    return module


def batch(vocab: int, prompts: int, samples: int, prompt_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [p for p in (torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
                        for _ in range(prompts)) for _ in range(samples)]


def decode_time(engine, rows: list[list[int]], new_tokens: int, temperature: float = 1.0
                ) -> float:
    """Seconds of one engine.generate of `rows` (every answer `new_tokens` long); an
    rollout.HFEngine of this or an older version, or HF generate through `HFGenerate`."""
    t = time.perf_counter()
    out = engine.generate(rows, rollout.SamplingParams(new_tokens, temperature),
                          list(range(len(rows))))
    seconds = time.perf_counter() - t
    assert all(len(c.output_ids) == new_tokens for c in out), "an answer stopped early"
    return seconds


class HFGenerate:
    """`model.generate` (sampling, no stop before `new_tokens`) behind the engine's call."""

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def generate(self, rows, sampling, seeds):
        ids = torch.tensor(rows)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                  temperature=sampling.temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=sampling.max_new_tokens,
                                  min_new_tokens=sampling.max_new_tokens, pad_token_id=0)
        return [rollout.Completion(r[ids.shape[1]:], [], "length") for r in out.tolist()]


def _timed(fn, reps: int = 5) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


@torch.inference_mode()
def allowed(model, rows: int, context: float) -> tuple[float, float, float]:
    """(matmul FLOPs, attention FLOPs, seconds) of one decode token of `rows` rows at mean
    `context` positions, the seconds those shapes take timed alone."""
    cfg = model.config.get_text_config()
    shapes = [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    seconds = 0.0
    for shape in set(shapes):
        x, w = torch.randn(rows, shape[1]), torch.randn(shape[1], shape[0])
        seconds += shapes.count(shape) * _timed(lambda x=x, w=w: x @ w)
    q = torch.randn(rows * kv, heads // kv, dim)
    k = torch.randn(rows * kv, dim, int(context))
    seconds += cfg.num_hidden_layers * 2 * _timed(lambda: torch.bmm(q, k))  # QK^T and PV
    flops = 2 * rows * sum(a * b for a, b in shapes)
    return flops, 4 * rows * heads * dim * context * cfg.num_hidden_layers, seconds


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--new-tokens", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="alternating rounds per length")
    p.add_argument("--baseline", default=BASELINE, help="the older rollout.py's git revision")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers (smoke runs)")
    p.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (smoke runs)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    over = {k: v for k, v in (("num_hidden_layers", args.num_layers),
                              ("vocab_size", args.vocab)) if v}
    path = build_model(args.model, **over)
    engines = {"nanoareal (this)": rollout.HFEngine(path),
               f"nanoareal {args.baseline}": old_rollout(args.baseline).HFEngine(path)}
    engines["HF generate"] = HFGenerate(engines["nanoareal (this)"].model)
    model = engines["nanoareal (this)"].model
    rows = batch(model.config.vocab_size, args.prompts, args.samples, args.prompt_len)
    print(f"{args.model}{over or ''}, {len(rows)} rows ({args.prompts} prompts x "
          f"{args.samples}), {args.prompt_len}-token prompts, fp32, {args.threads} threads")
    for engine in engines.values():
        decode_time(engine, rows, 2)  # warm-up
    print("| new tokens | engine | seconds (median, min-max) | tokens/s | GFLOP/s | "
          "share of allowed |\n|---|---|---|---|---|---|")
    for n in args.new_tokens:
        times = {name: [] for name in engines}
        for _ in range(args.reps):
            for name, engine in engines.items():
                times[name].append(decode_time(engine, rows, n))
                print(f"  {n} tokens, {name}: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
        mm, attn, per_token = allowed(model, len(rows), args.prompt_len + n / 2)
        pre = allowed(model, args.prompts * args.prompt_len, args.prompt_len / 2)
        mm, attn, per_token = mm + pre[0] / n, attn + pre[1] / n, per_token + pre[2] / n
        for name, ts in times.items():
            s = statistics.median(ts)
            print(f"| {n} | {name} | {s:.2f} ({min(ts):.2f}-{max(ts):.2f}) | "
                  f"{len(rows) * n / s:.1f} | {(mm + attn) * n / s / 1e9:.1f} | "
                  f"{per_token * n / s:.0%} |", flush=True)
        print(f"| {n} | allowed: the token's matmul shapes alone | {per_token * n:.2f} | "
              f"{len(rows) / per_token:.1f} | {(mm + attn) / per_token / 1e9:.1f} | 100% |",
              flush=True)


if __name__ == "__main__":
    main()
