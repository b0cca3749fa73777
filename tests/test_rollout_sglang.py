"""SGLang backends of rollout.py, on CPU: a stand-in SGLang HTTP server
(tests/support/sglang_standin.py) for the remote backend, and a fake `sglang` module whose Engine
enforces the colocated call sequence. Neither is real SGLang: tests/gpu/check_sglang.py runs the
same checks against the real thing on a GPU."""

from __future__ import annotations

import dataclasses
import inspect
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import types
from contextlib import suppress

import pytest
import torch
from sglang_standin import StandinSGLangServer, save_tiny_llama

import rollout
from cli import UserError
from rollout import Completion, HFEngine, RemoteSGLangEngine, SamplingParams, SGLangEngine

torch.set_num_threads(1)


# -----------------------------------------------------------------------------
# fixtures: a throwaway tiny llama (sglang_standin.save_tiny_llama); fast HTTP constants


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def fast_http(monkeypatch):
    for name, value in {"HTTP_TIMEOUT_S": 10.0, "HTTP_RETRIES": 2, "HTTP_BACKOFF_S": 0.01,
                        "HEALTH_TIMEOUT_S": 10.0}.items():
        monkeypatch.setattr(rollout, name, value)


@pytest.fixture
def server(model_dir):
    s = StandinSGLangServer(model_dir).start()
    yield s
    s.stop()


def config(**flags):
    """The trainer's Config with these flags (what rollout.make_engine and tasks.load_data read)."""
    import nanoareal

    return nanoareal.Config(**flags)


def client(server_or_urls, model_dir, tmp_path, **kw) -> RemoteSGLangEngine:
    urls = server_or_urls if isinstance(server_or_urls, list) else [server_or_urls.url]
    return RemoteSGLangEngine(urls, model_dir, str(tmp_path), **kw)


# "a+b=" in the character vocabulary
PROMPTS = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(6)]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8, stop_token_ids=[1])


def perturbed(model_dir, lora: bool = False):
    """The model, every weight moved; `lora`: with LoRA adapters (B != 0), engines get it merged."""
    from transformers import AutoModelForCausalLM

    import lora as lora_adapters

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if lora:
        lora_adapters.apply(model, 2, None)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def trainer_logprobs(model, prompt: list[int], completion: Completion,
                     temperature: float) -> torch.Tensor:
    from transformers import AttentionInterface

    import attention
    import modeling

    AttentionInterface.register("packed", attention.packed_attention)
    model.set_attn_implementation("packed")
    full = prompt + completion.output_ids
    with torch.no_grad():
        lp, _ = modeling.policy_logprobs(model, torch.tensor([full]), torch.arange(len(full))[None],
                                         torch.tensor(full[1:] + [0]), temperature)
    return lp[len(prompt) - 1 : len(full) - 1]


def max_logprob_gap(model, eng, temperature: float = 0.7) -> float:
    c = eng.generate([PROMPTS[0]], SamplingParams(8, temperature), [3])[0]
    return float((trainer_logprobs(model, PROMPTS[0], c, temperature)
                  - torch.tensor(c.logprobs)).abs().max())


# -----------------------------------------------------------------------------
# remote backend against the stand-in: generation


