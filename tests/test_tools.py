"""Multi-turn tool use (--env): episodes made of the policy's own sampled tokens and an
environment's text, on every engine (hf; SGLang in-process through a fake `sglang` module, remote
through the stand-in server); failures counted, never fatal; the README's example through the CLI.
The loss side (the policy's tokens only, every mode, 1 and 2 ranks) is in test_loss_fsdp.py."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import warm
from sglang_standin import StandinSGLangServer, save_tiny_llama
from test_rollout_sglang import install_fake_sglang

import rollout
import tasks
from cli import UserError
from rollout import Completion, HFEngine, RemoteSGLangEngine, SamplingParams, Tools, mix_seed

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
EQ, EOS = 14, 1  # "=" and "<eos>" in the stand-in's character vocabulary
PROMPTS = [[3 + i % 10, 13, 3 + (i * 7) % 10] for i in range(4)]  # "a+b", 4 groups x 4 samples
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=[EOS])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


class Echo:
    """Replies "12" to every tool call; the episode is over after its third."""
    stop = ["="]
    made: list = []

    def __init__(self, row: dict):
        self.row, self.turns = row, []
        Echo.made.append(self)

    def step(self, turn: str) -> str | None:
        self.turns.append(turn)
        return "12" if len(self.turns) < 3 else None


def tools_for(tokenizer, make=Echo, max_turns: int = 4) -> Tools:
    return Tools(make, [EQ], lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                 tokenizer.decode, max_turns)


def batch(n_samples: int = 4):
    prompts = [p for p in PROMPTS for _ in range(n_samples)]
    seeds = [mix_seed(0, 5, g, k) >> 1 for g in range(len(PROMPTS)) for k in range(n_samples)]
    rows = [{"prompt": str(p)} for p in prompts]
    return prompts, seeds, rows


def turns_of(c: Completion) -> list[tuple[int, int, int]]:
    """(who, start, stop) of each run of the policy_mask."""
    runs, start = [], 0
    for j in range(1, len(c.output_ids) + 1):
        if j == len(c.output_ids) or c.policy_mask[j] != c.policy_mask[start]:
            runs.append((c.policy_mask[start], start, j))
            start = j
    return runs


def test_each_policy_turn_is_what_the_engine_samples_from_exactly_the_ids_so_far(model_dir,
                                                                                 tokenizer):
    """Token-exact episodes: every policy turn equals a fresh generate call on prompt + the
    episode's ids so far, seeded (seed, turn); environment spans are the reply's ids, masked, with
    no behaviour log-prob; a turn ends at the end of sequence or at the tool stop."""
    engine, tools = HFEngine(model_dir), tools_for(tokenizer)
    prompts, seeds, rows = batch()
    episodes = rollout.run_episodes(engine, prompts, SAMPLING, seeds, tools, rows)
    stops = replace(SAMPLING, stop_token_ids=[EOS, EQ])
    reply = tokenizer("12", add_special_tokens=False)["input_ids"]
    longest = 0
    for prompt, seed, e in zip(prompts, seeds, episodes):
        assert len(e.output_ids) == len(e.logprobs) == len(e.policy_mask) <= 24
        policy = [(start, stop) for who, start, stop in turns_of(e) if who]
        assert e.episode["env/turns"] == len(policy)
        longest = max(longest, len(policy))
        for j, (start, stop) in enumerate(policy):
            fresh = engine.generate([prompt + e.output_ids[:start]], replace(
                stops, max_new_tokens=24 - start), [mix_seed(seed, j) >> 1 if j else seed])[0]
            assert fresh.output_ids[: stop - start] == e.output_ids[start:stop]
            assert fresh.logprobs[: stop - start] == pytest.approx(e.logprobs[start:stop],
                                                                   abs=1e-5)
            if stop < len(e.output_ids):  # a turn followed by the environment's reply
                assert e.output_ids[stop - 1] == EQ
                assert e.output_ids[stop : stop + len(reply)] == reply
                assert e.policy_mask[stop : stop + len(reply)] == [0] * len(reply)
                assert e.logprobs[stop : stop + len(reply)] == [0.0] * len(reply)
        # a tool call ends it when the env says so (its third), else no room was left for a reply
        ends = {EOS: "stop", EQ: "stop" if e.episode["env/tool_calls"] == 3 else "length"}
        assert e.finish_reason == ends.get(e.output_ids[-1], "length")
    assert longest >= 2, "some episode must call the tool and go on"
    assert any(e.output_ids[-1] == EOS and e.episode["env/tool_calls"] for e in episodes)
    # one episode alone is the same episode: the noise is keyed by (seed, turn), not the batch
    alone = rollout.run_episodes(engine, prompts[5:6], SAMPLING, seeds[5:6], tools, rows[5:6])[0]
    same = lambda c: (c.output_ids, c.policy_mask, c.finish_reason)
    assert same(alone) == same(episodes[5]) and alone.logprobs == pytest.approx(
        episodes[5].logprobs, abs=1e-5)


class Script:
    """An engine that answers every request with `turn` (cut to the budget) and records calls."""
    version = 0

    def __init__(self, turn: list[int]):
        self.turn, self.calls = turn, []

    def generate(self, prompts, sampling, seeds, groups=None, max_new_tokens=None):
        self.calls.append((prompts, sampling, seeds, groups))
        out = []
        for n in max_new_tokens or [sampling.max_new_tokens] * len(prompts):  # each its own
            ids = self.turn[:n]
            stop = ids[-1:] != [] and ids[-1] in sampling.stop_token_ids
            out.append(Completion(ids, [-0.5] * len(ids), "stop" if stop else "length"))
        return out


@pytest.mark.parametrize("max_turns, budget, reason, calls", [
    (2, 24, "length", 1),  # a tool call past the env's max_turns
    (4, 6, "length", 2),  # turn, reply, turn (6 tokens): the second reply leaves no room
    (4, 5, "length", 1),  # turn, reply, then a turn cut by the token budget
    (4, 24, "stop", 3),  # the env ends the episode at its third call
])
def test_max_turns_and_the_token_budget_end_an_episode_with_length(tokenizer, max_turns, budget,
                                                                   reason, calls):
    engine = Script([5, EQ])
    Echo.made.clear()
    e = rollout.run_episodes(engine, [[3, 13]], replace(SAMPLING, max_new_tokens=budget), [7],
                             tools_for(tokenizer, max_turns=max_turns), [{"prompt": "x"}])[0]
    assert (e.finish_reason, e.episode["env/tool_calls"]) == (reason, calls)
    assert len(e.output_ids) <= budget
    seeds = [c[2][0] for c in engine.calls]
    assert seeds == [7] + [mix_seed(7, j) >> 1 for j in range(1, len(engine.calls))]
    assert {c[3][0] for c in engine.calls} == {(3, 13)}  # the group's key: its prompt
    assert engine.calls[-1][0][0] == [3, 13] + e.output_ids[: len(engine.calls[-1][0][0]) - 2]
    assert len(Echo.made) == 1 and Echo.made[0].turns[0] == "2="  # one env per episode, its row


class Raises(Echo):
    def step(self, turn):
        raise ValueError("bad expression")


class Hangs(Echo):
    def step(self, turn):
        time.sleep(5)


class Junk(Echo):
    def step(self, turn):
        return 42


class BadInit(Echo):
    def __init__(self, row):
        raise KeyError("answer")


@pytest.mark.parametrize("make, error", [(Raises, "ValueError: bad expression"),
                                         (Hangs, "a call took over 0.2s"),
                                         (Junk, "step returned a int, not a str or None"),
                                         (BadInit, "KeyError: 'answer'")])
def test_an_env_that_raises_hangs_or_replies_junk_ends_its_episode_counted_and_said_once(
        tokenizer, monkeypatch, capsys, make, error):
    monkeypatch.setattr(rollout, "ENV_TIMEOUT_S", 0.2)
    monkeypatch.setattr(rollout, "_ENV_FAILED", False)
    episodes = rollout.run_episodes(Script([5, EQ]), [[3, 13]] * 3, SAMPLING, [1, 2, 3],
                                    tools_for(tokenizer, make), [{}] * 3)
    for e in episodes:  # ended as they stand: scored by the reward on the text so far
        assert (e.output_ids, e.policy_mask, e.finish_reason) == ([5, EQ], [1, 1], "stop")
        assert e.episode["env/errors"] == e.episode["env/tool_calls"] == 1
    out = capsys.readouterr().out
    assert out.count("an --env step failed") == 1 and error in out


ENV_METHODS = "    def __init__(self, row): pass\n    def step(self, turn): return None\n"


def test_env_plugin_errors_are_one_line(tmp_path, tokenizer):
    path = tmp_path / "envs.py"
    path.write_text(f"class NoStop:\n    pass\n\nclass Long:\n    stop = ['==']\n\n"
                    f"class Good:\n    stop = ['=', 1]\n{ENV_METHODS}\n"
                    f"class Far:\n    stop = ['=', 18]\n{ENV_METHODS}\n"  # 18 ids: 0..17
                    f"class Negative:\n    stop = [-1]\n{ENV_METHODS}")
    for name, message in (("NoStop", "its .stop must list"), ("Long", "its .stop must list"),
                          ("Missing", "has no function 'Missing'"),
                          ("Far", "stop token id 18 is outside the tokenizer's vocabulary of 18 "
                           "ids"),
                          ("Negative", "stop token id -1 is outside the tokenizer's vocabulary")):
        with pytest.raises(UserError, match=re.escape(message)):
            tasks.load_env(f"{path}:{name}", tokenizer, False)
    assert tasks.load_env(f"{path}:Good", tokenizer, False).stop_ids == [EQ, EOS]


MISFITS = """
class NoInit:  # object's __init__: NoInit(row) raises
    stop = ["="]
    def step(self, turn): return None

