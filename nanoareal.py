"""
nanoareal: a minimal, hackable GRPO trainer. This file is the reinforcement-learning loop, read
top to bottom: the config, the loop (generate -> reward -> advantages -> loss -> optimizer step
-> weight sync -> log), then the pieces in the order the loop uses them.

    python nanoareal.py                                  # the built-in arithmetic task, on a CPU
    torchrun --nproc_per_node 2 nanoareal.py --loss-aggregation prompt_mean
    python nanoareal.py --config configs/qwen2.5-0.5b-gsm8k.toml      # one GPU, SGLang colocated
    torchrun --nproc_per_node 4 nanoareal.py --cp-size 2  # 2 data-parallel x 2 context-parallel
    python nanoareal.py --reward my_reward.py:score       # your own reward, no edit here
    python nanoareal.py --help                            # every flag, documented

The rest is plumbing in flat files that never import this one: loss.py (aggregation modes,
surrogates and the LossReduction contract that makes gradients independent of micro-batching and
world size), rollout.py (generation engines), tasks.py (built-in tasks, datasets, rewards),
modeling.py (packed attention and Ulysses context parallel), checkpoint.py (checkpoints, resume,
export), logs.py (console and metrics).

Left out on purpose: a critic (GRPO needs none), multi-turn tool use, tensor/pipeline parallel in
the trainer (FSDP2 + optional context parallel cover one node up to a few billion parameters),
class hierarchies.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
import types
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
import tyro

import checkpoint
import cli
import logs
import loss
import modeling
import rollout
import tasks
from cli import UserError
from logs import Logger, on_rank0, print0, reduce_sums, step_metrics
from rollout import Completion, SamplingParams, mix_seed

# -----------------------------------------------------------------------------
# config: one flat set of flags, `--help` is its documentation. The trainer's flags are here; each
# helper file defines the flags it reads: the loss flags (--loss-aggregation, --policy-loss,
# --eps-low, --kl-coef, ...) are loss.py's LossConfig, next to the formulas they parametrise, and
# rollout.py, checkpoint.py and logs.py have theirs.


DATASET_HELP = (f"A built-in task ({', '.join(tasks.TASKS)}) or a JSONL file of rows with "
                '"prompt" or "messages" (and whatever the reward reads: the whole row reaches it).')
REWARD_HELP = ("The reward: auto (the built-in task's own, else exact_match), a built-in "
               f"({', '.join(tasks.REWARDS)}), or path/to/file.py:function taking (completion, "
               "row) and returning a float or (float, dict).")


@dataclass
class TrainConfig:
    # run
    model: str = "assets/tiny-arith"
    """Hugging Face causal-LM directory (weights and tokenizer) or hub id; the default is the
    shipped 1M-parameter arithmetic model."""
    run_dir: str | None = None
    """Directory of metrics.jsonl, the checkpoints and the final export; by default
    runs/<dataset>-<aggregation>-s<seed>-<hash of the other flags>: rerunning a command resumes
    its run, and a different command never writes into another's directory."""
    seed: int = 0
    """Seed of the run: prompt order and sampling noise are functions of (seed, step), so a seed
    reproduces a run (the held-out split of a built-in task never changes)."""
    steps: int = 100
    """Training steps; each generates one rollout batch and takes --num-minibatches optimizer
    steps on it."""
    config: str | None = None
    """TOML file whose keys (flag names, with - or _) set this command's defaults; flags given on
    the command line win."""

    # data
    dataset: Annotated[str, tyro.conf.arg(help=DATASET_HELP)] = "arithmetic"
    eval_dataset: str | None = None
    """JSONL file of held-out rows for greedy evaluation (a built-in task has its own split)."""
    chat_template: bool = False
    """Wrap each "prompt" in the tokenizer's chat template as a user turn ("messages" rows always
    use it)."""
    reward: Annotated[str, tyro.conf.arg(help=REWARD_HELP)] = "auto"
    prompts_per_step: int = 64
    """Prompts per rollout batch, all ranks together; each is a group of --group-size samples."""
    group_size: int = 8
    """Samples per prompt (G in GRPO): a sample's advantage compares its reward with its group's."""
    max_new_tokens: int = 8
    """Longest completion in tokens; a completion cut here ends with finish reason "length"."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs use the same one, so pi/pi_behave is 1 when
    the weights agree."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p."""
    top_k: int = -1
    """Draw from the k most likely tokens only (-1 keeps all)."""

    # advantages
    adv_estimator: Literal[tuple(ADVANTAGE_ESTIMATORS)] = "grpo"  # type: ignore[valid-type]
    """Baseline subtracted from a sample's reward: grpo, the group's mean; rloo, the mean of the
    other samples of its group (leave-one-out)."""
    adv_std: bool = True
    """Divide grpo advantages by the group's reward std; --no-adv-std is Dr. GRPO's fix (rloo
    never divides: its advantage is the plain leave-one-out difference)."""
    adv_eps: float = 1e-6
    """Added to the group's std before dividing, so a group with a tiny spread cannot explode."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal before training (no signal, only normalizer mass):
    DAPO's dynamic-sampling filter, without resampling."""
    mask_truncated: bool = False
    """Leave responses cut by --max-new-tokens out of the loss and its denominators (DAPO)."""

    # optimization
    lr: float = 1e-4
    """AdamW learning rate, reached after --warmup-steps and then kept or decayed."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay: each step shrinks the weights by lr times this factor."""
    beta1: float = 0.9
    """AdamW decay rate of the first moment (the gradient's running mean)."""
    beta2: float = 0.99
    """AdamW decay rate of the second moment (the squared gradient's running mean)."""
    warmup_steps: int = 2
    """Steps of linear learning-rate warm-up, from lr/(warmup+1) up to lr."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or cosine decay to 0 at --steps."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each optimizer step; 0 turns clipping
    off (the norm is still logged)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch, each on a share of its groups; more than one recomputes
    the proximal log-probs with one extra forward pass."""
    reuse_train_logprobs: bool = True
    """With one mini-batch, use the training forward's detached log-probs as pi_prox (exact, and
    one forward pass fewer)."""
    micro_batch_tokens: int = 4096
    """Token budget of a packed micro-batch (sequences are never cut); attention is per segment,
    so the cost is linear in it: bigger means fewer passes and more memory."""
    share_prompts: bool = True
    """Feed each group's prompt once per micro-batch and let its samples attend to that copy
    (exact); --no-share-prompts feeds every sequence whole."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when hidden states become log-probs: a large vocabulary never holds fp32
    logits for a whole micro-batch."""

    # eval
    eval_every: int = 10
    """Greedy held-out evaluation every N steps, at step 0 and at the end; 0 turns it off."""
    eval_size: int = 256
    """Held-out rows evaluated (the first N of the split)."""
    # failures
    max_bad_steps: int = 3
    """Stop after this many steps in a row with a non-finite loss or gradient norm (skipped)."""
    reward_timeout: float = 5.0
    """Seconds one reward call may take; one that raises or times out scores 0 (reward_errors)."""
    dist_timeout: float = 1800.0
    """Seconds a collective waits for the other ranks before giving up: a dead peer never hangs."""

    # system
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: auto picks CUDA when it is available, else the CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """Compute precision: bfloat16 computes in bf16 with fp32 master weights and optimizer state;
    auto is bfloat16 on a GPU and float32 on a CPU; float64 is for exactness tests."""
    attention: Literal[tuple(modeling.ATTENTION_PATHS)] = "auto"  # type: ignore[valid-type]
    """Attention kernel for packed rows: auto picks flash-attn varlen, else PyTorch's varlen_attn,
    for bf16 on a GPU, and the padded per-segment path otherwise; an impossible one is an error."""
    threads: int = 1
    """PyTorch CPU threads per rank (1 is the stable choice on small machines)."""
    cp_size: int = 1
    """Context parallel (Ulysses): ranks that split every packed micro-batch's tokens; it must
    divide the number of ranks and of attention heads."""


