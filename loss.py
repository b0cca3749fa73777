"""nanoareal losses: aggregation modes, policy surrogates, and the LossReduction contract.

The contract. A loss is a `LossReduction` of `LossTerm`s. Each term declares
`loss_fn(mb)` (kind "sum": the micro-batch's local numerator; kind "mean": a local mean over the
micro-batch's own normalizer), `normalizer_fn(mb)` (the micro-batch's share of the term's
denominator, from masks and weights only), and a coefficient. For one optimizer step the trainer:

    reduction.begin_step(microbatches)  # every normalizer of every micro-batch, ONE all_reduce -> Z_k
    for mb in microbatches:             # forward, then
        reduction(mb).backward()        # sum_k coef_k * (loss_fn / Z_k  or  loss_fn * n_mb / Z_k)
    logs = reduction.reported()         # ONE all_reduce -> global value of every term + stats

and makes the cross-rank gradient reduction a *sum* (FSDP2 averages: call `fsdp_sum_gradients(model)`
once, or multiply each loss by the data-parallel world size; a bare set_gradient_divide_factor(1.0)
fails on gloo, see there).

The invariant it guarantees: the summed gradient, and every reported number, equal those of the
full mini-batch objective computed in one process on one micro-batch, whatever the micro-batch
split (through groups, through responses for token-local surrogates) and whatever the DP x CP
layout. It holds because the aggregation mode never divides by anything local: mode weights are
per-token numbers computed from the whole mini-batch's metadata before splitting
(`response_weights`), and the only denominator is the global Z_k. An empty denominator is not an
error: that term contributes exactly 0 with finite zero gradients.

Aggregation as per-token weights (`w_t` numerator weight, `nw_t` normalizer weight, M_i = sum_t d_it):
    objective = sum_t m_t w_t l_t / sum_t d_t nw_t
so the per-micro-batch normalizer sum_t d_t nw_t is a (fractional) count of tokens, responses or
groups, and micro-batches may cut anywhere between tokens.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

MODES = ("token_mean", "seq_mean", "prompt_mean", "constant")
SURROGATES = ("ppo", "gspo", "cispo", "sapo")
STAT_NAMES = {"clipped": "policy/clip_frac", "dual_clipped": "policy/dual_clip_frac"}
KL_ESTIMATORS = ("k1", "k2", "k3")

# per-token keys of a packed micro-batch; all must be 1-D with one shape (no broadcasting)
TOKEN_KEYS = (
    "logprobs",
    "prox_logprobs",
    "behave_logprobs",
    "advantages",
    "loss_mask",
    "denom_mask",
    "loss_weight",
    "norm_weight",
    "seq_ids",
    "entropy",
    "ref_logprobs",
)


# -----------------------------------------------------------------------------
# aggregation modes (--loss-aggregation)


def check_mode(mode: str, divisor: float | None) -> None:
    if mode not in MODES:
        raise ValueError(f"--loss-aggregation: unknown mode {mode!r}; choose one of {MODES}")
    if mode == "constant" and (divisor is None or not math.isfinite(divisor) or divisor <= 0):
        raise ValueError(
            f"--loss-aggregation constant needs a positive --loss-aggregation-divisor, got {divisor!r} "
            "(a sensible value is the rollout's max new tokens)"
        )


def response_weights(
    mode: str, denom_counts: Tensor, group_ids: Tensor, divisor: float | None = None
) -> tuple[Tensor, Tensor]:
    """Per-response (loss_weight w_i, norm_weight nw_i) for objective sum m w l / sum d nw.

    token_mean:  w = 1,    nw = 1      -> sum m l / sum d
    seq_mean:    w = 1/M_i, nw = 1/M_i -> (1/N) sum_i (sum_t m l) / M_i
    prompt_mean: w = 1/D_g, nw = 1/D_g -> (1/P) sum_g (sum_{i in g,t} m l) / D_g, D_g = sum_{i in g} M_i
    constant:    w = 1/C,  nw = 1/M_i  -> sum m l / (N C)
    M_i = denom_counts must cover the WHOLE mini-batch (every micro-batch and rank). Inactive responses
    (M_i = 0) get 0 weights; they have no denominator tokens, so nothing is lost.
    """
    check_mode(mode, divisor)
    M = denom_counts.to(torch.float64)
    if M.dim() != 1 or group_ids.shape != M.shape:
        raise ValueError(f"denom_counts {tuple(M.shape)} and group_ids {tuple(group_ids.shape)} must be [R]")
    if (M < 0).any() or not torch.isfinite(M).all():
        raise ValueError("denom_counts must be finite and >= 0")
    active = M > 0
    inv_M = torch.where(active, 1.0 / torch.where(active, M, 1.0), 0.0)  # where before dividing: no inf
    ones = active.to(torch.float64)
    if mode == "token_mean":
        return ones, ones
    if mode == "seq_mean":
        return inv_M, inv_M
    if mode == "prompt_mean":
        _, g = torch.unique(group_ids, return_inverse=True)
        D = torch.zeros(int(g.max()) + 1 if g.numel() else 0, dtype=torch.float64).index_add_(0, g, M)[g]
        inv_D = torch.where(active, 1.0 / torch.where(D > 0, D, 1.0), 0.0)
        return inv_D, inv_D
    return ones / divisor, inv_M  # constant


def per_token(values: Tensor, seq_ids: Tensor) -> Tensor:
    """Expand per-response values [R] to tokens [T] by seq_ids (-1, non-response tokens, get 0)."""
    if values.numel() == 0:
        return torch.zeros(seq_ids.shape, dtype=values.dtype)
    return torch.where(seq_ids >= 0, values[seq_ids.clamp(min=0)], torch.zeros((), dtype=values.dtype))


def aggregate(
    token_loss: Tensor,
    loss_mask: Tensor,
    *,
    mode: str,
    group_ids: Tensor,
    denom_mask: Tensor | None = None,
    divisor: float | None = None,
) -> Tensor:
    """Reference: the full-batch objective of SPEC on padded [B, T] tensors, in one process.

    Written straight from SPEC's table, independently of `response_weights`; tests and readers compare
    against it. An empty denominator gives 0 (times the loss, so the graph stays finite).
    """
    check_mode(mode, divisor)
    m = loss_mask.to(token_loss.dtype)
    d = m if denom_mask is None else denom_mask.to(token_loss.dtype)
    if m.shape != token_loss.shape or d.shape != token_loss.shape:
        raise ValueError(
            f"masks {tuple(m.shape)}/{tuple(d.shape)} must equal token_loss {tuple(token_loss.shape)}"
        )
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


@dataclass
class LossTerm:
    """One term of a loss. `normalizer_fn` may read masks/weights only: it runs before any forward."""

    name: str
    loss_fn: Callable[[dict], Tensor]
    normalizer_fn: Callable[[dict], float | Tensor]
    kind: Literal["sum", "mean"]
    coef: float = 1.0


def validate_microbatch(mb: dict) -> None:
    """SPEC rule 4: every per-token tensor present is 1-D with exactly one shape; m <= d."""
    ref_key = "logprobs" if "logprobs" in mb else "loss_mask"
    if ref_key not in mb:
        raise ValueError("micro-batch has neither 'logprobs' nor 'loss_mask'")
    shape = mb[ref_key].shape
    if len(shape) != 1:
        raise ValueError(f"'{ref_key}' must be 1-D [T] (packed), got shape {tuple(shape)}")
    for key in TOKEN_KEYS:
        if key in mb and mb[key].shape != shape:
            raise ValueError(
                f"'{key}' has shape {tuple(mb[key].shape)}, expected {tuple(shape)} like '{ref_key}'"
            )
    if "seq_ids" in mb and mb["seq_ids"].is_floating_point():
        raise ValueError(f"'seq_ids' must be an integer tensor, got {mb['seq_ids'].dtype}")
    if "loss_mask" in mb and "denom_mask" in mb and (mb["loss_mask"] > mb["denom_mask"]).any():
        raise ValueError(
            "'loss_mask' > 'denom_mask' somewhere: a token may count in the numerator only if it "
            "also counts in the denominator (m_t <= d_t)"
        )


def _as_float(value: float | Tensor) -> float:
    return float(value.detach().to(torch.float64).item()) if isinstance(value, Tensor) else float(value)


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_vector(vec: Tensor, group=None, op=None) -> Tensor:
    """All-reduce a small host vector (sum by default) over `group`; a no-op in a world of one."""
    if _group_size(group) > 1:
        # NCCL reduces only CUDA tensors, gloo only CPU ones: move the (tiny) vector to the backend's device
        nccl = dist.get_backend(group) == "nccl"
        buf = vec.to(torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op is None else op, group=group)
        vec = buf.to(vec.device)
    return vec


class LossReduction:
    """Exact loss reduction across micro-batches, data-parallel and context-parallel ranks.

    `group` is the normalizer group: every rank whose gradients are reduced together (DP x CP); None is
    the default group. begin_step must see this rank's own tokens: across the group, every token of the
    mini-batch in exactly one micro-batch. `cp_factor`: set it to the CP size when, after that, every
    CP rank computes the loss of the gathered full sequences (each token then counts cp_factor times in
    the gradient sum, so Z carries the same factor). Leave it 1 when CP ranks compute the loss of their
    own token shards.
    The micro-batch normalizer n_mb is recomputed in __call__ with the same normalizer_fn (cheap, and
    no reliance on call order); a normalizer_fn must therefore be a pure function of the micro-batch.
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
        self._numerators: dict[str, float | Tensor] = {}  # device tensors until reported(): no per-call sync
        self._stats: dict[str, list[float | Tensor]] = {}

    def _normalizer(self, term: LossTerm, mb: dict) -> float:
        n = _as_float(term.normalizer_fn(mb))
        if not math.isfinite(n) or n < 0:
            raise ValueError(f"term {term.name!r}: normalizer must be finite and >= 0, got {n}")
        return n

    def begin_step(self, microbatches: list[dict]) -> None:
        """Sum every term's normalizer over this rank's micro-batches; one all_reduce -> global Z_k."""
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
        """The micro-batch's loss for backward: sum_k coef_k * (loss_fn / Z_k | loss_fn * n_mb / Z_k)."""
        if not self.Z:
            raise RuntimeError("call begin_step(microbatches) before computing micro-batch losses")
        validate_microbatch(mb)
        total = None
        for term in self.terms:
            value = term.loss_fn(mb)
            if term.kind == "mean":  # n_mb was validated in begin_step; no float() here: it would sync the GPU
                value = value * term.normalizer_fn(mb)
            self._numerators[term.name] = self._numerators[term.name] + value.detach().to(torch.float64)
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
        """Global value of every term (sum_mb numerator / Z_k), 'loss' = sum_k coef_k value_k, and the
        recorded stats as global fractions; one all_reduce."""
        stat_names = sorted(self._stats)
        vec = torch.tensor(
            [_as_float(self._numerators.get(t.name, 0.0)) for t in self.terms]
            + [_as_float(self._stats[s][i]) for s in stat_names for i in (0, 1)],
            dtype=torch.float64,
        )
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

    Both setters act on one FSDP module's own parameters, not recursively: set them on every FSDP module.
    A divide factor alone makes FSDP2 reduce with ReduceOp.PREMUL_SUM, which gloo rejects ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"); forcing sum reductions gives a plain SUM (then divide by 1: skipped)
    on every backend. The alternative is multiplying each micro-batch loss by the world size.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


