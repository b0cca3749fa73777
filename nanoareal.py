"""nanoareal: a minimal, hackable GRPO trainer. This file is the reinforcement-learning loop, read
top to bottom: the config, the loop (generate -> reward -> advantages -> loss -> optimizer step ->
weight sync -> log), then the pieces in the order the loop uses them.

    python nanoareal.py                                   # the built-in arithmetic task, on a CPU
    python nanoareal.py --dataset chain --reward my_reward.py:score   # another task, your reward
    python nanoareal.py --env my_env.py:Calculator  # the policy calls your tool between its turns
    torchrun --nproc_per_node 4 nanoareal.py --cp-size 2  # 2 data-parallel x 2 context-parallel
    python nanoareal.py --max-staleness 2 --correction mask       # rollouts 2 steps ahead
    python nanoareal.py --config configs/qwen2.5-0.5b-gsm8k.toml  # one GPU, SGLang colocated
    python nanoareal.py --steps 0 --model runs/<run>/final --eval-k 8   # evaluate only

Plumbing lives in flat files that never import this one: loss.py (aggregation modes, surrogates,
corrections, the LossReduction contract: gradients independent of micro-batching and world size),
rollout.py (engines, the batches in flight), tasks.py (tasks, data, rewards), packing.py,
modeling.py (packed attention, Ulysses, log-probs), checkpoint.py, logs.py, cli.py. Left out on
purpose: a critic (GRPO needs none), tensor/pipeline parallel in the trainer."""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import random
import time
import types
import typing
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as fsdp_method

import checkpoint
import cli
import loss
import modeling
import packing
import rollout
import tasks
from checkpoint import on_rank0
from cli import UserError
from logs import Logger, print0, reduce_metrics, sample_rows, step_metrics
from loss import MicroBatch, group_advantages
from rollout import Completion, SamplingParams, mix_seed

ROOT = Path(__file__).resolve().parent
ADAM_BETAS, WEIGHT_DECAY = (0.9, 0.99), 0.0  # AdamW: RL steps are few and noisy, no decay
SHARE_PROMPTS = True  # feed a group's prompt once per micro-batch (exact; off only to compare)
ATTENTION = "auto"  # auto | flash_attn | torch_varlen | sdpa: force a kernel when benchmarking
REWARD_TIMEOUT_S = 30.0  # a reward call that takes longer scores 0 and is counted
DIST_TIMEOUT_S = 1800.0  # a collective waits this long for a peer: a dead rank never hangs a run
MAX_BAD_STEPS = 3  # stop after this many steps in a row with a non-finite gradient norm
CKPT_MINUTES = 10.0  # save a checkpoint when this long has passed since the last one
CHECKPOINT_LAYERS = None  # rerun in backward, exact: True every decoder layer (~10x less memory),
# "selective" its elementwise work (~half); None: on a GPU True where the memory plan needs it,
SELECTIVE_FROM = 2**20  # a CPU: selective if a whole micro-batch's layer input has this many
RERUN_FROM = 2**19  # elements; yet a micro-batch's own under this many runs as is (135M: -12%)
COMPILE_FROM = 5 * 10**7  # --compile: decoder layers' parameters; fewer gain less than it costs

# -----------------------------------------------------------------------------
# config: one flat set of flags, `--help` its documentation. A Volatile flag changes how a run is
# watched or how long it goes, not what it computes: a rerun with another value continues the run.

T = TypeVar("T")
Volatile = Annotated[T, "volatile"]