@dataclass
class Config(loss.LossConfig, rollout.RolloutConfig, checkpoint.CheckpointConfig, logs.LogConfig,
             TrainConfig):
    """Every flag: the trainer's, then logging, checkpoints, the rollout engine and the loss."""


# -----------------------------------------------------------------------------
# the training loop


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)  # flags and --config TOML
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", 1)))  # every check, before any work
    ranks, device = setup_distributed(cfg)  # torchrun's environment, or a world of one
    reward_fn = tasks.load_reward(cfg.reward)
    modeling.check_model_source(cfg.model)
    resuming = on_rank0(checkpoint.claim_run_dir, cfg.run_dir, asdict(cfg), VOLATILE,
                        cfg.overwrite, cfg.resume == "none")  # this run's, or a one-line refusal
    torch.manual_seed(cfg.seed)
    tokenizer, train_rows, evalset, encoded = load_data(cfg)

    # the rollout engine first (SGLang sizes its KV cache from the GPU memory free at start), then
    # the policy sharded by FSDP2 over every rank, its optimizer, and the loss, whose normalizers
    # are reduced over every rank
    engine = rollout.make_engine(cfg, device)
    model = load_model(cfg, device, ranks)
    ref_model = load_model(cfg, device, ranks, trainable=False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
    group = dist.group.WORLD if ranks.world > 1 else None
    reduction = loss.build_loss(cfg, group=group, cp_factor=ranks.cp_size)
    start_step, last_eval = resume(cfg, model, optimizer, scheduler, engine, ranks, resuming)
    logger = Logger(cfg.run_dir, cfg.steps, start_step, cfg.log_every, cfg.wandb_project,
                    cfg.wandb_run_name, asdict(cfg))
    print0(f"nanoareal: {ranks.world} rank(s) on {device.type}, {cfg.model}, {len(train_rows)} "
           f"train prompts, {len(evalset)} eval, loss {cfg.policy_loss}/{cfg.loss_aggregation}, "
           f"run {cfg.run_dir}")
    if evalset and cfg.eval_every > 0 and start_step == 0:
        last_eval = evaluate(engine, evalset, cfg, tokenizer, reward_fn, ranks)
        logger.log(0, {"eval/accuracy": last_eval})
    bad_steps, last_save = 0, time.monotonic()
    with checkpoint.Preemption() as preempt:  # SIGINT/SIGTERM: finish the step, save, exit
        for step in range(start_step, cfg.steps):
            t0 = time.perf_counter()
            # ALGO LOGIC. generate: group_size samples of each of this data-parallel rank's
            # prompts (every dp_size-th of the step's list, so a group never straddles ranks); a
            # context-parallel group shares one rollout
            prompts = prompts_for_step(len(train_rows), cfg.prompts_per_step, step, cfg.seed)
            prompts = list(enumerate(prompts))[ranks.dp_rank :: ranks.dp_size]  # (slot, row)
            samples = cp_broadcast(generate(engine, encoded, prompts, step, cfg, tokenizer)
                                   if ranks.cp_rank == 0 else None, ranks)
            t1 = time.perf_counter()
            # reward each completion, then advantages within each prompt's group
            rollout_sums = score(samples, train_rows, reward_fn, tokenizer, cfg)
            rollout_sums |= set_advantages(samples, cfg)
            if cfg.filter_zero_variance:
                samples = [s for s in samples if not s.zero_variance]
            # loss and optimizer step(s); a colocated engine frees its GPU memory meanwhile
            engine.release_memory()
            train_sums, train_stats = train_on_samples(model, ref_model, optimizer, reduction,
                                                       samples, cfg, device, ranks)
            lr = scheduler.get_last_lr()[0]  # the one this step used
            scheduler.step()
            engine.resume_memory()
            t2 = time.perf_counter()
            # sync: the engine generates the next batch with the new weights
            engine.update_weights(model, step + 1)
            t3 = time.perf_counter()
            # TRY NOT TO MODIFY: metrics and what every rank must agree on (a signal one of them
            # got, a checkpoint due) in one collective, a CP group counting its samples once;
            # eval, log, checkpoint, stop on a signal
            due = cfg.ckpt_minutes and time.monotonic() - last_save > 60 * cfg.ckpt_minutes
            sums = reduce_sums((rollout_sums | train_sums if ranks.cp_rank == 0 else {})
                               | {"due": float(due)} | preempt.signal_sums())
            metrics = step_metrics(sums, train_stats, (t0, t1, t2, t3), lr)
            if evalset and every(cfg.eval_every, step + 1, cfg.steps):
                last_eval = evaluate(engine, evalset, cfg, tokenizer, reward_fn, ranks)
                metrics["eval/accuracy"] = last_eval
            logger.log(step + 1, metrics)  # metrics.jsonl, wandb, every --log-every a line
            bad_steps = check_bad_steps(bad_steps, metrics, cfg)  # stops after --max-bad-steps
            if bad_steps == 0 and (sums["due"] or "signal" in sums or step + 1 == cfg.steps
                                   or every(cfg.ckpt_every, step + 1, cfg.steps)):
                last_save = save(step + 1, cfg, model, optimizer, scheduler, last_eval, logger)
            if "signal" in sums:
                logger.close()
                raise checkpoint.Interrupted(cfg.run_dir, step + 1, int(sums["signal"]))
    logger.close()
    checkpoint.export_hf(model, tokenizer, cfg.model, Path(cfg.run_dir) / "final")
    if last_eval is not None:
        print0(f"final held-out accuracy {last_eval:.3f}")
    engine.shutdown()


# -----------------------------------------------------------------------------
# set-up: the config (flags + TOML, validated once) and the ranks


def parse_config(argv: list[str] | None = None) -> Config:
    """Flags and --config TOML -> Config; a mistake in either is one line (cli.parse_flags)."""
    return cli.parse_flags(Config, sys.argv[1:] if argv is None else argv)


def validate_config(cfg: Config, world: int) -> Config:
    """Every check of the flags, in one place, before anything heavy loads: a mistake is one line
    naming the flag (a UserError). Fills what depends on other flags (the surrogate's defaults,
    the reward of a built-in task, the run directory's name)."""
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    checks = [
        (min(cfg.steps, cfg.prompts_per_step, cfg.max_new_tokens, cfg.micro_batch_tokens,
             cfg.logprob_chunk_tokens, cfg.eval_size, cfg.log_every, cfg.threads) >= 1,
         "--steps, --prompts-per-step, --max-new-tokens, --micro-batch-tokens, "
         "--logprob-chunk-tokens, --eval-size, --log-every and --threads must be >= 1"),
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: a sample alone in its group has no "
         "baseline to compare with (every advantage would be 0); use --group-size >= 2"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: rollouts must sample (> 0); at 0 "
         "every sample of a group is the same and every advantage 0 (eval is always greedy)"),
        (0 < cfg.top_p <= 1 and (cfg.top_k == -1 or cfg.top_k >= 1),
         "--top-p must be in (0, 1] and --top-k -1 (off) or >= 1"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr {cfg.lr}: must be a positive number"),
        (cfg.weight_decay >= 0 and 0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1,
         "--weight-decay must be >= 0, --beta1 and --beta2 in [0, 1)"),
        (cfg.grad_clip >= 0, f"--grad-clip {cfg.grad_clip}: must be > 0, or 0 for no clipping"),
        (1 <= cfg.num_minibatches <= cfg.prompts_per_step,
         "--num-minibatches must be in [1, --prompts-per-step]"),
        (min(cfg.eval_every, cfg.max_bad_steps, cfg.warmup_steps) >= 0,
         "--eval-every, --max-bad-steps and --warmup-steps must be >= 0"),
        (min(cfg.reward_timeout, cfg.dist_timeout, cfg.adv_eps) > 0,
         "--reward-timeout, --dist-timeout and --adv-eps must be > 0"),
        (cfg.cp_size >= 1 and world % cfg.cp_size == 0,
         f"--cp-size {cfg.cp_size} must divide the number of ranks ({world})"),
        (cfg.device != "cuda" or torch.cuda.is_available(), "--device cuda: no GPU is available"),
        (not cfg.eval_dataset or cfg.dataset not in tasks.TASKS, f"--eval-dataset is for a JSONL "
         f"--dataset: the built-in task {cfg.dataset!r} has its own held-out split"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(f"config error: {message}")
    try:
        resolved = loss.check_loss_config(cfg, cfg.max_new_tokens)  # defaults filled in
        for name in ("loss_aggregation", "loss_aggregation_divisor", "eps_low", "eps_high"):
            setattr(cfg, name, getattr(resolved, name))
        if cfg.attention != "auto":  # a kernel that cannot run here fails now, not after loading
            modeling.choose_attention(cfg.attention, torch.device("cuda" if cuda else "cpu"),
                                      cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and cuda),
                                      softcap=False)
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    rollout.check_rollout_config(cfg, cuda)
    checkpoint.check_checkpoint_config(cfg)
    if cfg.m2po_threshold is not None:  # it needs the whole mini-batch's pi_prox before training
        cfg.reuse_train_logprobs = False
    if cfg.num_minibatches > 1 and cfg.reuse_train_logprobs:
        print0("warning: --reuse-train-logprobs is only valid with one mini-batch; recomputing "
               "pi_prox instead")
        cfg.reuse_train_logprobs = False
    cfg.reward = tasks.resolve_reward_name(cfg.reward, cfg.dataset)
    shipped = Path(__file__).resolve().parent / cfg.model  # assets/... from any directory
    cfg.model = str(shipped) if not Path(cfg.model).exists() and shipped.is_dir() else cfg.model
    state = {k: v for k, v in asdict(cfg).items() if k not in VOLATILE}
    cfg.run_dir = cfg.run_dir or checkpoint.run_dir_name(cfg.dataset, cfg.loss_aggregation,
                                                         cfg.seed, state)
    return cfg


# flags that change how a run is watched or how long it goes, not what it computes: a rerun with
# other values continues the same run (a cosine schedule's horizon follows --steps)
VOLATILE = {"run_dir", "config", "steps", "resume", "overwrite", "ckpt_every", "ckpt_minutes",
            "keep_ckpts", "eval_every", "eval_size", "log_every", "wandb_project",
            "wandb_run_name", "threads", "dist_timeout", "max_bad_steps", "reward_timeout",
            "rollout_url", "rollout_timeout", "rollout_retries", "rollout_abort_retries",
            "rollout_health_timeout", "weight_sync_addr", "weight_sync_bucket_mb", "attention"}


def load_data(cfg: Config) -> tuple:
    """(tokenizer, train rows, held-out (row, prompt ids) pairs, every train prompt's ids), every
    prompt tokenized once; or a one-line error: a tokenizer that will not load, unencodable
    prompts, a prompt too long for a micro-batch."""
    from transformers import AutoTokenizer

    logs.quiet_libraries()  # transformers' progress bars and info lines off (imported from here)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    except Exception as e:  # a directory without tokenizer files ends in sentencepiece advice
        raise UserError(f"--model {cfg.model}: no usable tokenizer there ({cli.why(e)})") from None
    train_rows, eval_rows = tasks.load_dataset(cfg.dataset, cfg.eval_dataset, cfg.reward)
    eval_rows = eval_rows[: cfg.eval_size]
    encoded = tasks.encode_prompts(train_rows, tokenizer, cfg.chat_template, cfg.dataset)
    evalset = list(zip(eval_rows, tasks.encode_prompts(eval_rows, tokenizer, cfg.chat_template,
                                                        cfg.eval_dataset or cfg.dataset)))
    # the longest possible sequence must fit one micro-batch (sequences are never cut): fail now,
    # not at the step that first samples a long answer
    longest = max(map(len, encoded), default=0)
    if longest + cfg.max_new_tokens > cfg.micro_batch_tokens:
        raise UserError(f"config error: --micro-batch-tokens {cfg.micro_batch_tokens} is smaller "
                        f"than the longest possible sequence ({longest} prompt tokens + "
                        f"--max-new-tokens {cfg.max_new_tokens})")
    return tokenizer, train_rows, evalset, encoded


@dataclass(frozen=True)
class Ranks:
    """This process's place: rank and world in torchrun's world, and in the (data-parallel,
    context-parallel) mesh, where ranks [k*cp_size, (k+1)*cp_size) form context-parallel group k
    (data-parallel rank k)."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: object = None


def setup_distributed(cfg: Config) -> tuple[Ranks, torch.device]:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:  # a collective waits at most dist_timeout for a peer
        from datetime import timedelta

        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    else:  # a one-rank group keeps one code path (FSDP2 and collectives work the same)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    torch.set_num_threads(cfg.threads)
    cp = cfg.cp_size if cfg.cp_size >= 1 and world % cfg.cp_size == 0 else 1  # else: see validate
    cp_group = None
    if cp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
        cp_group = mesh["cp"].get_group()
    return Ranks(rank, world, rank // cp, world // cp, rank % cp, cp, cp_group), device


def cp_broadcast(obj, ranks: Ranks):
    """The CP group's first rank's object on every rank of the group (one rollout per CP group)."""
    if ranks.cp_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=ranks.rank - ranks.cp_rank, group=ranks.cp_group)
    return box[0]


def every(n: int, step: int, last: int) -> bool:
    """Due every n steps and at the last step; n = 0 never."""
    return n > 0 and (step % n == 0 or step == last)


def lr_factor(step: int, cfg: Config) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0


# -----------------------------------------------------------------------------
# generate: the step's prompts, group_size samples each


def prompts_for_step(num_rows: int, per_step: int, step: int, seed: int) -> list[int]:
    """Row indices of a step's prompts, in slot order. An epoch is a seeded permutation cut into
    num_rows // per_step steps (the few rows left over sit out that epoch), so a step never holds
    a row twice. With fewer rows than --prompts-per-step each step concatenates fresh
    permutations. A function of (seed, step) only: resuming needs no data-loader state and every
    world size sees the same prompts in the same order."""
    def permutation(epoch: int) -> list[int]:
        perm = list(range(num_rows))
        random.Random(mix_seed(seed, 0xDA7A, epoch)).shuffle(perm)
        return perm

    if per_step > num_rows:
        per = -(-per_step // num_rows)  # permutations per step
        return sum((permutation(step * per + j) for j in range(per)), [])[:per_step]
    epoch, k = divmod(step, num_rows // per_step)
    return permutation(epoch)[k * per_step : (k + 1) * per_step]


@dataclass
class Sample:
    group: int
    """The GRPO group (the prompt's slot in the step): advantages compare samples of one group."""
    prompt_ids: list[int]
    completion: Completion
    reward: float = 0.0
    advantage: float = 0.0
    zero_variance: bool = False
    """All rewards of its group are equal (no GRPO signal)."""
    row: int = -1
    """The dataset row the prompt comes from (-1: same as group)."""
    correct: bool | None = None


def generate(engine, encoded: list[list[int]], prompts: list[tuple[int, int]], step: int,
             cfg: Config, tokenizer) -> list[Sample]:
    """group_size completions of each (slot, row) prompt; a sample the engine aborted is dropped.
    The slot is the group id, and with k it keys the sampling seed: a function of (seed, step,
    slot, k) only, not of the rank, the batch or the world size."""
    sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k,
                              [tokenizer.eos_token_id])
    slots = [(slot, row) for slot, row in prompts for _ in range(cfg.group_size)]
    seeds = [mix_seed(cfg.seed, step, slot, k) for slot, _ in prompts
             for k in range(cfg.group_size)]
    completions = engine.generate([encoded[row] for _, row in slots], sampling, seeds)
    return [Sample(slot, encoded[row], c, row=row) for (slot, row), c in zip(slots, completions)
            if c.finish_reason != "abort"]


# -----------------------------------------------------------------------------
# reward and advantages


def score(samples: list[Sample], rows: list[dict], reward_fn, tokenizer, cfg: Config) -> dict:
    """Reward every completion (sets .reward and .correct); returns this rank's rollout sums. A
    reward call that raises or hangs scores 0 and is counted."""
    texts = tokenizer.batch_decode([s.completion.output_ids for s in samples],
                                   skip_special_tokens=True)
    scores, errors, first_error = tasks.compute_rewards(
        reward_fn, texts, [rows[s.row] for s in samples], cfg.reward_timeout)
    sums = Counter({"n_samples": len(samples), "reward_sum": 0.0, "reward_errors": errors,
                    "judged": 0, "correct_sum": 0})
    for s, sc in zip(samples, scores):
        s.reward, s.correct, length = sc.reward, sc.correct, len(s.completion.output_ids)
        sums.update({"reward_sum": sc.reward, "response_len_sum": length,
                     "prompt_len_sum": len(s.prompt_ids),
                     "truncated_sum": s.completion.finish_reason == "length"})
        if sc.correct is not None:  # response lengths split by correctness: who grows longer
            kind = "correct" if sc.correct else "incorrect"
            sums.update({"judged": 1, "correct_sum": sc.correct, f"len_{kind}_sum": length,
                         f"len_{kind}_n": 1})
        for k, v in sc.metrics.items():  # the reward's own metrics: a mean over who reports them
            sums.update({f"reward/{k}_sum": v, f"reward/{k}_n": 1})
    return dict(sums) | ({"reward_error_message": first_error} if first_error else {})


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                     use_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from rewards and group ids (any sizes, any order; a group of one gets
    0): A_i = (R_i - baseline_i) / (std_g R + eps), divided by the (unbiased) std only with
    use_std and an estimator that scales."""
    rewards = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    n = torch.zeros(int(inv.max()) + 1 if len(inv) else 0, dtype=torch.float64)
    n = n.index_add_(0, inv, torch.ones_like(rewards))
    total = torch.zeros_like(n).index_add_(0, inv, rewards)
    squares = torch.zeros_like(n).index_add_(0, inv, (rewards - (total / n)[inv]) ** 2)
    std = (squares / (n - 1).clamp(min=1)).sqrt()
    baseline, scaled = ADVANTAGE_ESTIMATORS[estimator]
    adv = rewards - baseline(rewards, total[inv], n[inv])
    if use_std and scaled:
        adv = adv / (std[inv] + eps)
    return torch.where(n[inv] > 1, adv, torch.zeros_like(adv)).float()


# name -> (baseline_i from R_i, its group's reward sum and size; whether --adv-std divides by std)
ADVANTAGE_ESTIMATORS = {
    "grpo": (lambda r, total, n: total / n, True),  # the group's mean (Shao et al. 2024)
    "rloo": (lambda r, total, n: (total - r) / (n - 1).clamp(min=1), False),  # leave-one-out
}


def set_advantages(samples: list[Sample], cfg: Config) -> dict:
    """Sets each sample's .advantage and .zero_variance; returns this rank's sums of zero-advantage
    samples and of groups whose rewards are all equal."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    adv = group_advantages(rewards, groups, cfg.adv_estimator, cfg.adv_std, cfg.adv_eps)
    distinct: dict[int, set[float]] = {}  # each group's distinct rewards
    for s in samples:
        distinct.setdefault(s.group, set()).add(s.reward)
    for s, a in zip(samples, adv.tolist()):
        s.advantage, s.zero_variance = a, len(distinct[s.group]) == 1
    return {"zero_adv_sum": sum(abs(s.advantage) < 1e-12 for s in samples),
            "zero_var_groups": len({s.group for s in samples if s.zero_variance})}


# -----------------------------------------------------------------------------
# loss and step: packed micro-batches, log-probs, LossReduction, clip, AdamW


def train_on_samples(model, ref_model, optimizer, reduction, samples: list[Sample], cfg: Config,
                     device, ranks: Ranks) -> tuple[dict, dict]:
    """One rollout batch -> --num-minibatches optimizer steps, each on a share of the groups.
    Returns this rank's metric sums and the step's stats (grad norm, skipped steps, the loss
    terms' global values)."""
    groups = sorted({s.group for s in samples})
    shares = [set(groups[i :: cfg.num_minibatches]) for i in range(cfg.num_minibatches)]
    packed = [even_out_microbatches(pack_microbatches([s for s in samples if s.group in share],
                                                      cfg)) for share in shares]
    # pi_prox (and the reference policy) are the weights *before* the first update of this batch
    if not cfg.reuse_train_logprobs or ref_model is not None:
        with torch.no_grad():
            for mb in (mb for mbs in packed for mb in mbs):
                for key, policy in (("prox_logprobs", None if cfg.reuse_train_logprobs else model),
                                    ("ref_logprobs", ref_model)):
                    if policy is not None:
                        logprobs = microbatch_forward(policy, mb, cfg, device, ranks)[0]
                        mb[key] = logprobs.float().cpu()
    for mbs in packed if cfg.m2po_threshold is not None else []:  # a mask over all its tokens
        loss.apply_m2po(mbs, cfg.m2po_threshold, dist.group.WORLD if ranks.world > 1 else None)
    # trained_tokens: prompt + completion tokens of the samples trained on; positions: what the
    # model was fed (fewer: shared prompts, no last tokens). tokens/s counts the former, so a
    # cheaper layout shows up as more tokens/s
    sums = {"trained_tokens": sum(len(s.prompt_ids + s.completion.output_ids) for s in samples),
            "positions": sum(mb["input_ids"].numel() for mbs in packed for mb in mbs),
            "denom_tokens": sum(float(mb["denom_mask"].sum()) for mbs in packed for mb in mbs),
            "entropy_sum": 0.0, "mismatch_sum": 0.0}
    stats: dict[str, float] = {"grad_norm": 0.0, "skipped_steps": 0.0}
    for mbs in packed:
        out = train_minibatch(model, optimizer, reduction, mbs, cfg, device, ranks)
        stats["grad_norm"] = out["grad_norm"]
        stats["skipped_steps"] += out["skipped_step"]
        sums["entropy_sum"] += out["entropy_sum"]
        sums["mismatch_sum"] += out["mismatch_sum"]
        for k, v in reduction.reported().items():  # averaged over the mini-batches of the step
            stats[k] = stats.get(k, 0.0) + v / len(packed)
    return sums, stats


MODEL_KEYS = ("input_ids", "position_ids", "targets", "segments")  # the model's inputs


def train_minibatch(model, optimizer, reduction: loss.LossReduction, mbs: list[dict], cfg: Config,
                    device, ranks: Ranks) -> dict[str, float]:
    # every token's normalizer counted once globally: a CP group's ranks all hold the same
    # micro-batches, so only its first rank counts them (every CP rank then computes the full
    # loss: cp_factor puts the N back into Z)
    reduction.begin_step(mbs if ranks.cp_rank == 0 else [])
    # metric sums stay on the device until the end of the step: a float() per micro-batch would
    # sync the GPU
    entropy_sum = mismatch_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in mbs:
        logprobs, entropy = microbatch_forward(model, mb, cfg, device, ranks, grad=True)
        batch = {k: v.to(device) for k, v in mb.items() if k not in MODEL_KEYS}
        batch["logprobs"], batch["entropy"] = logprobs, entropy
        if "prox_logprobs" not in batch:  # one mini-batch: pi_prox is this very forward, detached
            batch["prox_logprobs"] = logprobs.detach()
        reduction(batch).backward()
        entropy_sum = entropy_sum + (entropy.detach() * batch["denom_mask"]).sum()
        # train/inference mismatch |log pi_theta - log pi_behave| before the update: ~0 when the
        # engine holds the same weights; large values mean a stale or broken weight sync
        mismatch = (logprobs.detach() - batch["behave_logprobs"]).abs()
        mismatch_sum = mismatch_sum + (mismatch * batch["denom_mask"]).sum()
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # 0: measure, do not clip
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    skipped = not math.isfinite(grad_norm)
    if not skipped:  # a non-finite norm is global, hence the same on every rank: all skip together
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "skipped_step": float(skipped),
            "entropy_sum": float(entropy_sum), "mismatch_sum": float(mismatch_sum)}


def pack_microbatches(samples: list[Sample], cfg: Config) -> list[dict]:
    """Pack samples into micro-batches of at most --micro-batch-tokens fed positions.

    Per-token tensors are aligned with the *predicted* token: position j of a sequence predicts
    token j+1. The last token of a sequence is never fed: it predicts nothing and, being last,
    nothing attends to it. Mode weights come from the whole mini-batch's metadata before any
    split, which is what makes any split exact (rule 2 of the contract in loss.py).

    With --share-prompts a micro-batch feeds each distinct prompt prefix (prompt minus its last
    token) once; each sample feeds only its tail (last prompt token + completion minus its last
    token) at positions p-1.. and attends to the shared prefix. Exact: under causal attention the
    prefix's hidden states depend on the prefix alone, and backward sums every sample's gradient
    into the one copy. `segments` [R, 4] says who attends to what (modeling.py).
    """
    lengths = [len(s.completion.output_ids) for s in samples]
    dropped = [cfg.mask_truncated and s.completion.finish_reason == "length" for s in samples]
    denom = torch.tensor([0.0 if d else n for n, d in zip(lengths, dropped)], dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    mode = loss.resolved(cfg).loss_aggregation
    weights, norm_weights = loss.response_weights(mode, denom, groups, cfg.loss_aggregation_divisor)
    keys = [tuple(s.prompt_ids[:-1]) for s in samples]  # what a sample can share with its group
    out = []
    for idx in split_by_budget(samples, keys, lengths, cfg):
        cols = {k: [] for k in ("input_ids", "position_ids", "targets", "loss_mask", "advantages",
                                "behave_logprobs", "loss_weight", "norm_weight", "seq_ids")}
        segments, prefix_at = [], {}  # prefix_at: key -> (start, length) of its copy in this batch
        for k, i in enumerate(idx):
            s, p, r, key = samples[i], len(samples[i].prompt_ids), lengths[i], keys[i]
            full = s.prompt_ids + s.completion.output_ids
            if not cfg.share_prompts:  # the whole sequence, alone
                head, ctx = 0, (0, 0)
            elif key in prefix_at:
                head, ctx = p - 1, prefix_at[key]
            else:  # the prompt's first sample here: its prefix is a segment that predicts nothing
                head, ctx = p - 1, (len(cols["input_ids"]), p - 1)
                prefix_at[key] = ctx
                if p > 1:
                    segments.append((len(cols["input_ids"]), p - 1, 0, 0))
                    zeros = [0.0] * (p - 1)
                    _extend(cols, full[: p - 1], range(p - 1), full[1:p], zeros, 0.0, zeros, 0.0,
                            0.0, [-1] * (p - 1))
            n, fed_prompt = p + r - 1 - head, p - 1 - head  # positions head..p+r-2, prompt ones
            if n == 0:
                continue
            segments.append((len(cols["input_ids"]), n, *ctx))
            _extend(cols, full[head:-1], range(head, p + r - 1), full[head + 1 :],
                    [0.0] * fed_prompt + [0.0 if dropped[i] else 1.0] * r, s.advantage,
                    [0.0] * fed_prompt + s.completion.logprobs, float(weights[i]),
                    float(norm_weights[i]), [-1] * fed_prompt + [k] * r)
        out.append(_to_tensors(cols, segments))
    return out


def split_by_budget(samples: list[Sample], keys: list[tuple], lengths: list[int],
                    cfg: Config) -> list[list[int]]:
    """Greedy cut of the samples, in order, into micro-batches of at most --micro-batch-tokens
    fed positions (a shared prefix costs its first sample only)."""
    batches, current, used, prefixes = [], [], 0, set()
    for i, (s, key) in enumerate(zip(samples, keys)):
        n = len(s.prompt_ids) + lengths[i] - 1  # <= the budget: load_data checked the longest
        cost = lengths[i] if cfg.share_prompts and key in prefixes else n
        if used + cost > cfg.micro_batch_tokens:
            batches.append(current)
            current, used, prefixes, cost = [], 0, set(), n
        current.append(i)
        used += cost
        prefixes.add(key)
    return batches + [current] if current else batches


def _extend(cols: dict, ids, pos, targets, mask, adv: float, behave, weight: float,
            norm_weight: float, seq) -> None:
    n = len(ids)
    for key, values in (("input_ids", ids), ("position_ids", pos), ("targets", targets),
                        ("loss_mask", mask), ("advantages", [adv] * n), ("behave_logprobs", behave),
                        ("loss_weight", [weight] * n), ("norm_weight", [norm_weight] * n),
                        ("seq_ids", seq)):
        cols[key] += values


def _to_tensors(cols: dict, segments: list) -> dict:
    ints = {"input_ids", "position_ids", "targets", "seq_ids"}
    mb = {k: torch.tensor(v, dtype=torch.long if k in ints else torch.float32)
          for k, v in cols.items()}
    mb["input_ids"], mb["position_ids"] = mb["input_ids"][None], mb["position_ids"][None]
    mb["denom_mask"] = mb["loss_mask"].clone()
    mb["segments"] = torch.tensor(segments, dtype=torch.long).view(-1, 4)
    return mb


def empty_microbatch() -> dict:
    """One masked token: a rank with nothing to train on still runs forward/backward so that
    FSDP's collectives match."""
    cols = {"input_ids": [0], "position_ids": [0], "targets": [0], "loss_mask": [0.0],
            "advantages": [0.0], "behave_logprobs": [0.0], "loss_weight": [0.0],
            "norm_weight": [0.0], "seq_ids": [-1]}
    return _to_tensors(cols, [(0, 1, 0, 0)])


def even_out_microbatches(mbs: list[dict]) -> list[dict]:
    """Every rank runs the same number of forward/backward passes (FSDP2 all-gathers per pass)."""
    n = loss.all_reduce_vector(torch.tensor([len(mbs)]), op=dist.ReduceOp.MAX)
    return mbs + [empty_microbatch() for _ in range(int(n) - len(mbs))]


# -----------------------------------------------------------------------------
# the model: FSDP2 wiring, packed attention, log-probs in vocabulary chunks


def load_model(cfg: Config, device: torch.device, ranks: Ranks, trainable: bool = True):
    """An HF causal LM sharded with FSDP2 over every rank: one unit per decoder layer + the root.
    Master weights and optimizer state stay fp32 (fp64 with --dtype float64); bf16 is compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )
    from transformers import AttentionInterface, AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model, dtype=torch.float64 if cfg.dtype == "float64" else torch.float32)
    except (OSError, ValueError) as e:  # no weights, an unknown architecture, ...
        raise UserError(f"--model {cfg.model}: cannot load a causal LM ({cli.why(e)})") from None
    model = model.to(device)
    text = model.config.get_text_config()
    if text.num_attention_heads % ranks.cp_size:  # each CP rank attends with H/N whole heads
        raise UserError(f"config error: --cp-size {ranks.cp_size} must divide the model's "
                        f"{text.num_attention_heads} attention heads")
    model.config.use_cache = False
    model.eval()  # dropout off: the trainer's log-probs must be those the sampler drew from
    # every layer's attention: packed rows by segments (modeling.py), checked against the model's
    # own forward once, then run with the fastest kernel that can
    AttentionInterface.register("packed", modeling.packed_attention)
    model.set_attn_implementation("packed")
    if trainable and (problem := modeling.check_model(model, text.vocab_size)):
        raise UserError(f"--model {cfg.model} ({text.model_type}) is not supported: {problem}")
    mixed = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    try:
        path, model.attention_kernel, why = modeling.choose_attention(
            cfg.attention, device, mixed, bool(getattr(text, "attn_logit_softcapping", None)))
    except ValueError as e:
        raise UserError(f"config error: {e}") from None
    if trainable:
        compute = "bf16 (fp32 master weights)" if mixed else str(model.dtype).removeprefix("torch.")
        print0(f"attention: {path}{f' ({why})' if why else ''}; compute: {compute}")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mp = {"mp_policy": bf16} if mixed else {}
    mesh = init_device_mesh(device.type, (ranks.world,))
    for block in modeling.decoder_layers(model):
        fully_shard(block, mesh=mesh, **mp)
    fully_shard(model, mesh=mesh, **mp)
    model.policy_logprobs = types.MethodType(modeling.policy_logprobs, model)
    register_fsdp_forward_method(model, "policy_logprobs")  # the root's parameters are gathered
    loss.fsdp_sum_gradients(model)  # LossReduction divides by the *global* normalizer: sum ranks
    model.requires_grad_(trainable)
    return model


def microbatch_forward(model, mb: dict, cfg: Config, device: torch.device, ranks: Ranks,
                       grad: bool = False):
    """(log-probs, entropy) of a packed micro-batch's positions."""
    ids, pos, targets = mb["input_ids"][0], mb["position_ids"][0], mb["targets"]
    segments = mb["segments"] if "segments" in mb else modeling.segments_from_positions(pos)
    temperature, chunk = cfg.temperature or 1.0, cfg.logprob_chunk_tokens
    with torch.set_grad_enabled(grad):
        if ranks.cp_size == 1:
            return model.policy_logprobs(ids[None].to(device), pos[None].to(device),
                                         targets.to(device), temperature, chunk, segments=segments)
        # Ulysses: this rank's contiguous 1/N of the row goes through the model; the log-probs of
        # the whole row are gathered on every CP rank
        inputs, layout = modeling.ulysses_chunk(ids, pos, targets, segments, ranks.cp_group,
                                                device, getattr(model, "attention_kernel", None))
        logprobs, entropy = model.policy_logprobs(*inputs, temperature, chunk, layout=layout)
        return modeling.gather_row(logprobs, entropy, ranks.cp_group, len(ids))


# -----------------------------------------------------------------------------
# log: held-out eval, bad steps, checkpoints


def evaluate(engine, evalset: list[tuple[dict, list[int]]], cfg: Config, tokenizer, reward_fn,
             ranks: Ranks) -> float:
    """Greedy held-out accuracy over (row, prompt ids) pairs split across ranks, one collective."""
    mine = [row for row, _ in evalset[ranks.rank :: ranks.world]]
    prompts = [ids for _, ids in evalset[ranks.rank :: ranks.world]]
    sampling = SamplingParams(cfg.max_new_tokens, 0.0, stop_token_ids=[tokenizer.eos_token_id])
    outs = engine.generate(prompts, sampling, [0] * len(prompts)) if prompts else []
    texts = tokenizer.batch_decode([o.output_ids for o in outs], skip_special_tokens=True)
    scores, _, _ = tasks.compute_rewards(reward_fn, texts, mine, cfg.reward_timeout)
    s = reduce_sums({"correct": sum(bool(sc.correct) for sc in scores),
                     "judged": sum(sc.correct is not None for sc in scores)})
    return s["correct"] / max(s["judged"], 1)


def check_bad_steps(bad_steps: int, metrics: dict, cfg: Config) -> int:
    """Count steps in a row whose optimizer step was skipped (non-finite loss or grad norm); stop
    after --max-bad-steps of them, leaving the checkpoints (written only after healthy steps)."""
    bad_steps = bad_steps + 1 if metrics["skipped_steps"] else 0
    if 0 < cfg.max_bad_steps <= bad_steps:
        last = checkpoint.complete_checkpoints(cfg.run_dir)
        raise cli.Stopped(f"error: {bad_steps} steps in a row had a non-finite loss or grad norm "
                           f"(--max-bad-steps {cfg.max_bad_steps}); last good checkpoint: "
                           f"{last[-1] if last else 'none'}", code=1)
    return bad_steps


def save(step: int, cfg: Config, model, optimizer, scheduler, last_eval: float | None,
         logger: Logger) -> float:
    """A checkpoint of the state after `step` (collective); returns when it was done."""
    t0 = time.perf_counter()
    meta = {"world": dist.get_world_size(), "last_eval": last_eval,
            "scheduler": scheduler.state_dict(), "config": asdict(cfg)}
    path = checkpoint.save_checkpoint(cfg.run_dir, step, model, optimizer, meta, cfg.keep_ckpts)
    logger.line(f"saved {path} in {time.perf_counter() - t0:.2f}s")
    return time.monotonic()


def resume(cfg: Config, model, optimizer, scheduler, engine, ranks: Ranks,
           resuming: bool) -> tuple[int, float | None]:
    """Restore a checkpoint into model, optimizer, scheduler, RNGs and the rollout engine, and cut
    metrics.jsonl back to its step: --resume's path, or (resuming this run) its newest readable
    checkpoint; a broken one is set aside on the way. Returns (step, last eval accuracy); (0,
    None) for a fresh start."""
    path = on_rank0(checkpoint.choose_resume, cfg.run_dir, cfg.resume, resuming)
    meta = {"step": 0, "last_eval": None}  # a fresh start (of this run: its old lines go)
    if path is not None:
        try:  # passed the cheap checks (sizes, meta.json), yet unreadable: say which one
            meta = checkpoint.load_checkpoint(Path(path), model, optimizer)
        except Exception as e:
            raise UserError(f"checkpoint {path} cannot be loaded ({cli.why(e)}); move it aside "
                            "to resume from the one before it") from None
        scheduler.load_state_dict(meta["scheduler"])
        engine.update_weights(model, meta["step"])  # the engine started from --model's
        done = " (nothing left to train: --steps is not beyond it)" if meta["step"] >= cfg.steps \
            else ""
        print0(f"resumed from step {meta['step']} ({path}){done}")
    if ranks.rank == 0:  # the run starts: its directory holds its config from now on
        checkpoint.write_config(cfg.run_dir, asdict(cfg))
        checkpoint.truncate_metrics(Path(cfg.run_dir) / "metrics.jsonl",
                                    meta["step"] if path else -1)
    return meta["step"], meta["last_eval"]


def run(argv: list[str] | None = None) -> int:
    """main() with its exit status: 2 after a user error (one line on stderr), 128 + the signal's
    number after SIGINT/SIGTERM (once the checkpoint is saved), 1 after --max-bad-steps."""
    return cli.run(main, argv)


if __name__ == "__main__":
    cli.exit_now(run())
