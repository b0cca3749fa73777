"""Issue 27, memory that fits: the start-up plan (modeling.memory_plan, and docs/gpu.md's table made
by it), activation checkpointing of the decoder layers (exact), the model loaded on the meta device
and sharded as it loads, the entropy computed without a graph when nothing trains on it, and the
attention layout read on the host. The multi-rank side (checkpointing under FSDP2 and Ulysses, one
reduce-scatter per optimizer step) is in tests/test_context_parallel.py; measured peaks against
the plan are bench/bench_memory.py's (bench/README.md)."""

import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import warm
from reference import GradCapture, whole
from torch.utils._python_dispatch import TorchDispatchMode

import attention
import modeling
import nanoareal as N
import rollout
from cli import UserError
from rollout import Completion, Sample

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
    shape = modeling.Shape(params=1000, trainable=600, layers=2, hidden=8, intermediate=16,
                           kv_dim=4, vocab=10, frozen_bytes=2, compute_bytes=2)
    kw = dict(shape=shape, world=2, tokens=5)
    layer = 5 * (8 * 8 + 2 * (5 * 8 + 2 * 4 + 4 * 16))  # fp32 norm inputs + bf16 saved tensors
    plain = modeling.memory_plan(**kw, checkpointing="")
    assert plain["weights"] == (600 * 4 + 400 * 2) / 2
    assert plain["grads"] == 600 * 4 / 2 and plain["adamw"] == 2 * 600 * 4 / 2
    assert plain["activations"] == 2 * layer + layer
    assert plain["head"] == 6 * 5 * 10 and plain["gathered"] == 2 * 2 * ((1000 - 160) + 160)
    ckpt = modeling.memory_plan(**kw, checkpointing="full")
    assert ckpt["activations"] == 2 * 5 * 8 * 2 + 2 * layer
    assert ckpt["total"] == sum(v for k, v in ckpt.items() if k != "total")
    # selective: the input, q, k, v, attention output, o_proj's, gate, up and down_proj's outputs
    kept = modeling.memory_plan(**kw, checkpointing="selective")
    assert kept["activations"] == 2 * 5 * (5 * 8 + 2 * 4 + 2 * 16) * 2 + 2 * layer
    unsharded = modeling.memory_plan(**kw, checkpointing="full", grads_unsharded=True)
    assert unsharded["grads"] - ckpt["grads"] == 600 * 4  # the whole gradient on every rank
    # an engine that takes 1e6 while generating: the trainer keeps weights and AdamW meanwhile
    gen = modeling.memory_plan(**kw, checkpointing="full", engine=(1e6, 0.0))
    assert gen["total"] == gen["weights"] + gen["adamw"] + 1e6 and gen["engine"] == 1e6
    # a bf16 head over more rows than it keeps or chunks: its d weight summed in fp32 besides
    big = kw | {"shape": replace(shape, vocab=2**20), "tokens": 2 * modeling.HEAD_CHUNK}
    rows = max(modeling.HEAD_CHUNK, modeling.HEAD_KEEP // (4 * 2**20))
    head = modeling.memory_plan(**big, checkpointing="full")["head"]
    assert head == 6 * 2**20 * rows + 4 * 2**20 * 8
    fp32 = modeling.memory_plan(**big | {"shape": replace(big["shape"], compute_bytes=4)},
                                checkpointing="full")["head"]
    assert fp32 == 4 * 2**20 * rows  # fp32 weights: gradients summed in their own dtype
    held = modeling.memory_plan(**kw, checkpointing="full", engine=(0.0, 1e6))
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


CUDA = torch.device("cuda", 0)  # a descriptor: gpu_memory reads modeling.free_memory of it


def measured(monkeypatch, total: float, engine: float = 0.0, held=None):
    """modeling.gpu_memory of a GPU whose (free, total) are (total - engine, total) before the
    weights load: the difference is the engine's (`held`: its own measure, generating and
    released)."""
    monkeypatch.setattr(modeling, "free_memory", lambda device: (total - engine, total))
    return modeling.gpu_memory(CUDA, held)


def test_memory_decisions_defer_gradient_sync_only_where_it_fits_and_refuse_what_cannot(
        monkeypatch):
    """gpu = (free, total) before the weights load: the difference is the engine's. Deferred
    reduce-scatters keep a whole gradient per rank: only where the GPU holds it."""
    model = tiny_llama()
    n = sum(p.numel() for p in model.parameters())
    shape = modeling.shape_of(model, mixed=True)  # bf16 compute
    assert shape == modeling.Shape(n, n, 2, 32, 64, 16, 64, compute_bytes=2)
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", "full")
    # 2 ranks, 512 tokens, eager layers; gpu and engine as gpu_memory measures them
    decide = lambda gpu=None, engine=(0.0, 0.0), others=0: modeling.memory_decisions(
        shape, 2, 512, False, gpu, engine, others=others)
    checkpointing, defer, line = decide()  # a CPU: print, defer
    assert checkpointing == "full" and defer
    assert line.startswith("memory per rank (plan): weights ") and line.endswith(" MiB")
    plan = lambda unsharded, engine=0.0, releases=False: modeling.memory_plan(
        shape, 2, 512, "full", grads_unsharded=unsharded,
        engine=(engine, 0.0 if releases else engine))["total"]
    gpu = lambda *a, **k: decide(*measured(monkeypatch, *a, **k))
    between = (plan(False) + plan(True)) / 2
    assert gpu(plan(True))[1] is True
    assert gpu(between)[1] is False
    with pytest.raises(UserError, match=r"will not fit: weights .* = [\d.]+ of [\d.]+ GiB; lower "
                                        r"--micro-batch-tokens \(activations\)"):
        gpu(plan(False) * 0.9)
    # an engine holding 1 MiB: while it generates only (SGLang releases its memory) or always
    held = plan(False, 2**20)
    with pytest.raises(UserError):
        gpu(held - 1, 2**20)
    assert held - 1 >= plan(False, 2**20, releases=True)
    gpu(held - 1, 2**20, held=(2**20, 0))  # fits: no error
    assert decide(others=n)[2] != line  # the KL reference's weights
    # None (a GPU's default): no layer reruns in backward where the plan without it fits 80%
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", None)
    unchecked = modeling.memory_plan(shape, 2, 512, "", grads_unsharded=True)["total"]
    assert gpu(unchecked / 0.79)[0] == "" and gpu(unchecked / 0.81)[0] == "full"
    assert "without checkpointing" in gpu(unchecked / 0.81)[2]


def test_ranks_never_disagree_on_a_memory_decision(tmp_path):
    """Issue 43: ranks that see different free GPU memory (another process on one GPU, an engine
    on one rank) decide from what modeling.gpu_memory agrees over them (torchrun, 2 ranks, gloo):
    the least free and total, the most an engine holds. Decided alone, on each rank's own numbers,
    these two would differ on checkpointing and on gradient sync, and FSDP2's collectives would
    pair wrongly (a hang)."""
    tiny_llama().save_pretrained(tmp_path / "model")
    out = tmp_path / "reports.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(port),
           "tests/support/memory_worker.py", str(tmp_path / "model"), str(out)]
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = warm.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"worker failed\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    # alone: rank 0 neither checkpoints nor syncs every micro-batch, rank 1 does both
    assert [r["alone"][:2] for r in reports] == [["", True], ["full", False]]
    assert reports[0]["alone"][2] != reports[1]["alone"][2]  # their plan lines too
    own = [r["own"] for r in reports]
    least = [min(free for free, _ in own), min(total for _, total in own)]
    most = max(total - free for free, total in own)
    assert most > 0 and least[1] < max(total for _, total in own)  # neither rank's own numbers
    for r in reports:
        assert r["gpu"] == least and r["engine"] == [most, most]
        # load_model decided what memory_decisions makes of the agreed numbers
        assert [r["checkpointing"], r["defer_grad_sync"], r["plan"]] == r["decided"]
    decisions = [(r["checkpointing"], r["defer_grad_sync"], r["plan"]) for r in reports]
    assert decisions[0] == decisions[1]
    assert decisions[0][:2] == ("full", False) and decisions[0][2].startswith("memory per rank")


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
    samples = [Sample(g, [4 + g, 13, 5], Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                      advantage=1.0) for g in range(2)]
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    assert not any(isinstance(m, FSDPModule) for m in model.module.modules())
    layer = min(sum(p.numel() for p in b.parameters())
                for b in modeling.decoder_layers(model.module))
    with OpSizes() as mode:
        N.train_minibatch(model, GradCapture(model), N.loss.build_loss(cfg),
                          N.pack_microbatches(samples, cfg), cfg, N.Ranks())
    assert not [(op, n) for op, n in mode.ops if n >= layer and any(
        k in op for k in ("copy", "cat", "div"))]


