"""Rollout engines: turn prompt token ids into sampled completions with behaviour log-probs.

One small interface, a few backends:

    engine.generate(prompt_ids, sampling, seeds) -> list[Completion]  # one per (prompt, seed)
    engine.update_weights(model, step)  # every rank calls it: FSDP2 gathers are collectives
    engine.release_memory() / engine.resume_memory()   # around the training phase (colocated GPU)
    engine.shutdown()

Backends:
- `HFEngine`: plain transformers on CPU (or one GPU). Used by the default run and the tests. It
  keeps its own copy of the weights, exactly like an inference server, so weight sync is a real
  copy.
- SGLang (in-process `sglang.Engine` colocated on the trainer's GPU, or remote servers over
  HTTP): see the SGLang section below.

Behaviour log-probs follow SGLang's definition: `log_softmax(logits / temperature)` of the
sampled token, taken *before* top-p / top-k truncation. The trainer computes its log-probs with
the same temperature so the ratio pi_theta / pi_behave is 1 when the weights are equal.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from cli import UserError


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 disables top-k (SGLang's convention)."""
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class Completion:
    output_ids: list[int]
    logprobs: list[float]
    """Behaviour log-prob of each output token: log_softmax(logits / temperature), before
    top-p/top-k."""
    finish_reason: str
    """"stop" (a stop token was sampled, and is included in output_ids), "length" or "abort"."""


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) for every parameter and buffer of a (possibly FSDP2-sharded) model.

    `DTensor.full_tensor()` is an all-gather: every rank must iterate the same names in the same
    order, even ranks that throw the result away.
    """
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


# -----------------------------------------------------------------------------
# Counter-based sampling noise: the sample drawn for (seed, position) never depends on the batch it
# was generated in, the rank that generated it, or how many other prompts there were. That is what
# makes a run reproducible across world sizes.

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors (or Python ints) holding values in [0, 2^32).

    Products may overflow int64, but only the low 32 bits are kept and those wrap correctly.
    """
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def mix_seed(*parts: int) -> int:
    """Combine integers (seed, step, prompt index, sample index, ...) into one 32-bit seed."""
    h = 0x9E3779B9  # plain Python ints: bit-identical to the tensor version, ~100x faster per call
    for p in parts:
        h = _fmix32(h ^ ((p & _MASK32) * 0x27D4EB2F & _MASK32))
    return h


