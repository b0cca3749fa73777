"""LoRA (Hu et al. 2021), all of it: adapters on a model's linear layers, their merge into plain
weights (what the engine and the export get), PEFT's adapter format in and out. An adapted layer
computes base(x) + (alpha / r) B A x, with A [r, in] random and B [out, r] zero at the start (the
base model's output). Its adapters are the parameters `<layer>.lora_A` and `<layer>.lora_B`:
`is_adapter` is the one test of what an adapter is; the base is frozen."""

import json
import math
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from cli import UserError, why

# alpha fixed: alpha / r shrinks as r grows, so one lr suits every rank (with Adam, alpha and lr
# are one knob); every linear layer, never the head (the log-probs read head.weight: bypassed)
LORA_ALPHA = 32
PEFT_PREFIX = "base_model.model."  # PEFT's names of a model's parameters in its adapter files
# what nanoareal reads of adapter_config.json; an adapter using anything else is refused
PEFT_EXTRAS = (
    "use_dora",
    "use_rslora",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "target_parameters",
    "layers_to_transform",
)


def is_adapter(name: str) -> bool:
    """Whether the parameter called `name` is a LoRA adapter (trained), not the frozen base."""
    return name.endswith((".lora_A", ".lora_B"))


def is_conv1d(layer: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): y = x W + b with W [in, out], the transpose of nn.Linear's."""
    return type(layer).__name__ == "Conv1D" and layer.weight.dim() == 2


class LoraLinear(nn.Module):
    """y = base(x) + (alpha / r) B A x (the adapter's path in the adapters' dtype, the sum in the
    output's); `enabled` False: the base alone (the KL penalty's reference policy)."""

    def __init__(self, base: nn.Module, r: int, alpha: float):
        super().__init__()
        fan_in, fan_out = base.weight.shape if is_conv1d(base) else base.weight.shape[::-1]
        # fp32 adapters at least
        dtype = torch.promote_types(base.weight.dtype, torch.float32)
        self.base = base
        self.scale = alpha / r
        self.enabled = True
        # on base.weight's device
        self.lora_A = nn.Parameter(base.weight.new_empty(r, fan_in, dtype=dtype))
        self.lora_B = nn.Parameter(self.lora_A.new_zeros(fan_out, r))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's (and PEFT's) init

    def forward(self, x):
        y = self.base(x)
        if not self.enabled:
            return y
        delta = x.to(self.lora_A.dtype) @ self.lora_A.t() @ self.lora_B.t() * self.scale
        return (y + delta).to(y.dtype)

    def merged(self, weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor):
        """The base weight plus the adapter's delta (full tensors; in fp64, rounded once)."""
        delta = (lora_B.double() @ lora_A.double()) * self.scale
        if is_conv1d(self.base):
            delta = delta.t()
        return (weight.double() + delta).to(weight.dtype)


def targets(model: nn.Module, spec) -> list[str]:
    """The names of the layers LoRA adapts: "all-linear" (every nn.Linear and Conv1D but the
    head; MoE experts' fused weights are no such layer: they stay frozen), or PEFT's
    target_modules: a list of names or name suffixes, or a regular expression."""
    head = model.get_output_embeddings()
    return [
        name
        for name, layer in model.named_modules()
        if (isinstance(layer, nn.Linear) or is_conv1d(layer))
        and layer is not head
        and (spec == "all-linear" or _matches(name, spec))
    ]


def _matches(name: str, spec) -> bool:
    if isinstance(spec, str):
        return re.fullmatch(spec, name) is not None
    return any(name == t or name.endswith("." + t) for t in spec)


def apply(model: nn.Module, r: int, config: dict | None) -> tuple[dict | None, str]:
    """LoRA adapters of rank r put into `model` in place (the base frozen), or those of an adapter
    directory's config (and its weights, after loading: load_weights). Returns their config as
    PEFT writes it (rank, alpha, the layers adapted) and the start-up line's words (one ending
    "; "); (None, "") for r = 0."""
    if not r:
        return None, ""
    alpha = LORA_ALPHA if config is None else config["lora_alpha"]
    spec = "all-linear" if config is None else config["target_modules"]
    names = targets(model, spec)
    if not names:
        raise UserError(f"LoRA: no layer of this model matches target_modules {spec!r}")
    base = list(model.parameters())
    model.requires_grad_(False)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoraLinear(getattr(owner, child), r, alpha))
    # the adapters, new, are the only parameters besides the base's
    frozen = sum(p.numel() for p in base)
    trainable = sum(p.numel() for p in model.parameters()) - frozen
    return {"r": r, "lora_alpha": alpha, "target_modules": names}, (
        f"LoRA r={r} alpha={alpha} on {len(names)} layers: {trainable:,} trainable, "
        f"{frozen:,} frozen in {base[0].dtype}; "
    )


