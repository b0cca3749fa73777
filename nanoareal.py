"""
nanoareal: a minimal, hackable GRPO trainer. This one file is the whole reinforcement-learning loop:
generate -> reward -> advantages -> loss -> optimizer step -> weight sync -> log -> checkpoint.

Run it:
    python nanoareal.py                                          # built-in tiny arithmetic task on a CPU
    torchrun --nproc_per_node 2 nanoareal.py --loss-aggregation prompt_mean
    python nanoareal.py --config configs/qwen2.5-0.5b-gsm8k.toml  # one GPU, SGLang colocated
    torchrun --nproc_per_node 4 nanoareal.py --cp-size 2         # 2 data-parallel x 2 context-parallel
    python nanoareal.py --ckpt-every 10                          # rerun the same command to resume
    python nanoareal.py --help                                   # every flag, documented

What it leaves out on purpose: a critic (GRPO needs none), multi-turn tools, pipeline/tensor parallel in the
trainer (FSDP2 + optional context parallel cover one node up to a few billion parameters), and any class
hierarchy. Every number that reaches the gradient is computed in `loss.py`, whose LossReduction makes the
gradient independent of micro-batching and world size (the contract is written out at the top of loss.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

import loss as L
from rollout import Completion, SamplingParams, mix_seed

# -----------------------------------------------------------------------------
# config: one flat dataclass; `--help` is the documentation and each field is a `--flag-name`


@dataclass
class Config:
    # run
    model: str = "assets/tiny-arith"
    """HF causal-LM directory (weights + tokenizer). The default is the shipped 1M-parameter arithmetic model."""
    run_dir: str = "runs/default"
    """Where metrics.jsonl, checkpoints and the final export go."""
    seed: int = 0
    steps: int = 100
    """Optimizer steps (one rollout batch each)."""
    config: str | None = None
    """TOML file of defaults for these flags (flags on the command line win)."""

    # data
    dataset: str = "arithmetic"
    """'arithmetic' (built-in, generated) or a JSONL file of {"prompt"|"messages", "answer"}."""
    eval_dataset: str | None = None
    """JSONL for held-out eval; the built-in task has its own held-out split."""
    chat_template: bool = False
    """Wrap prompts with the tokenizer's chat template ("messages" rows always use it)."""
    reward: Literal["exact_match", "gsm8k"] = "exact_match"
    """exact_match: the stripped completion equals the answer; gsm8k: the last number (or '#### x') equals it."""
    prompts_per_step: int = 64
    """Prompts per rollout batch (all ranks together); each gets `group_size` samples."""
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    # advantages
    adv_estimator: Literal["grpo", "rloo"] = "grpo"
    """grpo: baseline = group mean; rloo: baseline = mean of the *other* responses of the group."""
    adv_std: bool = True
    """Divide by the group's reward std (--no-adv-std gives Dr. GRPO)."""
    adv_eps: float = 1e-6
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (they carry no gradient under GRPO, only normalizer mass)."""
    mask_truncated: bool = False
    """Exclude responses cut by max_new_tokens from the loss (and from its denominators)."""

    # loss (see loss.py)
    loss_aggregation: Literal["token_mean", "seq_mean", "prompt_mean", "constant"] = "token_mean"
    loss_aggregation_divisor: float | None = None
    """C of the 'constant' mode; defaults to max_new_tokens."""
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    """Upper clip; > eps_low is DAPO's clip-higher."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1 (caps the loss of A < 0 tokens at -c A)."""
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    behaviour_cap: float | None = None
    """Decoupled PPO: weight tokens by pi_prox/pi_behave, capped at this value."""
    behaviour_cap_mode: Literal["truncate", "mask"] = "truncate"
    m2po_threshold: float | None = None
    """M2PO: mask tokens until the mean squared log(pi_prox/pi_behave) is below this."""
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    """KL penalty to the initial policy (loads a frozen reference copy)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"

    # optimization
    lr: float = 1e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    warmup_steps: int = 2
    lr_schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = 1.0
    num_minibatches: int = 1
    """Optimizer steps per rollout batch. >1 needs recomputed proximal log-probs (one extra forward)."""
    reuse_train_logprobs: bool = True
    """With one mini-batch, pi_prox = the training forward's detached log-probs (saves a forward pass)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch (sequences are never cut). Attention is per segment (flash-attn
    varlen on GPU, padded sdpa otherwise), so cost is linear in the budget: bigger means fewer passes, more memory."""
    share_prompts: bool = True
    """Feed each prompt once per micro-batch: a group's samples attend to one copy of it (exact).
    On the default task this halves the positions computed. --no-share-prompts feeds every sequence whole."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk when turning hidden states into log-probs (never materialises all fp32 logits)."""

    # rollout
    rollout_backend: Literal["hf", "sglang"] = "hf"
    rollout_url: list[str] = field(default_factory=list)
    """SGLang server URLs; empty with --rollout-backend sglang means an in-process engine on this GPU."""
    sglang_mem_fraction: float = 0.5
    """In-process SGLang: mem_fraction_static, the GPU share for its weights + KV cache (sized at start)."""
    rollout_timeout: float = 600.0
    """Seconds one HTTP request to a rollout server may take before it is retried."""
    rollout_retries: int = 3
    """Retries (exponential backoff) on timeouts, connection errors and 5xx before failing with the URL."""
    rollout_abort_retries: int = 3
    """Resubmissions of prompt + tokens so far when a server aborts a request; then the sample is dropped."""
    rollout_health_timeout: float = 600.0
    """Seconds to wait at start for every server's /health_generate."""
    weight_sync: Literal["auto", "tensor", "disk", "nccl"] = "auto"
    """auto: tensor (CUDA IPC) in-process, disk for --rollout-url; nccl: broadcast to servers on other GPUs."""
    weight_sync_bucket_mb: int = 512
    """Bucket size of the tensor/nccl weight push (MiB)."""
    weight_sync_addr: str = ""
    """nccl: host:port trainer rank 0 listens on for the weight group (empty: this host, a free port)."""

    # eval and logging
    eval_every: int = 10
    eval_size: int = 256
    log_every: int = 1
    wandb_project: str | None = None
    wandb_run_name: str | None = None

    # checkpointing and failures
    ckpt_every: int = 0
    """Save a checkpoint (DCP model + optimizer, scheduler, step, RNGs) every N steps and at the end; 0: never."""
    keep_ckpts: int = 2
    """Keep the newest N complete checkpoints in run_dir/checkpoints (0 keeps all)."""
    resume: str = "auto"
    """auto: the latest complete checkpoint in run_dir/checkpoints, if any; none: start fresh; or a checkpoint path."""
    max_bad_steps: int = 3
    """Stop with an error after this many steps in a row whose loss or grad norm was non-finite (each is skipped)."""
    reward_timeout: float = 5.0
    """Seconds one reward call may take; a reward that raises or times out gives 0 and counts in reward_errors."""
    dist_timeout: float = 1800.0
    """Seconds a collective waits for the other ranks before this rank gives up (a dead peer never hangs a run)."""

    # system
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float64"] = "auto"
    """auto: bf16 mixed precision on GPU, fp32 on CPU. float64 is for exactness tests."""
    threads: int = 1
    """torch CPU threads per rank (1 is the stable choice on small machines)."""
    cp_size: int = 1
    """Context parallel (Ulysses): ranks that split every packed micro-batch's tokens; must divide the world."""


def parse_config(argv: list[str] | None = None) -> Config:
    import tyro

    argv = sys.argv[1:] if argv is None else argv
    defaults = Config()
    if "--config" in argv:  # a TOML file supplies defaults, the command line overrides them
        path = argv[argv.index("--config") + 1]
        import tomllib

        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise SystemExit(f"--config {path}: {e}") from e
        known = {f for f in Config.__dataclass_fields__}
        unknown = sorted(k for k in values if k.replace("-", "_") not in known)
        if unknown:
            raise SystemExit(f"--config {path}: unknown keys {unknown}")
        defaults = Config(**{k.replace("-", "_"): v for k, v in values.items()})
    return tyro.cli(Config, args=argv, default=defaults)


