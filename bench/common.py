"""Shared bench plumbing: nanoareal driven in-process through its own functions, one step at a time.

`NanoRun(cfg).step(k)` is the body of `nanoareal.main`'s loop (rollout -> reward -> advantages ->
train_on_samples -> scheduler -> update_weights -> metrics) without the file logging, eval and
progress bar, so a bench can time it step by step and interleave it with something else (TRL) in
the same process.
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
import rollout  # noqa: E402
import tasks  # noqa: E402


def fix_threads(n: int = 1) -> None:
    """One CPU thread: with 2 threads on this kind of machine some calls randomly take 10-40x
    longer."""
    torch.set_num_threads(n)


def make_config(**overrides) -> N.Config:
    cfg = N.Config(**overrides)
    return N.validate_config(cfg, 1)


class NanoRun:
    """nanoareal's set-up (model, optimizer, scheduler, LossReduction, rollout engine) as in
    `main`, and its loop body one step at a time."""

    def __init__(self, cfg: N.Config):
        from transformers import AutoTokenizer

        self.cfg = cfg
        if dist.is_initialized():
            cuda = torch.cuda.is_available() and cfg.device != "cpu"
            self.ranks, self.device = N.Ranks(), torch.device("cuda" if cuda else "cpu")
        else:
            self.ranks, self.device = N.setup_distributed(cfg)
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.train_items, _ = tasks.load_dataset(cfg.dataset, None, cfg.reward)
        self.encoded = [tasks.encode_prompt(r, self.tokenizer, cfg.chat_template)
                        for r in self.train_items]
        self.reward_fn = tasks.load_reward(cfg.reward)
        self.engine = rollout.make_engine(cfg, self.device)
        self.model = N.load_model(cfg, self.device, self.ranks)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2),
                                           weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)
        self.reduction = L.build_loss(cfg)

    def prompts(self, step: int) -> list[int]:
        return N.prompts_for_step(len(self.train_items), self.cfg.prompts_per_step, step,
                                  self.cfg.seed)

    def rollout(self, step: int) -> tuple[list[N.Sample], dict]:
        """generate -> reward -> advantages, as main's loop: the samples train_on_samples takes,
        and this step's rollout sums."""
        slots = list(enumerate(self.prompts(step)))
        samples = N.generate(self.engine, self.encoded, slots, step, self.cfg, self.tokenizer)
        sums = N.score(samples, self.train_items, self.reward_fn, self.tokenizer, self.cfg)
        return samples, sums | N.set_advantages(samples, self.cfg)

    def train(self, samples: list[N.Sample]) -> tuple[dict, dict]:
        out = N.train_on_samples(self.model, None, self.optimizer, self.reduction, samples,
                                 self.cfg, self.device, self.ranks)
        self.scheduler.step()
        return out

    def step(self, step: int) -> dict[str, float]:
        """One full GRPO step, timed like `main` (t0..t3); returns times and token counts (main's
        metric formatting and file logging are left out)."""
        t0 = time.perf_counter()
        samples, sums = self.rollout(step)
        t1 = time.perf_counter()
        train_sums, train_stats = self.train(samples)
        t2 = time.perf_counter()
        self.engine.update_weights(self.model)
        t3 = time.perf_counter()
        m = N.reduce_sums(sums | train_sums)  # main's one metrics collective
        return {"time/step": t3 - t0, "time/rollout": t1 - t0, "time/train": t2 - t1,
                "time/sync": t3 - t2, "generated_tokens": m["response_len_sum"],
                "real_tokens": m["response_len_sum"] + m["prompt_len_sum"],
                "grad_norm": train_stats["grad_norm"]}


class PositionCounter:
    """Counts the positions a decoder computes in *training* forwards (grad enabled) and how many
    are real tokens.

    Hooks the inner decoder (`model.model`), which both nanoareal's `policy_logprobs` and a plain
    HF forward call. A real token is one whose attention_mask is 1; with no mask (packed rows)
    every position is real unless the caller says otherwise.
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
        real = isinstance(mask, torch.Tensor) and mask.dim() == 2
        self.masked_real += int(mask.sum()) if real else ids.numel()

    def reset(self):
        self.computed = self.masked_real = 0


def summarize(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def fmt_spread(xs: list[float], scale: float = 1.0, digits: int = 3) -> str:
    med, lo, hi = summarize([x * scale for x in xs])
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"
