"""nanoareal's losses: a catalogue of advantage estimators, aggregation modes, policy surrogates,
off-policy and mismatch corrections and KL estimators, each a function whose docstring is its
formula and a registry entry (the registries feed the flags and the tests), and the reduction
that keeps their sum exact. The trainer's step (nanoareal.train_minibatch) writes the objective
out of these pieces; a new mode, surrogate or correction touches this file alone.

Notation. A step's mini-batch holds prompt groups g (the responses sampled for one prompt). For
token t of response i: l_t the policy loss (a surrogate), m_t the numerator mask, d_t >= m_t the
denominator mask (a token a staleness correction rejects stays in the denominator: rejecting
never up-weights the survivors; a mismatch correction's rejection takes it out of both, as if
never sampled). M_i = sum_t d_it; N responses and P groups are active (M_i > 0,
sum_{i in g} M_i > 0). Every sum runs over the whole mini-batch: micro-batches, ranks, CP shards.

The contract. A loss is a `LossReduction` of `LossTerm`s: normalizer_fn(mb) >= 0 is a
micro-batch's share of a term's denominator (from masks and weights only, known before any
forward); the step computes each term's numerator share. With the cross-rank gradient reduction a
*sum* (modeling.sum_gradients), a step:

    reduction.begin_step(microbatches)       # every term's normaliser: ONE all_reduce -> Z_k
    for mb in microbatches:                  # forward, each term's numerator N_k, then
        reduction({k: N_k, ...}).backward()  # sum_k coef_k * N_k / Z_k
    logs = reduction.reported()              # ONE all_reduce -> every term's global value, stats

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

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

ADV_EPS = 1e-6  # added to a group's reward std before dividing: a tiny spread cannot explode
LOG_RATIO_BOUND = 20.0  # |log-ratio| clamp before any exp(): exp(20) ~ 5e8 overflows nothing
K3_CAP = 10.0  # k3's value explodes where pi_ref >> pi; cap it like verl's low_var_kl
CAPPED = "policy/behave_capped_frac"  # the share of d tokens a correction capped or masked
# (w, nw) of a mode, (w, rejected) of a correction, (total, count) of a stat
Pair = tuple[Tensor, Tensor]
Stats = dict[str, Pair]  # name -> (total, count): a global fraction
# a surrogate's (loss [T], {name: indicator [T]})
TokenLoss = tuple[Tensor, dict[str, Tensor]]


def _safe_inverse(x: Tensor) -> Tensor:
    """1 / x, and 0 where x is 0."""
    positive = x > 0
    return torch.where(positive, 1.0 / torch.where(positive, x, 1.0), 0.0)


def sanitize_log_ratio(x: Tensor) -> Tensor:
    """A log-ratio's NaN (from -inf - -inf) -> 0; a real +-inf stays, so caps can reject it."""
    return torch.nan_to_num(x, posinf=math.inf, neginf=-math.inf)


def log_ratio(p: Tensor, q: Tensor) -> Tensor:
    """log(p / q) of log-probs, sanitised and clamped before any exp(): inf * 0 in a branch the
    clip does not select would make the step's gradient NaN. A cap (<< e^20) still sees it."""
    return sanitize_log_ratio(p - q).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _group_sums(x: Tensor, ids: Tensor) -> Tensor:
    """Each element's group total, sum_{j: ids_j = ids_i} x_j (ids: any values, in any order);
    x [T] or columns [T, k], summed in one pass (torch.unique syncs a GPU once a call)."""
    unique, g = torch.unique(ids, return_inverse=True)
    return x.new_zeros((len(unique), *x.shape[1:])).index_add_(0, g, x)[g]


def _choice(kind: str, name: str, table: Mapping):
    if name not in table:
        raise ValueError(f"--{kind}: unknown {name!r}; choose one of {tuple(table)}")
    return table[name]


# -----------------------------------------------------------------------------
# advantages (--adv-estimator): fn(rewards, group_ids, copies) -> each sample's advantage (any
# group sizes, any order; a group of one gets 0). Every rank holds a share of the step's batch,
# each sample held by `copies` of them (a CP group's)
def grpo(rewards: Tensor, group_ids: Tensor, copies: int) -> Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + eps), the group's unbiased std (GRPO)."""
    centered = rewards - group_mean(rewards, group_ids)
    n = _group_sums(torch.ones_like(rewards), group_ids)
    variance = _group_sums(centered**2, group_ids) / (n - 1).clamp(min=1)
    std = variance.sqrt()
    return centered / (std + ADV_EPS)


