"""nanoareal: a minimal, hackable GRPO trainer. This file is the reinforcement-learning loop, read
top to bottom: the config, the loop (generate -> reward -> advantages -> loss -> optimizer step ->
weight sync -> log), then the pieces in the order the loop uses them.

    python nanoareal.py                                   # the built-in arithmetic task, on a CPU
    python nanoareal.py --dataset chain --reward my_reward.py:score   # another task, your reward
    python nanoareal.py --env my_env.py:Calculator  # the policy calls your tool between its turns
    python nanoareal.py --teacher assets/tiny-arith-teacher --adv-estimator none  # distillation
    torchrun --nproc_per_node 4 nanoareal.py --cp-size 2  # 2 data-parallel x 2 context-parallel
    python nanoareal.py --max-staleness 2 --correction mask       # rollouts 2 steps ahead
    python nanoareal.py --config configs/qwen2.5-0.5b-gsm8k.toml  # one GPU, SGLang colocated
    python nanoareal.py --steps 0 --model runs/<run>/final --eval-k 8   # evaluate only

Plumbing lives in flat files that never import this one: loss.py (advantages, aggregation modes,
surrogates, corrections, the LossReduction contract: gradients independent of micro-batching
and world size), rollout.py (engines, samples, the batches in flight), tasks.py (tasks, data,
rewards), packing.py, modeling.py (the model and every decision about it, log-probs),
attention.py (packed rows, Ulysses), lora.py, checkpoint.py, logs.py, cli.py. Left out on
purpose: a critic (GRPO needs none), tensor/pipeline parallel in the trainer."""

import ctypes
import math
import os
import platform
import random
import time
from collections import Counter
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import cli
import lora
import loss
import modeling
import packing
import rollout
import tasks
from cli import UserError, on_rank0
from logs import Logger, merge, print0, reduce_metrics, step_metrics
from rollout import Sample, SamplingParams, mix_seed

ROOT = Path(__file__).resolve().parent
ADAM_BETAS, WEIGHT_DECAY = (0.9, 0.99), 0.0  # AdamW: RL steps are few and noisy, no decay
# feed a group's prompt once per micro-batch (exact; off only to compare)
SHARE_PROMPTS = True
# a collective waits this long for a peer: a dead rank never hangs a run
DIST_TIMEOUT_S = 1800.0
MAX_BAD_STEPS = 3  # stop after this many steps in a row with a non-finite gradient norm
CKPT_MINUTES = 10.0  # save a checkpoint when this long has passed since the last one

# -----------------------------------------------------------------------------
# config: one flat set of flags, `--help` its documentation. A volatile flag (VOLATILE) changes
# how a run is watched or how long it goes, not what it computes: a rerun with another value
# continues the run.


@dataclass
class Config:
    # run
    model: str = "assets/tiny-arith"
    """Hugging Face causal-LM directory or hub id, an export (runs/<run>/final), a checkpoint or
    a PEFT LoRA adapter directory (its base model, its adapters)."""
    run_dir: str | None = None
    """Where metrics, samples and checkpoints go; default runs/<dataset>-<mode>-s<seed>-<hash>."""
    seed: int = 0
    """Seed of the run: prompt order and sampling noise are functions of (seed, step)."""
    steps: int = 100
    """Training steps, one rollout batch each; 0 evaluates --model without training."""
    config: str | None = None
    """A TOML file of flag defaults (keys are flag names); flags on the command line win."""
    resume: str = "auto"
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
    rollout_backend: Literal[tuple(rollout.BACKENDS)] = "hf"  # type: ignore[valid-type]
    """hf: transformers in the trainer's precision (hf_bf16: bf16 weights and compute; hf_int4:
    4-bit weights); sglang: in-process on this GPU or --rollout-url (sglang_deterministic:
    seeded)."""
    rollout_url: list[str] = field(default_factory=list)
    """SGLang server URLs; none with --rollout-backend sglang runs SGLang in-process."""
    weight_sync: Literal["auto", "tensor", "disk", "nccl"] = "auto"
    """How new weights reach SGLang: auto is tensor in-process, nccl to servers where it can."""

    # advantages
    adv_estimator: Literal[tuple(loss.ADVANTAGES)] = "grpo"  # type: ignore[valid-type]
    """A sample's reward against its group's: grpo (std-scaled), grpo_batch_std, dr_grpo (no
    std), rloo (the others' mean), none (no reward signal: distillation alone)."""
    zero_variance: Literal["keep", "filter", "resample"] = "keep"
    """Groups whose rewards are all equal (no signal): keep, filter out, or resample their
    prompts until they have a signal (DAPO's dynamic sampling, up to --max-resample rounds)."""
    max_resample: int = 4
    """With --zero-variance resample: rounds of fresh prompts a group may draw in a step."""
    mask_truncated: bool = False
    """Leave responses cut by --max-new-tokens out of the loss and its denominators (DAPO)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong penalty: the last N tokens up to --max-new-tokens cost 0 to 1 reward."""
    teacher: str | None = None
    """On-policy distillation: a teacher model (same tokenizer) or SGLang server URL scores the
    sampled tokens; its log-prob minus the sampler's is a per-token advantage."""
    distill_coef: float = 1.0
    """With --teacher: the weight of the teacher's per-token advantage (added to the reward's)."""

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
    """pi_prox vs the sampler: none, behave, truncate (token TIS), mask, m2po, seq_tis, token_mis,
    seq_mis, geo_mis (docs/losses.md); auto is none at K = 0, else behave (truncate with several
    updates per batch)."""
    correction_threshold: float | None = None
    """The correction's cap C (default 2; geo_mis 1.01), M2PO's threshold (0.04)."""
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
    """Train LoRA adapters of this rank on the frozen model; 0 trains every weight."""
    lora_adapter: str | None = None
    """Start from this PEFT adapter directory (--model such a directory sets it and its base)."""

    # eval, logging, checkpoints, system
    eval_every: int = 10
    """Held-out evaluation every N steps, at step 0 and at the end; 0 turns it off."""
    eval_k: int = 0
    """Also sample k answers per held-out prompt: mean@k and pass@k (Chen et al. 2021)."""
    ckpt_every: int = 0
    """Also save a checkpoint every N steps (besides every 10 minutes, the end and signals)."""
    wandb_project: str | None = None
    """Also log metrics and sample tables to this Weights & Biases project."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Compute precision; bfloat16 keeps fp32 master weights; auto: bf16 on a GPU, fp32 on a CPU."""
    cp_size: int = 1
    """Context parallel (Ulysses): ranks that split each micro-batch's tokens (exact, same run)."""
    compile: bool = True
    """torch.compile the decoder layers where they hold 50M parameters or more (fused, exact)."""

    def __post_init__(self):
        # defaults that depend on other flags, filled once when the config is made (command line
        # or code); given values stay: a replace() of --policy-loss keeps the clip range filled in
        # the built-in task's own reward, exact_match for a JSONL file
        if self.reward == "auto":
            task = tasks.TASKS.get(self.dataset)
            self.reward = task.reward if task else "exact_match"
        if not self.lr:  # docs/studies.md: LoRA wants a 10x larger one
            self.lr = default_lr(self.lora_rank or self.lora_adapter)
        vars(self).update(loss.resolve_loss_flags(self))


