"""`python tests/fault_runner.py [nanoareal flags]`: nanoareal.main() with faults injected, for
test_checkpoint.py.

The faults come from the JSON in NANOAREAL_FAULTS, so nanoareal.py itself carries no test hooks.
Steps are the 0-based loop index (step k logs metrics line k + 1). Keys, all optional:
  pause_in_step: k        at the rollout of step k, touch run_dir/in_step_{k}.rank{r} and sleep
                          (the test kills us)
  pause_ranks: [r, ...]   only these ranks pause in step k (default: all)
  pause_in_save: n        rank 0, saving checkpoint step_n: after every rank's shards are
                          written, before meta.json and the rename, touch run_dir/in_save_{n}
                          and sleep
  reward_raise_at: k      every reward call of step k raises
  reward_hang_at: k       the first reward call of step k (on each rank) sleeps 30 s, past
                          --reward-timeout
  constant_reward_at: k   every reward of step k is 0 on the ranks in constant_ranks (default:
                          all)
  nan_from_step: k        the advantages of step k and later are NaN (non-finite loss, skipped
                          optimizer steps)
  constants: {name: v}    module constants set first ("nanoareal.MAX_BAD_STEPS": 2, ...)
Every rank writes its pid to run_dir/pid.rank{r} at start.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import checkpoint  # noqa: E402
import cli  # noqa: E402
import loss  # noqa: E402
import nanoareal as N  # noqa: E402
import tasks  # noqa: E402

FAULTS = json.loads(os.environ.get("NANOAREAL_FAULTS", "{}"))
RANK = int(os.environ.get("RANK", 0))
RUN_DIR = Path(sys.argv[sys.argv.index("--run-dir") + 1])
STEP = [-1]
HUNG = set()


def touch(name: str) -> None:
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    (RUN_DIR / name).write_text(str(os.getpid()))


def generate(engine, data, prompts, step, cfg, *args, **kwargs):
    STEP[0] = step
    if FAULTS.get("pause_in_step") == step and RANK in FAULTS.get("pause_ranks", [RANK]):
        touch(f"in_step_{step}.rank{RANK}")
        time.sleep(600)
    out = _generate(engine, data, prompts, step, cfg, *args, **kwargs)
    if FAULTS.get("nan_from_step", math.inf) <= step:  # nanoareal.set_advantages calls it
        loss.group_advantages = lambda rewards, *a, **k: torch_nan(len(rewards))
    return out


def torch_nan(n: int):
    import torch

    return torch.full((n,), float("nan"))


def reward(text: str, row: dict) -> float:
    step = STEP[0]
    if FAULTS.get("reward_raise_at") == step:
        raise ValueError("injected reward failure")
    if FAULTS.get("reward_hang_at") == step and step not in HUNG:
        HUNG.add(step)
        time.sleep(30)
    if FAULTS.get("constant_reward_at") == step and RANK in FAULTS.get("constant_ranks", [RANK]):
        return 0.0
    return _reward(text, row)


def write_meta(tmp: Path, meta: dict) -> None:
    if FAULTS.get("pause_in_save") == meta["step"]:
        touch(f"in_save_{meta['step']}")
        time.sleep(600)
    _write_meta(tmp, meta)


for name, value in FAULTS.get("constants", {}).items():  # {"nanoareal.MAX_BAD_STEPS": 2, ...}
    module, _, attr = name.rpartition(".")
    setattr(sys.modules[module], attr, value)
_generate, _reward, _write_meta = N.generate, tasks.REWARDS["exact_match"], checkpoint.write_meta
N.generate, tasks.REWARDS["exact_match"], checkpoint.write_meta = generate, reward, write_meta
touch(f"pid.rank{RANK}")

if __name__ == "__main__":
    cli.exit_now(N.run())
