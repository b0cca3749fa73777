"""Built-in tasks (generated, never downloaded), JSONL datasets and rewards. A row is a dict with
"prompt" (a string) or "messages" (a chat), plus what the reward reads ("answer" for the built-in
ones). A reward (`--reward path/to/file.py:fn`) is any `fn(completion: str, row: dict) -> float |
tuple[float, dict[str, float]]` given the WHOLE row; each metric's mean is logged as reward/<name>;
its "correct" (a bool) defines accuracy, else equality with the row's "answer" (stripped): a shaped
reward never changes what accuracy means. `--reward "exact_match,0.1*format"` sums weighted rewards,
each logged too. A reward's `random` and numpy are seeded by its sample's (seed, step, slot, k)."""

import inspect
import json
import logging
import math
import queue
import random
import re
import sys
import threading
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from fractions import Fraction
from importlib.util import module_from_spec, spec_from_file_location
from itertools import product
from pathlib import Path

from cli import UserError, why
from logs import print0, quiet_libraries, reduce_metrics
from rollout import SamplingParams, Tools, is_url, mix_seed, run_episodes

# eval samples' seeds: the same noise at every eval, so only the policy moves
EVAL_SEED = 0xE7A1
_NUMBER = re.compile(r"-?[\d,]*\.?\d+(?:/\d+)?")  # 1,234 | -3.5 | .5 | 3/4
_INTEGER = re.compile(r"-?\d+")
# DAPO's (and verl's default) penalty at --max-new-tokens, in reward units
OVERLONG_FACTOR = 1.0
# SGLang 0.5.10-0.5.23 serves prompt + max_new_tokens <= context - 2 whole (beyond, it refuses the
# batch or caps the request) and prompts <= context - 7 (its scheduler aborts longer ones)
SGLANG_CONTEXT_MARGIN, SGLANG_PROMPT_MARGIN = 2, 7
PROBE_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "XQZ7"}]
MAX_TURNS = 4  # an --env's policy turns per episode, unless its class says (max_turns)
REWARD_TIMEOUT_S = 30.0  # a reward call that takes longer scores 0 and is counted


# -----------------------------------------------------------------------------
# built-in rewards
def exact_match(completion: str, row: dict) -> float:
    """1 if the stripped completion equals the row's "answer", else 0."""
    return float(completion.strip() == str(row["answer"]).strip())


def answer_span(text: str) -> str | None:
    """What a text marks as its final answer, whichever mark comes last: the inside of its last
    \\boxed{...} (nested braces kept) or the first line after its last '####'; else None."""
    box, mark = text.rfind("\\boxed{"), text.rfind("####")
    if box < 0 and mark < 0:
        return None
    if mark > box:  # the '####' comes last
        return (text[mark + 4 :].strip().splitlines() or [""])[0]
    depth, start = 0, box + len("\\boxed{")
    for i, c in enumerate(text[start:], start):
        depth += (c == "{") - (c == "}")
        if depth < 0:
            return text[start:i]
    return text[start:]  # a box cut off by --max-new-tokens: what there is


def final_number(text: str) -> str | None:
    """The first number in answer_span(text), else the last; commas dropped, \\frac{a}{b} = a/b."""
    span = answer_span(text)
    nums = _NUMBER.findall(
        re.sub(
            r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", text if span is None else span
        ).replace("{,}", ",")
    )
    return nums[-1 if span is None else 0].replace(",", "") if nums else None


def gsm8k(completion: str, row: dict) -> tuple[float, dict]:
    """GSM8K: 1 (correct) if completion and answer have equal final_numbers (18.00 = 18 = 36/2)."""
    try:
        got, want = (
            Fraction(final_number(t) or "nan") for t in (completion, str(row["answer"]))
        )
        ok = abs(got - want) < 1e-6
    except (ValueError, ZeroDivisionError):  # no number, or x/0
        ok = False
    return float(ok), {"correct": ok}


