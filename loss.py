"""nanoareal's losses: a catalogue of aggregation modes, policy surrogates and off-policy
corrections, and the LossReduction contract that makes every one of them exact.

Notation. One optimizer step consumes one mini-batch of prompt groups g, each holding the
responses sampled for one prompt. For response token t of response i:
    l_t  per-token policy loss (a surrogate below)
    m_t  numerator mask (the token is in the loss)
    d_t  denominator mask (the token counts in denominators); m_t <= d_t: a token rejected after
         the fact (a correction's mask) leaves the numerator but stays in the denominator, so
         rejecting tokens never silently up-weights the ones that survive
    M_i = sum_t d_it; response i is active when M_i > 0, group g when sum_{i in g} M_i > 0;
    N = active responses, P = active groups. Every sum runs over the whole mini-batch: all
    micro-batches, all data-parallel ranks, all context-parallel shards.

The contract. A loss is a `LossReduction` of `LossTerm`s. A term has `loss_fn(mb)`, the
micro-batch's share of its numerator (optionally with stats), `normalizer_fn(mb) >= 0`, the
micro-batch's share of its denominator (from masks and weights only; may be fractional), and a
coefficient. For one optimizer step the trainer does

    reduction.begin_step(microbatches)  # every term's normalizer: ONE all_reduce -> Z_k
    for mb in microbatches:             # forward, then
        reduction(mb).backward()        # sum_k coef_k * loss_fn(mb) / Z_k
    logs = reduction.reported()         # ONE all_reduce -> every term's global value, and stats

and makes the cross-rank gradient reduction a *sum* (FSDP2 averages by default:
`fsdp_sum_gradients`). Rules, each tested:
1. Invariance: the gradient and every reported number equal those of the full mini-batch
   objective in one process on one micro-batch, whatever the micro-batch split (through groups;
   through responses for token-local surrogates) and whatever the data-parallel x
   context-parallel layout.
2. Per-token weights, not per-micro-batch means: mode weights (1/M_i, 1/D_g, ...) are computed
   from the whole mini-batch's metadata before splitting (`response_weights`), so no micro-batch
   needs its whole group, and the only denominator is the global Z_k.
3. Empty is not an error: a global normalizer of 0 makes its term contribute exactly 0 with
   finite zero gradients; a micro-batch without an active token still runs forward/backward
   (collectives match).
4. Bad input is an error: a negative or non-finite normalizer raises naming the term; per-token
   tensors must share one 1-D shape (no broadcasting) and m_t <= d_t.
5. Normalizer group: Z is all-reduced over every rank whose gradients are summed (DP x CP). If
   every context-parallel rank computes the loss of the gathered full sequences, Z carries the CP
   factor.
6. Reporting: a term's logged value is its global objective (same group, same normalizer).
7. Entropy bonus and KL penalty are terms of the same reduction: a token mean is a term whose
   normalizer counts tokens.

Each aggregation mode is a pair of per-token weights: objective = sum_t m_t w_t l_t / sum_t d_t
nw_t, so a micro-batch's normalizer sum_t d_t nw_t is a (fractional) count of tokens, responses
or groups and micro-batches may cut anywhere between tokens.

Adding to the catalogue touches this file only: a mode is a function and its MODES entry (plus a
branch of the `aggregate` reference, which the tests compare it with); a surrogate is a function
with the common signature and its SURROGATES entry holding its defaults; a correction is a
CORRECTIONS entry. A new flag only for a genuinely new hyper-parameter.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

LOG_RATIO_BOUND = 20.0  # |log-ratio| clamp before any exp(): exp(20) ~ 5e8 overflows nothing
K3_CAP = 10.0  # k3's value explodes where pi_ref >> pi; cap it like verl's low_var_kl
KL_ESTIMATOR = "k3"  # the KL penalty's estimator (KL_ESTIMATORS): forward-KL gradient, as GRPO

# -----------------------------------------------------------------------------
# aggregation modes (--loss-aggregation): per-response (w_i, nw_i) from the whole mini-batch's
# metadata. M [R] = response denominators M_i (0 for inactive responses, which get zero weights),
# groups [R] = group ids, divisor = --loss-aggregation-divisor (resolved; only constant uses it).


def token_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / sum_t d_t (DAPO; TRL "dapo", verl "token-mean"): every token weighs the same,
    so a response's weight grows with its length."""
    active = (M > 0).double()
    return active, active


