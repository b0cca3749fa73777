"""Train-inference mismatch corrections (issue 45): token TIS, seq-TIS, token-MIS, seq-MIS and
geo-MIS through the trainer's own step on a real (tiny) model, against the objective written by
hand from their formulas on a plain padded forward. The engine's log-probs are the trainer's with
noise, so ratios spread and the caps bite; a rejected token or response leaves the numerator and
the denominators the mode defines (as if never sampled), whatever the micro-batching."""

import math
import random

import pytest
import torch
from reference import GradCapture, aggregate
from test_architectures import FAMILIES, build, samples
from transformers import AutoModelForCausalLM

import loss as L
import modeling
import nanoareal as N
from rollout import Completion

CAPS = {"truncate": 1.3, "seq_tis": 1.5, "token_mis": 1.3, "seq_mis": 1.6, "geo_mis": 1.08}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build(tmp_path_factory.mktemp("llama"), "llama", FAMILIES["llama"])


def plain_logprobs(model, batch) -> list[torch.Tensor]:
    """Each sample's completion log-probs from a plain forward of its whole sequence."""
    out = []
    for s in batch:
        ids = torch.tensor([s.prompt_ids + s.completion.output_ids])
        logp = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
        p, n = len(s.prompt_ids), len(s.completion.output_ids)
        out.append(logp[p - 1 : p - 1 + n].gather(-1, ids[0, p:, None])[:, 0])
    return out


def with_engine_noise(path: str, seed: int) -> list:
    """samples() whose behaviour log-probs are the model's own plus noise (another engine)."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    batch, g = samples(seed), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s, lp in zip(batch, plain_logprobs(model, batch)):
            noisy = lp + 0.15 * torch.randn(len(lp), generator=g)
            s.completion = Completion(s.completion.output_ids, noisy.tolist(), "stop")
    return batch


def reference(path: str, batch: list, mode: str, correction: str, cap: float):
    """Gradients of the corrected objective, from its formulas: r_t = pi/pi_behave (pi_prox = pi:
    one update per batch), rho_i = prod_t r_t, g_i = rho_i^(1/n_i); the PPO token loss -A r at
    ratio 1, weighted by w (sg), kept by m; rejected tokens out of m and d."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    rows, kept = [], []
    for s, logp in zip(batch, plain_logprobs(model, batch)):
        lr = logp.detach() - torch.tensor(s.completion.logprobs)
        n = len(lr)
        w, keep = torch.ones(n), torch.ones(n)
        if correction == "truncate":
            w = lr.exp().clamp(max=cap)
        elif correction == "seq_tis":
            w = torch.full((n,), min(math.exp(lr.sum()), cap))
        elif correction == "token_mis":
            keep = (lr.abs() <= math.log(cap)).float()
            w = lr.exp()
        elif correction == "seq_mis":
            keep = torch.full((n,), float(abs(lr.sum()) <= math.log(cap)))
            w = torch.full((n,), math.exp(lr.sum()))
        elif correction == "geo_mis":
            keep = torch.full((n,), float(abs(lr.mean()) <= math.log(cap)))
        ratio = torch.exp(logp - logp.detach())
        rows.append(-s.advantage * w * ratio)
        kept.append(keep)
    width = max(len(r) for r in rows)
    pad = lambda xs: torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in xs])
    groups = torch.tensor([s.group for s in batch])
    objective = aggregate(pad(rows), pad(kept), mode=mode, group_ids=groups, divisor=5.0)
    objective.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    rejected = 1 - torch.cat(kept).mean().item()
    return grads, rejected


@pytest.mark.parametrize("correction", list(CAPS))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_a_corrections_gradient_equals_its_formula_on_any_micro_batching(
        correction, mode, model_path, one_rank_group):
    cap, batch = CAPS[correction], with_engine_noise(model_path, seed=1)
    want, rejected = reference(model_path, batch, mode, correction, cap)
    if L.CORRECTIONS[correction].reject is not None:  # the cap bites, not everywhere
        assert 0.05 < rejected < 0.9, rejected
    scale = torch.cat([g.flatten() for g in want.values()]).norm()
    for budget in (24, 4096):  # micro-batches cutting groups apart, and one
        cfg = N.Config(model=model_path, micro_batch_tokens=budget, grad_clip=0,
                       loss_aggregation=mode, correction=correction, correction_threshold=cap,
                       loss_aggregation_divisor=5.0 if mode == "constant" else None)
        model = modeling.load_model(cfg, torch.device("cpu"))
        capture = GradCapture(model)
        counters, stats = N.train_on_samples(model, None, capture, L.build_loss(cfg),
                                             [s for s in batch], cfg, N.Ranks())
        got = capture.grads
        diff = torch.cat([(got[n] - want[n]).flatten() for n in got]).norm()
        assert diff <= 1e-5 * scale, f"budget {budget}: relative {diff / scale:.2e}"
        if L.CORRECTIONS[correction].reject is not None:
            share = counters["rejected"] / counters["loss_tokens"]
            assert share == pytest.approx(rejected, rel=1e-6)


