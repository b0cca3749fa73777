"""Test helpers (stand-ins, torchrun workers) live in tests/support/: importable from every test."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))

# The files that run the CLI end to end, longest first. xdist (--dist loadfile, in collection
# order with --no-loadscope-reorder) hands a worker the next file when it is done: a long file
# handed out last would run alone at the end while the other worker idles.
LONGEST_FIRST = ["test_context_parallel.py", "test_ablation.py", "test_checkpoint.py",
                 "test_lora.py", "test_runs.py", "test_torchrun_engines.py", "test_bench.py",
                 "test_rollout_sglang.py", "test_nanoareal.py", "test_staleness.py"]


def pytest_collection_modifyitems(items) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """Each test leaves os.environ as it found it: a variable set in-process (inductor's, a library
    reading its own) would turn every later CLI run of this worker cold (tests/support/warm.py
    runs a command warm only in the environment its zygotes imported under)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module")
def one_rank_group():
    """A world of one in this process (load_model shards with FSDP2), gone after the module."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
