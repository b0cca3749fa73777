"""Checkpoints, resume and the final export: a kill at any moment leaves nothing half-written that
a later run trusts. Prompts and sampling noise are functions of (seed, step): no data to save."""

import contextlib
import hashlib
import itertools
import json
import os
import pickle
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cli
import lora
from cli import Stopped, UserError

KEEP_CHECKPOINTS = 2  # the newest complete checkpoints a run keeps (0: all)
_step = lambda path: int(path.name.removeprefix("step_"))


def atomic_write_text(path: Path, text: str) -> None:
    """path.tmp, fsynced, renamed over `path`: readers see the old file or the new, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints (renamed, with meta.json), oldest first."""
    found = [
        p
        for p in (Path(run_dir) / "checkpoints").glob("step_*")
        if p.name.removeprefix("step_").isdigit() and (p / "meta.json").is_file()
    ]
    return sorted(found, key=_step)


def rng_states() -> dict:
    """Every RNG this process has, as tensors and plain tuples and lists (weights_only loads it)."""
    kind, keys, *rest = np.random.get_state()  # rest: pos, has_gauss, cached
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all(),  # one per device: none without CUDA
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), *rest],
    }


def set_rng_states(state: dict) -> None:
    version, words, gauss = state["python"]  # a list in older checkpoints
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), *rest))


def unreadable(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded (None: it can). Cheap: sizes, not contents."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            return "meta.json has no step"
    except (OSError, ValueError) as e:
        return f"meta.json: {type(e).__name__}: {e}"
    try:
        metadata = SafeReader(path).read_metadata()
    except Exception as e:
        return f".metadata: {type(e).__name__}: {e}"
    ends = {}
    for info in metadata.storage_data.values():
        name = info.relative_path
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if not (path / name).is_file():
            return f"{name} is missing"
        size = (path / name).stat().st_size
        if size < end:
            return f"{name} is truncated ({size} of {end} bytes)"
    return None if (path / "rng_rank0.pt").is_file() else "rng_rank0.pt is missing"


def set_aside(path: Path, suffix: str, first: int = 0) -> Path:
    """`path` renamed to the first free name of path + suffix + "", "-1", "-2", ... (from
    -`first`); returns it."""
    for n in itertools.count(first):
        aside = path.with_name(path.name + suffix + (f"-{n}" if n else ""))
        if not aside.exists():
            path.rename(aside)
            return aside


def newest_usable(run_dir: str | Path) -> Path | None:
    """The newest loadable checkpoint; an unreadable one is said and set aside as step_N.broken."""
    for path in reversed(complete_checkpoints(run_dir)):
        problem = unreadable(path)
        if problem is None:
            return path
        aside = set_aside(path, ".broken")
        print(
            f"warning: checkpoint {path} is unreadable ({problem}); moved it to {aside.name}"
        )
    return None


def run_dir_name(dataset: str, aggregation: str, seed: int, config: dict) -> str:
    """runs/<dataset>-<aggregation>-s<seed>-<hash of `config`>: the same command finds its run."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:6]
    return f"runs/{Path(dataset).stem}-{aggregation}-s{seed}-{digest}"


def choose_resume(run_dir: str | Path, resume: str, resuming: bool) -> str | Path | None:
    """Rank 0: --resume's path (this run's newer checkpoints become step_N.abandoned: no auto-resume
    may jump back onto them), or (`resuming`) the newest readable one, or None. Drops *.tmp."""
    for stale in (Path(run_dir) / "checkpoints").glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    if resume in ("auto", "fresh"):
        return newest_usable(run_dir) if resuming else None
    problem = unreadable(Path(resume))
    if problem:
        raise UserError(f"--resume {resume}: unreadable checkpoint ({problem})")
    step = json.loads((Path(resume) / "meta.json").read_text())["step"]  # an int: unreadable
    for path in (p for p in complete_checkpoints(run_dir) if _step(p) > step):
        # a name taken by an earlier such resume: step_N.abandoned-1, ...
        aside = set_aside(path, ".abandoned")
        print(
            f"set aside {path} as {aside.name} (newer than the one resumed from)", flush=True
        )
    return resume


def claim_run_dir(
    run_dir: str | Path,
    config: dict,
    volatile: set[str],
    fresh: bool,
    defaults: dict,
) -> bool:
    """Rank 0, before any write: True when `run_dir` holds this run (config.json equal but for
    `volatile`, new flags at their `defaults`); another run is refused, or (`fresh`) moved aside."""
    root = Path(run_dir)
    results = [p for p in ("metrics.jsonl", "checkpoints", "final") if (root / p).exists()]
    if not results:
        return False
    if fresh:
        aside = set_aside(root, ".old", first=1)
        print(f"moved the run in {root} to {aside}", flush=True)
        return False
    try:
        theirs = json.loads((root / "config.json").read_text())
        changed = sorted(
            k
            for k in set(theirs) | set(config)
            if k not in volatile and theirs.get(k, defaults.get(k)) != config.get(k)
        )
    except (OSError, ValueError):
        changed = ["(config.json missing or unreadable)"]
    if changed:
        raise UserError(
            f"{root} holds another run ({', '.join(results)}; its config differs in "
            f"{', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''}): pass "
            "another --run-dir, or --resume fresh to move it aside"
        )
    return True


def write_config(run_dir: str | Path, config: dict) -> None:
    """run_dir/config.json, which claim_run_dir compares a rerun with."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.json", json.dumps(config, indent=1))


