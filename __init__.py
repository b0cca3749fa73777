"""Installed (`pip install -e .`), `import nanoareal` is the trainer, nanoareal.py: the environment
gains that one name. The flat files import each other by plain names (`from cli import rank`), so a
clone runs as it is (`python nanoareal.py`); installed, those names stand for nanoareal.cli, ...
only while the files load: the environment's own `cli`, `logs`, ... never shadow them, nor are
shadowed. (pytest imports this folder too, by the folder's name: nothing happens.)"""

import importlib.util
import os
import sys

# in the order they import each other; the trainer imports them all and none imports it
HELPERS = (
    "cli",
    "logs",
    "loss",
    "attention",
    "lora",
    "modeling",
    "rollout",
    "packing",
    "checkpoint",
    "tasks",
)


def _trainer(name: str):
    here = os.path.dirname(os.path.abspath(__file__))
    # a clone on the path (tests)
    if here in (os.path.abspath(p or os.curdir) for p in sys.path):
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(here, "nanoareal.py")
        )
        sys.modules[name] = trainer = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(trainer)
        return trainer
    theirs = {h: sys.modules.pop(h) for h in HELPERS if h in sys.modules}
    try:
        for h in HELPERS:
            sys.modules[h] = importlib.import_module(f"{name}.{h}")
        trainer = importlib.import_module(f"{name}.nanoareal")
    finally:
        for h in HELPERS:
            sys.modules.pop(h, None)
        sys.modules.update(theirs)
    trainer.__path__ = __path__  # nanoareal.loss, ... stay importable
    return trainer


if __name__ == "nanoareal":
    sys.modules[__name__] = _trainer(__name__)
