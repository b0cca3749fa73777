"""loss.py against its contract (the rules in its header): reference vectors, a naive loop, split
invariance, empties, errors, surrogates.

References here are computed independently of the code under test: hand-computed numbers, python
loops over floats, or `aggregate` (straight from the mode formulas) on the full batch in one
piece.
"""

from __future__ import annotations

import math
import random
import types
from dataclasses import fields, replace

import pytest
import torch
from reference import aggregate, build, policy_token_loss

import loss as L

torch.set_num_threads(1)
F64 = torch.float64


# -----------------------------------------------------------------------------
# helpers: ragged batches, packing, splitting, running a LossReduction


def ragged_batch(seed: int, n_groups: int = 7) -> list[dict]:
    """Responses with variable lengths and group sizes (incl. 1), inactive responses, one inactive
    group, rejected tokens (m=0, d=1), and a response whose denominator mask has holes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = [1] + [rng.choice([1, 2, 3, 4]) for _ in range(n_groups - 2)] + [2]
    responses = []
    for gid, size in enumerate(sizes):
        for _ in range(size):
            n = rng.randint(1, 9)
            d = [1.0] * n
            if gid == len(sizes) - 1 or (gid > 0 and rng.random() < 0.15):
                d = [0.0] * n  # inactive response; the last group is entirely inactive
            elif rng.random() < 0.2:
                d = [0.0 if rng.random() < 0.3 else 1.0 for _ in range(n)]
            m = [0.0 if (di > 0 and rng.random() < 0.15) else di for di in d]
            logp = -2.0 * torch.rand(n, generator=gen, dtype=F64) - 0.05
            prox = logp + 0.25 * torch.randn(n, generator=gen, dtype=F64)
            responses.append({
                "group": gid, "prompt_len": rng.randint(1, 3), "d": d, "m": m,
                "token_loss": torch.randn(n, generator=gen, dtype=F64).tolist(),
                "advantage": float(torch.randn(1, generator=gen, dtype=F64)),
                "logprobs": logp, "prox_logprobs": prox,
                "behave_logprobs": prox + 0.5 * torch.randn(n, generator=gen, dtype=F64),
                "ref_logprobs": logp + 0.3 * torch.randn(n, generator=gen, dtype=F64),
                "entropy": 2.0 * torch.rand(n, generator=gen, dtype=F64),
            })
    return responses


def pack(responses: list[dict], mode: str, divisor: float | None = None, seed: int = 0) -> dict:
    """One packed stream like the trainer's: per sequence, (prompt_len - 1) prompt positions, the
    response positions, one trailing position; non-response positions carry junk values and m = d
    = 0."""
    gen = torch.Generator().manual_seed(seed + 1000)
    denom = torch.tensor([sum(r["d"]) for r in responses], dtype=F64)
    groups = torch.tensor([r["group"] for r in responses])
    w, nw = L.response_weights(mode, denom, groups, divisor)
    cols = {k: [] for k in ("logprobs", "prox_logprobs", "behave_logprobs", "ref_logprobs",
                            "entropy",
                            "advantages", "token_loss", "loss_mask", "denom_mask", "seq_ids")}
    starts = []
    for i, r in enumerate(responses):
        starts.append(len(cols["seq_ids"]))
        n, pad_before = len(r["d"]), r["prompt_len"] - 1
        for where, count in (("before", pad_before), ("resp", n), ("after", 1)):
            if where == "resp":
                for k in ("logprobs", "prox_logprobs", "behave_logprobs", "ref_logprobs",
                          "entropy"):
                    cols[k] += r[k].tolist()
                cols["token_loss"] += r["token_loss"]
                cols["loss_mask"] += r["m"]
                cols["denom_mask"] += r["d"]
                cols["seq_ids"] += [i] * n
                cols["advantages"] += [r["advantage"]] * n
                continue
            junk = (3.0 * torch.randn(5, count, generator=gen, dtype=F64)).tolist()
            cols["logprobs"] += [-abs(x) for x in junk[0]]
            cols["prox_logprobs"] += [-abs(x) for x in junk[1]]
            cols["behave_logprobs"] += [-abs(x) for x in junk[2]]
            cols["ref_logprobs"] += [-abs(x) for x in junk[3]]
            cols["entropy"] += [abs(x) for x in junk[4]]
            cols["token_loss"] += junk[0]
            cols["loss_mask"] += [0.0] * count
            cols["denom_mask"] += [0.0] * count
            cols["seq_ids"] += [-1] * count
            cols["advantages"] += [r["advantage"]] * count
    mb = {k: torch.tensor(v, dtype=torch.long if k == "seq_ids" else F64) for k, v in cols.items()}
    mb["loss_weight"] = torch.cat([w, w.new_zeros(1)])[mb["seq_ids"]]  # seq_id -1: weight 0
    mb["norm_weight"] = torch.cat([nw, nw.new_zeros(1)])[mb["seq_ids"]]
    mb["_starts"] = starts
    return mb


def split(mb: dict, cuts: list[int]) -> list[dict]:
    T = mb["loss_mask"].shape[0]
    bounds = [0, *sorted(set(cuts)), T]
    return [
        {k: v[a:b] for k, v in mb.items() if isinstance(v, torch.Tensor)}
        for a, b in zip(bounds, bounds[1:], strict=False)
        if b > a
    ]


def budget_cuts(mb: dict, responses: list[dict], rng: random.Random) -> list[int]:
    """Token-budget micro-batches of whole sequences; the budget is small enough to cut through
    groups."""
    starts = mb["_starts"] + [mb["loss_mask"].shape[0]]
    for _ in range(100):
        budget, cuts, used = rng.randint(4, 14), [], 0
        for i in range(len(responses)):
            n = starts[i + 1] - starts[i]
            if used and used + n > budget:
                cuts.append(starts[i])
                used = 0
            used += n
        cut_through_group = any(responses[i - 1]["group"] == responses[i]["group"]
                                for i in range(1, len(responses)) if starts[i] in cuts)
        if cut_through_group:
            return cuts
    raise AssertionError("could not find a split through a group")


def anywhere_cuts(mb: dict, rng: random.Random) -> list[int]:
    """Cuts at random token positions: through groups and through responses."""
    T = mb["loss_mask"].shape[0]
    return rng.sample(range(1, T), k=min(T - 1, rng.randint(3, 8)))


def run(objective, mbs: list[dict], params: list[torch.Tensor], forward=None) -> tuple[list, dict]:
    """The trainer's step (train_minibatch) on these micro-batches: (grads, reported)."""
    grads, reported, _ = objective.run(mbs, params, forward)
    return grads, reported


