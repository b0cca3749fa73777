"""Build the shipped warm-start model for nanoareal: a ~1M-parameter Llama that adds two numbers,
badly; and, trained further by the same steps, the distillation teacher for the default task.

    python scripts/make_tiny_model.py --out assets/tiny-arith
    python scripts/make_tiny_model.py --out assets/tiny-arith-teacher --max-steps 3000 \
        --stop-low 0.9 --stop-high 1.0

Steps (all local, deterministic for a given --seed on a given machine):
1. a character-level tokenizer (`tokenizers` WordLevel + per-character Split + Fuse decoder),
   wrapped in PreTrainedTokenizerFast: no special tokens are added on encode, decode concatenates
   characters;
2. a small LlamaForCausalLM (GQA: 4 query heads, 2 KV heads), float32, untied embeddings;
3. supervised warm start on the TRAIN split of `make_arithmetic_task` ("12+34=" -> "46<eos>",
   loss on the answer and <eos> only), stopped at the first held-out greedy evaluation inside
   [--stop-low, --stop-high] so that GRPO has room to improve it;
4. save_pretrained (safetensors) of model + tokenizer, and build_info.json with the measured
   accuracies.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
import time
from collections.abc import Iterator

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tasks import make_arithmetic_task  # noqa: E402

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARS = list("0123456789+= -*")  # the task needs "0-9+="; the rest are harmless extras

# -----------------------------------------------------------------------------
# tokenizer


def build_tokenizer(chars: list[str] = CHARS) -> PreTrainedTokenizerFast:
    """One token per character of `chars`; specials first so <pad>=0, <eos>=1, <unk>=2."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # every char is a piece
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()  # join pieces with "" (the default would insert spaces)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=64,
    )
    return tok


# -----------------------------------------------------------------------------
# greedy generation (exact, no padding: prompts are batched by token length)


@torch.no_grad()
def greedy_complete(
    model: LlamaForCausalLM,
    tok: PreTrainedTokenizerFast,
    prompts: list[str],
    max_new_tokens: int = 8,
    batch_size: int = 512,
    kv_cache: bool = False,
) -> list[str]:
    """Greedy completions (decoded, special tokens skipped, stripped), stopping at eos.

    Prompts of equal token length share a batch, so no padding, attention mask or position_ids
    are needed and every row is computed exactly as it would be alone (up to batched-matmul
    rounding). Without `kv_cache` every step recomputes the whole prefix (version-proof, fine for
    the arithmetic task's <= 3 new tokens); with it each step feeds only the new token (for long
    responses: ~10x faster at 19 new tokens; the same argmax up to rounding in the last bits).
    """
    eos = tok.eos_token_id
    # transformers 5.2x renamed the forward's `past_key_values` to `cache`; accept both
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    encoded = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    by_len: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_len.setdefault(len(ids), []).append(i)
    out = [""] * len(prompts)
    for idxs_all in by_len.values():
        for start in range(0, len(idxs_all), batch_size):
            idxs = idxs_all[start : start + batch_size]
            seq = torch.tensor([encoded[i] for i in idxs], dtype=torch.long)
            done = torch.zeros(len(idxs), dtype=torch.bool)
            new: list[torch.Tensor] = []
            cache, feed = DynamicCache() if kv_cache else None, seq
            for _ in range(max_new_tokens):
                if kv_cache:  # the cache fills in place
                    res = model(input_ids=feed, use_cache=True, **{cache_kw: cache})
                else:
                    res = model(input_ids=seq, use_cache=False)
                nxt = res.logits[:, -1].argmax(-1)
                # finished rows keep emitting eos
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                new.append(nxt)
                done |= nxt == eos
                if bool(done.all()):
                    break
                seq, feed = torch.cat([seq, nxt[:, None]], 1), nxt[:, None]
            gen = torch.stack(new, 1).tolist()
            for row, i in zip(gen, idxs, strict=True):
                ids = row[: row.index(eos)] if eos in row else row
                out[i] = tok.decode(ids, skip_special_tokens=True).strip()
    return out


def accuracy(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, items: list[dict]) -> float:
    completions = greedy_complete(model, tok, [it["prompt"] for it in items])
    return sum(c == it["answer"] for c, it in zip(completions, items, strict=True)) / len(items)


# -----------------------------------------------------------------------------
# SFT data


def sft_batch(tok: PreTrainedTokenizerFast, items: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded "prompt+answer<eos>" rows; labels are -100 on prompt and padding."""
    rows, labels = [], []
    for it in items:
        p = tok(it["prompt"], add_special_tokens=False)["input_ids"]
        a = tok(it["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    label_t = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_t}


# -----------------------------------------------------------------------------
# model: built and saved the same way for every shipped warm start (make_chain_model.py too)


def build_model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A ~1M-parameter LlamaForCausalLM for `tok`'s vocabulary: hidden 128, 4 layers, 4 query /
    2 KV heads (GQA), untied embeddings, float32, no bos; initialised from torch's global RNG."""
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config).float()