@dataclass
class Config:
    # run
    model: str = "assets/tiny-arith"
    """Hugging Face causal-LM directory or hub id, an export (runs/<run>/final) or a checkpoint."""
    run_dir: Volatile[str | None] = None
    """Where metrics, samples and checkpoints go; default runs/<dataset>-<mode>-s<seed>-<hash>."""
    seed: int = 0
    """Seed of the run: prompt order and sampling noise are functions of (seed, step)."""
    steps: Volatile[int] = 100
    """Training steps, one rollout batch each; 0 evaluates --model without training."""
    config: Volatile[str | None] = None
    """A TOML file of flag defaults (keys are flag names); flags on the command line win."""
    resume: Volatile[str] = "auto"
    """auto continues the run in --run-dir; fresh moves it aside first; or a checkpoint's path."""

    # data
    dataset: str = "arithmetic"
    """A built-in task (arithmetic, chain, calc: each brings its model and flags) or JSONL file."""
    eval_dataset: str | None = None
    """A JSONL file of held-out rows (a built-in task has its own; --steps 0 uses --dataset)."""
    prompt_key: str = "prompt"
    """The JSONL field holding the prompt text (rows may carry "messages" instead)."""
    chat_template: bool = False
    """Wrap each prompt in the tokenizer's chat template as a user turn."""
    reward: str = "auto"
    """auto (the task's own), exact_match, gsm8k, last_number, math, format, length, or
    path/to/file.py:function; several summed with weights: "exact_match,0.1*format"."""
    env: str | None = None
    """path/to/file.py:Class: an environment answering the policy's tool calls (multi-turn)."""
    max_turns: int = 4
    """With --env: most policy turns in an episode (a tool call past them ends it: "length")."""

    # rollout
    prompts_per_step: int = 64
    """Prompts per step, all ranks together; each is a group of --group-size samples."""
    group_size: int = 8
    """Samples per prompt (G in GRPO): advantages compare the samples of one group."""
    max_new_tokens: int = 8
    """Longest completion in tokens; one cut there ends with finish reason "length"."""
    temperature: float = 1.0
    """Sampling temperature of rollouts and eval samples; the trainer's log-probs use it too."""
    top_p: float = 1.0
    """Sample from the likeliest tokens holding p; all log-probs stay log_softmax(logits / T)."""
    top_k: int = -1
    """Sample from the k likeliest tokens (-1: all); log-probs stay untruncated, as SGLang's."""
    max_staleness: int = 0
    """K: the batch of step s is sampled by the weights of step s-K, generated while s-K trains."""
    rollout_backend: Literal["hf", "sglang"] = "hf"
    """hf: transformers on this rank's device; sglang: in-process on this GPU, or --rollout-url."""
    rollout_url: Volatile[list[str]] = field(default_factory=list)
    """SGLang server URLs; none with --rollout-backend sglang runs SGLang in-process."""
    sglang_deterministic: bool = False
    """Reproducible SGLang rollouts (its deterministic inference, seeds sent): slower sampling."""
    weight_sync: Volatile[Literal["auto", "tensor", "disk", "nccl"]] = "auto"
    """How new weights reach SGLang: auto is tensor in-process, nccl to servers where it can."""

    # advantages
    adv_estimator: Literal[loss.ADVANTAGES] = "grpo"  # type: ignore[valid-type]
    """Baseline of a sample's reward: grpo, its group's mean; rloo, the mean of the others."""
    adv_std: Literal[tuple(loss.ADV_STDS)] = "group"  # type: ignore[valid-type]
    """Divide grpo advantages by the group's reward std, the whole batch's, or none (Dr. GRPO)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (DAPO's dynamic-sampling filter, no resampling)."""
    mask_truncated: bool = False
    """Leave responses cut by --max-new-tokens out of the loss and its denominators (DAPO)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: the last N tokens up to --max-new-tokens cost 0 to 1 reward."""

    # loss (formulas in loss.py and docs/losses.md)
    policy_loss: Literal[tuple(loss.SURROGATES)] = "ppo"  # type: ignore[valid-type]
    """Policy surrogate: ppo (clipped ratio), gspo (sequence ratio), cispo or sapo."""
    loss_aggregation: Literal[("auto", *loss.MODES)] = "auto"  # type: ignore[valid-type]
    """token_mean (DAPO), seq_mean (GRPO), prompt_mean or constant (Dr. GRPO); auto: surrogate's."""
    loss_aggregation_divisor: float | None = None
    """The C of constant (token-loss sum / (responses x C)); default --max-new-tokens."""
    eps_low: float | None = None
    """The ratio is clipped below at 1 - eps_low; default the surrogate's (0.2, gspo 3e-4)."""
    eps_high: float | None = None
    """The ratio is clipped above at 1 + eps_high; default the surrogate's (0.2, gspo 4e-4)."""
    correction: Literal[("auto", *loss.CORRECTIONS)] = "auto"  # type: ignore[valid-type]
    """Off-policy correction: none, behave, truncate, mask, m2po; auto is none at K = 0, else the
    one docs/studies.md shows holding (behave; truncate with several updates per batch)."""
    correction_threshold: float | None = None
    """The cap on pi_prox/pi_behave of truncate/mask (default 2), M2PO's threshold (0.04)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus (the token mean of the policy's entropy, subtracted)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the initial policy (loads a frozen reference copy)."""
    kl_estimator: Literal[tuple(loss.KL_ESTIMATORS)] = "k3"  # type: ignore[valid-type]
    """The KL penalty's estimator: k1 (zero mean gradient), k2 (reverse KL's), k3 (forward KL's)."""

    # optimization
    lr: float = 0.0
    """AdamW learning rate after --warmup-steps; 0: 1e-4, or with --lora-rank 1e-3 (LoRA's)."""
    warmup_steps: int = 2
    """Steps of linear learning-rate warm-up, from lr/(warmup+1) up to lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or cosine decay to 0 at --steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this before each optimizer step; 0 turns it off."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch, each on a share of its groups."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (TRL num_iterations), the clip centred on its pi_prox."""
    micro_batch_tokens: int = 4096
    """Token budget of a packed micro-batch: bigger means fewer passes and more memory."""
    lora_rank: int = 0
    """Train LoRA adapters of this rank on the frozen model (peft); 0 trains every weight."""
    lora_adapter: str | None = None
    """Start from this PEFT adapter directory (--model such a directory sets it and its base)."""

    # eval, logging, checkpoints, system
    eval_every: Volatile[int] = 10
    """Held-out evaluation every N steps, at step 0 and at the end; 0 turns it off."""
    eval_k: Volatile[int] = 0
    """Also sample k answers per held-out prompt: mean@k and pass@k (Chen et al. 2021)."""
    ckpt_every: Volatile[int] = 0
    """Also save a checkpoint every N steps (besides every 10 minutes, the end and signals)."""
    wandb_project: Volatile[str | None] = None
    """Also log metrics and sample tables to this Weights & Biases project."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Compute precision; bfloat16 keeps fp32 master weights; auto: bf16 on a GPU, fp32 on a CPU."""
    cp_size: Volatile[int] = 1
    """Context parallel (Ulysses): ranks that split each micro-batch's tokens (exact, same run)."""
    compile: Volatile[bool] = True
    """torch.compile the decoder layers where they hold 50M parameters or more (fused, exact)."""

    def __post_init__(self):
        # defaults that depend on other flags, filled once when the config is made (command line
        # or code); given values stay: a replace() of --policy-loss keeps the clip range filled in
        if self.reward == "auto":  # the built-in task's own reward, exact_match for a JSONL file
            task = tasks.TASKS.get(self.dataset)
            self.reward = task.reward if task else "exact_match"
        self.lr = self.lr or (1e-3 if self.lora_rank or self.lora_adapter else 1e-4)  # studies.md
        for k, v in loss.resolve_loss_flags(
                self.policy_loss, self.loss_aggregation, self.eps_low, self.eps_high,
                self.loss_aggregation_divisor, self.correction, self.correction_threshold,
                self.max_new_tokens, self.max_staleness,
                self.num_minibatches * self.ppo_epochs).items():
            setattr(self, k, v)


VOLATILE = {k for k, hint in typing.get_type_hints(Config, include_extras=True).items()
            if "volatile" in getattr(hint, "__metadata__", ())}
DEFAULTS = {f.name: f.default for f in fields(Config) if f.default is not MISSING}

