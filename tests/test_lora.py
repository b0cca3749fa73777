"""LoRA (--lora-rank, issue 29; nanoareal's own, lora.py: peft is the reference here, never
needed at run time): the adapters' gradients against a plain peft model's padded forward for
every mode and on every architecture test_architectures.py trains, merged weights against the
unmerged forward and peft's own merge, the KL reference as the adapters switched off, the CLI
end to end (engines get the merged policy, final/ and its adapter), 2 ranks against 1 process,
a kill -9 and a rerun against the uninterrupted run, bad input. The SGLang syncs of a LoRA
model: tests/test_rollout_sglang.py (stand-ins)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from reference import GradCapture, aggregate, policy_token_loss, whole
from test_architectures import FAMILIES, REFUSED, build, samples, token_mean_objective
from test_checkpoint import assert_same_run, finish, kill_9, start, wait_for
from test_nanoareal import TINY, _sample, read_metrics, run_cli
from test_staleness import AFTER_UPDATES, ONE_STEP

import attention
import lora
import loss as L
import modeling
import nanoareal as N
import rollout
from cli import UserError

F64 = torch.float64
PEFT_PREFIX = "base_model.model."  # peft's names: ours under it, ".default.weight" after A/B


def random_adapters(module, seed: int = 0, dtype=F64) -> dict[str, torch.Tensor]:
    """Every adapter weight of `module` (B too: with B = 0 the gradient of A is 0) set to noise;
    returns them by name (ours: `<layer>.lora_A`, `<layer>.lora_B`)."""
    g, values = torch.Generator().manual_seed(seed), {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if lora.is_adapter(name):
                local = p.to_local() if hasattr(p, "to_local") else p
                values[name] = 0.1 * torch.randn(local.shape, generator=g, dtype=dtype)
                local.copy_(values[name])
    return values


def peft_name(ours: str) -> str:
    """`<layer>.lora_A` -> peft's `base_model.model.<layer>.lora_A.default.weight`."""
    return f"{PEFT_PREFIX}{ours}.default.weight"


def ours_name(theirs: str) -> str:
    return theirs.removeprefix(PEFT_PREFIX).removesuffix(".default.weight")


def plain_peft(path: str, rank: int, adapters: dict, targets="all-linear", alpha=lora.LORA_ALPHA,
               dtype=F64, conv1d: bool = False, **from_pretrained):
    """The reference: transformers' own model wrapped by peft.get_peft_model, same adapters
    (`conv1d`: GPT-2's Conv1D layers, whose weight is [in, out]: peft's fan_in_fan_out)."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **from_pretrained)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
        fan_in_fan_out=conv1d))
    own = dict(model.named_parameters())
    assert {ours_name(n) for n in own if ".lora_" in n} == set(adapters)  # the same layers
    with torch.no_grad():
        for name, value in adapters.items():
            own[peft_name(name)].copy_(value)
    return model


def padded_logprobs(model, samples, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of each completion token [B, T] by a right-padded forward, and its mask."""
    rows = [s.prompt_ids + s.completion.output_ids for s in samples]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    logp = (model(input_ids=ids, attention_mask=attention).logits / temperature).log_softmax(-1)
    logp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    T = max(len(s.completion.output_ids) for s in samples)
    out, mask = torch.zeros(len(rows), T, dtype=logp.dtype), torch.zeros(len(rows), T)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.completion.output_ids)
        out[i, :n], mask[i, :n] = logp[i, p - 1 : p - 1 + n], 1.0
    return out, mask