# -----------------------------------------------------------------------------
# the training loop
def main(argv: list[str]) -> None:
    cfg = parse_config(argv)  # flags, TOML, the task's own flags -> resolved and checked
    ranks, device = setup_distributed(cfg.cp_size)  # torchrun's, or a world of one
    data, reward_fn, engine, resuming = prepare_run(cfg, device, ranks)  # run dir claimed
    model, reference, teacher, optimizer = load_models(cfg, device, ranks, engine)
    reduction = loss.build_loss(cfg, cp_factor=ranks.cp_size)
    run = resume(cfg, model, optimizer, engine, ranks, resuming)  # step, batches ahead
    logger = Logger(cfg, run.step)
    make_batch = lambda step: rollout_batch(engine, data, reward_fn, step, cfg, ranks)
    share = lambda batch: cp_broadcast(batch, ranks)  # one rollout per CP group
    rollouts = rollout.Rollouts(
        make_batch, cfg.max_staleness, engine.overlaps, run.pending, cfg.steps, share
    )
    print0(banner(cfg, ranks, device, data, rollouts))
    evaluate = lambda: tasks.evaluate(engine, data, reward_fn, cfg, ranks.rank, ranks.world)
    if data.evalset and (cfg.steps == 0 or (cfg.eval_every > 0 and run.step == 0)):
        run.last_eval = evaluate()
        logger.log(run.step, run.last_eval)
    with checkpoint.Preemption() as preempt:  # SIGINT/SIGTERM: finish the step, save, exit
        for step in range(run.step, cfg.steps):
            t0 = time.perf_counter()
            # ALGO LOGIC. this step's batch, sampled by the policy of step max(0, step - K)
            samples = rollouts.take(step)
            set_advantages(samples, cfg, ranks, teacher)  # the group's, the teacher's
            sums = rollout_sums(samples, ranks)
            if cfg.zero_variance == "filter":  # no signal: only normaliser mass
                samples = [s for s in samples if not s.zero_variance]
            t1 = time.perf_counter()
            # loss and optimizer step(s); a colocated engine frees its GPU memory meanwhile
            engine.release_memory()
            lr = set_lr(optimizer, run.updates, cfg)
            train_sums, stats = train_on_samples(
                model, reference, optimizer, reduction, samples, cfg, ranks
            )
            run.updates += int(stats.pop("updated"))
            engine.resume_memory()
            t2 = time.perf_counter()
            rollouts.wait()  # sync: after the batch in flight, the engine gets new weights
            t3 = time.perf_counter()
            engine.update_weights(model.module, step + 1)
            t4 = time.perf_counter()
            times = dict(rollout=t1 - t0 + t3 - t2, train=t2 - t1, sync=t4 - t3, step=t4 - t0)
            # TRY NOT TO MODIFY: one collective for metrics and what ranks agree on (signal, save)
            sums = reduce_metrics(sums | train_sums | run.flags(preempt))
            metrics = step_metrics(sums, stats, times, lr, step + 1)
            if data.evalset and every(cfg.eval_every, step + 1, cfg.steps):
                run.last_eval = evaluate()
                metrics |= run.last_eval
            logger.log(step + 1, metrics)  # metrics.jsonl, wandb, a console line
            logger.log_samples(step + 1, samples, data.tokenizer)  # a few, to samples.jsonl
            end_step(step + 1, sums, metrics, cfg, model, optimizer, run, rollouts, logger)
    rollouts.close()
    logger.close(run.last_eval)
    # also when resumed with nothing left to train: a save killed mid-export
    if cfg.steps > 0:
        final = Path(cfg.run_dir) / "final"
        checkpoint.export_hf(model.module, model.lora, data.tokenizer, cfg.model, final)
    engine.shutdown()