def validate_config(cfg: Config, world: int) -> Config:
    """Fail fast, in one line naming the flags, on options that contradict each other."""
    def bad(msg: str):
        raise SystemExit(f"config error: {msg}")

    if cfg.loss_aggregation == "constant":
        if cfg.loss_aggregation_divisor is None:
            cfg.loss_aggregation_divisor = float(cfg.max_new_tokens)
        if not cfg.loss_aggregation_divisor > 0 or not math.isfinite(cfg.loss_aggregation_divisor):
            bad("--loss-aggregation constant needs a positive --loss-aggregation-divisor")
    elif cfg.loss_aggregation_divisor is not None:
        bad(f"--loss-aggregation-divisor is only used by --loss-aggregation constant (not {cfg.loss_aggregation})")
    if cfg.group_size < 1 or cfg.prompts_per_step < 1 or cfg.max_new_tokens < 1:
        bad("--group-size, --prompts-per-step and --max-new-tokens must be positive")
    if cfg.group_size == 1 and cfg.adv_std:
        bad("--group-size 1 with --adv-std: a one-sample group has no std (every advantage would be 0); "
            "use --group-size >= 2")
    if cfg.num_minibatches < 1 or cfg.num_minibatches > cfg.prompts_per_step:
        bad("--num-minibatches must be in [1, --prompts-per-step]")
    if cfg.m2po_threshold is not None and cfg.reuse_train_logprobs:
        # M2PO needs pi_prox of the whole mini-batch before the first micro-batch runs.
        cfg.reuse_train_logprobs = False
    if cfg.num_minibatches > 1 and cfg.reuse_train_logprobs:
        print0("warning: --reuse-train-logprobs is only valid with one mini-batch; recomputing pi_prox instead")
        cfg.reuse_train_logprobs = False
    if cfg.temperature < 0:
        bad("--temperature must be >= 0")
    if cfg.rollout_backend == "hf" and cfg.rollout_url:
        bad("--rollout-url needs --rollout-backend sglang")
    if cfg.cp_size < 1 or world % cfg.cp_size:
        bad(f"--cp-size {cfg.cp_size} must divide the number of ranks ({world})")
    if cfg.micro_batch_tokens < 1 or cfg.logprob_chunk_tokens < 1:
        bad("--micro-batch-tokens and --logprob-chunk-tokens must be positive")
    if cfg.dual_clip is not None and cfg.dual_clip <= 1:
        bad(f"--dual-clip must be > 1 (got {cfg.dual_clip})")
    if min(cfg.ckpt_every, cfg.keep_ckpts, cfg.max_bad_steps) < 0 or not cfg.reward_timeout > 0:
        bad("--ckpt-every, --keep-ckpts and --max-bad-steps must be >= 0 and --reward-timeout > 0")
    if cfg.resume not in ("auto", "none") and not (Path(cfg.resume) / "meta.json").is_file():
        bad(f"--resume {cfg.resume} is not a complete checkpoint (no such directory, or no meta.json: a save that "
            f"never finished); use --resume auto or none")
    return cfg


def validate_token_budget(encoded: list[list[int]], cfg: Config) -> None:
    """After tokenizing the dataset: the longest possible sequence must fit one micro-batch (sequences are never
    cut), so it fails now rather than at the step that first samples a long answer."""
    longest = max(map(len, encoded), default=0) + cfg.max_new_tokens
    if longest > cfg.micro_batch_tokens:
        raise SystemExit(f"config error: --micro-batch-tokens {cfg.micro_batch_tokens} is smaller than the longest "
                         f"possible sequence ({longest - cfg.max_new_tokens} prompt tokens + --max-new-tokens "
                         f"{cfg.max_new_tokens})")


# -----------------------------------------------------------------------------
# distributed setup from torchrun's environment (plain `python` = a world of one)

RANK, WORLD = 0, 1


def print0(*args, **kwargs):
    if RANK == 0:
        print(*args, **kwargs, flush=True)


def setup_distributed(cfg: Config) -> torch.device:
    global RANK, WORLD
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:  # a collective waits at most dist_timeout for a peer (torchrun usually ends it sooner)
        from datetime import timedelta

        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    else:  # a one-rank group keeps one code path (FSDP2 and collectives work the same)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def all_reduce_sum(values: dict[str, float]) -> dict[str, float]:
    """One collective for a whole dict of per-rank sums."""
    keys = sorted(values)
    t = L.all_reduce_vector(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, t.tolist()))

# -----------------------------------------------------------------------------
# data: the built-in arithmetic task (generated, never downloaded) or JSONL prompts


def make_arithmetic_task(seed: int = 0, max_operand: int = 50, heldout_size: int = 256):
    """All sums a+b with 0 <= a, b < max_operand, split deterministically into (train, heldout).

    Each item is {"prompt": "12+34=", "answer": "46"}. The split depends only on `seed`, so the
    SFT warm-start, every GRPO run and every test see the same held-out set.
    """
    pairs = [(a, b) for a in range(max_operand) for b in range(max_operand)]
    random.Random(seed).shuffle(pairs)
    items = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return items[heldout_size:], items[:heldout_size]


def load_jsonl(path: str) -> list[dict]:
    """Rows of {"prompt": str} or {"messages": [{"role", "content"}, ...]}, each with "answer"."""
    items = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"{path}: cannot read ({e.strerror})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SystemExit(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise SystemExit(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        has_prompt, has_messages = isinstance(row.get("prompt"), str), isinstance(row.get("messages"), list)
        if has_prompt == has_messages:
            raise SystemExit(f'{path}:{n}: needs exactly one of "prompt" (string) or "messages" (list)')
        if has_messages and not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in row["messages"]):
            raise SystemExit(f'{path}:{n}: every message needs "role" and "content"')
        if "answer" not in row or not isinstance(row["answer"], (str, int, float)):
            raise SystemExit(f'{path}:{n}: missing "answer" (string or number)')
        items.append({k: row[k] for k in ("prompt", "messages") if k in row} | {"answer": str(row["answer"])})
    if not items:
        raise SystemExit(f"{path}: no rows")
    return items


def encode_prompt(item: dict, tokenizer, chat_template: bool) -> list[int]:
    if "messages" in item or chat_template:
        messages = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = item["prompt"]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts_for_step(num_items: int, per_step: int, step: int, seed: int) -> list[int]:
    """Global prompt indices of a step: consecutive slices of per-epoch seeded permutations.

    Depends only on (seed, step), so resuming needs no data-loader state and every world size sees the same
    prompts in the same order.
    """
    out, pos = [], step * per_step
    while len(out) < per_step:
        epoch, offset = divmod(pos, num_items)
        perm = list(range(num_items))
        random.Random(mix_seed(seed, 0xDA7A, epoch)).shuffle(perm)
        take = perm[offset : offset + per_step - len(out)]
        out += take
        pos += len(take)
    return out


# -----------------------------------------------------------------------------
# rewards


def _last_number(text: str) -> str | None:
    m = re.search(r"####\s*(-?[\d,]*\.?\d+)", text)
    nums = [m.group(1)] if m else re.findall(r"-?[\d,]*\.?\d+", text)
    return nums[-1].replace(",", "").rstrip(".") if nums else None


def reward_exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def reward_gsm8k(completion: str, answer: str) -> float:
    """GSM8K style: the final number of the completion ('#### x' wins over the last number) equals the answer's."""
    got, want = _last_number(completion), _last_number(answer)
    if got is None or want is None:
        return 0.0
    try:
        return float(abs(float(got) - float(want)) < 1e-6)
    except ValueError:
        return 0.0


REWARDS = {"exact_match": reward_exact_match, "gsm8k": reward_gsm8k}


