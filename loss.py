"""nanoareal's losses: the aggregation modes, the policy surrogates, and the LossReduction contract.

Notation. One optimizer step consumes one mini-batch of prompt groups g, each holding the
responses sampled for one prompt. For response token t of response i:
    l_t  per-token policy loss (a surrogate below)
    m_t  numerator mask (the token is in the loss)
    d_t  denominator mask (the token counts in denominators); m_t <= d_t: a token rejected after
         the fact (behaviour-weight cap in mask mode, M2PO) leaves the numerator but stays in the
         denominator, so rejecting tokens never silently up-weights the ones that survive
    M_i = sum_t d_it; response i is active when M_i > 0, group g when sum_{i in g} M_i > 0;
    N = active responses, P = active groups. Every sum runs over the whole mini-batch: all
    micro-batches, all data-parallel ranks, all context-parallel shards.

The contract. A loss is a `LossReduction` of `LossTerm`s. A term has `loss_fn(mb)` of kind "sum"
(the micro-batch's share of the numerator) or "mean" (a mean over the micro-batch's own
normalizer), `normalizer_fn(mb) >= 0` (the micro-batch's share of the denominator, from masks and
weights only; may be fractional) and a coefficient. For one optimizer step the trainer does

    reduction.begin_step(microbatches)  # every term's normalizer: ONE all_reduce -> Z_k
    for mb in microbatches:             # forward, then
        reduction(mb).backward()        # sum_k coef_k * (loss_fn / Z_k  or  loss_fn * n_mb / Z_k)
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
7. Entropy bonus and KL penalty are terms of the same reduction.

Each aggregation mode is a pair of per-token weights: objective = sum_t m_t w_t l_t / sum_t d_t
nw_t, so a micro-batch's normalizer sum_t d_t nw_t is a (fractional) count of tokens, responses
or groups and micro-batches may cut anywhere between tokens. Adding a mode or a surrogate touches
this file only: a function, its entry in MODES / SURROGATES, and a LossConfig field for any new
hyper-parameter.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

# -----------------------------------------------------------------------------
# aggregation modes (--loss-aggregation): per-response (w_i, nw_i) from the whole mini-batch's
# metadata. M [R] = response denominators M_i (0 for inactive responses, which get zero weights),
# groups [R] = ids.


def token_mean(M: Tensor, groups: Tensor, divisor: float | None) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / sum_t d_t (DAPO; TRL "dapo", verl "token-mean"): every token weighs the same,
    so a response's weight grows with its length; a token's gradient share is 1 / (tokens in the
    mini-batch)."""
    active = (M > 0).double()
    return active, active


def seq_mean(M: Tensor, groups: Tensor, divisor: float | None) -> tuple[Tensor, Tensor]:
    """(1/N) sum_i (sum_t m_it l_it) / M_i (GRPO; TRL "grpo", verl "seq-mean-token-mean"): every
    response weighs the same, so a token of a response of length M_i gets 1 / (N M_i): short
    responses' tokens count more."""
    inv = _safe_inverse(M)
    return inv, inv


def prompt_mean(M: Tensor, groups: Tensor, divisor: float | None) -> tuple[Tensor, Tensor]:
    """(1/P) sum_g (sum_{i in g, t} m l) / D_g, D_g = sum_{i in g} M_i: every prompt group weighs
    the same, a token within it 1 / (P D_g): its group's total length, not its own response's,
    sets its weight."""
    _, g = torch.unique(groups, return_inverse=True)
    D = torch.zeros(int(g.max()) + 1 if g.numel() else 0, dtype=M.dtype).index_add_(0, g, M)[g]
    inv = torch.where(M > 0, _safe_inverse(D), 0.0)
    return inv, inv


def constant(M: Tensor, groups: Tensor, divisor: float | None) -> tuple[Tensor, Tensor]:
    """sum_t m_t l_t / (N C), C = --loss-aggregation-divisor (Dr. GRPO; TRL "dr_grpo", verl
    "seq-mean-token-sum-norm"): every token gets 1 / (N C) whatever its response's length, so
    length carries no bias. nw = 1/M_i makes the normalizer count responses (N); w = 1/C is the
    constant."""
    return (M > 0).double() / divisor, _safe_inverse(M)


