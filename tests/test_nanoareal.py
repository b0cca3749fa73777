"""The training loop: CLI end to end, reproducibility, world-size invariance, packing, advantages,
bad input."""

import json
import math
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm
from reference import whole

import loss
import modeling
import nanoareal as N
import packing
import tasks
from cli import UserError
from rollout import Completion, Sample

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "assets" / "tiny-arith")
# small but real: 8 prompts x 4 samples through the whole loop
FAST = ["--prompts-per-step", "8", "--group-size", "4", "--eval-every", "2"]
NOISE = ("time/", "gen_tokens_per_s", "train_tokens_per_s")  # wall-clock: differs between runs


def run_cli(args: list[str], nproc: int = 1, timeout: int = 240,
            **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env_extra)
    if nproc == 1:
        cmd = [sys.executable, str(ROOT / "nanoareal.py"), *args]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={port}", str(ROOT / "nanoareal.py"), *args]
    proc = warm.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_run_writes_metrics_console_wandb_and_a_loadable_export(tmp_path):
    proc = run_cli([*FAST, "--steps", "2", "--run-dir", str(tmp_path), "--wandb-project",
                    "nanoareal-test"],
                   WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    offline_runs = list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline_runs) == 1 and offline_runs[0].stat().st_size > 0
    tables = sorted(offline_runs[0].parent.glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 2  # the sampled completions of steps 1 and 2, as wandb tables
    table = json.loads(tables[0].read_text())
    assert {"prompt", "completion", "reward", "advantage"} <= set(table["columns"])
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert set(rows[0]) == {"step", "eval/accuracy"}
    for r in rows[1:]:
        for key in ("reward", "accuracy", "loss/policy", "response_len", "policy/clip_frac",
                    "zero_adv_frac", "truncated_frac", "grad_norm", "gen_tokens_per_s",
                    "train_tokens_per_s", "time/rollout", "time/train", "time/sync", "entropy",
                    "lr", "staleness", "policy_version", "importance_weight/mean",
                    "importance_weight/max", "logprob_mismatch"):
            assert key in r and math.isfinite(r[key]), key
        assert 0 <= r["reward"] <= 1 and r["response_len"] > 0 and r["grad_norm"] > 0
    assert "eval/accuracy" in rows[2]
    # the learning rate each step used: linear warm-up over 2 steps, lr (step + 1) / 3
    assert [r["lr"] for r in rows[1:]] == pytest.approx([1e-4 / 3, 2e-4 / 3])
    assert "step 2/2  reward" in proc.stdout and "final held-out eval/accuracy" in proc.stdout
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    base = AutoModelForCausalLM.from_pretrained(TINY)
    moved = [not torch.equal(a, b) for a, b in zip(exported.parameters(), base.parameters())]
    assert any(moved), "two optimizer steps must change the exported weights"


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(NOISE)} for r in rows]


def test_same_seed_gives_identical_metrics_and_another_seed_does_not(tmp_path):
    args = [*FAST, "--steps", "2", "--eval-every", "0"]
    run_cli([*args, "--run-dir", str(tmp_path / "a")])
    run_cli([*args, "--run-dir", str(tmp_path / "b")])
    run_cli([*args, "--run-dir", str(tmp_path / "c"), "--seed", "1", "--eval-every", "2"])
    a, b, c = (_comparable(read_metrics(tmp_path / x)) for x in "abc")
    assert a == b
    assert a[0] != c[1]
    # --seed changes the run, never the task: the held-out split stays the one the warm start was
    # measured on
    shipped = json.loads((Path(TINY) / "build_info.json").read_text())["heldout_acc"]
    assert c[0] == {"step": 0, "eval/accuracy": pytest.approx(shipped)}


