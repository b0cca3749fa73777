"""nanoareal vs TRL GRPOTrainer: end-to-end GRPO step time, tokens/s, training-only time and
padding fraction.

    python bench/bench_vs_trl.py        # the default CPU task: 64 prompts x 8 samples, 8 new tokens
    python bench/bench_vs_trl.py --steps 2 --warmup 1 --prompts-per-step 8   # smoke run

Same model (assets/tiny-arith), same prompts per step (nanoareal's `prompts_for_step`, fed to TRL
in that order with shuffling off), same group size / max new tokens / temperature 1 / top-p 1,
equivalent loss (nanoareal `token_mean` PPO-clip = TRL `loss_type="dapo"`, eps 0.2, beta 0: no
reference model), scale by group std, one optimizer step (AdamW, clip 1.0, constant lr) per
generation batch, fp32, CPU, one thread. The two run alternately in one process: a TRL callback
runs one nanoareal step after each TRL optimizer step, and each side's clock excludes the other.

What is timed:
- e2e step: nanoareal = `NanoRun.step` (rollout on the HF engine, reward, advantages,
  train_on_samples, weight copy to the engine, metrics); TRL = the interval between consecutive
  `on_step_end` callbacks minus nothing else (data loading, `model.generate`, reward, advantages,
  padding, forward/backward of every micro-batch, clip, AdamW, scheduler, TRL's own logging).
- train only, identical rollouts: one rollout batch from nanoareal's engine, given to both.
  nanoareal = `train_on_samples` (packing, LossReduction, forward/backward, clip, AdamW); TRL =
  its real `training_step` (forward with entropy, dapo loss, backward) on each buffered
  micro-batch + `_clip_grad_norm` + optimizer + scheduler + zero_grad. TRL's padding/tensor
  building happens before (not timed), nanoareal's packing is timed.
- tokens/s = (generated tokens + real prompt+completion tokens trained) / step time, the same
  definition for both.
- padding = share of the positions the decoder computes in training forwards that are padding
  (pad tokens of TRL's left-padded prompts and right-padded completions; nanoareal packs
  sequences back to back).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from common import (  # noqa: I001
    N,
    NanoRun,
    PositionCounter,
    fix_threads,
    fmt_spread,
    make_config,
    summarize,
    tasks,
)
from transformers import TrainerCallback


def build_trl(args, nano: NanoRun, total_steps: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    cfg = nano.cfg
    rows = [nano.data.rows[g] for s in range(total_steps) for g in nano.prompts(s)]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def exact_match(completions, answer, **kw):
        return [tasks.exact_match(c, {"answer": a}) for c, a in zip(completions, answer)]

    n = cfg.prompts_per_step * cfg.group_size
    if n % args.trl_micro_batch:
        raise SystemExit(f"--trl-micro-batch {args.trl_micro_batch} must divide {n}")
    accum = n // args.trl_micro_batch
    tcfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"), report_to="none", save_strategy="no",
        disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=accum, steps_per_generation=accum,
        num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=1.0, top_k=0, use_vllm=False, beta=0.0,
        loss_type="dapo", epsilon=cfg.eps_low, epsilon_high=cfg.eps_high, scale_rewards="group",
        num_iterations=1, learning_rate=cfg.lr, adam_beta1=N.ADAM_BETAS[0],
        adam_beta2=N.ADAM_BETAS[1], weight_decay=N.WEIGHT_DECAY, max_grad_norm=cfg.grad_clip,
        lr_scheduler_type="constant",
        warmup_steps=0, max_steps=total_steps, shuffle_dataset=False, seed=cfg.seed,
        logging_steps=10, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=tcfg, train_dataset=dataset,
                          processing_class=nano.data.tokenizer)
    return trainer


class Alternate(TrainerCallback):
    """Time each TRL optimizer step, then run (and time) one nanoareal step."""

    def __init__(self, nano: NanoRun, trl_counter: PositionCounter, nano_counter: PositionCounter):
        self.nano, self.trl_counter, self.nano_counter = nano, trl_counter, nano_counter
        self.trl, self.nanos = [], []
        self.mark = self.cpu_mark = None
        self.gen_lens = []  # TRL completion lengths of the current step

    def on_train_begin(self, args, state, control, **kw):
        self.mark, self.cpu_mark = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kw):
        t, cpu = time.perf_counter() - self.mark, time.process_time() - self.cpu_mark
        prompts = self.nano.prompts(state.global_step - 1)
        prompt_tokens = sum(len(self.nano.data.prompts[g]) for g in prompts) * \
            self.nano.cfg.group_size
        gen = sum(self.gen_lens)
        self.trl.append({"time": t, "cpu": cpu, "generated": gen, "real": gen + prompt_tokens,
                         "computed": self.trl_counter.computed,
                         "masked_real": self.trl_counter.masked_real})
        self.trl_counter.reset()
        self.gen_lens = []
        fix_threads(1)
        self.nano_counter.reset()
        cpu0 = time.process_time()
        m = self.nano.step(state.global_step - 1)
        self.nanos.append({"time": m["time/step"], "cpu": time.process_time() - cpu0,
                           "generated": m["generated_tokens"], "real": m["real_tokens"],
                           "computed": self.nano_counter.computed, "rollout": m["time/rollout"],
                           "train": m["time/train"], "sync": m["time/sync"]})
        fix_threads(1)
        self.mark, self.cpu_mark = time.perf_counter(), time.process_time()


def wrap_generate(trainer, alt: Alternate):
    inner = trainer._generate

    def generate(prompts):
        out = inner(prompts)
        alt.gen_lens += [len(c) for c in out[1]]
        return out

    trainer._generate = generate


def train_only(args, nano: NanoRun, trainer, step: int) -> tuple[list[float], list[float]]:
    """Both trainers on one identical rollout batch, alternately, `warmup + steps` times each."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    samples = nano.rollout(step)
    prompts = {s.group: nano.data.prompts[s.row] for s in samples}
    by_order = list(samples)

    def rollout_func(prompts_text, trainer_):
        return {"prompt_ids": [s.prompt_ids for s in by_order],
                "completion_ids": [s.completion.output_ids
                for s in by_order], "logprobs": [s.completion.logprobs for s in by_order]}

    assert all(p == prompts[s.group] for s, p in zip(samples, [s.prompt_ids for s in samples]))
    batch = [{"prompt": nano.data.rows[s.row]["prompt"],
              "answer": nano.data.rows[s.row]["answer"]}
             for s in samples]
    trainer.rollout_func = rollout_func
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(batch)
    trainer.rollout_func = None
    micro = split_tensor_dict(shuffle_sequence_dict(inputs), trainer.args.steps_per_generation)
    model = trainer.model_wrapped
    prepare = trainer._prepare_inputs
    # the batch is already generated: training_step must not regenerate
    trainer._prepare_inputs = lambda x: x

    def trl_train():
        for mb in micro:
            trainer.training_step(model, mb, None)
        trainer._clip_grad_norm(model)
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
        model.zero_grad()

    nano_t, trl_t, nano_c, trl_c = [], [], [], []
    for _ in range(args.warmup + args.steps):
        fix_threads(1)
        t0, c0 = time.perf_counter(), time.process_time()
        nano.train(samples)
        t1, c1 = time.perf_counter(), time.process_time()
        trl_train()
        t2, c2 = time.perf_counter(), time.process_time()
        nano_t.append(t1 - t0)
        trl_t.append(t2 - t1)
        nano_c.append(c1 - c0)
        trl_c.append(c2 - c1)
    trainer._prepare_inputs = prepare
    w = args.warmup
    return nano_t[w:], trl_t[w:], nano_c[w:], trl_c[w:]


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=7, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="nanoareal budget (default: its Config)")
    p.add_argument("--trl-micro-batch", type=int, default=64,
                   help="TRL per_device_train_batch_size (sequences)")
    p.add_argument("--skip-train-only", action="store_true")
    args = p.parse_args()
    fix_threads(1)

    over = dict(prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                max_new_tokens=args.max_new_tokens, loss_aggregation="token_mean",
                policy_loss="ppo", warmup_steps=0, eval_every=0)
    if args.micro_batch_tokens:
        over["micro_batch_tokens"] = args.micro_batch_tokens
    total = args.warmup + args.steps
    nano = NanoRun(make_config(**over))
    trainer = build_trl(args, nano, total)
    fix_threads(1)
    alt = Alternate(nano, PositionCounter(trainer.model.model),
                    PositionCounter(nano.model.module.model))
    trainer.add_callback(alt)
    wrap_generate(trainer, alt)
    trainer.train()

    trl, nan = alt.trl[args.warmup:], alt.nanos[args.warmup:]
    tput = lambda rows: [(r["generated"] + r["real"]) / r["time"] for r in rows]
    med_n, med_t = summarize([r["time"] for r in nan])[0], summarize([r["time"] for r in trl])[0]
    pad = lambda rows, real: 1 - sum(map(real, rows)) / max(sum(r["computed"] for r in rows), 1)
    # nanoareal feeds each sequence but its last token (which predicts nothing) and a group's prompt
    # once per micro-batch, so its computed positions are at most the samples' prompt+completion
    # tokens: beyond that is padding
    pad_n = pad(nan, lambda r: min(r["real"], r["computed"]))
    pad_t = pad(trl, lambda r: r["masked_real"])

    cfg = nano.cfg
    print(f"\n## nanoareal vs TRL {__import__('trl').__version__} GRPOTrainer: "
          f"{cfg.prompts_per_step} prompts x {cfg.group_size} samples, <= {cfg.max_new_tokens} "
          f"new tokens, CPU, {torch.get_num_threads()} thread, median (min-max) of {args.steps} "
          f"steps after {args.warmup} warm-up\n")
    print("| | nanoareal | TRL | nanoareal speedup |")
    print("|---|---|---|---|")
    print(f"| e2e step time (s) | {fmt_spread([r['time'] for r in nan])} | "
          f"{fmt_spread([r['time'] for r in trl])} | {med_t / med_n:.2f}x |")
    cn, ct = [r["cpu"] for r in nan], [r["cpu"] for r in trl]
    print(f"| e2e step CPU time (s) | {fmt_spread(cn)} | {fmt_spread(ct)} "
          f"| {summarize(ct)[0] / summarize(cn)[0]:.2f}x |")
    tn, tt = tput(nan), tput(trl)
    print(f"| generated + trained tokens/s | {fmt_spread(tn, digits=0)} | "
          f"{fmt_spread(tt, digits=0)} | {summarize(tn)[0] / summarize(tt)[0]:.2f}x |")
    print(f"| generated tokens / step | {summarize([r['generated'] for r in nan])[0]:.0f} | "
          f"{summarize([r['generated'] for r in trl])[0]:.0f} | |")
    print(f"| nanoareal rollout / train / sync (s) | {fmt_spread([r['rollout'] for r in nan])} / "
          f"{fmt_spread([r['train'] for r in nan])} / {fmt_spread([r['sync'] for r in nan])} | | |")
    if not args.skip_train_only:
        n_t, t_t, n_c, t_c = train_only(args, nano, trainer, total)
        print(f"| train only, identical rollouts (s) | {fmt_spread(n_t)} | {fmt_spread(t_t)} "
              f"| {summarize(t_t)[0] / summarize(n_t)[0]:.2f}x |")
        print(f"| train only, CPU time (s) | {fmt_spread(n_c)} | {fmt_spread(t_c)} "
              f"| {summarize(t_c)[0] / summarize(n_c)[0]:.2f}x |")
    print(f"| padding share of training-forward positions | {100 * pad_n:.1f}% | "
          f"{100 * pad_t:.1f}% | |")
    print(f"| training-forward positions / step | {summarize([r['computed'] for r in nan])[0]:.0f} "
          f"| {summarize([r['computed'] for r in trl])[0]:.0f} | |")
    print(f"\nnanoareal micro-batch budget {cfg.micro_batch_tokens} tokens (packed); TRL "
          f"micro-batch {args.trl_micro_batch} sequences x "
          f"{trainer.args.gradient_accumulation_steps} accumulation steps, gradient checkpointing "
          "off.")


if __name__ == "__main__":
    main()