def math_reward(completion: str, row: dict) -> tuple[float, dict]:
    """HF math-verify: the completion's final answer (its last \\boxed{} or '#### x', else the last
    LaTeX or number it writes) equals the row's "answer" (a number, '... #### 72' or LaTeX, with or
    without $) as mathematics: \\frac{3}{4} = 0.75, 1,234 = 1234, \\$18.00 = 18, units dropped."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    # math-verify's own timeouts use SIGALRM, main thread only: compute_rewards times the call
    read = lambda text: parse(text, config, parsing_timeout=None)
    want = str(row["answer"]).rsplit("####", 1)[-1].strip()
    latex = re.search(r"\$|\\\(|\\\[|\\boxed", want)
    gold = read(want if latex else f"${want}$") or read(want)
    # only the last mark: math-verify's own \boxed regex reads from the FIRST box outside $...$
    span = answer_span(completion)
    if span is not None and completion.rfind("\\boxed{") > completion.rfind("####"):
        span = f"\\boxed{{{span}}}"
    got = read(completion if span is None else span)
    ok = bool(gold and got) and verify(gold, got, timeout_seconds=None)
    return float(ok), {"correct": ok}


def last_number(completion: str, row: dict) -> tuple[float, dict]:
    """1 if the completion's last integer equals the row's integer "answer", else 0: whatever comes
    before is free (work shown or not); "scratchpad" is 1 when it holds more than one integer."""
    found, want = _INTEGER.findall(completion), str(row["answer"]).strip()
    ok = bool(found) and _INTEGER.fullmatch(want) is not None and int(found[-1]) == int(want)
    return float(ok), {"correct": ok, "scratchpad": float(len(found) > 1)}


def answer_format(completion: str, row: dict) -> float:
    """1 if an answer can be read off the completion: a '####' or \\boxed{} mark, or a number at
    its end; else 0 (a shaping term: weigh it next to an accuracy reward)."""
    return float(
        answer_span(completion) is not None or bool(re.search(r"\d\s*$", completion))
    )


def length(completion: str, row: dict) -> float:
    """The completion's length in characters (a shaping term: weigh it negative for brevity)."""
    return float(len(completion))