def test_entropy_without_a_coefficient_has_no_graph_and_costs_backward_nothing(tmp_path):
    """With --entropy-coef 0 the entropy is a metric: computed once in forward, no graph; and
    the fused head's backward takes the entropy's term only when the entropy has a gradient: the
    log-probs' backward is op for op and bit for bit the same either way."""
    tiny_llama().double().save_pretrained(tmp_path)
    cfg = replace(N.Config(), model=str(tmp_path), dtype="float64", compile=False)
    model = modeling.load_model(cfg, torch.device("cpu")).module
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
    samples = [Sample(g, [4 + g, 13, 5], Completion([6 + g, 7, 8 + g, 1], [-0.5] * 4, "stop"),
                      advantage=(-1.0) ** (g + k)) for g in range(6) for k in range(2)]
    grads, calls = [], []
    for on in ("", "full", "selective"):
        monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", on)
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointing == on and model.defer_grad_sync
        count, mlp = [], modeling.decoder_layers(model.module)[0].mlp
        forward = mlp.forward  # (a rerun in backward calls no forward hooks)
        mlp.forward = lambda *a, _f=forward, _n=count, **k: _n.append(1) or _f(*a, **k)
        mbs = N.pack_microbatches(samples, cfg)
        assert len(mbs) >= 3
        capture = GradCapture(model)
        N.train_minibatch(model, capture, N.loss.build_loss(cfg), mbs, cfg, N.Ranks())
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
    samples = [Sample(g, [4 + g, 13, 5], Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                      advantage=1.0) for g in range(2)]

    def matmuls_in_backward(model) -> int:
        logprobs, _ = model.logprobs(N.pack_microbatches(samples, cfg)[0], cfg.temperature,
                                     grad=True)
        with CountOps() as mode:
            logprobs.sum().backward()
        return sum(op in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")
                   for op in mode.ops)
    counts = {}
    for on in ("", "full", "selective"):
        monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", on)
        counts[on] = matmuls_in_backward(N.load_models(cfg, torch.device("cpu"), N.Ranks())[0])
    assert counts["selective"] == counts[""] < counts["full"]
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", None)  # a CPU: selective once big
    for tokens, want in ((4096, ""), (8192, "selective")):  # x hidden 128: 2^19, 2^20
        big = N.validate_config(replace(N.Config(), micro_batch_tokens=tokens), 1)
        assert N.load_models(big, torch.device("cpu"), N.Ranks())[0].checkpointing == want
    # a GPU (load_models: its (free, total) as gpu_memory agrees them): every layer checkpointed
    # where the plan without checkpointing takes over 80% of it, none where it fits well
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    raw = modeling.memory_plan(modeling.shape_of(model.module, model.mixed), 1,
                               cfg.micro_batch_tokens, "", grads_unsharded=True)["total"]
    agreed = modeling.gpu_memory
    monkeypatch.setattr(modeling, "gpu_memory", lambda device, held=None: agreed(CUDA, held))
    for total, want in ((int(raw / 0.9), "full"), (2**50, "")):
        monkeypatch.setattr(modeling, "free_memory", lambda device, t=total: (t, t))
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointing == want and matmuls_in_backward(model) == counts[want]


