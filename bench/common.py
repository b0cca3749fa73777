"""Shared bench plumbing: nanoareal driven in-process through its own functions, one step at a time.

`NanoRun(cfg).step(k)` is the body of `nanoareal.main`'s loop (rollout -> reward -> advantages -> train_on_samples
-> scheduler -> update_weights -> metrics) without the file logging, eval and progress bar, so a bench can time
it step by step and interleave it with something else (TRL) in the same process.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.chdir(ROOT)  # the default model path (assets/tiny-arith) is relative to the repository root

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import loss as L  # noqa: E402
import nanoareal as N  # noqa: E402


def fix_threads(n: int = 1) -> None:
    """One CPU thread: with 2 threads on this kind of machine some calls randomly take 10-40x longer (NOTES.md)."""
    torch.set_num_threads(n)


def make_config(**overrides) -> N.Config:
    cfg = N.Config(**overrides)
    return N.validate_config(cfg, 1)


class NanoRun:
    """nanoareal's set-up (model, optimizer, scheduler, LossReduction, HF rollout engine) as in `main`."""

    def __init__(self, cfg: N.Config):
        from transformers import AutoTokenizer

        self.cfg = cfg
        if dist.is_initialized():
            self.device = torch.device("cuda" if torch.cuda.is_available() and cfg.device != "cpu" else "cpu")
        else:
            self.device = N.setup_distributed(cfg)
        N.setup_context_parallel(cfg, self.device)
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.train_items, _ = N.make_arithmetic_task()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id
        self.engine = N.make_engine(cfg, self.device)
        self.model = N.load_model(cfg.model, self.device, torch.float32, False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.reduction = L.build_loss(mode=cfg.loss_aggregation, policy_loss=cfg.policy_loss,
                                      divisor=cfg.loss_aggregation_divisor, eps_low=cfg.eps_low,
                                      eps_high=cfg.eps_high, entropy_coef=cfg.entropy_coef)
        self.encoded: dict[int, list[int]] = {}

    def prompts(self, step: int) -> list[int]:
        indices = N.prompts_for_step(len(self.train_items), self.cfg.prompts_per_step, step, self.cfg.seed)
        for g in indices:
            if g not in self.encoded:
                self.encoded[g] = N.encode_prompt(self.train_items[g], self.tokenizer, self.cfg.chat_template)
        return indices

    def rollout(self, step: int) -> list[N.Sample]:
        """Rollout + reward + advantages: the samples `train_on_samples` takes."""
        cfg = self.cfg
        samples = N.rollout(self.engine, self.train_items, self.prompts(step), step, cfg, self.tokenizer,
                            self.encoded)
        texts = self.tokenizer.batch_decode([s.completion.output_ids for s in samples], skip_special_tokens=True)
        answers = [self.train_items[s.group]["answer"] for s in samples]
        if hasattr(N, "compute_rewards"):  # main's reward call (worker thread with a timeout)
            scores, _ = N.compute_rewards(N.REWARDS[cfg.reward], texts, answers, cfg.reward_timeout)
        else:
            scores = [N.REWARDS[cfg.reward](t, a) for t, a in zip(texts, answers)]
        for s, r in zip(samples, scores):
            s.reward = r
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        adv = N.group_advantages(rewards, groups, cfg.adv_estimator, cfg.adv_std, cfg.adv_eps)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        return samples

    def train(self, samples: list[N.Sample]) -> dict:
        stats = N.train_on_samples(self.model, None, self.optimizer, self.reduction, samples, self.cfg, self.device,
                                   self.pad_id)
        self.scheduler.step()
        return stats

    def step(self, step: int) -> dict[str, float]:
        """One full GRPO step, timed like `main` (t0..t3); returns times and token counts (main's metric formatting
        and file logging are left out)."""
        t0 = time.perf_counter()
        samples = self.rollout(step)
        t1 = time.perf_counter()
        rewards = torch.tensor([s.reward for s in samples])
        groups = torch.tensor([s.group for s in samples], dtype=torch.long)
        stats = N.rollout_stats(samples, N.group_is_constant(rewards, groups), groups)
        train_stats = self.train(samples)
        t2 = time.perf_counter()
        self.engine.update_weights(self.model)
        t3 = time.perf_counter()
        m = N.all_reduce_sum(stats | train_stats.pop("sums"))  # main's one metrics collective
        return {"time/step": t3 - t0, "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2,
                "generated_tokens": m["response_len_sum"], "real_tokens": m["response_len_sum"] + m["prompt_len_sum"],
                "grad_norm": train_stats["grad_norm"]}


class PositionCounter:
    """Counts the positions a decoder computes in *training* forwards (grad enabled) and how many are real tokens.

    Hooks the inner decoder (`model.model`), which both nanoareal's `policy_logprobs` and a plain HF forward call.
    A real token is one whose attention_mask is 1; with no mask (packed rows) every position is real unless the
    caller says otherwise.
    """

    def __init__(self, decoder: torch.nn.Module):
        self.computed = 0
        self.masked_real = 0
        self.handle = decoder.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        self.computed += ids.numel()
        mask = kwargs.get("attention_mask")
        self.masked_real += int(mask.sum()) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else ids.numel()

    def reset(self):
        self.computed = self.masked_real = 0


def summarize(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def fmt_spread(xs: list[float], scale: float = 1.0, digits: int = 3) -> str:
    med, lo, hi = summarize([x * scale for x in xs])
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"