def soft_overlong_penalty(n_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment of an n-token response: 0 up to max - buffer tokens, then
    linearly down to -OVERLONG_FACTOR at max: -F min(1, max(0, n - (max - buffer)) / buffer)."""
    return -OVERLONG_FACTOR * min(1.0, max(0, n_tokens - (max_tokens - buffer)) / buffer)


REWARDS = {  # the first four read row["answer"]
    "exact_match": exact_match,
    "gsm8k": gsm8k,
    "last_number": last_number,
    "math": math_reward,
    "format": answer_format,
    "length": length,
}


# -----------------------------------------------------------------------------
# built-in tasks: name -> (train rows, held-out rows, default reward)
# each built-in task's held-out rows (its tiny model's README reports on them)
HELDOUT_SIZE = 256


def make_arithmetic_task(seed: int = 0) -> tuple[list, list]:
    """All sums a+b with 0 <= a, b < 50 as {"prompt": "12+34=", "answer": "46"}, split by `seed`
    alone into (train, heldout): the SFT warm start, every run and test share a held-out."""
    return make_operations_task("+", range(50), seed)


def make_operations_task(ops: str, numbers: range, seed: int) -> tuple[list, list]:
    """Every "a<op>b=" with its value, for op in `ops` and a, b in `numbers` (in that order),
    shuffled by `seed`: (train, the first HELDOUT_SIZE held out)."""
    rows = [
        {"prompt": f"{a}{op}{b}=", "answer": str(a + b if op == "+" else a * b)}
        for op in ops
        for a in numbers
        for b in numbers
    ]
    random.Random(seed).shuffle(rows)
    return rows[HELDOUT_SIZE:], rows[:HELDOUT_SIZE]


# the chain task's operations; no "*0": it would reset the chain, making every earlier step moot
CHAIN_OPS = [f"+{d}" for d in range(10)] + [f"*{d}" for d in range(1, 10)]
CHAIN_MAX_OPS = 8
# bodies padded to the longest: a scratchpad's j-th value is a fixed distance after the j-th operand
CHAIN_WIDTH = 2 * CHAIN_MAX_OPS + 1
CHAIN_PER_LENGTH = 2500  # the most distinct bodies of k operations


def chain_values(prompt: str) -> list[int]:
    """The running values mod 10 of a chain prompt or body, left to right: "3+4*2" -> [3, 7, 4]."""
    body = prompt.rstrip("=").rstrip()
    values = [int(body[0])]
    for op, d in zip(body[1::2], body[2::2]):
        value = values[-1] + int(d) if op == "+" else values[-1] * int(d)
        values.append(value % 10)
    return values


def chain_scratchpad(prompt: str) -> str:
    """The worked response: every running value, space-separated ("3 7 4"), k + 1 numbers."""
    return " ".join(map(str, chain_values(prompt)))


def make_chain_task(seed: int = 0) -> tuple[list, list]:
    """Chains of k = 1..8 operations (+d or *d, mod 10) on a start digit, split by `seed` into
    (train, heldout), rows like {"prompt": "3+4*2            =", "answer": "4"} (bodies padded to
    CHAIN_WIDTH). Per k, min(CHAIN_PER_LENGTH, 10 * 19^k) >= 190 distinct bodies, HELDOUT_SIZE / 8
    = 32 held out, interleaved k = 1..8, 1..8, ...; the rest, shuffled, is train (docs/studies.md:
    the task)."""
    per_k, rng, train, held_by_k = HELDOUT_SIZE // CHAIN_MAX_OPS, random.Random(seed), [], []
    for k in range(1, CHAIN_MAX_OPS + 1):
        space = 10 * len(CHAIN_OPS) ** k
        # small: enumerate and shuffle (rejection would crawl)
        if space <= 4 * CHAIN_PER_LENGTH:
            bodies = ["".join(b) for b in product("0123456789", *[CHAIN_OPS] * k)]
            rng.shuffle(bodies)
        else:  # large: draw CHAIN_PER_LENGTH distinct (a dict keeps the order of first draws)
            bodies = {}
            while len(bodies) < CHAIN_PER_LENGTH:
                digit = str(rng.randrange(10))  # then the ops: the draws of the shipped split
                bodies[digit + "".join(rng.choice(CHAIN_OPS) for _ in range(k))] = None
        # the first min(CHAIN_PER_LENGTH, space) (the dict holds exactly that many)
        rows = [
            {"prompt": b.ljust(CHAIN_WIDTH) + "=", "answer": str(chain_values(b)[-1])}
            for b in list(bodies)[:CHAIN_PER_LENGTH]
        ]
        held_by_k.append(rows[:per_k])
        train += rows[per_k:]
    random.Random(seed + 1).shuffle(train)
    return train, [row for group in zip(*held_by_k) for row in group]


def make_calc_task(seed: int = 0) -> tuple[list, list]:
    """Every a+b and a*b with 10 <= a, b < 100 as {"prompt": "37*48=", "answer": "1776"}, split by
    `seed` into (train, heldout). Products are beyond a 1M model's head; with --env
    assets/tiny-calc/calculator.py:Calculator it may write "[37*48]" and read the value."""
    return make_operations_task("+*", range(10, 100), seed)


@dataclass(frozen=True)
class Task:
    make: Callable[[], tuple[list, list]]
    reward: str
    flags: dict  # its warm start and recommended flags, applied unless the user gives them


TASKS = {
    "arithmetic": Task(make_arithmetic_task, "exact_match", dict(model="assets/tiny-arith")),
    "chain": Task(
        make_chain_task,
        "last_number",
        dict(model="assets/tiny-chain", max_new_tokens=32, prompts_per_step=32),
    ),
    "calc": Task(
        make_calc_task, "last_number", dict(model="assets/tiny-calc", max_new_tokens=16)
    ),
}


# -----------------------------------------------------------------------------
# datasets
def load_jsonl(path: str, prompt_key: str, reward: str) -> list[dict]:
    """Rows of {prompt_key: str} or {"messages": [{"role", "content"}, ...]}, other fields kept;
    each with an "answer" for a built-in `reward`."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file (expected JSON lines)") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        chat = isinstance(row.get("messages"), list)
        if isinstance(row.get(prompt_key), str) == chat:
            raise UserError(
                f'{path}:{n}: needs exactly one of "{prompt_key}" (string; '
                '--prompt-key names the field) or "messages" (list); it has '
                + (", ".join(map(json.dumps, row)) or "no fields")
            )
        if chat and not row["messages"]:
            raise UserError(f'{path}:{n}: "messages" is empty')
        if chat and not all(
            isinstance(m, dict) and {"role", "content"} <= m.keys() for m in row["messages"]
        ):
            raise UserError(f'{path}:{n}: every message needs "role" and "content"')
        if "answer" in row and not isinstance(row["answer"], (str, int, float)):
            raise UserError(f'{path}:{n}: "answer" must be a string or a number')
        if "answer" not in row and reward in REWARDS:
            raise UserError(
                f'{path}: row {n} has no "answer", which --reward {reward} compares with'
            )
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no rows")
    return rows