MODES: dict[str, Callable[[Tensor, Tensor, float | None], tuple[Tensor, Tensor]]] = {
    "token_mean": token_mean, "seq_mean": seq_mean, "prompt_mean": prompt_mean,
    "constant": constant}


def _safe_inverse(x: Tensor) -> Tensor:
    # where before dividing: no inf
    return torch.where(x > 0, 1.0 / torch.where(x > 0, x, 1.0), 0.0)


def check_mode(mode: str, divisor: float | None) -> None:
    if mode not in MODES:
        raise ValueError(f"--loss-aggregation: unknown mode {mode!r}; choose one of {tuple(MODES)}")
    if mode == "constant" and (divisor is None or not math.isfinite(divisor) or divisor <= 0):
        raise ValueError("--loss-aggregation constant needs a positive "
                         "--loss-aggregation-divisor, got "
                         f"{divisor!r} (a sensible value is the rollout's max new tokens)")


def response_weights(mode: str, denom_counts: Tensor, group_ids: Tensor,
                     divisor: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-response (loss_weight w_i, norm_weight nw_i) of `mode` for objective sum m w l / sum d
    nw. denom_counts (M_i) must cover the WHOLE mini-batch (every micro-batch and rank)."""
    check_mode(mode, divisor)
    M = denom_counts.to(torch.float64)
    if M.dim() != 1 or group_ids.shape != M.shape:
        raise ValueError(f"denom_counts {tuple(M.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must be [R]")
    if (M < 0).any() or not torch.isfinite(M).all():
        raise ValueError("denom_counts must be finite and >= 0")
    return MODES[mode](M, group_ids, divisor)


def per_token(values: Tensor, seq_ids: Tensor) -> Tensor:
    """Expand per-response values [R] to tokens [T] by seq_ids (-1, non-response tokens, get 0)."""
    if values.numel() == 0:
        return torch.zeros(seq_ids.shape, dtype=values.dtype)
    zero = torch.zeros((), dtype=values.dtype)
    return torch.where(seq_ids >= 0, values[seq_ids.clamp(min=0)], zero)


def aggregate(token_loss: Tensor, loss_mask: Tensor, *, mode: str, group_ids: Tensor,
              denom_mask: Tensor | None = None, divisor: float | None = None) -> Tensor:
    """Reference: the full-batch objective of each mode on padded [B, T] tensors, in one process.

    Written straight from the formulas in the mode docstrings, independently of
    `response_weights`; tests and readers compare against it. An empty denominator gives 0 (times
    the loss: the graph stays finite).
    """
    check_mode(mode, divisor)
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
        return per_resp_num.sum() / (N * divisor) if N > 0 else zero
    total, P = zero, 0  # prompt_mean
    for g in torch.unique(group_ids):
        in_g = group_ids == g
        D_g = M[in_g].sum()
        if D_g > 0:
            total = total + per_resp_num[in_g].sum() / D_g
            P += 1
    return total / P if P > 0 else zero


# -----------------------------------------------------------------------------
# the LossReduction contract

# per-token keys of a packed micro-batch; all must be 1-D with one shape (no broadcasting)
TOKEN_KEYS = ("logprobs", "prox_logprobs", "behave_logprobs", "advantages", "loss_mask",
              "denom_mask",
              "loss_weight", "norm_weight", "seq_ids", "entropy", "ref_logprobs")


@dataclass
class LossTerm:
    """One term of a loss. `normalizer_fn` may read masks/weights only: it runs before any forward.
    """

    name: str
    loss_fn: Callable[[dict], Tensor]
    normalizer_fn: Callable[[dict], float | Tensor]
    kind: Literal["sum", "mean"]
    coef: float = 1.0


def validate_microbatch(mb: dict) -> None:
    """Rule 4: every per-token tensor present is 1-D with exactly one shape; m <= d."""
    ref_key = "logprobs" if "logprobs" in mb else "loss_mask"
    if ref_key not in mb:
        raise ValueError("micro-batch has neither 'logprobs' nor 'loss_mask'")
    shape = mb[ref_key].shape
    if len(shape) != 1:
        raise ValueError(f"'{ref_key}' must be 1-D [T] (packed), got shape {tuple(shape)}")
    for key in TOKEN_KEYS:
        if key in mb and mb[key].shape != shape:
            raise ValueError(f"'{key}' has shape {tuple(mb[key].shape)}, expected {tuple(shape)} "
                             f"like '{ref_key}'")
    if "seq_ids" in mb and mb["seq_ids"].is_floating_point():
        raise ValueError(f"'seq_ids' must be an integer tensor, got {mb['seq_ids'].dtype}")
    if "loss_mask" in mb and "denom_mask" in mb and (mb["loss_mask"] > mb["denom_mask"]).any():
        raise ValueError("'loss_mask' > 'denom_mask' somewhere: a token may count in the numerator "
                         "only if it also counts in the denominator (m_t <= d_t)")


def _as_float(value: float | Tensor) -> float:
    if isinstance(value, Tensor):
        return float(value.detach().to(torch.float64).item())
    return float(value)


def all_reduce_vector(vec: Tensor, group=None, op=None) -> Tensor:
    """All-reduce a small host vector (sum by default) over `group`; a no-op in a world of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # NCCL reduces only CUDA tensors, gloo only CPU ones: move the (tiny) vector to the
        # backend's device
        nccl = dist.get_backend(group) == "nccl"
        buf = vec.to(torch.device("cuda",
                                  torch.cuda.current_device()) if nccl else torch.device("cpu"))
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
        vec = buf.to(vec.device)
    return vec


class LossReduction:
    """Exact loss reduction across micro-batches, data-parallel and context-parallel ranks.

    `group` is the normalizer group: every rank whose gradients are reduced together (DP x CP);
    None is the default group. begin_step must see this rank's own tokens: across the group,
    every token of the mini-batch in exactly one micro-batch. `cp_factor`: the CP size when every
    CP rank computes the loss of the gathered full sequences (each token then counts cp_factor
    times in the gradient sum, so Z carries the same factor); 1 when CP ranks compute the loss of
    their own token shards. The micro-batch normalizer n_mb is recomputed in __call__ with the
    same normalizer_fn (no reliance on call order): a normalizer_fn must be a pure function of
    the micro-batch.
    """

    def __init__(self, terms: list[LossTerm], group=None, cp_factor: int = 1):
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"term names must be unique, got {names}")
        for t in terms:
            if t.kind not in ("sum", "mean"):
                raise ValueError(f"term {t.name!r}: kind must be 'sum' or 'mean', got {t.kind!r}")
        if cp_factor < 1:
            raise ValueError(f"cp_factor must be >= 1, got {cp_factor}")
        self.terms, self.group, self.cp_factor = terms, group, cp_factor
        self.Z: dict[str, float] = {}
        # device tensors until reported(): no per-call sync
        self._numerators: dict[str, float | Tensor] = {}
        self._stats: dict[str, list[float | Tensor]] = {}

    def _normalizer(self, term: LossTerm, mb: dict) -> float:
        n = _as_float(term.normalizer_fn(mb))
        if not math.isfinite(n) or n < 0:
            raise ValueError(f"term {term.name!r}: normalizer must be finite and >= 0, got {n}")
        return n

    def begin_step(self, microbatches: list[dict]) -> None:
        """Sum every term's normalizer over this rank's micro-batches; one all_reduce -> global Z_k.
        """
        local = torch.zeros(len(self.terms), dtype=torch.float64)
        for mb in microbatches:
            validate_microbatch(mb)
            for k, term in enumerate(self.terms):
                local[k] += self._normalizer(term, mb)
        Z = all_reduce_vector(local, self.group) * self.cp_factor
        self.Z = {t.name: float(z) for t, z in zip(self.terms, Z.tolist(), strict=True)}
        self._numerators = {t.name: 0.0 for t in self.terms}
        self._stats = {}

    def __call__(self, mb: dict) -> Tensor:
        """The micro-batch's loss for backward: sum_k coef_k * (loss_fn / Z_k | loss_fn * n_mb /
        Z_k)."""
        if not self.Z:
            raise RuntimeError("call begin_step(microbatches) before computing micro-batch losses")
        validate_microbatch(mb)
        total = None
        for term in self.terms:
            value = term.loss_fn(mb)
            # n_mb was validated in begin_step; no float() here: it would sync the GPU
            if term.kind == "mean":
                value = value * term.normalizer_fn(mb)
            numerator = value.detach().to(torch.float64)
            self._numerators[term.name] = self._numerators[term.name] + numerator
            Z = self.Z[term.name]
            # Z == 0: multiply (a finite loss) by 0, never divide, so gradients stay finite zeros
            scaled = value * (term.coef / Z) if Z > 0 else value * 0.0
            total = scaled if total is None else total + scaled
        return total

    def record_stat(self, name: str, total: float | Tensor, count: float | Tensor) -> None:
        """Accumulate a global fraction total/count (e.g. clipped tokens / tokens) for `reported`.
        Every rank must record the same names (they ride in one collective)."""
        acc = self._stats.setdefault(name, [0.0, 0.0])
        acc[0] = acc[0] + (total.detach() if isinstance(total, Tensor) else total)
        acc[1] = acc[1] + (count.detach() if isinstance(count, Tensor) else count)

    def reported(self) -> dict[str, float]:
        """Global value of every term (sum_mb numerator / Z_k), 'loss' = sum_k coef_k value_k, and
        the recorded stats as global fractions; one all_reduce."""
        stat_names = sorted(self._stats)
        vec = torch.tensor([_as_float(self._numerators.get(t.name, 0.0)) for t in self.terms]
                           + [_as_float(self._stats[s][i]) for s in stat_names for i in (0, 1)],
                           dtype=torch.float64)
        vec = all_reduce_vector(vec, self.group).tolist()
        out, loss = {}, 0.0
        for k, term in enumerate(self.terms):
            Z = self.Z.get(term.name, 0.0)
            out[term.name] = vec[k] / Z if Z > 0 else 0.0
            loss += term.coef * out[term.name]
        out["loss"] = loss
        for j, s in enumerate(stat_names):
            total, count = vec[len(self.terms) + 2 * j], vec[len(self.terms) + 2 * j + 1]
            out[s] = total / count if count > 0 else 0.0
        return out


