"""Rewards that read what current models write (gsm8k, math), datasets as they come (GSM8K's own
files, --prompt-key), and real tokenizers' stop tokens and BOS (Qwen2.5-, Llama-3-, Gemma-like
tokenizers built here, saved with their config.json and generation_config.json)."""

from __future__ import annotations

import json
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm

import tasks
from cli import UserError

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]

# -----------------------------------------------------------------------------
# rewards: completions as Qwen2.5/Llama-3-Instruct write them

EGGS = ("Janet's ducks lay 16 eggs per day. She eats 3 for breakfast and bakes muffins with 4, so "
        "she sells 16 - 3 - 4 = 9 eggs.\nEach egg sells for $2, so she makes 9 \\times 2 = 18 "
        "dollars.\n\n")
# (completion, the row's answer, gsm8k's verdict, math's verdict; None: not that reward's job)
CASES = [
    # a \boxed{} answer wins over the numbers of a check written after it
    (EGGS + "The answer is $\\boxed{18}$.\n\nCheck: she sells 16 - 3 - 4 = 9 eggs.", "#### 18",
     True, True),
    (EGGS + "**Final Answer**\n\\[\n\\boxed{18}\n\\]\n\nVerification: 9 eggs x $2 = $18, and "
     "16 - 3 - 4 = 9.", "18", True, True),
    (EGGS + "So the answer is \\boxed{9}.\nWait: the question asks for dollars, 9 * 2 = 18.",
     "#### 18", False, False),
    # the last box counts, and the last '####'
    ("At first I get \\boxed{16}, but she eats 3 and bakes 4: 9 eggs, 9 * 2 = 18.\nSo the answer "
     "is \\boxed{18}.", "18", True, True),
    ("#### 16\nWait, she eats 3 and bakes 4: 16 - 3 - 4 = 9 eggs, and 9 * 2 = 18 dollars.\n#### 18",
     "#### 18", True, True),
    ("She makes 9 * 2 = 18 dollars a day.\n#### 18\n\nI hope this helps with 3 of your questions!",
     "18", True, True),
    # thousands separators, currency, units, percent
    ("He has 617 pairs, 617 * 2 = 1,234 socks.\n#### 1,234", "#### 1234", True, True),
    ("The total is \\boxed{1{,}234}.", "1234", True, True),
    ("The answer is 1,000,000.", "#### 1000000", True, True),
    ("So Janet makes **$18.00** every day at the farmers' market.", "18", True, True),
    ("Therefore she earns $\\boxed{\\$18.00}$ per day.", "#### 18", True, True),
    ("The rope is $\\boxed{5 \\text{ cm}}$ long.", "5", True, True),
    ("The discount is \\boxed{25\\%}.", "25", True, True),
    ("So the temperature drops to $\\boxed{-5}$ degrees.", "-5", True, True),
    # fractions and LaTeX: nested braces inside \boxed
    ("The probability is $\\boxed{\\frac{3}{4}}$.", "0.75", True, True),
    ("The probability is $\\boxed{0.75}$.", "\\frac{3}{4}", True, True),
    ("Hence $p = \\boxed{\\dfrac{3}{4}}$.", "\\frac34", None, True),
    ("We get $\\cos 30^\\circ = \\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt3}{2}", None, True),
    ("Simplifying, the expression is $\\boxed{2x + 3}$.", "3 + 2x", None, True),
    ("Simplifying, the expression is $\\boxed{2x + 5}$.", "3 + 2x", None, False),
    ("The solution set is $\\boxed{(1, 2]}$.", "(1,2]", None, True),
    ("The probability is $\\boxed{\\frac{3}{4}}$.", "4", False, False),
    # GSM8K's own answer field as the reference
    ("Natalia sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 in total. The answer is "
     "$\\boxed{72}$.",
     "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
     "altogether in April and May.\n#### 72", True, True),
    ("So the answer is $\\boxed{72}$.", 72, True, True),  # a JSON number
    # no answer at all
    ("I'm sorry, I cannot determine that from the information given.", "#### 18", False, False),
    ("", "18", False, False),
]


