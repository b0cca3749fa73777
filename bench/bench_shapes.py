r"""nanoareal vs TRL's GRPOTrainer at real model shapes: step, generation and training time, peak
memory and achieved FLOP/s of each phase, the two alternating step by step in one run.

    python bench/bench_shapes.py                                    # 135M shape, 32/128/512 tokens
    python bench/bench_shapes.py --shapes qwen2.5-0.5b --tokens 64  # 2 prompts x 4, 152k vocab
    python bench/bench_shapes.py --tokens 32 --steps 2 --warmup 1   # one length, quicker
    python bench/bench_shapes.py --smoke                            # the test's tiny run (seconds)
    python bench/bench_shapes.py --baseline /tmp/old   # also another checkout's nanoareal (before)
    python bench/bench_shapes.py --tokens 512 --baseline /tmp/old --no-trl   # before/after alone

Models: random-init, seeded, built on the fly into a temporary folder with a word-level tokenizer
of the model's whole vocabulary ("w<id>" words): `smollm2-135m` (Llama, hidden 576, 30 layers,
9/3 heads, intermediate 1536, vocab 49152, tied, rope theta 1e5; 4 prompts x 4 samples by default)
and `qwen2.5-0.5b` (bench_flops.QWEN25_05B: 24 layers, 14/2 heads, vocab 151936, tied; 2 prompts x
4). Prompts: `--prompt-len` (64) random words, the same rows and order for both trainers. Every
answer runs to `--tokens`: the end-of-sequence token is id `vocab` (the tokenizer has one more
word than the model has logits), so neither nanoareal's sampler nor `generate` can ever emit it;
nothing else changes in either trainer's generation. Reward: the answer's length in characters
(nanoareal's built-in `length`; its digits vary, so groups have advantages and both train).

Each trainer runs in a child process of its own (its peak memory is its own) and the parent
alternates them over pipes, one step at a time (the order flips every step); only one computes at
a time. Both use `--threads` torch threads (2), fp32, the CPU. Timed, per step:
- nanoareal: `common.NanoRun.step` (the CLI loop's body: rollout on its HF engine, reward,
  advantages, train_on_samples, weight sync). generation = the engine's `generate` (Sample.gen_s);
  training = `train_on_samples` (packing, forward, backward, clip, AdamW); other = the rest
  (reward, advantages, weight sync).
- TRL: from the parent's "go" to `on_step_end` (data loading, generation, reward, advantages,
  padding, every micro-batch's forward/backward, clip, AdamW). generation = `_generate`
  (tokenizing, `model.generate`, decoding); training = the step less
  `_generate_and_score_completions`; other = that call less `_generate` (reward, advantages).
Memory: each trainer process reports its own peak resident set per step (VmHWM, reset through
/proc/self/clear_refs as the step starts: exact, no sampling); "peak RSS" is the largest over
the steps, warm-up included; "start-up" is VmHWM once the trainer is built. A forked rollout
process (nanoareal's hf engine at --max-staleness > 0; none at the default 0) adds its private
memory (Private_* of /proc/<pid>/smaps_rollup: the weights it shares are not counted twice),
sampled by the parent every `--mem-interval` s while its trainer computes.
FLOP/s: training = 6 N_dec T + 6 N_head H + 12 L d_attn P over the training phase's time, where
T = positions the decoder computed with autograd on (hooked: nanoareal feeds a group's prompt
once and no sequence's last token; TRL every prompt+completion), H = positions the head scored
(nanoareal the responses' alone: a shared prompt's prefix predicts nothing read; TRL all but
each row's last), P = causal (query, key) pairs of those positions
(nanoareal's packed segments, bench_flops.causal_pairs; TRL's rows by their attention mask).
Generation = 2 N_dec T + 2 N_head R + 4 L d_attn P over the generation time, counted from the
decoder forwards that generation runs (nanoareal's engine holds a model of its own; TRL's inside
`_generate`): prefill and decode, nanoareal prefilling a distinct prompt once and TRL every row;
R = rows a forward returns logits for (one each: the last position); P from the attention mask.
Against two peaks the parent measures at the same thread count just before each configuration:
a `--peak-n`^3 fp32 matmul (the larger of two), and for generation also the batch's own decode
matmuls ([rows, d] @ every layer's weights and the head, the attention GEMVs over the mean
context): "streamed" runs one whole step with every layer's own tensors, as a decode reads them
from memory (the limit a decode step has); "cache-hot" times each shape alone (an upper bound).

TRL 1.16 `GRPOTrainer`, configured as bench_vs_trl.py (equivalent loss: nanoareal token_mean
PPO-clip == loss_type "dapo", eps 0.2, beta 0 so no reference model, group-std advantages, one
AdamW step per generation batch, lr 1e-4 constant, clip 1.0, betas and decay as nanoareal's) in
its faster settings: transformers `generate` (no vLLM), gradient checkpointing off, no dataloader
workers, `per_device_train_batch_size` the most sequences whose padded tokens fit nanoareal's
`--micro-batch-tokens` (the same memory budget per forward; `--trl-micro-batch` overrides) with
`steps_per_generation` = gradient accumulation = the rest of the batch, shuffling off, logging
rare. Medians (min-max) of `--steps` steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_flops import QWEN25_05B, causal_pairs, matmul_peak, matmul_weights
from common import ROOT, N, NanoRun, make_config  # noqa: I001

import modeling  # noqa: E402  (common put the repository on the path)

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rope_theta=1e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, max_position_embeddings=2048,
                         hidden_act="silu"),
    # as a Llama: transformers 5.x gives a qwen2 directory Qwen2's own tokenizer class, which
    # reads the word-level tokenizer as no tokens; Qwen2 only adds q/k/v biases (0.006% of weights)
    "qwen2.5-0.5b": QWEN25_05B | {"model_type": "llama"},
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=True, max_position_embeddings=256, hidden_act="silu"),
}
PROMPTS = {"smollm2-135m": 4, "qwen2.5-0.5b": 2, "tiny": 2}  # prompts per step by default
SIDES = ("nanoareal", "TRL")
TAG = "@bench "  # a child's protocol lines on stdout start with this


# -----------------------------------------------------------------------------
# the model, tokenizer and prompts, made once per shape by the parent
def make_model(shape: str, out: Path) -> Path:
    """A seeded random-init model of `shape` and a word-level tokenizer of its vocabulary plus an
    end-of-sequence word (id = vocab) that no logit can sample."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = SHAPES[shape]["vocab_size"]
    config = AutoConfig.for_model(**SHAPES[shape], bos_token_id=None, eos_token_id=vocab,
                                  pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    words = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}, "<eos>": vocab}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<unk>", "<eos>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(out)
    return out


