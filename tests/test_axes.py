"""The ablation axes of issue 31, each against a hand-written reference: several optimizer passes
over one batch (--ppo-epochs), top-p / top-k sampling, DAPO's soft overlong penalty, weighted reward
terms, the reward's random state, and the removed --adv-std (--adv-estimator took its place). The
KL estimators and the batch std are in test_loss.py and test_nanoareal.py (next to their siblings);
runs end to end with a random reward in test_checkpoint.py, staleness with the auto correction in
test_staleness.py."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import whole

import loss as L
import modeling
import nanoareal as N
import rollout
import tasks
from cli import UserError
from rollout import Completion, Sample

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "assets" / "tiny-arith")
CPU = torch.device("cpu")


# -----------------------------------------------------------------------------
# --ppo-epochs: pass after pass over one batch, the clip centred on the weights before the first


def _samples() -> list[Sample]:
    return [Sample(g, [4 + g, 13, 5], Completion([6 + g, 7 + g % 2, 1], [-1.0] * 3, "stop"),
                   advantage=(-1.0) ** g * (1 + g / 4)) for g in range(4)]


def hand_written_passes(samples: list[Sample], epochs: int, minibatches: int, lr: float,
                        eps: float = 0.2) -> tuple[list[torch.Tensor], list[float]]:
    """PPO straight from its formula on an unsharded float64 copy, one sequence at a time: pi_prox
    once, before any update; then `epochs` passes of `minibatches` SGD steps on token_mean of
    max(-A r, -A clip(r, 1 - eps, 1 + eps)). Returns the weights and each update's clipped share."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def logprobs(s: Sample) -> torch.Tensor:
        ids = torch.tensor(s.prompt_ids + s.completion.output_ids)
        logits = model(input_ids=ids[None], use_cache=False).logits[0, len(s.prompt_ids) - 1 : -1]
        return torch.log_softmax(logits, -1).gather(-1, ids[len(s.prompt_ids):, None])[:, 0]

    with torch.no_grad():  # the trainer keeps frozen log-probs in float32, as the engine's
        prox = [logprobs(s).float().double() for s in samples]
    clip_shares = []
    for _ in range(epochs):
        for share in range(minibatches):  # groups share, share + minibatches, ...
            mine = [i for i, s in enumerate(samples) if s.group % minibatches == share]
            token_losses, clipped = [], 0
            for i in mine:
                r, A = torch.exp(logprobs(samples[i]) - prox[i]), samples[i].advantage
                token_losses.append(torch.maximum(-A * r, -A * r.clamp(1 - eps, 1 + eps)))
                clipped += int(((-A * r.clamp(1 - eps, 1 + eps)) > -A * r).sum())
            loss = torch.cat(token_losses)
            optimizer.zero_grad()
            (loss.sum() / loss.numel()).backward()
            optimizer.step()
            clip_shares.append(clipped / loss.numel())
    return [p.detach() for p in model.parameters()], clip_shares


@pytest.mark.parametrize("minibatches", [1, 2])
def test_ppo_epochs_second_pass_clips_around_the_first_pass_pi_prox_like_a_hand_written_loop(
        one_rank_group, minibatches, monkeypatch):
    """--ppo-epochs 2: the second pass's ratio is not 1 and the clip acts, on pi_prox of the weights
    before the batch's first update, computed once (a pi_prox recomputed per pass would give ratio
    1 again and other weights)."""
    lr = 2.0
    cfg = N.Config(model=TINY, dtype="float64", warmup_steps=0, grad_clip=0.0, ppo_epochs=2,
                   num_minibatches=minibatches)
    assert cfg.correction == "none"
    model = modeling.load_model(cfg, CPU)
    forwards, forward = [], modeling.Model.logprobs  # every micro-batch forward of the trainer
    monkeypatch.setattr(modeling.Model, "logprobs", lambda self, *a, **k: forwards.append(
        k.get("grad", False)) or forward(self, *a, **k))
    _, stats = N.train_on_samples(model, None, torch.optim.SGD(model.module.parameters(), lr=lr),
                                  L.build_loss(cfg), _samples(), cfg, N.Ranks())
    weights, clip_shares = hand_written_passes(_samples(), 2, minibatches, lr)
    assert forwards.count(False) == minibatches  # pi_prox: one forward per micro-batch, once
    assert stats["updated"] == 1 and forwards.count(True) == 2 * minibatches
    for got, want in zip(model.module.parameters(), weights, strict=True):
        torch.testing.assert_close(whole(got.detach()), want, rtol=1e-9, atol=1e-11)
    assert clip_shares[0] == 0 and clip_shares[-1] > 0  # the first update is on policy
    assert stats["policy/clip_frac"] == pytest.approx(sum(clip_shares) / len(clip_shares))


