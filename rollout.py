"""Rollout engines: prompt token ids -> sampled completions with their behaviour log-probs.

One interface (`Engine`), three backends: `HFEngine` (transformers on this rank's device, its own
copy of the weights), `SGLangEngine` (in-process, on the trainer's GPU) and `RemoteSGLangEngine`
(SGLang servers over HTTP). Behaviour log-probs are SGLang's: log_softmax(logits / temperature)
of the sampled token before top-p/top-k, as the trainer's, so pi/pi_behave is 1 at equal weights.
`Rollouts` (at the end) is the queue of batches in flight that bounded staleness needs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from cli import UserError

HTTP_TIMEOUT_S = 600.0  # one request to a server; a timed-out /generate is aborted, then re-posted
HTTP_RETRIES = 3  # retries of a timeout, connection error or 5xx, backing off exponentially
HTTP_BACKOFF_S = 0.5  # the first back-off; it doubles at every retry
ABORT_TIMEOUT_S = 10.0  # POST /abort_request before a timed-out /generate is re-posted
ABORT_RESUBMITS = 3  # resubmissions (prompt + tokens so far) of a request a server aborted
HEALTH_TIMEOUT_S = 600.0  # how long to wait for a server's /health_generate at start
HTTP_THREADS = 1024  # requests in flight per rank: more than a rank's whole batch
SYNC_BUCKET_MB = 512  # weights per update_weights_from_tensor / _from_distributed call
WEIGHT_GROUP_TIMEOUT_S = 600.0  # the NCCL weight group: its rendezvous and every broadcast
SGLANG_MEM_FRACTION = 0.5  # in-process engine: its share of the GPU (weights + KV cache)
SGLANG_PORT_BASE, SGLANG_PORT_STRIDE = 20000, 10  # in-process engine ports: base + stride x rank


@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k (SGLang's convention)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion:
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each output token
    finish_reason: str  # "stop" (ends in a stop token, included), "length" or "abort"


class Engine(Protocol):
    """What the trainer needs of a rollout engine: one completion per (prompt, seed); every rank
    calls update_weights (FSDP2 gathers are collectives); release/resume_memory bracket the
    training phase (a colocated engine frees the GPU)."""

    version: int  # the policy version (optimizer steps) of the weights it holds
    overlaps: bool  # can generate on a background thread while the trainer trains

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]: ...
    def update_weights(self, model: nn.Module, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def shutdown(self) -> None: ...


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter and buffer of a (possibly FSDP2-sharded) model.
    `full_tensor()` is an all-gather: every rank iterates, in the same order."""
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


# -----------------------------------------------------------------------------
# Counter-based sampling noise: the sample drawn for (seed, position) never depends on the batch,
# the rank or the number of prompts, so a run reproduces across world sizes.