class Preemption:
    """While active, SIGINT and SIGTERM (a scheduler's warning) are only noted, for the loop to end
    its step, save and exit; the first wins (torchrun passes Ctrl-C on a second time)."""

    def __enter__(self):
        self.signals = []
        self.previous = {
            s: signal.signal(s, lambda signum, _: self.signals.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM)
        }
        return self

    def signal_sums(self) -> dict:
        """{"signal": "<number>"} once one came: logs.reduce_metrics spreads it to every rank."""
        return {"signal": str(self.signals[0])} if self.signals else {}

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Interrupted(Stopped):
    """Stopped on a signal at `step`: says where a rerun resumes; exit code 128 + the signal."""

    def __init__(self, run_dir: str | Path, step: int, signum: int):
        last = complete_checkpoints(run_dir)
        at = _step(last[-1]) if last else 0
        saved = f"saved {last[-1]}" if at == step else f"the last good checkpoint is {at}"
        super().__init__(
            f"interrupted by {signal.Signals(signum).name} at step {step}: {saved}; "
            f"rerun the same command to resume from step {at}",
            128 + signum,
        )


def write_meta(tmp: Path, meta: dict) -> None:
    """A checkpoint's last file: once renamed, its presence marks the checkpoint complete."""
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))


def save_checkpoint(
    run_dir: str | Path, step: int, model, optimizer, meta: dict, ahead: dict | None = None
) -> Path:
    """Collective: each rank's DCP shards, RNG states and batches generated ahead into step_N.tmp/,
    then rank 0's meta.json ({"step": step} | meta), the rename to step_N/ and old ones deleted."""
    rank = dist.get_rank()
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    dcp.save(
        dict(zip(("model", "optim"), get_state_dict(model, optimizer))), checkpoint_id=tmp
    )
    for name, obj in (("rng", rng_states()), ("ahead", ahead)):
        # fsynced like DCP's shards: a renamed checkpoint never holds a part of a file
        if obj:
            with open(tmp / f"{name}_rank{rank}.pt", "wb") as f:
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
    dist.barrier()  # every rank's files are written
    if rank == 0:
        write_meta(tmp, {"step": step} | meta)
        # only there when resumed from an older checkpoint
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        # the rename survives a power loss
        fd = os.open(final.parent, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        # this one and the KEEP_CHECKPOINTS - 1 newest before it ([:-0] is empty: 0 keeps all);
        # it is the newest: a resume sets any newer one aside (choose_resume, newest_usable)
        for old in complete_checkpoints(run_dir)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def saved_config(path: str | Path) -> dict | None:
    """The config a checkpoint was saved with (None: `path` is no checkpoint)."""
    meta = Path(path) / "meta.json"
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{meta}: not a checkpoint's meta.json ({cli.why(e)})") from None


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, dict]:
    """Collective: loads model, optimizer and RNGs; returns meta and every rank's batches generated
    ahead, merged (step -> samples), to share out (a run may resume on another number of ranks).
    A checkpoint that passed the cheap checks (sizes, meta.json) yet does not load, or does not
    fit this model (DCP raises CheckpointException, a BaseException), is a UserError naming it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        meta = json.loads((path / "meta.json").read_text())
        sd = dict(zip(("model", "optim"), get_state_dict(model, optimizer)))
        dcp.load(sd, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        set_state_dict(
            model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        # absent on more ranks than saved: rank 0's
        rng = path / f"rng_rank{dist.get_rank()}.pt"
        if not rng.exists():
            rng = path / "rng_rank0.pt"
        set_rng_states(torch.load(rng, weights_only=True))
        ahead = {}
        for part in sorted(path.glob("ahead_rank*.pt")):
            for step, batch in torch.load(part, weights_only=True).items():
                ahead.setdefault(int(step), []).extend(batch)
    except (Exception, CheckpointException) as e:
        raise UserError(
            f"checkpoint {path} cannot be loaded ({cli.why(e)}); move it aside to "
            "resume from the one before it, or check --lora-rank"
        ) from None
    return meta, ahead


def truncate_metrics(path: Path, step: int) -> None:
    """Keep, atomically, the lines of steps <= `step` (a resumed run writes the rest again)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):  # cut by a kill
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
    atomic_write_text(path, "".join(keep))