def gumbel_noise(seeds: torch.Tensor, position: int, vocab_size: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, V] keyed by (seed_b, position, token): argmax(logits + noise) samples
    softmax. Computed on `device` (the logits'): B x V hashes a token are too many for a CPU when
    V is 150k; integer hashing is exact anywhere, so the noise does not depend on the device."""
    seeds = seeds.to(device=device, dtype=torch.int64)
    key = _fmix32(seeds ^ ((position * 0x9E3779B1 + 0x7F4A7C15) & _MASK32))
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    token = (token * 0x632BE5AB) & _MASK32
    h = _fmix32(_fmix32(key[:, None] ^ token[None, :]) ^ 0x5BD1E995)
    u = (h.to(torch.float64) + 0.5) / 2**32
    return -torch.log(-torch.log(u))


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (token ids [B], behaviour log-probs [B]).

    The log-prob is taken from the temperature-scaled distribution before truncation (SGLang's
    definition).
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / sampling.temperature
    logprobs = torch.log_softmax(scaled, dim=-1)
    truncated = scaled
    if sampling.top_k > 0:
        kth = torch.topk(scaled, min(sampling.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        truncated = truncated.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(truncated, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # keep the token that crosses p
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        truncated = truncated.masked_fill(drop, float("-inf"))
    noise = gumbel_noise(seeds, position, logits.shape[-1], logits.device)
    tokens = (truncated.double() + noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# HF backend: batched generation with a KV cache on plain transformers


class HFEngine:
    """Rollouts on a private transformers copy of the policy (CPU default; works on one GPU too)."""

    def __init__(self, model_path: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32,
                 batch_size: int = 512):
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model = self.model.to(self.device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    def update_weights(self, model: nn.Module, step: int = 0) -> None:
        self.version = step
        own = self.model.state_dict()
        for name, tensor in iter_full_tensors(model):
            own[name].copy_(tensor)

    def release_memory(self) -> None:
        """Nothing to release: the HF copy keeps its memory (it is the policy's size, no KV cache
        outlives a generate call)."""

    def resume_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        self.model = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        # Bucketing by prompt length keeps padding (and wasted attention) small.
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        out: list[Completion | None] = [None] * len(prompt_ids)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            for i, c in zip(idx, self._generate_batch([prompt_ids[i] for i in idx], sampling,
                                                       [seeds[i] for i in idx])):
                out[i] = c
        return out  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int]):
        from transformers import DynamicCache

        # Each distinct prompt is prefilled once and its KV cache copied to its rows (a GRPO group
        # shares one prompt), and rows that sampled a stop token leave the batch, so decoding costs
        # ~ the tokens generated. The noise is keyed by (seed, position), so neither changes which
        # token a row samples from its logits.
        unique: dict[tuple[int, ...], int] = {}
        row_prompt = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        B, L = len(prompts), max(len(p) for p in prompts)
        pad = 0
        input_ids = torch.full((len(unique), L), pad, dtype=torch.long)
        attention = torch.zeros((len(unique), L), dtype=torch.long)
        # left padding: every row's next token sits at the same column
        for b, p in enumerate(unique):
            input_ids[b, L - len(p):] = torch.tensor(p)
            attention[b, L - len(p):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        seed_t = torch.tensor(seeds, dtype=torch.int64)
        stop = torch.tensor(sampling.stop_token_ids or [-1], device=self.device)
        cache = DynamicCache()
        # transformers renamed `past_key_values` to `cache` (5.2x); accept both so older versions
        # work too
        params = inspect.signature(self.model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        logits = self.model(input_ids=input_ids, attention_mask=attention,
                            position_ids=position_ids,
                            use_cache=True, **{cache_kw: cache}).logits[:, -1]
        rows = torch.tensor(row_prompt, device=self.device)
        cache.reorder_cache(rows)  # [unique prompts] -> [rows]
        logits, attention, step_pos = logits[rows], attention[rows], position_ids[rows, -1:]
        live = torch.arange(B)  # the original row of every row still in the batch
        tokens = torch.full((B, sampling.max_new_tokens), pad, dtype=torch.long)
        logps = torch.zeros((B, sampling.max_new_tokens), dtype=torch.float32)
        for t in range(sampling.max_new_tokens):
            tok, lp = sample_tokens(logits, sampling, seed_t[live], t)
            tokens[live, t], logps[live, t] = tok.cpu(), lp.float().cpu()
            running = ~torch.isin(tok, stop)
            if t + 1 == sampling.max_new_tokens or not bool(running.any()):
                tokens, logps = tokens[:, : t + 1], logps[:, : t + 1]
                break
            if not bool(running.all()):  # finished rows leave the batch and the cache
                keep = running.nonzero().flatten()
                cache.reorder_cache(keep)
                live, tok = live[keep.cpu()], tok[keep]
                attention, step_pos = attention[keep], step_pos[keep]
            step_pos = step_pos + 1
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], 1)
            logits = self.model(input_ids=tok[:, None], attention_mask=attention,
                                position_ids=step_pos,
                                use_cache=True, **{cache_kw: cache}).logits[:, -1]
        results = []
        tokens, logps = tokens.cpu(), logps.cpu()
        for b in range(B):
            row = tokens[b].tolist()
            n = len(row)
            reason = "length"
            for j, tok_id in enumerate(row):
                if tok_id in sampling.stop_token_ids:
                    n, reason = j + 1, "stop"
                    break
            results.append(Completion(row[:n], logps[b, :n].tolist(), reason))
        return results


# -----------------------------------------------------------------------------
# SGLang: in-process engine colocated on the trainer's GPU, or remote servers over HTTP.
#
# SGLang facts that bite (read from SGLang's source, 0.5.x):
# - Behaviour log-probs (`meta_info["output_token_logprobs"]`, a list of (logprob, token_id,
#   text_or_None)) are log_softmax(logits / temperature) of the sampled token, taken before
#   top-p/top-k truncation. Setting the environment variable SGLANG_RETURN_ORIGINAL_LOGPROB makes
#   them temperature-1 log-probs instead, which breaks the pi_theta / pi_behave ratio for any
#   temperature != 1: we refuse to start with it.
# - temperature 0 is greedy (SGLang turns it into top_k=1 at temperature 1): its log-probs are
#   log_softmax(logits).
# - `finish_reason` is a dict: {"type": "stop", "matched": id}, {"type": "length", "length": n} or
#   {"type": "abort", "message": ...}. With a stop token id, the matched token is the last output
#   token.
# - The KV-cache budget is computed from *free* GPU memory when the engine starts: create the engine
#   before the trainer allocates (nanoareal.main does), and size it with `mem_fraction_static`.
# - Memory release/resume (`enable_memory_saver=True`): tags "kv_cache", "weights" and, where
#   sglang.srt.constants has GPU_MEMORY_TYPE_CUDA_GRAPH, "cuda_graph". Release needs an idle engine;
#   resuming a tag that is not released raises. Order around a training step: release all -> train
#   -> resume "weights" -> push the new weights -> resume "kv_cache" (+ "cuda_graph") -> flush the
#   cache. Resuming the KV cache only after the update leaves room for the gathered weight buckets.
# - From 0.5.21, tensor and distributed weight updates must run inside begin_weight_update() /
#   end_weight_update() (HTTP: POST /begin_weight_update {} and /end_weight_update {}); older
#   versions have neither (the in-process Engine lacks the methods, the HTTP server answers 404).
# - `update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)` sends CUDA-IPC
#   handles; it is the only in-memory path when trainer and engine share a GPU (NCCL between two
#   processes on one GPU fails with "Duplicate GPU detected"). Pass flush_cache=False for all but
#   the last bucket.
# - `sampling_seed` is a per-request sampling parameter only in newer versions (older ones reject
#   unknown keys); we send it when the installed SamplingParams has the field (in-process) or until
#   a server rejects it (remote). SGLang honours it only under enable_deterministic_inference
#   (--sglang-deterministic): otherwise the seed is ignored and rollouts are not reproducible.
# - Control calls (update_weights_from_tensor, begin/end_weight_update, memory release/resume,
#   flush_cache; their HTTP routes) report failure in their result, (success, message) or
#   {"success": false, "message": ...}, instead of raising: every result is checked (_succeeded).
# - Empty the trainer's CUDA cache before resume_memory_occupation (sglang issue #14092).
# - /server_info (from 0.5.10) replaces the deprecated /get_server_info.

def _finish_type(finish_reason) -> str:
    if isinstance(finish_reason, dict):
        return str(finish_reason.get("type", "abort"))
    return "abort" if finish_reason is None else str(finish_reason)


def completion_from_sglang(out: dict) -> Completion:
    """One SGLang generate result (HTTP JSON or in-process dict) -> Completion.

    Token ids come from `output_token_logprobs` so ids and log-probs can never be misaligned.
    """
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    if not pairs and out.get("output_ids"):
        raise RuntimeError("SGLang returned output_ids without output_token_logprobs: send "
                           "return_logprob=True")
    return Completion(ids, logprobs, _finish_type(meta.get("finish_reason")))


def _sampling_dict(sampling: SamplingParams, max_new_tokens: int, seed: int | None) -> dict:
    d = {"max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
         "top_p": sampling.top_p,
         "top_k": sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids),
         "skip_special_tokens": False, "no_stop_trim": True}
    if seed is not None:
        d["sampling_seed"] = int(seed) & 0x7FFFFFFF
    return d


def _check_logprob_env() -> None:
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        raise RuntimeError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return "
                           "temperature-1 log-probs, but nanoareal's trainer uses "
                           "log_softmax(logits / temperature). Unset it.")


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    """No rank may generate before rank 0 has finished pushing weights to the servers."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def iter_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None
                 ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """Group (name, tensor) into buckets of about `bucket_bytes`; yield (bucket, is_last).

    Floating-point tensors are cast to `dtype` (the engine's dtype); one bucket is held back so
    the last one is known (it is the one that flushes the cache). A tensor larger than the budget
    forms a bucket of its own.
    """
    pending, size, ready = [], 0, None
    for name, t in named:
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        if pending and size + t.numel() * t.element_size() > bucket_bytes:
            if ready is not None:
                yield ready, False
            ready, pending, size = pending, [], 0
        pending.append((name, t))
        size += t.numel() * t.element_size()
    if ready is not None:
        yield ready, not pending
    if pending:
        yield pending, True


class SGLangEngine:
    """One in-process `sglang.Engine` per rank (tp=1) on this rank's GPU, sharing it with the
    trainer."""

    def __init__(self, model_path: str, gpu_id: int = 0, mem_fraction: float = 0.5, seed: int = 0,
                 bucket_mb: int = 512, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", deterministic: bool = False,
                 **engine_kwargs):
        import sglang  # lazy: an optional extra

        _check_logprob_env()
        if deterministic:  # the only mode in which SGLang honours a request's sampling_seed
            engine_kwargs["enable_deterministic_inference"] = True
        self.engine = sglang.Engine(model_path=model_path, mem_fraction_static=mem_fraction,
                                    enable_memory_saver=True, skip_tokenizer_init=True,
                                    base_gpu_id=gpu_id, tp_size=1, random_seed=seed,
                                    **engine_kwargs)
        self.dtype, self.device = dtype, torch.device(device)
        self.bucket_bytes = int(bucket_mb * 2**20)
        # SGLang >= 0.5.21
        self.has_weight_update_session = hasattr(self.engine, "begin_weight_update")
        try:
            from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH  # absent in older versions
            self.tags = ["kv_cache", "weights", GPU_MEMORY_TYPE_CUDA_GRAPH]
        except ImportError:
            self.tags = ["kv_cache", "weights"]
        self.send_seed = _sampling_params_accept("sampling_seed")
        self.released: set[str] = set()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        if not prompt_ids:
            return []
        # never generate without a KV cache
        self._resume([t for t in self.tags if t in self.released])
        params = [_sampling_dict(sampling, sampling.max_new_tokens,
                                 s if self.send_seed else None) for s in seeds]
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_ids], sampling_params=params,
                                    return_logprob=True)
        return [completion_from_sglang(o) for o in outs]

    def release_memory(self) -> None:
        """Before training: free KV cache, weights (and CUDA graphs). The engine must be idle (it
        is: generate returns only when every request has finished)."""
        tags = [t for t in self.tags if t not in self.released]
        if tags:
            _succeeded(self.engine.release_memory_occupation(tags=tags),
                       f"release_memory_occupation({tags})")
            self.released.update(tags)

    def resume_memory(self, step: int | None = None) -> None:
        """After training: bring back the weights only; the KV cache comes back at the end of
        update_weights."""
        self._resume(["weights"] if "weights" in self.released else [], step)

    def _resume(self, tags: list[str], step: int | None = None) -> None:
        if tags:
            # the trainer's cached blocks would leave SGLang's allocator too little to map its
            # memory back (sglang issue #14092: "cu_mem_create ... out of memory")
            torch.cuda.empty_cache()
            _succeeded(self.engine.resume_memory_occupation(tags=tags),
                       f"resume_memory_occupation({tags})", step)
            self.released.difference_update(tags)

    @torch.no_grad()
    def update_weights(self, model: nn.Module, step: int = 0) -> None:
        """Every rank: gather full tensors (collectives), push them to its own engine in buckets,
        then resume the KV cache and flush it (cached prefixes were computed with the old
        weights). A control call that reports failure raises with SGLang's message and the step:
        generating from half-updated or released weights must never go unnoticed."""
        self.version = step
        self.resume_memory(step)
        if self.has_weight_update_session:
            _succeeded(self.engine.begin_weight_update(), "begin_weight_update", step)
        try:
            for bucket, last in iter_buckets(iter_full_tensors(model), self.bucket_bytes,
                                             self.dtype, self.device):
                _succeeded(self.engine.update_weights_from_tensor(named_tensors=bucket,
                                                                  flush_cache=last),
                           "update_weights_from_tensor", step)
        finally:
            if self.has_weight_update_session:
                _succeeded(self.engine.end_weight_update(), "end_weight_update", step)
        self._resume([t for t in self.tags if t in self.released], step)
        _succeeded(self.engine.flush_cache(), "flush_cache", step)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _sampling_params_accept(name: str) -> bool:
    """Whether the installed SGLang's SamplingParams has a field `name`. From 0.5.20 it is a
    msgspec.Struct, whose __init__ signature is (*args, **kwargs): read its fields instead."""
    try:
        from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    except ImportError:
        return False
    fields = getattr(SGLangSamplingParams, "__struct_fields__", None)  # msgspec.Struct
    if fields is None and hasattr(SGLangSamplingParams, "__dataclass_fields__"):
        fields = SGLangSamplingParams.__dataclass_fields__
    if fields is None:
        fields = inspect.signature(SGLangSamplingParams.__init__).parameters
    return name in fields