_MASK32 = 0xFFFFFFFF


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors (or ints) in [0, 2^32); products may
    overflow int64, but only their low 32 bits are kept, and those wrap correctly."""
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
    """Gumbel(0, 1) noise [B, V] keyed by (seed_b, position, token): argmax(logits + noise)
    samples softmax; exact integer hashing on the logits' device (B x V hashes: many for a CPU)."""
    seeds = seeds.to(device=device, dtype=torch.int64)
    key = _fmix32(seeds ^ ((position * 0x9E3779B1 + 0x7F4A7C15) & _MASK32))
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    token = (token * 0x632BE5AB) & _MASK32
    h = _fmix32(_fmix32(key[:, None] ^ token[None, :]) ^ 0x5BD1E995)
    u = (h.to(torch.float64) + 0.5) / 2**32
    return -torch.log(-torch.log(u))


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor,
                  position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: (token ids [B], behaviour log-probs [B]), the log-prob taken before
    truncation (SGLang's definition)."""
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
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p  # keeps the token crossing p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        truncated = truncated.masked_fill(drop, float("-inf"))
    noise = gumbel_noise(seeds, position, logits.shape[-1], logits.device)
    tokens = (truncated.double() + noise).argmax(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# HF backend: batched generation with a KV cache on plain transformers


class HFEngine:
    """Rollouts on a private transformers copy of the policy (CPU default; one GPU works too)."""

    overlaps = True  # a background thread hides generation behind training (NOTES: overlap)

    def __init__(self, model_path: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, batch_size: int = 512):
        from transformers import AutoModelForCausalLM

        self.device, self.batch_size, self.version = torch.device(device), batch_size, 0
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32)
        self.model = self.model.to(self.device).eval()

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        own = self.model.state_dict()
        for name, tensor in iter_full_tensors(model):
            own[name].copy_(tensor)
        self.version = version

    def release_memory(self) -> None: ...  # no KV cache outlives a generate call
    def resume_memory(self) -> None: ...

    def shutdown(self) -> None:
        self.model = None

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        assert len(prompt_ids) == len(seeds), "generate: one seed per prompt"
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # less padding
        out: dict[int, Completion] = {}
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            out |= zip(idx, self._generate_batch([prompt_ids[i] for i in idx], sampling,
                                                 [seeds[i] for i in idx]))
        return [out[i] for i in range(len(prompt_ids))]

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int]):
        from transformers import DynamicCache

        # Each distinct prompt is prefilled once and its KV cache copied to its rows (a GRPO group
        # shares one prompt), and rows that sampled a stop token leave the batch, so decoding costs
        # ~ the tokens generated. The noise is keyed by (seed, position): neither changes a sample.
        unique: dict[tuple[int, ...], int] = {}
        row_prompt = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        B, L = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.zeros((len(unique), L), dtype=torch.long)
        attention = torch.zeros((len(unique), L), dtype=torch.long)
        for b, p in enumerate(unique):  # left padding: every row's next token in the same column
            input_ids[b, L - len(p):] = torch.tensor(p)
            attention[b, L - len(p):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        seed_t = torch.tensor(seeds, dtype=torch.int64)
        stop = torch.tensor(sampling.stop_token_ids or [-1], device=self.device)
        cache = DynamicCache()
        # transformers 5.2x renamed `past_key_values` to `cache`; older versions work too
        kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else \
            "past_key_values"
        logits = self.model(input_ids=input_ids, attention_mask=attention,
                            position_ids=position_ids, use_cache=True, **{kw: cache}).logits[:, -1]
        rows = torch.tensor(row_prompt, device=self.device)
        cache.reorder_cache(rows)  # [unique prompts] -> [rows]
        logits, attention, step_pos = logits[rows], attention[rows], position_ids[rows, -1:]
        live = torch.arange(B)  # the original row of every row still in the batch
        tokens = torch.zeros((B, sampling.max_new_tokens), dtype=torch.long)
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
                                position_ids=step_pos, use_cache=True, **{kw: cache}).logits[:, -1]
        stops, rows = set(sampling.stop_token_ids), tokens.tolist()
        ends = [next((j + 1 for j, t in enumerate(r) if t in stops), len(r)) for r in rows]
        return [Completion(r[:n], lps[:n], "stop" if set(r[n - 1 : n]) & stops else "length")
                for r, lps, n in zip(rows, logps.tolist(), ends)]


# -----------------------------------------------------------------------------
# SGLang, in-process or remote. Facts that bite (read from its source, 0.5.10-0.5.23):
# - output_token_logprobs is [(logprob, token_id, None)], log_softmax(logits / T) before top-p/k;
#   SGLANG_RETURN_ORIGINAL_LOGPROB would make it T=1 (refused). The KV-cache budget comes from
#   the GPU memory free at start: create the engine first.
# - Memory release/resume: enable_memory_saver=True, an idle engine, tags kv_cache, weights,
#   cuda_graph; resuming an unreleased tag raises. A step: release all -> train -> resume weights
#   -> push -> resume the rest -> flush, so the pushed buckets are freed before the KV cache
#   returns; empty the trainer's CUDA cache first (sglang #14092: cu_mem_create out of memory).
# - From 0.5.21 tensor and distributed updates run between begin_weight_update() and
#   end_weight_update() (HTTP: 404 before). A disk update must not: it post-processes the weights
#   itself (load_weights_and_postprocess) and leaves the session unmarked, so end would run
#   post_load_weights and process_weights_after_loading again.
# - update_weights_from_tensor (CUDA IPC) is the only in-memory path on a shared GPU (NCCL on one
#   GPU: "Duplicate GPU detected"). Control calls report failure in their result ((success, msg),
#   {"success": false}) instead of raising: every result is checked.


