"""The hf engine's decode loop (rollout.HFEngine, rollout.kv_cache, rollout.sample_tokens) against
plain references: transformers' own DynamicCache in the same loop (bit for bit), a forward of each
whole sequence without a cache (to float rounding), and the sampler's out-of-place hash."""

from __future__ import annotations

import pytest
import torch
from sglang_standin import save_tiny_llama

import modeling
import rollout
from rollout import HFEngine, SamplingParams

torch.set_num_threads(1)

P = [[3 + i % 10, 13, 3 + (i * 7) % 10, 14] for i in range(4)]  # "a+b=" in the tiny vocabulary
CASES = {  # rows finishing early (stop 1), groups, left padding (3 lengths), truncation, greedy
    "groups": ([p for p in P[:3] for _ in range(4)], SamplingParams(12, 1.0, stop_token_ids=[1])),
    "padded, top-p and top-k": ([P[0], [5, 6, *P[1]], P[2][:2], P[0], [7, 8, 9, 10, 11, *P[3]]] * 2,
                                SamplingParams(10, 0.8, 0.9, 5, stop_token_ids=[1, 4])),
    "greedy": ([P[0], [5, 6, *P[1]], P[2][:2]], SamplingParams(9, 0.0, stop_token_ids=[1])),
    "no stop": ([P[0]] * 5 + [P[1]] * 3, SamplingParams(16, 1.3, 0.7)),
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return HFEngine(save_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def generate(engine, case: str) -> list[rollout.Completion]:
    prompts, sampling = CASES[case]
    return engine.generate(prompts, sampling, [100 + i for i in range(len(prompts))])


@pytest.mark.parametrize("case", list(CASES))
def test_the_in_place_kv_cache_decodes_bit_for_bit_as_transformers_dynamic_cache(
        engine, monkeypatch, case):
    from transformers import DynamicCache

    got = generate(engine, case)
    monkeypatch.setattr(rollout, "kv_cache", lambda capacity: DynamicCache())  # grows by cat
    want = generate(engine, case)
    assert [(c.output_ids, c.logprobs, c.finish_reason) for c in got] == \
        [(c.output_ids, c.logprobs, c.finish_reason) for c in want]
    assert len({len(c.output_ids) for c in got}) > 1 or case == "no stop"  # rows left early


@pytest.mark.parametrize("case", list(CASES))
def test_each_sampled_token_is_the_samplers_pick_from_a_full_forward_of_its_sequence(engine, case):
    """No cache, no batch, no padding: each completion's log-probs to float rounding, and every
    token the counter-based noise's pick from those logits at its (seed, position)."""
    prompts, sampling = CASES[case]
    model, scale = engine.model, modeling.head_transform(engine.model.config)[0]
    for i, (prompt, c) in enumerate(zip(prompts, generate(engine, case))):
        full = torch.tensor([prompt + c.output_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(prompt) - 1 : -1].float() * scale
        for t, (token, logp) in enumerate(zip(c.output_ids, c.logprobs)):
            got, lp = rollout.sample_tokens(logits[t : t + 1], sampling, torch.tensor([100 + i]), t)
            assert int(got) == token, (i, t)
            assert abs(float(lp) - logp) < 1e-5, (i, t, float(lp), logp)


def out_of_place_pick(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor,
                      position: int) -> torch.Tensor:
    """The sampler's noise as first written: a new int64 / float64 [B, V] tensor per operation."""
    def fmix(h):
        for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
            h = ((h ^ (h >> shift)) * mul) & 0xFFFFFFFF
        return h ^ (h >> 16)
    key = fmix(seeds ^ ((position * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF))
    token = torch.arange(logits.shape[-1]) * 0x632BE5AB & 0xFFFFFFFF
    h = fmix(fmix(key[:, None] ^ token[None, :]) ^ 0x5BD1E995)
    gumbel = -torch.log(-torch.log((h.to(torch.float64) + 0.5) / 2**32))
    return ((logits / sampling.temperature).double() + gumbel).argmax(-1)


@pytest.mark.parametrize("vocab", [7, 49152])
def test_the_in_place_hash_samples_the_out_of_place_hashs_tokens(vocab):
    g = torch.Generator().manual_seed(vocab)
    seeds = torch.cat([torch.arange(60) * 7919 + 13, torch.tensor([2**31 - 1, 2**31, 2**32 - 1,
                                                                   0])])
    logits = torch.randn(64, vocab, generator=g)  # seeds with the top bit set: int32's sign bit
    for position in (0, 5, 511):
        got, _ = rollout.sample_tokens(logits, SamplingParams(4, 1.0), seeds, position)
        assert torch.equal(got, out_of_place_pick(logits, SamplingParams(4, 1.0), seeds, position))
    assert rollout.mix_seed(1, 2, 3) == 3252709146  # the Python-int path of the in-place fmix32


def test_the_cpu_engine_runs_big_weights_on_packed_copies_to_float_rounding(monkeypatch,
                                                                             tmp_path):
    """modeling.linear on pack_weights' oneDNN copies (the CPU engine's nn.Linear forward and
    head) equals F.linear to float rounding (bias or not, any leading dims, rows other than the
    packed count); small weights are not packed; with the tiny model's weights counted big, the
    engine packs them and its tokens are a plain model's full-forward picks."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(1024, 256, generator=g), torch.randn(1024, generator=g)
    packed = modeling.pack_weights([w, w[:64]], 16)
    assert list(packed) == [id(w)]  # fits in cache: F.linear
    with pytest.MonkeyPatch.context() as mp:  # a CPU build without oneDNN: F.linear throughout
        mp.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        assert modeling.pack_weights([w], 16) == {}
    for x in (torch.randn(16, 256, generator=g), torch.randn(4, 1, 256, generator=g),
              torch.randn(300, 256, generator=g)):
        for bias in (None, b):
            got = modeling.linear(x, w, bias, packed)
            want = torch.nn.functional.linear(x, w, bias)  # entries ~16: fp32 rounding ~1e-5
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
            assert got.is_contiguous() and got.shape == want.shape
    monkeypatch.setattr(modeling, "BIG_WEIGHT", 1)
    taken, first = [], torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, w, *a: taken.append(x.shape[-1]) or first(x, w, *a),
                        raising=False)
    path = save_tiny_llama(tmp_path)
    prompts, sampling = CASES["padded, top-p and top-k"]
    engine = HFEngine(path)
    completions = engine.generate(prompts, sampling, [100 + i for i in range(len(prompts))])
    inner = engine.model.config.intermediate_size  # down_proj's input: the decoder's own linears
    assert inner in taken and not engine.packed  # packed copies live for one generate call
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for i, (prompt, c) in enumerate(zip(prompts, completions)):
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + c.output_ids])).logits[0, len(prompt) - 1 : -1]
        for t, (token, logp) in enumerate(zip(c.output_ids, c.logprobs)):
            got, lp = rollout.sample_tokens(logits[t : t + 1], sampling, torch.tensor([100 + i]), t)
            assert int(got) == token and abs(float(lp) - logp) < 1e-5, (i, t)
