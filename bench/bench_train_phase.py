r"""The training phase (`nanoareal.train_on_samples`) at real model shapes: time per batch, achieved
FLOP/s against the measured matmul peak, and peak resident memory, one child process per run.

    python bench/bench_train_phase.py                        # SmolLM2-135M shape, 32/128/512 tokens
    python bench/bench_train_phase.py --shape qwen2.5-0.5b --lengths 64 --prompts 2
    python bench/bench_train_phase.py --roots /tmp/base .    # two checkouts, runs alternating
    python bench/bench_train_phase.py --lengths 512 --uneven # answers of 64-512 tokens
    python bench/bench_train_phase.py --tiny --steps 1 --warmup 0     # smoke run

Each run is a fresh child process (`--child`) that imports nanoareal from one `--roots` checkout,
builds a random-init model of the shape (hidden 576, 30 layers, 9/3 heads, vocab 49152, tied; or
Qwen2.5-0.5B's, vocab 151936), and times `train_on_samples` (packing, pi_theta forward + backward of
every micro-batch, clip, AdamW) on `--prompts` x `--group` synthetic samples: `--prompt-len`-token
prompts, answers of every `--lengths` value run to the length, behaviour log-probs -log V (a
random-init model is near-uniform: ratios ~1). FLOPs: 6 N_body T + 6 N_head H + 12 n_layers
d_attn P (T positions fed, H of them scored by the head: a prompt's prefix is not, P causal
pairs). Peak: square fp32 matmuls of `--peak-n` on the same thread count. Memory: the child's
VmHWM over the whole run (loading included) and over the timed steps alone (the mark reset
through /proc/self/clear_refs first).
"""

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

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu"),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=1024, tie_word_embeddings=True),
}


