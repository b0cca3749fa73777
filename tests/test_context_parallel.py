"""Context parallel (Ulysses), issue 5: splitting every packed micro-batch across N ranks changes
nothing.

Reference = one process without CP, run in this process (tests/support/cp_worker.py's `main`). The
CP runs are real torchrun launches of the same worker on CPU gloo: CP=2 on 2 ranks, and dp 2 x cp 2
on 4 ranks. Tiny random Llamas: "gqa" (4 query heads, 2 KV heads: split as they are), "kv1" (4 and
1: fewer KV heads than CP ranks) and "kv3" (6 and 3: KV heads not divisible by N); for the last two
the KV heads are replicated so every rank gets the ones it needs; and a tiny Gemma 2 (a sliding
window of 3, attention and final logit softcaps). Compared in float32: logits and log-probs of a
packed row whose length is not a multiple of N, the full gradient of every parameter and the
reported loss terms (all four aggregation modes on "gqa", token_mean on the others).
"""

import importlib.util
import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import warm

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
ENV = os.environ | {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT)}

torch.set_num_threads(1)


def _load_worker():
    spec = importlib.util.spec_from_file_location("cp_worker",
                                                  ROOT / "tests" / "support" / "cp_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str, timeout: int = 240) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *args]
    p = warm.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{(p.stdout + p.stderr)[-4000:]}"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("cp_models")
    paths = {}
    for name, heads, kv in [("gqa", 4, 2), ("kv1", 4, 1), ("kv3", 6, 3), ("heads3", 3, 1)]:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=32, hidden_size=8 * heads, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv,
                          head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                          bos_token_id=None)
        LlamaForCausalLM(cfg).save_pretrained(root / name)
        paths[name] = str(root / name)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)  # Gemma 2: a sliding window shorter than the sequences, logit softcaps
    gemma2 = AutoConfig.for_model(
        "gemma2", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
        attn_logit_softcapping=0.05, final_logit_softcapping=0.5, query_pre_attn_scalar=8,
        max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    AutoModelForCausalLM.from_config(gemma2).save_pretrained(root / "gemma2")
    paths["gemma2"] = str(root / "gemma2")
    return paths


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp_ref") / "ref.pt"
    models = [tiny_models[m] for m in ("gqa", "kv1", "kv3", "gemma2")]
    worker = _load_worker()
    default = worker.modeling.CHECKPOINT_LAYERS  # main sets the trainer's: this process's other
    try:  # tests (same worker) must find its default again
        worker.main(["--models", *models, "--cp", "1", "--out", str(out)])
    finally:
        worker.modeling.CHECKPOINT_LAYERS = default
    return torch.load(out)["models"]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    diff = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    assert diff <= TOL, f"{what}: max |difference| {diff:.2e} > {TOL}"


def assert_matches_reference(result: dict, reference: dict, layout: str) -> None:
    for model, ref in reference.items():
        got = result[model]
        for key in ("logits", "logprobs", "entropy"):
            assert_close(got[key], ref[key], f"{layout} {model} {key}")
        for mode, want in ref["modes"].items():
            have = got["modes"][mode]
            assert have["grads"].keys() == want["grads"].keys()
            for name, g in want["grads"].items():
                assert_close(have["grads"][name], g, f"{layout} {model} {mode} gradient of {name}")
            assert have["reported"].keys() == want["reported"].keys()
            for term, v in want["reported"].items():
                assert abs(have["reported"][term] - v) < TOL, (layout, model, mode, term,
                                                               have["reported"][term], v)


@pytest.mark.parametrize("nproc", [2, 4], ids=["cp2_on_2_ranks", "dp2_x_cp2_on_4_ranks"])
def test_cp2_logits_grads_and_reported_losses_equal_one_process_for_every_mode(nproc, tiny_models,
                                                                               reference,
                                                                               tmp_path):
    """The models load sharded from rank 0's copy (the reference: from_pretrained), Gemma 2's tied
    head too. On 4 ranks the decoder layers are also checkpointed (the reference is not): rerun in
    backward inside FSDP2's hooks, the all-to-alls again, the gradients the same. Either way FSDP2
    reduce-scatters once per optimizer step (once per FSDP unit), however many micro-batches."""
    out = tmp_path / "cp.pt"
    models = [tiny_models[m] for m in ("gqa", "kv1", "kv3", "gemma2")]
    torchrun(nproc, "tests/support/cp_worker.py", "--models", *models, "--cp", "2", "--out",
             str(out), *(["--checkpoint-layers"] if nproc == 4 else []))
    saved = torch.load(out)
    result = saved["models"]
    assert set(result) == {"gqa", "kv1", "kv3", "gemma2"}
    # only rank 0 read whole models (from_pretrained, on the host); every rank built its own on
    # the meta device and received its shards: no rank held a whole copy on its device
    assert saved["whole_copies"] == [4] + [0] * (nproc - 1)
    assert_matches_reference(result, reference, f"{nproc} ranks")
    units = 2 + 1  # a unit per decoder layer + the root
    for model in result.values():
        for mode in model["modes"].values():
            assert mode["num_microbatches"] > 1 and mode["reduce_scatters"] == units, mode


def test_compiled_layers_under_fsdp2_and_ulysses_give_one_eager_process_results(tiny_models,
                                                                               reference,
                                                                               tmp_path):
    """--compile on 2 ranks, CP=2: each rank compiles its decoder layers (FSDP2's hooks and the
    all-to-alls run outside the compiled code, attention as is); logits, log-probs, gradients and
    reported terms equal the eager one-process run to float rounding, Gemma 2's extra norms and
    softcaps too."""
    out, names = tmp_path / "compiled.pt", ("gqa", "gemma2")
    torchrun(2, "tests/support/cp_worker.py", "--models", *[tiny_models[m] for m in names],
             "--cp", "2", "--out", str(out), "--compile")
    result = torch.load(out)["models"]
    assert all(result[m]["compiled"] for m in names) and not reference["gqa"]["compiled"]
    assert_matches_reference(result, {m: reference[m] for m in names}, "2 ranks, compiled")


def test_cp2_episodes_grads_and_reported_losses_equal_one_process_for_every_mode(tiny_models,
                                                                                tmp_path):
    """Multi-turn responses (environment spans inside them, policy_mask 0 there) packed by the
    trainer's own pack_microbatches (shared prompts, micro-batches of 16 tokens cutting through
    groups), every mode: CP=2 on 2 ranks gives one process's gradients and reported terms. The
    Ulysses split cuts episodes wherever the token count falls, env spans included."""
    worker, models = _load_worker(), [tiny_models["gqa"]]
    samples = worker.make_samples(32, episodes=True)
    masks = [s.completion.policy_mask for s in samples]
    assert any(0 in m[: len(m) - m[::-1].index(1)] for m in masks)  # interior environment spans
    assert sum(m.count(0) for m in masks) > 10
    ref, out = tmp_path / "ref.pt", tmp_path / "cp.pt"
    worker.main(["--models", *models, "--cp", "1", "--episodes", "--out", str(ref)])
    torchrun(2, "tests/support/cp_worker.py", "--models", *models, "--cp", "2", "--episodes",
             "--out", str(out))
    want, got = torch.load(ref)["models"], torch.load(out)["models"]
    assert set(want["gqa"]["modes"]) == {"token_mean", "seq_mean", "prompt_mean", "constant"}
    assert all(m["num_microbatches"] > 1 for m in got["gqa"]["modes"].values())
    assert_matches_reference(got, want, "2 ranks, episodes")


@pytest.mark.parametrize("nproc", [2, 4], ids=["cp2_on_2_ranks", "dp2_x_cp2_on_4_ranks"])
def test_distillation_and_a_sequence_correction_under_cp_equal_one_process(nproc, tiny_models,
                                                                          tmp_path):
    """A teacher sharded like the policy scores each rank's samples (its per-token advantages
    those of one process); geo-MIS rejects whole responses from pi_prox's forward, a sequence's
    tokens split over the CP ranks (its geometric mean needs them all: the gathered row): every
    mode's gradients and reported terms equal one process's."""
    worker, models = _load_worker(), [tiny_models["gqa"]]
    ref, out = tmp_path / "ref.pt", tmp_path / "cp.pt"
    flags = ["--models", *models, "--teacher", tiny_models["kv1"]]
    default = worker.modeling.CHECKPOINT_LAYERS  # main sets its own: restored for later tests
    try:
        worker.main([*flags, "--cp", "1", "--out", str(ref)])
    finally:
        worker.modeling.CHECKPOINT_LAYERS = default
    torchrun(nproc, "tests/support/cp_worker.py", *flags, "--cp", "2", "--out", str(out))
    want, got = torch.load(ref)["models"], torch.load(out)["models"]
    assert 0 < want["gqa"]["rejected"]["token_mean"]  # the correction bites
    if nproc == 2:  # one DP rank: the same samples, the same teacher scores and rejections
        for a, b in zip(got["gqa"]["token_advantages"], want["gqa"]["token_advantages"]):
            assert a == pytest.approx(b, abs=1e-5)
        assert got["gqa"]["rejected"] == want["gqa"]["rejected"]
    assert_matches_reference(got, want, f"{nproc} ranks, distillation, geo-MIS")


def test_query_heads_not_divisible_by_cp_size_is_a_startup_error(tiny_models, monkeypatch):
    """load_model reads the CP size from its group: here a stand-in group of 2 (one process)."""
    import modeling
    import nanoareal as na
    from cli import UserError

    group, size = object(), torch.distributed.get_world_size
    monkeypatch.setattr(torch.distributed, "get_world_size",
                        lambda g=None: 2 if g is group else size(g))
    cfg = na.Config(model=tiny_models["heads3"], cp_size=2)
    with pytest.raises(UserError, match=r"--cp-size 2 must divide the model's 3 attention heads"):
        modeling.load_model(cfg, torch.device("cpu"), world=2, cp_group=group)


def test_world_not_divisible_by_cp_size_is_a_config_error():
    import nanoareal as na
    from cli import UserError

    with pytest.raises(UserError, match=r"--cp-size 2 must divide the number of ranks \(3\)"):
        na.validate_config(replace(na.Config(), cp_size=2), world=3)


def test_cli_cp2_run_logs_the_same_first_step_as_one_process(tmp_path):
    """The real CLI with --cp-size 2 on 2 ranks vs plain `python nanoareal.py` (in this process):
    step 1 was trained from the same weights on the same samples, so reward, entropy and every
    loss term agree."""
    import nanoareal as na

    model = ROOT / "assets" / "tiny-arith"
    if not (model / "config.json").exists():
        pytest.skip("assets/tiny-arith not built yet")
    args = ["--model", str(model), "--steps", "2", "--prompts-per-step", "4", "--group-size", "4",
            "--eval-every", "0", "--entropy-coef", "0.01"]
    torchrun(2, "nanoareal.py", *args, "--cp-size", "2", "--run-dir", str(tmp_path / "cp2"))
    assert na.run([*args, "--run-dir", str(tmp_path / "cp1")]) == 0
    cp1, cp2 = ([json.loads(line) for line in (tmp_path / d / "metrics.jsonl").open()]
                for d in ("cp1", "cp2"))
    assert [m["step"] for m in cp1] == [m["step"] for m in cp2] == [1, 2]
    one, two = cp1[0], cp2[0]
    assert one["reward"] == two["reward"] and one["response_len"] == two["response_len"]
    losses = [k for k in one if k.startswith("loss/")]
    assert losses
    for k in losses + ["entropy"]:
        assert abs(one[k] - two[k]) < TOL, (k, one[k], two[k])
    assert abs(one["grad_norm"] - two["grad_norm"]) < 1e-4 * max(1.0, one["grad_norm"])


def test_a_context_parallel_group_scores_its_batch_once(tmp_path):
    """A reward that differs between the CP group's ranks (a judge, a random draw, a timeout on
    one rank) used to give each rank its own rewards: with --zero-variance filter they kept
    different samples, and the Ulysses all-to-alls saw different rows. The group's first rank
    scores; here its rewards are random and the other rank's all 0, so a rank that scored for
    itself would filter every group away and leave the other rank training alone."""
    reward = tmp_path / "ranked.py"
    reward.write_text("import os, random\n\ndef score(completion, row):\n"
                      "    return random.random() if os.environ['RANK'] == '0' else 0.0\n")
    torchrun(2, "nanoareal.py", "--model", str(ROOT / "assets" / "tiny-arith"), "--steps", "2",
             "--prompts-per-step", "4", "--group-size", "4", "--eval-every", "0", "--cp-size", "2",
             "--zero-variance", "filter", "--reward", f"{reward}:score",
             "--run-dir", str(tmp_path / "run"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["reward"] < 1 and r["zero_var_groups"] == 0 and r["grad_norm"] > 0