def seq_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """(1/N) sum_i (sum_t m_it l_it) / M_i (GRPO; TRL "grpo", verl "seq-mean-token-mean"): every
    response weighs the same, so a token of a short response counts more."""
    inv = _safe_inverse(M)
    return inv, inv


def prompt_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """(1/P) sum_g (sum_{i in g, t} m l) / D_g, D_g = sum_{i in g} M_i: every prompt group weighs
    the same; its group's total length, not its own response's, sets a token's weight."""
    _, g = torch.unique(groups, return_inverse=True)
    D = torch.zeros(int(g.max()) + 1 if g.numel() else 0, dtype=M.dtype).index_add_(0, g, M)[g]
    inv = torch.where(M > 0, _safe_inverse(D), 0.0)
    return inv, inv


def constant(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / (N C), C = --loss-aggregation-divisor (Dr. GRPO; TRL "dr_grpo", verl
    "seq-mean-token-sum-norm"): every token gets 1 / (N C) whatever its response's length.
    nw = 1/M_i makes the normalizer count responses; w = 1/C is the constant."""
    if not (divisor is not None and math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"--loss-aggregation constant needs a positive "
                         f"--loss-aggregation-divisor, got {divisor!r}")
    return (M > 0).double() / divisor, _safe_inverse(M)


MODES: dict[str, Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]] = {
    "token_mean": token_mean, "seq_mean": seq_mean, "prompt_mean": prompt_mean,
    "constant": constant}


def _safe_inverse(x: Tensor) -> Tensor:
    return torch.where(x > 0, 1.0 / torch.where(x > 0, x, 1.0), 0.0)  # where first: no inf


def _choice(kind: str, name: str, table: Mapping):
    if name not in table:
        raise ValueError(f"--{kind}: unknown {name!r}; choose one of {tuple(table)}")
    return table[name]


def response_weights(mode: str, denom_counts: Tensor, group_ids: Tensor,
                     divisor: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-response (loss_weight w_i, norm_weight nw_i) of `mode` for objective sum m w l / sum d
    nw. denom_counts (M_i) must cover the WHOLE mini-batch (every micro-batch and rank)."""
    fn = _choice("loss-aggregation", mode, MODES)
    M = denom_counts.to(torch.float64)
    if M.dim() != 1 or group_ids.shape != M.shape:
        raise ValueError(f"denom_counts {tuple(M.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must be [R]")
    if (M < 0).any() or not torch.isfinite(M).all():
        raise ValueError("denom_counts must be finite and >= 0")
    return fn(M, group_ids, divisor)


def per_token(values: Tensor, seq_ids: Tensor) -> Tensor:
    """Expand per-response values [R] to tokens [T] by seq_ids (-1, non-response tokens, get 0)."""
    if values.numel() == 0:
        return torch.zeros(seq_ids.shape, dtype=values.dtype)
    zero = torch.zeros((), dtype=values.dtype)
    return torch.where(seq_ids >= 0, values[seq_ids.clamp(min=0)], zero)


def aggregate(token_loss: Tensor, loss_mask: Tensor, *, mode: str, group_ids: Tensor,
              denom_mask: Tensor | None = None, divisor: float | None = None) -> Tensor:
    """Reference: the full-batch objective of each mode on padded [B, T] tensors, in one process,
    written straight from the formulas above, independently of `response_weights`; tests compare
    every mode with it. An empty denominator gives 0 (times the loss: the graph stays finite)."""
    m = loss_mask.to(token_loss.dtype)
    d = m if denom_mask is None else denom_mask.to(token_loss.dtype)
    if m.shape != token_loss.shape or d.shape != token_loss.shape:
        raise ValueError(f"masks {tuple(m.shape)}/{tuple(d.shape)} must equal token_loss "
                         f"{tuple(token_loss.shape)}")
    per_resp_num = (m * token_loss).sum(dim=1)  # sum_t m_it l_it
    M = d.sum(dim=1)
    active = M > 0
    zero = per_resp_num.sum() * 0.0
    N = int(active.sum())
    if mode == "token_mean":
        return per_resp_num.sum() / d.sum() if d.sum() > 0 else zero
    if mode == "seq_mean":
        return (per_resp_num[active] / M[active]).sum() / N if N > 0 else zero
    if mode == "constant":
        constant(M, group_ids, divisor)  # the divisor's check
        return per_resp_num.sum() / (N * divisor) if N > 0 else zero
    if mode == "prompt_mean":
        total, P = zero, 0
        for g in torch.unique(group_ids):
            D_g = M[group_ids == g].sum()
            if D_g > 0:
                total, P = total + per_resp_num[group_ids == g].sum() / D_g, P + 1
        return total / P if P > 0 else zero
    raise ValueError(f"aggregate: no reference for mode {mode!r}; write one for a new mode")


# -----------------------------------------------------------------------------
# the LossReduction contract


@dataclass(frozen=True)
class MicroBatch:
    """A packed micro-batch: 1-D [T] tensors aligned with the *predicted* token (position j of a
    sequence predicts token j+1), built once by the trainer's packing. The model reads input_ids,
    position_ids, targets and segments ([R, 4] attention layout); the loss reads the rest. Fields
    computed later are set by the one function that computes them (`dataclasses.replace`): the
    forward's logprobs/entropy, pi_prox's and pi_ref's log-probs, and keep_mask (a correction's
    mask over the whole mini-batch, M2PO)."""

    input_ids: Tensor | None = None
    position_ids: Tensor | None = None
    targets: Tensor | None = None
    segments: Tensor | None = None
    loss_mask: Tensor | None = None  # m_t
    denom_mask: Tensor | None = None  # d_t
    advantages: Tensor | None = None
    behave_logprobs: Tensor | None = None  # the rollout engine's (pi_behave)
    loss_weight: Tensor | None = None  # w: the mode's weight of the token's response
    norm_weight: Tensor | None = None  # nw: its share of the mode's normalizer
    seq_ids: Tensor | None = None  # response index within the micro-batch, -1 elsewhere
    prox_logprobs: Tensor | None = None  # pi_prox; None: the training forward's, detached
    ref_logprobs: Tensor | None = None  # the reference policy's (KL penalty)
    keep_mask: Tensor | None = None
    logprobs: Tensor | None = None  # the training forward's
    entropy: Tensor | None = None

    def validate(self, masks: bool = True) -> MicroBatch:
        """Rule 4: every per-token tensor present is 1-D with one shape; with `masks`, m <= d
        (a comparison that syncs a GPU: checked once, before the step). Returns self."""
        per_token = {f.name: getattr(self, f.name) for f in fields(self)
                     if f.name not in ("input_ids", "position_ids", "segments")}
        present = {k: v for k, v in per_token.items() if v is not None}
        if not present:
            raise ValueError("micro-batch has no per-token tensors")
        ref_key, ref = next(iter(present.items()))
        if ref.dim() != 1:
            raise ValueError(f"'{ref_key}' must be 1-D [T] (packed), got shape {tuple(ref.shape)}")
        for key, value in present.items():
            if value.shape != ref.shape:
                raise ValueError(f"'{key}' has shape {tuple(value.shape)}, expected "
                                 f"{tuple(ref.shape)} like '{ref_key}'")
        if self.seq_ids is not None and self.seq_ids.is_floating_point():
            raise ValueError(f"'seq_ids' must be an integer tensor, got {self.seq_ids.dtype}")
        if (masks and self.loss_mask is not None and self.denom_mask is not None
                and (self.loss_mask > self.denom_mask).any()):
            raise ValueError("'loss_mask' > 'denom_mask' somewhere: a token may count in the "
                             "numerator only if it also counts in the denominator (m_t <= d_t)")
        return self

    def to(self, device) -> MicroBatch:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in moved.items()
                                if v is not None and k != "segments"})