# -----------------------------------------------------------------------------
# set-up: the config (flags + TOML, resolved once, checked), the ranks, the data
# the volatile flags: how a run is watched or how long it goes (a rerun continues the run)
VOLATILE = {
    "run_dir",
    "steps",
    "config",
    "resume",
    "rollout_url",
    "weight_sync",
    "eval_every",
    "eval_k",
    "ckpt_every",
    "wandb_project",
    "cp_size",
    "compile",
}
DEFAULTS = {f.name: f.default for f in fields(Config) if f.default is not MISSING}


def parse_config(argv: list[str]) -> Config:
    """Flags, --config TOML and a built-in task's own flags -> a resolved, checked Config."""
    preset = lambda dataset: tasks.TASKS[dataset].flags if dataset in tasks.TASKS else {}
    cfg = resolve_config(cli.parse(Config, argv, preset))
    return validate_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))


def resolve_config(cfg: Config) -> Config:
    """The defaults that need the file system: the shipped model from any directory, a
    checkpoint's base model and adapters (--model a checkpoint resumes from it), an adapter's
    base, the run directory's name (an evaluation, --steps 0, gets its own) and what --steps 0 of
    a JSONL --dataset alone evaluates."""
    model, resume_from, adapter, rank = cfg.model, cfg.resume, cfg.lora_adapter, cfg.lora_rank
    found = lora.read_config(model)
    if found:  # a LoRA adapter: its base, its weights, its rank
        model, adapter = found["base_model_name_or_path"], model
    model = shipped(model)
    saved = checkpoint.saved_config(model)
    if saved is not None:  # a checkpoint: its run's base model and adapters, its weights
        model, resume_from, adapter = saved["model"], cfg.model, saved.get("lora_adapter")
        rank = rank or saved.get("lora_rank", 0)
    if cfg.resume not in ("auto", "fresh") and not rank:  # a LoRA run's checkpoint: its rank
        rank = (checkpoint.saved_config(cfg.resume) or {}).get("lora_rank", 0)
    if adapter and not rank:
        rank = (lora.read_config(adapter) or {}).get("r", 0)
    identity = {k: v for k, v in asdict(cfg).items() if k not in VOLATILE}  # --model as given
    # an evaluation of a JSONL --dataset without --eval-dataset evaluates that file
    held = cfg.eval_dataset
    if not held and not cfg.steps and cfg.dataset not in tasks.TASKS:
        held = cfg.dataset
    lr = cfg.lr
    if rank and not cfg.lora_rank and lr == default_lr(cfg.lora_adapter):  # an adopted rank
        lr = default_lr(rank)
    if cfg.steps:
        identity["model"] = model
    name = cfg.loss_aggregation if cfg.steps else "eval"
    run_dir = cfg.run_dir or checkpoint.run_dir_name(cfg.dataset, name, cfg.seed, identity)
    return replace(
        cfg,
        model=model,
        resume=resume_from,
        eval_dataset=held,
        lora_adapter=adapter,
        lora_rank=rank,
        teacher=shipped(cfg.teacher) if cfg.teacher else None,
        lr=lr,
        run_dir=run_dir,
    )


def default_lr(lora) -> float:
    """--lr's default: 1e-4, with LoRA 1e-3 (docs/studies.md: adapters want a 10x larger one)."""
    return 1e-3 if lora else 1e-4


def shipped(path: str) -> str:
    """`path`, or the shipped model it names (assets/...) from any directory."""
    if not Path(path).exists() and (ROOT / path).is_dir():
        return str(ROOT / path)
    return path


# the counting flags by their least value (validate_config)
LEAST = {
    1: (
        "prompts-per-step",
        "max-new-tokens",
        "micro-batch-tokens",
        "num-minibatches",
        "ppo-epochs",
        "cp-size",
    ),
    -1: ("top-k",),
    0: (
        "steps",
        "eval-every",
        "eval-k",
        "warmup-steps",
        "ckpt-every",
        "max-staleness",
        "max-resample",
        "overlong-buffer",
        "grad-clip",
        "lora-rank",
    ),
}


