"""Issue 28, compiled decoder layers (--compile, modeling.wrap_layers): the trainer's own path
(load_models, pack_microbatches, train_minibatch) gives eager's gradients to float rounding, with
and without every layer checkpointed around the compiled forward, for packed rows of changing
length without recompiling; a CPU adds no selective checkpointing to compiled layers (inductor
keeps about what it would); where it cannot or should not compile, the layers stay eager and the
start-up line says why. Multi-rank (FSDP2 and Ulysses) compiled runs: test_context_parallel.py."""

import os
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from reference import GradCapture

import modeling
import nanoareal as N
from rollout import Completion, Sample

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    """A world of one; and the environment as it was: inductor writes its own variables into
    os.environ, which would turn this worker's later CLI runs cold (tests/support/warm.py)."""
    environ = dict(os.environ)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


def train_grads(cfg, samples) -> tuple[object, dict, int]:
    """(model, gradients of one train_minibatch, distinct micro-batch lengths): a compile that
    fails, or a recompile for a new length, fails the test."""
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    mbs = N.pack_microbatches(samples, cfg)
    capture = GradCapture(model)
    with torch._dynamo.config.patch(suppress_errors=False):  # (the trainer's: run eager)
        # compiled here; the later rows of other lengths must reuse it (dynamic shapes)
        model.logprobs(mbs[0], cfg.temperature, grad=True,
                       entropy_grad=cfg.entropy_coef != 0)[0].sum().backward()
        model.module.zero_grad(set_to_none=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            N.train_minibatch(model, capture, N.loss.build_loss(cfg), mbs, cfg, N.Ranks())
    return model, capture.grads, len({len(mb.input_ids) for mb in mbs})


def why_eager(model) -> str | None:
    """Why the layers run eager, as the start-up line says it (None: they are compiled)."""
    line = next(x for x in model.summary.splitlines() if x.startswith("attention: "))
    said = re.search(r"; compute: [^;]+; (.*)$", line).group(1)
    assert (said == "layers compiled") == model.compiled, line
    return None if model.compiled else said


def rel_error(got: dict, want: dict) -> float:
    """The largest |got - want| of a parameter's gradient, over that gradient's largest |want|."""
    return max(float((got[n].double() - w).abs().max() / w.abs().max()) for n, w in want.items()
               if w.abs().max() > 0)


def test_compiled_layers_are_as_exact_as_eager_ones_with_and_without_checkpointing(
        monkeypatch):
    """Float rounding is all that differs (inductor fuses and reorders float32 work, HF's norms
    too): compiled float32 gradients are as far from the float64 eager ones as eager float32's."""
    cfg = N.validate_config(replace(N.Config(), micro_batch_tokens=24, entropy_coef=0.01), 1)
    samples = [Sample(g, [4 + g, 13, 5][: 2 + g % 2], Completion(
        [6 + g, 7, 8 + g, 1][: 2 + g % 3], [-0.5] * (2 + g % 3), "stop"),
        advantage=(-1.0) ** (g + k)) for g in range(6) for k in range(2)]
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", "")
    exact = train_grads(replace(cfg, dtype="float64"), samples)[1]
    eager, grads32, _ = train_grads(replace(cfg, compile=False), samples)
    assert why_eager(eager) == "eager (--no-compile)"
    rounding = rel_error(grads32, exact)
    assert 0 < rounding < 1e-4
    monkeypatch.setattr(modeling, "COMPILE_FROM", 0)  # the shipped model: far under 50M params
    for checkpointing in ("", "full"):
        monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", checkpointing)
        model, grads, lengths = train_grads(cfg, samples)
        assert why_eager(model) is None and model.checkpointing == checkpointing and lengths >= 2
        layer = modeling.decoder_layers(model.module)[0]
        compiled = layer.forward.args[0] if checkpointing else layer.forward  # (rerun's partial)
        assert hasattr(compiled, "_torchdynamo_orig_callable"), "the layer is not compiled"
        assert rel_error(grads, exact) < 2 * rounding, (rel_error(grads, exact), rounding)


def test_lora_adapters_compile_with_their_reference_policy(monkeypatch):
    """LoRA with a KL penalty (train_on_samples): the adapters (lora.py's) inside the compiled
    layers, the reference policy the same layers with the adapters off (a second variant,
    compiled once); float rounding is all that differs from the eager layers."""
    import lora
    cfg = N.validate_config(replace(N.Config(), lora_rank=4, kl_coef=0.1, micro_batch_tokens=24,
                                    lr=1e-3), 1)
    samples = [Sample(g, [4 + g, 13, 5], Completion([6 + g, 7, 8 + g, 1][: 2 + g % 3],
                                                    [-0.5] * (2 + g % 3), "stop"),
                      advantage=(-1.0) ** g * (1 + k)) for g in range(4) for k in range(2)]

    def grads(cfg) -> dict:
        torch.manual_seed(cfg.seed)  # as main() does: the adapters' initial values
        model, ref, _, _ = N.load_models(cfg, torch.device("cpu"), N.Ranks())
        assert ref.base_only and ref.module is model.module  # the frozen base: no second copy
        capture = GradCapture(model)
        with torch._dynamo.config.patch(suppress_errors=False):
            N.train_on_samples(model, ref, capture, N.loss.build_loss(cfg), samples, cfg,
                               N.Ranks())
        assert capture.grads and all(lora.is_adapter(n) for n in capture.grads)
        return capture.grads
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", "")
    # against eager float32 from the same adapters (float64 would draw other initial values);
    # a group's two copies of a sample have advantages 1 and 2: a gradient, not a cancellation
    # (with +1 and -1 the adapters' gradients were rounding noise, 15x their own size)
    eager = grads(replace(cfg, compile=False))
    assert max(float(g.abs().max()) for g in eager.values()) > 1e-3
    monkeypatch.setattr(modeling, "COMPILE_FROM", 0)
    assert rel_error(grads(cfg), eager) < 1e-4


def test_a_cpu_adds_no_selective_checkpointing_to_compiled_layers_and_plans_them_as_such(
        monkeypatch):
    """Inductor keeps what selective checkpointing would (the matmuls' outputs) and reruns the
    rest in backward itself: a CPU does not checkpoint compiled layers, and the start-up plan
    counts them as selective, without the "without checkpointing" alternative."""
    monkeypatch.setattr(modeling, "CHECKPOINT_LAYERS", None)
    monkeypatch.setattr(modeling, "SELECTIVE_FROM", 1)  # every budget counts as big
    cfg = N.validate_config(N.Config(), 1)
    eager = modeling.load_model(cfg, torch.device("cpu"))
    monkeypatch.setattr(modeling, "COMPILE_FROM", 0)
    compiled = modeling.load_model(cfg, torch.device("cpu"))
    assert eager.checkpointing == "selective" and why_eager(eager) is not None
    assert compiled.checkpointing == "" and why_eager(compiled) is None
    plan = lambda m: next(x for x in m.summary.splitlines() if x.startswith("memory per rank"))
    assert plan(eager) == modeling.memory_decisions(
        modeling.shape_of(eager.module, eager.mixed), 1, cfg.micro_batch_tokens, False)[2]
    assert re.sub(r" \([0-9.]+ without checkpointing\)", "", plan(eager)) == plan(compiled)
    assert "without checkpointing" in plan(eager)


def test_layers_stay_eager_where_compiling_cannot_run_or_would_not_pay(monkeypatch, capsys):
    cfg = N.validate_config(N.Config(), 1)
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    assert why_eager(model) == "eager (decoder layers under 50M parameters)"
    assert "eager (decoder layers under 50M parameters)" in capsys.readouterr().out
    monkeypatch.setattr(modeling, "COMPILE_FROM", 0)
    # torch's own patch for its config modules: pytest >= 9.2's monkeypatch.undo deletes what it
    # set there, and the option is then gone for the rest of the process
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/g++",)}):
        model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    assert why_eager(model).startswith("eager (") and "C++ compiler" in why_eager(model)
    assert not hasattr(modeling.decoder_layers(model.module)[0].forward,
                       "_torchdynamo_orig_callable")
    # a compiler again: what dynamo or inductor cannot compile runs eager
    with torch._dynamo.config.patch(suppress_errors=False):
        assert why_eager(N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]) is None
        assert torch._dynamo.config.suppress_errors


def test_a_toolchain_that_fails_at_the_first_launch_leaves_the_layers_eager_and_says_why(
        monkeypatch, capsys):
    """On a GPU without a C compiler triton fails at the first kernel launch, after compiling;
    under suppress_errors every layer would silently run eager while the plan counted compiled
    layers. A probe compiles and runs a tiny function at start-up, errors raised."""
    def compile_that_fails_at_launch(fn, **kwargs):
        def launch(*args, **kw):
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment")
        return launch
    monkeypatch.setattr(modeling, "COMPILE_FROM", 0)
    monkeypatch.setattr(torch, "compile", compile_that_fails_at_launch)
    cfg = N.validate_config(N.Config(), 1)
    model = N.load_models(cfg, torch.device("cpu"), N.Ranks())[0]
    assert why_eager(model).startswith("eager (torch.compile cannot run on this cpu: RuntimeError")
    assert "Failed to find C compiler" in capsys.readouterr().out
    assert model.checkpointing == ""  # planned and run as eager layers
