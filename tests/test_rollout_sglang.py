"""SGLang backends of rollout.py, on CPU: a stand-in SGLang HTTP server (tests/sglang_standin.py)
for the remote backend, and a fake `sglang` module whose Engine enforces the colocated call
sequence.

Neither is real SGLang: tests/gpu/check_sglang.py runs the same checks against the real thing on
a GPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import pytest
import torch
from sglang_standin import StandinSGLangServer

import rollout
from cli import UserError
from rollout import Completion, HFEngine, RemoteSGLangEngine, SamplingParams, SGLangEngine

torch.set_num_threads(1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -----------------------------------------------------------------------------
# fixtures: a throwaway tiny llama with a character tokenizer (llama model_type: see NOTES tokenizer
# pitfalls)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789+= -*"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    return str(out)


@pytest.fixture
def server(model_dir):
    s = StandinSGLangServer(model_dir).start()
    yield s
    s.stop()


def client(server_or_urls, model_dir, tmp_path, **kw) -> RemoteSGLangEngine:
    urls = server_or_urls if isinstance(server_or_urls, list) else [server_or_urls.url]
    kw = {"timeout": 10.0, "retries": 2, "backoff": 0.01, "health_timeout": 10.0} | kw
    return RemoteSGLangEngine(urls, model_dir, str(tmp_path), **kw)


# "a+b=" in the character vocabulary
PROMPTS = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(6)]
SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8, stop_token_ids=[1])


# -----------------------------------------------------------------------------
# remote backend against the stand-in


def test_remote_generate_returns_the_servers_tokens_and_logprobs(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    seeds = list(range(len(PROMPTS)))
    got = eng.generate(PROMPTS, SAMPLING, seeds)
    # the stand-in's engine, same seeds
    want = HFEngine(model_dir).generate(PROMPTS, SAMPLING, seeds)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-6)
    body = server.generate_bodies[0]
    assert body["return_logprob"] is True and body["rid"]
    params = body["sampling_params"]
    assert params["max_new_tokens"] == 6 and params["stop_token_ids"] == [1]
    eng.shutdown()


def test_prompts_are_spread_round_robin_over_servers(model_dir, tmp_path):
    a, b = StandinSGLangServer(model_dir).start(), StandinSGLangServer(model_dir).start()
    try:
        eng = client([a.url, b.url], model_dir, tmp_path)
        eng.generate(PROMPTS, SAMPLING, [0] * len(PROMPTS))
        assert len(a.generate_bodies) == len(b.generate_bodies) == len(PROMPTS) // 2
    finally:
        a.stop()
        b.stop()


def test_abort_resubmits_prompt_plus_tokens_so_far_with_reduced_budget(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)  # no stop token: always 6 tokens
    server.abort_after = (1, 2)  # the first request is aborted after 2 tokens
    c = eng.generate([PROMPTS[0]], sampling, [5])[0]
    first, second = server.generate_bodies
    assert second["input_ids"] == PROMPTS[0] + c.output_ids[:2]
    assert second["sampling_params"]["max_new_tokens"] == 4
    assert second["rid"] != first["rid"]
    assert len(c.output_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"


def test_abort_beyond_the_retry_budget_returns_an_abort_completion(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path, abort_retries=2)
    server.abort_after = (100, 1)
    c = eng.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6), [0])[0]
    assert c.finish_reason == "abort"  # the trainer drops it
    assert len(server.generate_bodies) == 3 and len(c.output_ids) == len(c.logprobs) == 3


def test_5xx_is_retried_then_fails_naming_the_url(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path, retries=3)
    server.fail_5xx = 2
    assert len(eng.generate([PROMPTS[0]], SAMPLING, [0])[0].output_ids) > 0
    server.fail_5xx = 10
    with pytest.raises(RuntimeError, match=rf"{server.url}/generate failed 4 times.*HTTP 503"):
        eng.generate([PROMPTS[0]], SAMPLING, [0])


def test_timeout_is_retried(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path, timeout=0.3)
    server.slow = (1, 1.0)
    assert len(eng.generate([PROMPTS[0]], SAMPLING, [0])[0].output_ids) > 0
    assert len(server.generate_bodies) == 2


def test_server_that_never_becomes_healthy_fails_fast_and_clearly(model_dir, tmp_path, capsys):
    s = StandinSGLangServer(model_dir, start_delay=1e6).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=rf"--rollout-url {s.url}: no healthy SGLang server "
                                            r"after 0.5s.*HTTP 503"):
            client(s, model_dir, tmp_path, health_timeout=0.5)
        assert time.monotonic() - t0 < 5
    finally:
        s.stop()
    with pytest.raises(UserError, match="no healthy SGLang server"):  # nothing listening at all
        client([s.url], model_dir, tmp_path, health_timeout=0.3)


def test_health_wait_says_what_it_waits_for_every_few_seconds(model_dir, tmp_path, capsys):
    s = StandinSGLangServer(model_dir, start_delay=2.0).start()  # 503 while "loading"
    try:
        eng = object.__new__(RemoteSGLangEngine)  # only the health wait, not a whole client
        eng.urls = [s.url]
        eng.wait_healthy(30.0, report_every=0.4)
    finally:
        s.stop()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 2, lines  # ~2 s of 503 at one report per 0.4 s
    assert all(line.startswith(f"waiting for the SGLang server {s.url} (") and "HTTP 503" in line
               for line in lines), lines


def test_older_server_without_sampling_seed_is_still_served(server, model_dir, tmp_path):
    eng = client(server, model_dir, tmp_path)
    server.reject_sampling_seed = True
    assert len(eng.generate(PROMPTS[:2], SAMPLING, [0, 1])) == 2
    assert eng.send_seed is False


# -----------------------------------------------------------------------------
# weight sync through the disk, round trip


def _trainer_logprobs(model, prompt: list[int], completion: Completion,
                      temperature: float) -> torch.Tensor:
    from transformers import AttentionInterface

    import modeling

    AttentionInterface.register("packed", modeling.packed_attention)
    model.set_attn_implementation("packed")
    full = prompt + completion.output_ids
    ids = torch.tensor([full])
    with torch.no_grad():
        lp, _ = modeling.policy_logprobs(model, ids, torch.arange(len(full))[None],
                                         torch.tensor(full[1:] + [0]), temperature)
    return lp[len(prompt) - 1 : len(full) - 1]


@pytest.mark.parametrize("session", [True, False], ids=["sglang>=0.5.21", "sglang<0.5.21"])
def test_disk_sync_round_trip_stand_in_logprobs_equal_trainers(model_dir, tmp_path, session):
    from transformers import AutoModelForCausalLM

    s = StandinSGLangServer(model_dir, weight_update_session=session).start()
    try:
        eng = client(s, model_dir, tmp_path)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        sampling = SamplingParams(max_new_tokens=8, temperature=0.7)
        before = eng.generate([PROMPTS[0]], sampling, [3])[0]
        assert (_trainer_logprobs(model, PROMPTS[0], before,
                                  0.7) - torch.tensor(before.logprobs)).abs().max() > 1e-3

        eng.update_weights(model)
        after = eng.generate([PROMPTS[0]], sampling, [3])[0]
        diff = (_trainer_logprobs(model, PROMPTS[0], after,
                                  0.7) - torch.tensor(after.logprobs)).abs().max()
        assert diff < 1e-5

        sync = [c for c in s.calls if c not in ("/generate", "/health_generate")]
        if session:
            assert sync == ["/begin_weight_update", "/update_weights_from_disk",
                            "/end_weight_update", "/flush_cache"]
        else:  # 404 on begin: an older server, so no end either
            assert sync == ["/begin_weight_update", "/update_weights_from_disk", "/flush_cache"]
        eng.update_weights(model)  # the second sync replaces the first directory
        root = tmp_path / "weights_sync"
        assert sorted(os.listdir(root)) == ["step_000002"]
        assert {"config.json", "model.safetensors",
                "tokenizer.json"} <= set(os.listdir(root / "step_000002"))
    finally:
        s.stop()


# -----------------------------------------------------------------------------
# in-process engine: a fake `sglang` module that enforces SGLang's rules and records the calls


def install_fake_sglang(monkeypatch, new: bool, fail: dict | None = None) -> list:
    """new=True: SGLang >= 0.5.21 (begin/end_weight_update, cuda_graph tag, SamplingParams a
    msgspec.Struct with sampling_seed); False: older. Control calls return (success, message) as
    SGLang's do, never raising: `fail` maps a call's name to the message it fails with."""
    log: list = []
    fail = fail or {}

    def result(name: str):
        return (False, fail[name]) if name in fail else (True, "Succeeded")

    class Engine:
        def __init__(self, **kw):
            assert kw["enable_memory_saver"] and kw["skip_tokenizer_init"] and kw["tp_size"] == 1
            log.append(("init", kw))
            self.released: set[str] = set()
            self.in_session = False

        def generate(self, input_ids, sampling_params, return_logprob):
            assert not self.released, f"generate with released memory {self.released}"
            assert return_logprob and len(input_ids) == len(sampling_params)
            log.append(("generate", sampling_params))
            meta = lambda i, p: {"id": str(i), "finish_reason": {"type": "stop", "matched": 1},
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

    if new:
        def begin_weight_update(self):
            assert not self.in_session
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
    srt = types.ModuleType("sglang.srt")
    mods = {"sglang": sglang, "sglang.srt": srt}
    if new:
        constants = types.ModuleType("sglang.srt.constants")
        constants.GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
        sampling = types.ModuleType("sglang.srt.sampling")
        sp = types.ModuleType("sglang.srt.sampling.sampling_params")

        class SGLSamplingParams:  # like a msgspec.Struct: fields in __struct_fields__, no signature
            __struct_fields__ = ("max_new_tokens", "temperature", "top_p", "top_k",
                                 "stop_token_ids", "sampling_seed")

            def __init__(self, *args, **kwargs):
                pass

        sp.SamplingParams = SGLSamplingParams
        mods |= {"sglang.srt.constants": constants, "sglang.srt.sampling": sampling,
                 "sglang.srt.sampling.sampling_params": sp}
    else:  # older versions: no cuda_graph tag, no sampling_seed
        mods |= {"sglang.srt.constants": None, "sglang.srt.sampling.sampling_params": None}
    for k, v in mods.items():
        monkeypatch.setitem(sys.modules, k, v)
    # the trainer's CUDA cache is emptied right before SGLang maps its memory back
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return log


@pytest.mark.parametrize("new", [True, False], ids=["sglang>=0.5.21", "sglang<0.5.21"])
def test_colocated_engine_call_sequence_and_buckets(monkeypatch, model_dir, new):
    from transformers import AutoModelForCausalLM

    log = install_fake_sglang(monkeypatch, new)
    # ~5 kB buckets: several of them
    eng = SGLangEngine(model_dir, gpu_id=0, device="cpu", bucket_mb=0.005)
    model = AutoModelForCausalLM.from_pretrained(model_dir)

    out = eng.generate(PROMPTS[:2], SAMPLING, [7, 8])
    assert out[0] == Completion([1], [-0.5], "stop")
    eng.release_memory()  # ---- training happens here ----
    eng.resume_memory()
    eng.update_weights(model, step=1)
    eng.generate(PROMPTS[:1], SAMPLING, [9])
    eng.shutdown()

    graph = ["cuda_graph"] if new else []
    assert all(log[i - 1] == ("empty_cache",) for i, e in enumerate(log) if e[0] == "resume")
    log[:] = [e for e in log if e[0] != "empty_cache"]
    kinds = [e[0] for e in log]
    first_update, last_update = kinds.index("update"), len(kinds) - 1 - kinds[::-1].index("update")
    updates = ["update"] * (last_update - first_update + 1)
    session = (["begin"], ["end"]) if new else ([], [])
    expected = (["init", "generate", "release", "resume", *session[0], *updates, *session[1],
                 "resume", "flush", "generate", "shutdown"])
    assert kinds == expected
    assert log[2] == ("release", ["kv_cache", "weights", *graph])
    assert log[3] == ("resume", ["weights"])
    assert log[kinds.index("flush") - 1] == ("resume", ["kv_cache", *graph])
    init = log[0][1]
    assert init["base_gpu_id"] == 0 and init["model_path"] == model_dir
    assert ("sampling_seed" in log[1][1][0]) is new

    updates = [e for e in log if e[0] == "update"]
    assert len(updates) > 2
    # flush only with the last bucket
    assert [e[2] for e in updates] == [False] * (len(updates) - 1) + [True]
    sent = [item for e in updates for item in e[1]]
    state = model.state_dict()
    assert sorted(n for n, _, _ in sent) == sorted(state)  # every tensor exactly once
    for name, shape, dtype in sent:
        assert shape == tuple(state[name].shape)
        assert dtype == (torch.bfloat16 if state[name].is_floating_point() else state[name].dtype)


@pytest.mark.parametrize("call", ["begin_weight_update", "update_weights_from_tensor",
                                  "end_weight_update"])
def test_a_control_call_reporting_failure_fails_the_step_with_its_message(monkeypatch, model_dir,
                                                                          call):
    from transformers import AutoModelForCausalLM

    install_fake_sglang(monkeypatch, new=True, fail={call: "CUDA IPC handle expired"})
    eng = SGLangEngine(model_dir, device="cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    eng.release_memory()
    with pytest.raises(RuntimeError, match=f"SGLang {call} failed at step 7: CUDA IPC handle "
                                           "expired"):
        eng.update_weights(model, step=7)


def test_the_step_fails_through_the_trainer_when_sglang_refuses_an_update(monkeypatch, model_dir):
    """The trainer's own weight sync (nanoareal's call) raises instead of generating on."""
    from transformers import AutoModelForCausalLM

    import nanoareal as N

    install_fake_sglang(monkeypatch, new=True, fail={"update_weights_from_tensor": "no memory"})
    cfg = N.Config(model=model_dir, rollout_backend="sglang", device="cpu")
    eng = rollout.make_engine(cfg, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="update_weights_from_tensor failed at step 3: no mem"):
        eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 3)


def test_deterministic_rollouts_turn_on_sglang_deterministic_inference_and_send_seeds(
        monkeypatch, model_dir):
    log = install_fake_sglang(monkeypatch, new=True)
    eng = SGLangEngine(model_dir, device="cpu", deterministic=True)
    eng.generate(PROMPTS[:2], SAMPLING, [5, 6])
    assert log[0][1]["enable_deterministic_inference"] is True
    assert [p["sampling_seed"] for p in log[1][1]] == [5, 6]
    SGLangEngine(model_dir, device="cpu")
    assert "enable_deterministic_inference" not in log[-1][1]


def test_deterministic_remote_rollouts_need_servers_launched_deterministic(model_dir, tmp_path):
    s = StandinSGLangServer(model_dir).start()
    try:
        with pytest.raises(UserError, match="--enable-deterministic-inference"):
            client(s, model_dir, tmp_path, deterministic=True)
        s.deterministic = True
        assert client(s, model_dir, tmp_path, deterministic=True).server_info(s.url)[
            "enable_deterministic_inference"] is True
    finally:
        s.stop()


def test_server_info_falls_back_to_the_deprecated_route(model_dir, tmp_path):
    s = StandinSGLangServer(model_dir, legacy_info_only=True).start()
    try:
        assert client(s, model_dir, tmp_path).server_info(s.url)["tp_size"] == 1
        assert s.calls[-2:] == ["/server_info", "/get_server_info"]
    finally:
        s.stop()


def test_a_server_refusing_a_weight_update_session_fails_the_sync_with_its_message(
        model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    s = StandinSGLangServer(model_dir).start()
    try:
        eng = client(s, model_dir, tmp_path)
        s.refuse_session = "another weight update is in progress"
        with pytest.raises(RuntimeError, match="begin_weight_update failed at step 4 .*another "
                                               "weight update is in progress"):
            eng.update_weights(AutoModelForCausalLM.from_pretrained(model_dir), 4)
    finally:
        s.stop()


def test_iter_buckets_respects_the_budget_and_marks_the_last():
    named = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 100])]
    buckets = list(rollout.iter_buckets(iter(named), bucket_bytes=80))  # 20 float32
    assert [[n for n, _ in b] for b, _ in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert [last for _, last in buckets] == [False, False, False, True]


# -----------------------------------------------------------------------------
# the real training loop through the remote backend


def test_training_loop_runs_through_the_remote_backend_with_faults(server, model_dir, tmp_path,
                                                                   monkeypatch):
    server.abort_after = (2, 1)  # two aborted requests are resubmitted
    server.fail_5xx = 1  # one 5xx is retried
    run_dir = tmp_path / "run"
    argv = ["--rollout-backend", "sglang", "--rollout-url", server.url, "--model", model_dir,
            "--run-dir", str(run_dir), "--steps", "2", "--prompts-per-step", "4", "--group-size",
            "4", "--max-new-tokens", "4", "--eval-every", "0", "--device", "cpu",
            "--rollout-retries", "2"]
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