def completion_from_sglang(out: dict, stop_ids: list[int]) -> Completion:
    """One SGLang result (HTTP JSON or in-process dict) -> Completion, its ids from
    output_token_logprobs (never misaligned). A stop id sampled as the last allowed token is
    "length" in SGLang <= 0.5.17 (it tests the length first), "stop" from 0.5.18: tokens decide."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    if not pairs and out.get("output_ids"):
        raise RuntimeError("SGLang returned output_ids without output_token_logprobs: send "
                           "return_logprob=True")
    ids, reason = [int(p[1]) for p in pairs], meta.get("finish_reason")
    reason = reason.get("type", "abort") if isinstance(reason, dict) else reason or "abort"
    return Completion(ids, [float(p[0]) for p in pairs],
                      "stop" if ids and ids[-1] in stop_ids else reason)


def _sampling_dict(sampling: SamplingParams, max_new_tokens: int, seed: int | None) -> dict:
    d = {"max_new_tokens": max_new_tokens, "temperature": sampling.temperature, "top_p":
         sampling.top_p, "top_k": sampling.top_k, "stop_token_ids": list(sampling.stop_token_ids),
         "skip_special_tokens": False, "no_stop_trim": True}
    return d if seed is None else d | {"sampling_seed": int(seed) & 0x7FFFFFFF}


def _check_logprob_env() -> None:
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        raise RuntimeError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return T=1 "
                           "log-probs, the trainer's are log_softmax(logits / T). Unset it.")


_rank = lambda: dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "float32": torch.float32}


def engine_dtype(model_path: str, requested: str | None = "auto",
                 fp32_as: torch.dtype | None = None) -> torch.dtype:
    """SGLang's dtype for the weights (a sync rounds them once): `requested` (its --dtype), else the
    config's; an fp32 config runs in `fp32_as`, or SGLang's float16 (Gemma: bfloat16)."""
    if requested in _DTYPES:
        return _DTYPES[requested]
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    d = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if (d := (_DTYPES.get(d) if isinstance(d, str) else d) or torch.float32) != torch.float32:
        return d
    return fp32_as or (torch.bfloat16 if cfg.model_type.startswith("gemma") else torch.float16)


def iter_buckets(named: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None
                 ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(name, tensor) -> (bucket of ~`bucket_bytes`, is_last), floating tensors in `dtype`; one is
    held back so the last (it flushes) is known; a bigger tensor is a bucket of its own."""
    pending, size, ready = [], 0, None
    for name, t in named:
        t = t.to(device=device, dtype=dtype if t.is_floating_point() else None)
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
    """One in-process `sglang.Engine` (tp=1) on this rank's GPU, sharing it with the trainer."""

    overlaps = False  # it must free the GPU memory the trainer trains in

    def __init__(self, model_path: str, gpu_id: int = 0, seed: int = 0,
                 device: torch.device | str = "cuda", deterministic: bool = False,
                 local_rank: int | None = None, **engine_kwargs):
        import sglang  # lazy: an optional extra
        from sglang.srt.constants import GPU_MEMORY_TYPE_CUDA_GRAPH
        from sglang.srt.server_args import ServerArgs

        _check_logprob_env()
        self.dtype = engine_dtype(model_path, fp32_as=torch.bfloat16)  # passed to SGLang too
        self.device, self.version, self.released = torch.device(device), 0, set()
        # SGLang picks free ports by probing, binding them later (0.5.10 get_free_port, 0.5.23 a
        # random one below the ephemeral range): engines started together on one host collide.
        # In-process it binds nccl_port (its scheduler's torch.distributed store; ZMQ uses ipc://
        # files); `port` is the HTTP port and the base of the TCP ZMQ ports under DP attention.
        rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        port = SGLANG_PORT_BASE + SGLANG_PORT_STRIDE * rank
        # an fp32 lm_head (0.5.10 has it): bf16 logits would make pi/pi_behave != 1 at equal weights
        optional = {"port": port, "nccl_port": port + 1, "enable_fp32_lm_head": True}
        fields = getattr(ServerArgs, "__struct_fields__", None) or [  # msgspec from 0.5.20
            f.name for f in dataclasses.fields(ServerArgs)]
        kw = {k: v for k, v in optional.items() if k in fields}
        if deterministic:  # the only mode in which SGLang honours a request's sampling_seed
            kw["enable_deterministic_inference"] = True
        kw |= {"model_path": model_path, "mem_fraction_static": SGLANG_MEM_FRACTION,
               "enable_memory_saver": True, "skip_tokenizer_init": True, "base_gpu_id": gpu_id,
               "tp_size": 1, "random_seed": seed, "dtype": str(self.dtype).removeprefix("torch.")}
        # SGLang spawns its scheduler and detokenizer (multiprocessing spawn: fork + exec) in our
        # process group, so a terminal's Ctrl-C would kill them mid-step. An ignored SIGINT
        # survives exec, Python keeps an inherited SIG_IGN, and they install no handler of their
        # own (0.5.10-0.5.23): spawned while it is ignored, they never see it.
        main = threading.current_thread() is threading.main_thread()
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.engine = sglang.Engine(**kw | engine_kwargs)
        finally:
            if main:
                signal.signal(signal.SIGINT, old)
        self.has_session = hasattr(self.engine, "begin_weight_update")  # SGLang >= 0.5.21
        self.tags = ["kv_cache", "weights", GPU_MEMORY_TYPE_CUDA_GRAPH]

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        assert len(prompt_ids) == len(seeds), "generate: one seed per prompt"
        if not prompt_ids:
            return []
        self._resume([t for t in self.tags if t in self.released])  # never without a KV cache
        params = [_sampling_dict(sampling, sampling.max_new_tokens, s) for s in seeds]
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_ids],
                                    sampling_params=params, return_logprob=True)
        return [completion_from_sglang(o, sampling.stop_token_ids) for o in outs]

    def release_memory(self) -> None:
        """Before training: free KV cache, weights (and CUDA graphs); the engine is idle, since
        generate returns only when every request has finished."""
        if tags := [t for t in self.tags if t not in self.released]:
            _succeeded(self.engine.release_memory_occupation(tags=tags),
                       f"release_memory_occupation({tags})")
            self.released.update(tags)

    def resume_memory(self) -> None:
        """After training: the weights only; the KV cache comes back after update_weights."""
        self._resume(["weights"] if "weights" in self.released else [])

    def _resume(self, tags: list[str]) -> None:
        if tags:
            torch.cuda.empty_cache()  # else SGLang may fail to map its memory back (#14092)
            _succeeded(self.engine.resume_memory_occupation(tags=tags),
                       f"resume_memory_occupation({tags})", self.version)
            self.released.difference_update(tags)

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        """Every rank gathers and pushes to its own engine in buckets of the engine's dtype, then
        resumes the KV cache and flushes it (stale prefixes); a refusal raises with the step."""
        self.version = version
        self.resume_memory()
        if self.has_session:
            _succeeded(self.engine.begin_weight_update(), "begin_weight_update", version)
        try:
            for bucket, last in iter_buckets(iter_full_tensors(model), SYNC_BUCKET_MB * 2**20,
                                             self.dtype, self.device):
                _succeeded(self.engine.update_weights_from_tensor(named_tensors=bucket,
                                                                  flush_cache=last),
                           "update_weights_from_tensor", version)
        finally:
            if self.has_session:
                _succeeded(self.engine.end_weight_update(), "end_weight_update", version)
        self._resume([t for t in self.tags if t in self.released])
        _succeeded(self.engine.flush_cache(), "flush_cache", version)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _succeeded(result, what: str, step: int | None = None, where: str = ""):
    """Raise if an SGLang control call reported failure ((success, message), an object with
    .success, or {"success": false, "message": ...}); return the result."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    elif isinstance(result, dict):
        ok, message = result.get("success", True), result.get("message", "")
    else:
        ok, message = getattr(result, "success", True), getattr(result, "message", "")
    if not ok:
        at = (f" at step {step}" if step is not None else "") + (f" on {where}" if where else "")
        raise RuntimeError(f"SGLang {what} failed{at}: {message or '(no message)'}")
    return result


class HTTPError(RuntimeError):
    def __init__(self, url: str, status: int, body):
        super().__init__(f"{url}: HTTP {status}: {body}")
        self.status, self.body = status, body


def _json(text: str):
    with suppress(json.JSONDecodeError):
        return json.loads(text)
    return text


def weight_group_ranks(url: str, info: dict) -> int:
    """A server's ranks in the weight group (/server_info): SGLang joins each scheduler as
    rank_offset + tp_rank (PP stages collide), refuses DP replicas (not DP attention: inside TP)."""
    tp, pp, dp = (int(info.get(k) or 1) for k in ("tp_size", "pp_size", "dp_size"))
    if pp > 1 or (dp > 1 and not info.get("enable_dp_attention")):
        raise UserError(f"--weight-sync nccl: the SGLang server {url} runs pp_size={pp}, "
                        f"dp_size={dp}; SGLang's update_weights_from_distributed joins only its "
                        "TP ranks (use --weight-sync disk, or a server per replica)")
    return tp


def route_address(url: str) -> str:
    """This host's address on the interface that routes to `url` (a UDP connect sends nothing);
    gethostbyname(gethostname()) can be 127.0.1.1, which no other host reaches."""
    parts = urllib.parse.urlsplit(url)
    family, kind, _, _, addr = socket.getaddrinfo(parts.hostname, parts.port or 80,
                                                  type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind) as s:
        s.connect(addr)
        return s.getsockname()[0]


class RemoteSGLangEngine:
    """SGLang servers over HTTP (stdlib only). Every rank generates its own prompts; rank 0 alone
    pushes weights (the others take part in the gathers), the others wait for it at a barrier."""

    overlaps = True  # the servers generate while the trainer trains

    def __init__(self, urls: list[str], model_path: str, run_dir: str = "runs/remote",
                 weight_sync: str = "disk", deterministic: bool = False, nccl_addr: str = "",
                 group_backend: str = "nccl"):
        assert urls and weight_sync in ("disk", "nccl"), "servers, synced by disk or nccl"
        _check_logprob_env()
        self.urls = [u.rstrip("/") for u in urls]
        self.model_path, self.run_dir, self.weight_sync = model_path, run_dir, weight_sync
        self.nccl_addr, self.group_backend, self.group = nccl_addr, group_backend, None
        self.pool = ThreadPoolExecutor(max_workers=HTTP_THREADS, thread_name_prefix="sglang-http")
        self.send_seed, self.version = True, 0
        self.session: dict[str, bool] = {}  # url -> has /begin_weight_update (SGLang >= 0.5.21)
        self.wait_healthy(HEALTH_TIMEOUT_S)
        self.infos = {u: self.server_info(u) for u in self.urls}
        first, nccl = self.infos[self.urls[0]], weight_sync == "nccl"
        self.group_sizes = [weight_group_ranks(u, self.infos[u]) for u in self.urls if nccl]  # now
        self.sync_dtype = engine_dtype(model_path, first.get("dtype"))
        if deterministic and (bad := [u for u, i in self.infos.items()
                                      if not i.get("enable_deterministic_inference")]):
            raise UserError(f"--sglang-deterministic: the SGLang server {bad[0]} runs without "
                            "deterministic inference; launch it with "
                            "--enable-deterministic-inference")
        if self.sync_dtype != torch.float32 and not first.get("enable_fp32_lm_head") and \
                _rank() == 0:
            print(f"warning: the SGLang server {self.urls[0]} computes its lm_head in "
                  f"{self.sync_dtype}: pi/pi_behave != 1 at equal weights (launch it with "
                  "--enable-fp32-lm-head)", flush=True)

    # -- HTTP plumbing

    def _request(self, url: str, path: str, payload: dict | None = None, before_retry=None,
                 retries: int | None = None, timeout: float | None = None):
        """POST (payload) or GET -> JSON (or text); timeouts, connection errors and 5xx retried
        with back-off, `before_retry()` first; a 4xx raises HTTPError (404: an older server)."""
        last, retries = None, HTTP_RETRIES if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(HTTP_BACKOFF_S * 2 ** (attempt - 1))
                if before_retry is not None:
                    before_retry()
            req = urllib.request.Request(
                url + path, data=None if payload is None else json.dumps(payload).encode(),
                method="GET" if payload is None else "POST",
                headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=timeout or HTTP_TIMEOUT_S) as r:
                    return _json(r.read().decode())
            except urllib.error.HTTPError as e:
                body = _json(e.read().decode(errors="replace"))
                if e.code < 500:
                    raise HTTPError(url + path, e.code, body) from None
                last = f"HTTP {e.code}: {body}"
            except OSError as e:  # URLError, TimeoutError, ConnectionError
                last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
        raise RuntimeError(f"SGLang server {url}{path} failed {retries + 1} times; last error: "
                           f"{last}")

    def _call(self, url: str, route: str, payload: dict, retries: int | None = None) -> dict:
        """POST a control route; a refusal (400, {"success": false}) raises naming call, step and
        server; a 404 raises HTTPError (an older server)."""
        try:
            out = self._request(url, f"/{route}", payload, retries=retries)
        except HTTPError as e:
            if e.status == 404:
                raise
            out = e.body if isinstance(e.body, dict) and "success" in e.body else \
                {"success": False, "message": e.body}
        return _succeeded(out, route, self.version, url)

    def wait_healthy(self, timeout: float, report_every: float = 5.0) -> None:
        """Poll GET /health_generate on every server until 200 (503 while it loads), saying every
        `report_every` s what it waits for (rank 0); a UserError after `timeout` s."""
        start = time.monotonic()
        next_report = start + report_every
        for url in self.urls:
            last = "no answer"
            while True:
                wait = max(1.0, min(30.0, start + timeout - time.monotonic()))
                try:
                    self._request(url, "/health_generate", retries=0, timeout=wait)
                    break
                except RuntimeError as e:  # HTTPError included
                    last = str(e).rpartition("last error: ")[2]
                if (waited := time.monotonic() - start) >= timeout:
                    raise UserError(f"--rollout-url {url}: no healthy SGLang server after "
                                    f"{timeout:g}s (GET /health_generate: {last}); is it running "
                                    "and reachable from here?")
                if time.monotonic() >= next_report and _rank() == 0:
                    print(f"waiting for the SGLang server {url} ({waited:.0f}s of {timeout:g}s; "
                          f"/health_generate: {last})", flush=True)
                    next_report += report_every
                time.sleep(min(1.0, max(0.05, timeout / 50), report_every / 4))

    def server_info(self, url: str) -> dict:
        """The server's arguments (tp_size, dtype, ...): /server_info, < 0.5.10 /get_server_info."""
        try:
            info = self._request(url, "/server_info")
        except HTTPError as e:
            if e.status != 404:
                raise
            info = self._request(url, "/get_server_info")
        return info if isinstance(info, dict) else {}

    # -- generation

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seeds: list[int]) -> list[Completion]:
        assert len(prompt_ids) == len(seeds), "generate: one seed per prompt"
        # a group's samples share their prompt: all on one server keep its prefix cache hot;
        # groups go round robin, offset by rank so that small batches spread too
        group: dict[tuple[int, ...], int] = {}
        for p in prompt_ids:
            group.setdefault(tuple(p), len(group))
        rank = _rank()
        url = lambda p: self.urls[(group[tuple(p)] + rank) % len(self.urls)]
        jobs = [self.pool.submit(self._generate_one, url(p), list(p), sampling, s)
                for p, s in zip(prompt_ids, seeds)]
        return [j.result() for j in jobs]

    def _generate_one(self, url: str, prompt: list[int], sampling: SamplingParams,
                      seed: int) -> Completion:
        """One prompt; a request the server aborts is resubmitted as prompt + tokens so far."""
        ids, logprobs, reason = [], [], "abort"
        for _ in range(ABORT_RESUBMITS + 1):
            if len(ids) >= sampling.max_new_tokens:
                return Completion(ids, logprobs, "length")
            out = self._post_generate(url, prompt + ids, _sampling_dict(
                sampling, sampling.max_new_tokens - len(ids), seed if self.send_seed else None))
            c = completion_from_sglang(out, sampling.stop_token_ids)
            ids, logprobs, reason = ids + c.output_ids, logprobs + c.logprobs, c.finish_reason
            if reason != "abort":
                break
        return Completion(ids, logprobs, reason)

    def _post_generate(self, url: str, input_ids: list[int], params: dict) -> dict:
        payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
                   "rid": uuid.uuid4().hex}

        def abort_and_renew():  # a timed-out request may still run there: abort it first
            try:  # SGLang's POST /abort_request {"rid"}; an unknown rid is a no-op
                self._request(url, "/abort_request", {"rid": payload["rid"]}, retries=0,
                              timeout=ABORT_TIMEOUT_S)
            except RuntimeError:  # best effort: a dead server has nothing left to abort
                pass
            payload["rid"] = uuid.uuid4().hex

        while True:
            try:
                return self._request(url, "/generate", payload, abort_and_renew)
            except HTTPError as e:  # a server whose SamplingParams has no sampling_seed (< 0.5.10)
                if e.status != 400 or "sampling_seed" not in str(e.body) or \
                        params.pop("sampling_seed", None) is None:
                    raise
                self.send_seed, payload["rid"] = False, uuid.uuid4().hex

    # -- weight sync

    def release_memory(self) -> None: ...  # the servers own their GPUs
    def resume_memory(self) -> None: ...

    def _all(self, fn, *args) -> list:
        """fn(url, *args) on every server concurrently; the first error re-raised."""
        return [f.result() for f in [self.pool.submit(fn, u, *args) for u in self.urls]]

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        self.version = version
        if self.weight_sync == "disk":
            path = self.write_weights(model)
            if path is not None:  # rank 0; no begin/end session around a disk update (above)
                self._all(lambda u: self._call(u, "update_weights_from_disk", {"model_path": path}))
                for d in os.listdir(os.path.dirname(path)):  # older syncs
                    if d.startswith("step_") and d != os.path.basename(path):
                        shutil.rmtree(os.path.join(os.path.dirname(path), d), ignore_errors=True)
        else:
            self._update_from_distributed(model)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank generates before rank 0 has pushed the weights

    def write_weights(self, model: nn.Module) -> str | None:
        """Every rank gathers; rank 0 writes model.safetensors (the servers' dtype) and the model's
        other files to <run_dir>/weights_sync/step_<version>, renamed into place when complete."""
        from safetensors.torch import save_file

        rank = _rank()  # every rank iterates (gathers); copies: tied weights share no storage
        tensors = {n: t.to("cpu", self.sync_dtype if t.is_floating_point() else None, copy=True)
                   .contiguous() for n, t in iter_full_tensors(model) if rank == 0}
        if rank != 0:
            return None
        root = os.path.abspath(os.path.join(self.run_dir, "weights_sync"))
        os.makedirs(root, exist_ok=True)
        final, tmp = os.path.join(root, f"step_{self.version:06d}"), tempfile.mkdtemp(dir=root)
        for f in os.listdir(self.model_path) if os.path.isdir(self.model_path) else []:
            src = os.path.join(self.model_path, f)  # config, tokenizer: what SGLang reads besides
            if os.path.isfile(src) and not f.endswith((".safetensors", ".bin", ".pt", ".pth",
                                                       ".index.json")):
                shutil.copy2(src, os.path.join(tmp, f))
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final

    def _session(self, url: str, which: str) -> None:
        """POST /begin_weight_update or /end_weight_update where the server has them."""
        if self.session.get(url) is not False:
            try:
                self._call(url, f"{which}_weight_update", {})
                self.session[url] = True
            except HTTPError:  # 404: SGLang < 0.5.21
                self.session[url] = False

    def _update_from_distributed(self, model: nn.Module) -> None:
        """Rank 0 broadcasts each bucket over the weight group to the servers receiving it."""
        if _rank() != 0:
            for _ in iter_full_tensors(model):  # take part in the gathers only
                pass
            return
        self._all(self._session, "begin")
        try:
            if self.group is None:
                self._init_weight_group()
            device = "cuda" if self.group_backend == "nccl" else "cpu"
            for bucket, last in iter_buckets(iter_full_tensors(model), SYNC_BUCKET_MB * 2**20,
                                             self.sync_dtype, device):
                meta = {"names": [n for n, _ in bucket],
                        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                        "flush_cache": last}
                posts = [self.pool.submit(self._call, u, "update_weights_from_distributed", meta, 0)
                         for u in self.urls]  # no retry: a receive re-posted pairs with nothing
                for _, t in bucket:  # the servers' receives, posted above, wait for these
                    dist.broadcast(t, src=0, group=self.group)
                [p.result() for p in posts]
        finally:
            self._all(self._session, "end")

    def _init_weight_group(self) -> None:
        """The trainer's rank 0 is rank 0; each server's GPU ranks follow from its rank_offset."""
        sizes = self.group_sizes
        host, _, port = (self.nccl_addr or f"{route_address(self.urls[0])}:0").rpartition(":")
        if not (port := int(port)):
            with socket.socket() as s:  # a free one; the rendezvous binds it
                s.bind(("", 0))
                port = s.getsockname()[1]
        self.group_name, world = f"nanoareal_weights_{uuid.uuid4().hex[:8]}", 1 + sum(sizes)
        posts = [self.pool.submit(self._call, u, "init_weights_update_group", {
            "master_address": host, "master_port": port, "rank_offset": 1 + sum(sizes[:i]),
            "world_size": world, "group_name": self.group_name, "backend": self.group_backend}, 0)
            for i, u in enumerate(self.urls)]
        self.group = init_weight_group(host, port, world, self.group_name,
                                       backend=self.group_backend)
        [p.result() for p in posts]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def init_weight_group(host: str, port: int, world_size: int, group_name: str, rank: int = 0,
                      backend: str = "nccl"):
    """A process group outside the trainer's torchrun world, joined by the servers, built as SGLang
    builds its side (init_custom_process_group) so both derive the same store keys: tcp://
    rendezvous, PrefixStore(group_name), torch's private _new_process_group_helper."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S)
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{port}", rank, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    params = inspect.signature(c10d._new_process_group_helper).parameters  # pg_options: older
    opts = {("backend_options" if "backend_options" in params else "pg_options"): None}
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                           c10d.PrefixStore(group_name, store),
                                           group_name=group_name, timeout=timeout, **opts)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def check_rollout_config(backend: str, urls: list[str], weight_sync: str, deterministic: bool,
                         cuda: bool) -> None:
    """Every combination of rollout flags and the GPU-only settings, before anything loads."""
    import importlib.util

    local = backend == "sglang" and not urls
    for bad, why in [
        (backend == "hf" and urls, "--rollout-url needs --rollout-backend sglang"),
        (backend == "hf" and deterministic, "--sglang-deterministic is for --rollout-backend "
         "sglang (the hf engine is always reproducible from --seed)"),
        (urls and weight_sync == "tensor", "--weight-sync tensor needs an in-process engine (drop "
         "--rollout-url)"),
        (local and weight_sync not in ("auto", "tensor"), "the in-process SGLang engine syncs "
         f"weights by tensor, not {weight_sync!r} (use --rollout-url for disk/nccl)"),
        (local and not cuda, "--rollout-backend sglang without --rollout-url runs SGLang "
         "in-process and needs a GPU; none is available (pass --rollout-url, or --rollout-backend "
         "hf)"),
        (local and importlib.util.find_spec("sglang") is None, "--rollout-backend sglang runs "
         "SGLang in-process, but sglang is not installed (pip install -e '.[gpu]'; see README)")]:
        if bad:
            raise UserError(f"config error: {why}")


def make_engine(backend: str, urls: list[str], model_path: str, device: torch.device, *,
                run_dir: str, seed: int, deterministic: bool = False,
                weight_sync: str = "auto") -> Engine:
    """HF on this rank's device, the SGLang servers at `urls`, or SGLang in-process on this GPU."""
    if backend == "hf":
        return HFEngine(model_path, device, torch.bfloat16 if device.type == "cuda" else None)
    if urls:
        sync = "disk" if weight_sync == "auto" else weight_sync
        return RemoteSGLangEngine(urls, model_path, run_dir, sync, deterministic)
    return SGLangEngine(model_path, gpu_id=device.index or 0, seed=seed, device=device,
                        deterministic=deterministic)


