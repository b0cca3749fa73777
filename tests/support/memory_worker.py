"""torchrun worker for tests/test_memory.py (issue 43 item 1, ranks never disagree on a memory
decision): 2 ranks (gloo, CPU), each told a different GPU memory by modeling.free_memory.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/memory_worker.py MODEL OUT.json

Rank 0 sees a big GPU with an engine holding some of it: alone, it would neither checkpoint nor
keep gradients out of sync (the deferred plan fits). Rank 1 sees a smaller GPU, no engine: alone,
it would checkpoint every layer and reduce-scatter every micro-batch (the deferred plan does not
fit). Each rank runs modeling.gpu_memory (the all_reduce over ranks) on a CUDA device descriptor,
then modeling.load_model with what it returned, and also memory_decisions on its own, unagreed,
numbers; rank 0 saves every rank's report as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
torch.set_num_threads(1)

import modeling  # noqa: E402
import nanoareal as N  # noqa: E402

TOKENS = 2**16  # --micro-batch-tokens: activations of GiB scale (the plan line in GiB)


def shape(model_dir: str) -> modeling.Shape:
    """The plan's Shape of the model as load_model sees it: built on the meta device, fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                  dtype=torch.float32)
    return modeling.shape_of(module, mixed=False)


def gpus(s: modeling.Shape, world: int) -> list[tuple[int, int]]:
    """Each rank's (free, total): rank 0 a GPU 4x the plan without checkpointing, an engine holding
    a quarter of the gradient a deferred sync keeps whole besides; rank 1 no engine, a GPU between
    the checkpointed plan with gradients synced and with them deferred (both with rank 0's
    engine, as the agreed numbers count it)."""
    plan = lambda checkpointing, unsharded, engine: modeling.memory_plan(
        s, world, TOKENS, checkpointing, grads_unsharded=unsharded, engine=(engine, engine))
    whole = plan("full", True, 0)["total"] - plan("full", False, 0)["total"]  # unsharded grads
    engine = int(whole // 4)
    big = int(4 * plan("", True, engine)["total"])
    small = int((plan("full", False, engine)["total"] + plan("full", True, engine)["total"]) / 2)
    return [(big - engine, big), (small, small)]


def main(model_dir: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    s = shape(model_dir)
    mine = gpus(s, world)[rank]
    modeling.free_memory = lambda device: mine  # this rank's GPU, as torch.cuda would say it
    gpu, engine = modeling.gpu_memory(torch.device("cuda", 0))  # a descriptor: gloo reduces
    cfg = replace(N.Config(), model=model_dir, micro_batch_tokens=TOKENS, compile=False)
    model = modeling.load_model(cfg, torch.device("cpu"), world=world,
                                memory={"gpu": gpu, "engine": engine})
    plan = next(x for x in model.summary.splitlines() if x.startswith("memory per rank"))
    used = mine[1] - mine[0]  # alone: its own numbers straight to the decisions
    alone = modeling.memory_decisions(s, world, TOKENS, model.compiled, mine, (used, used))
    report = {"rank": rank, "own": list(mine), "gpu": list(gpu), "engine": list(engine),
              "checkpointing": model.checkpointing, "defer_grad_sync": model.defer_grad_sync,
              "plan": plan, "decided": list(modeling.memory_decisions(
                  s, world, TOKENS, model.compiled, gpu, engine)),
              "alone": list(alone)}
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    # then exit without interpreter teardown, as nanoareal.py does (a rare gloo abort there)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