def make_rows(path: Path, n: int, prompt_len: int, vocab: int) -> Path:
    """n JSONL rows of `prompt_len` random words ("answer" is unused by the length reward)."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(n):
            words = " ".join(f"w{rng.randrange(2, vocab)}" for _ in range(prompt_len))
            f.write(json.dumps({"prompt": words, "answer": "0"}) + "\n")
    return path


# -----------------------------------------------------------------------------
# counting what a decoder computes
class Forwards:
    """A decoder's forwards by phase (`phase()` names the one running: "train" or "gen"):
    positions fed, rows, calls, and (query, key) pairs of attention, a row's from its attention
    mask when one is given (n new real tokens after c real ones: n c + n(n+1)/2), else 0 (the
    caller counts them)."""

    def __init__(self, decoder: torch.nn.Module, phase):
        self.phase = phase
        self.handle = decoder.register_forward_pre_hook(self._hook, with_kwargs=True)
        self.reset()

    def reset(self):
        self.counts = {k: {"positions": 0, "rows": 0, "pairs": 0, "calls": 0}
                       for k in ("train", "gen")}

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        ids = ids if ids.dim() == 2 else ids[None]
        c = self.counts[self.phase()]
        c["positions"] += ids.numel()
        c["rows"] += ids.shape[0]
        c["calls"] += 1
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            real = mask.sum(-1).cpu()
            new = real.clamp(max=ids.shape[1])
            c["pairs"] += int((new * (real - new) + new * (new + 1) // 2).sum())


def flops(n: tuple[int, int], layers: int, d_attn: int, positions: int, head: int, pairs: int,
          grad: bool) -> int:
    """Matmul FLOPs: 2 per weight and position forward (x3 with backward), attention QK^T and AV
    4 d_attn per pair and layer (x3)."""
    k = 3 if grad else 1
    return k * (2 * n[0] * positions + 2 * n[1] * head + 4 * layers * d_attn * pairs)


def model_facts(model) -> dict:
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {"n": matmul_weights(model), "layers": text.num_hidden_layers,
            "d_attn": text.num_attention_heads * head_dim, "threads": torch.get_num_threads()}


# -----------------------------------------------------------------------------
# the children: one trainer each, driven over stdin/stdout one step at a time
class Channel:
    """The child's end: JSON commands on stdin, TAG-prefixed JSON answers on the original stdout
    (everything libraries print goes to stderr, the child's log)."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, obj: dict) -> None:
        self.out.write(TAG + json.dumps(obj) + "\n")

    def recv(self) -> dict:
        line = sys.stdin.readline()
        if not line:  # the parent is gone
            os._exit(1)
        return json.loads(line)


def vm_hwm(reset: bool = False) -> int:
    """This process's peak resident set so far (VmHWM); `reset`: from now on (clear_refs 5)."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def nano_config(args, model: str, data: str) -> N.Config:
    over = dict(model=model, dataset=data, reward="length", prompts_per_step=args.prompts,
                group_size=args.group_size, max_new_tokens=args.tokens, warmup_steps=0,
                eval_every=0, loss_aggregation="token_mean", policy_loss="ppo", seed=0)
    if args.micro_batch_tokens:
        over["micro_batch_tokens"] = args.micro_batch_tokens
    for item in args.nano_set:  # e.g. max_staleness=1: typed as the Config field's default
        key, _, value = item.partition("=")
        default = getattr(N.Config, key)
        over[key] = value.lower() in ("1", "true") if isinstance(default, bool) else \
            type(default)(value) if default is not None else value
    return make_config(**over)


def nano_child(args, ch: Channel) -> None:
    nano = NanoRun(nano_config(args, args.model_dir, args.data))
    torch.set_num_threads(args.threads)
    train = Forwards(nano.model.module.model, lambda: "train")  # the engine's model is its own
    gen = Forwards(nano.engine.model.base_model, lambda: "gen")  # (a forked one goes uncounted)
    taken, rollout = [], nano.rollout
    nano.rollout = lambda step: taken.append(rollout(step)) or taken[-1]
    ch.send(model_facts(nano.model.module) | {"micro_batch_tokens": nano.cfg.micro_batch_tokens,
                                               "startup_hwm": vm_hwm()})
    step = 0
    while ch.recv()["cmd"] == "step":
        train.reset(), gen.reset(), taken.clear(), vm_hwm(reset=True)
        m = nano.step(step)
        hwm = vm_hwm()
        samples = taken[0]
        mbs = N.pack_microbatches(samples, nano.cfg)  # the step's own packing again, untimed
        t, g = train.counts["train"], gen.counts["gen"]
        ch.send({"step": m["time/step"], "gen": samples[0].gen_s, "train": m["time/train"],
                 "generated": m["generated_tokens"], "train_positions": t["positions"],
                 "train_head": sum(int((mb.seq_ids >= 0).sum()) for mb in mbs),
                 "train_pairs": causal_pairs(
                     torch.cat([mb.segments for mb in mbs])), "gen_positions": g["positions"],
                 "gen_head": g["rows"], "gen_pairs": g["pairs"], "hwm": hwm,
                 "threads": torch.get_num_threads()})
        step += 1
    nano.close()
    ch.send({})


def trl_micro_batch(args) -> int:
    """TRL's per_device_train_batch_size: --trl-micro-batch, else the most sequences (a divisor of
    the batch) whose tokens fit nanoareal's micro-batch budget."""
    rows = args.prompts * args.group_size
    if args.trl_micro_batch:
        return args.trl_micro_batch
    budget = args.micro_batch_tokens or N.Config.micro_batch_tokens
    fits = [d for d in range(1, rows + 1) if rows % d == 0 and d * (args.prompt_len + args.tokens)
            <= budget]
    return max(fits, default=1)