# -----------------------------------------------------------------------------
# the batches in flight (--max-staleness)


class Rollouts:
    """The rollout batches in flight. The batch of step s is sampled by the weights at the start of
    step max(0, s - K), K = --max-staleness: take(s) has the engine start every batch up to s + K
    (the engine holds the newest weights, those of step s) and returns batch s; wait() lets the
    batch in flight finish, so new weights reach the engine only between two batches. A run is
    thus a function of (seed, K). An engine that can overlap makes (generates and scores) batches
    on a background thread while the trainer trains; `share` hands a batch to the ranks that did
    not make it (a collective, on the trainer's thread). No batch is made at or past `steps`."""

    def __init__(self, make_batch, staleness: int, overlap: bool, pending: dict[int, list],
                 steps: int | None = None, share=lambda batch: batch):
        self.make_batch, self.staleness, self.steps = make_batch, staleness, steps
        self.share = share
        self.batches: dict[int, list | Future] = dict(pending)
        self.pool = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(
            torch.get_num_threads(),)) if overlap and staleness > 0 else None

    def describe(self) -> str:
        if self.staleness == 0:
            return "synchronous rollouts"
        how = "overlapped with training" if self.pool else "not overlapped (colocated engine)"
        return f"rollouts {self.staleness} step(s) ahead, {how}"

    def take(self, step: int) -> list:
        for s in range(step, step + self.staleness + 1):
            if s not in self.batches and (s == step or self.steps is None or s < self.steps):
                self.batches[s] = (self.pool.submit(self.make_batch, s) if self.pool
                                   else self.make_batch(s))
        batch = self.batches.pop(step)
        return self.share(batch.result() if isinstance(batch, Future) else batch)

    def wait(self) -> dict[int, list]:
        """Every batch in flight finished; returns the batches made ahead (for a checkpoint)."""
        self.batches = {s: b.result() if isinstance(b, Future) else b
                        for s, b in self.batches.items()}
        return self.batches

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