def grpo_batch_std(rewards: Tensor, group_ids: Tensor, copies: int) -> Tensor:
    """A_i = (R_i - mean_g R) / (std R + eps), the whole step's batch std, every rank's (TRL's
    scale_rewards="batch")."""
    count = torch.ones_like(rewards).sum()
    moments = torch.stack([count, rewards.sum(), (rewards**2).sum()])
    n, s, ss = all_reduce_vector(moments) / copies
    variance = (ss - s * s / n) / (n - 1).clamp(min=1)
    std = variance.clamp(min=0).sqrt()
    return (rewards - group_mean(rewards, group_ids)) / (std + ADV_EPS)


def dr_grpo(rewards: Tensor, group_ids: Tensor, copies: int) -> Tensor:
    """A_i = R_i - mean_g R: no std (Dr. GRPO; TRL scale_rewards="none")."""
    return rewards - group_mean(rewards, group_ids)


def rloo(rewards: Tensor, group_ids: Tensor, copies: int) -> Tensor:
    """A_i = R_i - mean of the group's other rewards (REINFORCE leave-one-out)."""
    n = _group_sums(torch.ones_like(rewards), group_ids)
    others = _group_sums(rewards, group_ids) - rewards
    return rewards - others / (n - 1).clamp(min=1)


def no_reward(rewards: Tensor, group_ids: Tensor, copies: int) -> Tensor:
    """A_i = 0: the reward teaches nothing (on-policy distillation alone: --teacher)."""
    return torch.zeros_like(rewards)


ADVANTAGES = {
    "grpo": grpo,
    "grpo_batch_std": grpo_batch_std,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "none": no_reward,
}