def _succeeded(result, what: str, step: int | None = None, where: str = ""):
    """Raise if an SGLang control call reported failure: the in-process Engine returns (success,
    message) or an object with .success, the HTTP server {"success": false, "message": ...};
    neither raises by itself. Returns the result."""
    ok, message = True, ""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    elif isinstance(result, dict) and "success" in result:
        ok, message = bool(result["success"]), result.get("message", "")
    elif hasattr(result, "success"):
        ok, message = bool(result.success), getattr(result, "message", "")
    if not ok:
        at = (f" at step {step}" if step is not None else "") + (f" on {where}" if where else "")
        raise RuntimeError(f"SGLang {what} failed{at}: {message or '(no message)'}")
    return result


class HTTPError(RuntimeError):
    def __init__(self, url: str, status: int, body):
        super().__init__(f"{url}: HTTP {status}: {body}")
        self.url, self.status, self.body = url, status, body


class RemoteSGLangEngine:
    """SGLang servers over HTTP (stdlib only): native /generate, retries, abort resubmission, weight
    sync.

    Every rank holds a client and generates its own prompts; rank 0 alone pushes weights, the
    others only take part in the gathers, and a barrier keeps every rank from generating before
    the push has finished.
    """

    def __init__(self, urls: list[str], model_path: str, run_dir: str = "runs/remote",
                 weight_sync: str = "disk", timeout: float = 600.0, retries: int = 3,
                 abort_retries: int = 3, health_timeout: float = 600.0,
                 bucket_mb: int = 512, sync_dtype: torch.dtype | None = None, backoff: float = 0.5,
                 nccl_addr: str = "", max_workers: int = 64, deterministic: bool = False):
        if not urls:
            raise ValueError("RemoteSGLangEngine needs at least one server URL")
        if weight_sync not in ("disk", "nccl"):
            raise ValueError("remote SGLang servers sync weights by 'disk' or 'nccl', not "
                             f"{weight_sync!r}")
        _check_logprob_env()
        self.urls = [u.rstrip("/") for u in urls]
        self.model_path, self.run_dir, self.weight_sync = model_path, run_dir, weight_sync
        self.timeout, self.retries, self.abort_retries = timeout, retries, abort_retries
        self.backoff, self.bucket_bytes = backoff, int(bucket_mb * 2**20)
        self.sync_dtype, self.nccl_addr = sync_dtype, nccl_addr
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="sglang-http")
        self.send_seed = True
        # url -> server has /begin_weight_update (SGLang >= 0.5.21)
        self.session: dict[str, bool] = {}
        self.version = self.step = 0
        self.nccl_group = None
        self.wait_healthy(health_timeout)
        if deterministic:  # the servers must run in the one mode that honours sampling_seed
            for url in self.urls:
                if not self.server_info(url).get("enable_deterministic_inference"):
                    raise UserError(f"--sglang-deterministic: the SGLang server {url} runs "
                                    "without deterministic inference; launch it with "
                                    "--enable-deterministic-inference")

    # -- HTTP plumbing

    def _request(self, url: str, path: str, payload: dict | None = None,
                 timeout: float | None = None):
        """POST (payload) or GET; retry timeouts, connection errors and 5xx with exponential
        backoff.

        Returns parsed JSON (or text). 4xx raises HTTPError at once: the caller decides (404 =
        older server).
        """
        data = None if payload is None else json.dumps(payload).encode()
        last = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(url + path, data=data,
                                         method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout or self.timeout) as r:
                    body = r.read().decode()
                try:
                    return json.loads(body)
                except json.JSONDecodeError:
                    return body
            except urllib.error.HTTPError as e:
                body = e.read().decode(errors="replace")
                try:
                    body = json.loads(body)
                except json.JSONDecodeError:
                    pass
                if e.code < 500:
                    raise HTTPError(url + path, e.code, body) from None
                last = f"HTTP {e.code}: {body}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise RuntimeError(f"SGLang server {url}{path} failed {self.retries + 1} times; last "
                           f"error: {last}")

    def wait_healthy(self, timeout: float, report_every: float = 5.0) -> None:
        """Poll GET /health_generate on every server until it answers 200 (503 while it loads),
        saying every `report_every` seconds what it waits for (rank 0); a server still not
        healthy after `timeout` seconds is a one-line UserError."""
        start = time.monotonic()
        next_report = start + report_every
        for url in self.urls:
            last = "no answer"
            while True:
                try:
                    req = urllib.request.Request(url + "/health_generate", method="GET")
                    wait = max(1.0, min(30.0, start + timeout - time.monotonic()))
                    with urllib.request.urlopen(req, timeout=wait) as r:
                        if r.status == 200:
                            break
                        last = f"HTTP {r.status}"
                except urllib.error.HTTPError as e:
                    last = f"HTTP {e.code}"
                except (urllib.error.URLError, OSError) as e:
                    last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
                waited = time.monotonic() - start
                if waited >= timeout:
                    raise UserError(f"--rollout-url {url}: no healthy SGLang server after "
                                    f"{timeout:g}s (GET /health_generate: {last}); is it running "
                                    "and reachable from here? (--rollout-health-timeout)")
                if time.monotonic() >= next_report and _rank_world()[0] == 0:
                    print(f"waiting for the SGLang server {url} ({waited:.0f}s of {timeout:g}s; "
                          f"/health_generate: {last})", flush=True)
                    next_report += report_every
                time.sleep(min(1.0, max(0.05, timeout / 50), report_every / 4))

    # -- generation

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        if len(prompt_ids) != len(seeds):
            raise ValueError(f"generate: {len(prompt_ids)} prompts but {len(seeds)} seeds")
        jobs = [self.pool.submit(self._generate_one, self.urls[i % len(self.urls)], p, sampling, s)
                for i, (p, s) in enumerate(zip(prompt_ids, seeds))]
        return [j.result() for j in jobs]

    def _generate_one(self, url: str, prompt: list[int], sampling: SamplingParams,
                      seed: int) -> Completion:
        """One prompt; on finish_reason "abort" (server retracted or restarted the request) resubmit
        prompt + tokens so far with the remaining budget, concatenating tokens and log-probs."""
        ids: list[int] = []
        logprobs: list[float] = []
        reason = "abort"
        for _ in range(self.abort_retries + 1):
            remaining = sampling.max_new_tokens - len(ids)
            if remaining <= 0:
                reason = "length"
                break
            params = _sampling_dict(sampling, remaining, seed)
            out = self._post_generate(url, list(prompt) + ids, params)
            c = completion_from_sglang(out)
            ids += c.output_ids
            logprobs += c.logprobs
            reason = c.finish_reason
            if reason != "abort":
                break
            if ids and ids[-1] in sampling.stop_token_ids:
                reason = "stop"
                break
        return Completion(ids, logprobs, reason)

    def _post_generate(self, url: str, input_ids: list[int], params: dict) -> dict:
        if not self.send_seed:
            params.pop("sampling_seed", None)
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
                   "rid": uuid.uuid4().hex}
        try:
            return self._request(url, "/generate", payload)
        except HTTPError as e:
            if e.status == 400 and "sampling_seed" in str(e.body) and "sampling_seed" in params:
                self.send_seed = False  # an older server: its SamplingParams has no sampling_seed
                params.pop("sampling_seed")
                payload["rid"] = uuid.uuid4().hex
                return self._request(url, "/generate", payload)
            raise

    # -- weight sync

    def release_memory(self) -> None:
        """Servers own their GPUs: nothing to release."""

    def resume_memory(self) -> None:
        pass

    def server_info(self, url: str) -> dict:
        """GET /server_info (SGLang >= 0.5.10), else the deprecated /get_server_info: the server's
        arguments (tp_size, enable_deterministic_inference, ...) and version."""
        try:
            info = self._request(url, "/server_info")
        except HTTPError as e:
            if e.status != 404:
                raise
            info = self._request(url, "/get_server_info")
        return info if isinstance(info, dict) else {}

    def _session(self, url: str, which: str) -> None:
        """POST /begin_weight_update or /end_weight_update where the server has them (404: SGLang <
        0.5.21); a refusal raises with the server's message."""
        if self.session.get(url) is False:
            return
        try:
            out = self._request(url, f"/{which}_weight_update", {})
            self.session[url] = True
        except HTTPError as e:
            if e.status != 404:
                raise RuntimeError(f"SGLang {which}_weight_update failed at step {self.step} on "
                                   f"{url}: {e.body}") from None
            self.session[url] = False
            return
        _succeeded(out, f"{which}_weight_update", self.step, url)

    def _all(self, fn, *args) -> list:
        """Run fn(url, *args) on every server concurrently; re-raise the first error."""
        return [f.result() for f in [self.pool.submit(fn, u, *args) for u in self.urls]]

    @torch.no_grad()
    def update_weights(self, model: nn.Module, step: int = 0) -> None:
        self.step = self.version = step  # for the error messages of the calls below
        if self.weight_sync == "disk":
            self._update_from_disk(model)
        else:
            self._update_from_distributed(model)
        _barrier()

    def _update_from_disk(self, model: nn.Module) -> None:
        rank, _ = _rank_world()
        path = self.write_weights(model, rank)
        if rank == 0:
            self._all(self._load_from_disk, path)
            self._all(self._flush)
            self._cleanup_old(path)

    def _flush(self, url: str) -> None:
        """/update_weights_from_disk already flushes; this one is belt and braces, so a 400
        (requests still running) is only reported."""
        try:
            self._request(url, "/flush_cache", {})
        except HTTPError as e:
            print(f"warning: {e}", flush=True)

    def _load_from_disk(self, url: str, path: str) -> None:
        self._session(url, "begin")
        try:
            out = self._request(url, "/update_weights_from_disk", {"model_path": path})
        except HTTPError as e:
            raise RuntimeError(f"SGLang update_weights_from_disk failed at step {self.step} on "
                               f"{url} ({path}): {e.body}") from None
        finally:
            self._session(url, "end")
        _succeeded(out, "update_weights_from_disk", self.step, f"{url} ({path})")

    def write_weights(self, model: nn.Module, rank: int = 0) -> str | None:
        """Every rank gathers; rank 0 writes `model.safetensors` + the original config/tokenizer
        files to <run_dir>/weights_sync/step_<n>, via a temporary directory renamed into place
        (never half-written)."""
        from safetensors.torch import save_file

        self.version += 1
        tensors = {}
        for name, t in iter_full_tensors(model):
            if rank == 0:
                if self.sync_dtype is not None and t.is_floating_point():
                    t = t.to(self.sync_dtype)
                # copy: tied weights must not share storage
                tensors[name] = t.to("cpu", copy=True).contiguous()
        if rank != 0:
            return None
        root = os.path.abspath(os.path.join(self.run_dir, "weights_sync"))
        final = os.path.join(root, f"step_{self.version:06d}")
        tmp = os.path.join(root, f".tmp_step_{self.version:06d}_{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if os.path.isdir(self.model_path):
            for f in os.listdir(self.model_path):
                src = os.path.join(self.model_path, f)
                weights = f.endswith((".safetensors", ".bin", ".pt",
                                      ".pth")) or f.endswith(".index.json")
                if os.path.isfile(src) and not weights:
                    shutil.copy2(src, os.path.join(tmp, f))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def _cleanup_old(self, keep: str) -> None:
        root = os.path.dirname(keep)
        for d in os.listdir(root):
            p = os.path.join(root, d)
            if p != keep and d.startswith("step_"):
                shutil.rmtree(p, ignore_errors=True)

    def _update_from_distributed(self, model: nn.Module) -> None:
        """NCCL: rank 0 of the trainer broadcasts each tensor to every server's TP ranks over a
        group of its own; per bucket, the servers receive (`/update_weights_from_distributed`)
        while rank 0 broadcasts."""
        import torch.distributed as dist

        rank, _ = _rank_world()
        if rank == 0 and self.nccl_group is None:
            self._init_nccl_group()
        if rank != 0:
            for _ in iter_full_tensors(model):  # take part in the gathers only
                pass
            return
        self._all(self._session, "begin")
        try:
            for bucket, last in iter_buckets(iter_full_tensors(model), self.bucket_bytes,
                                             self.sync_dtype or torch.bfloat16, "cuda"):
                meta = {"names": [n for n, _ in bucket],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                        "flush_cache": last}
                posts = [self.pool.submit(self._request, u, "/update_weights_from_distributed",
                                          meta)
                         for u in self.urls]
                # the servers' receives are posted above and block until these broadcasts
                for _, t in bucket:
                    dist.broadcast(t, src=0, group=self.nccl_group)
                for p in posts:
                    _succeeded(p.result(), "update_weights_from_distributed", self.step)
        finally:
            self._all(self._session, "end")

    def _init_nccl_group(self) -> None:
        """Group = trainer rank 0 (rank 0) + every server's TP ranks (rank_offset onwards), created
        the way SGLang creates its side (rendezvous on tcp://addr:port, PrefixStore(group_name),
        _new_process_group_helper)."""
        tp = [int(self.server_info(u).get("tp_size", 1)) for u in self.urls]
        world = 1 + sum(tp)
        addr = self.nccl_addr or f"{socket.gethostbyname(socket.gethostname())}:0"
        host, _, port = addr.rpartition(":")
        port = int(port) or _free_port()
        self.group_name = f"nanoareal_weights_{uuid.uuid4().hex[:8]}"
        offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        posts = [self.pool.submit(self._request, u, "/init_weights_update_group",
                                  {"master_address": host, "master_port": port, "rank_offset": off,
                                   "world_size": world, "group_name": self.group_name,
                                   "backend": "nccl"})
                 for u, off in zip(self.urls, offsets)]
        self.nccl_group = init_weight_group(host, port, world, self.group_name)
        for p in posts:
            _succeeded(p.result(), "init_weights_update_group", self.step)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_weight_group(host: str, port: int, world_size: int, group_name: str, rank: int = 0,
                      backend: str = "nccl"):
    """A process group outside the default one (the trainer's torchrun world), joined by the rollout
    servers.

    This mirrors SGLang's server side so both ends derive the same store keys: tcp:// rendezvous,
    a PrefixStore named after the group, then torch's private `_new_process_group_helper` (its
    options argument is `backend_options` in recent torch, `pg_options` in older; the same torch
    version on both ends is safest).
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(minutes=10)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    opts = {("backend_options" if "backend_options" in params else "pg_options"): None}
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout, **opts)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def check_rollout_config(backend: str, urls: list[str], weight_sync: str, deterministic: bool,
                         cuda: bool) -> None:
    """Every rollout flag's combination and the GPU-only settings, before anything loads; raises
    UserError."""
    if backend == "hf" and urls:
        raise UserError("config error: --rollout-url needs --rollout-backend sglang")
    if backend == "hf" and deterministic:
        raise UserError("config error: --sglang-deterministic is for --rollout-backend sglang (the "
                        "hf engine is always reproducible from --seed)")
    if urls and weight_sync == "tensor":
        raise UserError("config error: --weight-sync tensor needs an in-process engine (drop "
                        "--rollout-url)")
    if backend == "sglang" and not urls:
        if weight_sync not in ("auto", "tensor"):
            raise UserError(f"config error: the in-process SGLang engine syncs weights by tensor, "
                            f"not {weight_sync!r} (use --rollout-url for disk/nccl)")
        if not cuda:
            raise UserError("config error: --rollout-backend sglang without --rollout-url runs "
                            "SGLang in-process and needs a GPU; none is available (pass "
                            "--rollout-url, or --rollout-backend hf)")
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            raise UserError("config error: --rollout-backend sglang runs SGLang in-process, but "
                            "sglang is not installed (pip install -e '.[gpu]'; see the README)")


def make_engine(backend: str, urls: list[str], model_path: str, device: torch.device, *,
                run_dir: str, seed: int, deterministic: bool = False, weight_sync: str = "auto"):
    """The engine --rollout-backend names: HF on this rank's device, SGLang servers (urls) or an
    in-process SGLang engine on this GPU."""
    if backend == "hf":
        engine = HFEngine(model_path, device=device,
                          dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        engine.overlaps = True
    elif urls:
        sync = "disk" if weight_sync == "auto" else weight_sync
        engine = RemoteSGLangEngine(urls, model_path, run_dir, weight_sync=sync,
                                    sync_dtype=torch.bfloat16 if device.type == "cuda" else None,
                                    deterministic=deterministic)
        engine.overlaps = True
    else:
        engine = SGLangEngine(model_path, gpu_id=device.index or 0, seed=seed, device=device,
                              deterministic=deterministic)
        engine.overlaps = False
    engine.version = 0
    return engine
