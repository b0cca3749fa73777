"""Checkpoints, resume and the final export: what a run leaves on disk, written so that a kill at
any moment never leaves a half-written file that a later run would trust.

A checkpoint is run_dir/checkpoints/step_000010/: torch DCP shards of the model and the optimizer
(each rank writes its own), each rank's RNG states (rng_rank{r}.pt) and meta.json (step,
scheduler, config, ...), which rank 0 writes last. Everything goes into step_000010.tmp/ first
and is renamed when complete, so a save killed midway is never picked up. The data position needs
no saving: the trainer's prompts and sampling noise are functions of (seed, step).
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from cli import Stopped, UserError

KEEP_CHECKPOINTS = 2  # the newest complete checkpoints a run keeps (0: all)


def atomic_write_text(path: Path, text: str) -> None:
    """Write to path.tmp, fsync, rename over `path`: readers see the old file or the new one, never
    a part."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (a `.tmp` directory, or one without meta.json,
    is not one)."""
    found = [p for p in (Path(run_dir) / "checkpoints").glob("step_*")
             if p.name.removeprefix("step_").isdigit() and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step_")))


def rng_states() -> dict:
    """Every RNG this process has, as tensors and plain lists (loadable with weights_only=True)."""
    import numpy as np

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(words), gauss], "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]}


def set_rng_states(state: dict) -> None:
    import numpy as np

    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype("uint32"), *rest))


def unreadable(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be loaded (None: it can): a missing or empty file, JSON
    that does not parse, a shard shorter than its metadata says. Cheap: sizes, not contents."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            return "meta.json has no step"
    except (OSError, ValueError) as e:
        return f"meta.json: {type(e).__name__}: {e}"
    try:
        metadata = safe_dcp_reader(path).read_metadata()
    except Exception as e:
        return f".metadata: {type(e).__name__}: {e}"
    ends: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None:
            return f"{name} is missing"
        if size < end:
            return f"{name} is truncated ({size} of {end} bytes)"
    if not (path / "rng_rank0.pt").is_file():
        return "rng_rank0.pt is missing"
    return None


def newest_usable(run_dir: str | Path, say=print) -> Path | None:
    """The newest checkpoint that can be loaded. An unreadable one is said in one line and set
    aside as step_N.broken (renamed, never deleted), and the one before is tried."""
    for path in reversed(complete_checkpoints(run_dir)):
        problem = unreadable(path)
        if problem is None:
            return path
        aside = path.with_name(path.name + ".broken")
        n = 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.broken-{n}"), n + 1
        path.rename(aside)
        say(f"warning: checkpoint {path} is unreadable ({problem}); moved it to {aside.name}")
    return None


def run_dir_name(dataset: str, aggregation: str, seed: int, config: dict) -> str:
    """runs/<dataset>-<aggregation>-s<seed>-<hash of `config`> (the flags that change results): the
    same command finds its run again, to resume it; a different one never writes into it."""
    import hashlib

    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:6]
    return f"runs/{Path(dataset).stem}-{aggregation}-s{seed}-{digest}"


def choose_resume(run_dir: str | Path, resume: str, resuming: bool) -> str | None:
    """The checkpoint to start from: --resume's path (this run's newer checkpoints are set aside),
    or (`resuming` this run) its newest readable checkpoint; None for a fresh start. Deletes saves
    killed midway. Rank 0 only."""
    remove_unfinished_saves(run_dir)
    if resume not in ("auto", "fresh"):
        if problem := unreadable(Path(resume)):
            raise UserError(f"--resume {resume}: unreadable checkpoint ({problem})")
        abandon_after(run_dir, int(json.loads((Path(resume) / "meta.json").read_text())["step"]))
        return resume
    found = newest_usable(run_dir) if resuming else None
    return str(found) if found else None


def abandon_after(run_dir: str | Path, step: int) -> None:
    """Set aside (rename to step_N.abandoned) this run's checkpoints newer than `step`: resuming
    from an older one starts a new timeline, and a later auto-resume must not jump back onto the
    old one while metrics.jsonl holds the new."""
    for path in complete_checkpoints(run_dir):
        if int(path.name.removeprefix("step_")) > step:
            path.rename(path.with_name(path.name + ".abandoned"))
            print(f"set aside {path} (newer than the checkpoint resumed from)", flush=True)


def claim_run_dir(run_dir: str | Path, config: dict, volatile: set[str], fresh: bool) -> bool:
    """Make `run_dir` this run's, before anything is written: True when it holds this same run
    (same config.json up to the `volatile` keys) to continue, False when it starts anew. Another
    run's results there are an error unless `fresh` (--resume fresh), which moves whatever is there
    aside to <run_dir>.old-N first (never deleted). Writes nothing else (the run writes config.json
    once it has started: write_config). Rank 0 only."""
    root = Path(run_dir)
    results = [p for p in ("metrics.jsonl", "checkpoints", "final") if (root / p).exists()]
    if results and fresh:
        n = 1
        while (aside := root.with_name(f"{root.name}.old-{n}")).exists():
            n += 1
        root.rename(aside)
        print(f"moved the run in {root} to {aside}", flush=True)
        return False
    if results:
        try:
            theirs = json.loads((root / "config.json").read_text())
            changed = sorted(k for k in set(theirs) | set(config) if k not in volatile
                             and theirs.get(k) != config.get(k))
        except (OSError, ValueError):
            changed = ["(config.json missing or unreadable)"]
        if changed:
            raise UserError(f"{root} holds another run ({', '.join(results)}; its config differs "
                            f"in {', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''}): "
                            "pass another --run-dir, or --resume fresh to move it aside")
    return bool(results)


def write_config(run_dir: str | Path, config: dict) -> None:
    """run_dir/config.json: the flags of the run, which claim_run_dir compares a rerun with."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(run_dir) / "config.json", json.dumps(config, indent=1))