@pytest.mark.parametrize("completion, answer, want", [(c, a, g) for c, a, g, _ in CASES
                                                      if g is not None])
def test_gsm8k_reads_the_final_answer_boxed_or_after_the_last_hashes(completion, answer, want):
    assert tasks.gsm8k(completion, {"answer": answer}) == (float(want), {"correct": want})


@pytest.mark.parametrize("completion, answer, want", [(c, a, m) for c, a, _, m in CASES])
def test_math_reward_compares_answers_as_mathematics(completion, answer, want):
    assert tasks.math_reward(completion, {"answer": answer}) == (float(want), {"correct": want})


def test_final_number_is_the_first_number_of_the_last_answer_mark_else_the_last_number():
    assert tasks.final_number("#### 5\nno: #### 7") == "7"  # the LAST '####'
    assert tasks.final_number("#### 42 and later 7") == "42"
    assert tasks.final_number("\\boxed{18}. Check: 16 - 3 - 4 = 9") == "18"
    assert tasks.final_number("\\boxed{16} ... #### 18") == "18"  # whichever mark comes last
    assert tasks.final_number("#### 16 ... \\boxed{18}") == "18"
    assert tasks.final_number("\\boxed{18 \\text{ dollars (9 eggs)}} and 2") == "18"
    assert tasks.final_number("\\boxed{-\\frac{3}{4}}") == "-3/4"
    assert tasks.final_number("so 3 + 4 = 7. The answer is 1,234.") == "1234"
    assert tasks.final_number("\\boxed{18") == "18"  # cut by --max-new-tokens: what is there
    assert tasks.final_number("\\boxed{\\text{yes}}") is None
    assert tasks.final_number("no number") is None


def test_math_reward_runs_on_the_reward_worker_thread():
    # math-verify's default timeouts use SIGALRM and raise off the main thread; compute_rewards
    # runs rewards on a worker thread, so the reward must turn them off
    rows = [{"answer": "0.75"}, {"answer": "#### 18"}, {"answer": "5"}]
    texts = ["$\\boxed{\\frac{3}{4}}$", "#### 18", "\\boxed{6}"]
    scores = tasks.compute_rewards(tasks.load_reward("math"), texts, rows, 60, [0, 1, 2])
    assert [(s.reward, s.correct, s.reward_error) for s in scores] == [
        (1.0, True, None), (1.0, True, None), (0.0, False, None)]