def fsdp_sum_gradients(model: torch.nn.Module) -> None:
    """Make FSDP2 sum (not average) gradients across ranks, as the contract needs.

    Both setters act on one FSDP module's own parameters, not recursively: set them on every FSDP
    module. A divide factor alone makes FSDP2 reduce with ReduceOp.PREMUL_SUM, which gloo rejects
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); forcing sum reductions gives a plain SUM (then
    divide by 1: skipped) on every backend. The alternative is multiplying each micro-batch loss
    by the world size.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# -----------------------------------------------------------------------------
# policy surrogates (--policy-loss): pure functions on packed [T] tensors -> (token_loss, stats)


def sanitize_log_ratio(x: Tensor) -> Tensor:
    """NaN (from -inf - -inf) -> 0; real +-inf stays so masks and caps can reject it."""
    return torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)


LOG_RATIO_BOUND = 20.0


def log_ratio(logp: Tensor, other: Tensor) -> Tensor:
    """log(p / other), sanitised and clamped to +-20 before anything exponentiates it: one token
    at log-ratio 95 would overflow exp() to inf, and inf * 0 in the branch a clip does not select
    turns the whole step's gradient into NaN. exp(20) ~ 5e8 is still far beyond any clip or cap,
    so masks and caps reject such a token as before; beyond the bound its gradient is 0."""
    return sanitize_log_ratio(logp - other).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def ppo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor, *,
                  eps_low: float = 0.2,
                  eps_high: float = 0.2, dual_clip: float | None = None
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - logp_prox) (Schulman et al.
    2017); eps_high > eps_low is DAPO's clip-higher. Dual clip c > 1 (Ye et al. 2020): for A < 0,
    l = min(l, -c A)."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clipped": (clipped > unclipped).detach().to(logprobs.dtype)}
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        stats["dual_clipped"] = dual.detach().to(logprobs.dtype)
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
    sums = torch.zeros(n_seq, dtype=token.dtype).index_add_(0, idx, token)
    counts = torch.zeros(n_seq, dtype=token.dtype).index_add_(0, idx, is_resp.to(token.dtype))
    seq_log_ratio = sums / counts.clamp(min=1.0)
    seq_ratio = torch.exp(torch.where(seq_ids >= 0, seq_log_ratio[idx], 0.0))
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"clipped": (clipped > unclipped).detach().to(logprobs.dtype)}


def cispo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor, *,
                    eps_high: float = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 0, 1+eps_high)) A logp: the clipped importance
    weight scales a REINFORCE gradient, so clipped tokens still get gradient."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs)).detach()
    weight = torch.clamp(ratio, 0.0, 1.0 + eps_high)
    loss = -weight * advantages * logprobs
    return loss, {"clipped": (ratio > 1.0 + eps_high).to(logprobs.dtype)}


def sapo_surrogate(logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor, *,
                   tau_pos: float = 1.0,
                   tau_neg: float = 1.05) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Qwen, 2025): l = -(4/tau) sigmoid(tau (r - 1)) A with tau = tau_pos if A > 0 else
    tau_neg: a soft trust region instead of a hard clip; at r = 1 its gradient equals PPO's."""
    ratio = torch.exp(log_ratio(logprobs, prox_logprobs))
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    return loss, {}