def test_two_ranks_match_one_process_on_step_one_metrics_and_parameters(tmp_path):
    # 6 prompts over 2 ranks, token budget small enough for several (and uneven) micro-batches per
    # rank
    args = ["--prompts-per-step", "6", "--group-size", "4", "--eval-every", "0", "--steps", "1",
            "--micro-batch-tokens", "40", "--loss-aggregation", "prompt_mean"]
    run_cli([*args, "--run-dir", str(tmp_path / "one")])
    run_cli([*args, "--run-dir", str(tmp_path / "two")], nproc=2)
    one, two = read_metrics(tmp_path / "one")[0], read_metrics(tmp_path / "two")[0]
    for k, v in one.items():
        # positions fed depend on how groups fall into micro-batches (a split group feeds its
        # prompt once per part); the trainer/sampler log-prob gap is float noise that depends on
        # which prompts the engine batched together
        if not k.startswith((*NOISE, "train_positions", "logprob_mismatch")):
            assert two[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert max(one["logprob_mismatch"], two["logprob_mismatch"]) < 1e-5
    from safetensors.torch import load_file

    p1 = load_file(tmp_path / "one/final/model.safetensors")
    p2 = load_file(tmp_path / "two/final/model.safetensors")
    base = load_file(Path(TINY) / "model.safetensors")
    for name in p1:
        assert (p1[name] - p2[name]).norm() <= 1e-5 * p1[name].norm(), name
        # the update itself (~lr, far below fp32 resolution of the parameters at 1e-5) must agree
        # too, so that this test fails if one run did not step or stepped with another scale
        delta1, delta2 = p1[name] - base[name], p2[name] - base[name]
        assert delta1.norm() > 0
        assert (delta1 - delta2).norm() <= 1e-3 * delta1.norm(), name


# -----------------------------------------------------------------------------
# packing


def test_packed_forward_equals_per_sequence_forward():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    seqs = [torch.randint(3, 15, (n,)) for n in (5, 9, 3, 7)]
    packed = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        out = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0]
        ref = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _sample(group: int, prompt: list[int], out: list[int], reason="stop", adv=0.5) -> Sample:
    return Sample(group, prompt, Completion(out, [-0.1 * (i + 1) for i in range(len(out))],
                                            reason),
                  advantage=adv)


def test_pack_microbatches_aligns_targets_masks_and_respects_the_token_budget(monkeypatch):
    # shared prompts: tests/test_attention.py
    monkeypatch.setattr(N, "SHARE_PROMPTS", False)
    cfg = N.Config(micro_batch_tokens=10)
    samples = [_sample(0, [5, 6, 7], [8, 9]), _sample(0, [5, 6, 7], [10]),
               _sample(1, [4, 4], [3, 3, 3, 1])]
    mbs = N.pack_microbatches(samples, cfg)
    # a sequence's last token is never an input (it predicts nothing): 4 + 3 positions, then 5
    assert [mb.input_ids.numel() for mb in mbs] == [7, 5]
    mb = mbs[0]
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 5, 6, 7]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    # position j predicts token j+1 of the same sequence
    assert mb.targets.tolist() == [6, 7, 8, 9, 6, 7, 10]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert mb.behave_logprobs[2:4].tolist() == pytest.approx([-0.1, -0.2])
    assert mb.seq_ids.tolist() == [-1, -1, 0, 0, -1, -1, 1]
    assert mb.segments.tolist() == [[0, 4, 0, 0], [4, 3, 0, 0]]


def _fed(spans, starts):
    """Positions each micro-batch feeds: a prompt's prefix once, then every sample's tail."""
    out = []
    for a, b in zip(starts, starts[1:] + [len(spans)]):
        out.append(sum(r if k in {k2 for k2, _, _ in spans[a:i]} else p + r - 1
                       for i, (k, p, r) in enumerate(spans[a:b], a)))
    return out