def reduce(red: L.LossReduction, mbs: list[dict], numerators: dict) -> dict:
    """A LossReduction's loop, numerators given by fn(mb): begin_step, one per micro-batch."""
    red.begin_step(mbs)
    for mb in mbs:
        red({k: fn(mb) for k, fn in numerators.items()})
    return red.reported()


def with_leaf_logprobs(mb: dict) -> tuple[dict, torch.Tensor]:
    leaf = mb["logprobs"].detach().clone().requires_grad_()
    return {**mb, "logprobs": leaf}, leaf


def to_padded(mb: dict, key: str, values: torch.Tensor | None = None) -> torch.Tensor:
    """Packed per-token values -> padded [B, T] over responses (rows in seq_id order)."""
    values = mb[key] if values is None else values
    seq = mb["seq_ids"]
    n_resp = int(seq.max()) + 1
    rows = [values[seq == i] for i in range(n_resp)]
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r.new_zeros(width - len(r))]) for r in rows])


def with_params(monkeypatch, cfg: dict) -> dict:
    """Set a case's non-flag surrogate parameters for the test (reference.surrogate_params);
    returns its flags."""
    if "params" in cfg:
        entry = L.SURROGATES[cfg["policy_loss"]]
        monkeypatch.setitem(L.SURROGATES, cfg["policy_loss"],
                            L.Surrogate(entry.fn, entry.params | cfg["params"], entry.aggregation))
    return {k: v for k, v in cfg.items() if k != "params"}


def sum_term(name: str = "policy") -> L.LossTerm:
    return L.LossTerm(name, lambda mb: (mb.denom_mask * mb.norm_weight).sum())


def token_losses(mb) -> torch.Tensor:
    """A policy numerator: the given token losses, by the mode's weights, over m."""
    return L.masked_sum(mb["token_loss"], mb["loss_mask"], mb["loss_weight"])


# -----------------------------------------------------------------------------
# reference vectors, computed by hand

REF_VECTORS = [("token_mean", 13 / 3), ("seq_mean", 16 / 3), ("prompt_mean", 33 / 5),
               ("constant", 13 / 6)]
REF_LOSSES = [[1.0, 3.0], [2.0, 4.0, 6.0], [10.0]]
REF_GROUPS = [0, 0, 1]