def behaviour_weights(prox_logprobs: Tensor, behave_logprobs: Tensor, *, cap: float,
                      mode: Literal["truncate", "mask"] = "truncate") -> tuple[Tensor, Tensor]:
    """Decoupled PPO (Hilton et al. 2022): w_t = pi_prox / pi_behave (detached). truncate: w =
    min(w, cap), nothing rejected; mask: tokens with w > cap are rejected (caller sets m_t = 0,
    keeps d_t), the rest keep w. Returns (weights, rejected 0/1)."""
    w = torch.exp(log_ratio(prox_logprobs, behave_logprobs)).detach()
    if mode == "truncate":
        return torch.clamp(w, max=cap), torch.zeros_like(w)
    rejected = w > cap
    return torch.where(rejected, 0.0, w), rejected.to(w.dtype)


def m2po_mask(prox_logprobs: Tensor, behave_logprobs: Tensor, loss_mask: Tensor, *,
              threshold: float,
              group=None) -> Tensor:
    """M2PO (Zheng et al. 2025): drop the tokens with the largest second moment x = (log
    pi_prox/pi_behave)^2 until the mean of x over the kept tokens is <= threshold. Global over
    `group` (pass all of a rank's mini-batch tokens); returns the new loss mask (d is untouched).
    Tokens tied at the cut are dropped together.

    Exact across ranks: mean(x | x <= v) is non-decreasing in v, so the largest admissible cut v
    is found by bisection over the bit patterns of float64 (monotone for x >= 0), ~64 all_reduces
    of (sum, count).
    """
    x = sanitize_log_ratio(prox_logprobs.detach() - behave_logprobs.detach()).to(torch.float64) ** 2
    valid = loss_mask > 0

    def kept_mean_ok(cut: float) -> bool:
        keep = valid & (x <= cut)
        s = all_reduce_vector(torch.stack([torch.where(keep, x, 0.0).sum(),
                                           keep.sum().to(torch.float64)]), group)
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
        if kept_mean_ok(value(mid)):
            lo = mid
        else:
            hi = mid
    return loss_mask * (x <= value(lo)).to(loss_mask.dtype)