def test_math_reward_without_math_verify_is_a_one_line_error_when_loaded(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` raises
    with pytest.raises(UserError, match=r"--reward math needs .*pip install -e '\.\[math\]'"):
        tasks.load_reward("math")
    assert tasks.load_reward("gsm8k") is tasks.gsm8k


@pytest.mark.parametrize("spec", ["exact_match,0.1*format,-0.01*length",
                                  "exact_match, 0.1 * format, -0.01 * length",
                                  " exact_match ,0.1 *format,\t-0.01*  length "])
def test_weighted_rewards_read_the_same_with_spaces_around_commas_and_stars(spec):
    reward = tasks.load_reward(spec)
    assert reward("12", {"answer": "12"}) == (pytest.approx(1 + 0.1 - 0.02), {
        "exact_match": 1.0, "format": 1.0, "length": 2.0, "correct": True})


@pytest.mark.parametrize("spec, message", [
    ("exact_match, x * format", "weights are numbers"),
    ("exact_match, 0.1 0.2 * format", "weights are numbers"),
    ("exact_match, nan * format", "weights are finite numbers"),
    ("exact_match, , format", "a term names no reward"),
    ("exact_match, 0.1 * ", "a term names no reward"),
    ("exact_match, 0.1 * formt", "--reward formt: not a built-in reward")])
def test_a_bad_weighted_reward_is_a_one_line_error(spec, message):
    with pytest.raises(UserError, match=re.escape(message)) as e:
        tasks.load_reward(spec)
    assert "\n" not in str(e.value)


def test_cli_reads_a_weighted_reward_with_spaces_and_refuses_a_bad_one(tmp_path):
    small = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0"]
    proc = run_cli(*small, "--reward", "exact_match, 0.1 * format", "--run-dir",
                   str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()][-1]
    assert row["reward"] == pytest.approx(row["reward/exact_match"] + 0.1 * row["reward/format"])
    proc = run_cli(*small, "--reward", "exact_match, x * format", "--run-dir",
                   str(tmp_path / "bad"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].endswith("--reward exact_match, x * format: weights are numbers (0.1*format)")
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("reward", ["gsm8k", "math"])
def test_answer_rewards_need_an_answer_in_every_row(tmp_path, reward):
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "q?", "answer": "#### 1"}\n{"question": "r?"}\n')
    with pytest.raises(UserError, match=rf'row 2 has no "answer", which --reward {reward}'):
        tasks.load_dataset(str(path), None, reward, "question")


# -----------------------------------------------------------------------------
# datasets: GSM8K as openai/grade-school-math publishes it

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                 "clips in May. How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = "
               "<<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
                 "babysitting. How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
               "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many "
                 "bolts in total does it take?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total amount of fabric is "
               "2+1=<<2+1=3>>3 bolts of fabric\n#### 3"},
    {"question": "James writes a 3-page letter to 2 different friends twice a week. How many pages "
                 "does he write a year?",
     "answer": "He writes each friend 3*2=<<3*2=6>>6 pages a week\nSo he writes 6*2=<<6*2=12>>12 "
               "pages every week\nThat means he writes 12*52=<<12*52=624>>624 pages a year\n"
               "#### 624"},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_raw_gsm8k_rows_load_with_prompt_key_and_score_with_gsm8k(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    train, held = tasks.load_dataset(str(path), str(path), "gsm8k", "question")
    assert train == GSM8K_ROWS == held  # rows kept whole: the reward sees the answer's '#### x'
    finals = ["72", "10", "3", "624"]
    for row, final in zip(train, finals):
        assert tasks.gsm8k(f"... so the answer is $\\boxed{{{final}}}$.", row)[0] == 1.0
        assert tasks.gsm8k(f"#### {int(final) + 1}", row)[0] == 0.0  # not the calculator's <<>>


def test_a_row_without_the_prompt_key_names_the_key_and_the_fields_it_has(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    with pytest.raises(UserError, match=r'train.jsonl:1: needs exactly one of "prompt" .*'
                                        r'--prompt-key.*; it has "question", "answer"$'):
        tasks.load_jsonl(str(path), "prompt", "")
    with pytest.raises(UserError, match=r'train.jsonl:1: needs exactly one of "problem"'):
        tasks.load_dataset(str(path), None, "gsm8k", "problem")


def test_prompt_key_is_refused_for_a_built_in_task():
    with pytest.raises(UserError, match="--prompt-key question is for a JSONL --dataset"):
        tasks.load_dataset("arithmetic", None, "exact_match", "question")


def test_encode_prompts_read_the_prompt_key_plain_and_as_a_user_turn(qwen_instruct):
    rows = GSM8K_ROWS[:2]
    plain = tasks.encode_prompts(rows, qwen_instruct, False, "d", "question")
    assert [qwen_instruct.decode(ids) for ids in plain] == [r["question"] for r in rows]
    chat = tasks.encode_prompts(rows, qwen_instruct, True, "d", "question")
    text = qwen_instruct.decode(chat[0])
    assert text.endswith(f"<|im_start|>user\n{rows[0]['question']}<|im_end|>\n"
                         "<|im_start|>assistant\n")


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "gsm8k_to_jsonl.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_gsm8k_converter_reads_grade_school_math_from_disk(tmp_path):
    data = tmp_path / "grade-school-math" / "grade_school_math" / "data"
    data.mkdir(parents=True)
    write_jsonl(data / "train.jsonl", GSM8K_ROWS[:3])
    write_jsonl(data / "test.jsonl", GSM8K_ROWS[3:])
    proc = convert("--from-dir", str(data), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "wrote 3 rows" in proc.stdout and "wrote 1 rows" in proc.stdout
    train = tasks.load_jsonl(str(tmp_path / "out" / "gsm8k_train.jsonl"), "prompt", "")
    test = tasks.load_jsonl(str(tmp_path / "out" / "gsm8k_test.jsonl"), "prompt", "")
    assert [r["answer"] for r in train + test] == ["#### 72", "#### 10", "#### 3", "#### 624"]
    assert train[1]["prompt"].startswith(GSM8K_ROWS[1]["question"] + "\n\n")
    assert "'#### <number>'" in train[1]["prompt"]
    # the converted rows score like the raw ones
    assert tasks.gsm8k("\\boxed{624}", test[0]) == tasks.gsm8k("\\boxed{624}", GSM8K_ROWS[3])


@pytest.mark.parametrize("files, message", [
    ({"train.jsonl": GSM8K_ROWS}, "no test.jsonl there"),
    ({"train.jsonl": GSM8K_ROWS, "test.jsonl": [{"question": "q", "answer": "12"}]},
     r"test.jsonl:1: expected \{\"question\""),
])
def test_gsm8k_converter_names_what_is_missing_on_disk(tmp_path, files, message):
    for name, rows in files.items():
        write_jsonl(tmp_path / name, rows)
    proc = convert("--from-dir", str(tmp_path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
    assert __import__("re").search(message, proc.stderr), proc.stderr


# -----------------------------------------------------------------------------
# real tokenizers: character-level, with the special tokens, templates and configs of the families

CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
CHATML = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are Qwen, created "
          "by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
          "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + "
          "'<|im_end|>\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
LLAMA3 = ("{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}"
          "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")


def build_tokenizer(out: Path, specials: list[str], *, model_type: str = "llama",
                    add_bos: str | None = None, template: str | None = None,
                    config_eos=None, generation_eos=None, model: bool = False, **names):
    """A character tokenizer with `specials` (ids 0..) saved in `out` with a config.json (and a
    generation_config.json when generation_eos is given); with `model`, tiny Llama weights too.
    add_bos: the special token its post-processor puts first (as Llama/Gemma base tokenizers do).
    Token names (eos_token=..., bos_token=...) are given as strings; ids are looked up."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, *CHARS])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # "\n\n" too
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials)  # as the families do: <|eot_id|> etc. are special added tokens
    if add_bos:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{add_bos} $A", pair=f"{add_bos} $A {add_bos} $B",
            special_tokens=[(add_bos, vocab[add_bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", **names)
    if template:
        tok.chat_template = template
    tok.save_pretrained(out)
    ids = lambda x: [vocab[t] for t in x] if isinstance(x, list) else vocab.get(x)
    kw = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              bos_token_id=ids(names.get("bos_token")), eos_token_id=ids(config_eos),
              pad_token_id=ids(names.get("pad_token")), tie_word_embeddings=False)
    config = AutoConfig.for_model(model_type, **kw)
    config.save_pretrained(out)
    if generation_eos is not None:
        GenerationConfig(eos_token_id=ids(generation_eos)).save_pretrained(out)
    if model:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def load(out: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)


QWEN = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
         "<|end_header_id|>", "<|eot_id|>"]
GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>"]


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    """Model directories as the families ship them (qwen3 model_type: with qwen2 AutoTokenizer
    forces Qwen2Tokenizer, which mangles a character vocabulary)."""
    d = tmp_path_factory.mktemp("tokenizers")
    return {
        # Qwen2.5-Instruct: eos <|im_end|>, generation_config's [<|im_end|>, <|endoftext|>], no BOS
        "qwen_instruct": build_tokenizer(
            d / "qwen_instruct", QWEN, model_type="qwen3", template=CHATML,
            eos_token="<|im_end|>", pad_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
            config_eos="<|im_end|>", generation_eos=["<|im_end|>", "<|endoftext|>"]),
        # Qwen2.5 base: eos <|endoftext|> everywhere, yet a ChatML template
        "qwen_base": build_tokenizer(
            d / "qwen_base", QWEN, model_type="qwen3", template=CHATML, eos_token="<|endoftext|>",
            additional_special_tokens=["<|im_start|>", "<|im_end|>"],
            config_eos="<|endoftext|>", generation_eos="<|endoftext|>"),
        # Llama 3.x base: adds <|begin_of_text|>, template writes it too; <|eot_id|> is a special
        # added token only (not in additional_special_tokens), eos <|end_of_text|>
        "llama3": build_tokenizer(
            d / "llama3", LLAMA, add_bos="<|begin_of_text|>", template=LLAMA3,
            bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>",
            config_eos="<|end_of_text|>", generation_eos="<|end_of_text|>"),
        # Gemma base: adds <bos>, no chat template, no generation_config.json
        "gemma_base": build_tokenizer(
            d / "gemma_base", GEMMA, add_bos="<bos>", bos_token="<bos>", eos_token="<eos>",
            pad_token="<pad>", config_eos="<eos>", model=True),
        # no eos in the tokenizer, config.json or a generation_config.json
        "no_eos": build_tokenizer(d / "no_eos", ["<unk>", "<pad>"], pad_token="<pad>"),
    }


@pytest.fixture(scope="module")
def qwen_instruct(families):
    return load(families["qwen_instruct"])


def token_ids(tok, *names: str) -> list[int]:
    return sorted(tok.convert_tokens_to_ids(n) for n in names)


@pytest.mark.parametrize("family, chat, want", [
    ("qwen_instruct", False, ["<|im_end|>", "<|endoftext|>"]),  # generation_config's list
    ("qwen_instruct", True, ["<|im_end|>", "<|endoftext|>"]),
    ("qwen_base", False, ["<|endoftext|>"]),
    ("qwen_base", True, ["<|endoftext|>", "<|im_end|>"]),  # a base model ends its turn too
    ("llama3", False, ["<|end_of_text|>"]),
    ("llama3", True, ["<|end_of_text|>", "<|eot_id|>"]),
    ("gemma_base", False, ["<eos>"]),
])
def test_stop_tokens_are_eos_config_generation_config_and_end_of_turn(families, family, chat,
                                                                       want):
    tok = load(families[family])
    assert tasks.stop_token_ids(tok, str(families[family]), chat) == token_ids(tok, *want)


@pytest.mark.parametrize("family, end", [("qwen_instruct", "<|im_end|>"),
                                         ("qwen_base", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_end_of_turn_is_the_special_token_after_an_assistant_message(families, family, end):
    tok = load(families[family])
    assert tasks.end_of_turn_id(tok) == tok.convert_tokens_to_ids(end)


def test_context_length_is_read_from_config_json(families):
    assert tasks.context_length(str(families["llama3"])) == 1024


def test_a_tokenizer_without_any_eos_is_a_one_line_error(families):
    tok = load(families["no_eos"])
    with pytest.raises(UserError, match=r"no_eos: its tokenizer and configs name no end-of-"
                                        r"sequence token") as e:
        tasks.stop_token_ids(tok, str(families["no_eos"]), False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("family, bos", [("llama3", "<|begin_of_text|>"), ("gemma_base", "<bos>"),
                                         ("qwen_instruct", None)])
def test_plain_prompts_get_the_bos_the_tokenizer_adds_exactly_once(families, family, bos):
    tok = load(families[family])
    assert tasks.adds_bos(tok) == (bos is not None)
    text = "Weng earns $12 an hour."
    rows = [{"prompt": text}, {"prompt": (bos or "") + text}]  # one already starts with it
    for ids in tasks.encode_prompts(rows, tok, False, "d", "prompt"):
        assert tok.decode(ids) == (bos or "") + text
        assert ids.count(tok.bos_token_id) == (bos is not None)


def test_templated_prompts_carry_the_templates_bos_exactly_once(families):
    tok = load(families["llama3"])
    rows = [{"prompt": "How many clips?"},
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "How many clips?"}]}]
    for ids in tasks.encode_prompts(rows, tok, True, "d", "prompt"):
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert tok.decode(ids).endswith("How many clips?<|eot_id|><|start_header_id|>assistant"
                                        "<|end_header_id|>\n\n")
    qwen = load(families["qwen_base"])  # ChatML writes no BOS, and Qwen has none
    (ids,) = tasks.encode_prompts(rows[:1], qwen, True, "d", "prompt")
    assert qwen.decode(ids).startswith("<|im_start|>system\n")


def test_templated_prompts_are_exactly_what_the_template_writes(tmp_path):
    # a tokenizer that adds BOS to plain text, a template that writes none: HF's
    # apply_chat_template(tokenize=True) adds none (add_special_tokens=False), nor do we
    template = ("{%- for m in messages %}{{- m['role'] + ': ' + m['content'] + '<eos>' }}"
                "{%- endfor %}{{- 'assistant: ' }}")
    tok = load(build_tokenizer(tmp_path, GEMMA, add_bos="<bos>", template=template,
                               bos_token="<bos>", eos_token="<eos>", config_eos="<eos>"))
    assert tasks.adds_bos(tok)
    (chat,), (plain,) = (tasks.encode_prompts([{"prompt": "hi"}], tok, c, "d", "prompt")
                         for c in (True, False))
    assert tok.decode(chat) == "user: hi<eos>assistant: " and tok.decode(plain) == "<bos>hi"


def test_a_chat_without_a_template_names_the_prompt_key(families):
    tok = load(families["gemma_base"])
    with pytest.raises(UserError, match=r'has none; use "question" rows without --chat-template'):
        tasks.encode_prompts([{"question": "q"}], tok, True, "d", "question")


# -----------------------------------------------------------------------------
# the real CLI on GSM8K's own files


def run_cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    return warm.run([sys.executable, str(ROOT / "nanoareal.py"), *args], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("reward", ["gsm8k", "math"])
def test_cli_trains_on_raw_gsm8k_with_prompt_key(families, tmp_path, reward):
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:2])
    proc = run_cli("--model", str(families["gemma_base"]), "--dataset", str(train),
                   "--eval-dataset", str(test), "--prompt-key", "question", "--reward", reward,
                   "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                   "--max-new-tokens", "4", "--eval-every", "1", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [0, 1] and "eval/accuracy" in metrics[-1]
    assert metrics[-1]["reward_errors"] == 0  # the reward ran on its worker thread without error
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").open()]
    questions = {r["question"] for r in GSM8K_ROWS}
    assert samples and all(s["prompt"].removeprefix("<bos>") in questions and
                           s["prompt"].count("<bos>") == 1 for s in samples)  # BOS once


def test_cli_reward_math_without_math_verify_fails_before_loading(families, tmp_path):
    fake = tmp_path / "site" / "math_verify"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not installed')\n")
    train = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    proc = run_cli("--model", str(families["gemma_base"]), "--dataset", str(train),
                   "--prompt-key", "question", "--reward", "math", "--run-dir",
                   str(tmp_path / "run"), env_extra={"PYTHONPATH": str(fake.parent)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("pip install -e '.[math]'")