def test_micro_batches_are_as_even_as_in_order_cuts_allow_and_no_more_of_them():
    # 4 groups x 4 answers of 512 after 64-token prompts: greedy cuts at 4096 make 3710/3773/1087
    samples = [_sample(g, [1 + g] * 64, [7] * 512) for g in range(4) for _ in range(4)]
    mbs = N.pack_microbatches(samples, N.Config(micro_batch_tokens=4096))
    assert [mb.input_ids.numel() for mb in mbs] == [3198, 3198, 2111]
    assert sum(mb.loss_mask.sum().item() for mb in mbs) == 16 * 512
    rng = random.Random(0)
    for _ in range(300):  # random lengths against a plain greedy fill at the budget
        spans = [(rng.randrange(4), rng.randint(1, 30), rng.randint(1, 30))
                 for _ in range(rng.randint(1, 30))]
        budget = rng.randint(20, 120)
        greedy = [0]
        for i in range(1, len(spans)):
            if _fed(spans[greedy[-1] : i + 1], [0])[0] > budget:  # sample i overflows: cut
                greedy.append(i)
        even = packing.cuts(spans, budget)
        assert even[0] == 0 and len(even) <= len(greedy)
        assert max(_fed(spans, even)) <= max(_fed(spans, greedy))


def test_mask_truncated_removes_truncated_responses_from_numerator_and_denominator():
    cfg = N.Config(mask_truncated=True, loss_aggregation="seq_mean")
    samples = [_sample(0, [5, 6], [8, 9], "length"), _sample(0, [5, 6], [10, 1])]
    mb = N.pack_microbatches(samples, cfg)[0]  # shared prefix [5], tails [6 8] and [6 10]
    assert mb.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert mb.denom_mask.tolist() == mb.loss_mask.tolist()
    assert mb.norm_weight[3].item() == pytest.approx(0.5)


# -----------------------------------------------------------------------------
# advantages


def naive_advantages(rewards, groups, estimator, std_source, eps):
    """GRPO: (r - mean) / (std + eps), the group's std or the whole batch's, or r - mean without
    std (Dr. GRPO); RLOO: r minus the mean of the others, never divided (Ahmadian et al. 2024)."""
    out, mean_all = [], sum(rewards) / len(rewards)
    batch_std = math.sqrt(sum((r - mean_all) ** 2 for r in rewards) / (len(rewards) - 1))
    for r, g in zip(rewards, groups):
        peers = [rr for rr, gg in zip(rewards, groups) if gg == g]
        if len(peers) == 1:
            out.append(0.0)
            continue
        mean = sum(peers) / len(peers)
        std = batch_std if std_source == "batch" else \
            math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1))
        base = (sum(peers) - r) / (len(peers) - 1) if estimator == "rloo" else mean
        out.append((r - base) / (std + eps) if std_source != "none" and estimator == "grpo"
                   else r - base)
    return out


# --adv-estimator -> the naive loop's (estimator, std source); RLOO never divides by a std
ESTIMATORS = {"grpo": ("grpo", "group"), "grpo_batch_std": ("grpo", "batch"),
              "dr_grpo": ("grpo", "none"), "rloo": ("rloo", "none")}


@pytest.mark.parametrize("name", ESTIMATORS)
def test_group_advantages_match_a_naive_loop_for_ragged_interleaved_groups(name):
    estimator, std = ESTIMATORS[name]
    g = torch.Generator().manual_seed(0)
    groups = [3, 3, 7, 1, 3, 7, 9, 1, 1, 7, 7]  # sizes 3, 4, 3 and a group of one, interleaved
    rewards = torch.rand(len(groups), generator=g).round(decimals=1).tolist()
    assert loss.ADV_EPS == 1e-6
    got = loss.group_advantages(torch.tensor(rewards), torch.tensor(groups), name, 1)
    want = naive_advantages(rewards, groups, estimator, std, 1e-6)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_group_advantage_edge_cases():
    # a group of one gets 0, an all-equal group gets 0 (not NaN); rewards (1, 0): mean 0.5, unbiased
    # std sqrt(0.5)
    adv = loss.group_advantages(torch.tensor([1.0, 0.5, 0.5, 1.0, 0.0]),
                                torch.tensor([0, 1, 1, 2, 2]), "grpo", 1)
    assert adv[0] == 0 and adv[1] == 0 and adv[2] == 0
    assert adv[3] == pytest.approx(0.5 / math.sqrt(0.5),
                                   rel=1e-5) and adv[4] == pytest.approx(-adv[3])
    empty = loss.group_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long), "grpo", 1)
    assert torch.isfinite(empty).all()