class Preemption:
    """While active, SIGINT and SIGTERM (what a scheduler sends before it preempts a job) only set
    `signal`: the loop finishes its step, saves a checkpoint and exits with 128 + the signal's
    number. Later signals change nothing: under torchrun, Ctrl-C reaches the workers twice (from
    the terminal, then from torchrun). The previous handlers come back on exit."""

    def __enter__(self):
        import signal

        self.signal = None
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum

    def signal_sums(self) -> dict:
        """{"signal": "<number>"} once a signal came, for logs.reduce_metrics (which keeps strings
        whole): a signal that reached one rank stops them all."""
        return {} if self.signal is None else {"signal": str(self.signal)}

    def __exit__(self, *exc) -> None:
        import signal

        for s, handler in self.previous.items():
            signal.signal(s, handler)


class Interrupted(Stopped):
    """The run stopped on a signal at `step`; the message says where it can resume from, the exit
    code is 128 + the signal's number (the shell's convention)."""

    def __init__(self, run_dir: str | Path, step: int, signum: int):
        import signal

        last = complete_checkpoints(run_dir)
        at = int(last[-1].name.removeprefix("step_")) if last else 0
        saved = f"saved {last[-1]}" if at == step else f"the last good checkpoint is {at}"
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}: {saved}; "
                         f"rerun the same command to resume from step {at}", 128 + signum)