def load_dataset(
    dataset: str, eval_dataset: str | None, reward: str, prompt_key: str
) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows) of a built-in task or of JSONL files."""
    if dataset in TASKS:
        if prompt_key != "prompt":
            raise UserError(
                f"--prompt-key {prompt_key} is for a JSONL --dataset: the built-in "
                f'task {dataset!r} has "prompt" rows'
            )
        return TASKS[dataset].make()
    train = load_jsonl(dataset, prompt_key, reward)
    return train, load_jsonl(eval_dataset, prompt_key, reward) if eval_dataset else []


def adds_bos(tokenizer) -> bool:
    """Whether the model wants a BOS first: its tokenizer adds one to plain text (Llama, Gemma)."""
    first = tokenizer("a")["input_ids"][:1]  # a bos_token_id of None is no id
    return (
        first
        == [tokenizer.bos_token_id]
        != tokenizer("a", add_special_tokens=False)["input_ids"][:1]
    )


def encode_prompts(
    rows: list[dict], tokenizer, chat_template: bool, name: str, prompt_key: str
) -> list[list[int]]:
    """Every row's prompt as token ids: its "messages", or its prompt field (a user turn with
    chat_template). A chat is exactly what the template writes (its BOS if any, as HF's
    apply_chat_template(tokenize=True)); plain text gets the BOS once, if the model expects one."""
    bos = tokenizer.bos_token_id if adds_bos(tokenizer) else None
    unk = tokenizer.unk_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    encoded = []
    for n, row in enumerate(rows, 1):
        chat = "messages" in row or chat_template
        if chat and not tokenizer.chat_template:
            what = "--chat-template" if chat_template else 'rows with "messages"'
            raise UserError(
                f"{name}: {what} need(s) a chat template, and the tokenizer has none; use "
                f'"{prompt_key}" rows without --chat-template, or a model with one'
            )
        text = row.get(prompt_key)
        if chat:
            msgs = row.get("messages") or [{"role": "user", "content": text}]
            text = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=False
            )
        ids = encode(text)
        if unk in ids:  # None (no unk token) is in no ids
            missing = sorted({c for c in text if unk in encode(c)})
            raise UserError(
                f"{name}: row {n}'s prompt has characters the tokenizer cannot encode "
                f"({''.join(missing)!r} would become {tokenizer.unk_token}); the model "
                "was not trained on them"
            )
        if bos is not None and not chat and ids[:1] != [bos]:
            ids = [bos] + ids
        if not ids:  # nothing to condition on: no engine can start a completion
            raise UserError(f"{name}: row {n}'s prompt is empty (it encodes to no tokens)")
        encoded.append(ids)
    return encoded


def stop_token_ids(tokenizer, model: str, chat: bool) -> list[int]:
    """Every token that ends a response, the same set for every engine: the tokenizer's eos, the
    model's own eos ids (config.json and generation_config.json: SGLang stops on those too), and
    with a chat template the token that ends an assistant turn (a base model's eos is not it)."""
    from transformers import AutoConfig, GenerationConfig

    ids = [
        tokenizer.eos_token_id,
        AutoConfig.from_pretrained(model).get_text_config().eos_token_id,
        end_of_turn_id(tokenizer) if chat else None,
    ]
    with suppress(OSError):  # no generation_config.json
        ids.append(GenerationConfig.from_pretrained(model).eos_token_id)
    flat = [i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None]
    if not flat:
        raise UserError(
            f"--model {model}: its tokenizer and configs name no end-of-sequence "
            "token, so no response could ever stop; set eos_token in its tokenizer"
        )
    return sorted(set(flat))


def end_of_turn_id(tokenizer) -> int | None:
    """The special token closing an assistant turn in the chat template (<|im_end|>...) or None."""
    try:
        text = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False)
    except Exception:  # a template that refuses this conversation: no end-of-turn to add
        return None
    after = text.rpartition("XQZ7")[2] if "XQZ7" in text else ""
    ids = tokenizer(after.lstrip(), add_special_tokens=False)["input_ids"][:1]
    # Llama 3's <|eot_id|> is a special added token missing from all_special_ids
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special | set(tokenizer.all_special_ids) else None