def test_remote_generate_returns_the_servers_tokens_and_logprobs(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    seeds = list(range(len(PROMPTS)))
    got = eng.generate(PROMPTS, SAMPLING, seeds)
    want = HFEngine(model_dir).generate(PROMPTS, SAMPLING, seeds)  # the stand-in's engine
    assert [(c.output_ids, c.finish_reason) for c in got] == \
        [(c.output_ids, c.finish_reason) for c in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
    body = server.generate_bodies[0]
    assert body["return_logprob"] is True and body["rid"]
    assert body["sampling_params"]["max_new_tokens"] == 6
    assert body["sampling_params"]["stop_token_ids"] == [1]
    eng.shutdown()


def test_a_groups_samples_go_to_one_server_and_groups_are_balanced_over_servers(model_dir,
                                                                                 tmp_path):
    a, b = StandinSGLangServer(model_dir).start(), StandinSGLangServer(model_dir).start()
    try:
        eng = client([a.url, b.url], model_dir, tmp_path)
        groups = [p for p in PROMPTS[:4] for _ in range(3)]  # 4 groups of 3 samples
        eng.generate(groups, SAMPLING, list(range(len(groups))))
        seen = [{tuple(body["input_ids"]) for body in s.generate_bodies} for s in (a, b)]
        assert not seen[0] & seen[1]  # no prompt on both servers: its prefix is cached once
        assert len(seen[0]) == len(seen[1]) == 2
        assert len(a.generate_bodies) == len(b.generate_bodies) == 6
    finally:
        a.stop()
        b.stop()


def test_a_whole_batch_is_in_flight_at_once(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    server.gate_at = 80  # each request waits server-side until 80 are in flight
    eng.generate([PROMPTS[0]] * 80, SamplingParams(1), list(range(80)))
    assert server.peak_in_flight == 80  # more than the 64 threads there were


def test_abort_resubmits_prompt_plus_tokens_so_far_with_reduced_budget(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=[1])
    server.abort_after = (1, 2)  # the first request is aborted after 2 tokens
    c = eng.generate([PROMPTS[0]], sampling, [6])[0]  # a seed that samples no stop token
    first, second = server.generate_bodies
    assert second["input_ids"] == PROMPTS[0] + c.output_ids[:2]
    assert second["sampling_params"]["max_new_tokens"] == 4
    assert second["rid"] != first["rid"]
    assert len(c.output_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"


def test_abort_beyond_the_retry_budget_returns_an_abort_completion(server, model_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(rollout, "ABORT_RESUBMITS", 2)
    eng = client(server, model_dir, tmp_path)
    server.abort_after = (100, 1)
    c = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6), [0])[0]
    assert c.finish_reason == "abort"  # the trainer drops it
    assert len(server.generate_bodies) == 3 and len(c.output_ids) == len(c.logprobs) == 3


def test_5xx_is_retried_then_fails_naming_the_url(server, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "HTTP_RETRIES", 3)
    eng = client(server, model_dir, tmp_path)
    server.fail_5xx = 2
    assert len(eng.generate([PROMPTS[0]], SAMPLING, [0])[0].output_ids) > 0
    server.fail_5xx = 10
    with pytest.raises(RuntimeError, match=rf"{server.url}/generate failed 4 times.*HTTP 503"):
        eng.generate([PROMPTS[0]], SAMPLING, [0])


def test_a_long_answer_past_its_deadline_continues_from_the_tokens_generated(
        server, model_dir, tmp_path, monkeypatch):
    """A /generate's deadline grows with its budget (16k tokens at ~30 tokens/s outlast any fixed
    timeout); past it the request is aborted there, SGLang answers with the tokens so far, and
    the client resubmits prompt + those tokens with the same seed and the budget less them:
    greedy, the completion is the one an unhurried server gives."""
    monkeypatch.setattr(rollout, "HTTP_TIMEOUT_S", 0.3)
    monkeypatch.setattr(rollout, "MIN_TOKENS_PER_S", 1e9)  # the deadline: 0.3 s whatever the budget
    eng = client(server, model_dir, tmp_path)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[1])
    want = HFEngine(model_dir).generate([PROMPTS[1]], greedy, [3])[0]
    assert len(want.output_ids) > 4
    server.drip = (1, 0.1)  # a token every 0.1 s: ~3 by the deadline
    got = eng.generate([PROMPTS[1]], greedy, [3])[0]
    assert (got.output_ids, got.finish_reason) == (want.output_ids, want.finish_reason)
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    first, second = server.generate_bodies[-2:]
    k = len(second["input_ids"]) - len(PROMPTS[1])
    assert 1 <= k < len(want.output_ids) and server.aborted == [first["rid"]]
    assert second["input_ids"] == PROMPTS[1] + want.output_ids[:k]
    assert second["sampling_params"]["max_new_tokens"] == 12 - k
    assert second["sampling_params"]["sampling_seed"] == first["sampling_params"][
        "sampling_seed"] == 3 and second["rid"] != first["rid"]
    monkeypatch.setattr(rollout, "MIN_TOKENS_PER_S", 1.0)  # 12 tokens: 12.3 s, enough
    server.drip = (1, 0.1)
    assert eng.generate([PROMPTS[1]], greedy, [3])[0].output_ids == want.output_ids
    assert len(server.aborted) == 1  # not aborted this time


def test_a_timed_out_generate_is_aborted_on_the_server_then_reposted_under_a_new_rid(
        server, model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(rollout, "HTTP_TIMEOUT_S", 0.3)
    monkeypatch.setattr(rollout, "MIN_TOKENS_PER_S", 1e9)
    eng = client(server, model_dir, tmp_path)
    server.slow = (1, 1.0)
    assert len(eng.generate([PROMPTS[0]], SAMPLING, [0])[0].output_ids) > 0
    first, second = server.generate_bodies
    assert server.aborted == [first["rid"]] and second["rid"] != first["rid"]
    assert server.calls.index("/abort_request") < len(server.calls) - 1


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_the_stand_in_refuses_a_batch_past_the_context_as_sglang_does(model_dir, version):
    """One request of prompt + max_new_tokens past the context (0.5.10: at it) fails the whole
    batch, 400; then the scheduler caps max_new_tokens at context - 2 - prompt, and aborts a
    prompt from context - 6 tokens: prompt + max_new_tokens <= context - 2 and prompt <= context
    - 7 is safe on every version (tasks.load_data's bounds)."""
    import urllib.error
    import urllib.request

    s = StandinSGLangServer(model_dir, version=version).start()

    def post(rows, max_new, **extra):
        body = {"input_ids": rows, "return_logprob": True, "sampling_params": [
            {"max_new_tokens": m, "ignore_eos": True} | extra for m in max_new]}
        req = urllib.request.Request(s.url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        code, out = post([PROMPTS[0], PROMPTS[1]], [4, 61])  # 4 + 61 > 64
        assert code == 400 and "maximum context length of 64" in out["error"]["message"]
        code, out = post([PROMPTS[0], PROMPTS[1]], [4, 60])  # 4 + 60 = 64
        assert code == (400 if version == "0.5.10" else 200)
        if code == 200:  # capped: 63 - 4 - 1 tokens
            assert [len(o["output_ids"]) for o in out] == [4, 58]
        code, out = post([[3] * 64], [1])
        assert code == 400 and "longer than the model's context length" in out["error"]["message"]
        code, out = post([[3] * 57, [3] * 58], [1, 1])  # a prompt from 64 - 6 tokens: aborted
        assert code == 200 and [o["meta_info"]["finish_reason"]["type"] for o in out] == \
            ["length", "abort"]
    finally:
        s.stop()


def test_start_up_refuses_what_some_sglang_version_would_refuse_cut_or_abort(tmp_path):
    """tasks.load_data: prompt + --max-new-tokens <= context - 2 and prompt <= context - 7, what
    every SGLang 0.5.10-0.5.23 serves whole (the stand-in's limits, above), else one line."""
    import pathlib

    import tasks

    arith = str(pathlib.Path(__file__).resolve().parents[1] / "assets" / "tiny-arith")
    load = lambda data, new: tasks.load_data(config(  # 64 positions; sums of 6 tokens at most
        model=arith, dataset=data, reward="exact_match", max_new_tokens=new,
        micro_batch_tokens=4096))
    assert load("arithmetic", 56).prompts  # 6 + 56 = 64 - 2
    with pytest.raises(UserError, match=r"longest prompt \+ --max-new-tokens is 63 tokens, over "
                                        r"the model's context length \(64\) less 2: SGLang"):
        load("arithmetic", 57)
    data = tmp_path / "long.jsonl"  # a character per token, no BOS
    data.write_text(json.dumps({"prompt": "1" * 57, "answer": "1"}) + "\n")
    assert max(map(len, load(str(data), 1).prompts)) == 57  # 64 - 7
    data.write_text(json.dumps({"prompt": "1" * 58, "answer": "1"}) + "\n")
    with pytest.raises(UserError, match=r"the longest prompt is 58 tokens, over the model's "
                                        r"context length \(64\) less 7: SGLang aborts"):
        load(str(data), 1)


def test_hf_engine_per_prompt_limits_equal_each_prompt_generated_alone(model_dir):
    """A batch runs to its longest limit; each row, cut at its own, is what it samples alone."""
    eng, sampling = HFEngine(model_dir), SamplingParams(8, 1.0, stop_token_ids=[1])
    seeds, limits = [11, 12, 13, 14, 15, 16], [1, 8, 3, 5, 2, 8]
    got = eng.generate(PROMPTS, sampling, seeds, max_new_tokens=limits)
    for p, seed, n, c in zip(PROMPTS, seeds, limits, got):
        alone = eng.generate([p], dataclasses.replace(sampling, max_new_tokens=n), [seed])[0]
        assert (c.output_ids, c.finish_reason) == (alone.output_ids, alone.finish_reason)
        assert c.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert any(c.finish_reason == "length" and len(c.output_ids) == n < 8
               for c, n in zip(got, limits))
    same = eng.generate(PROMPTS, sampling, seeds, max_new_tokens=[8] * 6)
    assert [c.output_ids for c in same] == [c.output_ids for c in eng.generate(PROMPTS, sampling,
                                                                               seeds)]


class Reply:
    """An env replying row["reply"] to each tool call; the episode is over at its third."""
    stop = ["="]

    def __init__(self, row: dict):
        self.row, self.calls = row, 0

    def step(self, turn: str) -> str | None:
        self.calls += 1
        return self.row["reply"] if self.calls < 3 else None


def test_each_episode_asks_for_its_own_room_never_past_the_context(model_dir, tmp_path):
    """run_episodes continues every live episode in one generate call, each request with its own
    room (max_new_tokens less its episode so far). Here prompt + max_new_tokens is the context
    less 2 (tasks.load_data's bound): the batch's largest room for every episode would pass the
    context for the longer ones, and SGLang (the stand-in) would fail the whole batch."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [[3 + i % 10, 13, 3 + (i * 7) % 10] for i in range(4) for _ in range(4)]
    budget = 64 - 2 - 3
    sampling = SamplingParams(max_new_tokens=budget, temperature=1.0, stop_token_ids=[1])
    tools = rollout.Tools(Reply, [14], lambda t: tok(t, add_special_tokens=False)["input_ids"],
                          tok.decode, 4)
    rows = [{"reply": "12345678"[: 1 + 3 * (i % 3)]} for i in range(len(prompts))]
    seeds = [100 + i for i in range(len(prompts))]
    s = StandinSGLangServer(model_dir).start()
    try:
        got = rollout.run_episodes(client(s, model_dir, tmp_path), prompts, sampling, seeds,
                                   tools, rows)
    finally:
        s.stop()
    rooms = [(b["sampling_params"]["max_new_tokens"], budget - (len(b["input_ids"]) - 3))
             for b in s.generate_bodies]
    assert all(sent == own for sent, own in rooms), rooms
    assert len({own for _, own in rooms if own < budget}) > 2  # later turns: many rooms
    want = rollout.run_episodes(HFEngine(model_dir), prompts, sampling, seeds, tools, rows)
    assert [(c.output_ids, c.policy_mask, c.finish_reason) for c in got] == \
        [(c.output_ids, c.policy_mask, c.finish_reason) for c in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


def test_server_that_never_becomes_healthy_fails_fast_and_clearly(model_dir, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr(rollout, "HEALTH_TIMEOUT_S", 0.5)
    s = StandinSGLangServer(model_dir, start_delay=1e6).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=rf"--rollout-url {s.url}: no healthy SGLang server "
                                            r"after 0.5s.*HTTP 503"):
            client(s, model_dir, tmp_path)
        assert time.monotonic() - t0 < 5
    finally:
        s.stop()
    with pytest.raises(UserError, match="no healthy SGLang server"):  # nothing listening at all
        client([s.url], model_dir, tmp_path)


def test_health_wait_says_what_it_waits_for(model_dir, tmp_path, capsys):
    s = StandinSGLangServer(model_dir, start_delay=1.0).start()  # 503 while "loading"
    try:
        eng = object.__new__(RemoteSGLangEngine)  # only the health wait, not a whole client
        eng.urls, eng.waited = [s.url], set()
        eng.wait_healthy(30.0)
    finally:
        s.stop()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"waiting for the SGLang server {s.url} (")
    assert "HTTP 503" in lines[0]


def test_deterministic_remote_rollouts_need_servers_launched_deterministic(server, model_dir,
                                                                           tmp_path):
    with pytest.raises(UserError, match="--enable-deterministic-inference"):
        client(server, model_dir, tmp_path, deterministic=True)
    server.info["enable_deterministic_inference"] = True
    assert client(server, model_dir, tmp_path, deterministic=True).infos[server.url][
        "enable_deterministic_inference"] is True


# -----------------------------------------------------------------------------
# finish reasons and stop tokens


@pytest.mark.parametrize("version", ["0.5.10", "0.5.23"])
def test_a_response_ending_in_a_stop_token_stopped_whatever_the_sglang_version(model_dir, tmp_path,
                                                                               version):
    """With --mask-truncated a "length" response is dropped: one that ended properly never is."""
    s = StandinSGLangServer(model_dir, version=version).start()
    try:
        sampling = SamplingParams(max_new_tokens=3, temperature=1.0, stop_token_ids=[1])
        prompts, seeds = [PROMPTS[i % 6] for i in range(48)], list(range(48))
        got = client(s, model_dir, tmp_path).generate(prompts, sampling, seeds)
        want = HFEngine(model_dir).generate(prompts, sampling, seeds)
        assert [(c.output_ids, c.finish_reason) for c in got] == \
            [(c.output_ids, c.finish_reason) for c in want]
        for c in got:
            assert (c.finish_reason == "length") == (c.output_ids[-1] != 1)
        last = [i for i, c in enumerate(got) if len(c.output_ids) == 3 and c.output_ids[-1] == 1]
        assert last  # some stopped at the last allowed token, which the versions report apart:
        sent = {b["sampling_params"]["sampling_seed"]: s.finishes[b["rid"]]["type"]
                for b in s.generate_bodies}
        assert {sent[seeds[i]] for i in last} == {"length" if version == "0.5.10" else "stop"}
    finally:
        s.stop()


def test_sglang_also_stops_on_generation_config_eos_ids_as_do_both_engines_with_the_stop_set(
        model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer, GenerationConfig

    import tasks

    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=[1])
    seeds = list(range(12))
    prompts = [PROMPTS[i % 6] for i in seeds]
    common = HFEngine(model_dir).generate(prompts, sampling, seeds)
    eos2 = max(range(3, 18), key=lambda t: sum(t in c.output_ids[:-1] for c in common))
    path = shutil.copytree(model_dir, tmp_path / "model")
    GenerationConfig(eos_token_id=[1, eos2]).save_pretrained(path)
    s = StandinSGLangServer(str(path)).start()
    try:
        eng = client(s, str(path), tmp_path)
        got = eng.generate(prompts, sampling, seeds)  # the request names only 1
        assert any(c.output_ids[-1] == eos2 and c.finish_reason == "stop" for c in got)
        stop_ids = tasks.stop_token_ids(AutoTokenizer.from_pretrained(path), str(path), False)
        assert stop_ids == sorted([1, eos2])
        both = SamplingParams(8, 1.0, stop_token_ids=stop_ids)
        assert [c.output_ids for c in eng.generate(prompts, both, seeds)] == \
            [c.output_ids for c in HFEngine(str(path)).generate(prompts, both, seeds)]
    finally:
        s.stop()


# -----------------------------------------------------------------------------
# remote weight sync, round trips: through the disk, and over a gloo group as NCCL would


@pytest.mark.parametrize("version,lora", [("0.5.10", False), ("0.5.23", False), ("0.5.23", True)])
def test_disk_sync_round_trip_stand_in_logprobs_equal_trainers(model_dir, tmp_path, version, lora):
    from safetensors import safe_open

    s = StandinSGLangServer(model_dir, version=version).start()
    try:
        eng, model = client(s, model_dir, tmp_path), perturbed(model_dir, lora)
        assert max_logprob_gap(model, eng) > 1e-3
        eng.update_weights(model, 1)
        assert max_logprob_gap(model, eng) < 1e-5 and eng.version == 1
        # no begin/end session around a disk update: it post-processes the weights once
        assert [c for c in s.calls if c not in ("/generate", "/health_generate",
                                                "/server_info")] == ["/update_weights_from_disk"]
        assert s.post_processed == 1
        eng.update_weights(model, 2)  # the second sync replaces the first directory
        root = tmp_path / "weights_sync"
        assert sorted(os.listdir(root)) == ["step_000002"]
        assert {"config.json", "model.safetensors",
                "tokenizer.json"} <= set(os.listdir(root / "step_000002"))
        with safe_open(root / "step_000002" / "model.safetensors", "pt") as f:  # server's dtype
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    finally:
        s.stop()


@pytest.mark.parametrize("lora", [False, True])
def test_nccl_sync_round_trip_over_gloo_stand_ins_logprobs_equal_trainers(model_dir, tmp_path,
                                                                          monkeypatch, lora):
    """Two servers, SGLang 0.5.10 (no sessions) and 0.5.23, each with its group member in a
    process of its own, joined as SGLang joins; the trainer reaches them at the address of the
    interface towards the server, not gethostbyname's. A LoRA model's weights arrive merged."""
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(rollout, "SYNC_BUCKET_MB", 0.005)  # several buckets
    monkeypatch.setattr(rollout, "HTTP_TIMEOUT_S", 120.0)  # the members start (import torch)
    monkeypatch.setattr(rollout, "WEIGHT_GROUP_TIMEOUT_S", 120.0)
    old, new = (StandinSGLangServer(model_dir, version=v).start() for v in ("0.5.10", "0.5.23"))
    try:
        eng = client([old.url, new.url], model_dir, tmp_path, weight_sync="nccl",
                     group_backend="gloo")
        model = perturbed(model_dir, lora)
        assert max_logprob_gap(model, eng) > 1e-3
        eng.update_weights(model, 1)
        eng.update_weights(model, 2)  # the group is made once
        for s in (old, new):
            eng.urls = [s.url]
            assert max_logprob_gap(model, eng) < 1e-5 and not s.unknown_weights
        sync = {s: [c for c in s.calls if c not in ("/generate", "/health_generate",
                                                    "/server_info")] for s in (old, new)}
        updates = sync[new].count("/update_weights_from_distributed")
        assert updates > 8 and updates % 2 == 0
        first = ["/begin_weight_update", "/init_weights_update_group",
                 *["/update_weights_from_distributed"] * (updates // 2)]
        assert sync[new] == first + ["/end_weight_update"] + first[:1] + first[2:] + \
            ["/end_weight_update"]
        assert sync[old] == first + first[2:]  # 404 on the first begin: asked no more
        assert new.post_processed == 0  # a session that loaded weights post-processes no more
        assert [s.members[0][0].is_alive() for s in (old, new)] == [True, True]
        inits = [s.group_inits for s in (old, new)]
        assert [[(b["master_address"], b["rank_offset"], b["world_size"]) for b in i]
                for i in inits] == [[("127.0.0.1", 1, 3)], [("127.0.0.1", 2, 3)]]
    finally:
        old.stop()
        new.stop()


def test_the_weight_group_counts_each_servers_tp_ranks_and_refuses_pp_and_dp_replicas(
        server, model_dir, tmp_path):
    url = "http://h:1"
    assert rollout.weight_group_ranks(url, {"tp_size": 4, "pp_size": 1, "dp_size": 1}) == 4
    assert rollout.weight_group_ranks(url, {"tp_size": 4, "dp_size": 2,
                                            "enable_dp_attention": True}) == 4
    for info in ({"tp_size": 2, "pp_size": 2}, {"tp_size": 2, "dp_size": 2}):
        with pytest.raises(UserError, match="joins only its TP ranks"):
            rollout.weight_group_ranks(url, info)
    server.info["pp_size"] = 2  # refused at start, before any step trains
    with pytest.raises(UserError, match=f"{server.url} runs pp_size=2"):
        client(server, model_dir, tmp_path, weight_sync="nccl")
    assert client(server, model_dir, tmp_path).weight_sync == "disk"


def test_auto_weight_sync_broadcasts_wherever_a_group_can_form_else_goes_through_disk(
        server, model_dir, tmp_path, monkeypatch):
    """Disk writes the whole model and every server reloads it, every step: auto is nccl where a
    group can form (NCCL needs a CUDA trainer, servers of TP ranks only)."""
    assert client(server, model_dir, tmp_path).weight_sync == "disk"  # a CPU trainer: no NCCL
    assert client(server, model_dir, tmp_path, group_backend="gloo").weight_sync == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout, "gpu_neighbours", lambda device=None: [])  # a GPU of its own
    assert client(server, model_dir, tmp_path).weight_sync == "nccl"
    server.info["pp_size"] = 2
    assert client(server, model_dir, tmp_path).weight_sync == "disk"
    assert client(server, model_dir, tmp_path, weight_sync="disk").weight_sync == "disk"


def test_auto_weight_sync_never_picks_nccl_beside_a_server_that_may_share_rank0s_gpu(
        server, model_dir, tmp_path, monkeypatch, capsys):
    """NCCL between two processes on one GPU fails ("Duplicate GPU detected") and SGLang tells
    nothing of its GPU: with a server on this host, auto broadcasts only if no other process is
    on rank 0's GPU; it says its choice and why. An explicit --weight-sync nccl is honoured."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    answer, asked = [None], []
    monkeypatch.setattr(rollout, "gpu_neighbours",
                        lambda device=None: asked.append(device) or answer[0])
    for others, want, why in (([], "nccl", "no other process is on rank 0's GPU"),
                              ([4242], "disk", "process(es) 4242 share rank 0's GPU"),
                              (None, "disk", "cannot be told")):
        answer[0] = others
        eng = rollout.make_engine(config(rollout_backend="sglang", rollout_url=[server.url],
                                         model=model_dir, run_dir=str(tmp_path), seed=0),
                                  torch.device("cuda", 2))
        assert eng.weight_sync == want and asked[-1] == torch.device("cuda", 2)
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert line.startswith(f"--weight-sync auto: {want} (") and why in line, line
        assert server.url in line
    monkeypatch.setattr(rollout, "on_this_host", lambda url: False)  # a server elsewhere
    answer[0], n = [4242], len(asked)
    assert client(server, model_dir, tmp_path).weight_sync == "nccl" and len(asked) == n
    assert "auto: nccl (a weight group can form with every server)\n" in capsys.readouterr().out
    monkeypatch.setattr(rollout, "on_this_host", lambda url: True)
    assert client(server, model_dir, tmp_path, weight_sync="nccl").weight_sync == "nccl"
    assert "--weight-sync" not in capsys.readouterr().out  # an explicit choice, honoured


def test_a_server_url_naming_this_host_is_told_from_one_elsewhere(monkeypatch):
    with suppress(OSError):  # any address of ours, found by the route towards it
        own = rollout.route_address("http://192.0.2.1:1")
        assert rollout.on_this_host(f"http://{own}:30000")
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer")
    monkeypatch.setattr(socket, "gethostbyname_ex", lambda name: (name, [], ["10.9.8.7"]))
    monkeypatch.setattr(rollout, "route_address", lambda url: "10.9.8.6")  # our side of a route
    for url in ("http://127.0.0.1:30000", "http://localhost:1", "http://0.0.0.0:1",
                "http://10.9.8.7:1", "http://10.9.8.6:1"):
        assert rollout.on_this_host(url), url
    assert not rollout.on_this_host("http://10.9.8.5:30000")


def test_gpu_neighbours_are_the_other_processes_nvidia_smi_lists_on_that_gpu(monkeypatch):
    """By UUID (torch's indices are CUDA_VISIBLE_DEVICES'); None where it cannot be told: no
    nvidia-smi, or our own id absent while we hold a context there (host ids in a container)."""
    calls, answer = [], {}
    props = types.SimpleNamespace(uuid="8932f937-d72c-4106-c12f-20bd9faed9f6")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: calls.append(index) or props)
    monkeypatch.setattr(rollout.subprocess, "run", lambda argv, **kw: calls.append(argv) or
                        types.SimpleNamespace(returncode=answer["rc"], stdout=answer["out"]))
    me = os.getpid()
    for rc, out, context, want in [(0, f"{me}\n4242\n", True, [4242]), (0, "", True, []),
                                   (0, f"{me}\n", True, []), (0, "4242\n", False, [4242]),
                                   (0, "4242\n", True, None), (6, "", True, None)]:
        answer.update(rc=rc, out=out)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i, c=context: c,
                            raising=False)
        assert rollout.gpu_neighbours("cuda") == want, (rc, out, context)
    assert calls[:2] == [3, ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader",
                             "--id=GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"]]
    rollout.gpu_neighbours(torch.device("cuda", 1))
    assert calls[-2] == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: 1 / 0)  # no CUDA
    assert rollout.gpu_neighbours("cuda") is None


