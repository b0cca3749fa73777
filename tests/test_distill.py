"""On-policy distillation (issue 45, --teacher): the teacher's per-token advantage
coef * (log pi_teacher - log pi_behave), added to the reward's group advantage or alone, through
the trainer's own step on real (tiny) models, against the objective written by hand; episodes'
environment tokens get no signal; the CLI runs with the shipped teacher and refuses one that
reads the token ids otherwise."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference import GradCapture, aggregate
from test_architectures import FAMILIES, build, samples
from test_corrections import plain_logprobs as completion_logprobs
from transformers import AutoModelForCausalLM

import loss as L
import modeling
import nanoareal as N
from rollout import Completion

ROOT = Path(__file__).resolve().parents[1]
COEF = 0.7


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A tiny student and a teacher of the same vocabulary (its weights perturbed)."""
    root = tmp_path_factory.mktemp("distill")
    student = build(root, "llama", FAMILIES["llama"])
    teacher = AutoModelForCausalLM.from_pretrained(student)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    teacher.save_pretrained(root / "teacher")
    return student, str(root / "teacher")


def scored_batch(seed: int) -> list:
    """samples() with rewards (groups of mixed ones) and behaviour log-probs."""
    batch, g = samples(seed), torch.Generator().manual_seed(seed)
    for i, s in enumerate(batch):
        s.reward = float((i * 7 + seed) % 3 == 0) + 0.1 * i
        n = len(s.completion.output_ids)
        lp = -torch.rand(n, generator=g) - 0.1
        s.completion = Completion(s.completion.output_ids, lp.tolist(), "stop")
    return batch


def plain_logprobs(path: str, batch: list, grad: bool = False):
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.set_grad_enabled(grad):
        return model, completion_logprobs(model, batch)


def reference(paths, batch, mode: str, estimator: str):
    """The objective's gradient from its formulas: A_it = A_i + c (log t_it - log b_it), A_i the
    group's (grpo: std-scaled; none: 0), the PPO token loss -A_it r_t at ratio 1."""
    student, teacher = paths
    _, scores = plain_logprobs(teacher, batch)
    model, logps = plain_logprobs(student, batch, grad=True)
    groups = {}
    for s in batch:
        groups.setdefault(s.group, []).append(s.reward)
    rows = []
    for s, t, logp in zip(batch, scores, logps):
        r = torch.tensor(groups[s.group], dtype=torch.float64)
        a = (s.reward - r.mean()) / (r.std() + 1e-6) if estimator == "grpo" else 0.0
        adv = float(a) + COEF * (t.detach() - torch.tensor(s.completion.logprobs))
        rows.append(-adv * torch.exp(logp - logp.detach()))
    width = max(len(r) for r in rows)
    pad = lambda xs: torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in xs])
    ones = [torch.ones(len(r)) for r in rows]
    objective = aggregate(pad(rows), pad(ones), mode=mode,
                          group_ids=torch.tensor([s.group for s in batch]), divisor=6.0)
    objective.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("estimator", ["grpo", "none"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "prompt_mean", "constant"])
def test_the_teachers_advantage_trains_exactly_as_its_formula_on_any_micro_batching(
        mode, estimator, paths, one_rank_group):
    student, teacher_path = paths
    batch = scored_batch(3)
    want = reference(paths, batch, mode, estimator)
    scale = torch.cat([g.flatten() for g in want.values()]).norm()
    for budget in (24, 4096):
        cfg = N.Config(model=student, teacher=teacher_path, distill_coef=COEF,
                       adv_estimator=estimator, micro_batch_tokens=budget, grad_clip=0,
                       loss_aggregation=mode,
                       loss_aggregation_divisor=6.0 if mode == "constant" else None)
        model = modeling.load_model(cfg, torch.device("cpu"))
        teacher = modeling.load_model(replace(cfg, model=teacher_path), torch.device("cpu"),
                                      trainable=False)
        mine = [replace(s) for s in batch]
        N.set_advantages(mine, cfg, N.Ranks(), teacher)
        capture = GradCapture(model)
        N.train_on_samples(model, None, capture, L.build_loss(cfg), mine, cfg, N.Ranks())
        got = capture.grads
        diff = torch.cat([(got[n] - want[n]).flatten() for n in got]).norm()
        assert diff <= 1e-5 * scale, f"budget {budget}: relative {diff / scale:.2e}"