def context_length(model: str) -> int | None:
    """The model's trained context (max_position_embeddings or the like), from config.json."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model).get_text_config()
    names = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
    return next(
        (getattr(text, n) for n in names if isinstance(getattr(text, n, None), int)), None
    )


@dataclass
class Data:
    tokenizer: object
    rows: list[dict]  # train rows, whole: the reward sees every field
    prompts: list[list[int]]  # each train row's prompt ids
    evalset: list[tuple[dict, list[int]]]  # held-out (row, prompt ids)
    stop_ids: list[int]  # every token that ends a response, for every engine
    tools: Tools | None = None  # the --env, if any


def load_data(cfg) -> Data:
    """cfg.model's tokenizer, the rows of cfg.dataset (and cfg.eval_dataset), prompts tokenized once
    (BOS as the model expects), stop tokens, cfg.env, and no weights; or a one-line error: no
    tokenizer, prompts it cannot encode, a sequence too long."""
    from transformers import AutoTokenizer

    model, chat_template = cfg.model, cfg.chat_template
    quiet_libraries()  # transformers' progress bars and info lines off (imported from here)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except Exception as e:  # a directory without tokenizer files ends in sentencepiece advice
        raise UserError(f"--model {model}: no usable tokenizer there ({why(e)})") from None
    rows, eval_rows = load_dataset(cfg.dataset, cfg.eval_dataset, cfg.reward, cfg.prompt_key)
    prompts, eval_prompts = (
        encode_prompts(r, tokenizer, chat_template, name, cfg.prompt_key)
        for r, name in ((rows, cfg.dataset), (eval_rows, cfg.eval_dataset or ""))
    )
    stop_ids = stop_token_ids(
        tokenizer, model, chat_template or any("messages" in r for r in rows + eval_rows)
    )
    # sequences are never cut: the longest possible one must fit the model and a micro-batch
    prompt = max(map(len, prompts + eval_prompts))  # load_jsonl refuses a file of no rows
    longest, context = prompt + cfg.max_new_tokens, context_length(model) or math.inf
    if longest > context - SGLANG_CONTEXT_MARGIN:
        raise UserError(
            f"config error: the longest prompt + --max-new-tokens is {longest} tokens, "
            f"over the model's context length ({context}) less "
            f"{SGLANG_CONTEXT_MARGIN}: SGLang refuses or cuts a longer request"
        )
    if prompt > context - SGLANG_PROMPT_MARGIN:
        raise UserError(
            f"config error: the longest prompt is {prompt} tokens, over the model's "
            f"context length ({context}) less {SGLANG_PROMPT_MARGIN}: SGLang aborts "
            "a longer prompt"
        )
    if longest > (cfg.micro_batch_tokens or math.inf):
        raise UserError(
            f"config error: the longest prompt + --max-new-tokens is {longest} "
            f"tokens, over --micro-batch-tokens ({cfg.micro_batch_tokens})"
        )
    tools = load_env(cfg.env, tokenizer, chat_template)
    return Data(tokenizer, rows, prompts, list(zip(eval_rows, eval_prompts)), stop_ids, tools)


def check_teacher(teacher: str, model: str, tokenizer, temperature: float) -> None:
    """--teacher scores the policy's token ids: it must read them as the policy does (the same
    vocabulary and chat template), and an SGLang server scores at temperature 1 alone."""
    from transformers import AutoTokenizer

    if is_url(teacher):
        if temperature != 1.0:
            raise UserError(
                f"--teacher {teacher}: an SGLang server's prompt log-probs are at "
                f"temperature 1, not --temperature {temperature}"
            )
        return
    try:
        theirs = AutoTokenizer.from_pretrained(teacher)
    except Exception as e:
        raise UserError(
            f"--teacher {teacher}: no usable tokenizer there ({why(e)})"
        ) from None
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(
            f"--teacher {teacher}: its tokenizer is not --model {model}'s (another "
            "vocabulary: it cannot score the policy's token ids)"
        )
    if theirs.chat_template != tokenizer.chat_template:
        raise UserError(f"--teacher {teacher}: its chat template is not --model {model}'s")


# -----------------------------------------------------------------------------
# reward functions: built-in names or path/to/file.py:function
def load_reward(spec: str) -> Callable:
    """A built-in reward by name, or `path/to/file.py:function` loaded from that file."""
    if spec == "math":  # its optional dependency checked now, not at the first call
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise UserError(
                "--reward math needs math-verify: pip install -e '.[math]'"
            ) from None
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" etc.
    if spec in REWARDS:
        return REWARDS[spec]
    # weighted terms: "exact_match, 0.1 * format, -0.01*length"
    if "," in spec or "*" in spec:
        terms = [t.rpartition("*") for t in spec.split(",")]
        names = [name.strip() for _, _, name in terms]  # spaces around "," and "*" are layout
        try:
            # float() strips too
            weights = [float(w) if star else 1.0 for w, star, _ in terms]
        except ValueError:
            raise UserError(f"--reward {spec}: weights are numbers (0.1*format)") from None
        if not all(map(math.isfinite, weights)):  # nan or inf would poison every advantage
            raise UserError(f"--reward {spec}: weights are finite numbers (0.1*format)")
        if not all(names):
            raise UserError(
                f"--reward {spec}: a term names no reward (exact_match,0.1*format)"
            )
        return weighted_reward(weights, names)
    return load_plugin("--reward", spec, f"not a built-in reward ({', '.join(REWARDS)}) nor ")


def load_plugin(flag: str, spec: str, builtins: str = "") -> Callable:
    """`path/to/file.py:name`, a function or class, loaded from that file."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name:  # no ":" leaves path empty
        raise UserError(f"{flag} {spec}: {builtins}path/to/file.py:name")
    if not Path(path).is_file():
        raise UserError(f"{flag} {spec}: no such file {path}")
    module_name = f"nanoareal_plugin_{abs(hash(str(Path(path).resolve())))}"
    module_spec = spec_from_file_location(module_name, path)
    # picklable
    module = sys.modules[module_name] = module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(f"{flag} {spec}: importing {path} failed ({why(e)})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{flag} {spec}: {path} has no function {name!r}")
    return fn