# what DCP's .metadata may hold besides DCP's metadata classes and torch dtypes
SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles SAFE_GLOBALS, DCP's metadata classes and torch dtypes; refuses any other global."""

    def find_class(self, module, name):
        dcp_meta = module == "torch.distributed.checkpoint.metadata" and (
            "." not in name and name[:1].isupper() or name == "_MEM_FORMAT_ENCODING"
        )
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if not (dcp_meta or dtype or (module, name) in SAFE_GLOBALS):
            # its callers name the checkpoint
            raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader, but `.metadata` (plain pickle) is first unpickled by an allowlist."""

    def read_metadata(self, *args, **kwargs):
        with open(self.path / ".metadata", "rb") as f:  # a Path: FileSystem.init_path
            MetadataUnpickler(f).load()
        return super().read_metadata(*args, **kwargs)


class SafeLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP loads non-tensors (param_groups) with weights_only=False: check with True first."""

    def load_bytes(self, read_item, value):
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


def export_hf(model, adapters: dict | None, tokenizer, src: str, out_dir: Path) -> None:
    """Collective: a from_pretrained- (and SGLang-) loadable copy, renamed from out_dir.tmp/;
    `adapters` (a LoRA config): the merged model, and the adapters in PEFT's format."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return
    adapter = {k: state[k] for k in state if lora.is_adapter(k)}  # final/: the merged model
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # safetensors refuses tied weights (shared storage), from_pretrained re-ties them: the first
    # name of each storage is kept (an empty tensor shares none)
    tensors = {}
    for name, t in lora.merged(state.items(), model):
        key = t.untyped_storage().data_ptr() if t.numel() else name
        tensors.setdefault(key, (name, t.contiguous()))
    save_file(
        dict(tensors.values()), str(tmp / "model.safetensors"), metadata={"format": "pt"}
    )
    AutoConfig.from_pretrained(src).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if adapter:  # and the adapter in PEFT's format in final/adapter/ (--model takes it too)
        lora.save(adapter, adapters, src, tmp / "adapter")
    generation = Path(src) / "generation_config.json"
    if generation.exists():
        shutil.copy(generation, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