# -----------------------------------------------------------------------------
# the training loop
def main(argv: list[str]) -> None:
    cfg = parse_config(argv)  # flags, TOML, the task's own flags -> resolved and checked
    ranks, device = setup_distributed(cfg.cp_size)  # torchrun's, or a world of one
    data, reward_fn, resuming = prepare_run(cfg)  # the run directory claimed, data, reward
    engine = rollout.make_engine(  # first: SGLang sizes its KV cache from the GPU memory free
        cfg.rollout_backend, cfg.rollout_url, cfg.model, device, run_dir=cfg.run_dir, seed=cfg.seed,
        weight_sync=cfg.weight_sync, deterministic=cfg.sglang_deterministic,
        share=cfg.max_staleness == 0 and ranks.world == 1)  # K = 0, one rank: trainer's tensors
    model, ref_model, optimizer = load_models(cfg, device, ranks, engine)
    reduction = loss.build_loss(cfg, dist.group.WORLD, cp_factor=ranks.cp_size)
    run = resume(cfg, model, optimizer, engine, ranks, resuming)  # step, updates, batches ahead
    logger = Logger(cfg.run_dir, cfg.steps, run.step, cfg.wandb_project, asdict(cfg))
    rollouts = rollout.Rollouts(lambda s: rollout_batch(engine, data, reward_fn, s, cfg, ranks),
                                cfg.max_staleness, engine.overlaps, run.pending, cfg.steps,
                                share=lambda batch: cp_broadcast(batch, ranks))
    print0(f"nanoareal: {ranks.world} rank(s) on {device.type}, {cfg.model}, {len(data.rows)}/"
           f"{len(data.evalset)} train/eval prompts, {cfg.policy_loss}/{cfg.loss_aggregation}, "
           f"{rollouts.describe()}, run {cfg.run_dir}")
    evaluate = lambda: run.evaluated(tasks.evaluate(engine, data, reward_fn, cfg.max_new_tokens,
        cfg.temperature, cfg.eval_k, cfg.seed, ranks.rank, ranks.world, REWARD_TIMEOUT_S))
    if data.evalset and (cfg.steps == 0 or (cfg.eval_every > 0 and run.step == 0)):
        logger.log(run.step, evaluate())
    with checkpoint.Preemption() as preempt:  # SIGINT/SIGTERM: finish the step, save, exit
        for step in range(run.step, cfg.steps):
            t0 = time.perf_counter()
            # ALGO LOGIC. the batch for this step, sampled and scored by the policy of step
            # max(0, step - K); the engine starts on the batch for step + K meanwhile
            samples = rollouts.take(step)
            set_advantages(samples, cfg, ranks)  # GRPO / RLOO within each group
            sums = rollout_sums(samples, ranks)
            if cfg.filter_zero_variance:  # no signal: only normalizer mass
                samples = [s for s in samples if not s.zero_variance]
            t1 = time.perf_counter()
            # loss and optimizer step(s); a colocated engine frees its GPU memory meanwhile
            engine.release_memory()
            lr = set_lr(optimizer, run.updates, cfg)
            train_sums, stats = train_on_samples(model, ref_model, optimizer, reduction, samples,
                                                 cfg, device, ranks)
            run.updates += int(stats.pop("updated"))
            engine.resume_memory()
            t2 = time.perf_counter()
            rollouts.wait()  # sync: once the batch in flight is done, the engine gets new weights
            t3 = time.perf_counter()
            engine.update_weights(model, step + 1)
            times = {"rollout": t1 - t0 + t3 - t2, "train": t2 - t1,
                     "sync": time.perf_counter() - t3, "step": time.perf_counter() - t0}
            # TRY NOT TO MODIFY: one collective for metrics and what ranks agree on (signal, save)
            sums = reduce_metrics(sums | train_sums | run.flags(preempt))
            metrics = step_metrics(sums, stats, times, lr, step + 1)
            if data.evalset and every(cfg.eval_every, step + 1, cfg.steps):
                metrics |= evaluate()
            logger.log(step + 1, metrics)  # metrics.jsonl, wandb, a console line
            if logger.samples_due(step + 1):  # a few groups to samples.jsonl
                logger.log_samples(step + 1, sample_rows(samples, data.tokenizer))
            end_step(step + 1, sums, metrics, cfg, model, optimizer, run, rollouts, logger)
    rollouts.close()
    logger.close(run.last_eval)
    if cfg.steps > 0:  # also when resumed with nothing left to train: a save killed mid-export
        checkpoint.export_hf(model, data.tokenizer, cfg.model, Path(cfg.run_dir) / "final")
    engine.shutdown()


# -----------------------------------------------------------------------------
# set-up: the config (flags + TOML, resolved once, checked), the ranks, the data
def parse_config(argv: list[str]) -> Config:
    """Flags, --config TOML and a built-in task's own flags -> a resolved, checked Config."""
    preset = lambda dataset: tasks.TASKS[dataset].flags if dataset in tasks.TASKS else {}
    return validate_config(resolve_config(cli.parse(Config, argv, preset)),
                           int(os.environ.get("WORLD_SIZE", 1)))


