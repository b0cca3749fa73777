"""torchrun never hangs an engine, and engines started together never share a port: the trainer
under real torchrun (tests/support/torchrun_engines.py), the servers as processes of their own.

torchrun sets TORCHELASTIC_USE_AGENT_STORE in its workers: any tcp:// rendezvous they or their
children start then makes every rank a client of a store nobody hosts, and waits until its timeout.
Both paths that build such a group are run here: the weight group with SGLang servers (the nccl
path, on gloo) and an in-process engine's scheduler, a spawned process that builds its own group.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import warm
from sglang_standin import save_tiny_llama

REPO = str(Path(__file__).resolve().parents[1])
WORKER = "tests/support/torchrun_engines.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TIMEOUT_S = 300  # every run: a hang fails here, the worker's own waits are 90 s


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), WORKER, *args]


def finish(procs: list) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each, all killed at TIMEOUT_S: a hang fails the test."""
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"a run still going after {TIMEOUT_S} s: hung")
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


def start_server(model_dir: str, tp_size: int):
    proc = subprocess.Popen([sys.executable, WORKER, "serve", model_dir, "bfloat16", str(tp_size)],
                            cwd=REPO, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # a real process: it prints its URL on a pipe
    if not select.select([proc.stdout], [], [], 60)[0]:
        proc.kill()
        pytest.fail("the stand-in server did not start in 60 s")
    return proc, proc.stdout.readline().strip()


def test_torchrun_ranks_push_fsdp2_weights_in_bf16_over_a_weight_group_to_server_processes(
        model_dir, tmp_path):
    """2 ranks (FSDP2, gloo) against a stand-in server holding bf16 on 2 TP ranks (processes of
    its own, joined as SGLang's schedulers join): auto picks the group (gloo standing in for
    NCCL), the gathers run in bf16, every rank's rollouts carry the bf16 weights' log-probs."""
    servers = [start_server(model_dir, tp_size=2)]
    try:
        [(code, out, err)] = finish([warm.Popen(
            torchrun(2, "remote", model_dir, str(tmp_path), *[url for _, url in servers]),
            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)])
    finally:
        for proc, _ in servers:
            proc.stdin.close()
            proc.wait(30)
    assert code == 0, f"STDOUT\n{out[-3000:]}\nSTDERR\n{err[-6000:]}"
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["sync"] == "nccl" and r["gathered"] == ["torch.bfloat16"], r
        assert r["gap"] < 5e-5, r  # fp32 noise; unsynced weights: > 1e-3


def test_two_single_gpu_jobs_started_at_once_get_their_own_ports_and_their_engines_start(
        model_dir, tmp_path):
    """Two torchrun jobs on one host, both LOCAL_RANK 0, each starting an in-process engine whose
    scheduler builds its process group as SGLang's does (a store on nccl_port): both start (with
    torchrun's variables inherited, the scheduler waited for a store nobody hosts, then failed),
    with four distinct ports, held at once."""
    jobs = [warm.Popen(torchrun(1, "colocated", model_dir, str(tmp_path), "2"), cwd=REPO,
                       env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for code, out, err in finish(jobs):
        assert code == 0, f"STDOUT\n{out[-3000:]}\nSTDERR\n{err[-6000:]}"
    ports = [json.loads(f.read_text()) for f in tmp_path.iterdir()]
    assert [p["local_rank"] for p in ports] == ["0", "0"]
    assert len({p[k] for p in ports for k in ("port", "nccl_port")}) == 4, ports