@pytest.mark.parametrize("mode,expected", REF_VECTORS)
def test_aggregate_matches_hand_computed_vectors(mode, expected):
    losses = torch.tensor([[1.0, 3.0, 0.0], [2.0, 4.0, 6.0], [10.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)
    got = aggregate(losses, mask, mode=mode, group_ids=torch.tensor(REF_GROUPS), divisor=4.0)
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode,expected", REF_VECTORS)
@pytest.mark.parametrize("cuts", [[], [4], [2, 7], [1, 2, 3, 4, 5, 6, 7, 8]],
                         ids=["one", "mid_group", "two", "every_token"])
def test_loss_reduction_reported_matches_hand_computed_vectors(mode, expected, cuts):
    responses = [
        {"group": g, "prompt_len": 2, "d": [1.0] * len(x), "m": [1.0] * len(x), "token_loss": x,
         "advantage": 0.0, **{k: torch.zeros(len(x), dtype=F64) for k in
                              ("logprobs", "prox_logprobs", "behave_logprobs", "ref_logprobs",
                               "entropy")}}
        for x, g in zip(REF_LOSSES, REF_GROUPS, strict=True)
    ]
    mb = pack(responses, mode, divisor=4.0)
    red = L.LossReduction([sum_term()])
    reported = reduce(red, split(mb, cuts), {"policy": token_losses})
    assert reported["policy"] == pytest.approx(expected, rel=1e-12)
    assert reported["loss"] == pytest.approx(expected, rel=1e-12)


# -----------------------------------------------------------------------------
# every mode against a naive loop over python floats


def naive_objective(responses: list[dict], mode: str, divisor: float) -> float:
    num = [sum(m * x for m, x in zip(r["m"], r["token_loss"], strict=True)) for r in responses]
    M = [sum(r["d"]) for r in responses]
    active = [i for i in range(len(responses)) if M[i] > 0]
    if mode == "token_mean":
        return sum(num) / sum(M) if sum(M) > 0 else 0.0
    if mode == "seq_mean":
        return sum(num[i] / M[i] for i in active) / len(active) if active else 0.0
    if mode == "constant":
        return sum(num) / (len(active) * divisor) if active else 0.0
    if mode != "prompt_mean":
        raise ValueError(f"naive_objective: no loop for mode {mode!r}; write one for a new mode")
    per_group = {}
    for i, r in enumerate(responses):
        n, d = per_group.get(r["group"], (0.0, 0.0))
        per_group[r["group"]] = (n + num[i], d + M[i])
    values = [n / d for n, d in per_group.values() if d > 0]
    return sum(values) / len(values) if values else 0.0


@pytest.mark.parametrize("mode", L.MODES)
@pytest.mark.parametrize("seed", range(4))
def test_every_mode_matches_naive_loop_on_ragged_batches(mode, seed):
    responses = ragged_batch(seed)
    assert any(sum(r["m"]) < sum(r["d"]) for r in responses), "needs rejected tokens (m < d)"
    expected = naive_objective(responses, mode, divisor=7.0)
    mb = pack(responses, mode, divisor=7.0, seed=seed)

    got_ref = aggregate(to_padded(mb, "token_loss"), to_padded(mb, "loss_mask"), mode=mode,
                          group_ids=torch.tensor([r["group"] for r in responses]),
                          denom_mask=to_padded(mb, "denom_mask"), divisor=7.0)
    assert got_ref.item() == pytest.approx(expected, rel=1e-12)

    red = L.LossReduction([sum_term()])
    parts = split(mb, anywhere_cuts(mb, random.Random(seed)))
    reported = reduce(red, parts, {"policy": token_losses})
    assert reported["policy"] == pytest.approx(expected, rel=1e-12)


def test_inactive_responses_get_zero_weights_without_nan():
    M = torch.tensor([0.0, 3.0, 0.0, 0.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    for mode in L.MODES:
        w, nw = L.response_weights(mode, M, groups, divisor=5.0)
        assert torch.isfinite(w).all() and torch.isfinite(nw).all()
        assert w[[0, 2, 3]].abs().sum() == 0 and nw[[0, 2, 3]].abs().sum() == 0
    w, nw = L.response_weights("prompt_mean", M, groups, None)
    assert w.tolist() == pytest.approx([0.0, 1 / 3, 0.0, 0.0, 1 / 2])
    # the per-micro-batch normalizer sum_t d nw counts active groups: here 2 (group 1 is inactive)
    assert float((M * nw).sum()) == pytest.approx(2.0)


# -----------------------------------------------------------------------------
# invariance: every mode x term kind x surrogate, one micro-batch vs splits

SURROGATE_CONFIGS = {
    "ppo": dict(policy_loss="ppo"),
    "ppo_cliphigher_dualclip": dict(policy_loss="ppo", eps_high=0.28, params={"dual_clip": 1.4}),
    "ppo_decoupled_truncate": dict(policy_loss="ppo", correction="truncate",
                                   correction_threshold=1.3),
    "ppo_decoupled_mask": dict(policy_loss="ppo", correction="mask", correction_threshold=1.3),
    "ppo_clipped_to_behaviour": dict(policy_loss="ppo", correction="behave"),
    "gspo": dict(policy_loss="gspo", eps_low=0.02, eps_high=0.03),
    "cispo": dict(policy_loss="cispo", eps_high=0.1),
    "sapo": dict(policy_loss="sapo", params={"tau_pos": 0.9, "tau_neg": 1.2}),
}


def reference_policy_objective(mb: dict, leaf: torch.Tensor, mode: str, groups: torch.Tensor,
                               cfg: dict, divisor: float) -> torch.Tensor:
    """The full-batch objective: the reference token loss, `aggregate`, one piece, no weights."""
    token_loss, m = policy_token_loss(cfg, leaf, mb["prox_logprobs"], mb["behave_logprobs"],
                                      mb["advantages"], mb["seq_ids"], mb["loss_mask"])
    return aggregate(to_padded(mb, "", token_loss), to_padded(mb, "", m), mode=mode,
                       group_ids=groups, denom_mask=to_padded(mb, "denom_mask"), divisor=divisor)


@pytest.mark.parametrize("surrogate", list(SURROGATE_CONFIGS))
@pytest.mark.parametrize("mode", L.MODES)
def test_split_through_groups_equals_full_batch_gradient_and_reported(mode, surrogate,
                                                                      monkeypatch):
    cfg = SURROGATE_CONFIGS[surrogate]
    flags = with_params(monkeypatch, cfg)
    seed = 11 + list(L.MODES).index(mode)
    responses = ragged_batch(seed, n_groups=9)
    groups = torch.tensor([r["group"] for r in responses])
    mb = pack(responses, mode, divisor=6.0, seed=seed)

    full, leaf = with_leaf_logprobs(mb)
    reference = reference_policy_objective(full, leaf, mode, groups, cfg, divisor=6.0)
    (ref_grad,) = torch.autograd.grad(reference, leaf)
    assert ref_grad.abs().sum() > 0

    kwargs = ({} if cfg["policy_loss"] in ("cispo", "sapo") else {"eps_low": 0.2, "eps_high": 0.2}
              ) | flags
    rng = random.Random(seed)
    splits = {"one": [], "budget_1": budget_cuts(mb, responses, rng),
              "budget_2": budget_cuts(mb, responses, rng)}
    # GSPO's sequence ratio needs whole responses; the others are token-local
    if surrogate != "gspo":
        splits["anywhere"] = anywhere_cuts(mb, rng)
    reports = {}
    for split_name, cuts in splits.items():
        red = build(mode=mode, divisor=6.0, **kwargs)
        full, leaf = with_leaf_logprobs(mb)
        (grad,), reports[split_name] = run(red, split(full, cuts), [leaf])
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12, msg=f"split {split_name}")
        assert reports[split_name]["policy"] == pytest.approx(reference.item(), rel=1e-9, abs=1e-12)
    # stats are global fractions: split-invariant too, and the data must exercise them
    for split_name in splits:
        assert reports[split_name] == pytest.approx(reports["one"], rel=1e-9, abs=1e-12)
    if cfg["policy_loss"] in ("ppo", "gspo", "cispo"):
        assert 0 < reports["one"]["policy/clip_frac"] < 1
    if "dual_clip" in cfg.get("params", {}):
        assert 0 < reports["one"]["policy/dual_clip_frac"] < 1
    if cfg.get("correction") in ("truncate", "mask"):
        assert 0 < reports["one"]["policy/behave_capped_frac"] < 1


@pytest.mark.parametrize("kl_estimator", L.KL_ESTIMATORS)
def test_multi_term_policy_entropy_kl_on_linear_model_split_invariant(kl_estimator):
    """Policy + entropy (a token mean, negative coef) + KL (a token mean, --kl-estimator):
    gradients of a tiny linear model and every reported term equal the full-batch objective for
    micro-batch splits through groups."""
    mode, seed, vocab = "prompt_mean", 5, 6
    responses = ragged_batch(seed, n_groups=8)
    groups = torch.tensor([r["group"] for r in responses])
    mb = pack(responses, mode, seed=seed)
    T = mb["loss_mask"].shape[0]
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(T, 4, generator=gen, dtype=F64)
    targets = torch.randint(0, vocab, (T,), generator=gen)
    model = torch.nn.Linear(4, vocab, dtype=F64)
    with torch.no_grad():
        model.weight.copy_(0.5 * torch.randn(vocab, 4, generator=gen, dtype=F64))
        model.bias.zero_()
        logp0 = torch.log_softmax(model(features), -1).gather(-1, targets[:, None]).squeeze(-1)
    mb["prox_logprobs"] = logp0 + 0.2 * torch.randn(T, generator=gen, dtype=F64)
    mb["ref_logprobs"] = logp0 + 0.3 * torch.randn(T, generator=gen, dtype=F64)
    params = list(model.parameters())

    def forward(part_features, part_targets):
        logits = model(part_features)
        logp_all = torch.log_softmax(logits, -1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, part_targets[:, None]).squeeze(-1), entropy

    logp, entropy = forward(features, targets)
    pad = lambda x: to_padded(mb, "", x)
    kl_token = {"k1": lambda lr: lr, "k2": lambda lr: 0.5 * lr**2,
                "k3": lambda lr: torch.exp(-lr) - 1 + lr}
    policy = aggregate(pad(L.ppo_surrogate(logp, mb["prox_logprobs"], mb["advantages"], eps_low=0.2,
                                          eps_high=0.2, dual_clip=None)[0]),
                         pad(mb["loss_mask"]), mode=mode, group_ids=groups,
                         denom_mask=pad(mb["denom_mask"]))
    ent = aggregate(pad(entropy), pad(mb["loss_mask"]), mode="token_mean", group_ids=groups,
                      denom_mask=pad(mb["denom_mask"]))
    kl = aggregate(pad(kl_token[kl_estimator](logp - mb["ref_logprobs"])), pad(mb["loss_mask"]),
                     mode="token_mean", group_ids=groups, denom_mask=pad(mb["denom_mask"]))
    reference = policy - 0.01 * ent + 0.1 * kl
    ref_grads = torch.autograd.grad(reference, params)

    # each token's features by its input id, sliced along tokens with everything else
    mb["input_ids"], mb["targets"] = torch.arange(T), targets
    rng = random.Random(seed)
    for cuts in ([], budget_cuts(mb, responses, rng), anywhere_cuts(mb, rng)):
        parts = split(mb, cuts)
        red = build(mode=mode, policy_loss="ppo", eps_low=0.2, eps_high=0.2, entropy_coef=0.01,
                    kl_coef=0.1, kl_estimator=kl_estimator)
        assert [t.name for t in red.reduction.terms] == ["policy", "entropy", "kl"]
        grads, rep = run(red, parts, params,
                         lambda mb: forward(features[mb.input_ids], mb.targets))
        for g, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-9, atol=1e-12)
        assert rep["policy"] == pytest.approx(policy.item(), rel=1e-9)
        assert rep["entropy"] == pytest.approx(ent.item(), rel=1e-9)
        assert rep["kl"] == pytest.approx(kl.item(), rel=1e-9)
        assert rep["loss"] == pytest.approx(reference.item(), rel=1e-9)


# -----------------------------------------------------------------------------
# rule 3: empty is not an error


@pytest.mark.parametrize("surrogate", list(SURROGATE_CONFIGS))
@pytest.mark.parametrize("mode", L.MODES)
def test_zero_global_normalizer_gives_zero_loss_and_finite_zero_grads(mode, surrogate,
                                                                      monkeypatch):
    responses = ragged_batch(3)
    for r in responses:  # every response inactive: every denominator is 0
        r["d"] = [0.0] * len(r["d"])
        r["m"] = [0.0] * len(r["m"])
    mb = pack(responses, mode, divisor=5.0)
    # junk that would overflow exp() if it ever reached the surrogate unmasked
    mb["prox_logprobs"] = mb["prox_logprobs"] - 800.0
    mb["ref_logprobs"] = mb["ref_logprobs"] + 800.0
    objective = build(mode=mode, divisor=5.0, entropy_coef=0.01, kl_coef=0.1,
                      **with_params(monkeypatch, SURROGATE_CONFIGS[surrogate]))
    full, leaf = with_leaf_logprobs(mb)
    full["entropy"] = full["entropy"].clone().requires_grad_()
    parts = split(full, [5, 17])
    # the reduction: every Z is 0, so every term is exactly 0 with finite zero gradients
    red = objective.reduction
    red.begin_step(parts)
    assert all(z == 0.0 for z in red.Z.values())
    for part in parts:
        numerators = {"policy": L.masked_sum(part["logprobs"] * 1e30, part["loss_mask"]),
                      "entropy": L.masked_sum(part["entropy"], part["loss_mask"]),
                      "kl": L.masked_sum(L.kl_penalty(part["logprobs"], part["ref_logprobs"], "k3"),
                                         part["loss_mask"])}
        loss = red(numerators)
        assert loss.item() == 0.0
        loss.backward()
    for g in (leaf.grad, full["entropy"].grad):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() == 0
    rep = red.reported()
    assert rep["loss"] == 0.0 and all(math.isfinite(v) for v in rep.values())
    # the step: nothing to learn from, so no forward and no update (AdamW's momentum would move)
    forwards = []
    grads, rep = run(objective, parts, [leaf], lambda mb: forwards.append(mb) or (mb.logprobs,
                                                                                mb.entropy))
    assert not forwards and rep["updated"] == 0.0 and rep["loss"] == 0.0
    assert all(g.abs().sum() == 0 for g in grads)


@pytest.mark.parametrize("mode", L.MODES)
def test_every_token_rejected_gives_zero_loss_and_finite_zero_grads(mode):
    """All tokens rejected by the behaviour cap: numerator empty, denominator kept, loss exactly 0.
    """
    mb = pack(ragged_batch(4), mode, divisor=5.0)
    # pi_prox / pi_behave = e^50 > cap everywhere
    mb["behave_logprobs"] = mb["prox_logprobs"] - 50.0
    red = build(mode=mode, policy_loss="ppo", divisor=5.0, correction="mask",
                correction_threshold=2.0)
    full, leaf = with_leaf_logprobs(mb)
    (grad,), rep = run(red, split(full, [7]), [leaf])
    assert red.Z["policy"] > 0 and rep["updated"] == 1.0
    assert rep["policy"] == 0.0 and rep["policy/behave_capped_frac"] == 1.0
    assert torch.isfinite(grad).all() and grad.abs().sum() == 0


@pytest.mark.parametrize("surrogate", L.SURROGATES)
def test_microbatch_without_active_token_runs_forward_backward(surrogate):
    """A padding micro-batch (one masked token, seq_id -1) next to a real one: finite, contributes
    0."""
    mb = pack(ragged_batch(2), "seq_mean")
    empty = {k: torch.zeros(1, dtype=v.dtype) for k, v in mb.items() if isinstance(v, torch.Tensor)}
    empty["seq_ids"] = torch.tensor([-1])
    red = build(mode="seq_mean", policy_loss=surrogate, entropy_coef=0.1)
    full, leaf = with_leaf_logprobs(mb)
    empty_leaf = empty["logprobs"].clone().requires_grad_()
    empty["logprobs"] = empty_leaf
    seen = []
    forward = lambda mb: seen.append(len(mb.logprobs)) or (mb.logprobs, mb.entropy)
    (grad, empty_grad), rep = run(red, [full, empty], [leaf, empty_leaf], forward)
    assert seen == [len(leaf), 1]  # forward and backward ran on it too
    assert torch.isfinite(empty_grad).all() and empty_grad.abs().sum() == 0
    assert grad.abs().sum() > 0 and rep["updated"] == 1.0


# -----------------------------------------------------------------------------
# rule 4: bad normalizers and bad masks are errors


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), torch.tensor(-0.5)])
def test_negative_or_non_finite_normalizer_raises_naming_the_term(bad):
    mb = pack(ragged_batch(0), "token_mean")
    red = L.LossReduction([sum_term("policy"), L.LossTerm("my_aux", lambda mb: bad)])
    with pytest.raises(ValueError, match="my_aux"):
        red.begin_step([mb])