def build_trl(args, total_steps: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    order = [g for s in range(total_steps)
             for g in N.prompts_for_step(len(rows), args.prompts, s, 0)]
    dataset = Dataset.from_list([rows[g] for g in order])  # nanoareal's prompts, in its order
    rows_per_step = args.prompts * args.group_size
    micro = trl_micro_batch(args)
    if rows_per_step % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide {rows_per_step}")
    accum, cfg = rows_per_step // micro, N.Config()
    tcfg = GRPOConfig(
        output_dir=str(Path(args.data).parent / "trl"), report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=args.group_size, max_completion_length=args.tokens, temperature=1.0,
        top_p=1.0, top_k=0, use_vllm=False, beta=0.0, loss_type="dapo", epsilon=0.2,
        epsilon_high=0.2, scale_rewards="group", num_iterations=1, learning_rate=1e-4,
        adam_beta1=N.ADAM_BETAS[0], adam_beta2=N.ADAM_BETAS[1], weight_decay=N.WEIGHT_DECAY,
        max_grad_norm=cfg.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        max_steps=total_steps, shuffle_dataset=False, seed=0, logging_steps=10**6,
        log_completions=False)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    length = lambda completions, **kw: [float(len(c)) for c in completions]  # tasks.length
    return GRPOTrainer(model=model, reward_funcs=length, args=tcfg, train_dataset=dataset,
                       processing_class=AutoTokenizer.from_pretrained(args.model_dir))


def timed(obj, name: str, clock: dict) -> None:
    """Wrap obj.name: clock[name] accumulates its wall time, clock["running"] holds it meanwhile."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        clock.setdefault("running", set()).add(name)
        try:
            return inner(*a, **kw)
        finally:
            clock["running"].discard(name)
            clock[name] = clock.get(name, 0.0) + time.perf_counter() - t
    setattr(obj, name, wrapper)


def trl_child(args, ch: Channel) -> None:
    from transformers import TrainerCallback

    total = args.warmup + args.steps
    trainer = build_trl(args, total)
    torch.set_num_threads(args.threads)
    decoder = trainer.model.model
    clock, mark, lengths = {}, [0.0], []
    fwd = Forwards(decoder, lambda: "gen" if "_generate" in clock.get("running", ()) else "train")
    inner = trainer._generate  # (prompt_ids, completion_ids, ...): the answers' lengths kept
    trainer._generate = lambda prompts: (out := inner(prompts), lengths.extend(map(len, out[1])))[0]
    timed(trainer, "_generate", clock)
    timed(trainer, "_generate_and_score_completions", clock)

    def go():
        ch.recv()
        fwd.reset(), clock.clear(), lengths.clear(), vm_hwm(reset=True)
        mark[0] = time.perf_counter()

    class Alternate(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            go()

        def on_step_end(self, targs, state, control, **kw):
            step, hwm = time.perf_counter() - mark[0], vm_hwm()
            t, g = fwd.counts["train"], fwd.counts["gen"]
            prepared = clock.get("_generate_and_score_completions", 0.0)
            ch.send({"step": step, "gen": clock.get("_generate", 0.0), "train": step - prepared,
                     "generated": sum(lengths),
                     "train_positions": t["positions"], "train_head": t["positions"] - t["rows"],
                     "train_pairs": t["pairs"], "gen_positions": g["positions"],
                     "gen_head": g["rows"], "gen_pairs": g["pairs"], "hwm": hwm,
                     "threads": torch.get_num_threads()})
            if state.global_step < total:
                go()

    trainer.add_callback(Alternate())
    ch.send(model_facts(trainer.model) | {"micro_batch": trl_micro_batch(args),
                                           "startup_hwm": vm_hwm()})
    trainer.train()
    ch.recv()  # done
    ch.send({})


# -----------------------------------------------------------------------------
# the parent: two children alternating, their memory sampled, the peaks, the tables
def descendants_uss(pid: int) -> int:
    """Bytes of private memory (USS: Private_Clean + Private_Dirty of smaps_rollup) of pid's
    descendants, not pid's own: a forked rollout process's, beyond what it shares with pid."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            if p != pid:
                text = Path(f"/proc/{p}/smaps_rollup").read_text()
                total += sum(int(x) for x in re.findall(r"Private_\w+:\s+(\d+) kB", text)) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += map(int, (task / "children").read_text().split())
        except OSError:
            continue
    return total


class Side:
    """One trainer's child process: `flags` on its command line, its stderr in `log`, commands to
    its stdin and answers from its stdout over pipes of our own (plain fds: any Popen takes)."""

    def __init__(self, name: str, flags: list[str], log: Path, threads: int, root: Path = ROOT):
        self.name, self.log = name, log
        child = "TRL" if name == "TRL" else "nanoareal"  # the baseline: another checkout's
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                   WANDB_MODE="disabled")
        (cmd_r, cmd_w), (ans_r, ans_w) = os.pipe(), os.pipe()
        with log.open("w") as err:
            script = root / "bench" / "bench_shapes.py"
            self.proc = subprocess.Popen([sys.executable, str(script), *flags, "--child", child],
                                         stdin=cmd_r, stdout=ans_w, stderr=err, cwd=root, env=env)
        os.close(cmd_r), os.close(ans_w)
        self.commands, self.answers = os.fdopen(cmd_w, "w"), os.fdopen(ans_r)

    def recv(self) -> dict:
        for line in self.answers:
            if line.startswith(TAG):
                return json.loads(line[len(TAG):])
        tail = self.log.read_text()[-4000:]
        raise SystemExit(f"the {self.name} child ended (exit {self.proc.wait()}); its log "
                         f"{self.log} ends:\n{tail}")

    def ask(self, cmd: str) -> dict:
        self.commands.write(json.dumps({"cmd": cmd}) + "\n")
        self.commands.flush()
        return self.recv()