def test_the_trainers_address_is_that_of_the_interface_towards_the_server(monkeypatch):
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    assert rollout.route_address("http://127.0.0.1:30000") == "127.0.0.1"
    assert rollout.route_address("http://localhost") in ("127.0.0.1", "::1")


def test_a_server_refusing_a_weight_update_session_fails_the_sync_with_its_message(
        server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path, weight_sync="nccl", group_backend="gloo")
    server.refuse_session = "another weight update is in progress"
    with pytest.raises(RuntimeError, match="begin_weight_update failed at step 4 .*another "
                                           "weight update is in progress"):
        eng.update_weights(perturbed(model_dir), 4)


def test_the_hf_engines_logprobs_in_bf16_are_the_trainers_fp32_head_of_the_same_weights(tmp_path):
    """A bf16 HFEngine samples from fp32 logits, as the bf16 trainer's head (modeling.head_logits)
    computes them: with a body that is exact in bf16 (layers whose outputs are zero; a real body's
    cached decode and packed forward round differently) pi/pi_behave = 1 to fp32 rounding. bf16
    logits (the model's own lm_head) were off by ~1e-2 at these logits (~30)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_tiny_llama(tmp_path / "m"))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    eng = HFEngine(str(tmp_path / "m"), dtype=torch.bfloat16)
    trainer = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16)
    for i, t in enumerate((1.0, 0.7)):
        c = eng.generate([PROMPTS[i]], SamplingParams(8, t), [i])[0]
        gap = (trainer_logprobs(trainer, PROMPTS[i], c, t) - torch.tensor(c.logprobs)).abs()
        assert float(gap.max()) < 1e-5, (t, gap)


def test_weights_go_to_servers_in_the_dtype_they_hold(tmp_path):
    fp32 = save_tiny_llama(tmp_path / "fp32")
    fp16 = save_tiny_llama(tmp_path / "fp16", dtype=torch.float16)
    assert rollout.engine_dtype(fp16) == torch.float16  # the model's own
    assert rollout.engine_dtype(fp32) == torch.float16  # SGLang's "auto" for an fp32 config
    assert rollout.engine_dtype(fp32, "bfloat16") == torch.bfloat16  # the server's --dtype
    assert rollout.engine_dtype(fp32, fp32_as=torch.bfloat16) == torch.bfloat16
    gemma = tmp_path / "gemma"
    gemma.mkdir()
    (gemma / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    assert rollout.engine_dtype(str(gemma)) == torch.bfloat16


# -----------------------------------------------------------------------------
# in-process engine: a fake `sglang` module that enforces SGLang's rules and records the calls

ENGINE_FIELDS = ("model_path", "mem_fraction_static", "enable_memory_saver", "skip_tokenizer_init",
                 "base_gpu_id", "tp_size", "random_seed", "dtype", "port", "nccl_port",
                 "enable_deterministic_inference", "enable_fp32_lm_head")


def _fake_scheduler(conn, nccl_port: int, timeout_s: float) -> None:
    """What of SGLang's scheduler start depends on the environment it inherits: its process group
    by a tcp:// rendezvous on nccl_port (init_distributed_environment; rank 0 of tp_size 1 hosts
    the store). Then it holds the port until told to stop."""
    from datetime import timedelta

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{nccl_port}", rank=0,
                                world_size=1, timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        return conn.send(f"{type(e).__name__}: {e}")
    conn.send("ok")
    conn.recv()


def install_fake_sglang(monkeypatch, new: bool, fail: dict | None = None, lacks: tuple = (),
                        probe_sigint: bool = False, scheduler: bool = False) -> list:
    """new=True: SGLang >= 0.5.21 (begin/end_weight_update, ServerArgs and SamplingParams
    msgspec Structs); False: 0.5.10 (dataclass ServerArgs, plain SamplingParams). ServerArgs has
    ENGINE_FIELDS but `lacks`, and the Engine, like ServerArgs(**kwargs), refuses other keywords.
    Control calls return (success, message), never raising: `fail` maps a call's name to the
    message it fails with. `probe_sigint`: the Engine spawns a process (multiprocessing spawn, as
    SGLang does) that raises SIGINT in itself, and logs its exit code. `scheduler`: the Engine
    binds `port` and spawns a scheduler that builds its process group on `nccl_port` (as SGLang's
    does, a store it hosts there), failing as SGLang does if it cannot (timeout 20 s)."""
    log: list = []
    fail = fail or {}
    names = [n for n in ENGINE_FIELDS if n not in lacks]

    def result(name: str):
        return (False, fail[name]) if name in fail else (True, "Succeeded")

    if new:
        ServerArgs = type("ServerArgs", (), {"__struct_fields__": tuple(names)})
    else:
        ServerArgs = dataclasses.make_dataclass("ServerArgs", [(n, object, None) for n in names])

    class Engine:
        finish = {"type": "stop", "matched": 1}

        def __init__(self, **kw):
            if unknown := set(kw) - set(names):
                raise TypeError(f"ServerArgs got an unexpected keyword argument {unknown}")
            assert kw["enable_memory_saver"] and kw["skip_tokenizer_init"] and kw["tp_size"] == 1
            log.append(("init", kw))
            if probe_sigint:
                proc = mp.get_context("spawn").Process(target=signal.raise_signal,
                                                       args=(signal.SIGINT,))
                proc.start()
                proc.join()
                log.append(("child_exit", proc.exitcode))
            if scheduler:
                self.socket = socket.create_server(("", kw["port"]))  # EADDRINUSE: taken
                self.conn, there = mp.get_context("spawn").Pipe()
                self.proc = mp.get_context("spawn").Process(
                    target=_fake_scheduler, args=(there, kw["nccl_port"], 20), daemon=True)
                self.proc.start()
                state = self.conn.recv() if self.conn.poll(90) else "no answer in 90 s"
                if state != "ok":
                    raise RuntimeError(f"Initialization failed. scheduler: {state}")
            self.released: set[str] = set()
            self.in_session = False
            self.cuda_graph_env = os.environ.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH")  # inherited

        def generate(self, input_ids, sampling_params, return_logprob):
            assert not self.released, f"generate with released memory {self.released}"
            assert return_logprob and len(input_ids) == len(sampling_params)
            log.append(("generate", sampling_params))
            meta = lambda i, p: {"id": str(i), "finish_reason": self.finish,
                                 "prompt_tokens": len(p), "completion_tokens": 1,
                                 "output_token_logprobs": [(-0.5, 1, None)]}
            return [{"output_ids": [1], "meta_info": meta(i, p)} for i, p in enumerate(input_ids)]

        def release_memory_occupation(self, tags=None):
            assert not (set(tags) & self.released), "releasing a tag twice"
            self.released |= set(tags)
            log.append(("release", list(tags)))

        def resume_memory_occupation(self, tags=None):
            assert set(tags) <= self.released, f"resuming {tags} that were not released"
            self.released -= set(tags)
            log.append(("resume", list(tags)))

        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
            assert "weights" not in self.released, "weights must be resumed before an update"
            if new and not self.in_session:  # SGLang >= 0.5.21 refuses, in its result
                return False, "update outside begin_weight_update/end_weight_update"
            log.append(("update", [(n, tuple(t.shape), t.dtype) for n, t in named_tensors],
                        flush_cache))
            return result("update_weights_from_tensor")

        def flush_cache(self):
            log.append(("flush",))

        def shutdown(self):
            log.append(("shutdown",))
            if scheduler:
                self.conn.send("stop")
                self.proc.join(10)
                self.socket.close()

    if new:
        def begin_weight_update(self, selector="all"):
            assert not self.in_session and selector == "all"
            self.in_session = True
            log.append(("begin",))
            return result("begin_weight_update")

        def end_weight_update(self):
            assert self.in_session
            self.in_session = False
            log.append(("end",))
            return result("end_weight_update")

        Engine.begin_weight_update = begin_weight_update
        Engine.end_weight_update = end_weight_update

    sglang = types.ModuleType("sglang")
    sglang.Engine = Engine
    server_args = types.ModuleType("sglang.srt.server_args")
    server_args.ServerArgs = ServerArgs
    constants = types.ModuleType("sglang.srt.constants")
    constants.GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
    sp = types.ModuleType("sglang.srt.sampling.sampling_params")
    fields = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "sampling_seed")
    if new:  # a msgspec.Struct: fields in __struct_fields__, no signature
        sp.SamplingParams = type("SamplingParams", (), {"__struct_fields__": fields,
                                                        "__init__": lambda self, *a, **k: None})
    else:
        class SamplingParams:  # a plain class: its fields are its __init__'s parameters
            def __init__(self, max_new_tokens=None, temperature=None, top_p=None, top_k=None,
                         stop_token_ids=None, sampling_seed=None):
                pass

        sp.SamplingParams = SamplingParams
    mods = {"sglang": sglang, "sglang.srt": types.ModuleType("sglang.srt"),
            "sglang.srt.server_args": server_args, "sglang.srt.constants": constants,
            "sglang.srt.sampling": types.ModuleType("sglang.srt.sampling"),
            "sglang.srt.sampling.sampling_params": sp}
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    # the trainer's CUDA cache is emptied right before SGLang maps its memory back
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return log


@pytest.mark.parametrize("new,lora", [(True, False), (False, False), (True, True)],
                         ids=["sglang>=0.5.21", "sglang<0.5.21", "lora"])
def test_colocated_engine_call_sequence_and_buckets(monkeypatch, model_dir, new, lora):
    """As nanoareal drives it: made (then left released, holding no weights), weights pushed
    before the first generate (resume()), then each step generate, release, train, resume, push.
    A session brackets the pushes where SGLang has one: through the Engine (0.5.21+)."""
    from transformers import AutoModelForCausalLM

    log = install_fake_sglang(monkeypatch, new)
    monkeypatch.setattr(rollout, "SYNC_BUCKET_MB", 0.005)  # ~5 kB buckets: several of them
    eng = SGLangEngine(model_dir, device="cpu")
    model = perturbed(model_dir, lora)  # LoRA: the plain model's names, merged

    eng.update_weights(model, 0)  # nanoareal.resume(): engine.version < 0
    out = eng.generate(PROMPTS[:2], SAMPLING, [7, 8])
    assert out[0] == Completion([1], [-0.5], "stop")
    eng.release_memory()  # ---- training happens here ----
    eng.resume_memory()
    eng.update_weights(model, 1)
    eng.generate(PROMPTS[:1], SAMPLING, [9])
    eng.shutdown()

    assert all(log[i - 1] == ("empty_cache",) for i, e in enumerate(log) if e[0] == "resume")
    log[:] = [e for e in log if e[0] != "empty_cache"]
    kinds = [e[0] for e in log]
    n = kinds.count("update") // 2
    session = (["begin"], ["end"]) if new else ([], [])
    push = ["resume", *session[0], *["update"] * n, *session[1], "resume", "flush"]
    assert kinds == ["init", "release", *push, "generate", "release", *push, "generate",
                     "shutdown"]
    assert log[1] == ("release", ["kv_cache", "weights", "cuda_graph"])
    assert log[2] == ("resume", ["weights"])
    assert log[kinds.index("flush") - 1] == ("resume", ["kv_cache", "cuda_graph"])
    init = log[0][1]
    assert init["base_gpu_id"] == 0 and init["model_path"] == model_dir
    assert "sampling_seed" in log[kinds.index("generate")][1][0]

    updates = [e for e in log if e[0] == "update"][:n]  # the first push
    assert n > 2
    assert [e[2] for e in updates] == [False] * (n - 1) + [True]  # flush with the last
    sent = [item for e in updates for item in e[1]]
    state = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert sorted(n for n, _, _ in sent) == sorted(state)  # every tensor exactly once
    for name, shape, dtype in sent:
        assert shape == tuple(state[name].shape)
        assert dtype == (torch.bfloat16 if state[name].is_floating_point() else state[name].dtype)


def test_colocated_engine_starts_released_says_what_it_holds_and_never_generates_unpushed(
        monkeypatch, model_dir):
    """SGLang frees CUDA graphs only if SGLANG_MEMORY_SAVER_CUDA_GRAPH is set when its scheduler
    starts; released weights come back uninitialised. held = (free before - free after start,
    free before - free released), read with torch.cuda.mem_get_info."""
    monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)  # restored afterwards
    log = install_fake_sglang(monkeypatch, new=True)
    GiB, free = 2**30, iter([80 * 2**30, 30 * 2**30, 77 * 2**30])  # before, started, released
    reads = []
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda device=None: reads.append((len(log), device)) or
                        (next(free), 80 * GiB))
    eng = SGLangEngine(model_dir, device="cuda")
    assert eng.engine.cuda_graph_env == "1"  # in the environment its processes inherit
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in os.environ  # and only there
    assert eng.held == (50 * GiB, 3 * GiB)
    assert [n for n, _ in reads] == [0, 1, 2]  # before init, after it, after the release
    assert {str(d) for _, d in reads} == {"cuda"}
    assert log[1] == ("release", ["kv_cache", "weights", "cuda_graph"]) and len(log) == 2
    assert eng.version == -1
    with pytest.raises(RuntimeError, match="generate before update_weights"):
        eng.generate(PROMPTS[:1], SAMPLING, [0])
    assert len(log) == 2  # nothing resumed, nothing generated


def test_colocated_engine_runs_the_models_half_dtype_with_an_fp32_lm_head(monkeypatch, tmp_path):
    from transformers import AutoModelForCausalLM

    fp16 = save_tiny_llama(tmp_path / "fp16", dtype=torch.float16)
    log = install_fake_sglang(monkeypatch, new=True)
    eng = SGLangEngine(fp16, device="cpu")
    assert log[0][1]["dtype"] == "float16" and log[0][1]["enable_fp32_lm_head"] is True
    eng.release_memory()
    eng.update_weights(AutoModelForCausalLM.from_pretrained(fp16, dtype=torch.float32), 1)
    assert {d for e in log if e[0] == "update" for _, _, d in e[1]} == {torch.float16}
    fp32 = save_tiny_llama(tmp_path / "fp32")
    SGLangEngine(fp32, device="cpu")  # an fp32 model runs in bf16 on the GPU
    assert [e[1] for e in log if e[0] == "init"][-1]["dtype"] == "bfloat16"


def test_each_engine_gets_free_ports_of_its_own_whatever_its_local_rank(monkeypatch, model_dir):
    """Two jobs on one host both run LOCAL_RANK 0: ports come from the OS, not the rank (both
    jobs started at once, under torchrun: tests/test_torchrun_engines.py)."""
    log = install_fake_sglang(monkeypatch, new=True)
    engines = [SGLangEngine(model_dir, device="cpu") for _ in range(2)]
    ports = [e[1][k] for e in log if e[0] == "init" for k in ("port", "nccl_port")]
    assert len(set(ports)) == 4 and len(engines) == 2


def test_sglang_subprocesses_spawned_by_the_engine_ignore_the_terminals_sigint(monkeypatch,
                                                                             model_dir):
    """Ctrl-C reaches the whole process group: the trainer's handler finishes the step and saves,
    SGLang's scheduler and detokenizer must not die meanwhile."""
    log = install_fake_sglang(monkeypatch, new=True, probe_sigint=True)
    before = signal.getsignal(signal.SIGINT)
    SGLangEngine(model_dir, device="cpu")
    assert log[1] == ("child_exit", 0)  # it survived its own SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # and the trainer's handler is back