def compute_rewards(reward_fn, texts: list[str], answers: list[str], timeout: float) -> tuple[list[float], int]:
    """reward_fn over the batch on a daemon worker thread -> (rewards, errors). A call that raises, returns a
    non-finite value or takes longer than `timeout` seconds gives 0 and counts as an error; after a timeout the
    rest of the batch continues on a fresh thread. A thread cannot be killed: a hung pure-Python reward keeps its
    daemon thread busy (it never blocks exit), and one stuck in C code holding the GIL stalls us too. That is fine
    for the built-in rewards (short strings, simple regexes); a reward that runs untrusted code wants a process."""
    import queue
    import threading

    def work(start: int, out: queue.Queue):
        for i in range(start, len(texts)):
            try:
                r = float(reward_fn(texts[i], answers[i]))
                out.put((i, r if math.isfinite(r) else None))
            except Exception:
                out.put((i, None))

    rewards, errors, i = [0.0] * len(texts), 0, 0
    while i < len(texts):
        results: queue.Queue = queue.Queue()
        threading.Thread(target=work, args=(i, results), daemon=True).start()
        while i < len(texts):
            try:
                j, r = results.get(timeout=timeout)
            except queue.Empty:  # call i hangs: it scores 0, the next calls run on a new thread
                errors, i = errors + 1, i + 1
                break
            rewards[j], errors, i = r or 0.0, errors + (r is None), j + 1
    return rewards, errors

# -----------------------------------------------------------------------------
# advantages: per group, with groups sliced by their actual sizes


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str = "grpo",
                     use_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps); RLOO: A_i = R_i - mean_{j in g, j != i} R_j (then / std
    when use_std). Groups are whatever `group_ids` says (any sizes, any order); a group of one gets A = 0.
    std is the unbiased sample std, as in TRL and verl.
    """
    rewards = rewards.double()
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max()) + 1 if len(inv) else 0
    n = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, inv, torch.ones_like(rewards))
    total = torch.zeros_like(n).index_add_(0, inv, rewards)
    mean = total / n
    sq = torch.zeros_like(n).index_add_(0, inv, (rewards - mean[inv]) ** 2)
    std = (sq / (n - 1).clamp(min=1)).sqrt()
    if estimator == "rloo":
        baseline = (total[inv] - rewards) / (n[inv] - 1).clamp(min=1)
    else:
        baseline = mean[inv]
    adv = rewards - baseline
    if use_std:
        adv = adv / (std[inv] + eps)
    return torch.where(n[inv] > 1, adv, torch.zeros_like(adv)).float()


# -----------------------------------------------------------------------------
# packing: whole sequences concatenated into 1-D micro-batches (no padding), weights fixed before splitting


@dataclass
class Sample:
    group: int
    """Global prompt index within the step: the group id."""
    prompt_ids: list[int]
    completion: Completion
    reward: float = 0.0
    advantage: float = 0.0
    zero_variance: bool = False
    """All rewards of its group are equal (no GRPO signal)."""


def pack_microbatches(samples: list[Sample], cfg: Config, pad_id: int) -> list[dict]:
    """Pack samples into micro-batches of at most `micro_batch_tokens` fed positions.

    Per-token tensors are aligned with the *predicted* token: position j of a sequence predicts token j+1. The
    last token of a sequence is never fed in: it predicts nothing and, being last, nothing attends to it. Mode
    weights come from the whole mini-batch's metadata (response lengths, groups) before any split: that is what
    makes any split exact (SPEC rule 2).

    With `share_prompts`, a micro-batch feeds each distinct prompt prefix (prompt minus its last token) once; each
    sample then feeds only its tail (last prompt token + completion minus its last token) at positions p-1.. and
    attends to the shared prefix. Exact, not an approximation: under causal attention the prefix's hidden states
    depend on the prefix alone, and backward sums every sample's gradient into the one copy. A GRPO group of G
    samples feeds its prompt once instead of G times (on the default task 3.9k -> 2.0k positions per step).

    `segments` [R, 4] says who attends to what: rows (q_start, q_len, ctx_start, ctx_len) in token order; the
    q_len tokens from q_start attend causally to tokens [ctx_start, ctx_start + ctx_len) and then to themselves.
    """
    lengths = [len(s.completion.output_ids) for s in samples]
    dropped = [cfg.mask_truncated and s.completion.finish_reason == "length" for s in samples]
    denom = torch.tensor([0.0 if d else float(n) for n, d in zip(lengths, dropped)], dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    w, nw = L.response_weights(cfg.loss_aggregation, denom, groups, cfg.loss_aggregation_divisor)
    share = cfg.share_prompts
    keys = [tuple(s.prompt_ids[:-1]) for s in samples]  # what a sample can share: the prompt minus its last token

    microbatches, current, used, prefixes = [], [], 0, set()
    for i, (s, key) in enumerate(zip(samples, keys)):
        n = len(s.prompt_ids) + lengths[i] - 1
        if n > cfg.micro_batch_tokens:
            raise SystemExit(f"config error: a sequence of {n} tokens exceeds --micro-batch-tokens "
                             f"{cfg.micro_batch_tokens}")
        cost = lengths[i] if share and key in prefixes else n
        if used + cost > cfg.micro_batch_tokens:
            microbatches.append(current)
            current, used, prefixes, cost = [], 0, set(), n
        current.append(i)
        used += cost
        prefixes.add(key)
    if current:
        microbatches.append(current)

    out = []
    for idx in microbatches:
        ids, pos, tgt, mask, adv, blp, lw, nwt, seq, segments = [], [], [], [], [], [], [], [], [], []
        prefix_at: dict[tuple, tuple[int, int]] = {}
        for k, i in enumerate(idx):
            s, p, r = samples[i], len(samples[i].prompt_ids), lengths[i]
            full = s.prompt_ids + s.completion.output_ids
            active, key = (0.0 if dropped[i] else 1.0), keys[i]
            if not share:  # the whole sequence, alone
                head, ctx = 0, (0, 0)
            elif key in prefix_at:
                head, ctx = p - 1, prefix_at[key]
            else:  # first sample of this prompt here: its prefix goes in as a segment of its own, predicting nothing
                head, ctx = p - 1, (len(ids), p - 1)
                prefix_at[key] = ctx
                if p > 1:
                    segments.append((len(ids), p - 1, 0, 0))
                    ids += full[: p - 1]
                    pos += range(p - 1)
                    tgt += full[1:p]
                    for col in (mask, adv, blp, lw, nwt):
                        col += [0.0] * (p - 1)
                    seq += [-1] * (p - 1)
            n = p + r - 1 - head  # positions head .. p+r-2 of this sample
            if n == 0:
                continue
            segments.append((len(ids), n, *ctx))
            ids += full[head:-1]
            pos += range(head, p + r - 1)
            tgt += full[head + 1 :]
            mask += [0.0] * (p - 1 - head) + [active] * r
            adv += [s.advantage] * n
            blp += [0.0] * (p - 1 - head) + s.completion.logprobs
            lw += [float(w[i])] * n
            nwt += [float(nw[i])] * n
            seq += [-1] * (p - 1 - head) + [k] * r
        out.append(_microbatch(ids, pos, tgt, mask, adv, blp, lw, nwt, seq, segments))
    return out


def _microbatch(ids, pos, tgt, mask, adv, blp, lw, nwt, seq, segments) -> dict:
    f = lambda x: torch.tensor(x, dtype=torch.float32)
    m = f(mask)
    return {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "targets": torch.tensor(tgt),
            "loss_mask": m, "denom_mask": m.clone(), "advantages": f(adv), "behave_logprobs": f(blp),
            "loss_weight": f(lw), "norm_weight": f(nwt), "seq_ids": torch.tensor(seq),
            "segments": torch.tensor(segments, dtype=torch.long).view(-1, 4)}


def empty_microbatch(pad_id: int) -> dict:
    """One masked token: a rank with nothing to train on still runs forward/backward so FSDP's collectives match."""
    return _microbatch([pad_id], [0], [pad_id], [0.0], [0.0], [0.0], [0.0], [0.0], [-1], [(0, 1, 0, 0)])


