"""nanoareal's losses: advantage estimators, aggregation modes, policy surrogates and off-policy
corrections, each exact under the LossReduction contract. It grows in this file only: a mode is a
function and its MODES entry (plus a branch of the reference `aggregate`); a surrogate, a function
of the common signature and its SURROGATES entry (its defaults); a correction, a CORRECTIONS entry.

Notation. A step's mini-batch holds prompt groups g (the responses sampled for one prompt). For
token t of response i: l_t the policy loss (a surrogate), m_t the numerator mask, d_t >= m_t the
denominator mask (a token a correction rejects stays in the denominator: rejecting never
up-weights the survivors). M_i = sum_t d_it; N responses and P groups are active (M_i > 0,
sum_{i in g} M_i > 0). Every sum runs over the whole mini-batch: micro-batches, ranks, CP shards.

The contract. A loss is a `LossReduction` of `LossTerm`s: loss_fn(mb) is a micro-batch's share of
a term's numerator (and stats), normalizer_fn(mb) >= 0 its share of the denominator (from masks
and weights only). With the cross-rank gradient reduction a *sum* (`fsdp_sum_gradients`), a step:

    reduction.begin_step(microbatches)  # every term's normalizer: ONE all_reduce -> Z_k
    for mb in microbatches:             # forward, then
        reduction(mb).backward()        # sum_k coef_k * loss_fn(mb) / Z_k
    logs = reduction.reported()         # ONE all_reduce -> every term's global value, and stats

Rules, each tested:
1. Invariance: gradient and reported numbers equal the full mini-batch objective's in one process,
   for any split (through groups; through responses for token-local surrogates) and DP x CP layout.
2. Per-token weights, not per-micro-batch means: mode weights come from the whole mini-batch's
   metadata before splitting (`response_weights`); the only denominator is the global Z_k.
3. Empty is not an error: Z_k = 0 makes term k exactly 0 with finite zero gradients; a
   micro-batch without an active token still runs forward/backward.
4. Bad input raises: a normalizer < 0 or not finite, per-token tensors not of one 1-D shape, m > d.
5. Z is all-reduced over every rank whose gradients are summed (DP x CP), times the CP size when
   every CP rank computes the loss of the gathered full sequences.
6. A term's logged value is its global objective (same group, same normalizer).
7. Entropy bonus and KL penalty are terms of the same reduction (token means)."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
from torch import Tensor

ADV_EPS = 1e-6  # added to a group's reward std before dividing: a tiny spread cannot explode
ADVANTAGES = ("grpo", "rloo")  # --adv-estimator's choices (group_advantages)
LOG_RATIO_BOUND = 20.0  # |log-ratio| clamp before any exp(): exp(20) ~ 5e8 overflows nothing
K3_CAP = 10.0  # k3's value explodes where pi_ref >> pi; cap it like verl's low_var_kl
CAPPED = "policy/behave_capped_frac"  # the share of d tokens a correction capped or masked
Stats = dict[str, tuple[Tensor, Tensor]]  # name -> (total, count): a global fraction
TokenLoss = tuple[Tensor, dict[str, Tensor]]  # a surrogate's (loss [T], {name: indicator [T]})
_safe_inverse = lambda x: torch.where(x > 0, 1.0 / torch.where(x > 0, x, 1.0), 0.0)  # 1/0 -> 0
# a log-ratio's NaN (from -inf - -inf) -> 0; a real +-inf stays, so masks and caps can reject it
sanitize_log_ratio = lambda x: torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)
# log(p / q), sanitised and clamped before any exp(): inf * 0 in a branch the clip does not select
# would make the step's gradient NaN. A correction's cap (<< e^20) still sees a clamped ratio.
log_ratio = lambda p, q: sanitize_log_ratio(p - q).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _group_sums(x: Tensor, ids: Tensor) -> Tensor:
    """Each element's group total, sum_{j: ids_j = ids_i} x_j (ids: any values, in any order)."""
    _, g = torch.unique(ids, return_inverse=True)
    return x.new_zeros(int(g.max()) + 1 if g.numel() else 0).index_add_(0, g, x)[g]