def as_microbatch(mb: MicroBatch | Mapping) -> MicroBatch:
    """A MicroBatch, or the MicroBatch fields of a mapping (tests, a custom term's batch)."""
    if isinstance(mb, MicroBatch):
        return mb
    names = {f.name for f in fields(MicroBatch)}
    return MicroBatch(**{k: v for k, v in mb.items() if k in names})


Stats = dict[str, tuple[Tensor, Tensor]]  # name -> (total, count): a global fraction


@dataclass
class LossTerm:
    """One term: loss_fn(mb) -> numerator share, or (it, stats); normalizer_fn(mb) -> its share of
    the denominator, from masks and weights only (it runs before any forward). `mb` is whatever
    the caller passes: the trainer's MicroBatch, or any mapping with its per-token fields."""

    name: str
    loss_fn: Callable[[MicroBatch], Tensor | tuple[Tensor, Stats]]
    normalizer_fn: Callable[[MicroBatch], float | Tensor]
    coef: float = 1.0


def all_reduce_vector(vec: Tensor, group=None, op=None) -> Tensor:
    """All-reduce a small host vector (sum by default) over `group`; a no-op in a world of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # NCCL reduces only CUDA tensors, gloo only CPU ones: move the (tiny) vector there
        nccl = dist.get_backend(group) == "nccl"
        buf = vec.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
        vec = buf.to(vec.device)
    return vec


class LossReduction:
    """Exact loss reduction across micro-batches, data-parallel and context-parallel ranks.

    `group` is the normalizer group: every rank whose gradients are reduced together (DP x CP);
    None is the default group. begin_step must see this rank's own tokens: across the group,
    every token of the mini-batch in exactly one micro-batch. `cp_factor`: the CP size when every
    CP rank computes the loss of the gathered full sequences (each token then counts cp_factor
    times in the gradient sum, so Z carries the same factor); 1 otherwise.
    """

    def __init__(self, terms: list[LossTerm], group=None, cp_factor: int = 1):
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"term names must be unique, got {names}")
        if cp_factor < 1:
            raise ValueError(f"cp_factor must be >= 1, got {cp_factor}")
        self.terms, self.group, self.cp_factor = terms, group, cp_factor
        self.Z: dict[str, float] = {}
        self._numerators: dict[str, Tensor | float] = {}  # on the device until reported()
        self._stats: dict[str, list] = {}

    def begin_step(self, microbatches: list) -> None:
        """Every term's normalizer over this rank's micro-batches; one all_reduce -> global Z_k."""
        local = torch.zeros(len(self.terms), dtype=torch.float64)
        for mb in microbatches:
            as_microbatch(mb).validate()
            for k, term in enumerate(self.terms):
                n = float(torch.as_tensor(term.normalizer_fn(mb), dtype=torch.float64))
                if not math.isfinite(n) or n < 0:
                    raise ValueError(f"term {term.name!r}: normalizer must be finite and >= 0, "
                                     f"got {n}")
                local[k] += n
        Z = all_reduce_vector(local, self.group) * self.cp_factor
        self.Z = {t.name: float(z) for t, z in zip(self.terms, Z.tolist(), strict=True)}
        self._numerators = {t.name: 0.0 for t in self.terms}
        self._stats = {}

    def __call__(self, mb) -> Tensor:
        """The micro-batch's loss for backward: sum_k coef_k * loss_fn(mb) / Z_k."""
        if not self.Z:
            raise RuntimeError("call begin_step(microbatches) before computing micro-batch losses")
        as_microbatch(mb).validate(masks=False)
        total = None
        for term in self.terms:
            value = term.loss_fn(mb)
            value, stats = value if isinstance(value, tuple) else (value, {})
            self._numerators[term.name] = (self._numerators[term.name]
                                           + value.detach().to(torch.float64))
            for name, (num, count) in stats.items():
                acc = self._stats.setdefault(name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + num.detach(), acc[1] + count.detach()
            Z = self.Z[term.name]
            # Z == 0: multiply (a finite loss) by 0, never divide, so gradients stay finite zeros
            scaled = value * (term.coef / Z) if Z > 0 else value * 0.0
            total = scaled if total is None else total + scaled
        return total

    def reported(self) -> dict[str, float]:
        """Global value of every term (sum_mb numerator / Z_k), 'loss' = sum_k coef_k value_k, and
        the stats as global fractions; one all_reduce."""
        names = sorted(self._stats)
        local = [self._numerators.get(t.name, 0.0) for t in self.terms]
        local += [self._stats[s][i] for s in names for i in (0, 1)]
        vec = all_reduce_vector(torch.tensor([float(x) for x in local], dtype=torch.float64),
                                self.group).tolist()
        out = {t.name: vec[k] / self.Z[t.name] if self.Z.get(t.name, 0.0) > 0 else 0.0
               for k, t in enumerate(self.terms)}
        out["loss"] = sum(t.coef * out[t.name] for t in self.terms)
        for j, s in enumerate(names):
            total, count = vec[len(self.terms) + 2 * j : len(self.terms) + 2 * j + 2]
            out[s] = total / count if count > 0 else 0.0
        return out


def fsdp_sum_gradients(model: torch.nn.Module) -> None:
    """Make FSDP2 sum (not average) gradients across ranks, as the contract needs.

    Both setters act on one FSDP module's own parameters: set them on every FSDP module. A divide
    factor alone makes FSDP2 reduce with ReduceOp.PREMUL_SUM, which gloo rejects; forcing sum
    reductions gives a plain SUM on every backend.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# -----------------------------------------------------------------------------
# policy surrogates (--policy-loss): the common signature is
#   fn(logprobs, prox_logprobs, advantages, seq_ids, mask, **params) -> (token_loss [T], stats)
# with stats {name: 0/1 indicator [T]}, logged as policy/<name>, a fraction of the loss's tokens.


def sanitize_log_ratio(x: Tensor) -> Tensor:
    """NaN (from -inf - -inf) -> 0; real +-inf stays so masks and caps can reject it."""
    return torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)


def log_ratio(logp: Tensor, other: Tensor) -> Tensor:
    """log(p / other), sanitised and clamped to +-LOG_RATIO_BOUND before anything exponentiates
    it: one token at log-ratio 95 would overflow exp() to inf, and inf * 0 in the branch a clip
    does not select turns the whole step's gradient into NaN. Masks and caps still see a huge
    ratio and reject such a token; beyond the bound its gradient is 0."""
    return sanitize_log_ratio(logp - other).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def ppo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor,
                  seq_ids: Tensor | None = None, mask: Tensor | None = None, *,
                  eps_low: float = 0.2, eps_high: float = 0.2, dual_clip: float | None = None
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - logp_prox) (Schulman et al.
    2017); eps_high > eps_low is DAPO's clip-higher. Dual clip c > 1 (Ye et al. 2020): for A < 0,
    l = min(l, -c A)."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (clipped > unclipped).detach().to(logprobs.dtype)}
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        stats["dual_clip_frac"] = dual.detach().to(logprobs.dtype)
    return loss, stats


def gspo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor, seq_ids: Tensor,
                   mask: Tensor, *, eps_low: float = 3e-4, eps_high: float = 4e-4
                   ) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): sequence ratio s_i = exp(mean_{t in i, mask} (logp - logp_prox)) in
    the clipped surrogate, per token as GSPO-token: r_t = sg(s_i) exp(logp_t - sg(logp_t)) (value
    s_i, gradient s_i grad logp_t), l = max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high)). Needs
    whole responses in the micro-batch."""
    is_resp = (seq_ids >= 0) & (mask > 0)
    idx = seq_ids.clamp(min=0)
    n_seq = max(int(seq_ids.max()) + 1 if seq_ids.numel() else 0, 1)  # all -1: slot 0, masked out
    token = torch.where(is_resp, log_ratio(logprobs, prox_logprobs).detach(), 0.0)
    sums = torch.zeros(n_seq, dtype=token.dtype, device=token.device).index_add_(0, idx, token)
    counts = torch.zeros_like(sums).index_add_(0, idx, is_resp.to(token.dtype))
    seq_log_ratio = sums / counts.clamp(min=1.0)
    seq_ratio = torch.exp(torch.where(seq_ids >= 0, seq_log_ratio[idx], 0.0))
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"clip_frac": (clipped > unclipped).detach().to(logprobs.dtype)}