def test_zero_variance_groups_are_detected_per_sample():
    samples = [Sample(g, [1], None, reward=r) for g, r in
               zip([0, 0, 1, 1, 2, 2], [1.0, 1.0, 0.0, 1.0, 0.0, 0.0])]
    N.set_advantages(samples, N.Config(), N.Ranks(), None)
    assert [s.zero_variance for s in samples] == [True, True, False, False, True, True]
    assert [s.advantage for s in samples][:2] == [0.0, 0.0]


# -----------------------------------------------------------------------------
# data, rewards, config errors


def test_prompts_for_step_is_a_function_of_seed_and_step_and_walks_through_epochs():
    steps = [N.prompts_for_step(10, 4, s, seed=0) for s in range(6)]
    assert steps == [N.prompts_for_step(10, 4, s, seed=0) for s in range(6)]
    for epoch in range(3):  # 2 steps of 4 rows per epoch: 8 distinct rows, 2 sit out
        rows = steps[2 * epoch] + steps[2 * epoch + 1]
        assert len(set(rows)) == 8 and set(rows) <= set(range(10))
    assert steps[0] != N.prompts_for_step(10, 4, 0, seed=1)


def test_a_step_never_holds_a_prompt_twice_across_an_epoch_boundary():
    """The default task: 2244 rows, 64 per step; before the fix, step 35 (the epoch boundary)
    held row 2031 twice, as one group with every completion doubled."""
    for step in range(80):
        rows = N.prompts_for_step(2244, 64, step, seed=0)
        assert len(rows) == 64 and len(set(rows)) == 64, step


class SeedRecorder:
    """A rollout engine that records the seeds it is asked to sample with."""

    version = 0

    def generate(self, prompts, sampling, seeds):
        self.seeds = list(seeds)
        return [Completion([2], [-1.0], "length") for _ in seeds]


def test_groups_are_the_step_slots_and_seeds_differ_even_for_a_row_drawn_twice():
    rows = N.prompts_for_step(3, 8, step=0, seed=0)  # more slots than rows: rows repeat
    assert len(rows) == 8 and len(set(rows)) == 3
    cfg = N.Config(group_size=4, max_new_tokens=1)
    engine = SeedRecorder()
    data = tasks.Data(None, [{}, {}, {}], [[5], [6], [7]], [], stop_ids=[1])
    samples = N.generate(engine, data, list(enumerate(rows)), 0, cfg)
    assert [s.group for s in samples] == [g for g in range(8) for _ in range(4)]
    assert [s.row for s in samples] == [r for r in rows for _ in range(4)]
    assert len(set(engine.seeds)) == 32  # two copies of a row are sampled independently


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"answer": "1"}', 'exactly one of "prompt"'),
    ('{"prompt": "x", "messages": [], "answer": "1"}', 'exactly one of "prompt"'),
    ('{"messages": [{"role": "user"}], "answer": "1"}', '"role" and "content"'),
    ('{"messages": [], "answer": "1"}', '"messages" is empty'),
    ('{"prompt": "2+2=", "answer": [1]}', '"answer" must be a string or a number'),
])
def test_malformed_jsonl_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n' + line + "\n")
    with pytest.raises(UserError, match=rf"data.jsonl:2: .*{message}"):
        tasks.load_jsonl(str(path), "prompt", "")