@pytest.mark.parametrize("mode", L.MODES)
def test_adapter_gradients_equal_a_plain_peft_models_padded_objective(one_rank_group, mode):
    """Micro-batches of 14 positions cut through the groups; fp64 weights; SGD at lr 1 moves each
    adapter weight by minus its gradient; the base does not move."""
    cfg = N.Config(model=TINY, lora_rank=2, dtype="float64", grad_clip=0.0, temperature=0.8,
                   micro_batch_tokens=14, loss_aggregation=mode)
    lens = [[2, 5, 3], [4, 1, 4], [3, 3, 5], [1, 2, 2]]  # completion lengths per group
    samples = [_sample(g, [4 + g, 13, 5 + k % 2, 14][: 3 + g % 2], [6 + (g + k) % 9] * (n - 1)
                       + [1], adv=(-1) ** (g + k) * (0.5 + k))
               for g in range(4) for k, n in enumerate(lens[g])]
    assert len(N.pack_microbatches(samples, cfg)) > 4  # more micro-batches than groups
    model = modeling.load_model(cfg, torch.device("cpu"))
    adapters = random_adapters(model.module)
    params = dict(model.module.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(adapters)
    before = {n: whole(p.detach()).clone() for n, p in params.items()}
    optimizer = torch.optim.SGD(model.trainable(), lr=1.0)
    N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg, N.Ranks())

    ref = plain_peft(TINY, 2, adapters)
    logp, mask = padded_logprobs(ref, samples, cfg.temperature)
    adv = torch.tensor([s.advantage for s in samples], dtype=F64)[:, None].expand_as(logp)
    token_loss, m = policy_token_loss({"policy_loss": "ppo"}, logp, logp.detach(), logp.detach(),
                                      adv, None, mask)
    aggregate(token_loss, m, mode=mode, group_ids=torch.tensor([s.group for s in samples]),
              denom_mask=mask, divisor=cfg.loss_aggregation_divisor).backward()
    grads = {ours_name(n): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(adapters)
    for name, p in params.items():
        moved = before[name] - whole(p.detach())
        if name in grads:
            assert grads[name].abs().sum() > 0, name
            # the trainer's advantages and mode weights are fp32: ~2e-8 (a wrong weight: ~1)
            assert (moved - grads[name]).norm() <= 1e-6 * grads[name].norm(), name
        else:
            assert torch.equal(moved, torch.zeros_like(moved)), name


def test_bf16_lora_holds_the_frozen_base_in_bf16_and_only_the_adapters_in_fp32_and_adamw(
        one_rank_group):
    cfg = N.Config(model=TINY, lora_rank=2, dtype="bfloat16", warmup_steps=0)
    model, ref, teacher, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks())
    assert ref is None and teacher is None and cfg.lr == 1e-3  # LoRA's default rate
    named = list(model.module.named_parameters())
    dtypes = {(lora.is_adapter(n), p.requires_grad, p.dtype) for n, p in named}
    assert dtypes == {(False, False, torch.bfloat16), (True, True, torch.float32)}
    adapters = [p for n, p in named if lora.is_adapter(n)]
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == list(map(id, adapters))
    samples = [_sample(g, [4 + g, 13, 5], [6 + g, 1], adv=(-1) ** g) for g in range(4)]
    _, stats = N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg,
                                  N.Ranks())
    assert stats["updated"] == 1 and stats["grad_norm"] > 0


def test_merged_weights_equal_the_unmerged_forward_and_the_kl_reference_is_the_base():
    """lora.merged's state, loaded in the plain model, gives the adapted model's log-probs to
    float rounding; lora.disabled gives the base's exactly (no second copy of the model)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("packed", attention.packed_attention)
    load = lambda: AutoModelForCausalLM.from_pretrained(TINY).eval()
    model, base, merged = load(), load(), load()
    lora.apply(model, 4, None)
    random_adapters(model)
    merged.load_state_dict(dict(lora.merged(model.state_dict().items(), model)))
    ids = torch.tensor([[4, 13, 7, 14, 9, 3, 1, 5]])
    args = (ids, torch.arange(8)[None], torch.tensor([13, 7, 14, 9, 3, 1, 5, 0]))
    logprobs = {}
    for name, m in [("lora", model), ("base", base), ("merged", merged)]:
        m.set_attn_implementation("packed")
        with torch.no_grad():
            logprobs[name] = modeling.policy_logprobs(m, *args)[0]
    with torch.no_grad(), lora.disabled(model):
        reference = modeling.policy_logprobs(model, *args)[0]
    assert (logprobs["lora"] - logprobs["base"]).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(logprobs["merged"], logprobs["lora"], rtol=0, atol=2e-5)
    assert torch.equal(reference, logprobs["base"])
    with torch.no_grad():  # and the adapters are on again
        assert torch.equal(modeling.policy_logprobs(model, *args)[0], logprobs["lora"])


def test_cli_lora_run_syncs_the_merged_policy_and_exports_model_and_adapter(tmp_path):
    """pi/pi_behave = 1 after every sync (the hf engine holds W + (alpha/r) B A); only adapters
    move; the KL penalty runs against the base; final/ loads in transformers and equals its
    adapter on the base (PEFT's loader); --model final/adapter evaluates as --model final."""
    import peft
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    fast = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "3"]
    run_cli([*fast, "--steps", "3", "--lora-rank", "4", "--kl-coef", "0.05", "--run-dir",
             str(tmp_path / "run")])
    rows = read_metrics(tmp_path / "run")
    for r in rows[1:]:
        assert r["importance_weight/max"] == pytest.approx(1.0, abs=1e-4)
        assert r["logprob_mismatch"] < 1e-5
    assert rows[-1]["loss/kl"] > 0 and rows[-1]["grad_norm"] > 0
    final = tmp_path / "run" / "final"
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and Path(config["base_model_name_or_path"]) == Path(TINY)
    merged = load_file(final / "model.safetensors")
    base = load_file(Path(TINY) / "model.safetensors")
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed)
    ids = torch.tensor([[4, 13, 7, 14, 9]])
    plain = AutoModelForCausalLM.from_pretrained(final)(ids).logits
    adapted = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY),
                                             final / "adapter")(ids).logits
    torch.testing.assert_close(plain, adapted, rtol=0, atol=2e-5)
    evals = [read_metrics(tmp_path / name)[0]["eval/accuracy"] for name in ("merged", "adapter")
             if run_cli(["--steps", "0", "--model", str(final if name == "merged" else
                         final / "adapter"), "--run-dir", str(tmp_path / name)])]
    assert evals[0] == evals[1] == rows[-1]["eval/accuracy"]