@pytest.mark.parametrize("key", ["loss_mask", "denom_mask", "loss_weight", "norm_weight",
                                 "advantages"])
def test_mask_shape_mismatch_raises_naming_the_tensor(key):
    mb = pack(ragged_batch(0), "token_mean")
    red = build(mode="token_mean", policy_loss="ppo", eps_low=0.2, eps_high=0.2).reduction
    bad = dict(mb)
    bad[key] = mb[key][:-1]
    with pytest.raises(ValueError, match=key):
        red.begin_step([bad])
    bad[key] = mb[key][:, None]  # [T, 1] would broadcast against [T] into [T, T]
    with pytest.raises(ValueError, match=key):
        L.as_microbatch(bad).validate()
    if key in ("loss_mask", "loss_weight"):  # the step's numerator refuses it too
        with pytest.raises(ValueError, match="mask shape|weight shape"):
            L.masked_sum(mb["token_loss"], bad["loss_mask"], bad["loss_weight"])


def test_float_seq_ids_raise():
    mb = pack(ragged_batch(0), "token_mean")
    with pytest.raises(ValueError, match="seq_ids"):
        L.as_microbatch({**mb, "seq_ids": mb["seq_ids"].double()}).validate()


def test_per_token_tensors_all_of_one_2d_shape_raise():
    mb = pack(ragged_batch(0), "token_mean")
    with pytest.raises(ValueError, match="1-D"):  # equal shapes, but [T, 1] broadcasts to [T, T]
        L.as_microbatch({k: v[:, None] for k, v in mb.items() if torch.is_tensor(v)}).validate()