def apply_m2po(mbs: list[dict], threshold: float, group=None) -> None:
    """M2PO on one mini-batch's packed micro-batches: each one's 'loss_mask' replaced by the mask
    m2po_mask computes over all of the mini-batch's tokens, on every rank of `group`."""
    if not mbs:  # empty on every rank (the trainer pads a rank that alone has none)
        return
    prox, behave, mask = (torch.cat([mb[key] for mb in mbs])
                          for key in ("prox_logprobs", "behave_logprobs", "loss_mask"))
    masks = m2po_mask(prox, behave, mask, threshold=threshold, group=group)
    for mb, m in zip(mbs, masks.split([len(mb["loss_mask"]) for mb in mbs])):
        mb["loss_mask"] = m


# KL penalties to a reference policy. With L = log pi - log pi_ref on tokens sampled from pi, each
# estimator's *value* estimates KL(pi || ref) (Schulman, "Approximating KL divergence", 2020), but
# as a loss only its gradient counts, and those differ:
#   k1 = L             gradient E_pi[grad L] = E_pi[grad log pi] = 0: pure noise, so not offered;
#   k2 = L^2 / 2       gradient E_pi[L grad log pi] = grad KL(pi || ref)   (reverse KL);
#   k3 = e^-L - 1 + L  gradient E_pi[(1 - pi_ref/pi) grad log pi] = grad KL(ref || pi)  (forward
#                      KL; GRPO's and verl's low_var_kl choice), never negative.
# L is clamped like every log-ratio, and k3's value, whose e^-L explodes where pi_ref >> pi, at 10.
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k2": lambda L: 0.5 * L**2,
    "k3": lambda L: (torch.exp(-L) - 1.0 + L).clamp(max=10.0),
}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL penalty (KL_ESTIMATORS) of log-probs against reference log-probs."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl-estimator: unknown estimator {estimator!r}; choose one of "
                         f"{tuple(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](log_ratio(logprobs, ref_logprobs))