class TakesTokenizer:
    stop = ["="]
    def __init__(self, row, tokenizer): pass
    def step(self, turn): return None

class KeywordOnly:
    stop = ["="]
    def __init__(self, row, *, tools): pass
    def step(self, turn): return None

class NoStep:
    stop = ["="]
    def __init__(self, row): pass

class StepNotCallable:
    stop = ["="]
    step = "calculate"
    def __init__(self, row): pass

class StepWithoutText:
    stop = ["="]
    def __init__(self, row): pass
    def step(self): return None

class StepTakesState:
    stop = ["="]
    def __init__(self, row): pass
    def step(self, turn, state): return None

class StaticStepWithSelf:
    stop = ["="]
    def __init__(self, row): pass
    @staticmethod
    def step(self, turn): return None

def factory(row, tokenizer): return None
factory.stop = ["="]
"""
FITS = """
import dataclasses

class Defaults:  # extra arguments with defaults, *args and **kwargs are fine
    stop = ["="]
    def __init__(self, row, tools=None, *rest, **options): pass
    def step(self, turn, verbose=False): return None

class Variadic:
    stop = ["="]
    def __init__(self, *args): pass
    def step(self, *args): return None

class Static:
    stop = ["="]
    def __init__(self, row): pass
    @staticmethod
    def step(turn): return None

