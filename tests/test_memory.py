"""Issue 27, memory that fits: the start-up plan (modeling.memory_plan, and docs/gpu.md's table made
by it), activation checkpointing of the decoder layers (exact), the model loaded on the meta device
and sharded as it loads, the entropy computed without a graph when nothing trains on it, and the
attention layout read on the host. The multi-rank side (checkpointing under FSDP2 and Ulysses, one
reduce-scatter per optimizer step) is in tests/test_context_parallel.py; measured peaks against
the plan are bench/bench_memory.py's (bench/README.md)."""

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from reference import GradCapture, whole
from torch.utils._python_dispatch import TorchDispatchMode

import modeling
import nanoareal as N
import rollout
from cli import UserError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import memory_table  # noqa: E402

torch.set_num_threads(1)
GIB = 2**30


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """A world of one in this process (load_model shards with FSDP2), gone afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_memory_plan_parts_follow_their_formulas():
    """2 layers, hidden 8, MLP 16, kv 4, vocab 10 (untied), 1000 parameters of which 600 train and
    400 are frozen in bf16, 2 ranks, 5 tokens a rank."""
    kw = dict(params=1000, trainable=600, layers=2, hidden=8, intermediate=16, kv_dim=4, vocab=10,
              world=2, tokens=5, frozen_bytes=2)
    layer = 5 * (8 * 8 + 2 * (5 * 8 + 2 * 4 + 4 * 16))  # fp32 norm inputs + bf16 saved tensors
    plain = modeling.memory_plan(**kw, checkpointing=False)
    assert plain["weights"] == (600 * 4 + 400 * 2) / 2
    assert plain["grads"] == 600 * 4 / 2 and plain["adamw"] == 2 * 600 * 4 / 2
    assert plain["activations"] == 2 * layer + layer
    assert plain["head"] == 6 * 5 * 10 and plain["gathered"] == 2 * 2 * ((1000 - 160) + 160)
    ckpt = modeling.memory_plan(**kw, checkpointing=True)
    assert ckpt["activations"] == 2 * 5 * 8 * 2 + 2 * layer
    assert ckpt["total"] == sum(v for k, v in ckpt.items() if k != "total")
    # selective: the input, q, k, v, attention output, o_proj's, gate, up and down_proj's outputs
    kept = modeling.memory_plan(**kw, checkpointing="selective")
    assert kept["activations"] == 2 * 5 * (5 * 8 + 2 * 4 + 2 * 16) * 2 + 2 * layer
    unsharded = modeling.memory_plan(**kw, checkpointing=True, grads_unsharded=True)
    assert unsharded["grads"] - ckpt["grads"] == 600 * 4  # the whole gradient on every rank
    # an engine that takes 1e6 while generating: the trainer keeps weights and AdamW meanwhile
    gen = modeling.memory_plan(**kw, checkpointing=True, engine_generating=1e6)
    assert gen["total"] == gen["weights"] + gen["adamw"] + 1e6 and gen["engine"] == 1e6
    held = modeling.memory_plan(**kw, checkpointing=True, engine_training=1e6)
    assert held["total"] == ckpt["total"] + 1e6


def test_memory_plan_of_llama_8b_matches_the_issue():
    """Issue 27: 16 bytes a parameter is ~120 GiB before activations; the activations at 16384
    tokens are ~100 GiB without checkpointing and ~10x less with it."""
    shape = memory_table.MODELS["Llama-3.1-8B"]
    one = memory_table.plan(shape, 1, 16384, False)
    assert 115 < (one["weights"] + one["grads"] + one["adamw"]) / GIB < 125
    assert 90 < one["activations"] / GIB < 115
    assert memory_table.plan(shape, 1, 16384, True)["activations"] < one["activations"] / 8
    eight = memory_table.plan(shape, 8, 16384, True)
    assert eight["weights"] == pytest.approx(one["weights"] / 8)


def test_docs_gpu_memory_table_is_the_generated_one():
    assert memory_table.DOC.read_text() == memory_table.document(), (
        "docs/gpu.md's memory table is stale: run `python scripts/memory_table.py --write`")


def tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64) | kw))


def test_startup_memory_defers_gradient_sync_only_where_it_fits_and_refuses_what_cannot():
    """gpu = (free, total) before the weights load: the difference is the engine's. Deferred
    reduce-scatters keep a whole gradient per rank: only where the GPU holds it."""
    model = tiny_llama()
    args = (model, 2, 512, True, True)  # 2 ranks, 512 tokens, checkpointed, bf16 compute
    line, defer, _ = modeling.startup_memory(*args)  # a CPU: print, defer
    assert defer and line.startswith("memory per rank (plan): weights ") and line.endswith(" MiB")
    n = sum(p.numel() for p in model.parameters())
    plan = lambda unsharded, engine=0.0, releases=False: modeling.memory_plan(
        n, n, 2, 32, 64, 16, 64, 2, 512, True, grads_unsharded=unsharded,
        engine_generating=engine, engine_training=0.0 if releases else engine)["total"]
    gpu = lambda total, engine=0.0: (total - engine, total)
    between = (plan(False) + plan(True)) / 2
    assert modeling.startup_memory(*args, gpu(plan(True)))[1] is True
    assert modeling.startup_memory(*args, gpu(between))[1] is False
    with pytest.raises(UserError, match=r"will not fit: weights .* = [\d.]+ of [\d.]+ GiB; lower "
                                        r"--micro-batch-tokens \(activations\)"):
        modeling.startup_memory(*args, gpu(plan(False) * 0.9))
    # an engine holding 1 MiB: while it generates only (SGLang releases its memory) or always
    held = plan(False, 2**20)
    with pytest.raises(UserError):
        modeling.startup_memory(*args, gpu(held - 1, 2**20))
    assert held - 1 >= plan(False, 2**20, releases=True)
    modeling.startup_memory(*args, gpu(held - 1, 2**20), True)  # fits: no error
    frozen = modeling.startup_memory(*args, frozen_copies=1)[0]  # the KL reference's weights
    assert frozen != line
    # None (a GPU's default): no layer reruns in backward where the plan without it fits 80%
    unchecked = modeling.memory_plan(n, n, 2, 32, 64, 16, 64, 2, 512, False,
                                     grads_unsharded=True)["total"]
    choose = lambda total: modeling.startup_memory(model, 2, 512, None, True, gpu(total))[2]
    assert choose(unchecked / 0.79) is False and choose(unchecked / 0.81) is True
    assert "without checkpointing" in modeling.startup_memory(model, 2, 512, None, True,
                                                              gpu(unchecked / 0.81))[0]


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class OpSizes(TorchDispatchMode):
    """(op, elements of its first tensor argument) of every op run inside it."""
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.ops.append((str(func), 0 if first is None else first.numel()))
        return func(*args, **(kwargs or {}))


def test_one_rank_in_full_precision_trains_a_plain_model_with_no_copy_of_its_weights():
    """A world of one in full precision: no FSDP2, whose gathers and reduction there only copied
    (every weight twice and every gradient twice a step, each a fresh page-faulted mapping past
    32 MB: 0.5B shape 19 -> 14 s a step): the step copies, concatenates or divides no tensor as
    large as a layer."""
    from torch.distributed.fsdp import FSDPModule
    cfg = N.validate_config(replace(N.Config(), dtype="float64"), 1)
    samples = [N.Sample(g, [4 + g, 13, 5], N.Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                        advantage=1.0) for g in range(2)]
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    layer = min(sum(p.numel() for p in b.parameters()) for b in modeling.decoder_layers(model))
    with OpSizes() as mode:
        N.train_minibatch(model, GradCapture(model), N.loss.build_loss(cfg),
                          N.pack_microbatches(samples, cfg), cfg, torch.device("cpu"), N.Ranks())
    assert not [(op, n) for op, n in mode.ops if n >= layer and any(
        k in op for k in ("copy", "cat", "div"))]


def test_entropy_without_a_coefficient_has_no_graph_and_costs_backward_nothing(tmp_path):
    """With --entropy-coef 0 the entropy is a metric: computed once in forward, no graph; and
    the fused head's backward takes the entropy's term only when the entropy has a gradient: the
    log-probs' backward is op for op and bit for bit the same either way."""
    model = tiny_llama().double()
    model.save_pretrained(tmp_path)
    model, _ = modeling.load_causal_lm(str(tmp_path), torch.float64, torch.device("cpu"), 1,
                                       "auto", False)
    ids, pos = torch.randint(64, (1, 12)), torch.arange(12)[None]
    grads, backward_ops = [], []
    for entropy_grad in (True, False):
        lp, ent = modeling.policy_logprobs(model, ids, pos, ids[0].roll(-1), chunk=5,
                                           entropy_grad=entropy_grad)
        assert ent.requires_grad == entropy_grad and torch.isfinite(ent).all()
        with CountOps() as ops:
            lp.sum().backward()
        # autograd's own bookkeeping aside (a saved tensor unpacked, gradients accumulated)
        backward_ops.append([op for op in ops.ops if op not in ("aten.detach.default",
                                                                "aten.add_.Tensor")])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    assert backward_ops[0] == backward_ops[1]
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0)


