"""tests/support/warm.py, which most end-to-end tests run the CLI through, behaves as a fresh
interpreter does (argv, cwd, environment, streams, exit codes, signals, seeds) and falls back to a
real subprocess where a fork could differ."""

import os
import signal
import subprocess
import sys
import time

import warm

SCRIPT = """import json, os, random, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
                  "env": os.environ.get("NANOAREAL_X"), "hash": hash("x"),
                  "random": random.random(), "warm": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("NANOAREAL_CODE", "0")))
"""


def _script(tmp_path, text: str = SCRIPT, name: str = "probe.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_warm_run_sees_its_argv_cwd_environment_and_streams_as_a_fresh_interpreter(tmp_path):
    import json

    path = _script(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    env = dict(os.environ, NANOAREAL_X="1", NANOAREAL_CODE="3")
    out = warm.run([sys.executable, str(path), "a", "--b"], cwd=tmp_path / "elsewhere", env=env,
                   capture_output=True, text=True, timeout=120)
    seen = json.loads(out.stdout)
    assert seen["warm"] and out.returncode == 3 and out.stderr == "to stderr\n"
    assert seen["argv"] == [str(path), "a", "--b"] and seen["name"] == "__main__"
    assert seen["cwd"] == str(tmp_path / "elsewhere") and seen["path0"] == str(tmp_path)
    assert seen["env"] == "1"
    fresh = subprocess.run([sys.executable, str(path), "a", "--b"], cwd=tmp_path / "elsewhere",
                           env=env, capture_output=True, text=True, timeout=120)
    assert {k: v for k, v in json.loads(fresh.stdout).items() if k not in ("hash", "random")} == {
        **{k: v for k, v in seen.items() if k not in ("hash", "random")}, "warm": False}
    assert (fresh.returncode, fresh.stderr) == (out.returncode, out.stderr)


def test_consecutive_warm_runs_get_different_hash_and_random_seeds(tmp_path):
    import json

    path = _script(tmp_path)
    runs = [json.loads(warm.run([sys.executable, str(path)], capture_output=True, text=True,
                                timeout=120).stdout) for _ in range(2)]
    assert runs[0]["hash"] != runs[1]["hash"] and runs[0]["random"] != runs[1]["random"]


def test_exceptions_signals_and_stderr_to_stdout_end_as_in_python(tmp_path):
    path = _script(tmp_path, "import sys, time\nprint('x', flush=True)\nif sys.argv[1:]: "
                             "time.sleep(60)\nraise ValueError('boom')\n")
    out = warm.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "ValueError: boom" in out.stderr and out.stdout == "x\n"
    log = tmp_path / "log"
    with open(log, "w") as f:
        proc = warm.Popen([sys.executable, str(path), "sleep"], stdout=f, stderr=subprocess.STDOUT,
                          start_new_session=True)
    deadline = time.monotonic() + 60
    while log.read_text() != "x\n":
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    assert os.getsid(proc.pid) == proc.pid  # its own session
    proc.send_signal(signal.SIGINT)  # KeyboardInterrupt, uncaught: Python dies by SIGINT
    assert proc.wait(60) == -signal.SIGINT


def test_what_a_fork_could_change_runs_as_a_real_subprocess(tmp_path):
    path = _script(tmp_path)
    assert isinstance(warm.Popen([sys.executable, "-c", "pass"]), subprocess.Popen)
    changed = warm.Popen([sys.executable, str(path)], stdout=subprocess.DEVNULL,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)))
    assert isinstance(changed, subprocess.Popen) and changed.wait(60) == 0


def test_a_warm_runs_own_python_children_are_warm(tmp_path):
    import json

    probe = _script(tmp_path)
    parent = _script(tmp_path, f"import subprocess, sys\nsubprocess.run([sys.executable, "
                               f"{str(probe)!r}], check=True)\n", "parent.py")
    out = warm.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["warm"]


def test_torchrun_and_its_workers_run_warm_each_rank_with_its_own_hash_seed(tmp_path):
    import json
    import socket

    path = _script(tmp_path, SCRIPT.replace('"warm":', '"rank": os.environ["RANK"], "warm":'))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = warm.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    f"--master_port={port}", str(path)], capture_output=True, text=True,
                   timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    ranks = sorted((json.loads(line) for line in out.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == ["0", "1"] and all(r["warm"] for r in ranks)
    assert ranks[0]["hash"] != ranks[1]["hash"]