@pytest.mark.parametrize("layout", ["dp2", "cp2"])
def test_two_ranks_train_the_same_adapters_as_one_process(tmp_path, layout):
    """Rank 1: A [1, d] is sharded unevenly over the 2 ranks (FSDP2), or each micro-batch's
    tokens are split over them (context parallel); seq_mean and GSPO, stale rollouts (K = 1) with
    the mask correction: every piece of the step runs through the adapters."""
    from safetensors.torch import load_file

    args = ["--prompts-per-step", "6", "--group-size", "4", "--eval-every", "0", "--steps", "3",
            "--micro-batch-tokens", "40", "--lora-rank", "1", "--policy-loss", "gspo",
            "--loss-aggregation", "seq_mean", "--max-staleness", "1", "--correction", "mask"]
    run_cli([*args, "--run-dir", str(tmp_path / "one")])
    run_cli([*args, "--run-dir", str(tmp_path / "two"), *(["--cp-size", "2"] * (layout == "cp2"))],
            nproc=2)
    for one, two in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"),
                        strict=True):
        assert two["reward"] == one["reward"]  # the same samples
        tolerance = ONE_STEP if one["step"] == 1 else AFTER_UPDATES  # test_staleness.py's
        for k in ("loss/policy", "grad_norm", "importance_weight/max"):
            assert two[k] == pytest.approx(one[k], **tolerance), (one["step"], k)
    a1, a2 = (load_file(tmp_path / r / "final/adapter/adapter_model.safetensors")
              for r in ("one", "two"))
    assert set(a1) == set(a2) and len(a1) == 4 * 7 * 2
    for name in a1:  # AdamW amplifies rounding; the hf engine's fp32 head rounds by batch shape
        # B starts at 0, so it is all updates: it drifts as test_staleness.py derives (seen 3e-6);
        # A is its random init plus updates, the drift diluted (seen 5e-7)
        bound = AFTER_UPDATES["rel"] if "lora_B" in name else 2e-5
        assert (a1[name] - a2[name]).norm() <= bound * a1[name].norm(), name


def test_a_lora_run_killed_mid_step_resumes_to_the_uninterrupted_run(tmp_path):
    args = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "2", "--steps", "4",
            "--ckpt-every", "2", "--lora-rank", "2"]
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    finish(start(args, ref), ref)
    proc = start(args, run_dir, faults={"pause_in_step": 2})
    wait_for(run_dir / "in_step_2.rank0", proc, run_dir)
    kill_9(proc)
    finish(start(args, run_dir), run_dir)
    assert_same_run(ref, run_dir)