# -----------------------------------------------------------------------------
# aggregation modes (--loss-aggregation): objective = sum_t m_t w_t l_t / sum_t d_t nw_t, with
# fn(M [R], groups [R], divisor) -> per-response (w_i, nw_i), zero for inactive responses. So a
# micro-batch's normalizer is a (fractional) count of tokens, responses or groups, cut anywhere.
def token_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / sum_t d_t (DAPO; TRL "dapo", verl "token-mean"): tokens weigh the same."""
    return (M > 0).double(), (M > 0).double()


def seq_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """(1/N) sum_i (sum_t m_it l_it) / M_i (GRPO; TRL "grpo", verl "seq-mean-token-mean")."""
    return _safe_inverse(M), _safe_inverse(M)


def prompt_mean(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """(1/P) sum_g (sum_{i in g, t} m_it l_it) / D_g, D_g = sum_{i in g} M_i."""
    return (inv := torch.where(M > 0, _safe_inverse(_group_sums(M, groups)), 0.0)), inv


def constant(M: Tensor, groups: Tensor, divisor: float) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / (N C), C = --loss-aggregation-divisor (Dr. GRPO; TRL "dr_grpo", verl
    "seq-mean-token-sum-norm"): w = 1/C, and nw = 1/M_i makes the normalizer count responses."""
    if not (divisor is not None and math.isfinite(divisor) and divisor > 0):
        raise ValueError(f"--loss-aggregation constant needs a positive "
                         f"--loss-aggregation-divisor, got {divisor!r}")
    return (M > 0).double() / divisor, _safe_inverse(M)


MODES = {fn.__name__: fn for fn in (token_mean, seq_mean, prompt_mean, constant)}


def _choice(kind: str, name: str, table: Mapping):
    if name not in table:
        raise ValueError(f"--{kind}: unknown {name!r}; choose one of {tuple(table)}")
    return table[name]


