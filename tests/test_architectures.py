"""Every common Hugging Face family either trains exactly or is refused at start.

Tiny random models (2 layers, hidden 32, a 32-token vocabulary) of each family go through
nanoareal's own training step: load_model (the start-up check, FSDP2 over the family's decoder
blocks, the packed attention), pack_microbatches with a token budget that cuts groups apart,
shared prompts on and off, train_on_samples. Its gradient must equal that of the same objective
computed from a plain padded `AutoModelForCausalLM` forward (right padding, attention mask, eager
attention) to 1e-5 relative. Families whose semantics nanoareal does not reproduce must be refused
by load_model in one line naming the model type.
"""

import random

import pytest
import torch
from reference import GradCapture
from transformers import AutoConfig, AutoModelForCausalLM

import loss as L
import modeling
import nanoareal as N
from cli import UserError
from rollout import Completion, Sample

COMMON = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=1)
# model_type -> what makes the family itself: windows shorter than the sequences, softcaps,
# biases, logit scaling, partial rotary, absolute positions, MoE
FAMILIES = {
    "llama": {},
    "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mistral": {"sliding_window": 5},
    "gemma2": {"sliding_window": 5, "attn_logit_softcapping": 0.05, "final_logit_softcapping": 0.5,
               "query_pre_attn_scalar": 8},
    "gemma3_text": {"sliding_window": 5, "query_pre_attn_scalar": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "phi": {"partial_rotary_factor": 0.5, "num_key_value_heads": 4},  # lm_head with a bias
    "phi3": {},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128},
    "gpt_neox": {"rotary_pct": 0.5, "num_key_value_heads": None},
    "granite": {"logits_scaling": 4.0},
    "cohere": {"logit_scale": 0.5},
    "olmo2": {},
    "starcoder2": {"sliding_window": 5},
}
REFUSED = {"stablelm": {}, "falcon": {"head_dim": None, "num_key_value_heads": None}}


def build(tmp_path, family: str, extra: dict) -> str:
    kw = {k: v for k, v in (COMMON | extra).items() if v is not None}
    config = AutoConfig.for_model(family, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if family == "phi":  # random init leaves the lm_head bias at 0: make it matter
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    path = tmp_path / family
    model.save_pretrained(path)
    return str(path)


def samples(seed: int = 0) -> list[Sample]:
    """Five groups of 2-4 samples, prompts of 2-9 tokens, completions of 1-8 (longer than the
    windows), advantages of both signs."""
    rng = random.Random(seed)
    out = []
    for g in range(5):
        prompt = [rng.randrange(2, 32) for _ in range(rng.randint(2, 9))]
        for _ in range(rng.randint(2, 4)):
            ids = [rng.randrange(2, 32) for _ in range(rng.randint(1, 8))]
            out.append(Sample(g, prompt, Completion(ids, [-1.0] * len(ids), "stop"),
                              advantage=rng.uniform(-1, 1)))
    return out


def token_mean_objective(model, batch: list) -> torch.Tensor:
    """token_mean PPO at ratio 1 on any model: -sum_i A_i sum_t ratio_it / sum_i |o_i| from a plain
    right-padded forward; its gradient is -sum_i A_i sum_t grad log pi(o_it) / sum_i |o_i|."""
    seqs = [s.prompt_ids + s.completion.output_ids for s in batch]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    logp = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().log_softmax(-1)
    total, tokens = 0.0, 0
    for b, s in enumerate(batch):
        p, n = len(s.prompt_ids), len(s.completion.output_ids)
        token_logp = logp[b, p - 1 : p - 1 + n].gather(-1, ids[b, p : p + n, None]).squeeze(-1)
        total = total - s.advantage * torch.exp(token_logp - token_logp.detach()).sum()
        tokens += n
    return total / tokens


def padded_reference_grads(path: str, batch: list[Sample]) -> dict[str, torch.Tensor]:
    """token_mean_objective's gradient from a plain eager model loaded from `path`."""
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    token_mean_objective(model, batch).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_gradient_equals_a_plain_padded_forward(family, tmp_path, one_rank_group,
                                                              monkeypatch):
    path = build(tmp_path, family, FAMILIES[family])
    batch = samples()
    want = padded_reference_grads(path, batch)
    scale = torch.cat([g.flatten() for g in want.values()]).norm()
    assert scale > 0
    for share in (True, False):
        monkeypatch.setattr(N, "SHARE_PROMPTS", share)
        cfg = N.Config(model=path, micro_batch_tokens=24, grad_clip=1e9,
                       loss_aggregation="token_mean")
        model = modeling.load_model(cfg, torch.device("cpu"))
        capture = GradCapture(model.module)
        N.train_on_samples(model, None, capture, L.build_loss(cfg), batch, cfg, N.Ranks())
        got = capture.grads
        assert got.keys() <= want.keys() and len(got) >= len(want) - 1  # tied weights: one name
        diff = torch.cat([(got[n] - want[n]).flatten() for n in got]).norm()
        assert diff <= 1e-5 * scale, f"{family} share_prompts={share}: relative {diff / scale:.2e}"


def test_the_families_exercise_what_makes_them_different():
    """Windows shorter than the sequences, a biased head, softcaps and logit scales: without
    them the test above would pass for a trainer that ignores them."""
    longest = max(len(s.prompt_ids) + len(s.completion.output_ids) for s in samples())
    assert longest > 2 * FAMILIES["mistral"]["sliding_window"]
    assert FAMILIES["granite"]["logits_scaling"] != 1 and FAMILIES["cohere"]["logit_scale"] != 1


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_nanoareal_does_not_reproduce_is_refused_in_one_line(family, tmp_path,
                                                                      one_rank_group):
    path = build(tmp_path, family, REFUSED[family])
    with pytest.raises(UserError) as refused:
        modeling.load_model(N.Config(model=path), torch.device("cpu"))
    message = str(refused.value)
    assert "\n" not in message and f"({family})" in message and "not supported" in message