def write_meta(tmp: Path, meta: dict) -> None:
    """The last file of a checkpoint; its presence (after the rename) marks the checkpoint complete.
    """
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1))


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, meta: dict,
                    ahead: dict | None = None) -> Path:
    """Collective (every rank calls it): DCP shards, RNGs and this rank's rollout batches generated
    ahead (plain data) into step_N.tmp/, barrier, rank 0 writes meta.json ({"step": step} | meta),
    renames the directory and deletes the oldest beyond KEEP_CHECKPOINTS."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    final = Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)  # fsyncs its files
    torch.save(rng_states(), tmp / f"rng_rank{rank}.pt")
    if ahead:
        torch.save(ahead, tmp / f"ahead_rank{rank}.pt")
    dist.barrier()  # every rank's files are written
    if rank == 0:
        write_meta(tmp, {"step": step} | meta)
        shutil.rmtree(final, ignore_errors=True)  # only there when resumed from an older checkpoint
        tmp.rename(final)
        _fsync_dir(final.parent)
        older = [p for p in complete_checkpoints(run_dir)
                 if int(p.name.removeprefix("step_")) < step]
        keep = KEEP_CHECKPOINTS
        for old in older[: max(len(older) - keep + 1, 0)] if keep > 0 else []:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, dict]:
    """Load model, optimizer and this rank's RNG states from a checkpoint (collective); returns its
    meta and every rank's batches generated ahead, merged (step -> the samples' dicts), which the
    caller shares out: a run may resume on another number of ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = json.loads((path / "meta.json").read_text())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=safe_dcp_reader(path), planner=safe_dcp_planner())
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    # a run resumed on more ranks than it saved with: rank 0's
    rng = path / f"rng_rank{dist.get_rank()}.pt"
    set_rng_states(torch.load(rng if rng.exists() else path / "rng_rank0.pt", weights_only=True))
    ahead: dict[int, list] = {}
    for part in sorted(path.glob("ahead_rank*.pt")):
        for step, batch in torch.load(part, weights_only=True).items():
            ahead.setdefault(int(step), []).extend(batch)
    return meta, ahead


def remove_unfinished_saves(run_dir: str | Path) -> None:
    """Delete step_N.tmp/ directories: saves that were killed before they completed (never trusted).
    """
    for stale in (Path(run_dir) / "checkpoints").glob("*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics lines of steps <= `step` (a resumed run writes the rest again), atomically.
    """
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a line cut short by a kill
    atomic_write_text(path, "".join(keep))


def safe_dcp_reader(path: Path):
    """DCP's FileSystemReader unpickles `.metadata` with plain pickle: check it first with an
    unpickler that only knows DCP's metadata classes, torch sizes and dtypes (tensors themselves
    load with weights_only=True)."""
    from torch.distributed.checkpoint import FileSystemReader

    allowed = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            ok = (module, name) in allowed or dtype
            dcp_meta = module == "torch.distributed.checkpoint.metadata"
            ok |= dcp_meta and "." not in name and name[:1].isupper()
            ok |= dcp_meta and name == "_MEM_FORMAT_ENCODING"
            if not ok:
                raise pickle.UnpicklingError(f"{path}/.metadata: refusing to unpickle "
                                             f"{module}.{name}")
            return super().find_class(module, name)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(path) / ".metadata", "rb") as f:
                MetadataUnpickler(f).load()
            return super().read_metadata(*args, **kwargs)

    return Reader(path)


def safe_dcp_planner():
    """DCP loads non-tensor values (the optimizer's param_groups) with
    torch.load(weights_only=False): check each with weights_only=True first (plain numbers,
    strings, lists pass)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            torch.load(value, weights_only=True)
            value.seek(0)
            super().load_bytes(read_item, value)

    return Planner()


def export_hf(model, tokenizer, src: str, out_dir: Path) -> None:
    """Write a `from_pretrained`-loadable safetensors copy (and so SGLang-loadable). Collective: all
    ranks call it; rank 0 writes into a temporary directory renamed when complete, so a crash
    never leaves half a model."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # tied weights (input and output embeddings) share storage; safetensors refuses shared tensors,
    # and from_pretrained re-ties them: keep the first name of each storage
    seen, tensors = set(), {}
    for name, t in state.items():
        if t.numel() == 0 or t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    AutoConfig.from_pretrained(src).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if (Path(src) / "generation_config.json").exists():
        shutil.copy(Path(src) / "generation_config.json", tmp / "generation_config.json")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def on_rank0(fn, *args):
    """fn(*args) on rank 0 alone (decisions about shared files), its result on every rank; a
    UserError it raises is raised on every rank, so all stop together."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn(*args))]
        except UserError as e:
            box = [("error", str(e))]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise UserError(value)
    return value