# -----------------------------------------------------------------------------
# context parallel (Ulysses): each CP rank runs the model on a contiguous 1/N of every packed micro-batch.
# Only attention needs the whole row: it all-to-alls from "my tokens, all heads" to "all tokens, my heads",
# attends, and all-to-alls back. Ranks form a (dp, cp) mesh; a CP group shares its samples, FSDP2 still
# shards over all ranks, and every CP rank computes the loss of the gathered full micro-batch, so the loss
# normalizer carries the factor N (LossReduction's cp_factor, SPEC rule 5) and CP=N equals CP=1.

CP_GROUP, CP_SIZE, CP_RANK, DP_RANK, DP_SIZE = None, 1, 0, 0, 1
_FLASH_VARLEN = None  # flash_attn_varlen_func when flash-attn is installed and we train on CUDA (load_model)
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the kernel's dtypes; fp32 activations take the sdpa path


def setup_context_parallel(cfg: Config, device: torch.device) -> None:
    """(dp, cp) mesh over the world: ranks [k*N, (k+1)*N) form CP group k (data-parallel rank k)."""
    global CP_GROUP, CP_SIZE, CP_RANK, DP_RANK, DP_SIZE
    if cfg.cp_size > 1:
        from transformers import AutoConfig

        heads = AutoConfig.from_pretrained(cfg.model).get_text_config().num_attention_heads
        if heads % cfg.cp_size:  # each rank attends with H/N whole query heads
            raise SystemExit(f"config error: --cp-size {cfg.cp_size} must divide the model's {heads} attention heads")
    CP_SIZE, DP_SIZE = cfg.cp_size, WORLD // cfg.cp_size
    DP_RANK, CP_RANK = divmod(RANK, CP_SIZE)
    CP_GROUP = None
    if CP_SIZE == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AttentionInterface

    CP_GROUP = init_device_mesh(device.type, (DP_SIZE, CP_SIZE), mesh_dim_names=("dp", "cp"))["cp"].get_group()
    AttentionInterface.register("ulysses", ulysses_attention)


def cp_broadcast(obj):
    """The CP group's first rank's object on every rank of the group (one rollout per CP group)."""
    if CP_SIZE == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=RANK - CP_RANK, group=CP_GROUP)
    return box[0]


class _AllToAll(torch.autograd.Function):
    """Block i of dim 0 goes to CP rank i. Exchanging blocks twice is the identity, so backward is the same op."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()  # before empty_like: it copies a permuted view's strides, which the collective ignores
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=CP_GROUP)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.forward(ctx, grad)


class _GatherSeq(torch.autograd.Function):
    """[..., T/N] per CP rank -> [..., T] on every CP rank. Every rank's loss reads all T values, so the gradient
    of this rank's slice is the *sum* over the group of the incoming gradients, sliced."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(CP_SIZE)]
        dist.all_gather(parts, x, group=CP_GROUP)
        return torch.cat(parts, -1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=CP_GROUP)
        return grad.chunk(CP_SIZE, -1)[CP_RANK]


def _seq_to_heads(x):  # [B, H, S/N, D] -> [B, H/N, S, D]
    x = _AllToAll.apply(x.unflatten(1, (CP_SIZE, -1)).movedim(1, 0))  # [N: head block, ...] -> [N: seq chunk, ...]
    return x.movedim(0, 2).flatten(2, 3)


def _heads_to_seq(x):  # [B, H/N, S, D] -> [B, H, S/N, D]
    x = _AllToAll.apply(x.unflatten(2, (CP_SIZE, -1)).movedim(2, 0))  # [N: seq chunk, ...] -> [N: head block, ...]
    return x.movedim(0, 1).flatten(1, 2)


def ulysses_attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, ulysses=None, **kwargs):
    """transformers attention (registered as "ulysses"): q [B, H, S/N, D], k/v [B, Hkv, S/N, D] -> ([B, S/N, H, D],
    None). `ulysses` is attention_layout() of the full row; transformers' own attention_mask is None here."""
    if ulysses is None:
        raise RuntimeError("ulysses attention needs the layout of the whole row: use cp_policy_logprobs")
    hkv = k.shape[1]
    if hkv % CP_SIZE:  # too few KV heads to split: repeat each so every rank gets the KV heads its queries use
        rep = CP_SIZE // math.gcd(hkv, CP_SIZE)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    q, k, v = _seq_to_heads(q), _seq_to_heads(k), _seq_to_heads(v)
    out = segment_attention(q[0], k[0], v[0], ulysses, scaling, dropout)  # [S, H/N, D]
    return _heads_to_seq(out.transpose(0, 1)[None]).transpose(1, 2), None


def cp_policy_logprobs(model, mb: dict, cfg: Config, device: torch.device) -> tuple:
    """policy_logprobs under CP: this rank's chunk through the model, then log-probs and entropy of the whole
    micro-batch gathered on every CP rank. The row is padded to a multiple of N with a segment of its own,
    which no real token attends to; its outputs are cut off."""
    ids, pos, tgt = mb["input_ids"][0], mb["position_ids"][0], mb["targets"]
    T, pad = len(ids), -len(ids) % CP_SIZE
    ids, tgt = torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(tgt, (0, pad))
    pos = torch.cat([pos, torch.arange(pad)])
    segments = mb["segments"] if "segments" in mb else segments_from_positions(mb["position_ids"])
    if pad:
        segments = torch.cat([segments, segments.new_tensor([[T, pad, 0, 0]])])
    mine = slice(CP_RANK * (T + pad) // CP_SIZE, (CP_RANK + 1) * (T + pad) // CP_SIZE)
    logprobs, entropy = model.policy_logprobs(ids[mine][None].to(device), pos[mine][None].to(device),
                                              tgt[mine].to(device), cfg.temperature or 1.0, cfg.logprob_chunk_tokens,
                                              ulysses=attention_layout(segments, T + pad, device))
    full = _GatherSeq.apply(torch.stack([logprobs, entropy]))[:, :T]
    return full[0], full[1]


# -----------------------------------------------------------------------------
# model: per-token log-probs of a packed micro-batch, in vocabulary chunks


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = hidden @ weight.T
    half = logits.dtype in (torch.float16, torch.bfloat16)
    logits = (logits.float() if half else logits) / temperature  # softmax in fp32 at least
    logz = torch.logsumexp(logits, -1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
    entropy = logz - (torch.softmax(logits, -1) * logits).sum(-1)
    return logprobs, entropy


def policy_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0, chunk: int = 1024,
                    segments: torch.Tensor | None = None, **attn_kwargs):
    """log pi(target_t | prefix) and the entropy at every position of a packed row -> ([T], [T]).

    Called as `model.policy_logprobs(...)` (registered with FSDP2 so the root's parameters are gathered).
    `segments` is the row's attention layout (pack_microbatches); without it, every run of position_ids
    from 0 is a sequence of its own. Logits exist only `chunk` tokens at a time and are recomputed in backward
    (activation checkpointing), so a 150k vocabulary never holds fp32 logits for a whole micro-batch. `attn_kwargs`
    reach the attention function of every layer (context parallel passes its full-row layout this way).
    """
    if model.config._attn_implementation == "packed" and "layout" not in attn_kwargs:
        if segments is None:
            segments = segments_from_positions(position_ids.cpu())
        attn_kwargs["layout"] = attention_layout(segments, input_ids.shape[-1], input_ids.device)  # once per mb
    hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         **attn_kwargs).last_hidden_state[0]
    weight = model.lm_head.weight
    out = [torch.utils.checkpoint.checkpoint(_chunk_logprobs, hidden[i : i + chunk], weight,
                                             targets[i : i + chunk], temperature, use_reentrant=False)
           for i in range(0, hidden.shape[0], chunk)]
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def segments_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """Segments of a row of whole sequences (position_ids restart at 0 at each): [R, 4] rows (start, len, 0, 0)."""
    pos = position_ids.flatten()
    start = torch.nonzero(pos == 0).flatten()
    length = torch.diff(start, append=start.new_tensor([len(pos)]))
    zero = torch.zeros_like(start)
    return torch.stack([start, length, zero, zero], 1)