def cispo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor,
                    seq_ids: Tensor | None = None, mask: Tensor | None = None, *,
                    eps_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 0, 1+eps_high)) A logp: the clipped importance
    weight scales a REINFORCE gradient, so clipped tokens still get gradient."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs)).detach()
    loss = -torch.clamp(ratio, 0.0, 1.0 + eps_high) * advantages * logprobs
    return loss, {"clip_frac": (ratio > 1.0 + eps_high).to(logprobs.dtype)}


def sapo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor,
                   seq_ids: Tensor | None = None, mask: Tensor | None = None, *,
                   tau_pos: float = 1.0, tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, 2025): l = -(4/tau) sigmoid(tau (r - 1)) A with tau = tau_pos if A > 0 else
    tau_neg: a soft trust region instead of a hard clip; at r = 1 its gradient equals PPO's."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs))
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages, {}


@dataclass(frozen=True)
class Surrogate:
    """A surrogate and its defaults: `params` are its keyword hyper-parameters (the flags
    --eps-low/--eps-high override the ones it has); `aggregation` is its --loss-aggregation auto."""

    fn: Callable
    params: dict
    aggregation: str = "token_mean"


# GSPO clips a sequence-level ratio, a geometric mean that moves far less than token ratios: the
# paper uses 3e-4 / 4e-4 with a per-sequence mean, as does verl's recipe
SURROGATES: dict[str, Surrogate] = {
    "ppo": Surrogate(ppo_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}),
    "gspo": Surrogate(gspo_surrogate, {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean"),
    "cispo": Surrogate(cispo_surrogate, {"eps_high": 0.2}),
    "sapo": Surrogate(sapo_surrogate, {"tau_pos": 1.0, "tau_neg": 1.05}),
}


# -----------------------------------------------------------------------------
# off-policy corrections (--correction): what the loss does about pi_behave (the engine that
# sampled, possibly --max-staleness versions old) differing from pi_prox (the weights before
# this step's update)


def behaviour_weights(prox_logprobs: Tensor, behave_logprobs: Tensor, *, cap: float,
                      mode: str = "truncate") -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022): w_t = pi_prox / pi_behave (detached). truncate: w =
    min(w, cap), nothing rejected; mask: tokens with w > cap are rejected (caller sets m_t = 0,
    keeps d_t), the rest keep w. Returns (weights, rejected 0/1)."""
    w = torch.exp(log_ratio(prox_logprobs, behave_logprobs)).detach()
    if mode == "truncate":
        return torch.clamp(w, max=cap), torch.zeros_like(w)
    rejected = w > cap
    return torch.where(rejected, 0.0, w), rejected.to(w.dtype)


def m2po_mask(prox_logprobs: Tensor, behave_logprobs: Tensor, loss_mask: Tensor, *,
              threshold: float, group=None) -> Tensor:
    """M2PO (Zheng et al. 2025): drop the tokens with the largest second moment x = (log
    pi_prox/pi_behave)^2 until the mean of x over the kept tokens is <= threshold. Global over
    `group` (pass all of a rank's mini-batch tokens); returns the keep mask (0/1, over m).
    Tokens tied at the cut are dropped together.

    Exact across ranks: mean(x | x <= v) is non-decreasing in v, so the largest admissible cut v
    is found by bisection over the bit patterns of float64 (monotone for x >= 0), ~64 all_reduces
    of (sum, count)."""
    x = sanitize_log_ratio(prox_logprobs.detach() - behave_logprobs.detach()).double() ** 2
    valid = loss_mask > 0

    def kept_mean_ok(cut: float) -> bool:
        keep = valid & (x <= cut)
        s = all_reduce_vector(torch.stack([torch.where(keep, x, 0.0).sum(),
                                           keep.sum().double()]), group)
        return bool(s[0] <= threshold * s[1])

    local_max = (torch.where(valid, x, 0.0).max(0, keepdim=True).values if x.numel()
                 else torch.zeros(1, dtype=x.dtype))
    x_max = all_reduce_vector(local_max, group, op=dist.ReduceOp.MAX).item()
    if kept_mean_ok(x_max):
        return loss_mask.clone()
    bits = lambda v: struct.unpack("<q", struct.pack("<d", v))[0]
    value = lambda b: struct.unpack("<d", struct.pack("<q", b))[0]
    lo, hi = bits(0.0), bits(x_max)  # invariant: ok(lo) (x <= 0 keeps only exact zeros), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kept_mean_ok(value(mid)) else (lo, mid)
    return loss_mask * (x <= value(lo)).to(loss_mask.dtype)


@dataclass(frozen=True)
class Correction:
    """`threshold`: the default --correction-threshold; `clip_to_behaviour`: pi_prox := pi_behave
    (PPO clipped around the policy that sampled, AReaL's naive baseline); `token_mode`: a
    behaviour_weights mode applied per token; `global_mask`: a mask over the whole mini-batch's
    tokens, computed from pi_prox before training (so pi_prox needs its own forward)."""

    threshold: float | None = None
    clip_to_behaviour: bool = False
    token_mode: str | None = None
    global_mask: Callable | None = None


CORRECTIONS: dict[str, Correction] = {
    "none": Correction(),  # clip around pi_prox; pi_behave is ignored
    "behave": Correction(clip_to_behaviour=True),
    "truncate": Correction(2.0, token_mode="truncate"),  # AReaL's decoupled PPO, weight capped
    "mask": Correction(2.0, token_mode="mask"),  # decoupled PPO, tokens above the cap rejected
    "m2po": Correction(0.04, global_mask=m2po_mask),  # the paper's tau
}


def apply_global_mask(mbs: list[MicroBatch], correction: str, threshold: float,
                      group=None) -> list[MicroBatch]:
    """A correction's keep_mask over all of one mini-batch's micro-batches (on every rank of
    `group`), set on each; micro-batches unchanged for corrections without one."""
    mask_fn = CORRECTIONS[correction].global_mask
    if mask_fn is None or not mbs:
        return mbs
    prox, behave, m = (torch.cat([getattr(mb, k) for mb in mbs])
                       for k in ("prox_logprobs", "behave_logprobs", "loss_mask"))
    keep = mask_fn(prox, behave, m, threshold=threshold, group=group)
    return [replace(mb, keep_mask=k) for mb, k in zip(mbs, keep.split([len(mb.loss_mask)
                                                                        for mb in mbs]))]


# -----------------------------------------------------------------------------
# KL penalty to a reference policy. With L = log pi - log pi_ref on tokens sampled from pi, each
# estimator's *value* estimates KL(pi || ref) (Schulman, "Approximating KL divergence", 2020), but
# as a loss only its gradient counts, and those differ:
#   k1 = L             gradient E_pi[grad log pi] = 0: pure noise, so not offered;
#   k2 = L^2 / 2       gradient E_pi[L grad log pi] = grad KL(pi || ref)   (reverse KL);
#   k3 = e^-L - 1 + L  gradient E_pi[(1 - pi_ref/pi) grad log pi] = grad KL(ref || pi)  (forward
#                      KL; GRPO's and verl's low_var_kl choice), never negative.
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k2": lambda L: 0.5 * L**2,
    "k3": lambda L: (torch.exp(-L) - 1.0 + L).clamp(max=K3_CAP),
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str | None = None) -> Tensor:
    """Per-token KL penalty (KL_ESTIMATORS; default KL_ESTIMATOR) of log-probs against reference
    log-probs."""
    estimator = estimator or KL_ESTIMATOR
    return _choice("kl-estimator", estimator, KL_ESTIMATORS)(log_ratio(logprobs, ref_logprobs))


# -----------------------------------------------------------------------------
# the trainer's loss: defaults that depend on other flags, checks, build_loss


def resolve_loss_flags(policy_loss: str, loss_aggregation: str, eps_low: float | None,
                       eps_high: float | None, divisor: float | None, correction: str,
                       threshold: float | None, max_new_tokens: int) -> dict:
    """The loss flags with the defaults that depend on other flags filled in: the surrogate's
    aggregation mode (for auto) and clip range, constant's divisor (the longest response) and the
    correction's threshold."""
    s = _choice("policy-loss", policy_loss, SURROGATES)
    mode = s.aggregation if loss_aggregation == "auto" else loss_aggregation
    if mode == "constant" and divisor is None:
        divisor = float(max_new_tokens)
    pick = lambda given, default: default if given is None else given
    return {"loss_aggregation": mode, "loss_aggregation_divisor": divisor,
            "eps_low": pick(eps_low, s.params.get("eps_low")),
            "eps_high": pick(eps_high, s.params.get("eps_high")),
            "correction_threshold": pick(threshold, _choice("correction", correction,
                                                            CORRECTIONS).threshold)}


def needs_proximal_forward(correction: str, num_minibatches: int) -> bool:
    """Whether pi_prox needs a forward pass of its own before the first update: with one
    mini-batch the training forward's detached log-probs are pi_prox (exact, one pass fewer),
    unless a correction masks the whole mini-batch from pi_prox before training."""
    corr = CORRECTIONS[correction]
    return not corr.clip_to_behaviour and (num_minibatches > 1 or corr.global_mask is not None)


def surrogate_params(policy_loss: str, eps_low: float | None, eps_high: float | None) -> dict:
    """The surrogate's hyper-parameters: its defaults, the clip range flags where it has one; a
    flag it has no use for is an error."""
    s = _choice("policy-loss", policy_loss, SURROGATES)
    params = dict(s.params)
    for name, value in (("eps_low", eps_low), ("eps_high", eps_high)):
        if value is not None and name not in params:
            raise ValueError(f"--{name.replace('_', '-')}: {policy_loss} has no such parameter")
        if value is not None:
            params[name] = value
    return params


def check_loss_flags(cfg) -> None:
    """Every loss flag's range (on resolved flags); raises ValueError naming the flag."""
    _choice("loss-aggregation", cfg.loss_aggregation, MODES)
    if cfg.loss_aggregation == "constant":
        constant(torch.zeros(0), torch.zeros(0), cfg.loss_aggregation_divisor)
    elif cfg.loss_aggregation_divisor is not None:
        raise ValueError("--loss-aggregation-divisor is only used by --loss-aggregation constant "
                         f"(not {cfg.loss_aggregation})")
    params = surrogate_params(cfg.policy_loss, cfg.eps_low, cfg.eps_high)
    if not (0 <= params.get("eps_low", 0) < 1 and params.get("eps_high", 0) >= 0):
        raise ValueError(f"--eps-low must be in [0, 1) and --eps-high >= 0, got {cfg.eps_low} and "
                         f"{cfg.eps_high}")
    corr = _choice("correction", cfg.correction, CORRECTIONS)
    if corr.threshold is not None and not cfg.correction_threshold > 0:
        raise ValueError(f"--correction-threshold must be > 0, got {cfg.correction_threshold}")
    if corr.threshold is None and cfg.correction_threshold is not None:
        raise ValueError(f"--correction-threshold: --correction {cfg.correction} has none")
    if cfg.kl_coef < 0:
        raise ValueError(f"--kl-coef must be >= 0, got {cfg.kl_coef}")


def masked_sum(values: Tensor, mask: Tensor, weight: Tensor | None = None,
               name: str = "loss") -> Tensor:
    """sum_t mask_t weight_t values_t, refusing broadcasting; masked values are replaced by 0
    *before* multiplying so a non-finite masked value cannot poison the sum."""
    for key, t in (("mask", mask), ("weight", weight)):
        if t is not None and t.shape != values.shape:
            raise ValueError(f"{name}: {key} shape {tuple(t.shape)} != token loss shape "
                             f"{tuple(values.shape)}")
    w = mask if weight is None else mask * weight
    return (torch.where(w != 0, values, 0.0) * w).sum()


def build_loss(cfg, group=None, cp_factor: int = 1) -> LossReduction:
    """The trainer's loss from its resolved loss flags (cfg: policy_loss, eps_low, eps_high,
    correction, correction_threshold, entropy_coef, kl_coef): a "policy" term (sum m w l / sum d
    nw, with the mode weights of the micro-batch's loss_weight/norm_weight), optionally "entropy"
    (token mean of the entropy, coef -entropy_coef) and "kl" (token mean of the KL estimate, coef
    kl_coef). Stats: policy/clip_frac and the surrogate's others over m tokens,
    policy/behave_capped_frac (the correction's share of d tokens above its cap)."""
    params = surrogate_params(cfg.policy_loss, cfg.eps_low, cfg.eps_high)
    surrogate = SURROGATES[cfg.policy_loss].fn
    corr = _choice("correction", cfg.correction, CORRECTIONS)

    def policy(mb: MicroBatch) -> tuple[Tensor, Stats]:
        m, d, logp = mb.loss_mask, mb.denom_mask, mb.logprobs
        m = m if mb.keep_mask is None else mb.keep_mask
        active = d > 0
        prox = mb.behave_logprobs if corr.clip_to_behaviour else mb.prox_logprobs
        prox = logp.detach() if prox is None else prox
        # tokens outside the denominator get ratio 1 and advantage 0: their (arbitrary) prox values
        # can never produce inf in the forward, hence never NaN in the backward
        prox = torch.where(active, prox, logp.detach())
        advantages = torch.where(active, mb.advantages, 0.0)
        token_loss, indicators = surrogate(logp, prox, advantages, mb.seq_ids, m, **params)
        weight, stats = mb.loss_weight, {}
        if corr.token_mode is not None:
            behave = torch.where(active, mb.behave_logprobs, prox)
            w, rejected = behaviour_weights(prox, behave, cap=cfg.correction_threshold,
                                            mode=corr.token_mode)
            capped = (log_ratio(prox, behave) > math.log(cfg.correction_threshold)).to(d.dtype)
            stats["policy/behave_capped_frac"] = ((capped * d).sum(), d.sum())
            m, weight = m * (1.0 - rejected), weight * w
        stats |= {f"policy/{k}": ((v * m).sum(), m.sum()) for k, v in indicators.items()}
        return masked_sum(token_loss, m, weight, "policy"), stats

    def policy_norm(mb: MicroBatch) -> Tensor:  # float64: summed over many micro-batches and ranks
        return (mb.denom_mask.double() * mb.norm_weight.double()).sum()

    def token_count(mb: MicroBatch) -> Tensor:
        return mb.denom_mask.double().sum()

    def kl(mb: MicroBatch) -> Tensor:
        # reference log-probs outside the response are arbitrary: ratio 1 there, so exp() is finite
        ref = torch.where(mb.denom_mask > 0, mb.ref_logprobs, mb.logprobs.detach())
        return masked_sum(kl_penalty(mb.logprobs, ref), mb.loss_mask, name="kl")

    entropy = lambda mb: masked_sum(mb.entropy, mb.loss_mask, name="entropy")
    terms = [("policy", policy, policy_norm, 1.0),
             ("entropy", entropy, token_count, -cfg.entropy_coef), ("kl", kl, token_count,
                                                                    cfg.kl_coef)]
    typed = lambda fn: lambda mb: fn(as_microbatch(mb))  # a mapping works too (tests, scripts)
    return LossReduction([LossTerm(name, typed(fn), typed(norm), coef)
                          for name, fn, norm, coef in terms if coef != 0.0],
                         group=group, cp_factor=cp_factor)
