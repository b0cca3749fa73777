"""The bench scripts run end to end in a tiny configuration and print their tables. Nothing here
asserts a speed."""

import os
import sys
from pathlib import Path

import pytest
import warm

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, *flags: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    out = warm.run([sys.executable, str(ROOT / "bench" / script), *flags], cwd=ROOT,
                   capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_bench_lora_prints_full_and_lora_side_by_side():
    out = run_bench("bench_lora.py", "--tiny", "--steps", "1", "--warmup", "0", "--prompt-len",
                    "8", "--new-tokens", "8")
    assert "| full | " in out and "| LoRA r=8 | " in out and "| 100.00% |" in out


def test_bench_bookkeeping_prints_its_table():
    out = run_bench("bench_bookkeeping.py", "--steps", "1", "--warmup", "0", "--prompts-per-step",
                    "4",
                    "--group-size", "4")
    assert "| **bookkeeping total** |" in out and "target <= 2%" in out


def test_bench_flops_prints_its_table_on_cpu():
    out = run_bench("bench_flops.py", "--steps", "1", "--warmup", "0", "--seqs", "16", "--peak-n",
                    "256")
    assert "| achieved |" in out and "| share of peak (MFU) |" in out


def test_bench_flops_runs_the_gpu_model_config_on_cpu():
    """The GPU default (random-init Qwen2.5-0.5B config: 152k vocabulary, GQA 14/2 heads, tied
    lm_head) through the same script, cut to one layer so it fits a CPU test; groups of 8 share
    their 16-token prompt."""
    out = run_bench("bench_flops.py", "--model", "qwen2.5-0.5b", "--num-layers", "1", "--seqs",
                    "8", "--prompt-len", "16", "--completion-len", "8", "--steps", "1", "--warmup",
                    "0", "--peak-n", "256")
    assert "Qwen2.5-0.5B config" in out, out
    assert "8 seqs x 24 tokens, groups of 8: 79 positions fed" in out, out


def test_bench_vs_trl_prints_its_table():
    pytest.importorskip("trl")
    out = run_bench("bench_vs_trl.py", "--steps", "1", "--warmup", "0", "--prompts-per-step", "4",
                    "--group-size",
                    "4", "--max-new-tokens", "4", "--trl-micro-batch", "8")
    for row in ("| e2e step time (s) |", "| train only, identical rollouts (s) |",
                "| padding share of training-forward positions | 0.0% |"):
        assert row in out, out


def test_bench_staleness_prints_its_table():
    out = run_bench("bench_staleness.py", "--steps", "1", "--warmup", "1", "--prompts-per-step",
                    "8", "--rounds", "2", "--skip-trl")
    assert "| nanoareal K=1 (1 thread + a 1-thread rollout process) |" in out, out
    assert "K=1 vs K=0:" in out and "by round" in out, out


def test_the_gpu_check_documents_itself_and_skips_cleanly_without_a_gpu():
    """tests/gpu/check_gpu.py is run by hand on a GPU machine; here its --help, and on a machine
    without CUDA its plain run says it skipped (exit 0) instead of failing."""
    script = str(ROOT / "tests" / "gpu" / "check_gpu.py")
    helped = warm.run([sys.executable, script, "--help"], capture_output=True, text=True,
                      timeout=120)
    assert helped.returncode == 0 and "attention" in helped.stdout and "--quick" in helped.stdout
    import torch

    if not torch.cuda.is_available():
        out = warm.run([sys.executable, script], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.startswith("skipped: no CUDA device"), out


def test_the_gpu_check_runs_its_cpu_smoke_mode_through_the_trainers_functions():
    """The same code as on the GPU, small (one layer, a 1024-token vocabulary), so it cannot rot:
    the attention check against the model's own forward and its negative control, GRPO steps."""
    script = str(ROOT / "tests" / "gpu" / "check_gpu.py")
    out = warm.run([sys.executable, script, "--device", "cpu", "--num-layers", "1",
                    "--quick"], capture_output=True, text=True, timeout=300,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "| sdpa | ok |" in out.stdout and "all checks passed" in out.stdout
    assert "| weight sync (" in out.stdout and "| T 0.7 | 192 | 0 |" in out.stdout  # the sampler
    assert "| decoder layers (--compile) | eager (decoder layers under 50M" in out.stdout


def test_the_gpu_profile_runs_its_cpu_smoke_mode():
    """bench/profile_gpu.py, small on a CPU so that it cannot rot between GPU runs: the decode and
    its sampler, forward+backward under each checkpointing choice, both operator tables."""
    out = run_bench("profile_gpu.py", "--device", "cpu", "--num-layers", "1", "--vocab", "1024",
                    "--rows", "8", "--tokens", "4", "--seqs", "8", "--prompt-len", "8",
                    "--completion-len", "8")
    assert "| of which the sampler (sample_tokens on [8, 1024] logits) |" in out, out
    for choice in ("none", "selective", "full"):  # modeling.CHECKPOINT_LAYERS "", ...
        assert f"| forward+backward, checkpointing {choice} (" in out, out
    assert out.count("Self CPU time total") == 2, out


def test_bench_memory_prints_its_table():
    out = run_bench("bench_memory.py", "--layers", "2", "--hidden", "64", "--intermediate", "128",
                    "--heads", "4", "--kv-heads", "2", "--vocab", "512", "--tokens", "256")
    assert "| positions | checkpointing | measured peak (GiB) | plan (GiB) |" in out, out
    assert "| on |" in out and "| off |" in out, out


def test_bench_decode_prints_this_engine_the_baseline_and_hf_generate():
    out = run_bench("bench_decode.py", "--new-tokens", "4", "--reps", "1", "--num-layers", "1",
                    "--vocab", "512", "--threads", "1", "--prompt-len", "8")
    assert "| 4 | nanoareal (this) |" in out and "| 4 | HF generate |" in out and "allowed" in out


def test_bench_train_phase_prints_time_share_of_peak_and_memory():
    out = run_bench("bench_train_phase.py", "--tiny", "--steps", "1", "--warmup", "0",
                    "--threads", "1")
    assert "train peak GiB" in out and "of peak" in out
    assert "| 8 | " in out


def test_bench_shapes_compares_a_baseline_checkout_without_trl():
    """--baseline DIR --no-trl: this checkout's nanoareal and another's (here the same one) alone,
    each a row of its own, the summary's TRL cells empty."""
    out = run_bench("bench_shapes.py", "--smoke", "--baseline", str(ROOT), "--no-trl")
    names = [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ")]
    assert "| nanoareal" in names and "| baseline" in names and "| TRL" not in names, out
    summary = out.split("## Summary")[1]
    assert "(baseline / nanoareal)" in summary and "x | " not in summary.split("baseline")[0], out


def test_bench_shapes_prints_both_trainers_side_by_side():
    """The real-shape bench's own path on a tiny model: two child processes alternating, each
    reporting its peak memory, FLOP/s counted from hooked forwards."""
    pytest.importorskip("trl")
    out = run_bench("bench_shapes.py", "--smoke")
    assert "## Summary" in out, out
    rows = {line.split(" | ")[0]: line.split(" | ") for line in out.splitlines()
            if line.startswith(("| nanoareal | ", "| TRL | "))}
    nano, trl = rows["| nanoareal"], rows["| TRL"]
    # positions the decoder was fed: TRL 4 rows of 8 + 4 tokens; nanoareal shares each group's
    # prompt, so fewer; both generate (prefill + decode positions counted)
    assert trl[5] == "48" and 0 < int(nano[5]) < 48, out
    assert int(nano[7]) > 0 and int(trl[7]) > 0 and float(nano[9].split()[0]) > 0, out