def test_checkpointed_layers_rerun_in_backward_and_leave_gradients_unchanged(monkeypatch):
    """The trainer's own path (load_model, pack_microbatches, train_minibatch: three micro-batches,
    FSDP2 reduce-scatters deferred to the last) in float64, CHECKPOINT_LAYERS off, on, selective."""
    cfg = N.validate_config(replace(N.Config(), micro_batch_tokens=24, dtype="float64",
                                    entropy_coef=0.01), 1)
    samples = [N.Sample(g, [4 + g, 13, 5], N.Completion([6 + g, 7, 8 + g, 1], [-0.5] * 4, "stop"),
                        advantage=(-1.0) ** (g + k)) for g in range(6) for k in range(2)]
    grads, calls = [], []
    for on in (False, True, "selective"):
        monkeypatch.setattr(N, "CHECKPOINT_LAYERS", on)
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointed == on and model.defer_grad_sync
        count, mlp = [], modeling.decoder_layers(model)[0].mlp
        forward = mlp.forward  # (a rerun in backward calls no forward hooks)
        mlp.forward = lambda *a, _f=forward, _n=count, **k: _n.append(1) or _f(*a, **k)
        mbs = N.pack_microbatches(samples, cfg)
        assert len(mbs) >= 3
        capture = GradCapture(model)
        N.train_minibatch(model, capture, N.loss.build_loss(cfg), mbs, cfg,
                          torch.device("cpu"), N.Ranks())
        grads.append(capture.grads)
        calls.append(len(count) / len(mbs))
    assert calls == [1, 2, 2]  # checkpointed: every layer's forward again in backward
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grads[2][name], g, rtol=0, atol=0)  # the same ops, bit for bit