def resolve_config(cfg: Config) -> Config:
    """The defaults that need the file system: the shipped model from any directory, a
    checkpoint's base model (--model a checkpoint resumes from it), the run directory's name (an
    evaluation, --steps 0, gets its own) and what --steps 0 of a JSONL --dataset alone evaluates."""
    model, resume_from, adapter = cfg.model, cfg.resume, cfg.lora_adapter
    if found := modeling.adapter_config(model):  # a LoRA adapter: its base, its weights, its rank
        model, adapter = found["base_model_name_or_path"], model
    if not Path(model).exists() and (ROOT / model).is_dir():  # assets/... from any directory
        model = str(ROOT / model)
    if (Path(model) / "meta.json").is_file():  # a checkpoint: its run's base model, its weights
        model, resume_from = json.loads((Path(model) / "meta.json").read_text())["config"][
            "model"], cfg.model
    identity = {k: v for k, v in asdict(cfg).items() if k not in VOLATILE}  # --model as given
    # an evaluation of a JSONL --dataset without --eval-dataset evaluates that file
    held = cfg.eval_dataset or (cfg.dataset if not cfg.steps and cfg.dataset not in tasks.TASKS
                                else None)
    cfg = replace(cfg, model=model, resume=resume_from, eval_dataset=held, lora_adapter=adapter,
                  lora_rank=cfg.lora_rank or (modeling.adapter_config(adapter) or {}).get("r", 0))
    identity |= {"model": model} if cfg.steps else {}
    return replace(cfg, run_dir=cfg.run_dir or checkpoint.run_dir_name(
        cfg.dataset, cfg.loss_aggregation if cfg.steps else "eval", cfg.seed, identity))