def test_jsonl_prompts_and_messages_load():
    rows = [{"prompt": "1+1=", "answer": 2}, {"messages": [{"role": "user", "content": "hi"}],
                                              "answer": "x"}]
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    rows = tasks.load_jsonl(f.name, "prompt", "")
    # rows kept whole
    assert rows[0] == {"prompt": "1+1=", "answer": 2} and rows[1]["messages"][0]["content"] == "hi"


def test_gsm8k_reward_extracts_the_final_number():
    gsm8k = lambda text, answer: tasks.gsm8k(text, {"answer": answer})[0]
    assert gsm8k("so 3 + 4 = 7. The answer is 1,234.", "#### 1234") == 1.0
    assert gsm8k("#### 42 and later 7", "42") == 1.0
    assert gsm8k("the answer is 41", "#### 42") == 0.0
    assert gsm8k("no number", "42") == 0.0
    assert gsm8k("-3.50", "-3.5") == 1.0
    assert tasks.exact_match(" 46 ", {"answer": 46}) == 1.0
    assert tasks.exact_match("460", {"answer": "46"}) == 0.0


@pytest.mark.parametrize("args, message", [
    (["--loss-aggregation", "constant", "--loss-aggregation-divisor", "-1"],
     "--loss-aggregation-divisor"),
    (["--group-size", "1"], "--group-size 1"),
    (["--num-minibatches", "0"], "--num-minibatches"),
    (["--rollout-url", "http://127.0.0.1:1"], "--rollout-backend sglang"),
    (["--grad-clip", "-1"], "--grad-clip -1.0: must be >= 0"),
    (["--temperature", "0"], "--temperature 0.0: rollouts must sample"),
    (["--kl-coef", "-1"], "--kl-coef must be >= 0"),
])
def test_contradictory_options_fail_in_one_line_naming_the_flags(args, message):
    with pytest.raises(UserError, match=message):
        N.parse_config(args)


def test_config_file_supplies_defaults_and_flags_override(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('lr = 0.5\nloss-aggregation = "seq_mean"\n')
    cfg = N.parse_config(["--config", str(path), "--lr", "0.25"])
    assert cfg.lr == 0.25 and cfg.loss_aggregation == "seq_mean"
    path.write_text("not_a_flag = 1\n")
    with pytest.raises(UserError, match="unknown key 'not_a_flag'"):
        N.parse_config(["--config", str(path)])


# -----------------------------------------------------------------------------
# precision and clipping


def _one_step(cfg: N.Config, optimizer_cls=torch.optim.SGD, lr: float = 1.0) -> list[torch.Tensor]:
    """Parameter change of one train_on_samples step on a fixed batch (SGD, lr 1: -gradient)."""
    import loss as L

    model = modeling.load_model(cfg, torch.device("cpu"))
    before = [whole(p.detach()).clone() for p in model.module.parameters()]
    optimizer = optimizer_cls(model.module.parameters(), lr=lr)
    samples = [_sample(g, [4 + g, 13, 5], [6 + g, 1], adv=(-1) ** g) for g in range(4)]
    N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg, N.Ranks())
    return [whole(p.detach()) - b for p, b in zip(model.module.parameters(), before)]


def test_grad_clip_zero_turns_clipping_off(one_rank_group):
    """--grad-clip 0 used to scale every gradient by 0 (and a negative value flipped it)."""
    off = _one_step(N.Config(grad_clip=0.0, model=TINY))
    huge = _one_step(N.Config(grad_clip=1e9, model=TINY))
    assert sum(float(d.abs().sum()) for d in off) > 0
    for a, b in zip(off, huge):
        torch.testing.assert_close(a, b)


def test_bf16_compute_keeps_fp32_master_weights_so_small_updates_land(one_rank_group):
    """--dtype bfloat16 used to keep the weights and AdamW's state in bf16: at lr 1e-6 an update is
    far below bf16's resolution and almost no parameter moved."""
    cfg = N.Config(dtype="bfloat16", model=TINY, warmup_steps=0)
    deltas = _one_step(cfg, torch.optim.AdamW, lr=1e-6)
    moved = sum(int((d != 0).sum()) for d in deltas) / sum(d.numel() for d in deltas)
    assert moved > 0.5, f"only {moved:.1%} of the parameters moved"


