"""Shared bench plumbing: nanoareal driven in-process through its own functions, one step at a time.

`NanoRun(cfg).step(k)` is the body of `nanoareal.main`'s loop (the batch for step k from the
Rollouts queue -> advantages -> train_on_samples -> weight sync) without the file logging, eval
and progress bar, so a bench can time it step by step and interleave it with something else (TRL)
in the same process.
"""

from __future__ import annotations

import dataclasses
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
import modeling  # noqa: E402
import nanoareal as N  # noqa: E402
import rollout  # noqa: E402
import tasks  # noqa: E402
from rollout import Sample  # noqa: E402


def fix_threads(n: int = 1) -> None:
    """One CPU thread: with 2 threads on this kind of machine some calls randomly take 10-40x
    longer."""
    torch.set_num_threads(n)


def make_config(**overrides) -> N.Config:
    return N.validate_config(N.Config(**overrides), 1)


def load_policy(cfg: N.Config, device: torch.device, ranks: N.Ranks) -> modeling.Model:
    """The policy as N.load_models loads it (its memory plan agreed over ranks, nothing else on
    the GPU), without a reference, a teacher or AdamW."""
    gpu, engine = modeling.gpu_memory(device)
    return modeling.load_model(cfg, device, ranks.world, ranks.cp_group, True,
                               {"gpu": gpu, "engine": engine})


def compile_note(model: modeling.Model) -> str:
    """Whether its decoder layers run compiled, else why eager (its start-up summary's words)."""
    if model.compiled:
        return "compiled"
    return next(part for part in model.summary.splitlines()[0].split("; ")
                if part.startswith("eager"))


class NanoRun:
    """nanoareal's set-up as in `main` (data, reward, engine, FSDP2 model, AdamW, LossReduction,
    the Rollouts queue of --max-staleness) and its loop body one step at a time."""

    def __init__(self, cfg: N.Config):
        self.cfg = cfg
        if dist.is_initialized():
            self.ranks = N.Ranks()
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.ranks, self.device = N.setup_distributed(cfg.cp_size)
        torch.manual_seed(cfg.seed)
        self.data = tasks.load_data(cfg)
        self.reward_fn = tasks.load_reward(cfg.reward)
        self.engine = rollout.make_engine(dataclasses.replace(cfg, run_dir=cfg.run_dir or
                                                              "runs/bench"), self.device,
                                          share=cfg.max_staleness == 0 and self.ranks.world == 1)
        self.model, _, _, self.optimizer = N.load_models(cfg, self.device, self.ranks,
                                                         self.engine)
        # as nanoareal.resume does: the trainer's tensors (share), its adapters, or the weights
        # an engine that started released lacks (version -1)
        if cfg.lora_adapter or self.engine.share or self.engine.version < 0:
            self.engine.update_weights(self.model.module, 0)
        self.reduction = L.build_loss(cfg, cp_factor=self.ranks.cp_size)
        self.rollouts = rollout.Rollouts(
            lambda s: N.rollout_batch(self.engine, self.data, self.reward_fn, s, cfg, self.ranks),
            cfg.max_staleness, self.engine.overlaps, {})

    def prompts(self, step: int) -> list[int]:
        return N.prompts_for_step(len(self.data.rows), self.cfg.prompts_per_step, step,
                                  self.cfg.seed)

    def rollout(self, step: int) -> list[Sample]:
        """This step's batch, its advantages set: what train_on_samples takes."""
        samples = self.rollouts.take(step)
        N.set_advantages(samples, self.cfg, N.Ranks(), None)
        return samples

    def train(self, samples: list[Sample]) -> tuple[dict, dict]:
        return N.train_on_samples(self.model, None, self.optimizer, self.reduction, samples,
                                  self.cfg, self.ranks)

    def step(self, step: int) -> dict[str, float]:
        """One full GRPO step, timed like `main`; returns times and token counts (main's metric
        formatting and file logging are left out)."""
        t0 = time.perf_counter()
        samples = self.rollout(step)
        t1 = time.perf_counter()
        sums, stats = self.train(samples)
        t2 = time.perf_counter()
        self.rollouts.wait()
        t3 = time.perf_counter()
        self.engine.update_weights(self.model.module, step + 1)
        t4 = time.perf_counter()
        generated = sum(len(s.completion.output_ids) for s in samples)
        return {"time/step": t4 - t0, "time/rollout": t1 - t0 + t3 - t2, "time/train": t2 - t1,
                "time/sync": t4 - t3, "generated_tokens": generated,
                "real_tokens": sums["trained_tokens"], "grad_norm": stats["grad_norm"]}

    def close(self) -> None:
        self.rollouts.close()


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