def test_several_updates_per_batch_need_pi_prox_forward_unless_clipped_to_behaviour():
    assert not L.needs_proximal_forward("none", 1)
    assert L.needs_proximal_forward("none", 2) and L.needs_proximal_forward("truncate", 4)
    assert not L.needs_proximal_forward("behave", 4)  # its anchor is pi_behave, from the engine


# -----------------------------------------------------------------------------
# --top-p / --top-k: SGLang's rule, exactly, with the counter-based noise


def kept_by_hand(probs: list[float], top_p: float, top_k: int) -> set[int]:
    """SGLang's joint rule written out: sort by probability; the j-th is kept when j < k and the
    probabilities before it sum to at most p."""
    order, kept, before = sorted(range(len(probs)), key=lambda i: -probs[i]), set(), 0.0
    for j, i in enumerate(order):
        if (top_k < 1 or j < top_k) and (top_p >= 1 or before <= top_p):
            kept.add(i)
        before += probs[i]
    return kept


@pytest.mark.parametrize("top_p, top_k", [(1.0, -1), (0.5, -1), (0.8, -1), (1.0, 2), (0.9, 3),
                                          (0.3, 1)])
def test_top_p_top_k_sample_the_renormalised_kept_tokens_and_report_untruncated_logprobs(
        top_p, top_k):
    logits = torch.tensor([1.0, 3.0, 0.2, 2.1, -1.0, 2.0])
    temperature, n = 0.8, 20000
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    kept = kept_by_hand(probs, top_p, top_k)
    sampling = rollout.SamplingParams(4, temperature, top_p, top_k)
    seeds = torch.arange(n) * 7919 + 13
    tokens, logps = rollout.sample_tokens(logits.expand(n, -1), sampling, seeds, position=3)
    again, _ = rollout.sample_tokens(logits.expand(n, -1), sampling, seeds, position=3)
    assert torch.equal(tokens, again)  # a function of (seed, position)
    counts = torch.bincount(tokens, minlength=len(probs)).tolist()
    assert {i for i, c in enumerate(counts) if c} == kept
    mass = sum(probs[i] for i in kept)
    for i in kept:  # the kept tokens, renormalised: within 5 sigma of a binomial
        p = probs[i] / mass
        assert abs(counts[i] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (i, counts[i] / n, p)
    want = torch.log_softmax(logits / temperature, -1)[tokens]  # before truncation, as SGLang's
    torch.testing.assert_close(logps, want)


def test_the_config_sends_top_p_and_top_k_to_every_engine():
    class Capture:
        version = 0

        def generate(self, prompts, sampling, seeds):
            self.sampling = sampling
            return [rollout.Completion([1], [0.0], "stop") for _ in prompts]

    engine, cfg = Capture(), N.Config(top_p=0.9, top_k=5, group_size=2)
    data = tasks.Data(tokenizer=None, rows=[{}], prompts=[[4, 5]], evalset=[], stop_ids=[1])
    N.generate(engine, data, [(0, 0)], 0, cfg)
    assert (engine.sampling.top_p, engine.sampling.top_k) == (0.9, 5)
    sent = rollout._sampling_dict(engine.sampling, 8, 0)  # what the SGLang engines post
    assert (sent["top_p"], sent["top_k"]) == (0.9, 5)


# -----------------------------------------------------------------------------
# DAPO's soft overlong penalty


def test_soft_overlong_penalty_ramp_at_its_edges():
    f = tasks.OVERLONG_FACTOR
    pen = lambda n: tasks.soft_overlong_penalty(n, max_tokens=16, buffer=4)
    assert [pen(n) for n in (1, 11, 12)] == [0.0, 0.0, 0.0]  # up to max - buffer: free
    assert pen(13) == pytest.approx(-f / 4) and pen(14) == pytest.approx(-f / 2)
    assert pen(16) == pytest.approx(-f) and pen(17) == pytest.approx(-f)  # the cap, and beyond
    assert tasks.soft_overlong_penalty(3, 3, 3) == pytest.approx(-f)  # buffer = whole length
    assert tasks.soft_overlong_penalty(1, 3, 3) == pytest.approx(-f / 3)


def test_the_overlong_penalty_is_added_to_the_reward_and_logged_apart():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    cfg = N.Config(max_new_tokens=8, overlong_buffer=4)
    samples = [Sample(0, [4], Completion(tok("12")["input_ids"][:1] * n, [0.0] * n, "length"),
                      row=0) for n in (3, 4, 5, 8)]
    data = tasks.Data(tok, [{"prompt": "1+1=", "answer": "2"}], [[4]], [], [])
    N.score(samples, data, lambda c, row: 1.0, cfg)
    assert [s.metrics["overlong"] for s in samples] == pytest.approx([0, 0, -0.25, -1.0])
    assert [s.reward for s in samples] == pytest.approx([1.0, 1.0, 0.75, 0.0])
    assert N.rollout_sums(samples, N.Ranks())["reward/overlong"] == pytest.approx(-1.25)
    plain = [Sample(**{**s.__dict__, "metrics": {}}) for s in samples]
    N.score(plain, data, lambda c, row: 1.0, N.Config())
    assert [s.reward for s in plain] == [1.0] * 4 and all(not s.metrics for s in plain)


# -----------------------------------------------------------------------------
# several reward functions with weights


def test_weighted_reward_terms_sum_and_each_is_logged_under_its_name(tmp_path):
    (tmp_path / "mine.py").write_text("def politeness(completion, row):\n"
                                      "    return 1.0 if 'please' in completion else 0.0\n")
    fn = tasks.load_reward(f"exact_match, 0.5*format,-0.01*length,2*{tmp_path}/mine.py:politeness")
    row = {"answer": "46"}
    for text, want in [("46", 1 + 0.5 - 0.02), ("45", 0.5 - 0.02),
                       ("46 please", 2 - 0.09), ("forty", -0.05)]:
        score = tasks.score_one(fn, text, row)
        terms = {"exact_match": float(text == "46"), "format": float(text[-1].isdigit()),
                 "length": float(len(text)), "politeness": float("please" in text)}
        assert score.reward == pytest.approx(want) and score.metrics == terms
        assert score.correct is (text == "46")  # the first term's verdict: exact_match's
    for bad in ("exact_match,x*format", "exact_match,nope"):
        with pytest.raises(UserError, match="--reward"):
            tasks.load_reward(bad)
    assert tasks.load_reward("format") is tasks.REWARDS["format"]  # one name: the function itself


# -----------------------------------------------------------------------------
# the reward's random state: (seed, step, slot, k), like everything else


def test_a_reward_drawing_random_numbers_gets_its_samples_seed_on_any_batch():
    draw = lambda c, row: random.random() + float(np.random.rand())
    rows, seeds = [{}] * 4, [rollout.mix_seed(0, 1, slot, 0) for slot in range(4)]
    want = [random.Random(s).random() + np.random.RandomState(s).rand() for s in seeds]
    got = tasks.compute_rewards(draw, ["a"] * 4, rows, 5.0, seeds)
    assert [s.reward for s in got] == pytest.approx(want, rel=1e-15)
    # the same sample scored in another batch, alone: the same draws
    assert tasks.compute_rewards(draw, ["a"], rows[:1], 5.0, seeds[2:3])[0].reward == got[2].reward
    assert "numpy" in sys.modules


# -----------------------------------------------------------------------------
# --adv-std is gone (--adv-estimator dr_grpo is its "none"); --correction auto


def test_the_removed_adv_std_fails_in_one_line_naming_adv_estimator(tmp_path):
    """--adv-std (a bool, then group | batch | none) became values of --adv-estimator: the old flag
    in either form and its TOML key are refused in one line (the flag naming its successor); its
    "none" is dr_grpo."""
    refusals = []
    for argv in (["--no-adv-std"], ["--adv-std", "none"]):
        with pytest.raises(UserError, match=f"unknown flag {argv[0]} ") as refused:
            N.parse_config(argv)
        refusals.append(str(refused.value))
    assert "did you mean --adv-estimator?" in refusals[1]
    (tmp_path / "old.toml").write_text("adv-std = false\n")
    with pytest.raises(UserError, match="unknown key 'adv-std'") as refused:
        N.parse_config(["--config", str(tmp_path / "old.toml")])
    refusals.append(str(refused.value))
    assert not any("\n" in r for r in refusals)
    assert N.parse_config(["--adv-estimator", "dr_grpo"]).adv_estimator == "dr_grpo"


def test_an_old_run_directory_with_adv_std_is_refused_in_one_line_naming_it(tmp_path):
    """A run made while --adv-std existed (config.json "adv_std": false) is another run: a rerun
    with its successor (--adv-estimator dr_grpo) says which flags differ instead of mixing two
    configs in one directory."""
    import json

    import checkpoint

    old = json.loads((ROOT / "bench/results/modes_chain/constant-nostd-s0/config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    new = {k: v for k, v in old.items() if k != "adv_std"} | {"adv_estimator": "dr_grpo"}
    with pytest.raises(UserError, match="its config differs in adv_estimator, adv_std\\)") as e:
        checkpoint.claim_run_dir(tmp_path, new, N.VOLATILE, False, N.DEFAULTS)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, want", [
    ({}, "none"), ({"max_staleness": 2}, "behave"), ({"max_staleness": 1, "ppo_epochs": 2},
                                                     "truncate"),
    ({"max_staleness": 1, "num_minibatches": 4}, "truncate"),
    ({"max_staleness": 1, "correction": "none"}, "none"),  # a named one wins, none included
    ({"max_staleness": 1, "correction": "mask"}, "mask")])
def test_correction_auto_is_what_the_staleness_study_shows_holding(flags, want):
    cfg = N.Config(**flags)
    assert cfg.correction == want
    assert cfg.correction_threshold == L.CORRECTIONS[want].threshold


def test_a_run_older_than_a_flag_continues_while_the_flag_is_at_its_default(tmp_path):
    """config.json of a run made before --ppo-epochs/--top-p existed lacks them: at their defaults
    the rerun continues that run; a non-default value is another run, named in the refusal."""
    import json
    from dataclasses import asdict, replace

    import checkpoint

    cfg = N.Config()
    old = {k: v for k, v in asdict(cfg).items() if k not in ("ppo_epochs", "top_p")}
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    assert checkpoint.claim_run_dir(tmp_path, asdict(cfg), N.VOLATILE, False, N.DEFAULTS)
    with pytest.raises(UserError, match="its config differs in ppo_epochs"):
        checkpoint.claim_run_dir(tmp_path, asdict(replace(cfg, ppo_epochs=2)), N.VOLATILE,
                                 False, N.DEFAULTS)
