"""What a trainer rank does with SGLang where torchrun's environment matters, run as processes of
their own by tests/test_torchrun_engines.py:

    serve MODEL DTYPE TP        a stand-in SGLang server (sglang_standin) in this process, outside
                                torchrun as a real one is; prints its URL, serves until stdin closes
    remote MODEL RUN URL...     under torchrun: an FSDP2-sharded model (2 ranks) pushes its weights
                                over a weight group (the nccl path, on gloo) to the servers, then
                                every rank's rollouts must carry the trainer's log-probs
    colocated MODEL DIR JOBS    under torchrun: an in-process engine (the fake sglang module) whose
                                scheduler, a spawned process, builds its process group as SGLang's
                                does; writes its ports to DIR and holds them until JOBS jobs have

Every wait is bounded (WAIT_S), so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import rollout  # noqa: E402

WAIT_S = 90.0


def serve(model_dir: str, dtype: str, tp_size: str) -> None:
    from sglang_standin import StandinSGLangServer
    server = StandinSGLangServer(model_dir, tp_size=int(tp_size))
    server.info |= {"dtype": dtype, "enable_fp32_lm_head": True}  # received in dtype, kept fp32
    print(server.start().url, flush=True)
    sys.stdin.read()
    server.stop()


def remote(model_dir: str, run_dir: str, urls: list[str]) -> None:
    from test_rollout_sglang import PROMPTS, perturbed, trainer_logprobs
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    dist.init_process_group("gloo", timeout=timedelta(seconds=WAIT_S))
    rollout.WEIGHT_GROUP_TIMEOUT_S = rollout.HTTP_TIMEOUT_S = WAIT_S
    model = perturbed(model_dir)
    reference = perturbed(model_dir).to(torch.bfloat16).float()  # what bf16 servers hold
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    gathered, full_tensor = set(), DTensor.full_tensor
    DTensor.full_tensor = lambda t, **kw: gathered.add(t.dtype) or full_tensor(t, **kw)
    engine = rollout.RemoteSGLangEngine(urls, model_dir, run_dir, group_backend="gloo")
    engine.update_weights(model, 1)
    c = engine.generate([PROMPTS[0]], rollout.SamplingParams(8, 0.7), [dist.get_rank()])[0]
    gap = float((trainer_logprobs(reference, PROMPTS[0], c, 0.7)
                 - torch.tensor(c.logprobs)).abs().max())
    # a file per rank: two ranks' lines on one stdout may interleave
    with open(os.path.join(run_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "sync": engine.weight_sync, "gap": gap,
                   "gathered": sorted(str(d) for d in gathered)}, f)
    engine.shutdown()
    dist.destroy_process_group()


def colocated(model_dir: str, out_dir: str, jobs: int) -> None:
    import pytest
    from test_rollout_sglang import install_fake_sglang
    log = install_fake_sglang(pytest.MonkeyPatch(), new=True, scheduler=True)
    engine = rollout.SGLangEngine(model_dir, device="cpu")
    kw = log[0][1]
    with open(os.path.join(out_dir, f"{os.getpid()}.json"), "w") as f:
        json.dump({"port": kw["port"], "nccl_port": kw["nccl_port"],
                   "local_rank": os.environ["LOCAL_RANK"]}, f)
    deadline = time.monotonic() + WAIT_S  # the ports stay bound until every job has started
    while len(os.listdir(out_dir)) < jobs and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"], "torchrun's environment is back"
    engine.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    role, *args = sys.argv[1:]
    if role == "serve":
        serve(*args)
    elif role == "remote":
        remote(args[0], args[1], args[2:])
    else:
        colocated(args[0], args[1], int(args[2]))