def test_a_cpu_micro_batch_under_rerun_from_reruns_nothing(monkeypatch):
    """A CPU run checkpoints selectively by --micro-batch-tokens at start (the plan), then each
    micro-batch by its own layer input: one under RERUN_FROM runs its layers once, one at it
    runs each again in backward; the gradients are the same bit for bit."""
    from transformers import AutoConfig
    cfg = N.validate_config(replace(N.Config(), dtype="float64"), 1)
    samples = [Sample(g, [4 + g, 13, 5], Completion([6, 7, 8, 1], [-0.5] * 4, "stop"),
                      advantage=1.0) for g in range(2)]
    mb, runs, grads = N.pack_microbatches(samples, cfg)[0], [], []
    elements = len(mb.input_ids) * AutoConfig.from_pretrained(cfg.model).hidden_size
    for threshold in (elements + 1, elements):
        monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", None)  # the CPU's default
        monkeypatch.setattr(modeling, "SELECTIVE_FROM", 1)  # wrapped at start, whatever the budget
        monkeypatch.setattr(modeling, "RERUN_FROM", threshold)
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
        assert model.checkpointing == "selective"
        count, mlp = [], modeling.decoder_layers(model.module)[0].mlp
        forward = mlp.forward
        mlp.forward = lambda *a, _f=forward, _n=count, **k: _n.append(1) or _f(*a, **k)
        model.logprobs(mb, cfg.temperature, grad=True)[0].sum().backward()
        runs.append(len(count))
        grads.append([p.grad for p in model.module.parameters()])
    assert runs == [1, 2]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_synchronous_hf_engine_generates_with_the_trainers_own_tensors(tmp_path):
    """K = 0 on one rank: once resume() has run, the engine's parameters are the trainer's storage
    (no second copy; the optimizer's in-place steps are the sync; test_staleness's K = 0 run checks
    the metrics)."""
    cfg = N.validate_config(replace(N.Config(), run_dir=str(tmp_path)), 1)
    engine = rollout.make_engine(cfg, torch.device("cpu"), share=True)
    model, _, _, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks(), engine)
    N.resume(cfg, model, optimizer, engine, N.Ranks(), resuming=False)
    with torch.no_grad():
        theirs = {n: p.data_ptr() for n, p in model.module.named_parameters()}
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == theirs
    plain = rollout.make_engine(cfg, torch.device("cpu"))
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks(), plain)[0]
    with torch.no_grad():
        theirs = {p.data_ptr() for p in model.module.parameters()}
    assert not theirs & {p.data_ptr() for p in plain.model.parameters()}  # a copy of its own


def test_the_model_loads_sharded_with_its_weights_buffers_and_ties(tmp_path):
    """Built on the meta device, sharded, then filled from rank 0's copy: every weight and buffer
    (RoPE's inv_freq is in no state dict) equals from_pretrained's, a tied head stays tied."""
    from transformers import AutoModelForCausalLM

    tiny_llama(tie_word_embeddings=True).save_pretrained(tmp_path)
    cfg = replace(N.Config(), model=str(tmp_path))
    model = modeling.load_model(cfg, torch.device("cpu")).module
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
        attention.attention_layout(torch.tensor([[0, 3, 0, 0]], device="meta"), 3)