def test_colocated_engine_reports_stop_for_a_length_finish_ending_in_a_stop_token(monkeypatch,
                                                                                  model_dir):
    from transformers import AutoModelForCausalLM

    install_fake_sglang(monkeypatch, new=False)
    sys.modules["sglang"].Engine.finish = {"type": "length", "length": 1}  # SGLang <= 0.5.17
    eng = SGLangEngine(model_dir, device="cpu")
    eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 0)
    assert eng.generate(PROMPTS[:1], SamplingParams(1, stop_token_ids=[1]), [0])[0] == \
        Completion([1], [-0.5], "stop")
    assert eng.generate(PROMPTS[:1], SamplingParams(1, stop_token_ids=[2]), [0])[0] == \
        Completion([1], [-0.5], "length")


@pytest.mark.parametrize("call", ["begin_weight_update", "update_weights_from_tensor",
                                  "end_weight_update"])
def test_a_control_call_reporting_failure_fails_the_step_with_its_message(monkeypatch, model_dir,
                                                                          call):
    from transformers import AutoModelForCausalLM

    install_fake_sglang(monkeypatch, new=True, fail={call: "CUDA IPC handle expired"})
    eng = SGLangEngine(model_dir, device="cpu")
    eng.release_memory()
    with pytest.raises(RuntimeError, match=f"SGLang {call} failed at step 7: CUDA IPC handle "
                                           "expired"):
        eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 7)


