"""The repo stays ruff clean and ruff-formatted (pyproject.toml), and the trainer within issue 44's
budgets: tokens, tokens per line, wide lines, function length, flags, the loop's place, README."""

import shutil
import subprocess
from pathlib import Path

import pytest


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (it comes with the [test] extra)")
    proc = subprocess.run([ruff, "check", "."], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_trainer_files_are_laid_out_by_ruff_format():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (it comes with the [test] extra)")
    proc = subprocess.run([ruff, "format", "--check", "."], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# issue 44's budgets, measured as ../shared/tools/density.py does: Python tokens of code (comments,
# docstrings, blank lines free) over the trainer's files (all but tests/, bench/, scripts/, assets/)
ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS_PER_LINE, MAX_WIDE_SHARE, WIDE = 10.0, 0.05, 95
# Issue 44's budget: at most 44,000 tokens (43,998 on 2026-12-06, the GPU-review fixes and the
# distillation, mismatch and dynamic-sampling features included)
MAX_TOKENS = 44_000
MAX_FUNCTION_LINES, MAX_FLAGS, LOOP_WITHIN, README_LINES = 60, 55, 300, 280


def trainer_files() -> list[Path]:
    skip = {"tests", "bench", "scripts", "assets"}
    return sorted(p for p in ROOT.rglob("*.py")
                  if p.relative_to(ROOT).parts[0] not in skip
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))


def measure(path: Path) -> tuple[int, int, int]:
    """(tokens, code lines, code lines of WIDE columns or more)."""
    import ast
    import io
    import tokenize

    src = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, node.end_lineno + 1))
    free = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    tokens, code = 0, set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in free or (tok.type == tokenize.STRING and tok.start[0] in docstrings):
            continue
        tokens += 1
        code.add(tok.start[0])
    lines = src.splitlines()
    return tokens, len(code), sum(len(lines[i - 1]) >= WIDE for i in code)


def test_trainer_files_keep_their_budgets():
    import ast

    files = trainer_files()
    assert {p.name for p in files} >= {"nanoareal.py", "loss.py", "rollout.py"}
    total, problems = 0, []
    for path in files:
        tokens, code, wide = measure(path)
        total += tokens
        if tokens > MAX_TOKENS_PER_LINE * code:
            problems.append(f"{path.name}: {tokens / code:.2f} tokens per code line")
        if wide > MAX_WIDE_SHARE * code:
            problems.append(f"{path.name}: {wide} of {code} code lines at {WIDE}+ columns")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{path.name}: {node.name} is {length} lines")
    if total > MAX_TOKENS:
        problems.append(f"{total} tokens in the trainer's files (at most {MAX_TOKENS})")
    assert not problems, "\n".join(problems)


def test_flags_loop_and_readme_keep_their_budgets():
    import ast
    import dataclasses

    import nanoareal
    assert len(dataclasses.fields(nanoareal.Config)) <= MAX_FLAGS
    tree = ast.parse((ROOT / "nanoareal.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    assert loop.end_lineno <= LOOP_WITHIN, f"the step loop ends at line {loop.end_lineno}"
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_LINES