# -----------------------------------------------------------------------------
# policy surrogates (--policy-loss); pure functions on packed [T] tensors -> (token_loss, stats)


def sanitize_log_ratio(x: Tensor) -> Tensor:
    """NaN (from -inf - -inf) -> 0; real +-inf stays so masks and caps can reject it."""
    return torch.nan_to_num(x, nan=0.0, posinf=math.inf, neginf=-math.inf)


def ppo_surrogate(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = exp(logp - logp_prox); eps_high > eps_low is
    clip-higher. Dual clip c > 1: for A < 0, l = min(l, -c A)."""
    ratio = torch.exp(sanitize_log_ratio(logprobs - prox_logprobs))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    stats = {"clipped": (clipped > unclipped).detach().to(logprobs.dtype)}
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"--dual-clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        stats["dual_clipped"] = dual.detach().to(logprobs.dtype)
    return loss, stats


def gspo_surrogate(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    seq_ids: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence ratio s_i = exp(mean_{t in i, mask} (logp - logp_prox)) in the clipped surrogate, per token
    as GSPO-token: r_t = sg(s_i) exp(logp_t - sg(logp_t)) (value s_i, gradient s_i grad logp_t),
    l = max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high)). Needs whole responses in the micro-batch."""
    is_resp = (seq_ids >= 0) & (mask > 0)
    idx = seq_ids.clamp(min=0)
    n_seq = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    n_seq = max(n_seq, 1)  # a micro-batch without responses (all -1) still indexes slot 0, masked out
    log_ratio = torch.where(is_resp, sanitize_log_ratio(logprobs - prox_logprobs).detach(), 0.0)
    sums = torch.zeros(n_seq, dtype=log_ratio.dtype).index_add_(0, idx, log_ratio)
    counts = torch.zeros(n_seq, dtype=log_ratio.dtype).index_add_(0, idx, is_resp.to(log_ratio.dtype))
    seq_log_ratio = sums / counts.clamp(min=1.0)
    seq_ratio = torch.exp(torch.where(seq_ids >= 0, seq_log_ratio[idx], 0.0))
    ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, {"clipped": (clipped > unclipped).detach().to(logprobs.dtype)}


def cispo_surrogate(
    logprobs: Tensor, prox_logprobs: Tensor, advantages: Tensor, *, eps_high: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """l = -sg(clip(r, 0, 1+eps_high)) A logp: the clipped IS weight scales a REINFORCE gradient, so clipped
    tokens still get gradient."""
    ratio = torch.exp(sanitize_log_ratio(logprobs - prox_logprobs)).detach()
    weight = torch.clamp(ratio, 0.0, 1.0 + eps_high)
    loss = -weight * advantages * logprobs
    return loss, {"clipped": (ratio > 1.0 + eps_high).to(logprobs.dtype)}


def sapo_surrogate(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    advantages: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """l = -(4/tau) sigmoid(tau (r - 1)) A with tau = tau_pos if A > 0 else tau_neg (a soft trust region;
    at r = 1 its gradient equals PPO's)."""
    ratio = torch.exp(sanitize_log_ratio(logprobs - prox_logprobs))
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    return loss, {}


def behaviour_weights(
    prox_logprobs: Tensor,
    behave_logprobs: Tensor,
    *,
    cap: float,
    mode: Literal["truncate", "mask"] = "truncate",
) -> tuple[Tensor, Tensor]:
    """Decoupled PPO: w_t = pi_prox / pi_behave (detached). truncate: w = min(w, cap), nothing rejected;
    mask: tokens with w > cap are rejected (caller sets m_t = 0, keeps d_t) and the rest keep w.
    Returns (weights, rejected 0/1)."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"--behaviour-cap-mode must be 'truncate' or 'mask', got {mode!r}")
    if not cap > 0:
        raise ValueError(f"--behaviour-cap must be > 0, got {cap}")
    w = torch.exp(sanitize_log_ratio(prox_logprobs - behave_logprobs)).detach()
    if mode == "truncate":
        return torch.clamp(w, max=cap), torch.zeros_like(w)
    rejected = w > cap
    return torch.where(rejected, 0.0, w), rejected.to(w.dtype)


def m2po_mask(
    prox_logprobs: Tensor, behave_logprobs: Tensor, loss_mask: Tensor, *, threshold: float, group=None
) -> Tensor:
    """M2PO: drop the tokens with the largest second moment x = (log pi_prox/pi_behave)^2 until the mean of
    x over the kept tokens is <= threshold. Global over `group` (pass all of a rank's mini-batch tokens);
    returns the new loss mask (d is untouched). Tokens tied at the cut value are dropped together.

    Exact across ranks: mean(x | x <= v) is non-decreasing in v, so the largest admissible cut v is found
    by bisection over the bit patterns of float64 (monotone for x >= 0), ~64 all_reduces of (sum, count).
    """
    if threshold < 0:
        raise ValueError(f"--m2po-threshold must be >= 0, got {threshold}")
    x = sanitize_log_ratio(prox_logprobs.detach() - behave_logprobs.detach()).to(torch.float64) ** 2
    valid = loss_mask > 0

    def kept_mean_ok(cut: float) -> bool:
        keep = valid & (x <= cut)
        s = all_reduce_vector(torch.stack([torch.where(keep, x, 0.0).sum(), keep.sum().to(torch.float64)]), group)
        return bool(s[0] <= threshold * s[1])

    x_max = all_reduce_vector(
        torch.where(valid, x, 0.0).max(0, keepdim=True).values
        if x.numel()
        else torch.zeros(1, dtype=torch.float64),
        group,
        op=dist.ReduceOp.MAX,
    ).item()
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


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL(pi || pi_ref) estimates, with L = logp - logp_ref (Schulman's k1/k2/k3):
    k1 = L; k2 = L^2 / 2; k3 = exp(-L) - 1 + L (non-negative, unbiased)."""
    log_ratio = sanitize_log_ratio(logprobs - ref_logprobs)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"--kl-estimator: unknown estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


# -----------------------------------------------------------------------------
# assembling the trainer's loss


def masked_sum(values: Tensor, mask: Tensor, weight: Tensor | None = None, name: str = "loss") -> Tensor:
    """sum_t mask_t weight_t values_t, refusing broadcasting; masked values are replaced by 0 *before*
    multiplying so a non-finite masked value cannot poison the sum."""
    for key, t in (("mask", mask), ("weight", weight)):
        if t is not None and t.shape != values.shape:
            raise ValueError(
                f"{name}: {key} shape {tuple(t.shape)} != token loss shape {tuple(values.shape)}"
            )
    w = mask if weight is None else mask * weight
    return (torch.where(w != 0, values, 0.0) * w).sum()


def _safe_mean(total: Tensor, count: float | Tensor) -> Tensor:
    count = _as_float(count)
    return total / count if count > 0 else total * 0.0


def build_loss(
    *,
    mode: str,
    policy_loss: str,
    divisor: float | None = None,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
    behaviour_cap: float | None = None,
    behaviour_cap_mode: Literal["truncate", "mask"] = "truncate",
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    group=None,
    cp_factor: int = 1,
) -> LossReduction:
    """The trainer's loss: a "policy" term (sum kind, sum m w l_surrogate / sum d nw, mode weights w/nw
    from the micro-batch's 'loss_weight'/'norm_weight'), optionally "entropy" (token_mean of
    mb['entropy'], mean kind, coef -entropy_coef) and "kl" (token_mean of kl_penalty, sum kind).

    With behaviour_cap set (decoupled PPO) the token loss is multiplied by the capped pi_prox/pi_behave;
    in mask mode rejected tokens leave the numerator (m_t = 0) and stay in the denominator.
    Stats: policy/clip_frac (over m tokens), policy/dual_clip_frac, policy/behave_reject_frac (over d).
    """
    check_mode(mode, divisor)
    if policy_loss not in SURROGATES:
        raise ValueError(f"--policy-loss: unknown surrogate {policy_loss!r}; choose one of {SURROGATES}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"--dual-clip must be > 1, got {dual_clip}")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl-estimator: unknown estimator {kl_estimator!r}; choose one of {KL_ESTIMATORS}")
    if behaviour_cap is not None:
        behaviour_weights(torch.zeros(1), torch.zeros(1), cap=behaviour_cap, mode=behaviour_cap_mode)

    def surrogate(mb: dict, active: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        logp = mb["logprobs"]
        # non-response / non-denominator tokens get ratio 1 and advantage 0: their (arbitrary) prox values
        # can never produce inf in the forward, hence never NaN in the backward
        prox = torch.where(active, mb["prox_logprobs"], logp.detach())
        adv = torch.where(active, mb["advantages"], 0.0)
        if policy_loss == "ppo":
            return ppo_surrogate(logp, prox, adv, eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)
        if policy_loss == "gspo":
            return gspo_surrogate(
                logp, prox, adv, mb["seq_ids"], mb["loss_mask"], eps_low=eps_low, eps_high=eps_high
            )
        if policy_loss == "cispo":
            return cispo_surrogate(logp, prox, adv, eps_high=eps_high)
        return sapo_surrogate(logp, prox, adv, tau_pos=tau_pos, tau_neg=tau_neg)

    def policy_fn(mb: dict) -> Tensor:
        m, d = mb["loss_mask"], mb["denom_mask"]
        active = d > 0
        token_loss, stats = surrogate(mb, active)
        weight = mb["loss_weight"]
        if behaviour_cap is not None:
            behave = torch.where(active, mb["behave_logprobs"], mb["prox_logprobs"])
            w_beh, rejected = behaviour_weights(
                mb["prox_logprobs"], behave, cap=behaviour_cap, mode=behaviour_cap_mode
            )
            reduction.record_stat("policy/behave_reject_frac", (rejected * d).sum(), d.sum())
            m = m * (1.0 - rejected)
            weight = weight * w_beh
        for key, indicator in stats.items():
            reduction.record_stat(STAT_NAMES[key], (indicator * m).sum(), m.sum())
        return masked_sum(token_loss, m, weight, name="policy")

    # float64: normalizers are summed over many micro-batches and ranks before anything divides by them
    def policy_norm(mb: dict) -> Tensor:
        return (mb["denom_mask"].double() * mb["norm_weight"].double()).sum()

    def token_count(mb: dict) -> Tensor:
        return mb["denom_mask"].double().sum()

    terms = [LossTerm("policy", policy_fn, policy_norm, "sum", 1.0)]
    if entropy_coef != 0.0:
        entropy_fn = lambda mb: _safe_mean(
            masked_sum(mb["entropy"], mb["loss_mask"], name="entropy"), token_count(mb)
        )
        terms.append(LossTerm("entropy", entropy_fn, token_count, "mean", -entropy_coef))
    if kl_coef != 0.0:

        def kl_fn(mb: dict) -> Tensor:
            # reference logprobs outside the response are arbitrary: ratio 1 there, so exp() stays finite
            ref = torch.where(mb["denom_mask"] > 0, mb["ref_logprobs"], mb["logprobs"].detach())
            return masked_sum(kl_penalty(mb["logprobs"], ref, kl_estimator), mb["loss_mask"], name="kl")

        terms.append(LossTerm("kl", kl_fn, token_count, "sum", kl_coef))
    reduction = LossReduction(terms, group=group, cp_factor=cp_factor)
    return reduction