def test_the_step_fails_through_make_engine_when_sglang_refuses_an_update(monkeypatch, model_dir,
                                                                          tmp_path):
    """make_engine called as nanoareal.main calls it; the update raises instead of generating on."""
    from transformers import AutoModelForCausalLM

    install_fake_sglang(monkeypatch, new=True, fail={"update_weights_from_tensor": "no memory"})
    eng = rollout.make_engine(config(rollout_backend="sglang", model=model_dir,
                                     run_dir=str(tmp_path), seed=0, weight_sync="auto"),
                              torch.device("cpu"))
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed at step 3: no mem"):
        eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 3)


def test_deterministic_rollouts_turn_on_sglang_deterministic_inference_and_send_seeds(
        monkeypatch, model_dir):
    from transformers import AutoModelForCausalLM

    log = install_fake_sglang(monkeypatch, new=True)
    eng = SGLangEngine(model_dir, device="cpu", deterministic=True)
    eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 0)
    eng.generate(PROMPTS[:2], SAMPLING, [5, 6])
    assert log[0][1]["enable_deterministic_inference"] is True
    assert [p["sampling_seed"] for p in log[-1][1]] == [5, 6]
    SGLangEngine(model_dir, device="cpu")
    assert "enable_deterministic_inference" not in [e[1] for e in log if e[0] == "init"][-1]