class Sampler(threading.Thread):
    """Samples the private memory of the active side's descendants (a forked rollout process)
    every `interval` s; peak[name] is the largest. Reading smaps_rollup walks a process's pages
    (0.1-0.2 s for a 1.6 GB trainer on a loaded 2-core machine), so the trainers themselves are
    not sampled: each reports its own exact peak (VmHWM) per step."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.active, self.peak = interval, None, {}
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(self.interval):
            side = self.active
            if side is not None:
                self.peak[side.name] = max(self.peak.get(side.name, 0),
                                           descendants_uss(side.proc.pid))


def decode_peak(shape: dict, rows: int, context: int, reps: int = 5) -> tuple[float, float]:
    """FLOP/s one decode step's matmuls allow at their own shapes: [rows, d] @ every layer's
    weights (q, k, v, o, gate, up, down) and the head, and each layer's attention GEMVs (q @ K^T,
    p @ V over `context` keys, grouped heads batched as SDPA runs them). (streamed, cache-hot):
    streamed gives every layer its own weights and K/V, as a real step reads them (135M shape: 540
    MB, past any cache), the fastest of `reps` whole steps; cache-hot times each shape alone on the
    same tensors, the fastest of 6 * reps calls (an upper bound a decode cannot reach). A weight's
    matmul is timed three ways (x @ W^T, W @ x^T, and on oneDNN's copy of W packed for `rows`
    rows, as the hf engine runs it on a CPU), the fastest counted."""
    d, i = shape["hidden_size"], shape["intermediate_size"]
    hd = shape.get("head_dim") or d // shape["num_attention_heads"]
    heads, kvh = shape["num_attention_heads"], shape["num_key_value_heads"]
    q, kv, layers = heads * hd, kvh * hd, shape["num_hidden_layers"]
    x = {n: torch.randn(rows, n) for n in {d, i, q}}
    attn = lambda: (torch.randn(rows, kvh, heads // kvh, hd), torch.randn(rows, kvh, context, hd))
    calls = [("linear", (x[inp], torch.randn(out, inp)), 2 * rows * inp * out)
             for _ in range(layers) for out, inp in ((q, d), (kv, d), (kv, d), (d, q), (i, d),
                                                     (i, d), (d, i))]
    calls += [("attention", (a, b.transpose(-1, -2)), 2 * rows * heads * hd * context)
              for a, b in (attn() for _ in range(2 * layers))]  # scores, then values (same FLOPs)
    calls.append(("linear", (x[d], torch.randn(shape["vocab_size"], d)),
                  2 * rows * d * shape["vocab_size"]))
    # a weight's matmul three ways, the fastest kept (the hf engine's: packed, on a CPU)
    packed = modeling.pack_weights([args[1] for kind, args, _ in calls if kind == "linear"], rows)
    ways = [{"linear": torch.nn.functional.linear, "attention": torch.matmul},
            {"linear": lambda x, w: torch.mm(w, x.t()), "attention": torch.matmul},
            {"linear": lambda x, w: modeling.linear(x, w, None, packed), "attention": torch.matmul}]
    work, streamed, hot, seen = sum(c[2] for c in calls), float("inf"), 0.0, {}
    for _ in range(reps + 1):  # the first pass warms up
        for way in ways:
            t = time.perf_counter()
            for kind, args, _ in calls:
                way[kind](*args)
            streamed = min(streamed, time.perf_counter() - t)
    for kind, args, _ in calls:  # one call per distinct shape, timed alone, hot
        key = (kind, *(a.shape for a in args))
        if key not in seen:
            seen[key] = min(_timed_once(way[kind], args) for way in ways for _ in range(3 * reps))
        hot += seen[key]
    return work / streamed, work / hot


def _timed_once(fn, args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def alternate(sides: list[Side], sampler: Sampler, total: int) -> dict[str, list[dict]]:
    """`total` steps of each side, one side at a time, the order rotated every step (two sides:
    flipped)."""
    out = {s.name: [] for s in sides}
    for step in range(total):
        k = step % len(sides)
        for side in sides[k:] + sides[:k]:
            sampler.active = side
            out[side.name].append(side.ask("step"))
            sampler.active = None
            r = out[side.name][-1]
            print(f"  step {step} {side.name}: {r['step']:.2f} s (generation {r['gen']:.2f}, "
                  f"training {r['train']:.2f}), peak RSS {r['hwm'] / 2**30:.2f} GiB, positions "
                  f"trained {r['train_positions']}", file=sys.stderr, flush=True)
    return out


def spread(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


def summarize(facts: dict, steps: list[dict], peaks: dict) -> dict:
    """Per-step medians and spreads of one side, its FLOP/s against the peaks."""
    fl = lambda r, phase, grad: flops(facts["n"], facts["layers"], facts["d_attn"],
                                      r[f"{phase}_positions"], r[f"{phase}_head"],
                                      r[f"{phase}_pairs"], grad)
    train = [fl(r, "train", True) / r["train"] for r in steps]
    gen = [fl(r, "gen", False) / r["gen"] if r["gen_positions"] else float("nan") for r in steps]
    med = statistics.median
    return {"step": [r["step"] for r in steps], "gen": [r["gen"] for r in steps],
            "train": [r["train"] for r in steps],
            "other": [r["step"] - r["gen"] - r["train"] for r in steps],
            "train_flops": med(train), "gen_flops": med(gen),
            "train_share": med(train) / peaks["square"], "gen_share": med(gen) / peaks["square"],
            "gen_decode_share": med(gen) / peaks["decode"],
            "gen_hot_share": med(gen) / peaks["decode_hot"],
            "train_positions": med(r["train_positions"] for r in steps),
            "gen_positions": med(r["gen_positions"] for r in steps),
            "generated": med(r["generated"] for r in steps),
            "threads": sorted({r["threads"] for r in steps})}


def run_config(args, shape: str, tokens: int, model: Path, tmp: Path, peaks: dict) -> dict:
    """Both trainers on one (shape, answer length), alternating; their summaries."""
    total = args.warmup + args.steps
    data = make_rows(tmp / f"rows_{tokens}.jsonl", args.prompts * total, args.prompt_len,
                     SHAPES[shape]["vocab_size"])
    flags = [f"--tokens={tokens}", f"--prompts={args.prompts}", f"--group-size={args.group_size}",
             f"--prompt-len={args.prompt_len}", f"--steps={args.steps}",
             f"--warmup={args.warmup}", f"--threads={args.threads}", f"--model-dir={model}",
             f"--data={data}", f"--micro-batch-tokens={args.micro_batch_tokens}",
             f"--trl-micro-batch={args.trl_micro_batch}",
             *(f"--nano-set={s}" for s in args.nano_set)]
    # both start at once (memory is per process tree, and only the steps' is sampled)
    names = [name for name in SIDES if not (args.no_trl and name == "TRL")]
    sides = [Side(name, flags, tmp / f"{shape}_{tokens}_{name}.log", args.threads)
             for name in names]
    if args.baseline:  # the same nanoareal child, from another checkout (before/after a change)
        sides.append(Side("baseline", flags, tmp / f"{shape}_{tokens}_baseline.log",
                          args.threads, Path(args.baseline).resolve()))
    facts = {side.name: side.recv() for side in sides}
    sampler = Sampler(args.mem_interval)
    sampler.start()
    try:
        steps = alternate(sides, sampler, total)
    finally:
        sampler.stopped.set()
    out = {"peaks": peaks}
    for side in sides:
        side.ask("done")
        side.proc.wait()
        s = summarize(facts[side.name], steps[side.name][args.warmup:], peaks)
        out[side.name] = s | {"facts": facts[side.name], "forked": sampler.peak.get(side.name, 0),
                              "hwm": max(r["hwm"] for r in steps[side.name])}
    return out


def memory(r: dict) -> str:
    """GiB: the trainer process's peak resident set over the steps, plus its forked descendants'
    peak private memory when it has any."""
    gib = f"{r['hwm'] / 2**30:.2f}"
    return gib + (f" + {r['forked'] / 2**30:.2f} forked" if r["forked"] else "")


def print_config(shape: str, tokens: int, res: dict, args) -> None:
    nano = res["nanoareal"]["facts"]
    trl = ""
    if "TRL" in res:
        trl = f"TRL micro-batch {res['TRL']['facts']['micro_batch']} sequences; "
    print(f"\n### {shape}, {args.prompts} prompts x {args.group_size} samples, {args.prompt_len}"
          f"-token prompts, {tokens} new tokens\n\nnanoareal micro-batch budget "
          f"{nano['micro_batch_tokens']} tokens; {trl}"
          f"matmul weights {nano['n'][0] / 1e6:.1f} M decoder + {nano['n'][1] / 1e6:.1f} M head; "
          f"peaks: fp32 {args.peak_n}^3 matmul {res['peaks']['square'] / 1e9:.1f} GFLOP/s, "
          f"decode-step matmuls {res['peaks']['decode'] / 1e9:.1f} GFLOP/s streamed, "
          f"{res['peaks']['decode_hot'] / 1e9:.1f} cache-hot\n")
    print("| trainer | step s | generation s | training s | other s | trained positions | "
          "training GFLOP/s (of peak) | generation positions fed | generation GFLOP/s (of peak, "
          "of decode-step peak streamed, cache-hot) | peak RSS GiB, steps | start-up peak RSS "
          "GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in [k for k in res if k != "peaks"]:
        r = res[name]
        print(f"| {name} | {spread(r['step'])} | {spread(r['gen'])} | {spread(r['train'])} | "
              f"{spread(r['other'], 2)} | {r['train_positions']:.0f} | {r['train_flops'] / 1e9:.1f}"
              f" ({r['train_share']:.0%}) | {r['gen_positions']:.0f} | "
              f"{r['gen_flops'] / 1e9:.1f} ({r['gen_share']:.0%}, {r['gen_decode_share']:.0%}, "
              f"{r['gen_hot_share']:.0%}) | "
              f"{memory(r)} | {r['facts']['startup_hwm'] / 2**30:.2f} |", flush=True)


def print_summary(results: list, args, loads: list[str]) -> None:
    print(f"\n## Summary: nanoareal vs TRL {trl_version()} GRPOTrainer, fp32, CPU, "
          f"{args.threads} threads, median (min-max) of {args.steps} steps after {args.warmup}\n")
    print("| shape | new tokens | nanoareal step s (gen / train) | TRL step s (gen / train) | "
          "speedup | nanoareal peak RSS GiB | TRL peak RSS GiB | nanoareal train of peak / gen of "
          "decode-step peak | TRL train / gen of the same |")
    print("|---|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for shape, tokens, prompts, res in results:
        n, t = res["nanoareal"], res.get("TRL")
        cell = lambda r: (f"{spread(r['step'])} ({med(r['gen']):.1f} / {med(r['train']):.1f})")
        share = lambda r: f"{r['train_share']:.0%} / {r['gen_decode_share']:.0%}"
        if t is None:  # --no-trl
            print(f"| {shape} ({prompts}x{args.group_size}) | {tokens} | {cell(n)} | | | "
                  f"{memory(n)} | | {share(n)} | |")
        else:
            print(f"| {shape} ({prompts}x{args.group_size}) | {tokens} | {cell(n)} | {cell(t)} | "
                  f"{med(t['step']) / med(n['step']):.2f}x | {memory(n)} | {memory(t)} | "
                  f"{share(n)} | {share(t)} |")
        if "baseline" in res:
            b = res["baseline"]
            print(f"| ... baseline {args.baseline} | {tokens} | {cell(b)} | | "
                  f"{med(b['step']) / med(n['step']):.2f}x (baseline / nanoareal) | {memory(b)} | "
                  f"| {share(b)} | |")
    print(f"\nPeak RSS: the trainer process's VmHWM over the steps (warm-up included). Peaks "
          f"(of peak): measured just before each configuration at {args.threads} threads. Load "
          f"average (1/5/15 min) at start and end: {loads[0]} / {loads[-1]}.")


def trl_version() -> str:
    try:
        from importlib.metadata import version
        return version("trl")
    except Exception:
        return "?"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="smollm2-135m", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="32,128,512", help="new tokens per answer, comma-separated")
    p.add_argument("--prompts", type=int, default=0, help="prompts per step (default per shape: "
                   + ", ".join(f"{k} {v}" for k, v in PROMPTS.items()) + ")")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="measured steps per trainer")
    p.add_argument("--warmup", type=int, default=1, help="steps per trainer before those")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each trainer")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="nanoareal's budget (default: its Config's)")
    p.add_argument("--trl-micro-batch", type=int, default=0, help="TRL per_device_train_batch_"
                   "size (default: the most sequences that fit nanoareal's budget)")
    p.add_argument("--nano-set", action="append", default=[], metavar="FIELD=VALUE",
                   help="another nanoareal Config value, e.g. max_staleness=1 (repeatable)")
    p.add_argument("--mem-interval", type=float, default=0.5,
                   help="seconds between samples of a forked rollout process's memory")
    p.add_argument("--peak-n", type=int, default=2048, help="the square matmul of the peak")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2x2, 8+4 tokens, 1 step")
    p.add_argument("--no-trl", action="store_true",
                   help="leave TRL out: with --baseline, before/after alone (at 512 tokens three "
                        "trainers' processes do not fit in 24 GiB)")
    p.add_argument("--baseline", help="a checkout of another nanoareal commit: its nanoareal "
                   "runs as a third side, alternating with the two (before/after a change)")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.shapes, args.tokens, args.prompt_len, args.group_size = "tiny", "4", 8, 2
        args.steps, args.warmup, args.peak_n, args.mem_interval = 1, 0, 256, 0.05
    if args.child:
        args.tokens = int(args.tokens)
        (nano_child if args.child == "nanoareal" else trl_child)(args, Channel())
        return
    torch.set_num_threads(args.threads)
    loads, results, given = [Path("/proc/loadavg").read_text().split()[:3]], [], args.prompts
    with tempfile.TemporaryDirectory(prefix="bench_shapes_") as tmp:
        for shape in args.shapes.split(","):
            model = make_model(shape, Path(tmp) / shape)
            args.prompts = given or PROMPTS[shape]
            for tokens in map(int, args.tokens.split(",")):
                peaks = {"square": max(matmul_peak(torch.device("cpu"), torch.float32,
                                                   args.peak_n, 3) for _ in range(2)),
                         **dict(zip(("decode", "decode_hot"), decode_peak(
                             SHAPES[shape], args.prompts * args.group_size,
                             args.prompt_len + tokens // 2)))}
                res = run_config(args, shape, tokens, model, Path(tmp), peaks)
                print_config(shape, tokens, res, args)
                results.append((shape, tokens, args.prompts, res))
    loads.append(Path("/proc/loadavg").read_text().split()[:3])
    print_summary(results, args, [" ".join(x) for x in loads])


if __name__ == "__main__":
    main()
