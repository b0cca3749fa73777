"""Installed beside other code, nanoareal collides with nothing: `pip install -e .` adds one name,
`nanoareal` (the trainer; its files as nanoareal.cli, nanoareal.loss, ...: __init__.py), and a
script importing it from a folder that holds its own `logs/`, `tasks/`, `cli.py`, `loss.py` gets
nanoareal's files under nanoareal and its own under their plain names. (The flat files
(eleven now) used to be top-level modules: such a script failed with "cannot import name
'quiet_libraries' from 'logs'".)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys
import cli, logs
import nanoareal
from nanoareal import Config, main
import nanoareal.loss
import loss, tasks
print(json.dumps({"trainer_file": nanoareal.__file__, "trainer": main.__module__,
                  "helper": nanoareal.loss.__file__, "config": Config.__module__,
                  "theirs": [cli.WHO, loss.WHO, list(logs.__path__), list(tasks.__path__)],
                  "one_error_type": nanoareal.rollout.UserError is nanoareal.cli.UserError,
                  "plain_names_left": sorted({"rollout", "modeling", "packing", "checkpoint",
                                              "attention", "lora"} & set(sys.modules))}))
"""


def test_an_editable_install_adds_one_package_that_no_folder_or_file_beside_a_script_shadows(
        tmp_path):
    src, user, venv = tmp_path / "src", tmp_path / "user", tmp_path / "venv"
    src.mkdir()
    for f in [*REPO.glob("*.py"), REPO / "pyproject.toml", REPO / "README.md"]:
        shutil.copy(f, src)
    # the environment's packages (torch, transformers), setuptools for a build without a network
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    venv], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
                    "--no-build-isolation", "-e", src], check=True, timeout=300,
                   env=os.environ | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    [top_level] = (venv / "lib").glob("python*/site-packages/nanoareal-*.dist-info/top_level.txt")
    assert top_level.read_text().split() == ["nanoareal"]

    (user / "logs").mkdir(parents=True)
    (user / "tasks").mkdir()
    for name in ("cli", "loss"):
        (user / f"{name}.py").write_text(f"WHO = {name!r}\n")
    (user / "script.py").write_text(SCRIPT)
    proc = subprocess.run([python, "script.py"], cwd=user, capture_output=True, text=True,
                          timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["trainer_file"] == str(src / "nanoareal.py")
    assert got["helper"] == str(src / "loss.py")
    assert got["trainer"] == got["config"] == "nanoareal.nanoareal" and got["one_error_type"]
    assert got["theirs"] == ["cli", "loss", [str(user / "logs")], [str(user / "tasks")]]
    assert got["plain_names_left"] == []
