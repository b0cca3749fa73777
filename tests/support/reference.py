"""The loss tests' one reference: the trainer's objective built from flags exactly as the trainer
builds it, and the full-batch policy token loss of a surrogate and a correction written from their
formulas (loss.aggregate then applies the mode's formula to it)."""

from __future__ import annotations

import contextlib
import types

import torch

import loss as L


def build(mode: str = "token_mean", divisor: float | None = None, cp_factor: int = 1,
          policy_loss: str = "ppo", eps_low=None, eps_high=None, correction: str = "none",
          correction_threshold=None, entropy_coef=0.0, kl_coef=0.0,
          kl_estimator: str = "k3") -> Objective:
    """The trainer's objective from loss flags, resolved and checked as the trainer does (the
    divisor goes to the constant mode only): its flags and its LossReduction."""
    given = types.SimpleNamespace(policy_loss=policy_loss, loss_aggregation=mode, eps_low=eps_low,
                                  eps_high=eps_high, correction=correction,
                                  loss_aggregation_divisor=divisor if mode == "constant" else None,
                                  correction_threshold=correction_threshold, max_new_tokens=8,
                                  max_staleness=0, num_minibatches=1, ppo_epochs=1)
    flags = L.resolve_loss_flags(given)
    cfg = types.SimpleNamespace(policy_loss=policy_loss, entropy_coef=entropy_coef,
                                kl_coef=kl_coef, kl_estimator=kl_estimator, temperature=1.0,
                                grad_clip=0.0, adv_estimator="grpo", num_minibatches=1,
                                ppo_epochs=1, **flags)
    L.check_loss_flags(cfg)
    return Objective(cfg, L.build_loss(cfg, cp_factor=cp_factor))


class Given:
    """A Model for the loss tests: a micro-batch's (log-probs, entropies) are forward(mb), by
    default its own `logprobs` and `entropy` (leaves the test holds); `params` its parameters."""

    def __init__(self, params: list, forward=None):
        self.params = params
        self.forward = forward or (lambda mb: (mb.logprobs, mb.entropy))
        self.device, self.defer_grad_sync, self.cp_group = torch.device("cpu"), False, None

    def logprobs(self, mb, temperature, grad=False, entropy_grad=False):
        return self.forward(mb)

    def set_grad_sync(self, sync: bool) -> None:
        pass

    def trainable(self) -> list:
        return self.params


class Capture:
    """An optimizer for Given: step() records the parameters' gradients."""

    def __init__(self, params: list):
        self.params, self.grads, self.param_groups = params, None, []

    def step(self):
        self.grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class Objective:
    """The trainer's step (nanoareal.train_minibatch) on micro-batches given as dicts of
    per-token tensors, their log-probs Given: (gradients, reported values, counters)."""

    def __init__(self, cfg, reduction: L.LossReduction):
        self.cfg, self.reduction = cfg, reduction

    def run(self, mbs: list, params: list, forward=None, ranks=None):
        import nanoareal as N
        model, optimizer = Given(params, forward), Capture(params)
        for p in params:
            p.grad = None
        batches = [L.as_microbatch(mb) for mb in mbs]
        counters, stats = N.train_minibatch(model, optimizer, self.reduction, batches, self.cfg,
                                            ranks or N.Ranks())
        grads = optimizer.grads or [torch.zeros_like(p) for p in params]
        return grads, stats, counters

    @property
    def Z(self) -> dict:
        return self.reduction.Z


def aggregate(token_loss: torch.Tensor, loss_mask: torch.Tensor, *, mode: str,
              group_ids: torch.Tensor, denom_mask: torch.Tensor | None = None,
              divisor: float | None = None) -> torch.Tensor:
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
        L.constant(M, group_ids, divisor)  # the divisor's check
        return num.sum() / (N * divisor) if N > 0 else zero
    if mode == "prompt_mean":
        per_group = []
        for g in torch.unique(group_ids):
            D = M[group_ids == g].sum()
            if D > 0:
                per_group.append(num[group_ids == g].sum() / D)
        return sum(per_group, zero) / len(per_group) if per_group else zero
    raise ValueError(f"aggregate: no reference for mode {mode!r}; write one for a new mode")


@contextlib.contextmanager
def surrogate_params(policy_loss: str, params: dict):
    """A surrogate's hyper-parameters that are not flags (dual clip, SAPO's taus), set where a
    forker sets them: its SURROGATES entry."""
    entry = L.SURROGATES[policy_loss]
    L.SURROGATES[policy_loss] = L.Surrogate(entry.fn, entry.params | params, entry.aggregation)
    try:
        yield
    finally:
        L.SURROGATES[policy_loss] = entry


def policy_token_loss(case: dict, logp, prox, behave, advantages, seq_ids, mask):
    """(token loss, numerator mask) of case = {policy_loss, eps_low?, eps_high?, params?,
    correction?, correction_threshold?}, straight from the papers' formulas: no loss.py weights,
    masks or defaults beyond the surrogate functions themselves."""
    kw = {"eps_low": case.get("eps_low", 0.2), "eps_high": case.get("eps_high", 0.2)}
    params, name, correction = case.get("params", {}), case["policy_loss"], case.get("correction")
    anchor = behave if correction == "behave" else prox  # behave: PPO clipped around pi_behave
    if name == "ppo":
        token_loss, _ = L.ppo_surrogate(logp, anchor, advantages,
                                        dual_clip=params.get("dual_clip"), **kw)
    elif name == "gspo":
        token_loss, _ = L.gspo_surrogate(logp, anchor, advantages, seq_ids, mask, **kw)
    elif name == "cispo":
        token_loss, _ = L.cispo_surrogate(logp, anchor, advantages, eps_high=kw["eps_high"])
    elif name == "sapo":
        token_loss, _ = L.sapo_surrogate(logp, anchor, advantages,
                                         tau_pos=params.get("tau_pos", 1.0),
                                         tau_neg=params.get("tau_neg", 1.05))
    else:
        raise ValueError(f"policy_token_loss: no reference for {name!r}; write one")
    if correction in ("truncate", "mask"):  # decoupled PPO: w = pi_prox / pi_behave
        w = torch.exp(prox - behave)
        cap = case.get("correction_threshold", 2.0)
        if correction == "truncate":
            token_loss = token_loss * w.clamp(max=cap)
        else:
            token_loss, mask = token_loss * w, mask * (w <= cap).to(mask.dtype)
    return token_loss, mask


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient as one tensor: FSDP2's DTensor gathered (a collective: every rank,
    in the same order), a plain model's as it is (one rank in full precision: load_model)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class GradCapture:
    """Stands in for the optimizer of train_minibatch / train_on_samples: step() records the full
    gradients (whole(): gathered under FSDP2) of the parameters that have one."""

    def __init__(self, model):
        self.model, self.grads = getattr(model, "module", model), {}

    def step(self):
        self.grads = {n: whole(p.grad).clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
