"""The bench scripts run end to end in a tiny configuration and print their tables. Nothing here asserts a speed."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *flags: str) -> str:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / script), *flags], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
                                                      "PATH": "/usr/bin:/bin", "HOME": str(Path.home())})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_bench_bookkeeping_prints_its_table():
    out = run_bench("bench_bookkeeping.py", "--steps", "1", "--warmup", "0", "--prompts-per-step", "4",
                    "--group-size", "4")
    assert "| **bookkeeping total** |" in out and "target <= 2%" in out


def test_bench_flops_prints_its_table_on_cpu():
    out = run_bench("bench_flops.py", "--steps", "1", "--warmup", "0", "--seqs", "16", "--peak-n", "256")
    assert "| achieved |" in out and "| share of peak (MFU) |" in out


def test_bench_vs_trl_prints_its_table():
    pytest.importorskip("trl")
    out = run_bench("bench_vs_trl.py", "--steps", "1", "--warmup", "0", "--prompts-per-step", "4", "--group-size",
                    "4", "--max-new-tokens", "4", "--trl-micro-batch", "8")
    for row in ("| e2e step time (s) |", "| train only, identical rollouts (s) |",
                "| padding share of training-forward positions | 0.0% |"):
        assert row in out, out


def test_packed_sdpa_attention_equals_per_sequence_forward_and_gradients():
    """The CPU attention of packed rows (each sequence attends only to itself) is the per-sequence forward."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    import nanoareal as N

    AttentionInterface.register("packed_sdpa", N.packed_sdpa_attention)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ROOT / "assets/tiny-arith", dtype=torch.float64)
    seqs = [torch.randint(3, 15, (n,)) for n in (5, 9, 1, 3, 7)]
    packed, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
    ref = torch.cat([model.model(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in seqs])
    g_ref = torch.autograd.grad(ref.square().sum(), model.model.layers[0].self_attn.q_proj.weight)
    model.set_attn_implementation("packed_sdpa")
    out = model.model(input_ids=packed, position_ids=pos, use_cache=False,
                      packed=N.padded_layout(pos)).last_hidden_state[0]
    g = torch.autograd.grad(out.square().sum(), model.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g[0], g_ref[0], atol=1e-10, rtol=1e-10)