def response_weights(mode: str, denom_counts: Tensor, group_ids: Tensor,
                     divisor: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-response (w_i, nw_i) of `mode`; denom_counts (M_i) cover the WHOLE mini-batch."""
    fn, M = _choice("loss-aggregation", mode, MODES), denom_counts.to(torch.float64)
    if M.dim() != 1 or group_ids.shape != M.shape or (M < 0).any() or not M.isfinite().all():
        raise ValueError(f"denom_counts {tuple(M.shape)} must be finite, >= 0 and [R] like "
                         f"group_ids {tuple(group_ids.shape)}")
    return fn(M, group_ids, divisor)


def aggregate(token_loss: Tensor, loss_mask: Tensor, *, mode: str, group_ids: Tensor,
              denom_mask: Tensor | None = None, divisor: float | None = None) -> Tensor:
    """Reference: each mode's full-batch objective on padded [B, T] tensors in one process,
    straight from its formula (not from `response_weights`). An empty denominator gives 0."""
    m = loss_mask.to(token_loss.dtype)
    d = m if denom_mask is None else denom_mask.to(token_loss.dtype)
    if m.shape != token_loss.shape or d.shape != token_loss.shape:
        raise ValueError(f"masks {tuple(m.shape)}/{tuple(d.shape)} must equal token_loss "
                         f"{tuple(token_loss.shape)}")
    num, M = (m * token_loss).sum(dim=1), d.sum(dim=1)  # per response: sum_t m l, M_i
    N, zero = int((M > 0).sum()), num.sum() * 0.0  # zero: times the loss, so the graph stays finite
    if mode == "token_mean":
        return num.sum() / d.sum() if d.sum() > 0 else zero
    if mode == "seq_mean":
        return (num[M > 0] / M[M > 0]).sum() / N if N > 0 else zero
    if mode == "constant":
        constant(M, group_ids, divisor)  # the divisor's check
        return num.sum() / (N * divisor) if N > 0 else zero
    if mode == "prompt_mean":
        per_group = [num[group_ids == g].sum() / D for g in torch.unique(group_ids)
                     if (D := M[group_ids == g].sum()) > 0]
        return sum(per_group, zero) / len(per_group) if per_group else zero
    raise ValueError(f"aggregate: no reference for mode {mode!r}; write one for a new mode")


# -----------------------------------------------------------------------------
# advantages (--adv-estimator): a sample's reward against its GRPO group's; the std it is divided
# by (--adv-std): fn(rewards, group_ids, group, copies) -> each sample's std, None for no division
def group_std(rewards: Tensor, group_ids: Tensor, group=None, copies: int = 1) -> Tensor:
    """Each sample's group's unbiased reward std (GRPO)."""
    n, total = _group_sums(torch.ones_like(rewards), group_ids), _group_sums(rewards, group_ids)
    return (_group_sums((rewards - total / n) ** 2, group_ids) / (n - 1).clamp(min=1)).sqrt()


def batch_std(rewards: Tensor, group_ids: Tensor, group=None, copies: int = 1) -> Tensor:
    """The unbiased reward std of the whole step's batch, every rank of `group` (each sample held
    by `copies` ranks: a CP group's), as TRL's scale_rewards="batch"."""
    n, s, ss = (all_reduce_vector(torch.stack([rewards.new_tensor(float(len(rewards))),
                                               rewards.sum(), (rewards**2).sum()]), group) / copies)
    return rewards.new_full(rewards.shape, float(((ss - s * s / n) / (n - 1).clamp(min=1))
                                                .clamp(min=0).sqrt()) if n > 0 else 0.0)


ADV_STDS: dict[str, Callable | None] = {"group": group_std, "batch": batch_std, "none": None}


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                     std: str = "group", eps: float = ADV_EPS, group=None,
                     copies: int = 1) -> torch.Tensor:
    """Per-sample advantages from rewards and group ids (any sizes, any order; a group of one gets
    0): grpo A_i = (R_i - mean_g R) / (std_i + eps), std_i from ADV_STDS[std] (none: no division);
    rloo's baseline is the mean of the group's other samples, never divided."""
    rewards, std_fn = rewards.double(), _choice("adv-std", std, ADV_STDS)
    n, total = _group_sums(torch.ones_like(rewards), group_ids), _group_sums(rewards, group_ids)
    if estimator == "grpo":
        adv = rewards - total / n
        adv = adv / (std_fn(rewards, group_ids, group, copies) + eps) if std_fn else adv
    elif estimator == "rloo":
        adv = rewards - (total - rewards) / (n - 1).clamp(min=1)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}")
    return torch.where(n > 1, adv, torch.zeros_like(adv)).float()


# -----------------------------------------------------------------------------
# the LossReduction contract
@dataclass(frozen=True)
class MicroBatch:
    """A packed micro-batch. Past the model's input_ids, position_ids and segments: 1-D [T] tensors
    aligned with the *predicted* token. A field computed later is set (`replace`) where it is."""
    input_ids: Tensor | None = None
    position_ids: Tensor | None = None
    segments: Tensor | None = None  # [R, 4] attention layout
    targets: Tensor | None = None
    loss_mask: Tensor | None = None  # m_t
    denom_mask: Tensor | None = None  # d_t
    advantages: Tensor | None = None
    behave_logprobs: Tensor | None = None  # the rollout engine's (pi_behave)
    loss_weight: Tensor | None = None  # w: the mode's weight of the token's response
    norm_weight: Tensor | None = None  # nw: its share of the mode's normalizer
    seq_ids: Tensor | None = None  # response index within the micro-batch, -1 elsewhere
    prox_logprobs: Tensor | None = None  # pi_prox; None: the training forward's, detached
    ref_logprobs: Tensor | None = None  # the reference policy's (KL penalty)
    keep_mask: Tensor | None = None  # a correction's mask over the whole mini-batch (M2PO)
    logprobs: Tensor | None = None  # the training forward's
    entropy: Tensor | None = None

    def validate(self, masks: bool = True) -> None:
        """Rule 4; m <= d only with `masks` (it syncs a GPU: once, before the step)."""
        given = [(f.name, v) for f in fields(self)[3:] if (v := getattr(self, f.name)) is not None]
        if not given:
            raise ValueError("micro-batch has no per-token tensors")
        ref_key, ref = given[0]
        for key, value in given:
            if value.dim() != 1 or value.shape != ref.shape:
                raise ValueError(f"'{key}' has shape {tuple(value.shape)}: per-token tensors are "
                                 f"1-D [T] (packed), like '{ref_key}' {tuple(ref.shape)}")
        if self.seq_ids is not None and self.seq_ids.is_floating_point():
            raise ValueError(f"'seq_ids' must be an integer tensor, got {self.seq_ids.dtype}")
        if (masks and self.loss_mask is not None and self.denom_mask is not None
                and (self.loss_mask > self.denom_mask).any()):
            raise ValueError("'loss_mask' > 'denom_mask' somewhere, but m_t <= d_t")

    def to(self, device) -> MicroBatch:
        return replace(self, **{f.name: v.to(device) for f in fields(self) if f.name != "segments"
                                and (v := getattr(self, f.name)) is not None})


def as_microbatch(mb: MicroBatch | Mapping) -> MicroBatch:
    """A MicroBatch, or the MicroBatch fields of a mapping (tests, a custom term's batch)."""
    return mb if isinstance(mb, MicroBatch) else MicroBatch(
        **{k: v for k, v in mb.items() if k in MicroBatch.__dataclass_fields__})


@dataclass
class LossTerm:  # mb: a MicroBatch, or any mapping with its per-token fields
    name: str
    loss_fn: Callable[[MicroBatch], Tensor | tuple[Tensor, Stats]]  # numerator share (, stats)
    normalizer_fn: Callable[[MicroBatch], float | Tensor]  # masks and weights only: pre-forward
    coef: float = 1.0


def all_reduce_vector(vec: Tensor, group=None, op=None) -> Tensor:
    """All-reduce a small host vector (sum by default) over `group`; a no-op in a world of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        nccl = dist.get_backend(group) == "nccl"  # NCCL reduces CUDA tensors only, gloo CPU ones
        buf = vec.to(torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
        vec = buf.to(vec.device)
    return vec


class LossReduction:
    """The contract's reduction. `group`: the ranks whose gradients are summed (None: the default
    group), which together see each token once; `cp_factor`: rule 5's CP size, else 1."""
    def __init__(self, terms: list[LossTerm], group=None, cp_factor: int = 1):
        if len({t.name for t in terms}) != len(terms) or cp_factor < 1:
            raise ValueError(f"need unique term names and cp_factor >= 1, got "
                             f"{[t.name for t in terms]} and {cp_factor}")
        self.terms, self.group, self.cp_factor = terms, group, cp_factor
        self.Z, self._numerators, self._stats = {}, {}, {}  # Z: begin_step's; the rest on device

    def begin_step(self, microbatches: list) -> None:
        """Every term's normalizer over this rank's micro-batches; one all_reduce -> global Z_k."""
        local = torch.zeros(len(self.terms), dtype=torch.float64)
        for mb in microbatches:
            as_microbatch(mb).validate()
            for k, term in enumerate(self.terms):
                n = float(torch.as_tensor(term.normalizer_fn(mb), dtype=torch.float64))
                if not math.isfinite(n) or n < 0:
                    raise ValueError(f"term {term.name!r}: normalizer {n} is not finite and >= 0")
                local[k] += n
        Z = all_reduce_vector(local, self.group) * self.cp_factor  # each token cp_factor times
        self.Z = {t.name: float(z) for t, z in zip(self.terms, Z.tolist(), strict=True)}
        self._numerators, self._stats = {t.name: 0.0 for t in self.terms}, {}

    def __call__(self, mb) -> Tensor:
        """The micro-batch's loss for backward: sum_k coef_k * loss_fn(mb) / Z_k."""
        if not self.Z:
            raise RuntimeError("call begin_step(microbatches) before computing micro-batch losses")
        as_microbatch(mb).validate(masks=False)
        total = 0.0
        for term in self.terms:
            value, stats = v if isinstance(v := term.loss_fn(mb), tuple) else (v, {})
            self._numerators[term.name] = self._numerators[term.name] + value.detach().double()
            for k, p in stats.items():  # (total, count)
                self._stats[k] = [a + b.detach() for a, b in zip(self._stats.get(k, (0, 0)), p)]
            Z = self.Z[term.name]  # Z == 0: multiply by 0, never divide: finite zero gradients
            total = total + (value * (term.coef / Z) if Z > 0 else value * 0.0)
        return total

    def reported(self) -> dict[str, float]:
        """Each term's global value, 'loss' = sum_k coef_k value_k, the stats; one all_reduce."""
        names, k = sorted(self._stats), len(self.terms)
        local = [float(self._numerators.get(t.name, 0.0)) for t in self.terms]
        local += [float(x) for s in names for x in self._stats[s]]
        vec = all_reduce_vector(torch.tensor(local, dtype=torch.float64), self.group).tolist()
        out = {t.name: v / self.Z[t.name] if self.Z.get(t.name, 0.0) > 0 else 0.0
               for t, v in zip(self.terms, vec)}
        out["loss"] = sum(t.coef * out[t.name] for t in self.terms)
        return out | {s: n / c if c > 0 else 0.0
                      for s, n, c in zip(names, vec[k::2], vec[k + 1 :: 2])}


def fsdp_sum_gradients(model: torch.nn.Module) -> None:
    """Make FSDP2 sum, not average, gradients: on every FSDP module (the setters act on its own
    parameters), forced sums (a divide factor alone reduces with PREMUL_SUM, which gloo rejects);
    one rank's average is its sum, and a factor, even 1, divides every gradient: none there."""
    from torch.distributed.fsdp import FSDPModule
    if dist.get_world_size() == 1:
        return
    for module in (m for m in model.modules() if isinstance(m, FSDPModule)):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


# -----------------------------------------------------------------------------
# policy surrogates (--policy-loss): fn(logp, prox, A, seq_ids, mask, **params) -> TokenLoss on
# [T] (log pi, log pi_prox, advantages, response ids or -1, m); stats: policy/<name>, means over m
def ppo_surrogate(logp: Tensor, prox: Tensor, A: Tensor, seq_ids: Tensor | None = None,
                  mask: Tensor | None = None, *, eps_low: float = 0.2, eps_high: float = 0.2,
                  dual_clip: float | None = None) -> TokenLoss:
    """l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = pi / pi_prox (Schulman et al. 2017;
    eps_high > eps_low: DAPO's clip-higher); dual clip c (Ye et al. 2020): min(l, -c A) if A < 0."""
    ratio = torch.exp(log_ratio(logp, prox))
    unclipped, clipped = -A * ratio, -A * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clip_frac": (clipped > unclipped).detach().to(logp.dtype)}
    if dual_clip is not None:
        loss = torch.where(dual := (A < 0) & (loss > -dual_clip * A), -dual_clip * A, loss)
        stats["dual_clip_frac"] = dual.detach().to(logp.dtype)
    return loss, stats


def gspo_surrogate(logp: Tensor, prox: Tensor, A: Tensor, seq_ids: Tensor, mask: Tensor, *,
                   eps_low: float = 3e-4, eps_high: float = 4e-4) -> TokenLoss:
    """GSPO (Zheng et al. 2025), per token (GSPO-token): l = max(-A r_t, -A clip(r_t, 1-eps_low,
    1+eps_high)), r_t = sg(s_i) pi_t / sg(pi_t) (value s_i, gradient s_i grad logp_t), s_i =
    exp(mean_{t in i, mask} log(pi_t / pi_prox_t)). Needs whole responses in the micro-batch."""
    token = torch.where(is_resp := (seq_ids >= 0) & (mask > 0), log_ratio(logp, prox).detach(), 0.0)
    mean = _group_sums(token, seq_ids) / _group_sums(is_resp.to(token.dtype), seq_ids).clamp(min=1)
    ratio = torch.exp(torch.where(seq_ids >= 0, mean, 0.0)) * torch.exp(logp - logp.detach())
    unclipped, clipped = -A * ratio, -A * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), {
        "clip_frac": (clipped > unclipped).detach().to(logp.dtype)}