def load_env(spec: str | None, tokenizer, chat: bool) -> Tools | None:
    """--env path/to/file.py:Name: Name(row) is an episode's env, step(turn text) -> the text to
    append or None; Name.stop its tool-call stops, token ids or one-token strings; Name.max_turns
    the most policy turns of an episode (default MAX_TURNS). A reply is raw text, or with
    --chat-template the template's tool turn where it extends the turns before.
    Stops and signatures are checked here, before a misfit fails every episode at run time."""
    if not spec:
        return None
    make = load_plugin("--env", spec)
    ids = [
        s if isinstance(s, int) else tokenizer.convert_tokens_to_ids(s)
        for s in getattr(make, "stop", None) or []
    ]
    if not ids or {None, tokenizer.unk_token_id} & set(ids):
        raise UserError(
            f"--env {spec}: its .stop must list the tool-call stops (token ids or "
            "strings of one token each)"
        )
    outside = [i for i in ids if not 0 <= i < len(tokenizer)]  # never sampled: no call, ever
    if outside:
        raise UserError(
            f"--env {spec}: stop token id {outside[0]} is outside the tokenizer's "
            f"vocabulary of {len(tokenizer)} ids"
        )
    misfit = env_misfit(make, spec.rpartition(":")[2])
    if misfit:  # said now, not as an env/errors count in every episode
        raise UserError(f"--env {spec}: {misfit}")
    max_turns = getattr(make, "max_turns", MAX_TURNS)
    if not isinstance(max_turns, int) or max_turns < 1:
        raise UserError(
            f"--env {spec}: its .max_turns must be an int >= 1, got {max_turns!r}"
        )
    pre, post = (tool_turn(tokenizer) if chat else None) or ("", "")
    if pre or post:
        how = "the chat template's tool turn"
    elif chat:
        how = "raw text (the template has no tool turn extending the turns before)"
    else:
        how = "raw text"
    print0(f"--env {spec}: replies as {how}")
    return Tools(
        make,
        ids,
        lambda text: tokenizer(f"{pre}{text}{post}", add_special_tokens=False)["input_ids"],
        tokenizer.decode,
        max_turns,
    )