def test_iter_buckets_respects_the_budget_and_marks_the_last(monkeypatch):
    monkeypatch.setattr(rollout, "SYNC_BUCKET_MB", 80 / 2**20)  # 20 float32
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 100])]
    buckets = list(rollout.iter_buckets(iter(named), "cpu"))
    assert [[n for n, _ in b] for b, _ in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [last for _, last in buckets] == [False, False, False, True]


# -----------------------------------------------------------------------------
# one interface


def test_the_three_engines_implement_the_engine_protocol_with_identical_signatures(
        monkeypatch, model_dir, server, tmp_path):
    methods = ["generate", "update_weights", "release_memory", "resume_memory", "shutdown"]
    for cls in (HFEngine, SGLangEngine, RemoteSGLangEngine):
        for name in methods:
            assert inspect.signature(getattr(cls, name)) == \
                inspect.signature(getattr(rollout.Engine, name)), (cls.__name__, name)
    install_fake_sglang(monkeypatch, new=True)
    engines = [rollout.make_engine(config(rollout_backend=backend, rollout_url=urls,
                                          model=model_dir, run_dir=str(tmp_path), seed=0),
                                   torch.device("cpu"))
               for backend, urls in (("hf", []), ("sglang", []), ("sglang", [server.url]))]
    assert [type(e) for e in engines] == [HFEngine, SGLangEngine, RemoteSGLangEngine]
    assert [e.overlaps for e in engines] == ["process", "", "thread"]
    assert [e.version for e in engines] == [0, -1, 0]  # in-process: no weights until pushed
    assert [e.held for e in engines] == [None, None, None]  # a CPU engine's is not measured


# -----------------------------------------------------------------------------
# the real training loop through the remote backend


def test_training_loop_runs_through_the_remote_backend_with_faults(server, model_dir, tmp_path,
                                                                   monkeypatch):
    server.abort_after = (2, 1)  # two aborted requests are resubmitted
    server.fail_5xx = 1  # one 5xx is retried
    run_dir = tmp_path / "run"
    argv = ["--rollout-backend", "sglang", "--rollout-url", server.url, "--model", model_dir,
            "--run-dir", str(run_dir), "--steps", "2", "--prompts-per-step", "4", "--group-size",
            "4", "--max-new-tokens", "4", "--eval-every", "0"]
    # In-process (the same argv the CLI parses) to spare a second import of torch + transformers;
    # the loop sets up and tears down its own one-rank process group.
    import nanoareal

    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert nanoareal.run(argv) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "reward" in row] == [1, 2]
    assert server.calls.count("/update_weights_from_disk") == 2
    assert server.abort_after == (0, 1) and server.fail_5xx == 0
    assert all(len(b["input_ids"]) >= 4 for b in server.generate_bodies)