# -----------------------------------------------------------------------------
# the trainer's loss: the surrogate catalogue, the loss flags, build_loss


@dataclass(frozen=True)
class Surrogate:
    """A policy surrogate as the trainer calls it: fn(mb, logp, prox, adv, cfg) -> (token_loss,
    stats), and its defaults for --eps-low, --eps-high and --loss-aggregation."""

    fn: Callable
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "token_mean"


def _ppo(mb, logp, prox, adv, c):
    return ppo_surrogate(logp, prox, adv, eps_low=c.eps_low, eps_high=c.eps_high,
                         dual_clip=c.dual_clip)


def _gspo(mb, logp, prox, adv, c):
    return gspo_surrogate(logp, prox, adv, mb["seq_ids"], mb["loss_mask"], eps_low=c.eps_low,
                          eps_high=c.eps_high)


def _cispo(mb, logp, prox, adv, c):
    return cispo_surrogate(logp, prox, adv, eps_high=c.eps_high)


def _sapo(mb, logp, prox, adv, c):
    return sapo_surrogate(logp, prox, adv, tau_pos=c.sapo_tau_pos, tau_neg=c.sapo_tau_neg)


# GSPO clips a sequence-level ratio, a geometric mean that moves far less than token ratios: the
# paper uses 3e-4 / 4e-4 with a per-sequence mean (seq_mean), as does verl's recipe
SURROGATES: dict[str, Surrogate] = {
    "ppo": Surrogate(_ppo), "gspo": Surrogate(_gspo, 3e-4, 4e-4, "seq_mean"),
    "cispo": Surrogate(_cispo), "sapo": Surrogate(_sapo)}
STAT_NAMES = {"clipped": "policy/clip_frac", "dual_clipped": "policy/dual_clip_frac"}