def env_misfit(make: Callable, name: str) -> str | None:
    """What in make(row).step(text), as episodes call them, does not fit the signatures, or None;
    read from the signatures only: episodes build their own envs. A factory that is not a class
    is checked itself; the step of what it returns cannot be seen before an episode makes one."""
    sig = refusing_signature(make, {})
    if sig:  # a signature reads "(...)"
        fault = ": it has no __init__" if make.__init__ is object.__init__ else f", not {sig}"
        return f"{name}(row) must take the dataset row as its one argument{fault}"
    raw = inspect.getattr_static(make, "step", None)
    if not isinstance(make, type) or isinstance(raw, property):  # the instance's to say
        return None
    step = getattr(make, "step", None)
    if not callable(step):
        return (
            f"{name} has no method step(text) (the text to append, or None: the episode ends)"
        )
    # a method binds the instance first
    args = (None, "") if inspect.isfunction(raw) else ("",)
    sig = refusing_signature(step, *args)
    if sig:  # a signature reads "(...)"
        return (
            f"{name}(row).step(text) must take the turn's text as its one argument, not {sig}"
        )
    return None


def refusing_signature(fn: Callable, *args) -> str | None:
    """fn's signature if fn(*args) cannot bind to it, else None (a builtin without one too)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: trusted
        return None
    try:
        sig.bind(*args)
    except TypeError:
        return str(sig)
    return None


def tool_turn(tokenizer) -> tuple[str, str] | None:
    """The text the chat template writes before and after a tool's reply to an assistant turn, up
    to the next assistant turn, if it renders one that leaves the turns before unchanged."""
    try:
        before = tokenizer.apply_chat_template(PROBE_CHAT, tokenize=False)
        after = tokenizer.apply_chat_template(
            PROBE_CHAT + [{"role": "tool", "content": "ZQX9"}],
            add_generation_prompt=True,
            tokenize=False,
        )
    except Exception:  # a template without a tool role may refuse one
        return None
    head = before[: before.find("XQZ7") + 4]
    pre, found, post = after[len(head) :].partition("ZQX9")
    return (pre, post) if "XQZ7" in head and after.startswith(head) and found else None


def weighted_reward(weights: list[float], specs: list[str]) -> Callable:
    """sum_k w_k r_k of the rewards r_k that `specs` name, each term's value (unweighted) and
    metrics logged, reward/<name> (a file's function by its name); "correct" is the first term's
    (as if it were the reward alone)."""
    fns = [load_reward(spec) for spec in specs]
    names = [spec.rpartition(":")[2] for spec in specs]

    def reward(completion: str, row: dict) -> tuple[float, dict]:
        scores = [score_one(fn, completion, row) for fn in fns]
        metrics = {k: v for sc in scores for k, v in sc.metrics.items()}
        metrics |= {name: sc.reward for name, sc in zip(names, scores)}
        # None (no verdict) only without an "answer": score_one then leaves it None too
        metrics["correct"] = scores[0].correct
        return sum(w * sc.reward for w, sc in zip(weights, scores)), metrics

    return reward


def evaluate(
    engine,
    data: Data,
    reward_fn: Callable,
    cfg,
    rank: int,
    world: int,
) -> dict:
    """Held-out metrics (rows split across ranks, one collective): eval/accuracy of greedy answers;
    with cfg.eval_k = k > 0, k samples per prompt at cfg.temperature give eval/mean@k and
    eval/pass@j, j = 2, 4, ..., k: 1 - C(k-c, j)/C(k, j) for c of k correct (Chen et al. 2021),
    over prompts with all k judged."""
    k = cfg.eval_k

    def judge(todo: list, temperature: float, seeds: list[int]) -> list:
        """The verdicts (True, False, None: no verdict) of (row, prompt) pairs' answers."""
        if not todo:
            return []
        rows, prompts = map(list, zip(*todo))
        sampling = SamplingParams(
            cfg.max_new_tokens, temperature, stop_token_ids=data.stop_ids
        )
        outs = run_episodes(engine, prompts, sampling, seeds, data.tools, rows)
        # a reward call over 30 s scores 0
        scores = score_completions(reward_fn, data.tokenizer, outs, rows, seeds)
        return [s.correct for s in scores]

    mine = data.evalset[rank::world]
    verdicts = judge(mine, 0.0, [0] * len(mine))
    sums = Counter(
        judged=sum(v is not None for v in verdicts), correct=sum(map(bool, verdicts))
    )
    if k:
        seeds = [
            mix_seed(cfg.seed, EVAL_SEED, i, j)
            for i in range(rank, len(data.evalset), world)  # the dataset rows of `mine`
            for j in range(k)
        ]
        verdicts = judge([pair for pair in mine for _ in range(k)], cfg.temperature, seeds)
        # j = 2, 4, 8, ... below k, and k itself
        js = [j for j in range(2, k + 1) if j == k or j.bit_count() == 1]
        for i in range(0, len(verdicts), k):  # each prompt's k answers
            answers = verdicts[i : i + k]
            if None in answers:
                continue
            c = sum(answers)
            pass_at = {f"pass@{j}": 1 - math.comb(k - c, j) / math.comb(k, j) for j in js}
            sums.update({"k_judged": 1, f"mean@{k}": c / k} | pass_at)
    sums = reduce_metrics(sums)
    k_judged = max(sums.get("k_judged", 0), 1)
    at_k = {f"eval/{m}": v / k_judged for m, v in sums.items() if "@" in m}
    return {"eval/accuracy": sums["correct"] / max(sums["judged"], 1)} | at_k


@dataclass
class Score:  # its fields are a Sample's (nanoareal.score copies them over)
    reward: float
    # None: no verdict (nothing said and no "answer", or the call failed)
    correct: bool | None
    metrics: dict[str, float]
    reward_error: str | None = None  # why the call failed (it then scores 0)


def score_one(reward_fn: Callable, completion: str, row: dict) -> Score:
    """Run a reward and normalise what it returns: a float, or (float, metrics incl. "correct")."""
    out, metrics = reward_fn(completion, row), {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(
                f"a reward returns a float or (float, dict), got a tuple of {len(out)}"
            )
        out, metrics = out[0], dict(out[1])
    reward = float(out)
    if not math.isfinite(reward):
        raise ValueError(f"the reward is {reward}")
    correct = metrics.pop("correct", None)
    if correct is None and "answer" in row:
        correct = exact_match(completion, row)
    if correct is not None:
        correct = bool(correct)
    return Score(reward, correct, {k: float(v) for k, v in metrics.items()})


def score_completions(
    reward_fn: Callable,
    tokenizer,
    completions: list,
    rows: list[dict],
    seeds: list[int],
    overlong_buffer: int = 0,
    max_tokens: int = 0,
) -> list[Score]:
    """compute_rewards of completions as a reward reads them (decoded, special tokens dropped),
    plus soft_overlong_penalty with an overlong_buffer, logged as reward/overlong."""
    texts = tokenizer.batch_decode(
        [c.output_ids for c in completions], skip_special_tokens=True
    )
    scores = compute_rewards(reward_fn, texts, rows, REWARD_TIMEOUT_S, seeds)
    if overlong_buffer:
        for sc, c in zip(scores, completions):
            penalty = soft_overlong_penalty(len(c.output_ids), max_tokens, overlong_buffer)
            sc.metrics["overlong"] = penalty
            sc.reward += penalty
    return scores


def compute_rewards(
    reward_fn: Callable,
    texts: list[str],
    rows: list[dict],
    timeout: float,
    seeds: list[int],
) -> list[Score]:
    """Score every completion on a daemon worker thread, `random` (and numpy, if imported) seeded
    by its seed first; a call that raises, returns junk or takes over `timeout` s scores 0 with no
    verdict and its error. A hung call keeps its thread (threads cannot be killed; one in C
    holding the GIL stalls us): untrusted code wants a process."""

    # calls start.. in order, into its own queue
    def work(start: int, out: queue.Queue) -> None:
        for i in range(start, len(texts)):
            random.seed(seeds[i])
            if "numpy" in sys.modules:  # if a reward imported it
                sys.modules["numpy"].random.seed(seeds[i])
            try:
                out.put(score_one(reward_fn, texts[i], rows[i]))
            except Exception as e:
                out.put(Score(0.0, None, {}, f"{type(e).__name__}: {e}"))

    scores, results = [], None
    while len(scores) < len(texts):
        if results is None:  # a worker from the first unscored call on
            results = queue.Queue()
            threading.Thread(target=work, args=(len(scores), results), daemon=True).start()
        # this call hangs: it scores 0, the next calls run on a new thread
        try:
            scores.append(results.get(timeout=timeout))
        except queue.Empty:
            scores.append(Score(0.0, None, {}, f"a call took over {timeout:g}s"))
            results = None
    return scores