def test_masked_sum_ignores_non_finite_values_where_masked_and_keeps_gradients_finite():
    values = torch.tensor([2.0, math.inf, math.nan, -math.inf], dtype=F64, requires_grad=True)
    total = L.masked_sum(values, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64),
                         torch.tensor([0.5, 1.0, 1.0, 0.0], dtype=F64))
    total.backward()
    assert total.item() == 1.0 and values.grad.tolist() == [0.5, 0.0, 0.0, 0.0]


def test_microbatch_to_moves_every_tensor_but_the_attention_layout():
    mb = L.as_microbatch(pack(ragged_batch(0), "token_mean"))
    mb = replace(mb, segments=torch.zeros(2, 4, dtype=torch.long))
    moved = mb.to("meta")
    assert moved.segments.device.type == "cpu"  # modeling.attention_layout reads it on the host
    assert all(getattr(moved, f.name).device.type == "meta" for f in fields(mb)
               if f.name != "segments" and getattr(mb, f.name) is not None)


def test_token_loss_shape_mismatch_in_masked_sum_raises():
    with pytest.raises(ValueError, match="mask shape"):
        L.masked_sum(torch.ones(4), torch.ones(4, 1))
    with pytest.raises(ValueError, match="weight shape"):
        L.masked_sum(torch.ones(4), torch.ones(4), torch.ones(1))
    with pytest.raises(ValueError, match="token_loss"):
        aggregate(torch.ones(2, 3), torch.ones(2, 1), mode="token_mean",
                    group_ids=torch.tensor([0, 0]))


def test_loss_mask_above_denom_mask_raises():
    mb = pack(ragged_batch(0), "token_mean")
    i = int(torch.nonzero(mb["denom_mask"] == 0)[0])
    mb["loss_mask"] = mb["loss_mask"].clone()
    mb["loss_mask"][i] = 1.0
    red = build(mode="token_mean", policy_loss="ppo", eps_low=0.2, eps_high=0.2).reduction
    with pytest.raises(ValueError, match="m_t <= d_t"):
        red.begin_step([mb])


@pytest.mark.parametrize("divisor", [None, 0.0, -3.0, float("nan")])
def test_constant_mode_without_positive_divisor_raises(divisor):
    if divisor is not None:  # None resolves to --max-new-tokens
        with pytest.raises(ValueError, match="--loss-aggregation-divisor"):
            build(mode="constant", policy_loss="ppo", divisor=divisor)
    with pytest.raises(ValueError, match="--loss-aggregation-divisor"):
        L.response_weights("constant", torch.ones(2), torch.tensor([0, 0]), divisor)
    with pytest.raises(ValueError, match="--loss-aggregation-divisor"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), mode="constant",
                    group_ids=torch.tensor([0]),
                    divisor=divisor)