@dataclass
class LossConfig:
    """The loss flags. The trainer's Config inherits them: they are --flags like the rest."""

    # loss
    loss_aggregation: Literal[("auto", *MODES)] = "auto"  # type: ignore[valid-type]
    """How token losses are averaged over the mini-batch: token_mean (DAPO), seq_mean (GRPO),
    prompt_mean or constant (Dr. GRPO); auto is the surrogate's own (seq_mean for gspo, else
    token_mean). The formulas are in loss.py and the README."""
    loss_aggregation_divisor: float | None = None
    """The constant C of --loss-aggregation constant (objective = token-loss sum / (responses x
    C)); defaults to --max-new-tokens."""
    policy_loss: Literal[tuple(SURROGATES)] = "ppo"  # type: ignore[valid-type]
    """Policy surrogate: ppo (clipped ratio), gspo (sequence-level ratio), cispo (clipped
    importance weight on a REINFORCE gradient) or sapo (soft sigmoid gate instead of a clip)."""
    eps_low: float | None = None
    """Lower clip range: the ratio is clipped below at 1 - eps_low; default 0.2, and 3e-4 for
    gspo (its paper's value for a sequence-level ratio)."""
    eps_high: float | None = None
    """Upper clip range: the ratio is clipped above at 1 + eps_high (above eps_low: DAPO's
    clip-higher; CISPO's weight cap); default 0.2, and 4e-4 for gspo."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye et al. 2020): caps the loss of a negative-advantage token at
    -c A; off by default."""
    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens with positive advantage (higher: harder trust region)."""
    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for tokens with negative advantage."""
    behaviour_cap: float | None = None
    """Decoupled PPO: multiply each token's loss by pi_prox/pi_behave (the rollout engine's
    policy), capped at this value; off by default."""
    behaviour_cap_mode: Literal["truncate", "mask"] = "truncate"
    """What --behaviour-cap does to a token above the cap: truncate its weight, or mask it out of
    the numerator (it stays in the denominator)."""
    m2po_threshold: float | None = None
    """M2PO: mask the tokens with the largest (log pi_prox/pi_behave)^2 until their mean over the
    kept tokens is at most this value; off by default."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (the token mean of the policy's entropy, subtracted)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (token mean; loads a frozen reference copy of
    the model)."""
    kl_estimator: Literal[tuple(KL_ESTIMATORS)] = "k3"  # type: ignore[valid-type]
    """KL penalty with L = log pi - log pi_ref: k2 = L^2/2 has the gradient of KL(pi||ref), k3 =
    exp(-L) - 1 + L that of KL(ref||pi); k1 = L is not offered (its gradient is 0 on average)."""


def resolved(c: LossConfig, max_new_tokens: int | None = None) -> LossConfig:
    """A copy of the loss flags with the defaults that depend on other flags filled in: the
    surrogate's aggregation mode for auto and clip range for an unset --eps-low / --eps-high, and
    constant's divisor (the longest response, max_new_tokens) when none is given."""
    if c.policy_loss not in SURROGATES:
        raise ValueError(f"--policy-loss: unknown surrogate {c.policy_loss!r}; choose one of "
                         f"{tuple(SURROGATES)}")
    s = SURROGATES[c.policy_loss]
    mode = s.aggregation if c.loss_aggregation == "auto" else c.loss_aggregation
    divisor = c.loss_aggregation_divisor
    if mode == "constant" and divisor is None and max_new_tokens:
        divisor = float(max_new_tokens)
    return dataclasses.replace(c, loss_aggregation=mode, loss_aggregation_divisor=divisor,
                               eps_low=s.eps_low if c.eps_low is None else c.eps_low,
                               eps_high=s.eps_high if c.eps_high is None else c.eps_high)


def check_loss_config(c: LossConfig, max_new_tokens: int | None = None) -> LossConfig:
    """Every loss flag's range, in one place; raises ValueError naming the flag. Returns the
    flags resolved (see resolved)."""
    c = resolved(c, max_new_tokens)
    check_mode(c.loss_aggregation, c.loss_aggregation_divisor)
    if c.loss_aggregation != "constant" and c.loss_aggregation_divisor is not None:
        raise ValueError(f"--loss-aggregation-divisor is only used by --loss-aggregation constant "
                         f"(not {c.loss_aggregation})")
    if not (0 <= c.eps_low < 1 and c.eps_high >= 0):
        raise ValueError(f"--eps-low must be in [0, 1) and --eps-high >= 0, got {c.eps_low} and "
                         f"{c.eps_high}")
    if c.kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl-estimator: unknown estimator {c.kl_estimator!r}; choose one of "
                         f"{tuple(KL_ESTIMATORS)}")
    if c.dual_clip is not None and not c.dual_clip > 1.0:
        raise ValueError(f"--dual-clip must be > 1, got {c.dual_clip}")
    if c.behaviour_cap is not None and not c.behaviour_cap > 0:
        raise ValueError(f"--behaviour-cap must be > 0, got {c.behaviour_cap}")
    if c.behaviour_cap_mode not in ("truncate", "mask"):
        raise ValueError("--behaviour-cap-mode must be 'truncate' or 'mask', got "
                         f"{c.behaviour_cap_mode!r}")
    if c.m2po_threshold is not None and c.m2po_threshold < 0:
        raise ValueError(f"--m2po-threshold must be >= 0, got {c.m2po_threshold}")
    if min(c.sapo_tau_pos, c.sapo_tau_neg) <= 0 or c.kl_coef < 0:
        raise ValueError("--sapo-tau-pos and --sapo-tau-neg must be > 0 and --kl-coef >= 0")
    return c


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