def save_model(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: str) -> None:
    """save_pretrained (safetensors) of model and tokenizer into `out`; generation stops at
    <eos>."""
    os.makedirs(out, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # transformers 5 writes "TokenizersBackend", which 4.x cannot resolve; both load
    # PreTrainedTokenizerFast
    cfg_path = os.path.join(out, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
        f.write("\n")


# -----------------------------------------------------------------------------
# main


def sft_loop(model, train: list[dict], args, make_batch) -> Iterator[float]:
    """AdamW (betas 0.9/0.95, linear warm-up, grad clip 1) on shuffled batches of `train`; yields
    each step's loss after its update. Batch order comes from torch.Generator(seed);
    make_batch(rows, rng) builds a batch, drawing each row's format from rng = random.Random(seed +
    12345), so steps are a function of (seed, train) alone. The chain and calc builders use it."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    gen = torch.Generator().manual_seed(args.seed)
    fmt_rng = random.Random(args.seed + 12345)
    order: list[int] = []
    while True:
        model.train()
        if len(order) < args.batch_size:  # reshuffle each epoch; drop the ragged tail
            order = torch.randperm(len(train), generator=gen).tolist()
        idx, order = order[: args.batch_size], order[args.batch_size :]
        loss = model(**make_batch([train[i] for i in idx], fmt_rng), use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        yield loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-arith")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=0, help="seed of make_arithmetic_task's split")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--stop-low", type=float, default=0.25,
                    help="stop at the first eval in [low, high]")
    ap.add_argument("--stop-high", type=float, default=0.45)
    args = ap.parse_args()
    defaults = vars(ap.parse_args(["--out", args.out]))
    given = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v != defaults[k]]

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train, heldout = make_arithmetic_task(seed=args.task_seed)
    tok = build_tokenizer()

    model = build_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}  params {n_params:,}")

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    gen = torch.Generator().manual_seed(args.seed)
    order: list[int] = []
    trajectory: list[dict] = []
    t0 = time.perf_counter()
    step, acc, stopped = 0, 0.0, False
    while step < args.max_steps:
        model.train()
        if len(order) < args.batch_size:  # reshuffle each epoch; drop the ragged tail
            order = torch.randperm(len(train), generator=gen).tolist()
        idx, order = order[: args.batch_size], order[args.batch_size :]
        batch = sft_batch(tok, [train[i] for i in idx])
        loss = model(**batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % args.eval_every == 0:
            model.eval()
            acc = accuracy(model, tok, heldout)
            elapsed = time.perf_counter() - t0
            trajectory.append({"step": step, "loss": round(loss.item(), 4), "heldout_acc": acc})
            print(f"step {step:4d}  loss {loss.item():.4f}  heldout {acc:.3f}  ({elapsed:.1f}s)",
                  flush=True)
            if args.stop_low <= acc <= args.stop_high:
                stopped = True
                break
            if acc > args.stop_high:
                raise SystemExit(f"overshot: heldout {acc:.3f} > {args.stop_high}; lower --lr")
    if not stopped:
        raise SystemExit(f"did not reach heldout >= {args.stop_low} in {args.max_steps} steps")
    sft_seconds = time.perf_counter() - t0

    model.eval()
    train_acc = accuracy(model, tok, train)
    print(f"final: step {step}  heldout {acc:.3f}  train {train_acc:.3f}  sft {sft_seconds:.1f}s")

    save_model(model, tok, args.out)
    info = {
        "command": " ".join(["python scripts/make_tiny_model.py --out", args.out, *given]),
        "args": vars(args),
        "torch": torch.__version__,
        "vocab": tok.get_vocab(),
        "n_params": n_params,
        "sft_steps": step,
        "sft_seconds": round(sft_seconds, 1),
        "heldout_acc": acc,
        "train_acc": train_acc,
        "trajectory": trajectory,
    }
    with open(os.path.join(args.out, "build_info.json"), "w") as f:
        json.dump(info, f, indent=1, sort_keys=False)
        f.write("\n")
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(
            f"# {os.path.basename(os.path.normpath(args.out))}: "
            + ("nanoareal's warm-start model" if not given else
               "the warm start trained further (the default task's distillation teacher)")
            + "\n\n"
            f"Built by `{info['command']}` (torch {torch.__version__}); details in "
            "build_info.json.\n\n"
            f"LlamaForCausalLM, {n_params:,} parameters (hidden 128, 4 layers, 4 heads / 2 KV "
            f"heads), float32; character tokenizer, <pad>={tok.pad_token_id}, "
            f"<eos>={tok.eos_token_id}, no bos.\n"
            f"SFT on the train split of `make_arithmetic_task()` for {step} steps of batch "
            f"{args.batch_size}, stopped inside the held-out band [{args.stop_low}, "
            f"{args.stop_high}].\n\n"
            f"Greedy exact match: held-out {acc:.3f}, train {train_acc:.3f}. Prompt `12+34=` "
            "without special tokens; the answer ends with <eos>.\n"
        )


if __name__ == "__main__":
    main()