def vm(field: str) -> float:
    """A /proc/self/status field in GiB (VmHWM: peak resident set, VmRSS: now)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines()
                if x.startswith(field))
    return int(line.split()[1]) / 2**20


def model_dir(shape: str) -> str:
    out = Path(tempfile.gettempdir()) / f"bench_train_{shape}"
    if not (out / "config.json").is_file():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPES[shape])).save_pretrained(
            str(out))
    return str(out)


def child(a) -> dict:
    sys.path.insert(0, a.root)
    os.chdir(a.root)
    import torch

    import loss as L
    import modeling
    import nanoareal as N
    from rollout import Completion, Sample
    path = model_dir(a.shape)
    cfg = N.validate_config(N.Config(model=path, prompts_per_step=a.prompts, group_size=a.group,
                                     max_new_tokens=a.length), 1)
    ranks, device = N.setup_distributed(cfg.cp_size)
    torch.set_num_threads(a.threads)
    model, ref, _, optimizer = N.load_models(cfg, device, ranks)
    reduction, hf = L.build_loss(cfg), model.module.config
    vocab, g = hf.vocab_size, torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (a.prompt_len,), generator=g).tolist()
               for _ in range(a.prompts)]
    lp = -float(torch.tensor(vocab).log())
    lengths = [a.length if not a.uneven else int(torch.randint(a.length // 8, a.length + 1, (),
                                                               generator=g))
               for _ in range(a.prompts * a.group)]
    samples = [Sample(i // a.group, prompts[i // a.group], Completion(
        torch.randint(2, vocab, (n,), generator=g).tolist(), [lp] * n, "length"),
        advantage=float(torch.randn((), generator=g))) for i, n in enumerate(lengths)]
    mbs = N.pack_microbatches(samples, cfg)
    T = sum(len(mb.input_ids) for mb in mbs)
    seg = torch.cat([mb.segments for mb in mbs])
    pairs = int((seg[:, 1] * seg[:, 3] + seg[:, 1] * (seg[:, 1] + 1) // 2).sum())
    n_body = sum(p.numel() for n, p in model.module.named_parameters() if p.dim() == 2
                 and "embed_tokens" not in n and "lm_head" not in n)
    scored = sum(int((mb.seq_ids >= 0).sum()) for mb in mbs)  # the head's rows (not a prefix's)
    d_attn = hf.num_attention_heads * (getattr(hf, "head_dim", None)
                                       or hf.hidden_size // hf.num_attention_heads)
    flops = 6 * n_body * T + 6 * vocab * hf.hidden_size * scored + \
        12 * hf.num_hidden_layers * d_attn * pairs
    times, load_peak, saved = [], vm("VmHWM"), saved_bytes(modeling)
    state = sum(p.numel() * p.element_size() for p in model.module.parameters())
    for i in range(a.warmup + a.steps):
        if i == a.warmup:
            Path("/proc/self/clear_refs").write_text("5")  # the timed steps' own peak from here
        t = time.perf_counter()
        N.train_on_samples(model, ref, optimizer, reduction, samples, cfg, ranks)
        times.append(time.perf_counter() - t)
        if i == 0:  # weights, their gradients (freed by zero_grad) and AdamW's two moments
            state += sum(v.numel() * v.element_size() for st in optimizer.state.values()
                         for v in st.values() if torch.is_tensor(v))
    x = torch.randn(a.peak_n, a.peak_n)
    x @ x
    t = time.perf_counter()
    for _ in range(3):
        x @ x
    peak = 6 * a.peak_n**3 / (time.perf_counter() - t)
    return {"times": times[a.warmup:], "flops": flops, "peak": peak, "positions": T,
            "micro_batches": len(mbs), "train_hwm": vm("VmHWM"), "load_hwm": load_peak,
            "rss_end": vm("VmRSS"), "saved": saved, "state": state / 2**30,
            "mb_positions": [len(mb.input_ids) for mb in mbs]}


def saved_bytes(modeling) -> list[float]:
    """Wraps modeling.Model.logprobs: the GiB of distinct storages autograd saves for backward in
    each training micro-batch (activations as the graph holds them), appended to the list
    returned."""
    import torch
    out, forward, seen = [], modeling.Model.logprobs, {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def wrapped(*args, grad=False, **kw):
        seen.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = forward(*args, grad=grad, **kw)
        if grad:
            out.append(sum(seen.values()) / 2**30)
        return result
    modeling.Model.logprobs = wrapped
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--tiny", action="store_true", help="--shape tiny, short answers (smoke)")
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="child runs per (root, length)")
    p.add_argument("--uneven", action="store_true", help="answers of seeded random lengths from "
                   "1/8 of each --lengths value to it (real answers stop at different lengths)")
    p.add_argument("--peak-n", type=int, default=2048)
    p.add_argument("--roots", nargs="+", default=[str(Path(__file__).resolve().parents[1])])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a)))
        return
    if a.tiny:
        a.shape, a.lengths, a.peak_n = "tiny", [8], 256
    rows = []
    for length in a.lengths:
        for _ in range(a.rounds):
            for root in a.roots:  # alternating: a shared machine's load hits both alike
                keys = ("shape", "prompts", "group", "prompt_len", "threads", "steps", "warmup",
                        "peak_n")
                cmd = [sys.executable, __file__, "--child", "--root", str(Path(root).resolve()),
                       "--length", str(length)] + [f"--{k.replace('_', '-')}={getattr(a, k)}"
                                                   for k in keys] + ["--uneven"] * a.uneven
                env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), WANDB_MODE="disabled")
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
                r = json.loads(line[7:]) | {"root": root, "length": length,
                                            "load": os.getloadavg()[0]}
                rows.append(r)
                print(f"# {root} {length}: {json.dumps(r)}", flush=True)
    print(f"\n## train_on_samples, {a.shape}, {a.prompts} x {a.group}, {a.prompt_len}-token "
          f"prompts, {a.threads} thread(s), median (min-max) of {a.steps} steps x {a.rounds} "
          "run(s)\n")
    print("| checkout | answer | positions (micro-batches) | time s | GFLOP/s | of peak | "
          "train peak GiB | run peak GiB | load avg |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in a.lengths:
        for root in a.roots:
            rs = [r for r in rows if r["root"] == root and r["length"] == length]
            ts = [t for r in rs for t in r["times"]]
            med = statistics.median(ts)
            share = statistics.median(r["flops"] / statistics.median(r["times"]) / r["peak"]
                                      for r in rs)
            print(f"| {root} | {length} | {rs[0]['positions']} ({rs[0]['micro_batches']}) | "
                  f"{med:.2f} ({min(ts):.2f}-{max(ts):.2f}) | {rs[0]['flops'] / med / 1e9:.1f} | "
                  f"{100 * share:.0f}% | {max(r['train_hwm'] for r in rs):.2f} | "
                  f"{max(max(r['train_hwm'], r['load_hwm']) for r in rs):.2f} | "
                  f"{statistics.median(r['load'] for r in rs):.2f} |")


if __name__ == "__main__":
    main()