def test_unknown_mode_or_surrogate_raises_naming_the_flag():
    with pytest.raises(ValueError, match="--loss-aggregation"):
        build(mode="sequence_mean", policy_loss="ppo", eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="--loss-aggregation"):
        L.response_weights("seq-mean-token-mean", torch.ones(2), torch.tensor([0, 0]), None)
    with pytest.raises(ValueError, match="--policy-loss"):
        build(mode="token_mean", policy_loss="grpo", eps_low=0.2, eps_high=0.2)
    with pytest.raises(ValueError, match="--kl-estimator"):
        L.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match="--correction"):
        build(mode="token_mean", correction="clip")
    with pytest.raises(ValueError, match="--eps-low: cispo"):  # a flag the surrogate has no use for
        build(mode="token_mean", policy_loss="cispo", eps_low=0.1)
    with pytest.raises(ValueError, match="--correction-threshold"):
        build(mode="token_mean", correction="behave", correction_threshold=2.0)
    with pytest.raises(ValueError, match="aggregate: no reference"):
        aggregate(torch.ones(1, 2), torch.ones(1, 2), mode="sum", group_ids=torch.tensor([0]))


def test_loss_before_begin_step_raises():
    red = build(mode="token_mean", policy_loss="ppo", eps_low=0.2, eps_high=0.2).reduction
    with pytest.raises(RuntimeError, match="begin_step"):
        red({"policy": torch.zeros(())})
    red.begin_step([pack(ragged_batch(0), "token_mean")])
    with pytest.raises(ValueError, match="numerators"):  # every term's, by name
        red({"policy": torch.zeros(()), "kl": torch.zeros(())})


# -----------------------------------------------------------------------------
# surrogates: each formula against a scalar re-statement


def grad_of(fn, logp):
    leaf = logp.clone().requires_grad_()
    loss, stats = fn(leaf)
    (g,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), g, stats


RATIOS = [0.5, 0.79, 0.9, 1.0, 1.1, 1.25, 1.35, 3.0]


@pytest.mark.parametrize("adv", [1.5, -1.5])
def test_ppo_surrogate_clip_higher_and_dual_clip_match_formula(adv):
    eps_low, eps_high, c = 0.2, 0.3, 2.0
    logp = torch.log(torch.tensor(RATIOS, dtype=F64))
    prox = torch.zeros_like(logp)
    A = torch.full_like(logp, adv)
    loss, grad, stats = grad_of(lambda x: L.ppo_surrogate(x, prox, A, eps_low=eps_low,
                                                          eps_high=eps_high,
                                                          dual_clip=c), logp)
    for r, l_t, g_t, clipped, dual in zip(RATIOS, loss, grad, stats["clip_frac"],
                                          stats["dual_clip_frac"], strict=True):
        ppo = max(-adv * r, -adv * min(max(r, 1 - eps_low), 1 + eps_high))
        expected = min(ppo, -c * adv) if adv < 0 else ppo
        assert l_t.item() == pytest.approx(expected, rel=1e-12)
        is_clipped = -adv * min(max(r, 1 - eps_low), 1 + eps_high) > -adv * r
        is_dual = adv < 0 and ppo > -c * adv
        assert bool(clipped) == is_clipped and bool(dual) == is_dual
        # gradient of -A r w.r.t. logp is -A r, unless a clip holds the loss constant
        assert g_t.item() == pytest.approx(0.0 if (is_clipped or is_dual) else -adv * r, abs=1e-12)


def test_gspo_uses_masked_geometric_mean_ratio_per_sequence_with_per_token_gradient():
    gen = torch.Generator().manual_seed(0)
    seq = torch.tensor([-1, 0, 0, 0, -1, 1, 1, -1, 2, 2, 2, 2])
    mask = torch.tensor([0, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1], dtype=F64)
    logp = -torch.rand(12, generator=gen, dtype=F64)
    prox = logp + torch.tensor([9, 0.01, -0.02, 5.0, 9, -0.3, -0.2, 9, -0.001, 0.002, 0.0, 0.001],
                               dtype=F64)
    adv = torch.tensor([0, 1.0, 1.0, 1.0, 0, 2.0, 2.0, 0, -1.0, -1.0, -1.0, -1.0], dtype=F64)
    loss, grad, stats = grad_of(lambda x: L.gspo_surrogate(x, prox, adv, seq, mask, eps_low=0.05,
                                                           eps_high=0.05), logp)
    for i in range(3):
        tokens = [t for t in range(12) if seq[t] == i and mask[t] > 0]
        s = math.exp(sum(float(logp[t] - prox[t]) for t in tokens) / len(tokens))
        A = float(adv[tokens[0]])
        clipped = -A * min(max(s, 0.95), 1.05) > -A * s
        for t in (t for t in range(12) if seq[t] == i):
            assert loss[t].item() == pytest.approx(max(-A * s, -A * min(max(s, 0.95), 1.05)),
                                                   rel=1e-12)
            assert grad[t].item() == pytest.approx(0.0 if clipped else -A * s, abs=1e-12)
            assert bool(stats["clip_frac"][t]) == clipped
    # sequence 1 (s = e^0.25, A > 0) is clipped
    assert stats["clip_frac"][5] == 1 and stats["clip_frac"][1] == 0


def test_cispo_keeps_gradient_on_clipped_tokens_with_stopped_weight():
    eps_high = 0.2
    logp = torch.log(torch.tensor(RATIOS, dtype=F64))
    prox = torch.zeros_like(logp)
    A = torch.full_like(logp, -0.7)
    loss, grad, stats = grad_of(lambda x: L.cispo_surrogate(x, prox, A, eps_high=eps_high), logp)
    for r, lp, l_t, g_t, clipped in zip(RATIOS, logp.tolist(), loss, grad, stats["clip_frac"],
                                        strict=True):
        weight = min(r, 1 + eps_high)
        assert l_t.item() == pytest.approx(-weight * -0.7 * lp, rel=1e-12)
        # never zero: clipping caps, not drops
        assert g_t.item() == pytest.approx(-weight * -0.7, rel=1e-12)
        assert bool(clipped) == (r > 1 + eps_high)