def build_loss(cfg: LossConfig, group=None, cp_factor: int = 1) -> LossReduction:
    """The trainer's loss from the loss flags: a "policy" term (sum kind, sum m w l / sum d nw with
    the mode weights in the micro-batch's 'loss_weight'/'norm_weight'), optionally "entropy"
    (token mean of mb['entropy'], coef -entropy_coef) and "kl" (token mean of the KL estimate,
    coef kl_coef).

    With --behaviour-cap (decoupled PPO) the token loss is multiplied by the capped
    pi_prox/pi_behave; in mask mode rejected tokens leave the numerator (m_t = 0) and stay in the
    denominator. Stats: policy/clip_frac (over m tokens), policy/dual_clip_frac,
    policy/behave_reject_frac (over d).
    """
    cfg = check_loss_config(cfg)
    surrogate = SURROGATES[cfg.policy_loss]

    def policy_fn(mb: dict) -> Tensor:
        m, d = mb["loss_mask"], mb["denom_mask"]
        active = d > 0
        logp = mb["logprobs"]
        # non-response / non-denominator tokens get ratio 1 and advantage 0: their (arbitrary) prox
        # values can never produce inf in the forward, hence never NaN in the backward
        prox = torch.where(active, mb["prox_logprobs"], logp.detach())
        advantages = torch.where(active, mb["advantages"], 0.0)
        token_loss, stats = surrogate.fn(mb, logp, prox, advantages, cfg)
        weight = mb["loss_weight"]
        if cfg.behaviour_cap is not None:
            behave = torch.where(active, mb["behave_logprobs"], mb["prox_logprobs"])
            w_beh, rejected = behaviour_weights(mb["prox_logprobs"], behave, cap=cfg.behaviour_cap,
                                                mode=cfg.behaviour_cap_mode)
            reduction.record_stat("policy/behave_reject_frac", (rejected * d).sum(), d.sum())
            m = m * (1.0 - rejected)
            weight = weight * w_beh
        for key, indicator in stats.items():
            reduction.record_stat(STAT_NAMES[key], (indicator * m).sum(), m.sum())
        return masked_sum(token_loss, m, weight, name="policy")

    # float64: normalizers are summed over many micro-batches and ranks before anything divides by
    # them
    def policy_norm(mb: dict) -> Tensor:
        return (mb["denom_mask"].double() * mb["norm_weight"].double()).sum()

    def token_count(mb: dict) -> Tensor:
        return mb["denom_mask"].double().sum()

    def entropy_fn(mb: dict) -> Tensor:  # mean kind: the micro-batch's own token mean
        count = token_count(mb)
        total = masked_sum(mb["entropy"], mb["loss_mask"], name="entropy")
        return torch.where(count > 0, total / count.clamp(min=1).to(total.dtype), total * 0.0)

    def kl_fn(mb: dict) -> Tensor:
        # reference logprobs outside the response are arbitrary: ratio 1 there, so exp() stays
        # finite
        ref = torch.where(mb["denom_mask"] > 0, mb["ref_logprobs"], mb["logprobs"].detach())
        return masked_sum(kl_penalty(mb["logprobs"], ref, cfg.kl_estimator), mb["loss_mask"],
                          name="kl")

    terms = [LossTerm("policy", policy_fn, policy_norm, "sum", 1.0)]
    if cfg.entropy_coef != 0.0:
        terms.append(LossTerm("entropy", entropy_fn, token_count, "mean", -cfg.entropy_coef))
    if cfg.kl_coef != 0.0:
        terms.append(LossTerm("kl", kl_fn, token_count, "sum", cfg.kl_coef))
    reduction = LossReduction(terms, group=group, cp_factor=cp_factor)
    return reduction
