"""The loss tests' one reference: a LossReduction built from flags exactly as the trainer builds
it, and the full-batch policy token loss of a surrogate and a correction written from their
formulas (loss.aggregate then applies the mode's formula to it)."""

from __future__ import annotations

import contextlib
import types

import torch

import loss as L


def build(mode: str = "token_mean", divisor: float | None = None, group=None, cp_factor: int = 1,
          policy_loss: str = "ppo", eps_low=None, eps_high=None, correction: str = "none",
          correction_threshold=None, entropy_coef=0.0, kl_coef=0.0,
          kl_estimator: str = "k3") -> L.LossReduction:
    """build_loss from loss flags, resolved and checked as the trainer does (the divisor goes to
    the constant mode only)."""
    flags = L.resolve_loss_flags(policy_loss, mode, eps_low, eps_high,
                                 divisor if mode == "constant" else None, correction,
                                 correction_threshold, max_new_tokens=8)
    cfg = types.SimpleNamespace(policy_loss=policy_loss, entropy_coef=entropy_coef,
                                kl_coef=kl_coef, kl_estimator=kl_estimator, **flags)
    L.check_loss_flags(cfg)
    return L.build_loss(cfg, group=group, cp_factor=cp_factor)


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
        self.model, self.grads = model, {}

    def step(self):
        self.grads = {n: whole(p.grad).clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)