def attention_layout(segments: torch.Tensor, num_tokens: int, device: torch.device | None = None) -> dict:
    """Index tensors for segment_attention, built once per micro-batch and used by every layer.

    Segment r = (q_start, q_len, ctx_start, ctx_len): its q_len tokens attend causally to the ctx_len context
    tokens, then to themselves. An attention row of segment r is its context followed by its own tokens. Two
    encodings of the same rows: `grid` (row-major [R, max_len] slots -> token, for a padded sdpa batch) + `out`
    (token -> the slot holding its own output), and `k_index`/`cu_q`/`cu_k` for flash-attn's varlen kernel, whose
    causal mask is aligned bottom-right (queries are the last q_len keys of their row). Built on the CPU (a few
    hundred integers; no GPU sync for the sizes) and moved to `device` (default: where `segments` is)."""
    device = device or segments.device
    segments = segments.cpu()
    q_start, q_len, ctx_start, ctx_len = segments.unbind(1)
    if int(q_len.sum()) != num_tokens or (q_start != torch.cumsum(q_len, 0) - q_len).any():
        raise ValueError(f"segments must cover the {num_tokens} tokens of the row in order, got {segments.tolist()}")
    if ((ctx_start < 0) | ((ctx_len > 0) & (ctx_start + ctx_len > q_start)) | (ctx_len < 0)).any():
        raise ValueError(f"a segment's context must be earlier tokens of the row, got {segments.tolist()}")
    row_len = ctx_len + q_len
    max_len = int(row_len.max())
    j = torch.arange(max_len)[None]
    src = torch.where(j < ctx_len[:, None], ctx_start[:, None] + j, q_start[:, None] + j - ctx_len[:, None])
    valid = j < row_len[:, None]
    seg = torch.repeat_interleave(torch.arange(len(segments)), q_len)
    zero = segments.new_zeros(1)
    # padding slots (after each row's real slots, so the causal mask hides them) read token 0: any real token
    # works, its outputs are dropped and no real query sees it, so it gets no gradient either
    index = {"grid": torch.where(valid, src, 0).flatten(),
             "out": seg * max_len + ctx_len[seg] + torch.arange(num_tokens) - q_start[seg], "k_index": src[valid],
             "cu_q": torch.cat([zero, torch.cumsum(q_len, 0)]).int(),
             "cu_k": torch.cat([zero, torch.cumsum(row_len, 0)]).int()}
    return {k: v.to(device, non_blocking=True) for k, v in index.items()} | {
        "rows": len(segments), "max_len": max_len, "max_q": int(q_len.max())}


def segment_attention(q, k, v, layout: dict, scaling=None, dropout: float = 0.0):
    """Attention of a packed row by segments: q [H, T, D], k/v [Hkv, T, D] -> [T, H, D].

    flash-attn varlen (GPU, half precision): queries stay packed, each segment's keys are gathered (its context
    then itself) and the bottom-right causal mask does the rest. Otherwise sdpa over a padded [R, H, max_len, D]
    batch of the rows with a plain causal mask: cost ~ R * max_len^2 instead of T^2 for a mask over the whole row.
    Context tokens shared by several rows are gathered into each; index_select's backward sums their gradients."""
    if _FLASH_VARLEN is not None and q.dtype in _FLASH_DTYPES:
        keys = layout["k_index"]
        kt, vt = k.transpose(0, 1).index_select(0, keys), v.transpose(0, 1).index_select(0, keys)
        return _FLASH_VARLEN(q.transpose(0, 1), kt, vt, layout["cu_q"], layout["cu_k"], layout["max_q"],
                             layout["max_len"], dropout_p=dropout, softmax_scale=scaling, causal=True)
    rows, length, grid = layout["rows"], layout["max_len"], layout["grid"]

    def to_grid(x):  # [h, T, D] -> [rows, h, max_len, D]
        return x.transpose(0, 1).index_select(0, grid).view(rows, length, x.shape[0], x.shape[2]).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(to_grid(q), to_grid(k), to_grid(v), is_causal=True,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).reshape(rows * length, q.shape[0], q.shape[2]).index_select(0, layout["out"])


def packed_attention(module, q, k, v, attention_mask, scaling=None, dropout=0.0, layout=None, **kwargs):
    """transformers attention (registered as "packed"): q [1, H, T, D], k/v [1, Hkv, T, D] of a packed row ->
    ([1, T, H, D], None), by segment_attention. transformers passes attention_mask=None for a registered function."""
    if layout is None:
        raise RuntimeError("packed attention needs the row's layout: call model.policy_logprobs")
    return segment_attention(q[0], k[0], v[0], layout, scaling, dropout)[None], None


def load_model(path: str, device: torch.device, dtype: torch.dtype, mixed_precision: bool, trainable: bool = True):
    """Load an HF causal LM and shard it with FSDP2: one unit per decoder layer, plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
    from transformers import AttentionInterface, AutoModelForCausalLM

    global _FLASH_VARLEN

    if device.type == "cuda":
        try:
            from flash_attn import flash_attn_varlen_func as _FLASH_VARLEN
        except ImportError:
            pass
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.config.use_cache = False
    # our attention for every layer: packed rows by segments (shared prompts, whole sequences), flash-attn varlen
    # on GPU, padded sdpa otherwise; under CP the same after Ulysses' all-to-all (registered by setup_context_parallel)
    AttentionInterface.register("packed", packed_attention)
    model.set_attn_implementation("ulysses" if CP_SIZE > 1 else "packed")
    mesh = init_device_mesh(device.type, (WORLD,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    kw = {"mesh": mesh} | ({"mp_policy": mp} if mp else {})
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.policy_logprobs = types.MethodType(policy_logprobs, model)
    register_fsdp_forward_method(model, "policy_logprobs")
    # LossReduction already divides by the *global* normalizer, so ranks' gradients must be summed, not averaged.
    L.fsdp_sum_gradients(model)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


# -----------------------------------------------------------------------------
# the training step: LossReduction over micro-batches, clip, AdamW


def microbatch_forward(model, mb: dict, cfg: Config, device: torch.device, grad: bool) -> tuple:
    with torch.set_grad_enabled(grad):
        if CP_SIZE > 1:
            return cp_policy_logprobs(model, mb, cfg, device)
        return model.policy_logprobs(mb["input_ids"].to(device), mb["position_ids"].to(device),
                                     mb["targets"].to(device), cfg.temperature or 1.0, cfg.logprob_chunk_tokens,
                                     segments=mb.get("segments"))  # on the CPU: attention_layout moves it


def even_out_microbatches(mbs: list[dict], pad_id: int) -> list[dict]:
    """Every rank must run the same number of forward/backward passes (FSDP2 all-gathers per pass)."""
    n = L.all_reduce_vector(torch.tensor([len(mbs)]), op=dist.ReduceOp.MAX)
    return mbs + [empty_microbatch(pad_id) for _ in range(int(n) - len(mbs))]


ROW_KEYS = ("input_ids", "position_ids", "targets", "segments")  # what the model takes, not the loss


def train_minibatch(model, optimizer, reduction: L.LossReduction, mbs: list[dict], cfg: Config,
                    device: torch.device) -> dict[str, float]:
    # every token's normalizer counted once globally: a CP group's ranks all hold the same micro-batches, so only
    # its first rank counts them (every CP rank then computes the full loss: cp_factor puts the N back into Z)
    reduction.begin_step(mbs if CP_RANK == 0 else [])
    # metric sums stay on the device until the end of the step: a float() per micro-batch would sync the GPU
    entropy_sum = mismatch_sum = torch.zeros((), dtype=torch.float64, device=device)
    for mb in mbs:
        logprobs, entropy = microbatch_forward(model, mb, cfg, device, grad=True)
        batch = {k: v.to(device) for k, v in mb.items() if k not in ROW_KEYS}
        batch["logprobs"], batch["entropy"] = logprobs, entropy
        if "prox_logprobs" not in batch:  # one mini-batch: pi_prox is this very forward, detached
            batch["prox_logprobs"] = logprobs.detach()
        reduction(batch).backward()
        entropy_sum = entropy_sum + (entropy.detach() * batch["denom_mask"]).sum()
        # train/inference mismatch: |log pi_theta - log pi_behave| before the update (0 up to numerics when the
        # rollout engine holds the same weights; large values mean a stale or broken weight sync)
        mismatch_sum = mismatch_sum + ((logprobs.detach() - batch["behave_logprobs"]).abs() * batch["denom_mask"]).sum()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    skipped = not math.isfinite(grad_norm)
    if not skipped:  # a non-finite norm is identical on every rank (it is global), so all ranks skip together
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": grad_norm, "skipped_step": float(skipped), "entropy_sum": float(entropy_sum),
            "mismatch_sum": float(mismatch_sum)}


# -----------------------------------------------------------------------------
# rollout + eval helpers


def rollout(engine, items: list[dict], indices: list[int], step: int, cfg: Config, tokenizer,
            encoded: list[list[int]]) -> list[Sample]:
    """Sample `group_size` completions for each of this rank's prompts; failed (aborted) samples are dropped."""
    sampling = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, [tokenizer.eos_token_id])
    prompts, seeds, groups = [], [], []
    for g in indices:
        ids = encoded[g]
        for k in range(cfg.group_size):
            prompts.append(ids)
            seeds.append(mix_seed(cfg.seed, step, g, k))  # independent of rank, batch and world size
            groups.append(g)
    completions = engine.generate(prompts, sampling, seeds)
    return [Sample(g, p, c) for g, p, c in zip(groups, prompts, completions) if c.finish_reason != "abort"]


