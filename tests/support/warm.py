"""Warm interpreters for the end-to-end tests: `python script.py args` without Python's start-up.

Every CLI run in the suite spends ~10 s of CPU importing torch and transformers (transformers 5
scans its model registry for seconds) before steps that take a tenth of that. A zygote imports
them once and never runs anything; each run is a fork of it that executes the script as __main__
with the run's argv, cwd, environment, standard streams and session, and exits as a fresh
interpreter would (atexit, exit code, death by SIGINT). `Popen` and `run` take subprocess's
arguments for `python [-u] script.py ...` and `python [-u] -m module ...`; anything else, or an
environment that changes what the imports read (PYTHONPATH, HF_*), is a real subprocess. Inside a
warm run its own Python children are warm too: torchrun's workers, ablate.py's runs. What a fork
would share with its zygote and a fresh interpreter would not: the str hash seed and the
random/numpy seeds. Children reseed random and numpy, and runs alternate between two zygotes (two
hash seeds), so two runs a test compares, or two ranks of a run, never share one. A warm child's
parent is its zygote, not the process that started it: kill a process tree by its pids."""

from __future__ import annotations

import atexit
import itertools
import json
import os
import random
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZYGOTES = 2  # distinct hash seeds: consecutive runs land in different zygotes
# read at run time, not by the zygote's imports: may differ from the zygote's environment
RUNTIME_ENV = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "NANOAREAL_", "WANDB_", "PYTEST_",
               "TOKENIZERS_PARALLELISM", "HF_HUB_DISABLE_PROGRESS_BARS",
               # what torchrun gives its workers (torch.distributed reads them at init)
               "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_", "WORLD_SIZE",
               "MASTER_", "TORCHELASTIC_", "TORCH_NCCL_")
KWARGS = {"cwd", "env", "stdin", "stdout", "stderr", "start_new_session", "text"}
_REAL_POPEN = subprocess.Popen
_pool: list[str] = []  # the zygotes' socket paths
_base_env: dict[str, str] = {}  # the zygotes' environment
_turn = itertools.count()