def test_sapo_soft_gate_picks_tau_by_advantage_sign():
    tau_pos, tau_neg = 1.0, 1.05
    logp = torch.log(torch.tensor(RATIOS * 2, dtype=F64))
    prox = torch.zeros_like(logp)
    A = torch.tensor([0.8] * len(RATIOS) + [-0.8] * len(RATIOS), dtype=F64)
    loss, grad, _ = grad_of(lambda x: L.sapo_surrogate(x, prox, A, tau_pos=tau_pos,
                                                       tau_neg=tau_neg), logp)
    sig = lambda z: 1 / (1 + math.exp(-z))
    for r, a, l_t, g_t in zip(RATIOS * 2, A.tolist(), loss, grad, strict=True):
        tau = tau_pos if a > 0 else tau_neg
        assert l_t.item() == pytest.approx(-(4 / tau) * sig(tau * (r - 1)) * a, rel=1e-12)
        # d/dlogp: -(4/tau) sig'(.) tau r A = -4 sig (1 - sig) r A; at r = 1 exactly PPO's -A
        s = sig(tau * (r - 1))
        assert g_t.item() == pytest.approx(-4 * s * (1 - s) * r * a, rel=1e-10)
    assert loss[len(RATIOS) + 3].item() == pytest.approx(0.8 * 4 / tau_neg * 0.5)


def test_behaviour_weights_truncate_and_mask_with_infinite_log_ratios():
    prox = torch.tensor([-1.0, -1.0, -1.0, -1.0, float("-inf"), -2.0])
    behave = torch.tensor([-1.0, -1.5, -0.5, float("-inf"), float("-inf"), -3.5])
    # -inf - -inf: NaN -> ratio 1
    w_true = [1.0, math.exp(0.5), math.exp(-0.5), math.inf, 1.0, math.exp(1.5)]
    seq, m = torch.zeros(6, dtype=torch.long), torch.ones(6)
    mb = L.MicroBatch(denom_mask=m, loss_mask=m, behave_logprobs=behave, seq_ids=seq)
    w, kept, _ = L.correct(L.CORRECTIONS["truncate"], prox, mb, 2.0)
    assert w.tolist() == pytest.approx([min(x, 2.0) for x in w_true]) and kept.sum() == 6
    w, kept, _ = L.correct(L.CORRECTIONS["mask"], prox, mb, 2.0)
    assert kept.tolist() == [float(x <= 2.0) for x in w_true]
    assert w.tolist() == pytest.approx([0.0 if x > 2.0 else x for x in w_true])


def test_sanitize_log_ratio_only_turns_nan_into_zero():
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1.5])
    assert L.sanitize_log_ratio(x).tolist() == [0.0, math.inf, -math.inf, 1.5]
    minus_inf = torch.tensor([float("-inf")])
    assert L.sanitize_log_ratio(minus_inf - minus_inf).tolist() == [0.0]


def test_kl_estimators_match_formulas_with_bounded_log_ratios():
    logp = torch.tensor([-1.0, -0.2, -3.0, -40.0], dtype=F64)
    ref = torch.tensor([-1.5, -0.2, -1.0, -2.0], dtype=F64)  # the last: L = -38, pi_ref >> pi
    lr = [0.5, 0.0, -2.0, -20.0]  # log-ratios are clamped to +-20 before any exp
    assert L.kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5 * x * x for x in lr])
    k3 = [min(math.exp(-x) - 1 + x, 10.0) for x in lr]  # k3's value is capped at 10 (verl's bound)
    assert L.kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3)
    assert L.kl_penalty(logp, ref, "k1").tolist() == pytest.approx(lr)
    with pytest.raises(ValueError, match="--kl-estimator"):
        L.kl_penalty(logp, ref, "k5")


def test_k1_k2_k3_as_losses_have_zero_reverse_kl_and_forward_kl_gradients():
    """Exact expectation over a categorical pi = softmax(theta): E_{x ~ pi}[grad k(x)] (samples
    from pi, so the weights pi(x) are constants) against the gradient of the exact divergence."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(6, generator=gen, dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=F64), -1)

    def expected_grad(estimator):
        logp = torch.log_softmax(theta, -1)
        k = L.kl_penalty(logp, ref, estimator)
        return torch.autograd.grad((logp.exp().detach() * k).sum(), theta)[0]

    def exact_grad(forward: bool):
        logp = torch.log_softmax(theta, -1)
        kl = (ref.exp() * (ref - logp)).sum() if forward else (logp.exp() * (logp - ref)).sum()
        return torch.autograd.grad(kl, theta)[0]

    torch.testing.assert_close(expected_grad("k2"), exact_grad(forward=False))  # KL(pi || ref)
    torch.testing.assert_close(expected_grad("k3"), exact_grad(forward=True))  # KL(ref || pi)
    assert expected_grad("k1").abs().max() < 1e-12  # k1: zero in expectation (noise alone)
    # and per sample, each one's gradient is its formula's: dk/dL = 1, L, 1 - e^-L
    logp = torch.tensor([-1.0, -0.5], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.1], dtype=F64)
    for estimator, dk in {"k1": lambda x: 1 + 0 * x, "k2": lambda x: x,
                          "k3": lambda x: 1 - torch.exp(-x)}.items():
        grad, = torch.autograd.grad(L.kl_penalty(logp, ref, estimator).sum(), logp)
        torch.testing.assert_close(grad, dk(logp.detach() - ref))


@pytest.mark.parametrize("surrogate", list(SURROGATE_CONFIGS))
def test_one_extreme_log_ratio_cannot_make_the_step_non_finite(surrogate, monkeypatch):
    """A token at log(pi/pi_prox) = +95 or -95 (exp overflows float32 at ~88): the loss and every
    gradient stay finite, and the other tokens' gradients are what they are without it."""
    mb = pack(ragged_batch(6), "token_mean")
    idx = torch.nonzero(mb["loss_mask"] > 0).flatten()
    red = build(mode="token_mean", **with_params(monkeypatch, SURROGATE_CONFIGS[surrogate]))
    grads = []
    for extreme in (0.0, 95.0, -95.0):
        full, leaf = with_leaf_logprobs({k: (v.float() if v.is_floating_point() else v)
                                         for k, v in mb.items() if isinstance(v, torch.Tensor)})
        full["prox_logprobs"] = full["prox_logprobs"].clone()
        full["behave_logprobs"] = full["prox_logprobs"].clone()
        full["prox_logprobs"][idx[0]] = leaf[idx[0]].detach() - extreme
        full["behave_logprobs"][idx[0]] = full["prox_logprobs"][idx[0]]
        (grad,), reported = run(red, [full], [leaf])
        assert torch.isfinite(grad).all() and all(math.isfinite(v) for v in reported.values())
        grads.append(grad)
    if surrogate != "gspo":  # GSPO's sequence ratio mixes the extreme token into its response
        for g in grads[1:]:
            rest = torch.ones_like(g, dtype=torch.bool)
            rest[idx[0]] = False
            torch.testing.assert_close(g[rest], grads[0][rest])