def test_an_environments_tokens_get_no_distillation_signal(paths, one_rank_group):
    """An episode's env tokens (policy_mask 0) keep the reward's advantage alone."""
    student, teacher_path = paths
    batch = scored_batch(4)
    mask = [1, 0, 0, 1, 1, 0, 1, 1]
    for s in batch:
        c = s.completion
        s.completion = replace(c, policy_mask=mask[: len(c.output_ids)])
    cfg = N.Config(model=student, teacher=teacher_path, distill_coef=COEF)
    teacher = modeling.load_model(replace(cfg, model=teacher_path), torch.device("cpu"),
                                  trainable=False)
    N.set_advantages(batch, cfg, N.Ranks(), teacher)
    _, scores = plain_logprobs(teacher_path, batch)
    for s, t in zip(batch, scores):
        for j, (m, got) in enumerate(zip(s.completion.policy_mask, s.token_advantages)):
            extra = COEF * (t[j].item() - s.completion.logprobs[j]) if m else 0.0
            assert got == pytest.approx(s.advantage + extra, abs=1e-5)


def test_an_sglang_teacher_scores_at_temperature_one_only():
    with pytest.raises(N.UserError, match="temperature 1"):
        N.tasks.check_teacher("http://127.0.0.1:1", "m", None, 0.7)


def run_cli(*args, cwd):
    return subprocess.run([sys.executable, str(ROOT / "nanoareal.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def test_the_cli_distills_from_the_shipped_teacher_and_refuses_another_vocabulary(tmp_path):
    """The default task's teacher (assets/tiny-arith-teacher, ~90% held-out) alone
    (--adv-estimator none): the run logs its step; tiny-calc's tokenizer has other ids."""
    out = run_cli("--teacher", "assets/tiny-arith-teacher", "--adv-estimator", "none",
                  "--steps", "2", "--prompts-per-step", "8", "--eval-every", "0",
                  "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all(math.isfinite(x["grad_norm"])
                                                        for x in lines)
    bad = run_cli("--teacher", "assets/tiny-calc", "--steps", "1", "--run-dir",
                  str(tmp_path / "bad"), cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "tiny-calc: its tokenizer is not --model" in bad.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_the_shipped_teacher_is_the_student_trained_further():
    """assets/tiny-arith-teacher: the same builder and architecture, stopped at >= 90% held-out."""
    info = json.loads((ROOT / "assets" / "tiny-arith-teacher" / "build_info.json").read_text())
    student = json.loads((ROOT / "assets" / "tiny-arith" / "build_info.json").read_text())
    assert info["heldout_acc"] >= 0.9 and info["n_params"] == student["n_params"]
    assert info["sft_steps"] > student["sft_steps"] and info["args"]["seed"] == 0
    teacher = json.loads((ROOT / "assets" / "tiny-arith-teacher" / "config.json").read_text())
    config = json.loads((ROOT / "assets" / "tiny-arith" / "config.json").read_text())
    version = "transformers_version"  # of the build
    assert {**teacher, version: None} == {**config, version: None}


def test_an_sglang_teacher_scores_the_sampled_tokens_as_the_model_itself(tmp_path,
                                                                         one_rank_group):
    """rollout.Scorer against the stand-in server (SGLang's prefill-only /generate: max_new_tokens
    0, input_token_logprobs from logprob_start_len = the prompt's last token, temperature 1):
    the same per-token advantages as the teacher loaded in the trainer."""
    from sglang_standin import StandinSGLangServer, save_tiny_llama

    import rollout
    path = save_tiny_llama(tmp_path / "teacher")
    server = StandinSGLangServer(path).start()
    try:
        batch = scored_batch(5)
        for s in batch:  # the tiny llama's vocabulary: 18 ids
            s.prompt_ids = [3 + t % 15 for t in s.prompt_ids]
            c = s.completion
            s.completion = replace(c, output_ids=[3 + t % 15 for t in c.output_ids])
        cfg = N.Config(model=path, teacher=server.url, distill_coef=COEF)
        remote = [replace(s) for s in batch]
        N.set_advantages(remote, cfg, N.Ranks(), rollout.Scorer(server.url))
        local = [replace(s) for s in batch]
        teacher = modeling.load_model(replace(cfg, model=path), torch.device("cpu"),
                                      trainable=False)
        N.set_advantages(local, cfg, N.Ranks(), teacher)
        for a, b in zip(remote, local):
            assert a.token_advantages == pytest.approx(b.token_advantages, abs=1e-5)
        asked = [b for b in server.generate_bodies if "logprob_start_len" in b]
        assert len(asked) == len(batch)  # concurrent: in any order
        want = sorted((s.prompt_ids + s.completion.output_ids, len(s.prompt_ids) - 1)
                      for s in batch)
        assert sorted((b["input_ids"], b["logprob_start_len"]) for b in asked) == want
        assert all(b["sampling_params"]["max_new_tokens"] == 0 for b in asked)
    finally:
        server.stop()