def run(args: list[str], *, capture_output: bool = False, timeout: float | None = None,
        **kw) -> subprocess.CompletedProcess:
    """subprocess.run for `[sys.executable, script.py, ...]`, warm when it can be."""
    if capture_output:
        kw |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with Popen(args, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def Popen(args: list[str], **kw):  # noqa: N802 (stands in for subprocess.Popen)
    args = [str(a) for a in args]
    if _warmable(args, kw) and (zygote := _next_zygote()):
        try:
            return WarmProcess(args, zygote, **kw)
        except OSError as e:  # a zygote that is gone: the same command, cold
            print(f"warm: {e}; running {args[1]} in a fresh interpreter", file=sys.stderr)
    return _REAL_POPEN(args, **kw)


def _target(args: list[str]) -> tuple[bool, str, str, list[str]] | None:
    """`python [-u] script.py args` or `python [-u] -m module args` -> (unbuffered, "path" or
    "module", the script or module, args); None for any other command."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    unbuffered = args[1] == "-u"
    rest = args[1 + unbuffered :]
    if len(rest) >= 2 and rest[0] == "-m" and not rest[1].startswith("-"):
        return unbuffered, "module", rest[1], rest[2:]
    if rest and rest[0].endswith(".py"):
        return unbuffered, "path", rest[0], rest[1:]
    return None


def _warmable(args: list[str], kw: dict) -> bool:
    if os.name != "posix" or not set(kw) <= KWARGS or (target := _target(args)) is None:
        return False
    if target[1] == "path" and not Path(kw.get("cwd") or ".", target[2]).is_file():
        return False
    env = kw.get("env") or os.environ
    base = _base_env or {**os.environ, "OMP_NUM_THREADS": "1"}
    changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    # a PYTHONPATH of the project's folders, where the zygote's imports came from, cannot shadow
    # a module it imported; the child puts it on sys.path as Python would
    if set(_pythonpath(env)) <= {str(ROOT), str(ROOT / "tests" / "support")}:
        changed.discard("PYTHONPATH")
    return all(k.startswith(RUNTIME_ENV) for k in changed)


def _pythonpath(env) -> list[str]:
    return [str(Path(d).resolve()) for d in env.get("PYTHONPATH", "").split(os.pathsep) if d]


def _next_zygote() -> str | None:
    """A zygote's socket, the pool started on first use; None when it cannot start here."""
    if not _pool and not _base_env:
        _base_env.update(os.environ, OMP_NUM_THREADS="1")
        # a short folder: a unix socket's path has at most 107 bytes, whatever TMPDIR is
        folder = tempfile.mkdtemp(prefix="warm-", dir="/tmp" if os.path.isdir("/tmp") else None)
        paths = [f"{folder}/{i}.sock" for i in range(ZYGOTES)]
        procs = [_REAL_POPEN([sys.executable, __file__, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=_base_env, cwd=ROOT) for path in paths]

        def stop() -> None:  # EOF on its stdin stops a zygote
            for proc in procs:
                proc.stdin.close()
            shutil.rmtree(folder, ignore_errors=True)

        atexit.register(stop)
        if all(p.stdout.readline() == b"ready\n" for p in procs):  # each says so once imported
            _pool.extend(paths)
        else:
            print("warm: a zygote did not start; every run is a fresh interpreter", file=sys.stderr)
    return _pool[next(_turn) % len(_pool)] if _pool else None


class WarmProcess:
    """A fork of a zygote running the script, with subprocess.Popen's methods."""

    def __init__(self, args: list[str], zygote: str, cwd=None, env=None, stdin=None, stdout=None,
                 stderr=None, start_new_session: bool = False, text: bool = False):
        self.args, self.text, self.returncode = args, text, None
        self._pipes: dict[int, object] = {}  # PIPE streams: temporary files, read at the end
        self._opened: list = []  # files opened for the child (DEVNULL), closed once it has them
        fds = [self._fd(stdin, 0), self._fd(stdout, 1)]
        fds.append(fds[1] if stderr == subprocess.STDOUT else self._fd(stderr, 2))
        request = {"argv": args[1:], "cwd": str(Path(cwd or os.getcwd()).resolve()),
                   "env": dict(env or os.environ), "new_session": start_new_session,
                   "pool": _pool, "base_env": _base_env}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(zygote)
        socket.send_fds(self._conn, [json.dumps(request).encode()], fds)
        for f in self._opened:
            f.close()
        self.pid = int(self._conn.recv(64))

    def _fd(self, spec, default: int) -> int:
        if spec is None:
            return default
        if spec == subprocess.PIPE:  # a temporary file, read once the process has exited
            f = self._pipes[default] = tempfile.TemporaryFile()
            return f.fileno()
        if spec == subprocess.DEVNULL:
            self._opened.append(f := open(os.devnull, "r+b"))
            return f.fileno()
        return spec if isinstance(spec, int) else spec.fileno()

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def _collect(self) -> None:
        self.returncode = int(self._conn.recv(64))
        self._conn.close()

    def communicate(self, input=None, timeout: float | None = None):
        self.wait(timeout)
        outs = []
        for fd in (1, 2):
            if (f := self._pipes.get(fd)) is None:
                outs.append(None)
                continue
            f.seek(0)
            data = f.read()
            f.close()
            outs.append(data.decode() if self.text else data)
        return tuple(outs)

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.wait()


# -----------------------------------------------------------------------------
# the zygote: imports, then forks a child per request and reports its pid and exit status
def serve(path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM  # noqa: F401

    import nanoareal  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}
    while True:
        ready = select.select([listener, sys.stdin], [], [], 0.05)[0]
        if sys.stdin in ready and not os.read(0, 1):  # the test process is gone
            break
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush(), sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            conn.send(str(pid).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if conn := waiting.pop(pid, None):
                try:
                    conn.send(str(os.waitstatus_to_exitcode(status)).encode())
                except OSError:  # the test stopped waiting
                    pass
                conn.close()


def _child(request: dict, fds: list[int]) -> None:
    """Become `python script args` in request's cwd, environment and streams; never returns."""
    global _pool, _base_env
    import numpy as np
    import torch

    if request["new_session"]:
        os.setsid()
    for std, fd in enumerate(fds):
        os.dup2(fd, std)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _pool, _base_env = request["pool"], request["base_env"]
    for module in list(sys.modules.values()):  # its own Python children are warm too, also
        if vars(module).get("Popen") is _REAL_POPEN:  # where `from subprocess import Popen`
            module.Popen = Popen
    unbuffered, kind, target, args = _target([sys.executable, *request["argv"]])
    # a script's directory, or for -m the working directory, leads sys.path (not the zygote's)
    sys.path[:] = [str(Path(target).resolve().parent) if kind == "path" else os.getcwd(),
                   *_pythonpath(os.environ), *_SYS_PATH]
    sys.argv = [target, *args]
    random.seed()
    np.random.seed()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    if unbuffered or os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
    code = 0
    try:
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as Python does: die by SIGINT
        sys.stdout.flush(), sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        traceback.print_exc()
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    # a fresh interpreter's sys.path after its script's directory and PYTHONPATH
    _SYS_PATH = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    sys.path.insert(0, str(ROOT))
    serve(sys.argv[1])