def test_defaults_come_from_the_registries_gspo_its_papers_clip_range_and_a_sequence_mean():
    resolve = lambda loss, mode="auto", eps_high=None, divisor=None, correction="none": \
        L.resolve_loss_flags(types.SimpleNamespace(
            policy_loss=loss, loss_aggregation=mode, eps_low=None, eps_high=eps_high,
            loss_aggregation_divisor=divisor, correction=correction, correction_threshold=None,
            max_new_tokens=8, max_staleness=0, num_minibatches=1, ppo_epochs=1))
    gspo, ppo = resolve("gspo"), resolve("ppo")
    assert (gspo["eps_low"], gspo["eps_high"], gspo["loss_aggregation"]) == (3e-4, 4e-4,
                                                                            "seq_mean")
    assert (ppo["eps_low"], ppo["eps_high"], ppo["loss_aggregation"]) == (0.2, 0.2, "token_mean")
    mine = resolve("gspo", "constant", eps_high=1e-3)
    assert (mine["eps_high"], mine["loss_aggregation"], mine["loss_aggregation_divisor"]) == (
        1e-3, "constant", 8.0)  # constant's divisor defaults to the longest response
    assert resolve("ppo", correction="m2po")["correction_threshold"] == 0.04
    assert resolve("ppo", correction="truncate")["correction_threshold"] == 2.0
    assert resolve("ppo", correction="behave")["correction_threshold"] is None


def naive_m2po(x: list[float], valid: list[bool], threshold: float) -> list[bool]:
    """Sort-and-drop: remove the largest (log ratio)^2 one at a time until the kept mean <=
    threshold."""
    kept = sorted((v, i) for i, (v, ok) in enumerate(zip(x, valid, strict=True)) if ok)
    while kept and sum(v for v, _ in kept) / len(kept) > threshold:
        kept.pop()
    keep = {i for _, i in kept}
    return [i in keep for i in range(len(x))]


@pytest.mark.parametrize("threshold", [0.0, 0.01, 0.04, 0.2, 10.0])
def test_m2po_mask_drops_largest_second_moments_until_mean_below_threshold(threshold):
    gen = torch.Generator().manual_seed(1)
    prox = -torch.rand(300, generator=gen, dtype=F64)
    behave = prox + 0.3 * torch.randn(300, generator=gen, dtype=F64)
    # an impossible token under pi_behave: infinite second moment, always dropped
    behave[7] = float("-inf")
    prox[9] = behave[9] = float("-inf")  # NaN log ratio sanitised to 0: kept
    loss_mask = (torch.rand(300, generator=gen) > 0.2).to(F64)
    loss_mask[[7, 9]] = 1.0
    new = L.m2po_mask(prox, behave, loss_mask, threshold=threshold)
    x = L.sanitize_log_ratio(prox - behave).pow(2).tolist()
    expected = naive_m2po(x, (loss_mask > 0).tolist(), threshold)
    assert new.tolist() == [float(e) for e in expected]
    assert new[7] == 0 and new[9] == 1
    assert (new <= loss_mask).all()


@pytest.mark.parametrize("mode", L.MODES)
def test_m2po_trains_on_its_kept_tokens_and_reports_the_share_of_d_it_removed(mode):
    """M2PO's mask in the loss, whatever the split: the objective is the plain importance ratio to
    pi_behave, unclipped (PPO clipped around pi_behave with an open clip range), on m := the kept
    tokens (d unchanged); policy/behave_capped_frac is the share of d tokens the mask removed (the
    stat the token-level corrections report; none and behave report none)."""
    threshold, seed = 0.1, 31 + list(L.MODES).index(mode)
    responses = ragged_batch(seed, n_groups=9)
    mb = pack(responses, mode, divisor=6.0, seed=seed)
    x = L.sanitize_log_ratio(mb["prox_logprobs"] - mb["behave_logprobs"]).pow(2).tolist()
    keep = torch.tensor(naive_m2po(x, (mb["loss_mask"] > 0).tolist(), threshold), dtype=F64)
    d = mb["denom_mask"]
    removed = float(((mb["loss_mask"] - keep) * d).sum() / d.sum())
    assert 0 < removed < 1  # the threshold bites, and not everywhere

    full, leaf = with_leaf_logprobs(mb)
    reference = reference_policy_objective({**full, "loss_mask": keep}, leaf, mode,
                                           torch.tensor([r["group"] for r in responses]),
                                           {"policy_loss": "ppo", "correction": "behave",
                                            "eps_low": 1.0, "eps_high": math.inf}, divisor=6.0)
    (ref_grad,) = torch.autograd.grad(reference, leaf)
    rng = random.Random(seed)
    for cuts in ([], budget_cuts(mb, responses, rng), anywhere_cuts(mb, rng)):
        red = build(mode=mode, divisor=6.0, correction="m2po", correction_threshold=threshold)
        full, leaf = with_leaf_logprobs(mb)
        parts = split(full, cuts)
        kept = L.m2po_mask(*(torch.cat([p[k] for p in parts]) for k in (
            "prox_logprobs", "behave_logprobs", "loss_mask")), threshold=threshold)
        for part, k in zip(parts, kept.split([len(p["loss_mask"]) for p in parts])):
            part["keep_mask"] = k
        (grad,), reported = run(red, parts, [leaf])
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        assert reported["policy"] == pytest.approx(reference.item(), rel=1e-9, abs=1e-12)
        assert reported["policy/behave_capped_frac"] == pytest.approx(removed, rel=1e-12)
    for correction in ("none", "behave"):  # nothing capped, nothing masked: no such stat
        red = build(mode=mode, divisor=6.0, correction=correction)
        assert "policy/behave_capped_frac" not in run(red, [full], [leaf])[1]