def test_selective_checkpointing_reruns_no_matmul_in_backward(monkeypatch):
    """Selective keeps every matmul's output: backward runs as many as without checkpointing,
    while full checkpointing runs each layer's forward matmuls again. A CPU run picks it by size;
    a GPU loads undecided and load_models wraps the layers only where its memory plan needs it."""
    cfg = N.validate_config(replace(N.Config(), dtype="float64"), 1)
    samples = [N.Sample(g, [4 + g, 13, 5], N.Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                        advantage=1.0) for g in range(2)]

    def matmuls_in_backward(model) -> int:
        logprobs, _ = N.microbatch_forward(model, N.pack_microbatches(samples, cfg)[0], cfg,
                                           torch.device("cpu"), N.Ranks(), grad=True)
        with CountOps() as mode:
            logprobs.sum().backward()
        return sum(op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
                   for op in mode.ops)
    counts = {}
    for on in (False, True, "selective"):
        monkeypatch.setattr(N, "CHECKPOINT_LAYERS", on)
        counts[on] = matmuls_in_backward(N.load_models(cfg, torch.device("cpu"), N.Ranks())[0])
    assert counts["selective"] == counts[False] < counts[True]
    monkeypatch.setattr(N, "CHECKPOINT_LAYERS", None)  # a CPU: selective once layer inputs are big
    for tokens, want in ((4096, False), (8192, "selective")):  # x hidden 128: 2^19, 2^20
        big = N.validate_config(replace(N.Config(), micro_batch_tokens=tokens), 1)
        assert N.load_models(big, torch.device("cpu"), N.Ranks())[0].checkpointed == want
    load, plan = N.load_model, modeling.startup_memory  # a GPU's (free, total): None, no limit
    monkeypatch.setattr(N, "load_model", lambda *a, **k: setattr(
        m := load(*a, **k), "checkpointed", None) or m)
    for gpu, want in ((None, True), ((2**50, 2**50), False)):
        monkeypatch.setattr(modeling, "startup_memory", lambda *a, gpu=gpu: plan(*a[:5], gpu,
                                                                                   *a[6:]))
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointed is want and matmuls_in_backward(model) == counts[want]