def cispo_surrogate(logp: Tensor, prox: Tensor, A: Tensor, seq_ids: Tensor | None = None,
                    mask: Tensor | None = None, *, eps_high: float = 0.2) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 0, 1+eps_high)) A logp: the clipped weight
    scales a REINFORCE gradient, so clipped tokens still get gradient."""
    ratio = torch.exp(log_ratio(logp, prox)).detach()
    loss = -torch.clamp(ratio, 0.0, 1.0 + eps_high) * A * logp
    return loss, {"clip_frac": (ratio > 1.0 + eps_high).to(logp.dtype)}


def sapo_surrogate(logp: Tensor, prox: Tensor, A: Tensor, seq_ids: Tensor | None = None,
                   mask: Tensor | None = None, *, tau_pos: float = 1.0, tau_neg: float = 1.05
                   ) -> TokenLoss:
    """SAPO (Qwen, 2025): l = -(4/tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else
    tau_neg: a soft trust region; at r = 1 its gradient is PPO's."""
    tau = torch.full_like(A, tau_neg).masked_fill(A > 0, tau_pos)
    return -(4.0 / tau) * torch.sigmoid(tau * (torch.exp(log_ratio(logp, prox)) - 1.0)) * A, {}


@dataclass(frozen=True)
class Surrogate:
    fn: Callable
    params: dict  # its hyper-parameters' defaults (--eps-low/--eps-high override those it has)
    aggregation: str = "token_mean"  # its --loss-aggregation auto


# GSPO's s_i, a geometric mean, moves far less than token ratios: the paper's (and verl's) clip
SURROGATES: dict[str, Surrogate] = {
    "ppo": Surrogate(ppo_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}),
    "gspo": Surrogate(gspo_surrogate, {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean"),
    "cispo": Surrogate(cispo_surrogate, {"eps_high": 0.2}),
    "sapo": Surrogate(sapo_surrogate, {"tau_pos": 1.0, "tau_neg": 1.05})}

# -----------------------------------------------------------------------------
# off-policy corrections (--correction) for pi_behave (the engine that sampled, maybe
# --max-staleness versions old) differing from pi_prox (the weights before this step's update)
def behaviour_weights(prox_logprobs: Tensor, behave_logprobs: Tensor, *, cap: float,
                      mode: str = "truncate") -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022): (w, rejected 0/1), w_t = sg(pi_prox / pi_behave).
    truncate: min(w, cap), none rejected; mask: w > cap rejected (m_t = 0, d_t kept), w kept."""
    w = torch.exp(log_ratio(prox_logprobs, behave_logprobs)).detach()
    return ((torch.clamp(w, max=cap), torch.zeros_like(w)) if mode == "truncate"
            else (torch.where(w > cap, 0.0, w), (w > cap).to(w.dtype)))


def m2po_mask(prox_logprobs: Tensor, behave_logprobs: Tensor, loss_mask: Tensor, *,
              threshold: float, group=None) -> Tensor:
    """M2PO (Zheng et al. 2025): the keep mask (0/1, within m) that drops the tokens of largest x =
    (log pi_prox/pi_behave)^2, ties together, until mean x <= threshold over `group`'s kept tokens.
    Exact across ranks: mean(x | x <= v) is non-decreasing in v, so bisect the largest admissible
    cut over float64's bit patterns (monotone for x >= 0): ~64 all_reduces of (sum, count)."""
    x = sanitize_log_ratio(prox_logprobs.detach() - behave_logprobs.detach()).double() ** 2
    valid = loss_mask > 0
    def kept_mean_ok(cut: float) -> bool:
        keep = valid & (x <= cut)
        s = all_reduce_vector(torch.stack([torch.where(keep, x, 0.0).sum(),
                                           keep.sum().double()]), group)
        return bool(s[0] <= threshold * s[1])
    local_max = torch.cat([torch.where(valid, x, 0.0), x.new_zeros(1)]).max()[None]  # x >= 0
    if kept_mean_ok(x_max := all_reduce_vector(local_max, group, op=dist.ReduceOp.MAX).item()):
        return loss_mask.clone()
    value = lambda b: struct.unpack("<d", struct.pack("<q", b))[0]  # the float64 of bit pattern b
    lo, hi = 0, struct.unpack("<q", struct.pack("<d", x_max))[0]  # 0: 0.0's bits (keeps x = 0)
    while hi - lo > 1:  # invariant: ok(value(lo)), not ok(value(hi))
        lo, hi = (mid, hi) if kept_mean_ok(value(mid := (lo + hi) // 2)) else (lo, mid)
    return loss_mask * (x <= value(lo)).to(loss_mask.dtype)


@dataclass(frozen=True)
class Correction:
    threshold: float | None = None  # the default --correction-threshold
    clip_to_behaviour: bool = False  # pi_prox := pi_behave
    token_mode: str | None = None  # a behaviour_weights mode, per token
    global_mask: Callable | None = None  # a keep mask over the mini-batch, from pi_prox pre-step
    clip: bool = True  # False: the surrogate's clip range opened up (eps_low 1, eps_high inf)


CORRECTIONS: dict[str, Correction] = {
    "none": Correction(),  # clip around pi_prox; pi_behave is ignored
    "behave": Correction(clip_to_behaviour=True),  # PPO around the policy that sampled (AReaL's)
    "truncate": Correction(2.0, token_mode="truncate"),  # decoupled PPO, its weight capped (TIS)
    "mask": Correction(2.0, token_mode="mask"),  # AReaL's decoupled PPO: tokens over the cap out
    "m2po": Correction(0.04, clip_to_behaviour=True, global_mask=m2po_mask, clip=False)}
AUTO_CORRECTION = {False: "behave", True: "truncate"}  # --correction auto, by updates_per_batch > 1


def apply_global_mask(mbs: list[MicroBatch], correction: str, threshold: float,
                      group=None) -> list[MicroBatch]:
    """A correction's keep_mask over one mini-batch's micro-batches on all of `group`, if any."""
    if (mask_fn := CORRECTIONS[correction].global_mask) is None or not mbs:
        return mbs
    keep = mask_fn(*(torch.cat([getattr(mb, k) for mb in mbs]) for k in (
        "prox_logprobs", "behave_logprobs", "loss_mask")), threshold=threshold, group=group)
    return [replace(mb, keep_mask=k)
            for mb, k in zip(mbs, keep.split([len(mb.loss_mask) for mb in mbs]))]


# -----------------------------------------------------------------------------
# KL penalty to a reference policy (--kl-estimator): with L = log pi - log pi_ref on tokens from pi,
# each estimator's *value* estimates KL(pi || ref) (Schulman 2020); a loss sees only its gradient:
#   k1 = L             gradient E_pi[grad log pi] = 0: noise alone (verl puts it in the reward);
#   k2 = L^2 / 2       gradient E_pi[L grad log pi] = grad KL(pi || ref)   (reverse KL);
#   k3 = e^-L - 1 + L  gradient E_pi[(1 - pi_ref/pi) grad log pi] = grad KL(ref || pi) (forward).
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": lambda L: L, "k2": lambda L: L**2 / 2,
    "k3": lambda L: (torch.exp(-L) - 1.0 + L).clamp(max=K3_CAP)}


def kl_penalty(logp: Tensor, ref: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL penalty of log-probs against the reference's, by KL_ESTIMATORS[estimator]."""
    return _choice("kl-estimator", estimator, KL_ESTIMATORS)(log_ratio(logp, ref))


# -----------------------------------------------------------------------------
# the trainer's loss: defaults that depend on other flags, checks, build_loss
def resolve_loss_flags(policy_loss: str, loss_aggregation: str, eps_low: float | None,
                       eps_high: float | None, divisor: float | None, correction: str,
                       threshold: float | None, max_new_tokens: int, max_staleness: int = 0,
                       updates_per_batch: int = 1) -> dict:
    """Defaults that depend on other flags: the surrogate's mode (auto) and clip range, constant's
    divisor (the longest response), the correction (auto) and its threshold."""
    s = _choice("policy-loss", policy_loss, SURROGATES)
    mode = s.aggregation if loss_aggregation == "auto" else loss_aggregation
    if correction == "auto":  # what docs/studies.md measured holding under staleness
        correction = "none" if max_staleness == 0 else AUTO_CORRECTION[updates_per_batch > 1]
    pick = lambda given, default: default if given is None else given
    return {"loss_aggregation": mode, "loss_aggregation_divisor": pick(
                divisor, float(max_new_tokens) if mode == "constant" else None),
            "eps_low": pick(eps_low, s.params.get("eps_low")),
            "eps_high": pick(eps_high, s.params.get("eps_high")), "correction": correction,
            "correction_threshold": pick(threshold, _choice("correction", correction,
                                                            CORRECTIONS).threshold)}


def needs_proximal_forward(correction: str, updates_per_batch: int) -> bool:
    """With one update per batch (one mini-batch, one pass) the training forward's log-probs,
    detached, are pi_prox, unless a correction masks the mini-batch from pi_prox first: else
    pi_prox (the weights before the batch's first update) needs a forward of its own, once."""
    corr = CORRECTIONS[correction]
    return corr.global_mask is not None or (updates_per_batch > 1 and not corr.clip_to_behaviour)


def surrogate_params(policy_loss: str, eps_low: float | None, eps_high: float | None) -> dict:
    """The surrogate's defaults and the clip flags given; one it cannot use is an error."""
    params = _choice("policy-loss", policy_loss, SURROGATES).params
    given = {k: v for k, v in (("eps_low", eps_low), ("eps_high", eps_high)) if v is not None}
    if unused := [k for k in given if k not in params]:
        raise ValueError(f"--{unused[0].replace('_', '-')}: {policy_loss} has no such parameter")
    return params | given


def check_loss_flags(cfg) -> None:
    """Every loss flag's range (on resolved flags); raises ValueError naming the flag."""
    response_weights(cfg.loss_aggregation, torch.zeros(0), torch.zeros(0),  # the mode, a divisor
                     cfg.loss_aggregation_divisor)
    if cfg.loss_aggregation != "constant" and cfg.loss_aggregation_divisor is not None:
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
    """sum_t mask_t weight_t values_t, no broadcasting; masked values -> 0 first (inf * 0 = NaN)."""
    for key, t in (("mask", mask), ("weight", weight)):
        if t is not None and t.shape != values.shape:
            raise ValueError(f"{name}: {key} shape {tuple(t.shape)} != loss {tuple(values.shape)}")
    w = mask if weight is None else mask * weight
    return (torch.where(w != 0, values, 0.0) * w).sum()


def build_loss(cfg, group=None, cp_factor: int = 1) -> LossReduction:
    """The trainer's loss from resolved flags: "policy" (the mode's objective; stats: the
    surrogate's, CAPPED), "entropy" and "kl" (token means, coefs -entropy_coef, kl_coef) if != 0."""
    params = surrogate_params(cfg.policy_loss, cfg.eps_low, cfg.eps_high)
    corr, cap = _choice("correction", cfg.correction, CORRECTIONS), cfg.correction_threshold
    if not corr.clip:  # r in [1 - 1, 1 + inf]: never clipped
        params |= {k: v for k, v in (("eps_low", 1.0), ("eps_high", math.inf)) if k in params}
    def policy(mb: MicroBatch) -> tuple[Tensor, Stats]:
        d, logp, active, weight = mb.denom_mask, mb.logprobs, mb.denom_mask > 0, mb.loss_weight
        m = mb.loss_mask if mb.keep_mask is None else mb.keep_mask
        stats = {} if corr.global_mask is None else {  # the share of d the mask took from m
            CAPPED: (((mb.loss_mask - m) * d).sum(), d.sum())}
        prox = mb.behave_logprobs if corr.clip_to_behaviour else mb.prox_logprobs
        # outside d: ratio 1 and advantage 0, so arbitrary prox values never make inf (nor NaN)
        prox = torch.where(active, logp.detach() if prox is None else prox, logp.detach())
        token_loss, indicators = SURROGATES[cfg.policy_loss].fn(
            logp, prox, torch.where(active, mb.advantages, 0.0), mb.seq_ids, m, **params)
        if corr.token_mode is not None:
            behave = torch.where(active, mb.behave_logprobs, prox)
            w, rejected = behaviour_weights(prox, behave, cap=cap, mode=corr.token_mode)
            stats[CAPPED] = (((log_ratio(prox, behave) > math.log(cap)) * d).sum(), d.sum())
            m, weight = m * (1.0 - rejected), weight * w
        stats |= {f"policy/{k}": ((v * m).sum(), m.sum()) for k, v in indicators.items()}
        return masked_sum(token_loss, m, weight, "policy"), stats
    def kl(mb: MicroBatch) -> Tensor:  # pi_ref outside d is arbitrary: ratio 1 there, exp() finite
        ref = torch.where(mb.denom_mask > 0, mb.ref_logprobs, mb.logprobs.detach())
        return masked_sum(kl_penalty(mb.logprobs, ref, cfg.kl_estimator), mb.loss_mask, name="kl")
    # normalizers in float64: summed over many micro-batches and ranks
    norm = lambda mb: (mb.denom_mask.double() * mb.norm_weight.double()).sum()
    tokens = lambda mb: mb.denom_mask.double().sum()
    entropy = lambda mb: masked_sum(mb.entropy, mb.loss_mask, name="entropy")
    typed = lambda fn: lambda mb: fn(as_microbatch(mb))  # a mapping works too (tests, scripts)
    return LossReduction([LossTerm(name, typed(fn), typed(nf), coef) for name, fn, nf, coef in (
        ("policy", policy, norm, 1.0), ("entropy", entropy, tokens, -cfg.entropy_coef),
        ("kl", kl, tokens, cfg.kl_coef)) if coef != 0.0], group, cp_factor)
