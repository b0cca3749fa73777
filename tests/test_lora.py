"""LoRA (--lora-rank, issue 29): the adapters' gradients against a plain peft model's padded
forward for every mode, merged weights against the unmerged forward, the KL reference as the
adapters switched off, the CLI end to end (engines get the merged policy, final/ and its
adapter), 2 ranks against 1 process, a kill -9 and a rerun against the uninterrupted run, bad
input. The SGLang syncs of a LoRA model: tests/test_rollout_sglang.py (stand-ins)."""

import json
import types
from pathlib import Path

import pytest
import torch
from reference import policy_token_loss, whole
from test_checkpoint import assert_same_run, finish, kill_9, start, wait_for
from test_nanoareal import TINY, _sample, read_metrics, run_cli

import loss as L
import modeling
import nanoareal as N
from cli import UserError

F64 = torch.float64


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def random_adapters(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every adapter weight of `model` (B too: with B = 0 the gradient of A is 0) set to noise;
    returns them by name."""
    g, values = torch.Generator().manual_seed(seed), {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                values[name] = 0.1 * torch.randn(local.shape, generator=g, dtype=F64)
                local.copy_(values[name])
    return values


def plain_peft(rank: int, adapters: dict, dtype=F64):
    """The reference: transformers' own model wrapped by peft.get_peft_model, same adapters."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(
        r=rank, lora_alpha=modeling.LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0))
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapters.items():
            own["base_model.model." + name].copy_(value)
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
    model = N.load_model(cfg, torch.device("cpu"), N.Ranks())
    adapters = random_adapters(model)
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if p.requires_grad} == set(adapters)
    before = {n: whole(p.detach()).clone() for n, p in params.items()}
    optimizer = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=1.0)
    N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg,
                       torch.device("cpu"), N.Ranks())

    ref = plain_peft(2, adapters)
    logp, mask = padded_logprobs(ref, samples, cfg.temperature)
    adv = torch.tensor([s.advantage for s in samples], dtype=F64)[:, None].expand_as(logp)
    token_loss, m = policy_token_loss({"policy_loss": "ppo"}, logp, logp.detach(), logp.detach(),
                                      adv, None, mask)
    L.aggregate(token_loss, m, mode=mode, group_ids=torch.tensor([s.group for s in samples]),
                denom_mask=mask, divisor=cfg.loss_aggregation_divisor).backward()
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in ref.named_parameters()
             if p.grad is not None}
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
    model, ref, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks())
    assert ref is None and cfg.lr == 1e-3  # LoRA's default rate
    dtypes = {(".lora_" in n, p.requires_grad, p.dtype) for n, p in model.named_parameters()}
    assert dtypes == {(False, False, torch.bfloat16), (True, True, torch.float32)}
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == list(map(id, adapters))
    samples = [_sample(g, [4 + g, 13, 5], [6 + g, 1], adv=(-1) ** g) for g in range(4)]
    _, stats = N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg,
                                  torch.device("cpu"), N.Ranks())
    assert stats["updated"] == 1 and stats["grad_norm"] > 0


def test_merged_weights_equal_the_unmerged_forward_and_the_kl_reference_is_the_base():
    """merge_lora's state, loaded in the plain model, gives the adapted model's log-probs to float
    rounding; WithoutAdapters gives the base's exactly (no second copy of the model)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("packed", modeling.packed_attention)
    load = lambda: AutoModelForCausalLM.from_pretrained(TINY).eval()
    model, base, merged = load(), load(), load()
    modeling.apply_lora(model, 4)
    random_adapters(model)
    merged.load_state_dict(dict(modeling.merge_lora(model.state_dict().items(), model)))
    ids = torch.tensor([[4, 13, 7, 14, 9, 3, 1, 5]])
    args = (ids, torch.arange(8)[None], torch.tensor([13, 7, 14, 9, 3, 1, 5, 0]))
    logprobs = {}
    for name, m in [("lora", model), ("base", base), ("merged", merged)]:
        m.set_attn_implementation("packed")
        m.policy_logprobs = types.MethodType(modeling.policy_logprobs, m)
        with torch.no_grad():
            logprobs[name] = m.policy_logprobs(*args)[0]
    with torch.no_grad():
        reference = modeling.WithoutAdapters(model).policy_logprobs(*args)[0]
    assert (logprobs["lora"] - logprobs["base"]).abs().max() > 1e-2  # the adapters matter
    torch.testing.assert_close(logprobs["merged"], logprobs["lora"], rtol=0, atol=2e-5)
    assert torch.equal(reference, logprobs["base"])
    with torch.no_grad():  # and the adapters are on again
        assert torch.equal(model.policy_logprobs(*args)[0], logprobs["lora"])


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
        for k in ("reward", "loss/policy", "grad_norm", "importance_weight/max"):
            assert two[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), k
    a1, a2 = (load_file(tmp_path / r / "final/adapter/adapter_model.safetensors")
              for r in ("one", "two"))
    assert set(a1) == set(a2) and len(a1) == 4 * 7 * 2
    for name in a1:  # AdamW amplifies rounding; the hf engine's fp32 head rounds by batch shape
        assert (a1[name] - a2[name]).norm() <= 2e-5 * a1[name].norm(), name


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


def test_bad_lora_input_is_one_line(monkeypatch, tmp_path):
    """peft missing; an adapter whose layers do not fit the base (another model's)."""
    from sglang_standin import save_tiny_llama
    from transformers import AutoModelForCausalLM

    find_spec = modeling.find_spec
    monkeypatch.setattr(modeling, "find_spec",
                        lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(UserError, match="--lora-rank needs peft: pip install"):
        modeling.check_lora(2, None, TINY)
    monkeypatch.undo()
    other = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "other"))
    modeling.apply_lora(other, 2)
    modeling.save_adapter({k: v for k, v in other.state_dict().items() if ".lora_" in k},
                          other.peft_config["default"], str(tmp_path / "other"),
                          tmp_path / "adapter")
    model = AutoModelForCausalLM.from_pretrained(TINY)
    with pytest.raises(UserError, match="does not fit this base model") as e:
        modeling.apply_lora(model, 2, str(tmp_path / "adapter"))
    assert "\n" not in str(e.value)