@pytest.mark.parametrize("correction", ["none", "seq_mis", "geo_mis"])
def test_the_mismatch_metrics_follow_their_formulas(correction, model_path, one_rank_group):
    """k3 = r - 1 - log r and the log perplexity gap mean_t (log pi_behave - log pi) per response,
    over every sampled token, those a correction rejects included (the engine's gap, not what is
    left of it); the extreme per-response ratios rho_i."""
    batch = with_engine_noise(model_path, seed=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
    with torch.no_grad():
        lrs = [lp - torch.tensor(s.completion.logprobs)
               for s, lp in zip(batch, plain_logprobs(model, batch))]
    k3 = torch.cat([lr.exp() - 1 - lr for lr in lrs])
    gap = sum(-lr.mean().item() for lr in lrs) / len(lrs)
    cfg = N.Config(model=model_path, micro_batch_tokens=24, grad_clip=0, correction=correction,
                   correction_threshold=CAPS.get(correction))
    trained = modeling.load_model(cfg, torch.device("cpu"))
    sums, _ = N.train_on_samples(trained, None, GradCapture(trained), L.build_loss(cfg),
                                 batch, cfg, N.Ranks())
    if correction != "none":  # the cap bites: the metrics still see every sampled token
        assert 0 < sums["rejected"] < sums["loss_tokens"]
        assert sums["denom_tokens"] == sums["loss_tokens"] - sums["rejected"]
    assert sums["loss_tokens"] == len(k3)
    assert sums["mismatch_k3"] / sums["loss_tokens"] == pytest.approx(k3.mean().item(), rel=1e-4)
    assert sums["log_ppl_gap"] / sums["responses"] == pytest.approx(gap, rel=1e-4)
    assert sums["responses"] == len(batch)
    rho = [lr.sum().item() for lr in lrs]
    assert sums["seq_log_ratio_max"] == pytest.approx(max(rho), rel=1e-4)
    assert -sums["seq_log_ratio_min_max"] == pytest.approx(min(rho), rel=1e-4)


def test_geo_mis_keeps_a_length_independent_geometric_mean_and_seq_mis_the_product():
    """rho_i = prod_t r_t grows with length; g_i = rho_i^(1/n) does not: a long response of
    ratios 1.05 is rejected by seq-MIS at C = 2 and kept by geo-MIS at C = 1.08."""
    lr = torch.full((20,), math.log(1.05))
    seq, d = torch.zeros(20, dtype=torch.long), torch.ones(20)
    assert L.seq_reject(lr, seq, d, 2.0).sum() == 0  # 1.05^20 = 2.65 > 2
    assert L.geo_reject(lr, seq, d, 1.08).sum() == 20
    assert L.geo_reject(lr, seq, d, 1.04).sum() == 0
    rng = random.Random(0)
    ids = torch.tensor(sorted(rng.randrange(4) for _ in range(20)))
    per = L.seq_ratio(lr, ids, d).clamp(max=1.1)  # seq_tis: truncated at C
    for i in ids.unique():  # one weight per response, min(1.05^n_i, C)
        n = int((ids == i).sum())
        assert per[ids == i].unique().tolist() == pytest.approx([min(1.05**n, 1.1)])


@pytest.mark.parametrize("cap", [1e6, 1.2])
def test_seq_tis_counts_as_capped_only_the_responses_its_cap_cut(cap, model_path, one_rank_group):
    """policy/behave_capped_frac under seq_tis: the tokens of responses with rho_i > C, not those
    whose own ratio r_t happens to exceed their response's rho (about half of them)."""
    batch = with_engine_noise(model_path, seed=3)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
    with torch.no_grad():
        lrs = [lp - torch.tensor(s.completion.logprobs)
               for s, lp in zip(batch, plain_logprobs(model, batch))]
    cut = sum(len(lr) for lr in lrs if lr.sum().exp() > cap) / sum(len(lr) for lr in lrs)
    if cap < 10:
        assert 0 < cut < 1, cut
    cfg = N.Config(model=model_path, grad_clip=0, correction="seq_tis", correction_threshold=cap)
    trained = modeling.load_model(cfg, torch.device("cpu"))
    _, stats = N.train_on_samples(trained, None, GradCapture(trained), L.build_loss(cfg),
                                  batch, cfg, N.Ranks())
    assert stats["policy/behave_capped_frac"] == pytest.approx(cut, abs=1e-9)


def test_a_step_with_nothing_trained_logs_valid_json():
    """No micro-batch added (every group filtered away): the largest importance weight is 0, as
    before the mismatch metrics, and the extreme sequence ratios are left out; no -inf reaches
    metrics.jsonl (JSON has none)."""
    import json

    import logs

    sums = N.StepMetrics(torch.device("cpu")).sums()
    metrics = logs.step_metrics(sums, {}, {"train": 1.0}, 1e-6, 1)
    assert metrics["importance_weight/max"] == 0.0
    assert "mismatch/seq_ratio_max" not in metrics and "mismatch/seq_ratio_min" not in metrics
    json.dumps(metrics, allow_nan=False)