def test_lora_needs_no_peft_and_an_adapter_of_another_base_is_one_line(monkeypatch, tmp_path):
    """LoRA is nanoareal's own: with peft unimportable, adapters go on, save in PEFT's format and
    load back. An adapter whose layers do not fit the base (another model's) is one line."""
    from sglang_standin import save_tiny_llama
    from transformers import AutoModelForCausalLM

    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    other = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "other"))
    lora.apply(other, 2, None)
    saved = random_adapters(other, dtype=torch.float32)
    config = {"r": 2, "lora_alpha": lora.LORA_ALPHA, "target_modules": "all-linear"}
    lora.save(saved, config, str(tmp_path / "other"), tmp_path / "adapter")
    found = lora.read_config(tmp_path / "adapter")
    assert found["r"] == 2 and found["base_model_name_or_path"] == str(tmp_path / "other")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "other")
    lora.apply(again, 2, found)
    lora.load_weights(again, str(tmp_path / "adapter"))
    loaded = {n: p for n, p in again.named_parameters() if lora.is_adapter(n)}
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[n], saved[n]) for n in saved)
    monkeypatch.undo()
    model = AutoModelForCausalLM.from_pretrained(TINY)
    lora.apply(model, 2, found)
    with pytest.raises(UserError, match="does not fit this base model") as e:
        lora.load_weights(model, str(tmp_path / "adapter"))
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# every architecture: LoRA trains exactly what a plain peft model of it trains


def linear_layers_but_the_head(path: str) -> list[str]:
    """What "all-linear" adapts in a plain model: every nn.Linear and transformers Conv1D but the
    output head (MoE experts' fused 3-D weights are neither)."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    plain = AutoModelForCausalLM.from_pretrained(path)
    head = plain.get_output_embeddings()
    return [n for n, m in plain.named_modules()
            if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not head]


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_every_family_trains_and_merges_as_a_plain_peft_model(family, tmp_path,
                                                                      one_rank_group):
    """Issue 43 item 7. Each family test_architectures.py trains in full: nanoareal's LoRA (rank
    4, random B: with B = 0 the gradient of A is 0) through its own training step, against peft on
    transformers' plain padded forward with exactly the layers nanoareal adapted, the same alpha
    and the same A and B; then lora.merged's weights (what the engine and the export get) against
    peft's merge_and_unload. Qwen3-MoE's fused experts (3-D weights, no Linear) stay frozen in
    nanoareal; handed the list of layers nanoareal adapted (its attention projections), peft
    adapts exactly those, so peft is its reference too."""
    path = build(tmp_path, family, FAMILIES[family])
    batch = samples()
    cfg = N.Config(model=path, lora_rank=4, micro_batch_tokens=24, grad_clip=1e9,
                   loss_aggregation="token_mean")
    model = modeling.load_model(cfg, torch.device("cpu"))
    adapted = model.lora["target_modules"]
    assert model.lora["r"] == 4 and adapted == linear_layers_but_the_head(path)
    adapters = random_adapters(model.module, dtype=torch.float32)
    assert set(adapters) == {f"{n}.lora_{x}" for n in adapted for x in "AB"}
    assert {n for n, p in model.module.named_parameters() if p.requires_grad} == set(adapters)
    capture = GradCapture(model)
    N.train_on_samples(model, None, capture, L.build_loss(cfg), batch, cfg, N.Ranks())
    got = capture.grads

    ref = plain_peft(path, 4, adapters, adapted, model.lora["lora_alpha"], torch.float32,
                     conv1d=family == "gpt2", attn_implementation="eager")
    ref.eval()
    token_mean_objective(ref, batch).backward()
    want = {ours_name(n): p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() == set(adapters), family
    scale = torch.cat([g.flatten() for g in want.values()]).norm()
    assert scale > 0 and all(want[n].abs().sum() > 0 for n in want if n.endswith("lora_A"))
    diff = torch.cat([(got[n] - want[n]).flatten() for n in got]).norm()
    assert diff <= 1e-5 * scale, f"{family}: relative {diff / scale:.2e}"

    ours = dict(rollout.iter_full_tensors(model.module, torch.float32))
    with torch.no_grad():
        theirs = ref.merge_and_unload().state_dict()
    assert ours.keys() == theirs.keys(), family
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype, name
        # ours is merged in fp64 and rounded once, peft's in fp32: an ulp or so apart
        torch.testing.assert_close(ours[name], t, rtol=1e-6, atol=1e-7, msg=name)
    base = dict(model.module.named_parameters())
    assert all(not torch.equal(ours[f"{n}.weight"], base[f"{n}.base.weight"]) for n in adapted)


@pytest.mark.parametrize("family", REFUSED)
def test_lora_on_a_family_nanoareal_does_not_reproduce_is_refused_in_one_line(family, tmp_path,
                                                                            one_rank_group):
    path = build(tmp_path, family, REFUSED[family])
    with pytest.raises(UserError) as refused:
        modeling.load_model(N.Config(model=path, lora_rank=4), torch.device("cpu"))
    message = str(refused.value)
    assert "\n" not in message and f"({family})" in message and "not supported" in message