def test_a_cpu_micro_batch_under_rerun_from_reruns_nothing(monkeypatch):
    """A CPU run checkpoints selectively by --micro-batch-tokens at start (the plan), then each
    micro-batch by its own layer input: one under RERUN_FROM runs its layers once, one at it
    runs each again in backward; the gradients are the same bit for bit."""
    from transformers import AutoConfig
    cfg = N.validate_config(replace(N.Config(), dtype="float64"), 1)
    samples = [N.Sample(g, [4 + g, 13, 5], N.Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                        advantage=1.0) for g in range(2)]
    mb, runs, grads = N.pack_microbatches(samples, cfg)[0], [], []
    elements = len(mb.input_ids) * AutoConfig.from_pretrained(cfg.model).hidden_size
    for threshold in (elements + 1, elements):
        monkeypatch.setattr(N, "CHECKPOINT_LAYERS", None)  # the CPU's default
        monkeypatch.setattr(N, "SELECTIVE_FROM", 1)  # wrapped at start, whatever the budget
        monkeypatch.setattr(N, "RERUN_FROM", threshold)
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointed == "selective"
        count, mlp = [], modeling.decoder_layers(model)[0].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, _f=forward, _n=count, **k: _n.append(1) or _f(*a, **k)
        N.microbatch_forward(model, mb, cfg, torch.device("cpu"), N.Ranks(), grad=True)[0].sum(
            ).backward()
        runs.append(len(count))
        grads.append([p.grad for p in model.parameters()])
    assert runs == [1, 2]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_synchronous_hf_engine_generates_with_the_trainers_own_tensors(tmp_path):
    """K = 0 on one rank: once resume() has run, the engine's parameters are the trainer's storage
    (no second copy; the optimizer's in-place steps are the sync; test_staleness's K = 0 run checks
    the metrics)."""
    cfg = N.validate_config(replace(N.Config(), run_dir=str(tmp_path)), 1)
    engine = rollout.make_engine("hf", [], cfg.model, torch.device("cpu"), run_dir="unused",
                                 seed=0, share=True)
    model, _, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks(), engine)
    N.resume(cfg, model, optimizer, engine, N.Ranks(), resuming=False)
    with torch.no_grad():
        theirs = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == theirs
    plain = rollout.make_engine("hf", [], cfg.model, torch.device("cpu"), run_dir="unused", seed=0)
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks(), plain)[0]
    with torch.no_grad():
        theirs = {p.data_ptr() for p in model.parameters()}
    assert not theirs & {p.data_ptr() for p in plain.model.parameters()}  # a copy of its own


def test_the_model_loads_sharded_with_its_weights_buffers_and_ties(tmp_path):
    """Built on the meta device, sharded, then filled from rank 0's copy: every weight and buffer
    (RoPE's inv_freq is in no state dict) equals from_pretrained's, a tied head stays tied."""
    from transformers import AutoModelForCausalLM

    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    cfg = replace(N.Config(), model=str(tmp_path))
    model = N.load_model(cfg, torch.device("cpu"), N.Ranks())
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    theirs = dict(plain.named_parameters()) | dict(plain.named_buffers())
    ours = dict(model.named_parameters()) | dict(model.named_buffers())
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        mine = whole(ours[name])
        assert torch.equal(mine, t), name
    assert not model.training  # from_config builds in train mode: dropout must be off


def test_attention_layout_refuses_segments_on_a_device():
    """Packing makes the segments on the host; a device copy would sync every micro-batch."""
    with pytest.raises(ValueError, match="segments must be a CPU tensor"):
        modeling.attention_layout(torch.tensor([[0, 3, 0, 0]], device="meta"), 3)