def group_mean(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Each sample's group's mean reward."""
    return _group_sums(rewards, group_ids) / _group_sums(torch.ones_like(rewards), group_ids)


def group_advantages(
    rewards: Tensor, group_ids: Tensor, estimator: str, copies: int
) -> Tensor:
    """Per-sample advantages of ADVANTAGES[estimator]; a group of one gets 0."""
    fn = _choice("adv-estimator", estimator, ADVANTAGES)
    rewards = rewards.double()
    adv = fn(rewards, group_ids, copies)
    alone = _group_sums(torch.ones_like(rewards), group_ids) < 2
    return torch.where(alone, 0.0, adv).float()


def distill_advantages(
    teacher: Tensor, behave: Tensor, policy: Tensor, coef: float
) -> Tensor:
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): the per-token
    advantage coef * (log pi_teacher(a_t) - log pi_behave(a_t)), the negative reverse KL of the
    policy that sampled to the teacher, on the policy's own tokens (`policy` 1; an env's: 0)."""
    return coef * log_ratio(teacher, behave) * policy


# -----------------------------------------------------------------------------
# aggregation modes (--loss-aggregation): objective = sum_t m_t w_t l_t / sum_t d_t nw_t, with
# fn(M [R], groups [R], divisor) -> per-response (w_i, nw_i), zero for inactive responses. So a
# micro-batch's normalizer is a (fractional) count of tokens, responses or groups, cut anywhere.
def token_mean(M: Tensor, groups: Tensor, divisor: float) -> Pair:
    """sum_t m_t l_t / sum_t d_t (DAPO; TRL "dapo", verl "token-mean"): tokens weigh the same."""
    active = (M > 0).double()
    return active, active


def seq_mean(M: Tensor, groups: Tensor, divisor: float) -> Pair:
    """(1/N) sum_i (sum_t m_it l_it) / M_i (GRPO; TRL "grpo", verl "seq-mean-token-mean")."""
    return _safe_inverse(M), _safe_inverse(M)


def prompt_mean(M: Tensor, groups: Tensor, divisor: float) -> Pair:
    """(1/P) sum_g (sum_{i in g, t} m_it l_it) / D_g, D_g = sum_{i in g} M_i."""
    inverse = torch.where(M > 0, _safe_inverse(_group_sums(M, groups)), 0.0)
    return inverse, inverse


def constant(M: Tensor, groups: Tensor, divisor: float) -> Pair:
    """sum_t m_t l_t / (N C), C = --loss-aggregation-divisor (Dr. GRPO; TRL "dr_grpo", verl
    "seq-mean-token-sum-norm"): w = 1/C, and nw = 1/M_i makes the normalizer count responses."""
    if divisor is None or not 0 < divisor < math.inf:
        raise ValueError(
            f"--loss-aggregation constant needs a positive "
            f"--loss-aggregation-divisor, got {divisor!r}"
        )
    return (M > 0).double() / divisor, _safe_inverse(M)


MODES = {fn.__name__: fn for fn in (token_mean, seq_mean, prompt_mean, constant)}


def response_weights(
    mode: str, denom_counts: Tensor, group_ids: Tensor, divisor: float | None
) -> Pair:
    """Per-response (w_i, nw_i) of `mode`; denom_counts (M_i) cover the WHOLE mini-batch: sums of
    the responses' 0/1 d masks, [R] like group_ids (packing.mode_weights makes both from one list
    of samples), so finite and >= 0; begin_step checks the normalizers they make (rule 4)."""
    fn = _choice("loss-aggregation", mode, MODES)
    return fn(denom_counts.to(torch.float64), group_ids, divisor)


# -----------------------------------------------------------------------------
# policy surrogates (--policy-loss): fn(logp, prox, A, seq_ids, mask, **params) -> TokenLoss on
# [T] (log pi, log pi_prox, advantages, response ids or -1, m); stats: policy/<name>, means over m.
# Their params' defaults are SURROGATES' (surrogate_params passes every one)
# A token-local surrogate takes seq_ids and mask as *_ (unused)
def _clipped(ratio: Tensor, A: Tensor, eps_low: float, eps_high: float, dtype) -> TokenLoss:
    """PPO's l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), and where the clip binds."""
    unclipped = -A * ratio
    clipped = -A * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clip_frac = (clipped > unclipped).to(dtype)
    return torch.maximum(unclipped, clipped), {"clip_frac": clip_frac}


def ppo_surrogate(
    logp: Tensor,
    prox: Tensor,
    A: Tensor,
    *_,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> TokenLoss:
    """l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)), r = pi / pi_prox (Schulman et al. 2017;
    eps_high > eps_low: DAPO's clip-higher); dual clip c (Ye et al. 2020): min(l, -c A) if A < 0."""
    ratio = torch.exp(log_ratio(logp, prox))
    loss, stats = _clipped(ratio, A, eps_low, eps_high, logp.dtype)
    if dual_clip is not None:
        dual = (A < 0) & (loss > -dual_clip * A)
        loss = torch.where(dual, -dual_clip * A, loss)
        stats["dual_clip_frac"] = dual.to(logp.dtype)
    return loss, stats


def gspo_surrogate(
    logp: Tensor,
    prox: Tensor,
    A: Tensor,
    seq_ids: Tensor,
    mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> TokenLoss:
    """GSPO (Zheng et al. 2025), per token (GSPO-token): l = max(-A r_t, -A clip(r_t, 1-eps_low,
    1+eps_high)), r_t = sg(s_i) pi_t / sg(pi_t) (value s_i, gradient s_i grad logp_t), s_i =
    exp(mean_{t in i, mask} log(pi_t / pi_prox_t)). Needs whole responses in the micro-batch."""
    in_response = (seq_ids >= 0) & (mask > 0)
    token = torch.where(in_response, log_ratio(logp, prox).detach(), 0.0)
    count = _group_sums(in_response.to(token.dtype), seq_ids).clamp(min=1)
    mean = _group_sums(token, seq_ids) / count
    seq_ratio = torch.exp(torch.where(seq_ids >= 0, mean, 0.0))
    ratio = seq_ratio * torch.exp(logp - logp.detach())
    return _clipped(ratio, A, eps_low, eps_high, logp.dtype)


def cispo_surrogate(
    logp: Tensor,
    prox: Tensor,
    A: Tensor,
    *_,
    eps_high: float,
) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): l = -sg(clip(r, 0, 1+eps_high)) A logp: the clipped weight
    scales a REINFORCE gradient, so clipped tokens still get gradient."""
    ratio = torch.exp(log_ratio(logp, prox)).detach()
    loss = -torch.clamp(ratio, 0.0, 1.0 + eps_high) * A * logp
    return loss, {"clip_frac": (ratio > 1.0 + eps_high).to(logp.dtype)}


def sapo_surrogate(
    logp: Tensor,
    prox: Tensor,
    A: Tensor,
    *_,
    tau_pos: float,
    tau_neg: float,
) -> TokenLoss:
    """SAPO (Qwen, 2025): l = -(4/tau) sigmoid(tau (r - 1)) A, tau = tau_pos if A > 0 else
    tau_neg: a soft trust region; at r = 1 its gradient is PPO's."""
    tau = torch.full_like(A, tau_neg).masked_fill(A > 0, tau_pos)
    ratio = torch.exp(log_ratio(logp, prox))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * A, {}


@dataclass(frozen=True)
class Surrogate:
    fn: Callable
    # its hyper-parameters' defaults (--eps-low/--eps-high override those it has)
    params: dict
    aggregation: str = "token_mean"  # its --loss-aggregation auto


# GSPO's s_i, a geometric mean, moves far less than token ratios: the paper's (and verl's) clip
SURROGATES = {
    "ppo": Surrogate(ppo_surrogate, {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}),
    "gspo": Surrogate(gspo_surrogate, {"eps_low": 3e-4, "eps_high": 4e-4}, "seq_mean"),
    "cispo": Surrogate(cispo_surrogate, {"eps_high": 0.2}),
    "sapo": Surrogate(sapo_surrogate, {"tau_pos": 1.0, "tau_neg": 1.05}),
}


# -----------------------------------------------------------------------------
# corrections (--correction) for pi_behave (the engine that sampled: maybe --max-staleness
# versions old, maybe another precision or kernels) differing from pi_prox (the trainer's
# weights before this step's update). r_t = pi_prox / pi_behave of a token, rho_i = prod_t r_t
# of a response (t in m), g_i = rho_i^(1/|i|) its geometric mean. A weigh fn(log r [T], seq_ids,
# m) -> the uncapped importance weight; the step truncates it at the cap C, or rejects the tokens
# over C from the numerator alone (Correction.mask)
def token_ratio(lr: Tensor, seq_ids: Tensor, m: Tensor) -> Tensor:
    """Per token: w_t = r_t."""
    return torch.exp(lr)


def _log_rho(lr: Tensor, seq_ids: Tensor, m: Tensor) -> Tensor:
    """log rho_i of each token's response, over the tokens of m."""
    return _group_sums(torch.where(m > 0, lr, 0.0), seq_ids)


def seq_ratio(lr: Tensor, seq_ids: Tensor, m: Tensor) -> Tensor:
    """Per response (seq-TIS): w_t = rho_i on every token of response i."""
    w = torch.exp(_log_rho(lr, seq_ids, m).clamp(max=LOG_RATIO_BOUND))
    return torch.where(seq_ids >= 0, w, 1.0)


def seq_reject(lr: Tensor, seq_ids: Tensor, d: Tensor, cap: float) -> Tensor:
    """Sequence-level masked IS (seq-MIS): the responses with rho_i outside [1/C, C] (tokens of
    d), whole; a keep mask [T]."""
    log_rho = _log_rho(lr, seq_ids, d)
    return (log_rho.abs() <= math.log(cap)).to(lr.dtype)


def geo_reject(lr: Tensor, seq_ids: Tensor, d: Tensor, cap: float) -> Tensor:
    """Geometric-mean masking (geo-MIS): the responses with g_i = rho_i^(1/|i|) outside
    [1/C, C], whole (length-independent, unlike rho_i); a keep mask [T]."""
    count = _group_sums((d > 0).to(lr.dtype), seq_ids).clamp(min=1)
    log_g = _log_rho(lr, seq_ids, d) / count
    return (log_g.abs() <= math.log(cap)).to(lr.dtype)


def token_reject(lr: Tensor, seq_ids: Tensor, d: Tensor, cap: float) -> Tensor:
    """Token-level masked IS (token-MIS): tokens with r_t outside [1/C, C]; a keep mask [T]."""
    return (lr.abs() <= math.log(cap)).to(lr.dtype)


def m2po_mask(
    prox_logprobs: Tensor,
    behave_logprobs: Tensor,
    loss_mask: Tensor,
    *,
    threshold: float,
) -> Tensor:
    """M2PO (Zheng et al. 2025): the keep mask (0/1, within m) that drops the tokens of largest x =
    (log pi_prox/pi_behave)^2, ties together, until mean x <= threshold over all ranks' kept tokens.
    Exact across ranks: mean(x | x <= v) is non-decreasing in v, so bisect the largest admissible
    cut over float64's bit patterns (monotone for x >= 0): ~64 all_reduces of (sum, count)."""
    x = sanitize_log_ratio(prox_logprobs.detach() - behave_logprobs.detach()).double() ** 2
    valid = loss_mask > 0

    def kept_mean_ok(cut: float) -> bool:
        keep = valid & (x <= cut)
        kept_sum = torch.where(keep, x, 0.0).sum()
        kept = torch.stack([kept_sum, keep.sum().double()])
        total, count = all_reduce_vector(kept)
        return bool(total <= threshold * count)

    # x >= 0: a rank without valid tokens has max 0
    local_max = torch.cat([torch.where(valid, x, 0.0), x.new_zeros(1)]).max()[None]
    x_max = all_reduce_vector(local_max, op=dist.ReduceOp.MAX).item()
    if kept_mean_ok(x_max):
        return loss_mask.clone()
    # the float64 of bit pattern b
    value = lambda b: struct.unpack("<d", struct.pack("<q", b))[0]
    # 0: 0.0's bits (keeps x = 0)
    lo = 0
    hi = struct.unpack("<q", struct.pack("<d", x_max))[0]
    while hi - lo > 1:  # invariant: ok(value(lo)), not ok(value(hi))
        mid = (lo + hi) // 2
        if kept_mean_ok(value(mid)):
            lo = mid
        else:
            hi = mid
    return loss_mask * (x <= value(lo)).to(loss_mask.dtype)


@dataclass(frozen=True)
class Correction:
    threshold: float | None = None  # the default --correction-threshold (C)
    clip_to_behaviour: bool = False  # the surrogate's ratio against pi_behave, not pi_prox
    weigh: Callable | None = None  # per token, in the step: the uncapped weight
    mask: bool = False  # a weight over the cap: the token out of m (d kept), else w = C
    reject: Callable | None = None  # before the step, from pi_prox: a keep mask for m and d
    # before the step over the mini-batch: a keep mask in m
    global_mask: Callable | None = None
    clip: bool = True  # False: the surrogate's clip range opened up (eps_low 1, eps_high inf)


CORRECTIONS = {
    # clip around pi_prox; pi_behave is ignored
    "none": Correction(),
    # PPO around the policy that sampled (AReaL's)
    "behave": Correction(clip_to_behaviour=True),
    # truncated IS (decoupled PPO, Hilton et al. 2022; TIS): w_t = min(r_t, C)
    "truncate": Correction(2.0, weigh=token_ratio),
    # AReaL's decoupled PPO: w_t = r_t, tokens with r_t > C out of m (d kept)
    "mask": Correction(2.0, weigh=token_ratio, mask=True),
    "m2po": Correction(0.04, clip_to_behaviour=True, global_mask=m2po_mask, clip=False),
    # sequence-level truncated IS (seq-TIS): w_t = min(rho_i, C) on every token of response i
    "seq_tis": Correction(2.0, weigh=seq_ratio),
    "token_mis": Correction(2.0, weigh=token_ratio, reject=token_reject),
    "seq_mis": Correction(2.0, weigh=seq_ratio, reject=seq_reject),
    "geo_mis": Correction(1.01, reject=geo_reject),
}


def needs_proximal_forward(correction: str, updates_per_batch: int) -> bool:
    """With one update per batch (one mini-batch, one pass) the training forward's log-probs,
    detached, are pi_prox, unless a correction masks the mini-batch from pi_prox first: else
    pi_prox (the weights before the batch's first update) needs a forward of its own, once."""
    corr = CORRECTIONS[correction]
    before = corr.global_mask is not None or corr.reject is not None
    return before or (updates_per_batch > 1 and not corr.clip_to_behaviour)


def anchor(mb, logp: Tensor, correction: Correction) -> Tensor:
    """The log-probs the surrogate's ratio is taken against: pi_behave (clip_to_behaviour),
    pi_prox's own forward, or the training forward's (detached: one update per batch). Outside
    d the ratio is 1 and the advantage 0, so arbitrary values there never make inf (nor NaN)."""
    given = mb.behave_logprobs if correction.clip_to_behaviour else mb.prox_logprobs
    base = logp.detach() if given is None else given
    return torch.where(mb.denom_mask > 0, base, logp.detach())


def correct(
    correction: Correction, prox: Tensor, mb, cap: float | None
) -> tuple[Tensor, Tensor, Stats]:
    """(w, m, stats) of a micro-batch: the correction's importance weight per token, the numerator
    mask (its global keep mask and rejections applied), the share of d it capped or masked."""
    d = mb.denom_mask
    m = mb.loss_mask if mb.keep_mask is None else mb.keep_mask
    stats = {}
    if correction.global_mask is not None:  # the share of d the mask took from m
        taken = (mb.loss_mask - m) * d
        stats[CAPPED] = (taken.sum(), d.sum())
    if correction.weigh is None:
        return torch.ones_like(prox), m, stats
    behave = torch.where(d > 0, mb.behave_logprobs, prox)
    lr = log_ratio(prox, behave)
    ratio = correction.weigh(lr, mb.seq_ids, m)  # a token's ratio, or its response's rho
    if correction.mask:
        over = ratio > cap
        w, m = torch.where(over, 0.0, ratio), torch.where(over, 0.0, m)
    else:
        w = ratio.clamp(max=cap)
    # capped: weighed below the uncapped weight (a rejected token's is 0)
    capped = w < ratio * (1 - 1e-6)
    stats[CAPPED] = ((capped * d).sum(), d.sum())
    return w.detach(), m, stats


# -----------------------------------------------------------------------------
# KL penalty to a reference policy (--kl-estimator): with L = log pi - log pi_ref on tokens from pi,
# each estimator's *value* estimates KL(pi || ref) (Schulman 2020); a loss sees only its gradient:
#   k1 = L             gradient E_pi[grad log pi] = 0: noise alone (verl puts it in the reward);
#   k2 = L^2 / 2       gradient E_pi[L grad log pi] = grad KL(pi || ref)   (reverse KL);
#   k3 = e^-L - 1 + L  gradient E_pi[(1 - pi_ref/pi) grad log pi] = grad KL(ref || pi) (forward).
KL_ESTIMATORS = {
    "k1": lambda L: L,
    "k2": lambda L: L**2 / 2,
    "k3": lambda L: (torch.exp(-L) - 1.0 + L).clamp(max=K3_CAP),
}


def kl_penalty(logp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """Per-token KL penalty of log-probs against the reference's, by KL_ESTIMATORS[estimator]."""
    return _choice("kl-estimator", estimator, KL_ESTIMATORS)(log_ratio(logp, ref))


def mismatch_sums(
    logp: Tensor, behave: Tensor, d: Tensor, seq_ids: Tensor, rejected: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The engine-vs-trainer mismatch of a micro-batch over the response tokens as sampled:
    those trained (d) and those a correction `rejected` before the step. Sums (reduce_metrics
    sums them, logs.step_metrics divides): tokens, |log r|, k3 = r - 1 - log r (KL(pi_behave ||
    pi), r = pi / pi_behave), responses, their log perplexity gap mean_t (log pi_behave - log
    pi), the tokens rejected and the responses rejected whole. Extremes (reduced by max): [max,
    -min] over responses of log rho_i = sum_t log r_t."""
    rejected = torch.zeros_like(d) if rejected is None else rejected
    d = d + rejected
    # log(pi / pi_behave) of the tokens sampled (0 elsewhere), detached, in float64
    lr = torch.where(d > 0, log_ratio(logp.detach(), behave), 0.0).double()
    k3 = torch.exp(lr) - 1 - lr
    columns = torch.stack([d.double(), rejected.double(), lr], 1)
    count, rejected_count, log_rho = _group_sums(columns, seq_ids).unbind(1)
    # one token per response: its values counted once
    first = torch.ones_like(d, dtype=torch.bool)
    first[1:] = seq_ids[1:] != seq_ids[:-1]
    active = first & (seq_ids >= 0) & (count > 0)
    gone = active & (rejected_count == count)
    gap = torch.where(active, -log_rho / count.clamp(min=1), 0.0)
    sums = [
        d.double().sum(),
        (lr.abs() * d).sum(),
        (k3 * d).sum(),
        active.double().sum(),
        gap.sum(),
        rejected.double().sum(),
        gone.double().sum(),
    ]
    extremes = torch.where(active, torch.stack([log_rho, -log_rho]), -math.inf).amax(1)
    return torch.stack(sums), extremes


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
    seq_ids: Tensor | None = None  # the response's index in its mini-batch, -1 elsewhere
    prox_logprobs: Tensor | None = None  # pi_prox; None: the training forward's, detached
    ref_logprobs: Tensor | None = None  # the reference policy's (KL penalty)
    keep_mask: Tensor | None = None  # a correction's mask over the whole mini-batch (M2PO)
    rejected: Tensor | None = None  # d tokens a mismatch correction took out of m and d
    # given log-probs (tests); the trainer's come from its forward
    logprobs: Tensor | None = None
    entropy: Tensor | None = None

    def validate(self) -> None:
        """Rule 4 (m <= d syncs a GPU: begin_step checks it once, before the step)."""
        given = [(k, v) for k, v in list(vars(self).items())[3:] if v is not None]
        if not given:
            raise ValueError("micro-batch has no per-token tensors")
        ref_key, ref = given[0]
        for key, value in given:
            if value.dim() != 1 or value.shape != ref.shape:
                raise ValueError(
                    f"'{key}' has shape {tuple(value.shape)}: per-token tensors are "
                    f"1-D [T] (packed), like '{ref_key}' {tuple(ref.shape)}"
                )
        if self.seq_ids is not None and self.seq_ids.is_floating_point():
            raise ValueError(f"'seq_ids' must be an integer tensor, got {self.seq_ids.dtype}")
        if (
            self.loss_mask is not None
            and self.denom_mask is not None
            and (self.loss_mask > self.denom_mask).any()
        ):
            raise ValueError("'loss_mask' > 'denom_mask' somewhere, but m_t <= d_t")

    def to(self, device) -> "MicroBatch":
        """The tensors on `device`; segments stay on the host (attention.check_segments)."""
        moved = {
            k: v.to(device)
            for k, v in vars(self).items()
            if v is not None and k != "segments"
        }
        return replace(self, **moved)


def as_microbatch(mb: MicroBatch | Mapping) -> MicroBatch:
    """A MicroBatch, or the MicroBatch fields of a mapping (tests, a custom term's batch)."""
    if isinstance(mb, MicroBatch):
        return mb
    known = MicroBatch.__dataclass_fields__
    return MicroBatch(**{k: v for k, v in mb.items() if k in known})


@dataclass
class LossTerm:
    name: str
    # masks and weights only: pre-forward
    normalizer_fn: Callable[[MicroBatch], float | Tensor]
    coef: float = 1.0


def all_reduce_vector(vec: Tensor, group=None, op=dist.ReduceOp.SUM) -> Tensor:
    """All-reduce a small host vector (sum by default) over `group`; a no-op in a world of one."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # NCCL reduces CUDA tensors only, gloo CPU ones
        buf = vec.to("cuda" if dist.get_backend(group) == "nccl" else "cpu")
        dist.all_reduce(buf, op=op, group=group)
        vec = buf.to(vec.device)
    return vec


class LossReduction:
    """The contract's reduction. `group`: the ranks whose gradients are summed (None: the default
    group), which together see each token once; `cp_factor`: rule 5's CP size (>= 1: --cp-size's
    range check), else 1."""

    def __init__(self, terms: list[LossTerm], group=None, cp_factor: int = 1):
        self.names = [t.name for t in terms]
        if len(set(self.names)) != len(terms):
            raise ValueError(f"need unique term names, got {self.names}")
        self.terms = terms
        self.group = group
        self.cp_factor = cp_factor
        self.Z = {}  # begin_step's global normalizers; numerators and stats on device

    def begin_step(self, microbatches: list) -> None:
        """Every term's normalizer over this rank's micro-batches; one all_reduce -> global Z_k."""
        local = torch.zeros(len(self.terms), dtype=torch.float64)
        for mb in map(as_microbatch, microbatches):
            mb.validate()
            for k, term in enumerate(self.terms):
                n = float(term.normalizer_fn(mb))
                if not 0 <= n < math.inf:
                    raise ValueError(
                        f"term {term.name!r}: normalizer {n} is not finite and >= 0"
                    )
                local[k] += n
        # each token cp_factor times
        Z = all_reduce_vector(local, self.group) * self.cp_factor
        self.Z = dict(zip(self.names, Z.tolist()))
        self._numerators = dict.fromkeys(self.names, 0.0)
        self._stats = {}

    def __call__(
        self, numerators: Mapping[str, Tensor], stats: Stats | None = None
    ) -> Tensor:
        """The micro-batch's loss for backward: sum_k coef_k * N_k / Z_k, from each term's
        numerator N_k (every term's, by name); `stats`: (total, count) pairs to report."""
        if not self.Z:
            raise RuntimeError(
                "call begin_step(microbatches) before computing micro-batch losses"
            )
        if set(numerators) != set(self.names):
            raise ValueError(f"numerators {sorted(numerators)} for terms {self.names}")
        for k, pair in (stats or {}).items():
            old = self._stats.get(k, (0, 0))
            self._stats[k] = [a + b.detach() for a, b in zip(old, pair)]
        total = 0.0
        for term in self.terms:
            value = numerators[term.name]
            self._numerators[term.name] += value.detach().double()
            # Z == 0: multiply by 0, never divide: finite zero gradients
            Z = self.Z[term.name]
            scale = term.coef / Z if Z > 0 else 0.0
            total = total + value * scale
        return total

    def reported(self) -> dict[str, float]:
        """Each term's global value, 'loss' = sum_k coef_k value_k, the stats; one all_reduce."""
        stats = sorted(self._stats)
        local = [*self._numerators.values(), *(x for s in stats for x in self._stats[s])]
        local = torch.tensor([float(x) for x in local], dtype=torch.float64)
        vec = all_reduce_vector(local, self.group).tolist()
        share = lambda total, count: total / count if count > 0 else 0.0
        out = {name: share(v, Z) for (name, Z), v in zip(self.Z.items(), vec)}
        out["loss"] = sum(t.coef * out[t.name] for t in self.terms)
        k = len(self.terms)
        pairs = zip(stats, vec[k::2], vec[k + 1 :: 2])
        return out | {s: share(total, count) for s, total, count in pairs}


def masked_sum(values: Tensor, mask: Tensor, weight: Tensor | None = None) -> Tensor:
    """sum_t mask_t weight_t values_t, no broadcasting; masked values -> 0 first (inf * 0 = NaN)."""
    for key, t in (("mask", mask), ("weight", weight)):
        if t is not None and t.shape != values.shape:
            raise ValueError(
                f"masked_sum: {key} shape {tuple(t.shape)} != loss {tuple(values.shape)}"
            )
    w = mask if weight is None else mask * weight
    return (torch.where(w != 0, values, 0.0) * w).sum()


def policy_normalizer(mb: MicroBatch) -> Tensor:
    """The mode's: sum_t d_t nw_t (tokens, responses or groups), in float64."""
    return (mb.denom_mask.double() * mb.norm_weight.double()).sum()


def token_count(mb: MicroBatch) -> Tensor:
    """A token mean's: sum_t d_t."""
    return mb.denom_mask.double().sum()


def build_loss(cfg, cp_factor: int = 1) -> LossReduction:
    """The trainer's reduction from resolved flags: "policy" (over the mode's normaliser), and,
    where their coefficients are not 0, "entropy" (-entropy_coef) and "kl" (token means)."""
    terms = [
        LossTerm("policy", policy_normalizer),
        LossTerm("entropy", token_count, -cfg.entropy_coef),
        LossTerm("kl", token_count, cfg.kl_coef),
    ]
    return LossReduction([t for t in terms if t.coef != 0.0], cp_factor=cp_factor)


# -----------------------------------------------------------------------------
# flags: defaults that depend on other flags, and checks
def resolve_loss_flags(cfg) -> dict:
    """Defaults that depend on other flags: the surrogate's mode (auto) and clip range, constant's
    divisor (the longest response), the correction (auto) and its threshold."""
    s = _choice("policy-loss", cfg.policy_loss, SURROGATES)
    mode = cfg.loss_aggregation
    if mode == "auto":
        mode = s.aggregation
    # --correction auto: what docs/studies.md measured holding under staleness
    correction = cfg.correction
    if correction == "auto" and cfg.max_staleness == 0:
        correction = "none"
    elif correction == "auto":  # truncate under several updates per batch
        correction = "truncate" if cfg.num_minibatches * cfg.ppo_epochs > 1 else "behave"
    pick = lambda given, default: default if given is None else given
    divisor = cfg.loss_aggregation_divisor
    if mode == "constant":
        divisor = pick(divisor, float(cfg.max_new_tokens))
    corr = _choice("correction", correction, CORRECTIONS)
    return {
        "loss_aggregation": mode,
        "loss_aggregation_divisor": divisor,
        "eps_low": pick(cfg.eps_low, s.params.get("eps_low")),
        "eps_high": pick(cfg.eps_high, s.params.get("eps_high")),
        "correction": correction,
        "correction_threshold": pick(cfg.correction_threshold, corr.threshold),
    }


def surrogate_params(
    policy_loss: str, eps_low: float | None, eps_high: float | None, correction: str = "none"
) -> dict:
    """The surrogate's defaults and the clip flags given; one it cannot use is an error. A
    correction that replaces the clip opens it (r in [1 - 1, 1 + inf]: never clipped)."""
    params = dict(_choice("policy-loss", policy_loss, SURROGATES).params)
    opens = not _choice("correction", correction, CORRECTIONS).clip
    for flag, given, opened in (
        ("eps_low", eps_low, 1.0),
        ("eps_high", eps_high, math.inf),
    ):
        if given is not None and flag not in params:
            raise ValueError(
                f"--{flag.replace('_', '-')}: {policy_loss} has no such parameter"
            )
        if given is not None:
            params[flag] = given
        if opens and flag in params:
            params[flag] = opened
    return params


def check_loss_flags(cfg) -> None:
    """Every loss flag's range (on resolved flags); raises ValueError naming the flag."""
    # the mode, and constant's divisor
    response_weights(
        cfg.loss_aggregation, torch.zeros(0), torch.zeros(0), cfg.loss_aggregation_divisor
    )
    if cfg.loss_aggregation != "constant" and cfg.loss_aggregation_divisor is not None:
        raise ValueError(
            "--loss-aggregation-divisor is only used by --loss-aggregation constant "
            f"(not {cfg.loss_aggregation})"
        )
    params = surrogate_params(cfg.policy_loss, cfg.eps_low, cfg.eps_high)
    eps_low = params.get("eps_low", 0)
    eps_high = params.get("eps_high", 0)
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(
            f"--eps-low must be in [0, 1) and --eps-high >= 0, got {cfg.eps_low} and "
            f"{cfg.eps_high}"
        )
    corr = _choice("correction", cfg.correction, CORRECTIONS)
    if corr.threshold is not None and not cfg.correction_threshold > 0:
        raise ValueError(
            f"--correction-threshold must be > 0, got {cfg.correction_threshold}"
        )
    if corr.reject is not None and not cfg.correction_threshold > 1:
        raise ValueError(
            f"--correction {cfg.correction} keeps ratios in [1/C, C]: "
            f"--correction-threshold must be > 1, got {cfg.correction_threshold}"
        )
    if corr.threshold is None and cfg.correction_threshold is not None:
        raise ValueError(f"--correction-threshold: --correction {cfg.correction} has none")
    if cfg.kl_coef < 0:
        raise ValueError(f"--kl-coef must be >= 0, got {cfg.kl_coef}")
    _choice("adv-estimator", cfg.adv_estimator, ADVANTAGES)