def test_adamw_state_is_made_at_load_and_steps_as_torchs_lazy_one_even_after_a_save(
        one_rank_group):
    """modeling.adamw makes AdamW's state before any activation, as the first step would: two steps
    equal torch's lazily initialised fused AdamW's to the bit. A checkpoint before the first step
    (get_state_dict) found no state and made it by a zero step (step 1): every later bias
    correction moved."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    mine, lazy = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    lazy.load_state_dict(mine.state_dict())
    ours = modeling.adamw(list(mine.parameters()), lr=0.1, betas=N.ADAM_BETAS)
    torchs = torch.optim.AdamW(lazy.parameters(), lr=0.1, betas=N.ADAM_BETAS, fused=True)
    assert [float(s["step"]) for s in ours.state.values()] == [0.0, 0.0]
    get_state_dict(mine, ours)  # a save before the first step
    for k in range(2):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(k))
        for model, optimizer in ((mine, ours), (lazy, torchs)):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(mine.parameters(), lazy.parameters()))
    assert [float(s["step"]) for s in ours.state.values()] == [2.0, 2.0]


def test_a_step_with_nothing_to_learn_from_moves_neither_the_weights_nor_adamw(one_rank_group):
    """Every response masked (--mask-truncated, all cut) gives a global normalizer of 0: AdamW must
    not step, or its momentum from the step before and its bias correction move every weight."""
    import loss as L

    cfg = N.Config(model=TINY, warmup_steps=0, mask_truncated=True)
    model, _, _, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks())
    reduction = L.build_loss(cfg)
    ok = [_sample(g, [4 + g, 13, 5], [6 + g, 1], adv=(-1) ** g) for g in range(4)]
    _, stats = N.train_on_samples(model, None, optimizer, reduction, ok, cfg, N.Ranks())
    assert stats["updated"] == 1
    before = [whole(p.detach()).clone() for p in model.module.parameters()]
    steps = [float(s["step"]) for s in optimizer.state.values()]
    cut = [_sample(g, [4 + g, 13, 5], [6 + g, 7], "length", adv=(-1) ** g) for g in range(4)]
    for samples in (cut, []):  # all masked; or every group filtered away
        _, stats = N.train_on_samples(model, None, optimizer, reduction, samples, cfg,
                                      N.Ranks())
        assert stats["updated"] == 0 and stats["grad_norm"] == 0
    assert all(torch.equal(b, whole(p.detach())) for b, p in zip(before,
                                                                 model.module.parameters()))
    assert [float(s["step"]) for s in optimizer.state.values()] == steps


def test_num_minibatches_steps_once_per_share_and_logs_the_mean_grad_norm(one_rank_group,
                                                                          monkeypatch):
    """--num-minibatches 2: two AdamW steps on the step's batch, each on half of its groups; the
    logged grad_norm is the mean over those steps (it used to be the last one's)."""
    import loss as L

    cfg = N.Config(model=TINY, warmup_steps=0, num_minibatches=2)
    model, _, _, optimizer = N.load_models(cfg, torch.device("cpu"), N.Ranks())
    norms, clip = [], torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda *a, **k: norms.append(float(n := clip(*a, **k))) or n)
    samples = [_sample(g, [4 + g, 13, 5], [6 + g, 1], adv=(-1) ** g) for g in range(4)]
    _, stats = N.train_on_samples(model, None, optimizer, L.build_loss(cfg), samples, cfg,
                                  N.Ranks())
    assert len(norms) == 2 and norms[0] != norms[1]
    assert stats["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-12)
    assert {float(s["step"]) for s in optimizer.state.values()} == {2.0}