@contextmanager
def disabled(model: nn.Module):
    """The model without its adapters while inside: the frozen base (the KL reference for free)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    try:
        for m in layers:
            m.enabled = False
        yield
    finally:
        for m in layers:
            m.enabled = True


def merged(named, model: nn.Module):
    """(name, full tensor) pairs of `model`'s state, in order -> the plain model's: each adapted
    layer's weight merged with its adapter, its base's other tensors renamed. One layer at a
    time: never a second whole model."""
    adapted = {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    held = {}
    for name, t in named:
        layer, _, kind = name.rpartition(".")
        owner = layer if is_adapter(name) else layer.removesuffix(".base")
        if owner not in adapted:
            yield name, t
        elif kind not in ("lora_A", "lora_B", "weight"):  # the base's bias
            yield f"{owner}.{kind}", t
        else:
            parts = held.setdefault(owner, {})
            parts[kind] = t
            if len(parts) == 3:
                del held[owner]
                yield f"{owner}.weight", adapted[owner].merged(**parts)


def read_config(path: str | Path | None) -> dict | None:
    """A PEFT adapter directory's adapter_config.json, checked (None: `path` holds none); a
    UserError names what nanoareal cannot read or reproduce."""
    file = Path(path or "") / "adapter_config.json"
    if not path or not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{file}: not a readable adapter config ({why(e)})") from None
    if not isinstance(config, dict):
        raise UserError(f"{file}: not a JSON object")
    if config.get("peft_type") != "LORA":
        raise UserError(
            f"{file}: not a PEFT LoRA adapter (peft_type {config.get('peft_type')!r})"
        )
    needed = {
        "r": int,
        "lora_alpha": (int, float),
        "target_modules": (str, list),
        "base_model_name_or_path": str,
    }
    missing = [k for k, kind in needed.items() if not isinstance(config.get(k), kind)]
    if missing:
        raise UserError(
            f"{file}: incomplete LoRA adapter config (no valid {', '.join(missing)})"
        )
    extras = [k for k in PEFT_EXTRAS if config.get(k)]
    if extras or config.get("bias", "none") != "none":
        raise UserError(
            f"{file}: uses {', '.join(extras) or 'a bias'}, which nanoareal's LoRA "
            "does not reproduce"
        )
    return config


def save(tensors: dict, config: dict, base: str, out_dir: Path) -> None:
    """Adapters (full tensors, by our names) in PEFT's format: adapter_model.safetensors and an
    adapter_config.json naming `base` (PeftModel.from_pretrained and --model load it)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    peft_names = {f"{PEFT_PREFIX}{k}.weight": v.contiguous() for k, v in tensors.items()}
    save_file(peft_names, str(out_dir / "adapter_model.safetensors"))
    base = str(Path(base).resolve()) if Path(base).exists() else base
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "bias": "none",
        "lora_dropout": 0.0,
        "fan_in_fan_out": False,
    } | config
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=1))


def load_weights(model: nn.Module, path: str) -> None:
    """A PEFT adapter's weights into `model`'s adapters; a UserError if they do not fit."""
    from safetensors.torch import load_file

    own = {k: p for k, p in model.named_parameters() if is_adapter(k)}
    peft = load_file(str(Path(path) / "adapter_model.safetensors"))
    theirs = {
        k.removeprefix(PEFT_PREFIX).removesuffix(".weight").replace(".default", ""): v
        for k, v in peft.items()
    }
    bad = [
        k
        for k in own.keys() | theirs.keys()
        if k not in own or k not in theirs or own[k].shape != theirs[k].shape
    ]
    if bad:
        raise UserError(
            f"--model {path}: the adapter does not fit this base model ({len(bad)} "
            f"tensors missing or of another shape, e.g. {sorted(bad)[0]})"
        )
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(theirs[k])