class ClassMethod:
    stop = ["="]
    def __init__(self, row): pass
    @classmethod
    def step(cls, turn): return None

class Property:  # what the property returns is the instance's to say
    stop = ["="]
    def __init__(self, row): pass
    @property
    def step(self): return lambda turn: None

class New:
    stop = ["="]
    def __new__(cls, row): return super().__new__(cls)
    def step(self, turn): return None

@dataclasses.dataclass
class Data:
    row: dict
    stop = ["="]
    def step(self, turn): return None

class Inherited(Data):
    pass

class Made:
    def step(self, turn): return None

def factory(row): return Made()
factory.stop = ["="]
"""


STEP_RETURNS = "(the text to append, or None: the episode ends)"


@pytest.mark.parametrize("name, message", [
    ("NoInit", "NoInit(row) must take the dataset row as its one argument: it has no __init__"),
    ("TakesTokenizer",
     "TakesTokenizer(row) must take the dataset row as its one argument, not (row, tokenizer)"),
    ("KeywordOnly", "KeywordOnly(row) must take the dataset row as its one argument, not "
     "(row, *, tools)"),
    ("NoStep", f"NoStep has no method step(text) {STEP_RETURNS}"),
    ("StepNotCallable", f"StepNotCallable has no method step(text) {STEP_RETURNS}"),
    ("StepWithoutText", "StepWithoutText(row).step(text) must take the turn's text as its one "
     "argument, not (self)"),
    ("StepTakesState", "StepTakesState(row).step(text) must take the turn's text as its one "
     "argument, not (self, turn, state)"),
    ("StaticStepWithSelf", "StaticStepWithSelf(row).step(text) must take the turn's text as its "
     "one argument, not (self, turn)"),
    ("factory", "factory(row) must take the dataset row as its one argument, not (row, tokenizer)"),
])
def test_an_env_that_does_not_fit_the_interface_is_refused_when_loaded(tmp_path, tokenizer, name,
                                                                       message):
    (tmp_path / "misfits.py").write_text(MISFITS)
    spec = f"{tmp_path / 'misfits.py'}:{name}"
    with pytest.raises(UserError) as e:
        tasks.load_env(spec, tokenizer, False)
    assert str(e.value) == f"--env {spec}: {message}"


@pytest.mark.parametrize("name", ["Defaults", "Variadic", "Static", "ClassMethod", "Property",
                                  "New", "Data", "Inherited", "factory"])
def test_an_env_that_fits_the_interface_loads_and_runs_an_episode(tmp_path, tokenizer, name):
    (tmp_path / "fits.py").write_text(FITS)
    tools = tasks.load_env(f"{tmp_path / 'fits.py'}:{name}", tokenizer, False)
    counts = dict.fromkeys(("env/seconds", "env/tool_calls", "env/errors"), 0)
    env, reply = rollout.env_step(tools, None, {"prompt": "1+2"}, "3=", counts)
    assert env is not None and reply is None and counts["env/errors"] == 0  # made, stepped


TOOL_TEMPLATE = (  # a tool turn after the assistant's, the turns before unchanged (as Qwen2.5's)
    "{% for m in messages %}{% if m.role == 'tool' %}-{{ m.content }}-{% else %}{{ m.content }} "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}*{% endif %}")
NO_TOOL_TEMPLATE = TOOL_TEMPLATE.replace("-{{ m.content }}-", "")  # a tool message vanishes
REWRITES_TEMPLATE = TOOL_TEMPLATE.replace("{% else %}", (  # an earlier turn cut (as Qwen3's think)
    "{% elif m.role == 'assistant' and not loop.last %}{{ m.content[:2] }} {% else %}"))


def test_a_reply_is_the_templates_tool_turn_where_it_extends_the_turns_before(model_dir, tmp_path,
                                                                              capsys):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)  # its own copy: the template is set here
    (tmp_path / "e.py").write_text(f"class E:\n    stop = ['=']\n{ENV_METHODS}")
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    tok.chat_template = TOOL_TEMPLATE
    assert tasks.tool_turn(tok) == (" -", "-*")
    assert tasks.load_env(f"{tmp_path / 'e.py'}:E", tok, True).encode("5") == encode(" -5-*")
    assert "replies as the chat template's tool turn" in capsys.readouterr().out
    for template in (NO_TOOL_TEMPLATE, REWRITES_TEMPLATE):  # raw text, said at start-up
        tok.chat_template = template
        assert tasks.tool_turn(tok) is None
        assert tasks.load_env(f"{tmp_path / 'e.py'}:E", tok, True).encode("5") == encode("5")
        assert "raw text (the template has no tool turn" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# SGLang: token ids in and out, a group's episodes on one server


def test_remote_episodes_equal_the_hf_engines_and_keep_a_group_on_one_server(model_dir,
                                                                             tokenizer, tmp_path):
    servers = [StandinSGLangServer(model_dir).start() for _ in range(2)]
    try:
        remote = RemoteSGLangEngine([s.url for s in servers], model_dir, str(tmp_path))
        prompts, seeds, rows = batch()
        got = rollout.run_episodes(remote, prompts, SAMPLING, seeds, tools_for(tokenizer), rows)
        want = rollout.run_episodes(HFEngine(model_dir), prompts, SAMPLING, seeds,
                                    tools_for(tokenizer), rows)
        assert [(c.output_ids, c.policy_mask) for c in got] == \
            [(c.output_ids, c.policy_mask) for c in want]
        for g, w in zip(got, want):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
        seen = [{tuple(b["input_ids"][:3]) for b in s.generate_bodies} for s in servers]
        assert not seen[0] & seen[1] and seen[0] | seen[1] == {tuple(p) for p in PROMPTS}
        for s in servers:  # a later turn finds its episode so far, but the reply, cached there
            later = [(len(b["input_ids"]), s.cached[b["rid"]]) for b in s.generate_bodies
                     if len(b["input_ids"]) > 3]
            assert later and all(n == length - len("12") for length, n in later)
    finally:
        for s in servers:
            s.stop()


def test_in_process_sglang_runs_episodes_with_token_ids_in_and_out(monkeypatch, model_dir,
                                                                   tokenizer):
    install_fake_sglang(monkeypatch, new=True)
    hf = HFEngine(model_dir)

    def generate(self, input_ids, sampling_params, return_logprob):  # the fake, backed by hf
        outs = [hf.generate([ids], SamplingParams(
            sp["max_new_tokens"], sp["temperature"], stop_token_ids=sp["stop_token_ids"]),
            [sp["sampling_seed"]])[0] for ids, sp in zip(input_ids, sampling_params)]
        return [{"output_ids": c.output_ids, "meta_info": {"finish_reason": {
                 "type": c.finish_reason},
                 "output_token_logprobs": [(lp, t, None) for lp, t in zip(c.logprobs,
                                                                          c.output_ids)]}}
                for c in outs]
    monkeypatch.setattr(sys.modules["sglang"].Engine, "generate", generate)
    engine = rollout.SGLangEngine(model_dir, device="cpu", deterministic=True)
    engine.update_weights(hf.model, 0)  # it starts holding none (nanoareal.resume pushes them)
    prompts, seeds, rows = batch(2)
    got = rollout.run_episodes(engine, prompts, SAMPLING, seeds, tools_for(tokenizer), rows)
    want = rollout.run_episodes(hf, prompts, SAMPLING, seeds, tools_for(tokenizer), rows)
    assert [(c.output_ids, c.policy_mask) for c in got] == \
        [(c.output_ids, c.policy_mask) for c in want]


# -----------------------------------------------------------------------------
# the README's example, through the CLI

def env_example() -> str:
    block = (ROOT / "README.md").read_text().split("<!-- env-example -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


def example_args(tmp_path: Path, model_dir: str) -> list[str]:
    """The README's calculator on sums "a+b" through the CLI: a random-init model writes "=" often,
    so the calculator is called, replies or fails."""
    (tmp_path / "my_env.py").write_text(env_example())
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(
        {"prompt": f"{a}+{b}", "answer": str(a + b)}) + "\n" for a in range(4) for b in range(4)))
    return ["--model", model_dir, "--dataset", str(tmp_path / "sums.jsonl"), "--env",
            f"{tmp_path / 'my_env.py'}:Calculator", "--reward", "last_number", "--prompts-per-step",
            "8", "--group-size", "4", "--max-new-tokens", "16", "--eval-every", "0"]


def test_readme_env_example_runs_through_the_cli_and_shows_its_episodes(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), *example_args(tmp_path, model_dir),
           "--steps", "2", "--run-dir", str(run_dir)]
    proc = warm.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "replies as raw text" in proc.stdout
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["env/tool_calls"] for r in steps) > 0 and all(r["env/turns"] >= 1 for r in steps)
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    replied = [r for r in rows if any(who == "env" for who, _ in r["turns"])]
    assert replied
    for r in replied:  # the calculator's reply to the sum its "=" ended
        text = r["prompt"]
        for who, part in r["turns"]:
            if who == "env":
                a, b = text[:-1].rsplit("=", 1)[-1].split("+")
                assert part == str(int(a) + int(b))
            text += part
        assert "".join(part for _, part in r["turns"]) == r["completion"]


def test_a_run_killed_with_episodes_in_flight_resumes_to_the_uninterrupted_run(tmp_path, model_dir):
    """--max-staleness 2 with the rollout process: the checkpoint of step 2 carries the episodes of
    steps 3 and 4; SIGKILL while step 5's are made, then the same command (as test_checkpoint)."""
    from test_checkpoint import assert_same_run, kill_9, log_of, run, start, wait_for
    args = [*example_args(tmp_path, model_dir), "--max-staleness", "2", "--steps", "5",
            "--ckpt-every", "2"]
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    run(args, ref)
    proc = start(args, run_dir, faults={"pause_in_step": 4})
    wait_for(run_dir / "in_step_4.rank0", proc, run_dir)
    kill_9(proc)
    run(args, run_dir)
    assert "resumed from step 2" in log_of(run_dir)
    assert_same_run(ref, run_dir)  # env/* metrics included: the episodes came back whole