def evaluate(engine, items: list[dict], cfg: Config, tokenizer, reward_fn) -> float:
    """Greedy held-out accuracy (reward > 0.5), prompts split across ranks, one all-reduce."""
    mine = items[RANK::WORLD]
    sampling = SamplingParams(cfg.max_new_tokens, 0.0, stop_token_ids=[tokenizer.eos_token_id])
    prompts = [encode_prompt(it, tokenizer, cfg.chat_template) for it in mine]
    outs = engine.generate(prompts, sampling, [0] * len(prompts)) if prompts else []
    texts = tokenizer.batch_decode([o.output_ids for o in outs], skip_special_tokens=True)
    scores, _ = compute_rewards(reward_fn, texts, [it["answer"] for it in mine], cfg.reward_timeout)
    correct = sum(r > 0.5 for r in scores)
    s = all_reduce_sum({"correct": correct, "n": len(mine)})
    return s["correct"] / max(s["n"], 1)


def make_engine(cfg: Config, device: torch.device):
    if cfg.rollout_backend == "hf":
        from rollout import HFEngine

        return HFEngine(cfg.model, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    import rollout

    return rollout.make_sglang_engine(cfg, device)


def export_hf(model, tokenizer, src: str, out_dir: Path) -> None:
    """Write a `from_pretrained`-loadable safetensors copy (and so SGLang-loadable). Collective: all ranks call it;
    rank 0 writes into a temporary directory that is renamed when complete, so a crash never leaves half a model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if RANK != 0:
        return
    import shutil

    from safetensors.torch import save_file

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # tied embeddings share storage; safetensors refuses shared tensors, and from_pretrained re-ties them
    if getattr(AutoConfig.from_pretrained(src), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    AutoConfig.from_pretrained(src).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for extra in ("generation_config.json",):
        if (Path(src) / extra).exists():
            shutil.copy(Path(src) / extra, tmp / extra)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


# -----------------------------------------------------------------------------
# checkpoint / resume. A checkpoint is run_dir/checkpoints/step_000010/: torch DCP shards of the model and the
# optimizer (each rank writes its own), each rank's RNG states (rng_rank{r}.pt) and meta.json (step, scheduler,
# last eval, config), which rank 0 writes last. Everything is written into step_000010.tmp/ and renamed when
# complete, so a save killed at any moment is never picked up. The data position is the step itself:
# prompts_for_step and the sampling noise are functions of (seed, step), so nothing else needs saving.


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (a `.tmp` directory, or one without meta.json, is not one)."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("step_*")
             if not p.name.endswith(".tmp") and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def rng_states() -> dict:
    """Every RNG this process has, as tensors and plain lists (loadable with weights_only=True)."""
    import numpy as np

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(words), gauss], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]}


def set_rng_states(state: dict) -> None:
    import numpy as np

    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), *rest))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_meta(tmp: Path, meta: dict) -> None:
    """The last file of a checkpoint; its presence (after the rename) marks the checkpoint complete."""
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _fsync(tmp / "meta.json")


def save_checkpoint(step: int, model, optimizer, scheduler, cfg: Config, last_eval: float | None) -> Path:
    """Collective (every rank calls it): DCP shards + RNGs into step_N.tmp/, barrier, rank 0 writes meta.json,
    renames the directory and deletes older checkpoints beyond --keep-ckpts."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = Path(cfg.run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if RANK == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # fsyncs its files
    torch.save(rng_states(), tmp / f"rng_rank{RANK}.pt")
    dist.barrier()  # every rank's files are written
    if RANK == 0:
        _write_meta(tmp, {"step": step, "world": WORLD, "last_eval": last_eval, "scheduler": scheduler.state_dict(),
                          "config": asdict(cfg)})
        shutil.rmtree(final, ignore_errors=True)  # only there when resumed from an older checkpoint
        tmp.rename(final)
        _fsync(final.parent)
        older = [p for p in complete_checkpoints(cfg.run_dir) if int(p.name.removeprefix("step_")) < step]
        for old in older[: max(len(older) - cfg.keep_ckpts + 1, 0)] if cfg.keep_ckpts > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def maybe_save_checkpoint(step: int, model, optimizer, scheduler, cfg: Config, last_eval: float | None) -> None:
    """Every --ckpt-every steps and at the last step."""
    if cfg.ckpt_every > 0 and (step % cfg.ckpt_every == 0 or step == cfg.steps):
        t0 = time.perf_counter()
        path = save_checkpoint(step, model, optimizer, scheduler, cfg, last_eval)
        print0(f"saved {path} in {time.perf_counter() - t0:.2f}s")


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics lines of steps <= `step` (a resumed run writes the rest again): a temporary file replaces
    the old one in one rename, so a kill never leaves half a file."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by a kill
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def _safe_dcp_reader(path: Path):
    """DCP's FileSystemReader unpickles `.metadata` with plain pickle: check it first with an unpickler that only
    knows DCP's metadata classes, torch sizes and dtypes (tensors themselves load with weights_only=True)."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    allowed = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            ok = (module, name) in allowed or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                 torch.dtype))
            ok |= module == "torch.distributed.checkpoint.metadata" and "." not in name and name[:1].isupper()
            ok |= module == "torch.distributed.checkpoint.metadata" and name == "_MEM_FORMAT_ENCODING"
            if not ok:
                raise pickle.UnpicklingError(f"{path}/.metadata: refusing to unpickle {module}.{name}")
            return super().find_class(module, name)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(path) / ".metadata", "rb") as f:
                MetadataUnpickler(f).load()
            return super().read_metadata(*args, **kwargs)

    return Reader(path)


def _safe_dcp_planner():
    """DCP loads non-tensor values (the optimizer's param_groups) with torch.load(weights_only=False): check each with
    weights_only=True first (plain numbers, strings, lists pass)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return Planner()


def resume(cfg: Config, model, optimizer, scheduler, engine) -> tuple[int, float | None]:
    """Restore the checkpoint --resume names (auto: this run's latest complete one, if any) into model, optimizer,
    scheduler, RNGs and the rollout engine, and cut metrics.jsonl back to it. Returns (step, last eval accuracy);
    (0, None) for a fresh start, which also starts a fresh metrics.jsonl."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = complete_checkpoints(cfg.run_dir) if cfg.resume == "auto" else []
    path = Path(cfg.resume) if cfg.resume not in ("auto", "none") else found[-1] if found else None
    box = [str(path) if path else None]  # every rank resumes from rank 0's choice
    dist.broadcast_object_list(box, src=0)
    path = Path(box[0]) if box[0] else None
    metrics_file = Path(cfg.run_dir) / "metrics.jsonl"
    if RANK == 0:
        for stale in (Path(cfg.run_dir) / "checkpoints").glob("*.tmp"):  # saves that were killed
            shutil.rmtree(stale, ignore_errors=True)
    if path is None:
        if RANK == 0:
            metrics_file.unlink(missing_ok=True)
        return 0, None

    meta = json.loads((path / "meta.json").read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=_safe_dcp_reader(path), planner=_safe_dcp_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(meta["scheduler"])
    rng = path / f"rng_rank{RANK}.pt"
    set_rng_states(torch.load(rng if rng.exists() else path / "rng_rank0.pt", weights_only=True))
    engine.update_weights(model)  # the engine started from --model's weights
    if RANK == 0:
        truncate_metrics(metrics_file, meta["step"])
    same = {"run_dir", "resume", "steps", "ckpt_every", "keep_ckpts", "config", "eval_every", "log_every"}
    changed = sorted(k for k, v in meta["config"].items() if k not in same and json.loads(json.dumps(
        getattr(cfg, k, v))) != v)
    if changed:
        print0(f"warning: resuming {path} with changed options {changed}")
    print0(f"resumed from {path} at step {meta['step']}")
    return meta["step"], meta["last_eval"]


def check_bad_steps(bad_steps: int, metrics: dict[str, float], cfg: Config) -> int:
    """Count steps in a row whose optimizer step was skipped (non-finite loss or grad norm); stop after
    --max-bad-steps of them, leaving the checkpoints (written only after healthy steps) as they are."""
    bad_steps = bad_steps + 1 if metrics["skipped_steps"] else 0
    if 0 < cfg.max_bad_steps <= bad_steps:
        last = complete_checkpoints(cfg.run_dir)
        raise SystemExit(f"error: {bad_steps} steps in a row had a non-finite loss or grad norm (--max-bad-steps "
                         f"{cfg.max_bad_steps}); last good checkpoint: {last[-1] if last else 'none'}")
    return bad_steps


# -----------------------------------------------------------------------------
# logging


class Logger:
    """stdout line + metrics.jsonl (+ wandb when a project is given), rank 0 only."""

    def __init__(self, cfg: Config):
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.wandb = None
        if RANK == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if cfg.wandb_project:
                import wandb

                self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=asdict(cfg))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if RANK != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step} | metrics) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self):
        if self.wandb is not None:
            self.wandb.finish()


def format_line(step: int, m: dict[str, float]) -> str:
    parts = [f"step {step:4d}", f"reward {m['reward']:.3f}", f"acc {m['accuracy']:.3f}"]
    parts += [f"{k[5:]} {v:+.4f}" for k, v in m.items() if k.startswith("loss/")]
    parts += [f"len {m['response_len']:.1f}", f"clip {m.get('policy/clip_frac', 0.0):.3f}",
              f"zero_adv {m['zero_adv_frac']:.2f}", f"trunc {m['truncated_frac']:.2f}",
              f"gnorm {m['grad_norm']:.3f}", f"tok/s {m['tokens_per_s']:.0f}",
              f"t rollout/train/sync {m['time/rollout']:.2f}/{m['time/train']:.2f}/{m['time/sync']:.2f}s"]
    if "eval/accuracy" in m:
        parts.append(f"eval {m['eval/accuracy']:.3f}")
    return " | ".join(parts)


# -----------------------------------------------------------------------------
# main


def main(argv: list[str] | None = None) -> None:
    import faulthandler

    faulthandler.enable()  # a rank that aborts in C++ (gloo, NCCL) still prints every thread's Python stack
    cfg = parse_config(argv)
    device = setup_distributed(cfg)
    cfg = validate_config(cfg, WORLD)
    setup_context_parallel(cfg, device)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float64": torch.float64}[cfg.dtype]
    mixed_precision = device.type == "cuda" and cfg.dtype == "auto"

    # data
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    if cfg.dataset == "arithmetic":
        train_items, eval_items = make_arithmetic_task()  # one fixed split: --seed varies the run, not the task
    else:
        train_items = load_jsonl(cfg.dataset)
        eval_items = load_jsonl(cfg.eval_dataset) if cfg.eval_dataset else []
    eval_items = eval_items[: cfg.eval_size]
    reward_fn = REWARDS[cfg.reward]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = [encode_prompt(it, tokenizer, cfg.chat_template) for it in train_items]
    validate_token_budget(encoded, cfg)

    # model, optimizer, rollout engine (the engine first: SGLang sizes its KV cache from free GPU memory)
    engine = make_engine(cfg, device)
    model = load_model(cfg.model, device, dtype, mixed_precision)
    ref_model = load_model(cfg.model, device, dtype, mixed_precision, trainable=False) if cfg.kl_coef > 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    reduction = L.build_loss(
        mode=cfg.loss_aggregation, policy_loss=cfg.policy_loss, divisor=cfg.loss_aggregation_divisor,
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip, behaviour_cap=cfg.behaviour_cap,
        behaviour_cap_mode=cfg.behaviour_cap_mode, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg,
        entropy_coef=cfg.entropy_coef, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
        group=dist.group.WORLD if WORLD > 1 else None, cp_factor=cfg.cp_size)
    logger = Logger(cfg)
    print0(f"nanoareal: {WORLD} rank(s) on {device.type}, model {cfg.model}, {len(train_items)} train prompts, "
           f"{len(eval_items)} eval, loss {cfg.policy_loss}/{cfg.loss_aggregation}")

    from tqdm import tqdm

    start_step, last_eval = resume(cfg, model, optimizer, scheduler, engine)  # (0, None) for a fresh run
    bad_steps = 0
    progress = tqdm(total=cfg.steps, initial=start_step, disable=RANK != 0, dynamic_ncols=True, file=sys.stdout)
    if eval_items and cfg.eval_every > 0 and start_step == 0:
        last_eval = evaluate(engine, eval_items, cfg, tokenizer, reward_fn)
        logger.log(start_step, {"eval/accuracy": last_eval})
        print0(f"step {start_step:4d} | eval {last_eval:.3f}")
    for step in range(start_step, cfg.steps):
        t0 = time.perf_counter()
        # ALGO LOGIC: rollout -> reward -> advantages -> loss -> step -> sync. This rank's prompts: every
        # DP_SIZE-th of the step's global list, so whole groups live on one data-parallel rank (one CP group).
        indices = prompts_for_step(len(train_items), cfg.prompts_per_step, step, cfg.seed)[DP_RANK::DP_SIZE]
        # a CP group must train on identical samples: its first rank samples, the others receive them
        samples = cp_broadcast(rollout(engine, train_items, indices, step, cfg, tokenizer, encoded) if CP_RANK == 0
                               else None)
        t1 = time.perf_counter()

        stats = score_samples(samples, train_items, reward_fn, tokenizer, cfg)  # sets .reward and .advantage
        if cfg.filter_zero_variance:
            samples = [s for s in samples if not s.zero_variance]

        engine.release_memory()
        train_stats = train_on_samples(model, ref_model, optimizer, reduction, samples, cfg, device, pad_id)
        scheduler.step()
        engine.resume_memory()
        t2 = time.perf_counter()

        engine.update_weights(model)
        t3 = time.perf_counter()

        # TRY NOT TO MODIFY: metrics, eval, logging
        sums = stats | train_stats.pop("sums")  # a CP group holds one copy of its samples: count it once
        m = all_reduce_sum(sums if CP_RANK == 0 else dict.fromkeys(sums, 0.0))
        metrics = finalize_metrics(m, train_stats, cfg, t0, t1, t2, t3, optimizer)
        if eval_items and cfg.eval_every > 0 and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
            last_eval = metrics["eval/accuracy"] = evaluate(engine, eval_items, cfg, tokenizer, reward_fn)
        logger.log(step + 1, metrics)
        if (step + 1) % cfg.log_every == 0:
            progress.write(format_line(step + 1, metrics))  # a no-op off rank 0: the bar is disabled there
        progress.update(1)
        bad_steps = check_bad_steps(bad_steps, metrics, cfg)  # stops the run after --max-bad-steps in a row
        if bad_steps == 0:  # checkpoints only after healthy steps
            maybe_save_checkpoint(step + 1, model, optimizer, scheduler, cfg, last_eval)
    progress.close()
    export_hf(model, tokenizer, cfg.model, Path(cfg.run_dir) / "final")
    if last_eval is not None:
        print0(f"final held-out accuracy {last_eval:.3f}")
    logger.close()
    engine.shutdown()
    dist.destroy_process_group()


def score_samples(samples: list[Sample], items: list[dict], reward_fn, tokenizer, cfg: Config) -> dict[str, float]:
    """Rewards, then group advantages, written into the samples. Returns this rank's rollout metric sums."""
    texts = tokenizer.batch_decode([s.completion.output_ids for s in samples], skip_special_tokens=True)
    scores, reward_errors = compute_rewards(reward_fn, texts, [items[s.group]["answer"] for s in samples],
                                            cfg.reward_timeout)  # a reward that raises or hangs scores 0
    rewards = torch.tensor(scores, dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    adv = group_advantages(rewards, groups, cfg.adv_estimator, cfg.adv_std, cfg.adv_eps)
    zero_var = group_is_constant(rewards, groups)
    for s, r, a, z in zip(samples, scores, adv.tolist(), zero_var.tolist()):
        s.reward, s.advantage, s.zero_variance = r, a, z
    return rollout_stats(samples, zero_var, groups) | {"reward_errors": reward_errors}


def group_is_constant(rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per sample: its group's rewards are all equal (zero variance, zero GRPO advantage)."""
    _, inv = torch.unique(groups, return_inverse=True)
    k = int(inv.max()) + 1 if len(inv) else 0
    lo = torch.full((k,), float("inf")).scatter_reduce(0, inv, rewards.float(), "amin")
    hi = torch.full((k,), float("-inf")).scatter_reduce(0, inv, rewards.float(), "amax")
    return (hi - lo <= 0)[inv]


def rollout_stats(samples: list[Sample], zero_var: torch.Tensor, groups: torch.Tensor) -> dict[str, float]:
    """Per-rank sums; all-reduced with the training sums in one collective."""
    n_groups = len(set(groups.tolist()))
    zero_groups = len({g for g, z in zip(groups.tolist(), zero_var.tolist()) if z})
    return {
        "n_samples": len(samples),
        "reward_sum": sum(s.reward for s in samples),
        "correct_sum": sum(s.reward > 0.5 for s in samples),
        "response_len_sum": sum(len(s.completion.output_ids) for s in samples),
        "prompt_len_sum": sum(len(s.prompt_ids) for s in samples),
        "truncated_sum": sum(s.completion.finish_reason == "length" for s in samples),
        "zero_adv_sum": sum(abs(s.advantage) < 1e-12 for s in samples),
        "n_groups": n_groups,
        "zero_var_groups": zero_groups,
    }


def train_on_samples(model, ref_model, optimizer, reduction, samples, cfg, device, pad_id) -> dict:
    """One rollout batch -> `num_minibatches` optimizer steps. Returns stats and per-rank sums."""
    order = sorted(set(s.group for s in samples))
    chunks = [set(order[i :: cfg.num_minibatches]) for i in range(cfg.num_minibatches)]
    minibatches = [[s for s in samples if s.group in c] for c in chunks]
    packed = [even_out_microbatches(pack_microbatches(mb, cfg, pad_id) if mb else [], pad_id) for mb in minibatches]
    # pi_prox (and the reference policy) must be the weights *before* the first update of this batch.
    extra_forwards = (not cfg.reuse_train_logprobs) or ref_model is not None
    if extra_forwards:
        with torch.no_grad():
            for mbs in packed:
                for mb in mbs:
                    if not cfg.reuse_train_logprobs:
                        mb["prox_logprobs"] = microbatch_forward(model, mb, cfg, device, False)[0].float().cpu()
                    if ref_model is not None:
                        mb["ref_logprobs"] = microbatch_forward(ref_model, mb, cfg, device, False)[0].float().cpu()
    if cfg.m2po_threshold is not None:
        for mbs in packed:
            if not mbs:  # empty on every rank (even_out_microbatches padded any rank that alone had none)
                continue
            masks = L.m2po_mask(torch.cat([mb["prox_logprobs"] for mb in mbs]),
                                torch.cat([mb["behave_logprobs"] for mb in mbs]),
                                torch.cat([mb["loss_mask"] for mb in mbs]), threshold=cfg.m2po_threshold,
                                group=dist.group.WORLD if WORLD > 1 else None)
            for mb, m in zip(mbs, masks.split([len(mb["loss_mask"]) for mb in mbs])):
                mb["loss_mask"] = m
    out = {"grad_norm": 0.0, "skipped_steps": 0.0}
    # trained_tokens: prompt + completion tokens of the samples trained; positions: what the model was fed (fewer:
    # shared prompts, no last tokens) -- tokens/s counts the former, so a cheaper layout shows up as more tokens/s
    sums: dict[str, float] = {"entropy_sum": 0.0, "mismatch_sum": 0.0, "denom_tokens": 0.0, "positions": 0.0,
                              "trained_tokens": float(sum(len(s.prompt_ids) + len(s.completion.output_ids)
                                                          for s in samples))}
    reported: dict[str, float] = {}
    for mbs in packed:
        s = train_minibatch(model, optimizer, reduction, mbs, cfg, device)
        out["grad_norm"] = s["grad_norm"]
        out["skipped_steps"] += s["skipped_step"]
        sums["entropy_sum"] += s["entropy_sum"]
        sums["mismatch_sum"] += s["mismatch_sum"]
        sums["positions"] += sum(mb["input_ids"].numel() for mb in mbs)
        sums["denom_tokens"] += sum(float(mb["denom_mask"].sum()) for mb in mbs)
        for k, v in reduction.reported().items():
            reported[k] = reported.get(k, 0.0) + v / len(packed)
    out["reported"] = reported
    out["sums"] = sums
    return out


def finalize_metrics(m: dict, train_stats: dict, cfg: Config, t0, t1, t2, t3, optimizer) -> dict[str, float]:
    n = max(m["n_samples"], 1)
    metrics = {
        "reward": m["reward_sum"] / n,
        "accuracy": m["correct_sum"] / n,
        "response_len": m["response_len_sum"] / n,
        "truncated_frac": m["truncated_sum"] / n,
        "zero_adv_frac": m["zero_adv_sum"] / n,
        "zero_var_groups": m["zero_var_groups"],
        "entropy": m["entropy_sum"] / max(m["denom_tokens"], 1),
        "logprob_mismatch": m["mismatch_sum"] / max(m["denom_tokens"], 1),
        "grad_norm": train_stats["grad_norm"],
        "skipped_steps": train_stats["skipped_steps"],
        "reward_errors": m["reward_errors"],
        "lr": optimizer.param_groups[0]["lr"],
        "tokens_per_s": (m["response_len_sum"] + m["trained_tokens"]) / max(t3 - t0, 1e-9),
        "train_positions": m["positions"],
        "time/rollout": t1 - t0, "time/train": t2 - t1, "time/sync": t3 - t2, "time/step": t3 - t0,
    }
    for k, v in train_stats["reported"].items():  # loss terms by name, "loss" = their weighted total, "x/y" stats
        metrics["loss/total" if k == "loss" else k if "/" in k else f"loss/{k}"] = v
    return metrics


if __name__ == "__main__":
    main()
    # Everything is written, fsynced or closed by now (metrics lines, checkpoints, export, wandb.finish). Skip the
    # interpreter's teardown: it garbage-collects what still references the process groups (FSDP state, device
    # mesh) after their backends were shut down, and about 1 in 60 finished 2-rank gloo runs aborted there
    # ("terminate called without an active exception"; faulthandler: no Python frame left) -- a failed exit status
    # for a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
