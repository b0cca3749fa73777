"""How nanoareal runs a Hugging Face causal LM: `load_model` returns a `Model`, the module and
every decision about how it runs (attention kernel, checkpointing, compiled layers, mixed
precision, gradient sync, LoRA), made once at load from what all ranks agree on. Its log-probs
come from the model's own head in vocabulary chunks (the plain head beside it, to read first);
`check_model` refuses a family it misreproduces; the memory plan decides checkpointing."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import socket
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import attention
import lora
import loss
from cli import UserError, on_rank0, why

HALF = (torch.float16, torch.bfloat16)
# selective checkpointing keeps these ops' outputs (a layer's matmuls and attention kernel)
KEPT_OPS = [
    getattr(torch.ops.aten, op).default
    for op in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
]
# model_type prefix -> (the config field that scales its head's logits, whether it divides by it)
HEAD_SCALES = {
    "granite": ("logits_scaling", True),
    "cohere": ("logit_scale", False),
    "hyperclovax": ("logits_scaling", False),
    "falcon_h1": ("lm_head_multiplier", False),
}
FAST_HEAD = True  # the chunked head (HeadLogprobs); False: plain_head, autograd's, to compare
HEAD_CHUNK = 1024  # the head's fp32 logits: rows at once (1024 x 150k: 0.6 GB)
HEAD_ROWS = (16, 256)  # rows a pass of the head's softmax takes on a CPU, on a GPU
HEAD_KEEP = 1 << 29  # bytes of logits kept from forward to backward (else a GEMM reruns them)
# the CPU engine packs weights of this many elements for oneDNN (pack_weights)
BIG_WEIGHT = 10**5
ATTENTION = "auto"  # auto | flash_attn | torch_varlen | sdpa | plain: force a path to compare
# checkpointing (exact: no dropout, a rerun op computes what it did): "full" reruns each decoder
# layer from its input (~10x less memory), "selective" its elementwise work alone (~half), ""
# none; None: decided, on a GPU by the memory plan, on a CPU by SELECTIVE_FROM
CHECKPOINT_LAYERS = None
SELECTIVE_FROM = 2**20  # a CPU: selective if a whole micro-batch's layer input has this many
# elements; yet a micro-batch's own under this many runs as is (135M: -12%)
RERUN_FROM = 2**19
NO_RERUN_UP_TO = 0.8  # a GPU checkpoints no layer while the plan without it is <= this share
# --compile: decoder layers' parameters; fewer gain less than it costs
COMPILE_FROM = 5 * 10**7
_PROBES = itertools.count()  # compile_verdict's probes, each compiled anew


@dataclass
class Model:
    """A causal LM as the trainer runs it. Decided once at load, the same on every rank."""

    module: nn.Module  # the HF model: FSDP2-sharded (several ranks or bf16), else plain
    device: torch.device
    attention: str  # the attention path: flash_attn, torch_varlen, sdpa or plain
    kernel: object = None  # its varlen kernel (None: padded or plain rows)
    checkpointing: str = ""  # what a layer keeps for backward: "full" its input, "selective"
    compiled: bool = False  # its decoder layers run through torch.compile
    mixed: bool = False  # bf16 compute, fp32 master weights (FSDP2's mixed precision)
    defer_grad_sync: bool = False  # FSDP2 reduces gradients once a step (they fit unsharded)
    lora: dict | None = None  # LoRA's config (r, lora_alpha, target_modules), or None
    base_only: bool = False  # LoRA's frozen base alone: the KL penalty's reference
    cp_group: object = None  # Ulysses: the ranks that split each row
    summary: str = ""  # the start-up lines that say all of the above

    def logprobs(
        self, mb, temperature: float, grad: bool = False, entropy_grad: bool = False
    ):
        """(log pi(target), entropy) [T] of a packed micro-batch at `temperature`. Inputs and
        layout are made on the host. A CP group (Ulysses): this rank runs its contiguous 1/N of
        the row, padded to a multiple of N by a segment of its own, and every rank's values are
        gathered (each rank sends its own to all, attention.Swap: backward sums the gradients
        their readers send back), the padding cut. A target of -1 is read by nothing: not
        scored (a prompt's prefix), so the head skips it. entropy_grad: a graph for the entropy
        (a bonus), else none."""
        ids, pos, targets, segments = mb.input_ids, mb.position_ids, mb.targets, mb.segments
        if mb.seq_ids is not None:  # a prompt's positions predict nothing read: not scored
            targets = targets.masked_fill(mb.seq_ids < 0, -1)
        T = len(ids)
        group = self.cp_group
        n = 1 if group is None else dist.get_world_size(group)
        r = 0 if group is None else dist.get_rank(group)
        pad = -T % n
        size = T + pad
        if pad:  # a sequence of its own, scored nowhere
            ids = F.pad(ids, (0, pad))
            pos = torch.cat([pos, torch.arange(pad)])
            targets = F.pad(targets, (0, pad), value=-1)
            segments = torch.cat([segments, segments.new_tensor([[T, pad, 0, 0]])])
        mine = slice(r * size // n, (r + 1) * size // n)
        targets = targets[mine]
        inputs = {
            "input_ids": ids[None, mine],
            "position_ids": pos[None, mine],
            "targets": targets,
            "scored": (targets >= 0).nonzero()[:, 0],
        }
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        layout = attention.attention_layout(
            segments, size, self.device, self.kernel, group, self.attention == "plain"
        )
        # the KL reference (base_only): LoRA's frozen base alone
        adapters = lora.disabled(self.module) if self.base_only else contextlib.nullcontext()
        with torch.set_grad_enabled(grad), adapters:
            out = as_root_forward(
                self.module,
                policy_logprobs,
                self.module,
                **inputs,
                layout=layout,
                temperature=temperature,
                entropy_grad=entropy_grad,
            )
        if group is None:
            return out
        # each rank's values, n copies, one to every rank: their gradients come back summed
        gathered = attention.Swap.apply(torch.stack(out).repeat(1, n), group, 1, 1)
        return gathered[:, :T].unbind()

    def set_grad_sync(self, sync: bool) -> None:
        """FSDP2: reduce-scatter the gradients in this backward (else they stay unsharded)."""
        if hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(sync)

    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]


def as_root_forward(module: nn.Module, fn, *args, **kwargs):
    """fn(*args, **kwargs) run as `module`'s forward for FSDP2: its root's parameters gathered
    before, its gradients reduced in backward (what register_fsdp_forward_method wraps a method
    with, without attaching one to the module); a plain module: fn as it is."""
    if not hasattr(module, "_get_fsdp_state"):
        return fn(*args, **kwargs)
    state = module._get_fsdp_state()
    args, kwargs = state._pre_forward(module, args, kwargs)
    return state._post_forward(module, args, fn(*args, **kwargs))


# -----------------------------------------------------------------------------
# loading: rank 0 reads the weights on the host, every rank shards a meta-device model
def load_model(
    cfg,
    device: torch.device,
    world: int = 1,
    cp_group=None,
    trainable: bool = True,
    memory: dict | None = None,
) -> Model:
    """cfg.model (an HF causal LM) as a Model: dropout off (its log-probs must be the sampler's),
    checked against its own forward, LoRA per cfg.lora_rank / cfg.lora_adapter, decisions made
    on the meta-device model, then sharded over `world` ranks (one rank in full precision: plain)
    and given rank 0's weights tensor by tensor: no rank holds a whole copy on `device`. `memory`:
    what the plan counts besides (memory_plan's gpu, engine, others); a UserError on every rank
    if the model cannot run here."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    AttentionInterface.register("packed", torch.compiler.disable(attention.packed_attention))
    mixed = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    if cfg.lora_rank and mixed:  # LoRA's frozen base in the compute dtype
        dtype = torch.bfloat16
    adapter = lora.read_config(cfg.lora_adapter)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    # the whole model on rank 0 alone
    full = on_rank0(_load_checked, cfg, dtype, cp_size, trainable, adapter, share=False)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(cfg.model, use_cache=False),
            dtype=dtype,
            attn_implementation="packed",
        )
    peft_config, described = lora.apply(module, cfg.lora_rank, adapter)
    tokens = -(-cfg.micro_batch_tokens // cp_size)  # a micro-batch's, on this rank
    model = decide(module, cfg, device, world, tokens, trainable, mixed, memory or {})
    model.cp_group = cp_group
    model.lora = peft_config
    model.summary = described + model.summary
    _shard(module, device, world, mixed)
    wrap_layers(module, model.compiled, model.checkpointing)
    module.to_empty(device=device).eval().tie_weights()  # to_empty unties a plain model
    state = {} if full is None else full.state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, state, options=options)
    for name, buffer in module.named_buffers():  # some are in no state dict (RoPE's inv_freq)
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    # LoRA trains its adapters alone (lora.apply froze the base); a frozen copy nothing
    if not trainable:
        module.requires_grad_(False)
    sum_gradients(module)  # the loss divides by the *global* normaliser: FSDP2 must sum ranks
    return model


def _load_checked(cfg, dtype: torch.dtype, heads_divisor: int, check: bool, adapter):
    """cfg.model whole on the host, checked (before its adapters: they start at zero or load
    after), with its adapters (`adapter`: cfg.lora_adapter's config); a UserError if it cannot
    run here."""
    from transformers import AutoModelForCausalLM

    path = cfg.model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_cache=False, attn_implementation="packed"
        ).eval()
    except (OSError, ValueError) as e:  # no weights, an unknown architecture, ...
        raise UserError(f"--model {path}: cannot load a causal LM ({why(e)})") from None
    text = model.config.get_text_config()
    if text.num_attention_heads % heads_divisor:  # each CP rank attends with H/N whole heads
        raise UserError(
            f"config error: --cp-size {heads_divisor} must divide the model's "
            f"{text.num_attention_heads} attention heads"
        )
    problem = check_model(model, text.vocab_size) if check else None
    if problem:
        raise UserError(f"--model {path} ({text.model_type}) is not supported: {problem}")
    lora.apply(model, cfg.lora_rank, adapter)
    if cfg.lora_adapter:
        lora.load_weights(model, cfg.lora_adapter)
    return model


def decide(
    module: nn.Module,
    cfg,
    device,
    world: int,
    tokens: int,
    trainable: bool,
    mixed: bool,
    memory: dict,
) -> Model:
    """Every decision about the model, from its meta-device shapes and what all ranks agree on:
    attention path, compiled layers, checkpointing and gradient sync (the memory plan)."""
    softcap = bool(getattr(module.config.get_text_config(), "attn_logit_softcapping", None))
    try:
        path, kernel, reason = attention.choose_attention(ATTENTION, device, mixed, softcap)
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    eager = compile_verdict(module, device) if cfg.compile else "eager (--no-compile)"
    compute = (
        "bf16 (fp32 master weights)" if mixed else str(module.dtype).removeprefix("torch.")
    )
    because = f" ({reason})" if reason else ""
    summary = f"attention: {path}{because}; compute: {compute}; {eager or 'layers compiled'}"
    # a frozen copy: no backward
    checkpointing = ""
    defer = False
    if trainable:
        checkpointing, defer, plan = memory_decisions(
            shape_of(module, mixed), world, tokens, eager is None, **memory
        )
        summary += f"\n{plan}"
    return Model(
        module,
        device,
        path,
        kernel,
        checkpointing,
        eager is None,
        mixed,
        defer,
        summary=summary,
    )


def _shard(module: nn.Module, device, world: int, mixed: bool) -> None:
    """FSDP2: a unit per decoder layer + the root. One rank in full precision stays plain: FSDP2
    would only copy every weight and gradient twice a step (fresh buffers: 0.5B 19 -> 14 s)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if world == 1 and not mixed:
        return
    mp = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if mixed else {}
    mesh = init_device_mesh(device.type, (world,))
    for block in [*decoder_layers(module), module]:  # each decoder layer, then the root
        fully_shard(block, mesh=mesh, **mp)


def sum_gradients(module: nn.Module) -> None:
    """Make FSDP2 sum, not average, gradients: on every FSDP module (the setters act on its own
    parameters), forced sums (a divide factor alone reduces with PREMUL_SUM, which gloo rejects);
    one rank's average is its sum, and a factor, even 1, divides every gradient: none there."""
    from torch.distributed.fsdp import FSDPModule

    if dist.get_world_size() == 1:
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one, innermost first: modules of the classes the model never
    splits (`_no_split_modules`), else the children of its longest ModuleList."""
    names = set(model._no_split_modules or ())
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return (blocks or list(max(lists, key=len, default=[])))[::-1]


def adamw(params: list, **kwargs) -> torch.optim.AdamW:
    """Fused AdamW (CPU: 33 ms a step looped, 8 foreach, 5), its state made now as its first step
    would, before any activation: made in their freed memory, the next step's fault in afresh."""
    optimizer = torch.optim.AdamW(params, fused=True, **kwargs)
    for p in params:
        optimizer.state[p] = {
            "step": torch.zeros((), dtype=torch.float32, device=p.device),
            "exp_avg": torch.zeros_like(p),
            "exp_avg_sq": torch.zeros_like(p),
        }
    return optimizer


# -----------------------------------------------------------------------------
# compiled layers and checkpointing (the plain version of both: eager layers, all kept)
def compile_verdict(module: nn.Module, device: torch.device) -> str | None:
    """None if the decoder layers are to be compiled, else why they run eager: too small to pay,
    or torch.compile cannot build and run a probe kernel on `device` (inductor needs a C++
    compiler on a CPU; on a GPU, triton builds its launcher with a C compiler at the first
    launch). Errors are raised here: under suppress_errors a missing compiler would silently run
    eager while the memory plan counts compiled layers."""
    size = sum(p.numel() for m in decoder_layers(module) for p in m.parameters())
    if size < COMPILE_FROM:
        return f"eager (decoder layers under {COMPILE_FROM / 1e6:g}M parameters)"
    probe = lambda x: torch.sin(x) * 2 + 1
    # compiled afresh
    probe.__code__ = probe.__code__.replace(co_name=f"probe_{next(_PROBES)}")
    try:
        with torch._dynamo.config.patch(suppress_errors=False):
            torch.compile(probe, dynamic=False)(torch.ones(8, device=device))
    except Exception as e:
        return f"eager (torch.compile cannot run on this {device.type}: {why(e)})"
    return None


def wrap_layers(module: nn.Module, compiled: bool, checkpointing: str) -> None:
    """Each decoder layer's forward, `compiled`: torch.compile'd (dynamic shapes: a new row length
    does not recompile; the attention kernel eager): inductor fuses the elementwise work and
    reruns it in backward. Then activation checkpointing, `checkpointing` "full" or "selective"
    ("": none): each layer keeps only its inputs for backward and runs its forward again there;
    "selective" also keeps what KEPT_OPS return, so the rerun is the elementwise work alone
    (norms, RoPE, activation, products). Non-reentrant, inside FSDP2's hooks (they gather the
    layer's weights for the rerun too); a CP all-to-all inside reruns on every rank alike (equal
    chunks: Model.logprobs)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as keeping

    selective = checkpointing == "selective"
    kw = {"context_fn": functools.partial(keeping, KEPT_OPS)} if selective else {}
    # a CPU's own choice (selective) skips small micro-batches' reruns: a layer input under
    # RERUN_FROM elements runs as is
    from_elements = RERUN_FROM if selective and CHECKPOINT_LAYERS is None else 0
    if compiled:  # what fails to compile runs eager (a warning)
        torch._dynamo.config.suppress_errors = True
    for layer in decoder_layers(module):
        if compiled:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        if checkpointing:
            layer.forward = functools.partial(_maybe_rerun, layer.forward, from_elements, kw)


def _maybe_rerun(forward, from_elements: int, kw: dict, *args, **kwargs):
    hidden = args[0] if args else kwargs["hidden_states"]
    if hidden.numel() < from_elements:
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, **kw, **kwargs
    )


# -----------------------------------------------------------------------------
# the memory plan
@dataclass(frozen=True)
class Shape:
    """What the memory plan reads of a model (parameters in elements, sizes in bytes)."""

    params: int  # every parameter (LoRA: the base's too)
    trainable: int  # those with gradients and AdamW state
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int
    vocab: int
    tied: bool = False
    master_bytes: int = 4  # a trainable parameter's
    frozen_bytes: int = 4  # a frozen one's (LoRA's base)
    compute_bytes: int = 4  # an activation's (bf16 compute: 2)


def parameter_count(path: str) -> int:
    """The parameters of the causal LM at `path`, counted on the meta device (nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return module.num_parameters()


def shape_of(module: nn.Module, mixed: bool) -> Shape:
    text = module.config.get_text_config()
    heads = text.num_attention_heads
    hidden = text.hidden_size
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # LoRA trains its adapters alone (lora.apply froze the base), else every parameter
    master = next(p for p in module.parameters() if p.requires_grad).element_size()
    return Shape(
        module.num_parameters(),
        module.num_parameters(only_trainable=True),
        text.num_hidden_layers,
        hidden,
        getattr(text, "intermediate_size", None) or 4 * hidden,
        kv_heads * head_dim,
        text.vocab_size,
        bool(getattr(text, "tie_word_embeddings", False)),
        master,
        module.dtype.itemsize,  # the first parameter's: the base's (an embedding)
        2 if mixed else master,
    )


def memory_plan(
    shape: Shape,
    world: int,
    tokens: int,
    checkpointing: str,
    *,
    engine: tuple[float, float] = (0.0, 0.0),
    grads_unsharded: bool = False,
    others: int = 0,
) -> dict[str, float]:
    """Peak bytes per rank of a training step of a decoder LM FSDP2-sharded over `world` ranks (one
    in full precision: plain), by part, and "total"; `tokens` a micro-batch's positions on this
    rank; `others` the parameters of frozen models beside it (the KL reference, a teacher).
    Activations saved per token and layer: the RMSNorms' fp32 inputs and outputs, q, k, v,
    attention output, o_proj input, the MLP's gate, SiLU, up and product; checkpointed, each
    layer's input ("selective", compiled layers: and what its matmuls and attention return), plus
    one layer rerun. "gathered": FSDP2's unsharded params and grads (two layers, the root);
    `grads_unsharded`: whole grads until the step. The engine holds engine[0] while it
    generates, engine[1] while the trainer trains."""
    s = shape
    c = s.compute_bytes
    fsdp = world > 1 or c != s.master_bytes  # load_model's rule: ranks, or bf16 compute
    root = s.vocab * s.hidden * (1 if s.tied else 2)
    per_token = 8 * s.hidden + c * (5 * s.hidden + 2 * s.kv_dim + 4 * s.intermediate)
    layer = tokens * per_token
    # per token, a checkpointed layer keeps its input (selective: and its matmuls' outputs)
    kept = s.hidden
    if checkpointing == "selective":
        kept = 5 * s.hidden + 2 * s.kv_dim + 2 * s.intermediate
    if checkpointing:
        saved = s.layers * tokens * kept * c
    else:
        saved = s.layers * layer
    frozen = (s.params - s.trainable) * s.frozen_bytes + others * s.master_bytes
    # HeadLogprobs' peak: fp32 logits of the rows kept or of one chunk (a half head: also their
    # half copy), and summed over chunks, a half head's d weight in fp32
    logit_bytes = max(4, c)
    rows = min(tokens, max(HEAD_CHUNK, HEAD_KEEP // (logit_bytes * s.vocab)))
    accumulator = 4 * s.vocab * s.hidden if c < 4 and tokens > rows else 0
    plan = {
        "weights": (s.trainable * s.master_bytes + frozen) / world,
        "grads": s.trainable * s.master_bytes * (1 / world + (grads_unsharded and fsdp)),
        "adamw": 2 * s.trainable * s.master_bytes / world,
        "activations": saved + layer * (2 if checkpointing else 1),
        "head": (logit_bytes + c % 4) * s.vocab * rows + accumulator,
        "gathered": fsdp * 2 * c * (2 * (s.params - root) / s.layers + root),
        "engine": max(engine),
    }
    training = sum(plan.values()) - plan["engine"] + engine[1]
    plan["total"] = max(plan["weights"] + plan["adamw"] + engine[0], training)
    return plan


def memory_decisions(
    shape: Shape,
    world: int,
    tokens: int,
    compiled: bool,
    gpu: tuple[int, int] | None = None,
    engine: tuple[float, float] = (0, 0),
    others: int = 0,
) -> tuple[str, bool, str]:
    """(checkpointing, whether gradients stay unsharded until the step, the plan's line). `gpu`:
    (free, total) bytes before the weights loaded, the least over ranks (None: a CPU, whose
    decisions do not depend on memory); `engine`: what the engine holds while it generates and
    while the trainer trains. A UserError if nothing fits."""
    # inductor keeps what selective checkpointing keeps
    plain = "selective" if compiled else ""
    capacity = None if gpu is None else gpu[1]
    plan_for = functools.partial(
        memory_plan, shape, world, tokens, engine=engine, others=others
    )
    raw = plan_for(plain, grads_unsharded=True)
    checkpointing = CHECKPOINT_LAYERS
    # decided: on a CPU, selective where a layer input is big; on a GPU, full only where the
    # plan without it does not fit well
    if checkpointing is None and capacity is None:
        big = not compiled and tokens * shape.hidden >= SELECTIVE_FROM
        checkpointing = "selective" if big else ""
    elif checkpointing is None:
        checkpointing = "full" if raw["total"] > NO_RERUN_UP_TO * capacity else ""
    planned = checkpointing or plain
    plan = plan_for(planned, grads_unsharded=True)
    defer = capacity is None or plan["total"] <= capacity
    if not defer:
        plan = plan_for(planned)
    # the plan in one line, in GiB (MiB when small)
    unit, scale = ("GiB", 2**30) if plan["total"] >= 2**30 or capacity else ("MiB", 2**20)
    f = lambda b: f"{b / scale:.1f}"
    line = " + ".join(f"{k} {f(v)}" for k, v in plan.items() if k != "total" and v)
    if checkpointing:
        line += f" ({f(raw['activations'])} without checkpointing)"
    line += f" = {f(plan['total'])}"
    if capacity:
        line += f" of {f(capacity)}"
    line += f" {unit}"
    if capacity is not None and plan["total"] > capacity:
        raise UserError(
            f"config error: this will not fit: {line}; lower --micro-batch-tokens "
            "(activations), raise --cp-size, or use more GPUs (weights, grads and "
            "AdamW are sharded over ranks)"
        )
    return checkpointing, defer, f"memory per rank (plan): {line}"


def gpu_memory(device: torch.device, held: tuple[int, int] | None = None):
    """(free, total) bytes of this rank's GPU (None on a CPU) and what its engine holds while it
    generates and while released (`held`: its own measure; else all it holds now, kept while
    training). Agreed over ranks, the least free and the most held: every memory decision must
    be the same on every rank, or FSDP2's collectives pair wrongly (a hang)."""
    if device.type != "cuda":
        return None, (0.0, 0.0)
    free, total = free_memory(device)
    used = total - free  # the engine's and anything else's, before the trainer loads
    training = used if held is None else used - (held[0] - held[1])
    vec = torch.tensor([free, total, -used, -training], dtype=torch.float64)
    free, total, used, training = loss.all_reduce_vector(vec, op=dist.ReduceOp.MIN).tolist()
    return (int(free), int(total)), (-used, -training)


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device` now (a GPU)."""
    return torch.cuda.mem_get_info(device)


# -----------------------------------------------------------------------------
# log-probs: the model's body, then its own head on the scored positions
def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32, or `dtype` if wider (fp64): what the head's logits and sums are computed in."""
    return torch.promote_types(dtype, torch.float32)


def head_transform(config) -> tuple[float, float | None]:
    """(scale, softcap) a family's forward applies to its lm_head output: logits * scale, then
    softcap * tanh(logits / softcap). check_model catches a family that applies something else."""
    text = config.get_text_config()
    scale = 1.0
    for family, (name, divide) in HEAD_SCALES.items():
        value = getattr(text, name, None)
        if text.model_type.startswith(family) and value:
            scale = 1.0 / value if divide else float(value)
    return scale, getattr(text, "final_logit_softcapping", None) or None


def policy_logprobs(
    model,
    input_ids,
    position_ids,
    targets,
    temperature: float = 1.0,
    segments: Tensor | None = None,
    layout=None,
    entropy_grad: bool = True,
    scored: Tensor | None = None,
    chunk: int = HEAD_CHUNK,
):
    """(log pi(target_t | prefix), entropy) [T] of a packed row by `segments` (default: one sequence
    per run of positions from 0) or its `layout`; entropy_grad=False: no entropy graph.
    `scored`: the positions read (an index, default all): the head runs there alone, the rest 0."""
    if layout is None:
        if segments is None:
            segments = attention.segments_from_positions(position_ids.cpu())
        layout = attention.attention_layout(segments, input_ids.shape[-1], input_ids.device)
    hidden = model.base_model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, layout=layout
    ).last_hidden_state[0]
    # TRL's logits_to_keep: a shared prompt's prefix predicts nothing read
    if scored is not None:
        hidden, targets = hidden[scored], targets[scored]
    head = model.get_output_embeddings()
    # both heads' inputs: (hidden, weight, bias, targets, temperature, scale, softcap)
    args = (hidden, head.weight, getattr(head, "bias", None), targets, temperature)
    args += head_transform(model.config)
    if FAST_HEAD:
        keep = HEAD_KEEP if torch.is_grad_enabled() else 0
        out = HeadLogprobs.apply(*args, chunk, entropy_grad, keep)
    else:
        out = plain_head(*args, entropy_grad)
    if scored is None:
        return out
    return tuple(x.new_zeros(input_ids.shape[-1]).index_copy(0, scored, x) for x in out)


def plain_head(
    hidden,
    weight,
    bias,
    targets,
    temperature: float,
    scale: float,
    softcap: float | None,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """The head as written: x = softcap(scale (hW^T + b)) / T in fp32 at least for every row at
    once, log p = log_softmax(x), (log p(target), H = -sum_v p_v log p_v); autograd's backward.
    HeadLogprobs computes the same in chunks, in less memory and fewer GEMMs."""
    up = at_least_fp32(hidden.dtype)
    logits = F.linear(hidden.to(up), weight.to(up), None if bias is None else bias.to(up))
    logits = logits * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logp = torch.log_softmax(logits / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    if not entropy_grad:
        entropy = entropy.detach()
    return logp.gather(-1, targets[:, None])[:, 0], entropy


class HeadLogprobs(torch.autograd.Function):
    """plain_head, chunked: x = softcap(scale (hW^T + b)) / T in fp32 at least (bf16 logits err
    by ~0.06 at 20, more than the ratio clip tolerates). x [T, V] is kept for backward if at most
    `keep` bytes (else a GEMM reruns it); there d/dx = g_lp (onehot(y) - p) - g_H p (log p + H),
    times scale / T (1 - tanh^2 under a softcap), overwrites it for two GEMMs. Exact; without
    `h_grad`: no d/dH."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temp, scale, softcap, chunk, h_grad, keep
    ):
        ctx.set_materialize_grads(False)
        up = at_least_fp32(hidden.dtype)
        kept = None  # x stays for backward when it fits `keep`: one chunk of every row
        if len(hidden) * len(weight) * up.itemsize <= keep:
            kept = []
            chunk = max(len(hidden), 1)
        ctx.kept = kept
        ctx.args = (temp, scale, softcap, chunk)
        lp_out = hidden.new_empty(len(hidden), dtype=up)
        entropy = torch.empty_like(lp_out)
        for rows, x in _head_blocks(hidden, weight, bias, *ctx.args, kept=kept):
            lp = torch.log_softmax(x, -1)
            lp_out[rows] = lp.gather(-1, targets[rows, None])[:, 0]
            p = torch.exp(lp, out=x if kept is None else None)
            entropy[rows] = -torch.linalg.vecdot(p, lp)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy if h_grad else None)
        if not h_grad:
            ctx.mark_non_differentiable(entropy)
        return lp_out, entropy

    @staticmethod
    def backward(ctx, g_lp, g_h):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        temperature, scale, softcap, chunk = ctx.args
        # d/dz is d/dx times scale / T
        g_lp, g_h = (g if g is None else g * (scale / temperature) for g in (g_lp, g_h))
        # d weight and d bias sum over chunks: in fp32 at least, rounded once (a half sum rounds
        # at every chunk); one chunk writes them in their own dtype
        up = at_least_fp32(hidden.dtype)
        inputs = (hidden, weight, bias)
        grads = [None] * 3
        for i, x in enumerate(inputs):
            summed = i > 0 and len(hidden) > chunk
            if ctx.needs_input_grad[i]:
                grads[i] = torch.zeros_like(x, dtype=up if summed else x.dtype)
        for rows, x in _head_blocks(hidden, weight, bias, *ctx.args, grads, ctx.kept):
            cap = 1.0
            if softcap:  # d softcap tanh(u / softcap) / du = 1 - tanh^2
                cap = (x * (temperature / softcap)).square_().neg_().add_(1)
            lp = torch.log_softmax(x, -1)
            p = torch.exp(lp, out=x)  # d/dx over x: -p (g_lp + g_H (log p + H)), + g_lp at y
            k = 0
            if g_h is not None:
                k = lp.add_(entropy[rows, None]).mul_(g_h[rows, None])
            if g_lp is not None:
                k = k + g_lp[rows, None]
            p.mul_(k).neg_()
            if g_lp is not None:
                p.scatter_add_(-1, targets[rows, None], g_lp[rows, None])
            p.mul_(cap)
        grads = [g if g is None else g.to(x.dtype) for g, x in zip(grads, inputs)]
        return *grads, *[None] * 7


def _head_blocks(
    hidden, weight, bias, temperature, scale, softcap, chunk, grads=None, kept=None
):
    """(rows, x) HEAD_ROWS rows at a time: logits x = softcap(scale z) / T in place in z = hW^T + b
    (fp32 at least), `chunk` rows at a time in one buffer, or `kept` (forward appends z, backward
    pops it). With `grads` [hidden, weight, bias]: once the caller overwrote a chunk by d/dz, its
    half GEMMs where they run: d hidden (a sum over V) out in fp32 (cuBLAS may split-K a half
    output in bf16), d weight summed in grads[1]'s dtype."""
    up = at_least_fp32(hidden.dtype)
    again = not (grads and kept)  # logits to compute (not kept from forward)
    rows = HEAD_ROWS[hidden.device.type != "cpu"]
    buf = None
    for i in range(0, len(hidden), chunk):
        h = hidden[i : i + chunk]
        if not again:
            z = kept.pop(0)
        elif buf is None or not h.dtype == weight.dtype == up:
            z = buf = _mm(h, weight.t(), up)
        else:  # fp32: into the first chunk's buffer
            z = torch.mm(h, weight.t(), out=buf[: len(h)])
        if again and bias is not None:
            z.add_(bias)
        for j in range(0, len(h), rows):
            x = z[j : j + rows]
            if again:  # the model's ops, then / T (kept logits had them)
                x.mul_(scale)
                if softcap:
                    x.div_(softcap).tanh_().mul_(softcap)
                x.div_(temperature)
            yield slice(i + j, i + j + len(x)), x
        if kept is not None and grads is None:
            kept.append(z)  # forward's (one chunk): backward's x
        if grads:  # the chunk's share of d hidden (its rows), d weight and d bias (summed)
            g = z.to(h.dtype)
            if grads[0] is not None:
                grads[0][i : i + len(h)] = _mm(g, weight, up)
            if grads[1] is not None and g.dtype == up:
                grads[1].addmm_(g.t(), h)
            elif grads[1] is not None:
                grads[1].add_(_mm(g.t(), h, grads[1].dtype))
            if grads[2] is not None:
                grads[2].add_(z.sum(0))


@functools.cache
def mm_out_dtype_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm(a, b, out_dtype=torch.float32) runs here (torch 2.13: CUDA and XPU kernels
    for fp16/bf16 inputs, no CPU one). Probed once, without autograd: mm.dtype has no derivative."""
    # NotImplementedError: no kernel on this device; TypeError: an older torch
    try:
        x = torch.ones(1, 1, device=device, dtype=dtype)
        return (
            dtype in HALF and torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
        )
    except Exception:
        return False


def _mm(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """a @ b accumulated in fp32 at least, as out_dtype: a half GEMM where it runs, else upcast."""
    if a.dtype == b.dtype and mm_out_dtype_runs(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    up = at_least_fp32(torch.promote_types(a.dtype, b.dtype))
    return (a.to(up) @ b.to(up)).to(out_dtype)


# -----------------------------------------------------------------------------
# the CPU engine's matmuls
def pack_weights(weights: list[Tensor], rows: int) -> dict[int, Tensor]:
    """{id(W): oneDNN's copy of W, reordered once for `rows`-row inputs} of the big fp32 weights of
    the CPU engine's model for one generate call (the trainer changes them every step). A few-row
    matmul on a plain W re-blocks W at every call, a pass over it as long as the product: 135M
    shape, 16 rows, 2 threads: 2x the decode's matmuls. {} where oneDNN is absent: F.linear."""
    if not torch.backends.mkldnn.is_available():
        return {}
    return {
        id(w): torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
        for w in weights
        if w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.numel() >= BIG_WEIGHT
    }


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, packed: dict | None) -> Tensor:
    """F.linear(x, W, b), on W's packed copy where `packed` holds one (the same rows to ~1e-6)."""
    w = (packed or {}).get(id(weight))
    if w is None or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def head_logits(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, packed: dict | None = None
) -> Tensor:
    """The sampler's logits hW^T (+ b) [n, V] in fp32 at least by a half GEMM where one runs."""
    if hidden.dtype == weight.dtype == torch.float32:
        logits = linear(hidden, weight, None, packed)
    else:
        logits = _mm(hidden, weight.t(), at_least_fp32(hidden.dtype))
    return logits if bias is None else logits + bias


# -----------------------------------------------------------------------------
# checks: a model source that exists, a family nanoareal reproduces
def check_model_source(name: str) -> None:
    """--model is a model directory (config.json, tokenizer files) or a cached or reachable hub id:
    a wrong path is one line at once, not a minute of retries against an unreachable hub."""
    path = Path(name).expanduser()
    bad = lambda problem: UserError(f"--model {name}: {problem}")
    if path.exists():
        if not (path / "config.json").is_file():
            raise bad("not a model directory (it has no config.json)")
        files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if not any((path / f).is_file() for f in files):
            raise bad(
                f"no tokenizer files there (none of {', '.join(files)}); save the tokenizer "
                "with the model"
            )
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:  # a path, not an org/name id
        raise bad("no such directory")
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except Exception:  # not a valid repo id either
        raise bad("no such directory, nor a Hugging Face hub id") from None
    where = f"no such directory, and {name!r} is not in the local Hugging Face cache"
    # huggingface_hub's truthy values; "0", "false" or unset: online
    offline = {
        os.environ.get(v, "").lower() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    if offline & {"1", "on", "yes", "true"}:
        raise bad(f"{where} (HF_HUB_OFFLINE is set)")
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        raise bad(f"{where}, and {host} cannot be reached to download it") from None


def check_model(model, vocab_size: int) -> str | None:
    """None if our packed forward of the (unsharded) model equals its own eager one on two samples
    sharing a prompt, past a small window (every attention keyword and head transform), else why."""
    from packing import feed  # (packing imports rollout, which imports this module)

    if model.config._attn_implementation != "packed":
        return "its attention does not go through transformers' AttentionInterface"
    window = getattr(model.config.get_text_config(), "sliding_window", None) or 0
    n = min(max(16, window + 8), 64)
    p = n // 2
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab_size, (p,), generator=g).tolist()
    tails = torch.randint(vocab_size, (n,), generator=g).tolist()
    tails = [tails[:p], tails[p:][: n // 3]]
    # one packed row as packing feeds one: the prompt but its last token, then each tail from
    # that token on, attending to the prompt's prefix
    row = feed(defaultdict(list), prompt, 0, p - 1)
    for t in tails:
        feed(row, prompt + t, p - 1, p - 1 + len(t), (0, p - 1))
    tensor = functools.partial(torch.tensor, device=model.device)
    try:
        with torch.no_grad():
            ours, _ = policy_logprobs(
                model,
                tensor([row["input_ids"]]),
                tensor([row["position_ids"]]),
                tensor(row["targets"]),
                segments=torch.tensor(row["segments"]),
            )
            model.set_attn_implementation("eager")
            theirs = []
            for k, t in enumerate(tails):
                s = tensor(prompt + t)
                logits = model(input_ids=s[None], use_cache=False).logits[0].float()
                lp = -F.cross_entropy(logits[:-1], s[1:], reduction="none")
                # the row holds the prompt once: the first sample's positions only
                theirs.append(lp[0 if k == 0 else p - 1 :])
    except Exception as e:  # e.g. an attention keyword packed_attention does not implement
        return f"its forward fails under nanoareal's packed attention ({why(e)})"
    finally:
        model.set_attn_implementation("packed")
    diff = float((ours.float() - torch.cat(theirs)).abs().max())
    tol = 0.1 if model.dtype in HALF else 1e-4  # bf16 (LoRA's base): ~0.03
    if diff <= tol:  # 1e-4 for fp64 too: eager softmaxes in fp32; NaN fails
        return None
    return (
        f"nanoareal's packed forward disagrees with the model's own by {diff:.2g} in log-prob "
        "(an attention or head feature this model uses is not reproduced)"
    )
