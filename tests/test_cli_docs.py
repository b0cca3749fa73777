"""The CLI documents itself: every flag's --help is a sentence, docs/cli.md is the table --help
generates, the README's reward example runs through the real CLI, and the docs cite nothing
outside the repository."""

import json
import os
import re
import sys
from pathlib import Path

import pytest
import warm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cli_table  # noqa: E402

README = (ROOT / "README.md").read_text()


def test_every_flag_has_a_help_sentence_not_a_label():
    helps = cli_table.flag_help()
    assert len(helps) >= 40
    for name, (flag, _, text) in helps.items():
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) >= 5, f"{flag}: help too short to explain anything: {text!r}"
        assert text.endswith((".", ")")), f"{flag}: help is not a sentence: {text!r}"
        assert text.lower().rstrip(".") != name.replace("_", " "), f"{flag}: help repeats the name"


def test_every_flag_is_in_a_section_of_the_table():
    names = [n for _, fields in cli_table.sections() for n in fields]
    assert sorted(names) == sorted(cli_table.flag_help())


def test_docs_cli_table_is_the_generated_one():
    assert cli_table.DOC.read_text() == cli_table.document(), (
        "docs/cli.md is stale: run `python scripts/cli_table.py --write`")


def test_docs_cite_nothing_outside_the_repository():
    files = [ROOT / "README.md", *ROOT.glob("*.py"), *(ROOT / "bench").glob("*.md"),
             *(ROOT / "docs").glob("*.md")]
    for path in files:
        text = path.read_text()
        for outside in ("SPEC.md", "NOTES.md", "STYLE.md", "../shared", "SPEC rule", "SPEC's"):
            assert outside not in text, f"{path.name} cites {outside}, outside the repository"


def reward_example() -> str:
    """The README's `--reward` example: the python block right after its marker."""
    block = README.split("<!-- reward-example -->", 1)[1]
    return re.search(r"```python\n(.*?)```", block, re.S).group(1)


def test_readme_reward_example_runs_through_the_cli_and_logs_its_metrics(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(reward_example())
    assert len(reward_example().strip().splitlines()) <= 12
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--reward", f"{path}:score", "--steps", "2",
           "--prompts-per-step", "8", "--group-size", "4", "--eval-every", "2", "--run-dir",
           str(run_dir)]
    proc = warm.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2
    for r in steps:
        # the example's own metric is logged; accuracy is its "correct" verdict, not reward > 0.5
        assert 0 <= r["reward/right_length"] <= 1
        assert r["reward"] >= r["accuracy"]  # partial credit only adds reward
    assert any(r["reward"] > r["accuracy"] for r in steps), "partial credit must show up"
    assert "eval/accuracy" in rows[-1]


@pytest.mark.parametrize("spec, message", [
    ("nope.py:score", "no such file nope.py"),
    ("{example}:missing", "has no function 'missing'"),
    ("not_a_reward", "not a built-in reward"),
])
def test_a_bad_reward_spec_is_one_line_naming_it(tmp_path, spec, message):
    example = tmp_path / "r.py"
    example.write_text(reward_example())
    cmd = [sys.executable, str(ROOT / "nanoareal.py"), "--reward", spec.format(example=example),
           "--run-dir", str(tmp_path / "run")]
    proc = warm.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_readme_loop_is_main_s_own_code():
    """Every line of the README's loop (but its `...` placeholders) is a line of nanoareal.main,
    in the same order: the excerpt cannot drift from the code it shows."""
    import inspect

    import nanoareal
    squash = lambda line: " ".join(line.split())
    source = [squash(line) for line in inspect.getsource(nanoareal.main).splitlines()]
    excerpt = README.split("## The loop", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    at = 0
    for line in map(squash, excerpt.splitlines()):
        if not line or line.startswith("..."):
            continue
        assert line in source[at:], f"README loop line not in main() (or out of order): {line!r}"
        at = source.index(line, at) + 1