def validate_config(cfg: Config, world: int) -> Config:
    """Every flag checked before anything heavy loads; a mistake: one UserError line naming it."""
    for least, flags in LEAST.items():
        for flag in flags:
            value = getattr(cfg, flag.replace("-", "_"))
            if value < least:
                raise UserError(f"config error: --{flag} {value}: must be >= {least}")
    checks = [
        (
            cfg.group_size >= 2,
            f"--group-size {cfg.group_size}: a sample alone in its group has no baseline "
            "(every advantage would be 0); use --group-size >= 2",
        ),
        (
            cfg.temperature > 0,
            f"--temperature {cfg.temperature}: rollouts must sample (> 0; eval/accuracy "
            "is greedy anyway)",
        ),
        (cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr {cfg.lr}: must be a positive number"),
        (
            cfg.num_minibatches <= cfg.prompts_per_step,
            "--num-minibatches must be in [1, --prompts-per-step]",
        ),
        (
            cfg.overlong_buffer <= cfg.max_new_tokens,
            f"--overlong-buffer {cfg.overlong_buffer}: must be in [0, --max-new-tokens]",
        ),
        (0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]"),
        (cfg.top_k != 0, "--top-k 0: use -1 (all) or >= 1"),
        (
            world % cfg.cp_size == 0,
            f"--cp-size {cfg.cp_size} must divide the number of ranks ({world})",
        ),
        (
            not cfg.eval_dataset or cfg.dataset not in tasks.TASKS,
            f"--eval-dataset is for a JSONL --dataset: the built-in task {cfg.dataset!r} has "
            "its own held-out split",
        ),
        (
            cfg.resume in ("auto", "fresh") or (Path(cfg.resume) / "meta.json").is_file(),
            f"--resume {cfg.resume} is not a complete checkpoint (no directory, or a save "
            "that never finished: no meta.json); use --resume auto or fresh",
        ),
        (
            cfg.teacher or cfg.adv_estimator != "none",
            "--adv-estimator none leaves no signal but a --teacher's",
        ),
        (math.isfinite(cfg.distill_coef), f"--distill-coef {cfg.distill_coef}: not a number"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"config error: {message}")
    try:
        loss.check_loss_flags(cfg)
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    check_lora(cfg)
    cuda = torch.cuda.is_available()
    rollout.check_rollout_config(cfg.rollout_backend, cfg.rollout_url, cfg.weight_sync, cuda)
    return cfg


def check_lora(cfg: Config) -> None:
    """--lora-rank, and --lora-adapter against --model (its base), before anything loads."""
    if not cfg.lora_adapter:
        return
    found = lora.read_config(cfg.lora_adapter)
    if found is None:
        raise UserError(
            f"config error: --lora-adapter {cfg.lora_adapter} is not a PEFT adapter directory"
        )
    if found["r"] != cfg.lora_rank:
        raise UserError(
            f"config error: --lora-adapter {cfg.lora_adapter} has rank {found['r']}, not "
            f"--lora-rank {cfg.lora_rank}"
        )
    base = found["base_model_name_or_path"]
    same = Path(base).exists() and Path(base).resolve() == Path(cfg.model).resolve()
    if base != cfg.model and not same:
        raise UserError(
            f"config error: --lora-adapter {cfg.lora_adapter} is an adapter of {base!r}, not "
            f"of --model {cfg.model}"
        )


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
    alone = (
        {}
        if "RANK" in os.environ
        else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    )
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=timedelta(seconds=DIST_TIMEOUT_S), **alone
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    # freed blocks went back to the OS, so each step's
    elif platform.libc_ver()[0] == "glibc":
        # buffers page-faulted afresh (0.5B shape: 130-550k faults, ~1 s a training step): mmap
        # only past 1 GiB (older glibc: 32 MB), never trim the heap (M_MMAP_, M_TRIM_THRESHOLD)
        libc = ctypes.CDLL(None)
        if not libc.mallopt(-3, 1 << 30):
            libc.mallopt(-3, 32 << 20)
        libc.mallopt(-1, 2**31 - 1)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    # validate_config made sure cp_size divides world
    cp_group = None
    if cp_size > 1:
        mesh = init_device_mesh(
            device.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp")
        )
        cp_group = mesh["cp"].get_group()
    ranks = Ranks(
        rank, world, rank // cp_size, world // cp_size, rank % cp_size, cp_size, cp_group
    )
    return ranks, device


def prepare_run(cfg: Config, device, ranks: Ranks) -> tuple:
    """(data, reward, the rollout engine, whether the run directory, claimed now or refused,
    holds a run to resume). A colocated engine (no staleness, one process) may share the
    trainer's weight tensors."""
    reward_fn = tasks.load_reward(cfg.reward)
    modeling.check_model_source(cfg.model)
    resuming = on_rank0(
        checkpoint.claim_run_dir,
        cfg.run_dir,
        asdict(cfg),
        VOLATILE,
        cfg.resume == "fresh",
        DEFAULTS,
    )
    torch.manual_seed(cfg.seed)
    data = tasks.load_data(cfg)
    if cfg.teacher:
        tasks.check_teacher(cfg.teacher, cfg.model, data.tokenizer, cfg.temperature)
    colocated = cfg.max_staleness == 0 and ranks.world == 1
    engine = rollout.make_engine(cfg, device, share=colocated)
    return data, reward_fn, engine, resuming


def banner(cfg: Config, ranks: Ranks, device, data: tasks.Data, rollouts) -> str:
    """The run's first line: where it runs, what it trains on, how."""
    return (
        f"nanoareal: {ranks.world} rank(s) on {device.type}, {cfg.model}, {len(data.rows)}/"
        f"{len(data.evalset)} train/eval prompts, {cfg.policy_loss}/{cfg.loss_aggregation}, "
        f"{rollouts.describe()}, run {cfg.run_dir}"
    )


def every(n: int, step: int, last: int) -> bool:
    """Due every n steps and at the last step; n = 0 never."""
    return n > 0 and (step % n == 0 or step == last)


def set_lr(optimizer, updates: int, cfg: Config) -> float:
    """Linear warm-up, then constant or cosine to 0 at --steps, counted in steps that updated the
    weights (a step with nothing to learn from moves neither weights nor lr)."""
    factor = 1.0
    if updates < cfg.warmup_steps:
        factor = (updates + 1) / (cfg.warmup_steps + 1)
    elif cfg.lr_schedule == "cosine":
        progress = (updates - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        factor = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * factor
    return cfg.lr * factor


# -----------------------------------------------------------------------------
# generate and reward: the batches in flight, one step's prompts, group_size samples each
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


def rollout_batch(
    engine, data: tasks.Data, reward_fn, step: int, cfg: Config, ranks: Ranks
) -> list[Sample]:
    """This data-parallel rank's share of the step's groups (every dp_size-th slot: a group never
    straddles ranks), sampled by the engine's current weights and scored. --zero-variance
    resample: a slot whose group's rewards are all equal draws a fresh prompt (a function of
    (seed, step, slot, round)) up to --max-resample times; every sample's gen_s is the rounds'
    generation time summed (the discarded tokens took part of it). It may run on the rollout
    thread, overlapping training: no collectives here. A CP group's first rank makes it."""
    if ranks.cp_rank != 0:
        return []
    rows = prompts_for_step(len(data.rows), cfg.prompts_per_step, step, cfg.seed)
    todo = list(enumerate(rows))[ranks.dp_rank :: ranks.dp_size]
    rounds = cfg.max_resample if cfg.zero_variance == "resample" else 0
    groups = {}
    discarded = Counter()  # tokens of the groups a slot threw away
    gen_s = 0.0  # every round's generation time: the discarded tokens took some of it
    for round_ in range(rounds + 1):
        start = time.perf_counter()
        drawn = generate(engine, data, todo, step, cfg, round_)
        gen_s += time.perf_counter() - start
        score(drawn, data, reward_fn, cfg)
        for slot, _ in todo:
            replaced = groups.get(slot, [])
            discarded[slot] += sum(len(s.completion.output_ids) for s in replaced)
            groups[slot] = [s for s in drawn if s.group == slot]
        # the flat slots draw again: rows that are functions of (seed, step, slot, round)
        todo = []
        for slot in sorted(flat_groups(drawn)):
            rng = random.Random(mix_seed(cfg.seed, step, slot, round_ + 1, 0x5A3F))
            todo.append((slot, rng.randrange(len(data.rows))))
        if not todo:
            break
    for slot, group in groups.items():
        for s in group:
            s.gen_s = gen_s
        if group:
            group[0].discarded_tokens = discarded[slot]
    return [s for slot in sorted(groups) for s in groups[slot]]


def flat_groups(samples: list[Sample]) -> set[int]:
    """The groups whose rewards are all equal: no GRPO signal."""
    rewards = {}
    for s in samples:
        rewards.setdefault(s.group, set()).add(s.reward)
    return {g for g, r in rewards.items() if len(r) == 1}


def generate(
    engine,
    data: tasks.Data,
    prompts: list[tuple[int, int]],
    step: int,
    cfg: Config,
    round_: int = 0,
) -> list[Sample]:
    """group_size completions of each (slot, row) prompt (one the engine aborted is dropped); the
    slot is the group; seeds (seed, step, slot, k[, round]), not the rank's."""
    sampling = SamplingParams(
        cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, data.stop_ids
    )
    slots = [(slot, row) for slot, row in prompts for _ in range(cfg.group_size)]
    extra = (round_,) if round_ else ()
    seeds = [
        mix_seed(cfg.seed, step, slot, k, *extra)
        for slot, _ in prompts
        for k in range(cfg.group_size)
    ]
    encoded = [data.prompts[r] for _, r in slots]
    rows = [data.rows[r] for _, r in slots]  # what an env starts from (tools only)
    version = engine.version
    completions = rollout.run_episodes(engine, encoded, sampling, seeds, data.tools, rows)
    return [
        Sample(
            slot,
            data.prompts[row],
            c,
            row=row,
            version=version,
            seed=seed,
            round=round_,
        )
        for (slot, row), c, seed in zip(slots, completions, seeds)
        if c.finish_reason != "abort"
    ]


def score(samples: list[Sample], data: tasks.Data, reward_fn, cfg: Config) -> None:
    """Reward every completion (.reward, .correct, .metrics, .reward_error; random seeded by its
    seed, DAPO's overlong penalty added); a call that raises or hangs scores 0 and is counted."""
    scores = tasks.score_completions(
        reward_fn,
        data.tokenizer,
        [s.completion for s in samples],
        [data.rows[s.row] for s in samples],
        [s.seed for s in samples],
        cfg.overlong_buffer,
        cfg.max_new_tokens,
    )
    for s, sc in zip(samples, scores):
        vars(s).update(vars(sc))  # reward, correct, metrics, reward_error


def rollout_sums(samples: list[Sample], ranks: Ranks) -> dict:
    """This rank's counters of a batch (advantages set) for the step's metrics (logs.MEANS) and its
    generation time (gen_s, a maximum over ranks); a CP group counts its shared batch once."""
    if ranks.cp_rank != 0:
        return {}
    sums = Counter()
    for s in samples:
        n = len(s.completion.output_ids)
        sums.update(
            {
                "samples": 1,
                "reward": s.reward,
                "response_tokens": n,
                "version": s.version,
                "truncated": s.completion.finish_reason == "length",
                "reward_errors": s.reward_error is not None,
                "zero_adv": abs(s.advantage) < 1e-12,
                "resampled": s.round > 0,
                "discarded_tokens": s.discarded_tokens,
            }
        )
        if s.correct is not None:  # response lengths split by correctness: who grows longer
            kind = "correct" if s.correct else "incorrect"
            sums.update({"judged": 1, "correct": s.correct, kind: 1, f"len_{kind}": n})
        # the reward's and env's: means per reporter
        reported = {f"reward/{k}": v for k, v in s.metrics.items()} | s.completion.episode
        sums.update(reported | {f"{k}#n": 1 for k in reported})
    sums["zero_var_groups"] = len({s.group for s in samples if s.zero_variance})
    if samples:
        sums["gen_s"] = max(s.gen_s for s in samples)
    return dict(sums)


def set_advantages(samples: list[Sample], cfg: Config, ranks: Ranks, teacher) -> None:
    """Each sample's .advantage (its reward against its group's, loss.ADVANTAGES) and
    .zero_variance (its group's rewards are all equal); with a teacher, .token_advantages: the
    advantage plus the teacher's per-token term (loss.distill_advantages)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples])
    adv = loss.group_advantages(rewards, groups, cfg.adv_estimator, copies=ranks.cp_size)
    flat = flat_groups(samples)
    for s, a in zip(samples, adv.tolist()):
        s.advantage, s.zero_variance = a, s.group in flat
    if teacher is None:
        return
    for s, scores in zip(samples, teacher_logprobs(teacher, samples, cfg)):
        policy = torch.tensor(packing.loss_mask(s, False))
        distill = loss.distill_advantages(
            scores, torch.tensor(s.completion.logprobs), policy, cfg.distill_coef
        )
        s.token_advantages = (s.advantage + distill).tolist()


def teacher_logprobs(teacher, samples: list[Sample], cfg: Config) -> list[torch.Tensor]:
    """The teacher's log-prob of each sampled token at --temperature: an SGLang server's
    (prefill only), or a frozen Model's forward of the packed samples (every rank forwards the
    same number of micro-batches: FSDP2 gathers per forward)."""
    if isinstance(teacher, rollout.Scorer):
        return teacher.score(samples)
    mbs = packing.pack_microbatches(samples, "token_mean", None, cfg.micro_batch_tokens)
    out = [[] for _ in samples]
    with torch.no_grad():
        for mb in packing.even_out(mbs):
            logp = teacher.logprobs(mb, cfg.temperature)[0].float().cpu()
            for i in mb.seq_ids[mb.seq_ids >= 0].unique().tolist():
                out[i] = logp[mb.seq_ids == i]
    return out


# -----------------------------------------------------------------------------
# loss and step: packed micro-batches, log-probs, the objective, clip, AdamW
def train_on_samples(
    model,
    reference,
    optimizer,
    reduction: loss.LossReduction,
    samples: list[Sample],
    cfg: Config,
    ranks: Ranks,
) -> tuple[dict, dict]:
    """One rollout batch -> --ppo-epochs x --num-minibatches optimizer steps, each on a share of
    the groups. Returns this rank's counters (the first pass's; reduce_metrics sums them over ranks)
    and the step's stats: grad norm and loss terms (means), skipped steps, whether any update."""
    # mini-batch i: every n-th group from the i-th; pi_prox, pi_ref: the weights before any update
    n = cfg.num_minibatches
    groups = sorted({s.group for s in samples})
    packed = [
        minibatch(model, reference, [s for s in samples if s.group in share], cfg)
        for share in (set(groups[i::n]) for i in range(n))  # a set: one lookup per sample
    ]
    # positions: what the model was fed (fewer than trained_tokens: shared prompts, no last tokens)
    tokens = sum(len(s.prompt_ids) + len(s.completion.output_ids) for s in samples)
    positions = sum(len(mb.input_ids) for mbs in packed for mb in mbs)
    parts = [{"positions": positions, "trained_tokens": tokens}]
    stats, updates = Counter(), packed * cfg.ppo_epochs  # pass after pass
    for i, mbs in enumerate(updates):
        counters, out = train_minibatch(model, optimizer, reduction, mbs, cfg, ranks)
        if i < len(packed):  # later passes see the same tokens again
            parts.append(counters)
        stats.update({k: v / len(updates) for k, v in out.items() if k != "updated"})
        stats["updated"] = max(stats["updated"], out["updated"])
    stats["skipped_steps"] *= len(updates)  # a count, not a mean
    sums = merge(parts)  # summed, extremes (logs.MAXIMA) kept
    return (sums if ranks.cp_rank == 0 else {}), dict(stats)  # a CP group counts once


def minibatch(model, reference, samples: list[Sample], cfg: Config) -> list[loss.MicroBatch]:
    """A mini-batch's micro-batches, the same number on every rank, with the frozen log-probs
    they need: pi_prox's own forward (loss.needs_proximal_forward), the reference's (KL); then a
    correction's masks from pi_prox (M2PO's over every rank; a mismatch rejection, taken out of
    the denominators too: the mode's weights made again)."""
    mbs = packing.even_out(pack_microbatches(samples, cfg))
    frozen = {}
    if loss.needs_proximal_forward(cfg.correction, cfg.num_minibatches * cfg.ppo_epochs):
        frozen["prox_logprobs"] = model
    if reference is not None:
        frozen["ref_logprobs"] = reference
    with torch.no_grad():
        mbs = [
            replace(
                mb,
                **{
                    k: m.logprobs(mb, cfg.temperature)[0].float().cpu()
                    for k, m in frozen.items()
                },
            )
            for mb in mbs
        ]
    corr = loss.CORRECTIONS[cfg.correction]
    if corr.reject is not None:
        mbs = [reject(mb, corr, cfg.correction_threshold) for mb in mbs]
        mbs = packing.reweigh(
            mbs, samples, cfg.loss_aggregation, cfg.loss_aggregation_divisor
        )
    if corr.global_mask is None or not mbs:
        return mbs
    keep = corr.global_mask(
        *(
            torch.cat([getattr(mb, k) for mb in mbs])
            for k in ("prox_logprobs", "behave_logprobs", "loss_mask")
        ),
        threshold=cfg.correction_threshold,
    )
    keep = keep.split([len(mb.loss_mask) for mb in mbs])
    return [replace(mb, keep_mask=k) for mb, k in zip(mbs, keep)]


def reject(mb: loss.MicroBatch, corr: loss.Correction, cap: float) -> loss.MicroBatch:
    """The micro-batch without the tokens a mismatch correction rejects, from m and from d."""
    d = mb.denom_mask
    behave = torch.where(d > 0, mb.behave_logprobs, mb.prox_logprobs)
    keep = corr.reject(loss.log_ratio(mb.prox_logprobs, behave), mb.seq_ids, d, cap)
    return replace(
        mb, loss_mask=mb.loss_mask * keep, denom_mask=d * keep, rejected=d - d * keep
    )


def train_minibatch(
    model,
    optimizer,
    reduction: loss.LossReduction,
    mbs: list[loss.MicroBatch],
    cfg: Config,
    ranks: Ranks,
) -> tuple[dict, dict]:
    """One optimizer step on a mini-batch's micro-batches. Its objective, over tokens t:

        J = sum_t m_t w_t l_t / Z_policy - entropy_coef sum_t m_t H_t / Z_tokens
                                         + kl_coef sum_t m_t kl_t / Z_tokens

    l_t the surrogate's loss, w_t the mode's weight of the token's response times the
    correction's importance weight, m_t the loss mask (a correction may reject tokens), H_t the
    entropy, kl_t the KL estimator against the reference; Z_policy the mode's normaliser and
    Z_tokens the token count, each over the whole mini-batch on every rank (one all_reduce). No
    update when nothing is to be learned (AdamW's momentum would still move the weights)."""
    surrogate = loss.SURROGATES[cfg.policy_loss]
    params = loss.surrogate_params(cfg.policy_loss, cfg.eps_low, cfg.eps_high, cfg.correction)
    corr = loss.CORRECTIONS[cfg.correction]
    # each token counted once: a CP group's ranks hold the same micro-batches, its first counts
    reduction.begin_step(mbs if ranks.cp_rank == 0 else [])
    learn = any(reduction.Z.values())
    metrics = StepMetrics(model.device)
    for i, mb in enumerate(mbs if learn else []):  # FSDP2: one reduce-scatter, after the last
        model.set_grad_sync(i == len(mbs) - 1 or not model.defer_grad_sync)
        logp, entropy = model.logprobs(
            mb, cfg.temperature, grad=True, entropy_grad=cfg.entropy_coef != 0
        )
        mb = mb.to(model.device)
        prox = loss.anchor(mb, logp, corr)  # pi_prox, or pi_behave (clip_to_behaviour)
        weight, m, stats = loss.correct(corr, prox, mb, cfg.correction_threshold)
        advantages = torch.where(mb.denom_mask > 0, mb.advantages, 0.0)
        token_loss, indicators = surrogate.fn(logp, prox, advantages, mb.seq_ids, m, **params)
        terms = {"policy": loss.masked_sum(token_loss, m, mb.loss_weight * weight)}
        if cfg.entropy_coef:
            terms["entropy"] = loss.masked_sum(entropy, mb.loss_mask)
        if cfg.kl_coef:  # pi_ref outside d is arbitrary: ratio 1 there, exp() finite
            ref = torch.where(mb.denom_mask > 0, mb.ref_logprobs, logp.detach())
            kl = loss.kl_penalty(logp, ref, cfg.kl_estimator)
            terms["kl"] = loss.masked_sum(kl, mb.loss_mask)
        stats |= {f"policy/{k}": ((v * m).sum(), m.sum()) for k, v in indicators.items()}
        reduction(terms, stats).backward()
        pi_prox = logp.detach() if mb.prox_logprobs is None else mb.prox_logprobs
        metrics.add(mb, logp, entropy, pi_prox)
    out = optimizer_step(model, optimizer, cfg, learn)
    return metrics.sums(), out | reduction.reported()


class StepMetrics:
    """A step's counters, on the device until the end (a float() per micro-batch would sync the
    GPU): the engine-vs-trainer mismatch over the tokens as sampled (loss.mismatch_sums), the
    entropy and the correction's importance weights over the tokens trained; the largest weight
    and log rho over responses (and -the smallest)."""

    NAMES = (
        "loss_tokens",
        "mismatch",
        "mismatch_k3",
        "responses",
        "log_ppl_gap",
        "rejected",
        "rejected_responses",
        "denom_tokens",
        "entropy",
        "importance_weight",
    )
    MAXIMA = ("importance_weight_max", "seq_log_ratio_max", "seq_log_ratio_min_max")

    def __init__(self, device):
        self.acc = torch.zeros(len(self.NAMES), dtype=torch.float64, device=device)
        # weights are >= 0: a step with nothing trained logs 0, not -inf (JSON has no -inf)
        self.most = torch.tensor(
            [0.0, -math.inf, -math.inf], dtype=torch.float64, device=device
        )

    def add(self, mb, logp, entropy, prox) -> None:
        d, behave = mb.denom_mask, mb.behave_logprobs
        mismatch, extremes = loss.mismatch_sums(logp, behave, d, mb.seq_ids, mb.rejected)
        iw = torch.exp(loss.log_ratio(prox, behave)).double()
        mine = torch.stack([d.sum(), (entropy.detach() * d).sum(), (iw * d).sum()])
        self.acc += torch.cat([mismatch, mine.double()])
        iw_max = torch.where(d > 0, iw, 0.0).max()[None]
        self.most = torch.maximum(self.most, torch.cat([iw_max, extremes]))

    def sums(self) -> dict:
        return dict(zip(self.NAMES + self.MAXIMA, torch.cat([self.acc, self.most]).tolist()))


def optimizer_step(model, optimizer, cfg: Config, learn: bool) -> dict:
    """Clip the global gradient norm, then step, unless it is not finite (all ranks agree: a
    global norm) or there is nothing to learn; gradients cleared either way."""
    out = {"updated": 0.0, "skipped_steps": 0.0, "grad_norm": 0.0}
    if learn:
        # --grad-clip 0: no clipping
        norm = torch.nn.utils.clip_grad_norm_(model.trainable(), cfg.grad_clip or math.inf)
        out["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        finite = math.isfinite(out["grad_norm"])
        if finite:
            optimizer.step()
        out["updated" if finite else "skipped_steps"] = 1.0
    optimizer.zero_grad()
    return out


def pack_microbatches(samples: list[Sample], cfg: Config) -> list[loss.MicroBatch]:
    """Samples -> packed micro-batches of at most --micro-batch-tokens positions (packing.py)."""
    return packing.pack_microbatches(
        samples,
        cfg.loss_aggregation,
        cfg.loss_aggregation_divisor,
        cfg.micro_batch_tokens,
        cfg.mask_truncated,
        SHARE_PROMPTS,
    )


# -----------------------------------------------------------------------------
# the models: the policy, frozen copies for the KL penalty and distillation, AdamW
def load_models(cfg: Config, device: torch.device, ranks: Ranks, engine=None) -> tuple:
    """(policy, KL reference or None, teacher or None, AdamW), each model sharded over every rank;
    the policy's memory plan agreed over ranks (modeling.gpu_memory) counts the engine and the
    frozen copies."""
    gpu, engine_bytes = modeling.gpu_memory(device, getattr(engine, "held", None))
    frozen = [cfg.teacher] if cfg.teacher and not rollout.is_url(cfg.teacher) else []
    if cfg.kl_coef > 0 and not cfg.lora_rank:  # LoRA's reference is its own base
        frozen.append(cfg.model)
    others = sum(modeling.parameter_count(path) for path in frozen)
    memory = {"gpu": gpu, "engine": engine_bytes, "others": others}
    load = lambda c, trainable: modeling.load_model(
        c, device, ranks.world, ranks.cp_group, trainable, memory
    )
    model = load(cfg, True)
    print0(model.summary)
    reference = None
    if cfg.kl_coef > 0 and cfg.lora_rank:  # LoRA: the frozen base is the reference, for free
        reference = replace(model, base_only=True)
    elif cfg.kl_coef > 0:
        reference = load(cfg, False)
    teacher = None
    if cfg.teacher and rollout.is_url(cfg.teacher):
        teacher = rollout.Scorer(cfg.teacher)
    elif cfg.teacher:
        teacher = load(replace(cfg, model=cfg.teacher, lora_rank=0, lora_adapter=None), False)
    # LoRA: the adapters alone
    optimizer = modeling.adamw(
        model.trainable(), lr=cfg.lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY
    )
    return model, reference, teacher, optimizer


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

    def flags(self, preempt: checkpoint.Preemption) -> dict:
        """What every rank must agree on: a checkpoint due by time, a signal one of them got."""
        # a bool: reduce_metrics' merge() sums it as a float
        due = time.monotonic() - self.last_save > 60 * CKPT_MINUTES
        return {"due": due} | preempt.signal_sums()


def end_step(
    step: int,
    sums: dict,
    metrics: dict,
    cfg: Config,
    model,
    optimizer,
    run: RunState,
    rollouts: rollout.Rollouts,
    logger: Logger,
) -> None:
    """After logging: stop after MAX_BAD_STEPS non-finite steps in a row (checkpoints hold healthy
    steps only); save when due (time, --ckpt-every, the end, a signal); stop on a signal."""
    run.bad_steps = run.bad_steps + 1 if metrics["skipped_steps"] else 0
    if run.bad_steps >= MAX_BAD_STEPS:
        last = checkpoint.complete_checkpoints(cfg.run_dir)
        raise cli.Stopped(
            f"error: {run.bad_steps} steps in a row had a non-finite loss or grad "
            f"norm; last good checkpoint: {last[-1] if last else 'none'}",
            code=1,
        )
    due = sums["due"] or "signal" in sums or step == cfg.steps
    if run.bad_steps == 0 and (due or every(cfg.ckpt_every, step, cfg.steps)):
        t0 = time.perf_counter()
        ahead = {s: [asdict(x) for x in b] for s, b in rollouts.wait().items()}
        meta = {
            "world": dist.get_world_size(),
            "updates": run.updates,
            "last_eval": run.last_eval,
            "config": asdict(cfg),
        }
        path = checkpoint.save_checkpoint(
            cfg.run_dir, step, model.module, optimizer, meta, ahead
        )
        logger.line(f"saved {path} in {time.perf_counter() - t0:.2f}s")
        run.last_save = time.monotonic()
    if "signal" in sums:
        logger.close()
        raise checkpoint.Interrupted(cfg.run_dir, step, int(sums["signal"]))


def resume(cfg: Config, model, optimizer, engine, ranks: Ranks, resuming: bool) -> RunState:
    """Restore --resume's checkpoint, or this run's newest readable one (a broken one set aside),
    into model, optimizer, RNGs, engine and batches made ahead; cut metrics.jsonl and samples.jsonl
    back to its step. Evaluating (--steps 0) touches no run's checkpoints or lines."""
    if cfg.steps == 0:
        path = None if cfg.resume in ("auto", "fresh") else cfg.resume
    else:
        path = on_rank0(checkpoint.choose_resume, cfg.run_dir, cfg.resume, resuming)
    run = RunState()
    if path is not None:
        meta, ahead = checkpoint.load_checkpoint(Path(path), model.module, optimizer)
        pending = {
            s: [
                rollout.sample_from_dict(x)
                for x in b
                if x["group"] % ranks.dp_size == ranks.dp_rank
            ]
            for s, b in ahead.items()
            if ranks.cp_rank == 0  # a CP group's first rank makes its batches
        }
        run = RunState(meta["step"], meta["updates"], meta["last_eval"] or {}, pending)
        done = " (nothing left to train)" if meta["step"] >= cfg.steps > 0 else ""
        verb = "resumed from" if cfg.steps else "evaluating"
        print0(f"{verb} step {meta['step']} ({path}){done}")
    # the engine loaded --model: these weights instead (share: the trainer's tensors; an engine
    # that released its weights to measure its memory holds none)
    if path is not None or cfg.lora_adapter or engine.share or engine.version < 0:
        engine.update_weights(model.module, run.step)
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
