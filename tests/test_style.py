"""The repo stays ruff clean (rules in pyproject.toml)."""

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