def validate_config(cfg: Config, world: int) -> Config:
    """Every flag checked before anything heavy loads; a mistake: one UserError line naming it."""
    checks = [
        (min(cfg.prompts_per_step, cfg.max_new_tokens, cfg.micro_batch_tokens, cfg.max_turns) >= 1
         and min(cfg.steps, cfg.eval_every, cfg.eval_k, cfg.warmup_steps, cfg.ckpt_every,
                 cfg.max_staleness) >= 0,
         "--prompts-per-step, --max-new-tokens, --micro-batch-tokens, --max-turns >= 1; --steps, "
         "--eval-every, --eval-k, --warmup-steps, --ckpt-every and --max-staleness >= 0"),
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: a sample alone in its group has no "
         "baseline (every advantage would be 0); use --group-size >= 2"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: rollouts must sample (> 0; "
         "eval/accuracy is greedy anyway)"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr {cfg.lr}: must be a positive number"),
        (cfg.grad_clip >= 0, f"--grad-clip {cfg.grad_clip}: must be > 0, or 0 for no clipping"),
        (1 <= cfg.num_minibatches <= cfg.prompts_per_step,
         "--num-minibatches must be in [1, --prompts-per-step]"),
        (cfg.ppo_epochs >= 1, f"--ppo-epochs {cfg.ppo_epochs}: must be >= 1"),
        (0 <= cfg.overlong_buffer <= cfg.max_new_tokens, f"--overlong-buffer "
         f"{cfg.overlong_buffer}: must be in [0, --max-new-tokens ({cfg.max_new_tokens})]"),
        (0 < cfg.top_p <= 1 and (cfg.top_k >= 1 or cfg.top_k == -1), f"--top-p {cfg.top_p} "
         f"--top-k {cfg.top_k}: top-p must be in (0, 1], top-k -1 (all) or >= 1"),
        (cfg.cp_size >= 1 and world % cfg.cp_size == 0,
         f"--cp-size {cfg.cp_size} must divide the number of ranks ({world})"),
        (not cfg.eval_dataset or cfg.dataset not in tasks.TASKS, f"--eval-dataset is for a JSONL "
         f"--dataset: the built-in task {cfg.dataset!r} has its own held-out split"),
        (cfg.resume in ("auto", "fresh") or (Path(cfg.resume) / "meta.json").is_file(),
         f"--resume {cfg.resume} is not a complete checkpoint (no directory, or a save that never "
         "finished: no meta.json); use --resume auto or fresh"),
    ]
    if problem := next((message for ok, message in checks if not ok), None):
        raise UserError(f"config error: {problem}")
    try:
        loss.check_loss_flags(cfg)
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    modeling.check_lora(cfg.lora_rank, cfg.lora_adapter, cfg.model)
    rollout.check_rollout_config(cfg.rollout_backend, cfg.rollout_url, cfg.weight_sync,
                                 cfg.sglang_deterministic, torch.cuda.is_available())
    return cfg


@dataclass(frozen=True)
class Ranks:
    """This process's place in torchrun's world and the (dp, cp) mesh: ranks [k*cp_size,
    (k+1)*cp_size) are CP group k (dp rank k): one rollout, each micro-batch's tokens split."""
    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: object = None


def setup_distributed(cp_size: int = 1) -> tuple[Ranks, torch.device]:
    """torchrun's environment (or a world of one: one code path for FSDP2 and collectives), this
    rank's device, the (dp, cp) mesh. Threads: OMP_NUM_THREADS, else 1 (stable on CPUs)."""
    cuda = torch.cuda.is_available()
    alone = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=DIST_TIMEOUT_S),
                            **alone)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    elif platform.libc_ver()[0] == "glibc":  # freed blocks went back to the OS, so each step's
        # buffers page-faulted afresh (0.5B shape: 130-550k faults, ~1 s a training step): mmap
        # only past 1 GiB (older glibc: 32 MB), never trim the heap (M_MMAP_, M_TRIM_THRESHOLD)
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 30) or libc.mallopt(-3, 32 << 20), libc.mallopt(-1, 2**31 - 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    cp = cp_size if world % cp_size == 0 else 1  # else: validate_config has said so
    cp_group = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))[
        "cp"].get_group() if cp > 1 else None
    return Ranks(rank, world, rank // cp, world // cp, rank % cp, cp, cp_group), device


def prepare_run(cfg: Config) -> tuple[tasks.Data, object, bool]:
    """(data, reward, whether the run directory, claimed now or refused, holds a run to resume)."""
    reward_fn = tasks.load_reward(cfg.reward)
    modeling.check_model_source(cfg.model)
    resuming = on_rank0(checkpoint.claim_run_dir, cfg.run_dir, asdict(cfg), VOLATILE,
                        cfg.resume == "fresh", DEFAULTS)
    torch.manual_seed(cfg.seed)
    data = tasks.load_data(cfg.model, cfg.dataset, cfg.eval_dataset, cfg.reward, cfg.prompt_key,
                           cfg.chat_template, cfg.max_new_tokens, cfg.micro_batch_tokens)
    data.tools = tasks.load_env(cfg.env, data.tokenizer, cfg.chat_template, cfg.max_turns)
    return data, reward_fn, resuming


def every(n: int, step: int, last: int) -> bool:
    """Due every n steps and at the last step; n = 0 never."""
    return n > 0 and (step % n == 0 or step == last)


def set_lr(optimizer, updates: int, cfg: Config) -> float:
    """Linear warm-up, then constant or cosine to 0 at --steps, counted in steps that updated the
    weights (a step with nothing to learn from moves neither weights nor lr)."""
    factor = (updates + 1) / (cfg.warmup_steps + 1) if updates < cfg.warmup_steps else 1.0
    if updates >= cfg.warmup_steps and cfg.lr_schedule == "cosine":
        progress = (updates - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        factor = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * factor
    return cfg.lr * factor


# -----------------------------------------------------------------------------
# generate and reward: the batches in flight, one step's prompts, group_size samples each
@dataclass
class Sample:
    group: int  # the GRPO group (the prompt's slot in the step): advantages compare within it
    prompt_ids: list[int]
    completion: Completion
    reward: float = 0.0
    advantage: float = 0.0
    zero_variance: bool = False  # every reward of its group is equal (no GRPO signal)
    row: int = -1  # the dataset row of the prompt
    correct: bool | None = None
    version: int = 0  # the policy version (step whose starting weights) that sampled it
    metrics: dict = field(default_factory=dict)  # the reward's own
    reward_error: str | None = None
    gen_s: float = 0.0  # seconds its batch took to generate
    seed: int = 0  # (seed, step, slot, k) mixed: its sampling noise and its reward's random state


def cp_broadcast(obj, ranks: Ranks):
    """The CP group's first rank's object on every rank of the group (one rollout per CP group)."""
    box = [obj]
    if ranks.cp_size > 1:
        dist.broadcast_object_list(box, src=ranks.rank - ranks.cp_rank, group=ranks.cp_group)
    return box[0]


def prompts_for_step(num_rows: int, per_step: int, step: int, seed: int) -> list[int]:
    """Row indices of a step's prompts: an epoch is a seeded permutation cut into steps (rows left
    over sit out the epoch), so no step holds a row twice (fewer rows than --prompts-per-step: fresh
    permutations joined). A function of (seed, step): no loader state, the same on any world."""
    def permutation(epoch: int) -> list[int]:
        perm = list(range(num_rows))
        random.Random(mix_seed(seed, 0xDA7A, epoch)).shuffle(perm)
        return perm

    if per_step > num_rows:
        per = -(-per_step // num_rows)  # permutations per step
        return sum((permutation(step * per + j) for j in range(per)), [])[:per_step]
    epoch, k = divmod(step, num_rows // per_step)
    return permutation(epoch)[k * per_step : (k + 1) * per_step]


def rollout_batch(engine, data: tasks.Data, reward_fn, step: int, cfg: Config,
                  ranks: Ranks) -> list[Sample]:
    """This data-parallel rank's share of the step's groups (every dp_size-th slot: a group never
    straddles ranks), sampled by the engine's current weights and scored. It may run on the
    rollout thread, overlapping training: no collectives here. A CP group's first rank makes it."""
    if ranks.cp_rank != 0:
        return []
    prompts = prompts_for_step(len(data.rows), cfg.prompts_per_step, step, cfg.seed)
    samples = generate(engine, data.prompts, list(enumerate(prompts))[ranks.dp_rank::ranks.dp_size],
                       step, cfg, data.stop_ids, data.tools, data.rows)
    score(samples, data.rows, reward_fn, data.tokenizer, cfg)
    return samples


def generate(engine, encoded: list[list[int]], prompts: list[tuple[int, int]], step: int,
             cfg: Config, stop_ids: list[int], tools=None, rows=None) -> list[Sample]:
    """group_size completions of each (slot, row) prompt, timed (gen_s; one the engine aborted is
    dropped); the slot is the group; seeds (seed, step, slot, k), not the rank's or the batch's."""
    sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, stop_ids)
    slots = [(slot, row) for slot, row in prompts for _ in range(cfg.group_size)]
    seeds = [mix_seed(cfg.seed, step, slot, k) for slot, _ in prompts
             for k in range(cfg.group_size)]
    version, start = engine.version, time.perf_counter()
    completions = rollout.run_episodes(engine, [encoded[r] for _, r in slots], sampling, seeds,
                                       tools, [rows[r] for _, r in slots] if tools else None)
    took = time.perf_counter() - start
    return [Sample(slot, encoded[row], c, row=row, version=version, seed=seed, gen_s=took) for
            (slot, row), c, seed in zip(slots, completions, seeds) if c.finish_reason != "abort"]


def score(samples: list[Sample], rows: list[dict], reward_fn, tokenizer, cfg: Config) -> None:
    """Reward every completion (.reward, .correct, .metrics, .reward_error; random seeded by its
    seed, DAPO's overlong penalty added); a call that raises or hangs scores 0 and is counted."""
    scores = tasks.score_completions(
        reward_fn, tokenizer, [s.completion for s in samples], [rows[s.row] for s in samples],
        REWARD_TIMEOUT_S, [s.seed for s in samples], cfg.overlong_buffer, cfg.max_new_tokens)
    for s, sc in zip(samples, scores):
        s.reward, s.correct, s.metrics, s.reward_error = sc.reward, sc.correct, sc.metrics, sc.error


def rollout_sums(samples: list[Sample], ranks: Ranks) -> dict:
    """This rank's counters of a batch (advantages set) for the step's metrics (logs.MEANS) and its
    generation time (gen_s, a maximum over ranks); a CP group counts its shared batch once."""
    if ranks.cp_rank != 0:
        return {}
    sums = Counter({"samples": len(samples), "reward": 0.0, "judged": 0, "correct": 0})
    for s in samples:
        n = len(s.completion.output_ids)
        sums.update({"reward": s.reward, "response_tokens": n, "version": s.version,
                     "truncated": s.completion.finish_reason == "length",
                     "reward_errors": s.reward_error is not None,
                     "zero_adv": abs(s.advantage) < 1e-12})
        if s.correct is not None:  # response lengths split by correctness: who grows longer
            kind = "correct" if s.correct else "incorrect"
            sums.update({"judged": 1, "correct": s.correct, kind: 1, f"len_{kind}": n})
        for k, v in [*((f"reward/{k}", v) for k, v in s.metrics.items()),
                     *s.completion.episode.items()]:  # the reward's and env's: means per reporter
            sums.update({k: v, f"{k}#n": 1})
    sums["zero_var_groups"] = len({s.group for s in samples if s.zero_variance})
    error = next((s.reward_error for s in samples if s.reward_error), None)
    return dict(sums) | ({"reward_error_message": error} if error else {}) | (
        {"gen_s": samples[0].gen_s} if samples else {})


def set_advantages(samples: list[Sample], cfg: Config, ranks: Ranks = Ranks()) -> None:
    """Each sample's .advantage, and .zero_variance: its group's rewards are all equal."""
    adv = group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float32),
                           torch.tensor([s.group for s in samples], dtype=torch.long),
                           cfg.adv_estimator, cfg.adv_std, copies=ranks.cp_size)
    distinct = Counter(g for g, _ in {(s.group, s.reward) for s in samples})  # per group
    for s, a in zip(samples, adv.tolist()):
        s.advantage, s.zero_variance = a, distinct[s.group] == 1


# -----------------------------------------------------------------------------
# loss and step: packed micro-batches, log-probs, LossReduction, clip, AdamW
def train_on_samples(model, ref_model, optimizer, reduction: loss.LossReduction,
                     samples: list[Sample], cfg: Config, device, ranks: Ranks
                     ) -> tuple[dict, dict]:
    """One rollout batch -> --ppo-epochs x --num-minibatches optimizer steps, each on a share of
    the groups. Returns this rank's counters (the first pass's; reduce_metrics sums them over ranks)
    and the step's stats: grad norm and loss terms (means), skipped steps, whether any update."""
    groups = sorted({s.group for s in samples})
    shares = [set(groups[i :: cfg.num_minibatches]) for i in range(cfg.num_minibatches)]
    packed = []
    for share in shares:  # pi_prox and pi_ref come from the weights before the first update
        mbs = packing.even_out(pack_microbatches([s for s in samples if s.group in share], cfg))
        mbs = frozen_logprobs(model, ref_model, mbs, cfg, device, ranks)
        packed.append(loss.apply_global_mask(mbs, cfg.correction, cfg.correction_threshold,
                                             dist.group.WORLD if ranks.world > 1 else None))
    # positions: what the model was fed (fewer than trained_tokens: shared prompts, no last tokens)
    sums = Counter({"trained_tokens": sum(len(s.prompt_ids) + len(s.completion.output_ids)
                                          for s in samples),
                    "positions": sum(len(mb.input_ids) for mbs in packed for mb in mbs)})
    stats, iw_max, updates = Counter(), 0.0, packed * cfg.ppo_epochs  # pass after pass
    for i, mbs in enumerate(updates):
        counters, mb_iw_max, out = train_minibatch(model, optimizer, reduction, mbs, cfg, device,
                                                   ranks)
        if i < len(packed):  # later passes see the same tokens again
            sums.update(counters)
            iw_max = max(iw_max, mb_iw_max)
        stats.update({k: v / len(updates) for k, v in out.items() if k != "updated"})
        stats["updated"] = max(stats["updated"], out["updated"])
    stats["skipped_steps"] *= len(updates)  # a count, not a mean
    sums = dict(sums) if ranks.cp_rank == 0 else {}  # a CP group counts its tokens once
    return sums | {"importance_weight_max": iw_max}, dict(stats)


def frozen_logprobs(model, ref_model, mbs: list[MicroBatch], cfg: Config, device,
                    ranks: Ranks) -> list[MicroBatch]:
    """Each micro-batch with pi_prox's log-probs when they need a forward of their own (else the
    training forward's serve) and the reference policy's (KL penalty)."""
    policies = {"prox_logprobs": model} if loss.needs_proximal_forward(
        cfg.correction, cfg.num_minibatches * cfg.ppo_epochs) else {}
    policies |= {"ref_logprobs": ref_model} if ref_model is not None else {}
    with torch.no_grad():
        return [replace(mb, **{k: microbatch_forward(p, mb, cfg, device, ranks)[0].float().cpu()
                               for k, p in policies.items()}) for mb in mbs]


def train_minibatch(model, optimizer, reduction: loss.LossReduction, mbs: list[MicroBatch],
                    cfg: Config, device, ranks: Ranks) -> tuple[dict, float, dict]:
    """One optimizer step on a mini-batch's micro-batches (the same number on every rank, for
    FSDP); with nothing to learn from on any rank no step at all (AdamW's momentum would still
    move). Returns this rank's counters, its largest pi_prox/pi_behave and the step's stats."""
    # each token counted once in the normalizers: a CP group's ranks hold the same micro-batches,
    # so its first rank counts (every CP rank computes the full loss: cp_factor puts N into Z)
    reduction.begin_step(mbs if ranks.cp_rank == 0 else [])
    learn = any(reduction.Z.values())
    # counters stay on the device until the end: a float() per micro-batch would sync the GPU
    acc = torch.zeros(4, dtype=torch.float64, device=device)
    iw_max = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(mbs if learn else []):  # FSDP2: one reduce-scatter, after the last
        model.set_requires_gradient_sync(i == len(mbs) - 1 or not model.defer_grad_sync)
        logprobs, entropy = microbatch_forward(model, mb, cfg, device, ranks, grad=True)
        batch = replace(mb.to(device), logprobs=logprobs, entropy=entropy)
        reduction(batch).backward()
        # |log pi_theta - log pi_behave| before the update: ~0 when the engine holds the same
        # weights (larger: stale rollouts, a broken sync); pi_prox/pi_behave: what corrections weigh
        d = batch.denom_mask
        prox = logprobs.detach() if batch.prox_logprobs is None else batch.prox_logprobs
        weight = torch.exp(loss.log_ratio(prox, batch.behave_logprobs)).double()
        acc += torch.stack([x.double() for x in (d.sum(), (entropy.detach() * d).sum(),
            ((logprobs.detach() - batch.behave_logprobs).abs() * d).sum(), (weight * d).sum())])
        iw_max = torch.maximum(iw_max, torch.where(d > 0, weight, 0.0).max())
    out = {"updated": 0.0, "skipped_steps": 0.0, "grad_norm": 0.0}
    if learn:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                              cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        out["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(out["grad_norm"])  # a global norm: all ranks step or skip together
        if finite:
            optimizer.step()
        out["updated" if finite else "skipped_steps"] = 1.0
    optimizer.zero_grad(set_to_none=True)
    counters = dict(zip(("denom_tokens", "entropy", "mismatch", "importance_weight"), acc.tolist()))
    return counters, float(iw_max), out | reduction.reported()


def pack_microbatches(samples: list[Sample], cfg: Config,
                      share_prompts: bool | None = None) -> list[MicroBatch]:
    """Samples -> packed micro-batches of at most --micro-batch-tokens positions (packing.py)."""
    return packing.pack_microbatches(samples, cfg.loss_aggregation, cfg.loss_aggregation_divisor,
                                     cfg.micro_batch_tokens, cfg.mask_truncated,
                                     SHARE_PROMPTS if share_prompts is None else share_prompts)


# -----------------------------------------------------------------------------
# the model: FSDP2 wiring, packed attention, log-probs in vocabulary chunks
def load_models(cfg: Config, device: torch.device, ranks: Ranks, engine=None) -> tuple:
    """The policy, a frozen copy for the KL penalty (else None), its AdamW; the memory plan."""
    gpu = torch.cuda.mem_get_info(device) if device.type == "cuda" else None  # (free, total)
    model = load_model(cfg, device, ranks)
    ref_model = (modeling.WithoutAdapters(model) if cfg.lora_rank else load_model(
        cfg, device, ranks, trainable=False)) if cfg.kl_coef > 0 else None  # LoRA: base is free
    undecided = model.checkpointed is None  # a GPU: checkpointed only where the plan needs it
    line, model.defer_grad_sync, model.checkpointed = modeling.startup_memory(
        model, ranks.world, -(-cfg.micro_batch_tokens // ranks.cp_size), model.checkpointed,
        model.mixed, gpu, engine is not None and engine.overlaps == "", ref_model is not None)
    if undecided and model.checkpointed:
        modeling.checkpoint_layers(model)
    print0(line)
    return model, ref_model, modeling.adamw([p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY)  # LoRA: the adapters alone


def load_model(cfg: Config, device: torch.device, ranks: Ranks, trainable: bool = True):
    """An HF causal LM sharded with FSDP2 over every rank as it loads (one rank in full precision:
    plain), a unit per (checkpointed) decoder layer + the root. Master weights, AdamW in fp32/64."""
    mixed = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    mp = {"mp_policy": MixedPrecisionPolicy(torch.bfloat16, torch.float32)} if mixed else {}
    tokens = -(-cfg.micro_batch_tokens // ranks.cp_size)  # of a micro-batch on this rank

    def shard(model):  # one rank in full precision: FSDP2 would only copy every weight and
        if ranks.world > 1 or mixed:  # gradient twice a step (fresh buffers: 0.5B 19 -> 14 s)
            mesh = init_device_mesh(device.type, (ranks.world,))
            for block in modeling.decoder_layers(model):
                fully_shard(block, mesh=mesh, **mp)
            fully_shard(model, mesh=mesh, **mp)
        else:
            model.set_requires_gradient_sync = lambda sync: None  # no gradient to reduce
        model.why_eager = modeling.compile_layers(model, device, COMPILE_FROM) if cfg.compile \
            else "eager (--no-compile)"
        elements = tokens * model.config.get_text_config().hidden_size  # a layer input's
        big = model.why_eager is not None and elements >= SELECTIVE_FROM  # compiled (None): as is
        model.checkpointed = trainable and (CHECKPOINT_LAYERS if CHECKPOINT_LAYERS is not None else
                                            None if device.type == "cuda" else big and "selective")
        if model.checkpointed:
            modeling.checkpoint_layers(model, model.checkpointed == "selective",
                                       RERUN_FROM if CHECKPOINT_LAYERS is None else 0)
    model, attention = modeling.load_causal_lm(  # LoRA: the frozen base in the compute dtype
        cfg.model, torch.bfloat16 if cfg.lora_rank and mixed else torch.float64 if
        cfg.dtype == "float64" else torch.float32, device, ranks.cp_size, ATTENTION, mixed,
        check=trainable, shard=shard, lora=(cfg.lora_rank, cfg.lora_adapter))
    model.mixed, model.defer_grad_sync = mixed, False
    if trainable:
        compute = "bf16 (fp32 master weights)" if mixed else str(model.dtype).removeprefix("torch.")
        print0(f"{attention}; compute: {compute}; {model.why_eager or 'layers compiled'}")
    model.policy_logprobs = types.MethodType(modeling.policy_logprobs, model)
    fsdp_method(model, "policy_logprobs")  # the root's parameters are gathered for it
    loss.fsdp_sum_gradients(model)  # LossReduction divides by the *global* normalizer: sum ranks
    for name, p in model.named_parameters():  # LoRA: the adapters alone
        p.requires_grad_(trainable and (not cfg.lora_rank or ".lora_" in name))
    return model


def microbatch_forward(model, mb: MicroBatch, cfg: Config, device: torch.device, ranks: Ranks,
                       grad: bool = False):
    """(log-probs, entropy) [T] of a packed micro-batch's positions at --temperature."""
    targets = mb.targets if mb.seq_ids is None else mb.targets.masked_fill(mb.seq_ids < 0, -1)
    kw = {"temperature": cfg.temperature, "entropy_grad": cfg.entropy_coef != 0}  # else a metric
    with torch.set_grad_enabled(grad):  # inputs, layout made on the host (FSDP2 moves them to a
        # GPU); Ulysses: this rank's 1/N of the row runs, the whole row's log-probs are gathered
        inputs, layout = modeling.row_inputs(mb.input_ids, mb.position_ids, targets, mb.segments,
                                             device, getattr(model, "attention_kernel", None),
                                             ranks.cp_group)
        out = model.policy_logprobs(**inputs, layout=layout, **kw)
        return out if ranks.cp_size < 2 else modeling.gather_row(*out, ranks.cp_group, len(targets))


# -----------------------------------------------------------------------------
# bad steps, checkpoints
@dataclass
class RunState:
    """What a checkpoint restores besides weights, optimizer and RNGs, and the run's bookkeeping."""
    step: int = 0
    updates: int = 0  # steps that updated the weights: the learning-rate schedule's clock
    last_eval: dict = field(default_factory=dict)
    pending: dict[int, list[Sample]] = field(default_factory=dict)
    bad_steps: int = 0  # steps in a row with a non-finite gradient norm
    last_save: float = field(default_factory=time.monotonic)

    def evaluated(self, metrics: dict) -> dict:
        self.last_eval = metrics
        return metrics

    def flags(self, preempt: checkpoint.Preemption) -> dict:
        """What every rank must agree on: a checkpoint due by time, a signal one of them got."""
        return {"due": float(time.monotonic() - self.last_save > 60 * CKPT_MINUTES)} | \
            preempt.signal_sums()


def end_step(step: int, sums: dict, metrics: dict, cfg: Config, model, optimizer, run: RunState,
             rollouts: rollout.Rollouts, logger: Logger) -> None:
    """After logging: stop after MAX_BAD_STEPS non-finite steps in a row (checkpoints hold healthy
    steps only); save when due (time, --ckpt-every, the end, a signal); stop on a signal."""
    run.bad_steps = run.bad_steps + 1 if metrics["skipped_steps"] else 0
    if run.bad_steps >= MAX_BAD_STEPS:
        last = checkpoint.complete_checkpoints(cfg.run_dir)
        raise cli.Stopped(f"error: {run.bad_steps} steps in a row had a non-finite loss or grad "
                          f"norm; last good checkpoint: {last[-1] if last else 'none'}", code=1)
    if run.bad_steps == 0 and (sums["due"] or "signal" in sums or step == cfg.steps
                               or every(cfg.ckpt_every, step, cfg.steps)):
        t0 = time.perf_counter()
        ahead = {s: [asdict(x) for x in b] for s, b in rollouts.wait().items()}
        meta = {"world": dist.get_world_size(), "updates": run.updates,
                "last_eval": run.last_eval, "config": asdict(cfg)}
        path = checkpoint.save_checkpoint(cfg.run_dir, step, model, optimizer, meta, ahead)
        logger.line(f"saved {path} in {time.perf_counter() - t0:.2f}s")
        run.last_save = time.monotonic()
    if "signal" in sums:
        logger.close()
        raise checkpoint.Interrupted(cfg.run_dir, step, int(sums["signal"]))


def resume(cfg: Config, model, optimizer, engine, ranks: Ranks, resuming: bool) -> RunState:
    """Restore --resume's checkpoint, or this run's newest readable one (a broken one set aside),
    into model, optimizer, RNGs, engine and batches made ahead; cut metrics.jsonl and samples.jsonl
    back to its step. Evaluating (--steps 0) touches no run's checkpoints or lines."""
    path = (None if cfg.resume in ("auto", "fresh") else cfg.resume) if cfg.steps == 0 else \
        on_rank0(checkpoint.choose_resume, cfg.run_dir, cfg.resume, resuming)
    run = RunState()
    if path is not None:
        try:  # passed the cheap checks (sizes, meta.json), yet unreadable: say which one
            meta, ahead = checkpoint.load_checkpoint(Path(path), model, optimizer)
        except Exception as e:
            raise UserError(f"checkpoint {path} cannot be loaded ({cli.why(e)}); move it aside "
                            "to resume from the one before it") from None
        mine = lambda batch: [Sample(**x | {"completion": Completion(**x["completion"])})
                              for x in batch if x["group"] % ranks.dp_size == ranks.dp_rank]
        run = RunState(meta["step"], meta["updates"], meta["last_eval"] or {},
                       {s: mine(b) for s, b in ahead.items()} if ranks.cp_rank == 0 else {})
        done = " (nothing left to train)" if meta["step"] >= cfg.steps > 0 else ""
        print0(f"evaluating step {meta['step']} ({path})" if cfg.steps == 0 else
               f"resumed from step {meta['step']} ({path}){done}")
    if path is not None or cfg.lora_adapter or engine.share:  # the engine loaded --model: these
        engine.update_weights(model, run.step)  # weights instead (share: the trainer's tensors)
    if ranks.rank == 0:  # the run starts: its directory holds its config from now on
        checkpoint.write_config(cfg.run_dir, asdict(cfg))
        for name in ("metrics.jsonl", "samples.jsonl") if cfg.steps else ():
            checkpoint.truncate_metrics(Path(cfg.run_dir) / name, run.step if path else -1)
    return run


def run(argv: list[str] | None = None) -> int:
    """main() with its exit status: 2 after a user error (one line on stderr), 128 + the signal's
    number after SIGINT/SIGTERM (once the checkpoint is saved), 1 after MAX_BAD_STEPS."""
    return cli.run(main, argv)


if __name__ == "__main__":
    cli.exit_now(run())
