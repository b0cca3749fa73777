"""Rollout engines and the batches in flight. Behaviour log-probs: SGLang's log_softmax(logits / T)
of each sampled token before top-p/top-k, as the trainer's (pi/pi_behave = 1 at equal weights)."""

import dataclasses
import importlib.util
import inspect
import ipaddress
import itertools
import json
import mmap
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

import lora
import modeling
from cli import UserError, rank
from logs import print0

# a request to a server; a /generate: plus its tokens at the rate below
HTTP_TIMEOUT_S = 600.0
MIN_TOKENS_PER_S = 10.0  # past HTTP_TIMEOUT_S + tokens / this, a /generate is aborted there
HTTP_RETRIES = 3  # retries of a timeout, connection error or 5xx, backing off exponentially
HTTP_BACKOFF_S = 0.5  # the first back-off; it doubles at every retry
ABORT_TIMEOUT_S = 10.0  # POST /abort_request before a timed-out /generate is re-posted
ABORT_RESUBMITS = 3  # resubmissions (prompt + tokens so far) of an aborted /generate
HEALTH_TIMEOUT_S = 600.0  # how long to wait for a server's /health_generate at start
HEALTH_POLL_S = 30.0  # one /health_generate's timeout
HTTP_THREADS = 1024  # requests in flight per rank: more than a rank's whole batch
SYNC_BUCKET_MB = 512  # weights per update_weights_from_tensor / _from_distributed call
WEIGHT_GROUP_TIMEOUT_S = 600.0  # the NCCL weight group: its rendezvous and every broadcast
SGLANG_MEM_FRACTION = 0.5  # in-process engine: its share of the GPU (weights + KV cache)
INT4_MAX = 7  # hf_int4: weights rounded to the integers -7..7 times a scale per row
ENV_TIMEOUT_S = 30.0  # an --env step that takes longer ends its episode and is counted
# torchrun's variables, hidden from SGLang's scheduler processes: with them its process group (a
# tcp:// rendezvous) looks for torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE) and waits
TORCHRUN_VARS = (
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE "
    "ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT".split()
)
GRAPH_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"  # set for the in-process engine's start
_MASK32 = 0xFFFFFFFF
_ENV_FAILED = False  # an env's first failure was said (once per process)
# a batch requested from the forked child, not yet received
IN_CHILD = "in the rollout process"


@dataclasses.dataclass
class SamplingParams:  # its fields are SGLang's sampling_params names
    max_new_tokens: int
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k (SGLang's convention)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Completion:
    output_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each output token (0 for an env's)
    finish_reason: str  # "stop" (ends in a stop token, included), "length" or "abort"
    policy_mask: list[int] | None = None  # an episode's: 1 sampled by the policy, 0 env text
    # env/turns, tool_calls, errors...
    episode: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Sample:
    """One completion of a step's prompt, what scored it and what it trains with."""

    group: int  # the GRPO group (the prompt's slot in the step): advantages compare within it
    prompt_ids: list[int]
    completion: Completion
    reward: float = 0.0
    advantage: float = 0.0
    zero_variance: bool = False  # every reward of its group is equal (no GRPO signal)
    row: int = -1  # the dataset row of the prompt
    correct: bool | None = None
    version: int = 0  # the policy version (step whose starting weights) that sampled it
    metrics: dict = dataclasses.field(default_factory=dict)  # the reward's own
    reward_error: str | None = None
    gen_s: float = 0.0  # seconds its batch took to generate
    # (seed, step, slot, k) mixed: its sampling noise and its reward's random state
    seed: int = 0
    round: int = 0  # --zero-variance resample: the round its slot drew this prompt at
    # tokens of its slot's groups resampled away (on its first sample)
    discarded_tokens: int = 0
    # per token (a teacher's term), else advantage
    token_advantages: list[float] | None = None


def sample_from_dict(d: dict) -> Sample:
    """A Sample from dataclasses.asdict's dict (a checkpoint's batches made ahead)."""
    return Sample(**d | {"completion": Completion(**d["completion"])})


class Engine(Protocol):
    """One completion per (prompt, seed); requests with one `groups` key (an episode's group) share
    a prefix: a server engine keeps them on one server. Every rank calls update_weights (FSDP2
    gathers are collectives); release/resume_memory bracket training: a colocated engine frees the
    GPU, others inherit no-ops (no KV cache outlives a generate call; servers own their GPUs).
    `max_new_tokens`, one per prompt, overrides sampling.max_new_tokens (an episode's own room)."""

    version: int  # the policy version (optimizer steps) of the weights it holds; -1: none yet
    # how it generates while the trainer trains: "process", "thread" or "" (not)
    overlaps: str
    # it generates with the trainer's own tensors: update_weights copies none
    share: bool = False
    # bytes of the trainer's GPU it keeps: (generating, released); None: none of its own there
    # (a remote server; the hf engine's copy is counted)
    held: tuple[int, int] | None = None

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        groups: list | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Completion]: ...
    def update_weights(self, model: nn.Module, version: int) -> None: ...
    def release_memory(self) -> None: ...
    def resume_memory(self) -> None: ...
    def shutdown(self) -> None: ...


def iter_full_tensors(
    model: nn.Module, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of each parameter and buffer, floats in `dtype`: FSDP2 all-gathers, every
    rank iterates; floats cast before the gather (a bf16 engine's cost half an fp32 gather). A LoRA
    model's adapted layers come merged (in fp64, from full precision, then cast), the plain
    model's names."""
    adapted = {n for n, m in model.named_modules() if isinstance(m, lora.LoraLinear)}

    def gathered():
        for name, t in model.state_dict().items():
            layer = name.rpartition(".")[0].removesuffix(".base")
            if t.is_floating_point() and layer not in adapted:
                t = t.to(dtype)  # a DTensor casts its local shard; adapted layers merge first
            # a DTensor; a mesh of one holds it whole (no gather)
            if hasattr(t, "full_tensor"):
                t = t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()
            yield name, t.detach()

    for name, t in lora.merged(gathered(), model):
        yield name, t.to(dtype) if t.is_floating_point() else t


def mmap_share(tensors: list[torch.Tensor]) -> None:
    """Moves CPU tensors' data into one anonymous MAP_SHARED mapping, the same tensor objects (tied
    weights stay tied): a process forked afterwards sees every later write. Not /dev/shm (torch's
    share_memory_), which containers cap at 64 MB."""
    # 64-byte aligned, as a SIMD load wants
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    buffer, offsets = mmap.mmap(-1, max(sum(sizes), 1)), itertools.accumulate([0, *sizes])
    for t, at in zip(tensors, offsets):
        if t.numel():  # an empty one has nothing to share
            shared = torch.frombuffer(buffer, dtype=t.dtype, count=t.numel(), offset=at)
            t.data = shared.view(t.shape).copy_(t)


# -----------------------------------------------------------------------------
# Counter-based noise: a sample depends on (seed, position), never on batch, rank or world size.
def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's fmix32 of ints or int64 tensors in [0, 2^32), or in place of int32 ones with
    the same bits (half the bytes: products wrap mod 2^32; shifts are masked to be logical)."""
    wide = not isinstance(h, torch.Tensor) or h.dtype == torch.int64
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, 0)):
        h ^= h >> shift if wide else (h >> shift).bitwise_and_((1 << 32 - shift) - 1)
        if mul:
            h = h * mul & _MASK32 if wide else h.mul_(mul - (1 << 32))
    return h


def mix_seed(*parts: int) -> int:
    """Combine integers (seed, step, prompt index, sample index, ...) into one 32-bit seed."""
    h = 0x9E3779B9  # plain Python ints: bit-identical to the tensor version, ~100x faster per call
    for p in parts:
        h = _fmix32(h ^ ((p & _MASK32) * 0x27D4EB2F & _MASK32))
    return h


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingParams, seeds: torch.Tensor, position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B], log-probs [B] before truncation, as SGLang's) = argmax(logits + hashed Gumbel)."""
    logits = logits.float()
    pick = lambda x, tok: (tok, torch.log_softmax(x, -1).gather(-1, tok[:, None]).squeeze(-1))
    if sampling.temperature == 0:
        return pick(logits, logits.argmax(-1))
    scaled = logits if sampling.temperature == 1 else logits / sampling.temperature
    truncated = scaled
    if sampling.top_k > 0 or sampling.top_p < 1.0:  # SGLang's rule, both on the full softmax
        # ("joint"): token j of the sorted ones is kept iff j < k and p_0 + ... + p_{j-1} <= p
        probs, order = torch.sort(
            torch.softmax(scaled, -1), dim=-1, descending=True, stable=True
        )
        if sampling.top_p < 1.0:
            drop = probs.cumsum(-1) - probs > sampling.top_p
        else:
            drop = torch.zeros_like(probs, dtype=torch.bool)
        if sampling.top_k > 0:
            drop[:, sampling.top_k :] = True
        # unsorted
        truncated = truncated.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    seeds = seeds.to(device=logits.device, dtype=torch.int64)
    key = _fmix32(seeds ^ ((position * 0x9E3779B1 + 0x7F4A7C15) & _MASK32))
    token = torch.arange(logits.shape[-1], device=seeds.device) * 0x632BE5AB & _MASK32  # [V]
    # the same 32 bits as int32 (sign flip: back to unsigned)
    as32 = lambda x: (x - (x >> 31 << 32)).int()
    h = _fmix32(_fmix32(as32(key)[:, None] ^ as32(token)[None, :]).bitwise_xor_(0x5BD1E995))
    u = h.bitwise_xor_(-(2**31)).double().add_(2**31 + 0.5).div_(2**32)  # uniform in (0, 1)
    return pick(scaled, u.log_().neg_().log_().neg_().add_(truncated).argmax(-1))  # + Gumbel


# -----------------------------------------------------------------------------
# HF backend: batched generation with a KV cache on plain transformers
class HFEngine(Engine):
    """Rollouts on a private transformers copy of the policy (CPU, or one GPU). On a CPU its weights
    and version live in shared memory: a forked process generates while the trainer trains (a thread
    shares the trainer's GIL: 3-12% slower training); on a GPU a thread does (CUDA does not survive
    a fork). `share` (one rank, nothing generated ahead): the trainer's tensors where they match.
    `dtype` its weights' and compute's; `int4`: its linear weights rounded to 4 bits per output
    channel at every update (a weight-quantized engine: a train-inference mismatch on purpose)."""

    def __init__(
        self,
        model_path: str,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        batch_size: int = 512,
        share: bool = False,
        int4: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.device, self.batch_size, self.share = torch.device(device), batch_size, share
        self.int4 = int4
        cpu = self.device.type == "cpu"  # packed linears; a forked generator
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32)
        self.model = model.to(self.device).eval().requires_grad_(False)  # no autograd graph
        # a generate call's packed copies of the linears' weights
        self.packed = {}
        self.weights = []
        for m in self.model.modules() if cpu else ():
            if isinstance(m, nn.Linear):  # the head too: read as its weight
                m.forward = lambda x, m=m: modeling.linear(x, m.weight, m.bias, self.packed)
                self.weights.append(m.weight)  # a Parameter: update_weights keeps it
        self.overlaps = "thread"
        self._version = torch.tensor(0)  # int64
        if cpu and not share and "fork" in multiprocessing.get_all_start_methods():
            self.overlaps = "process"
            # (parameters() and buffers() list a tied tensor once)
            mmap_share([*self.model.parameters(), *self.model.buffers(), self._version])
        self._quantize()

    def _quantize(self) -> None:
        """int4: W := round(W / s) s per output channel, s = max |W| / 7 (weight-only 4-bit)."""
        if not self.int4:
            return
        # a set: a weight two layers share is rounded once
        for w in {m.weight for m in self.model.modules() if isinstance(m, nn.Linear)}:
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT4_MAX
            w.copy_(torch.round(w / scale).clamp(-INT4_MAX, INT4_MAX) * scale)

    @property
    def version(self) -> int:
        return int(self._version)

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        mine = dict(self.model.named_parameters())
        # a DTensor on a mesh of one holds the whole tensor
        theirs = {
            n: p.to_local() if hasattr(p, "to_local") else p
            for n, p in model.named_parameters()
        }
        key = lambda t: (t.shape, t.dtype, t.device)
        if self.share and all(
            n in theirs and key(theirs[n]) == key(m) for n, m in mine.items()
        ):
            for n, m in mine.items():
                m.data = theirs[n].detach()  # the in-place optimizer steps are the sync
        else:
            own = self.model.state_dict()
            for name, tensor in iter_full_tensors(model, self.model.dtype):
                own[name].copy_(tensor)
            self._quantize()
        self._version.fill_(version)

    def shutdown(self) -> None:
        self.model = None

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        groups: list | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Completion]:
        """A batch runs to its rows' longest limit, each row cut at its own ("length"): the noise
        is keyed by (seed, position), so a row's tokens are those it samples alone."""
        limits = _limits(prompt_ids, sampling, seeds, max_new_tokens)
        # (prompt, seed, limit, index), the shortest prompts first: less padding
        rows = sorted(
            zip(prompt_ids, seeds, limits, itertools.count()), key=lambda r: len(r[0])
        )
        out, n = [], self.batch_size
        try:  # this call's weights, packed once for its batches' rows; freed when it returns
            self.packed = modeling.pack_weights(self.weights, min(len(rows), n))
            for i in range(0, len(rows), n):
                *batch, idx = zip(*rows[i : i + n])  # prompts, seeds, limits; indices
                out += zip(idx, self._generate_batch(sampling, *batch))
        finally:
            self.packed = {}
        return [c for _, c in sorted(out)]  # in the prompts' order (indices are distinct)

    @torch.inference_mode()  # no autograd bookkeeping (version counters) on the decode's tensors
    def _generate_batch(
        self, sampling: SamplingParams, prompts: tuple, seeds: tuple, limits: tuple
    ) -> list[Completion]:
        """The batch decodes to its longest limit; each row ends at its first stop ("stop"),
        else at its own limit ("length")."""
        # a distinct prompt (a group's) is prefilled once
        unique = {}
        rows = torch.tensor([unique.setdefault(tuple(p), len(unique)) for p in prompts])
        B, L, T = len(prompts), max(map(len, prompts)), max(limits)
        # left: every row's next token in one column
        pad = lambda p: [0] * (L - len(p)) + list(p)
        input_ids = torch.tensor([pad(p) for p in unique], device=self.device)
        # attention: L + T columns
        attention = torch.tensor(
            [pad([1] * len(p)) + [1] * T for p in unique], device=self.device
        )
        position_ids = (attention[:, :L].cumsum(-1) - 1).clamp(min=0)
        seeds, cache, live = torch.tensor(seeds), kv_cache(L + T), torch.arange(B)
        stop = torch.tensor(sampling.stop_token_ids or [-1], device=self.device)
        body, head = self.model.base_model, self.model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        params = inspect.signature(body.forward).parameters  # 5.2x: past_key_values -> cache
        kw = {"use_cache": True, ("cache" if "cache" in params else "past_key_values"): cache}
        scale, softcap = modeling.head_transform(self.model.config)

        def forward(ids, mask, pos):  # the last position's fp32 logits, as the trainer's head
            hidden = body(
                input_ids=ids, attention_mask=mask, position_ids=pos, **kw
            ).last_hidden_state[:, -1]
            logits = modeling.head_logits(hidden, head.weight, bias, self.packed) * scale
            return logits if softcap is None else softcap * torch.tanh(logits / softcap)

        logits = forward(input_ids, attention[:, :L], position_ids)
        cache.reorder_cache(rows)  # [unique prompts] -> [rows]
        logits, attention, step_pos = logits[rows], attention[rows], position_ids[rows, -1:]
        tokens = torch.zeros(B, T, dtype=torch.long)
        logps = torch.zeros(B, T)  # float32
        for t in range(T):
            tok, lp = sample_tokens(logits, sampling, seeds[live], t)
            tokens[live, t], logps[live, t] = tok.cpu(), lp.cpu()
            running = ~torch.isin(tok, stop)
            if t + 1 == T or not running.any():  # every row's cut lies within 0..t
                break
            if not running.all():  # finished rows leave the batch and the cache
                cache.reorder_cache(keep := running.nonzero().flatten())
                live, tok = live[keep.cpu()], tok[keep]
                attention, step_pos = attention[keep], step_pos[keep]
            step_pos = step_pos + 1
            logits = forward(tok[:, None], attention[:, : L + t + 1], step_pos)
        stops, done = set(sampling.stop_token_ids), []
        for r, lps, m in zip(tokens.tolist(), logps.tolist(), limits):
            # its first stop within its own limit (a row that ran on past it has none before it)
            n = next((j + 1 for j, t in enumerate(r[:m]) if t in stops), None)
            done.append(Completion(r[: n or m], lps[: n or m], "stop" if n else "length"))
        return done


def _limits(
    prompts: list, sampling: SamplingParams, seeds: list, max_new_tokens
) -> list[int]:
    """Each prompt's max_new_tokens: its own where given, else the sampling's (and one seed per
    prompt, checked: every engine's generate starts here)."""
    assert len(seeds) == len(prompts), "generate: one seed per prompt"
    if max_new_tokens is None:
        return [sampling.max_new_tokens] * len(prompts)
    assert len(max_new_tokens) == len(prompts), "generate: one max_new_tokens per prompt"
    return max_new_tokens


def kv_cache(capacity: int):
    """transformers' DynamicCache whose layers, from the first reorder_cache (prompts -> rows),
    write each token into storage of `capacity` positions and return views, not torch.cat's copy."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class Layer(DynamicLayer):  # 4.56-5.x: keys/values [B, H, L, D] are what mask code reads
        def update(self, key_states, value_states, *args, **kwargs):
            n, new, b = self.get_seq_length(), key_states.shape[-2], len(key_states)
            self.is_initialized, self.device = True, key_states.device
            if n:  # past the prompts (kept as they come): into the storage reorder_cache made
                for s, x in zip(self.store, (key_states, value_states)):
                    s[:b, :, n : n + new] = x
                key_states, value_states = (s[:b, :, : n + new] for s in self.store)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            n, b, old = self.get_seq_length(), len(beam_idx), (self.keys, self.values)
            self.store = getattr(self, "store", None) or tuple(
                x.new_empty(b, x.shape[1], capacity, x.shape[-1]) for x in old
            )
            # rows leaving: gathered (a copy), then written over
            for s, x in zip(self.store, old):
                s[:b, :, :n] = x[beam_idx.to(x.device)]
            self.keys, self.values = (s[:b, :, :n] for s in self.store)

    # 4.56-5.x: a layer_class_to_replicate() made per layer at its update
    cache = DynamicCache()
    cache.layer_class_to_replicate = Layer
    return cache


# -----------------------------------------------------------------------------
# episodes: a user's environment (--env) answers the policy's tool calls between its turns
@dataclasses.dataclass(frozen=True)
class Tools:
    """An --env bound to the tokenizer: make(row) is an episode's env, whose step(turn text)
    returns the text to append or None (the episode is over); stop_ids end a turn calling it."""

    make: Callable
    stop_ids: list[int]
    encode: Callable[[str], list[int]]  # a reply -> ids (a tool turn of the chat template)
    decode: Callable[[list[int]], str]
    max_turns: int


def run_episodes(
    engine: Engine,
    prompts: list[list[int]],
    sampling: SamplingParams,
    seeds: list[int],
    tools: Tools | None = None,
    rows: list[dict] | None = None,
) -> list[Completion]:
    """engine.generate, or with tools episodes: each round one generate call continues every live
    episode from exactly its ids so far; a turn ending in a tool stop goes to its env, whose reply's
    ids are appended (policy_mask 0). max_new_tokens bounds the whole episode: a turn or reply cut
    there, or a call past max_turns, ends it ("length"); a failing env, as it stands."""
    if tools is None:
        return engine.generate(prompts, sampling, seeds)
    calls = dataclasses.replace(
        sampling, stop_token_ids=sorted({*sampling.stop_token_ids, *tools.stop_ids})
    )
    counters = ("env/turns", "env/tool_calls", "env/errors", "env/seconds")
    eps = [Completion([], [], "stop", [], dict.fromkeys(counters, 0)) for _ in prompts]
    envs, live = [None] * len(prompts), list(range(len(prompts)))
    for turn in range(tools.max_turns):
        # each episode its own room: one request past the context fails SGLang's whole batch
        room = [sampling.max_new_tokens - len(eps[i].output_ids) for i in live]
        # later turns' seeds in 31 bits: SGLang's sampling_seed
        turn_seeds = [mix_seed(seeds[i], turn) >> 1 if turn else seeds[i] for i in live]
        # a group on one server
        groups = [tuple(prompts[i]) for i in live]
        inputs = [prompts[i] + eps[i].output_ids for i in live]
        outs = engine.generate(inputs, calls, turn_seeds, groups, room)
        going, live = live, []
        for i, out in zip(going, outs):
            e, ids = eps[i], out.output_ids
            e.output_ids += ids
            e.logprobs += out.logprobs
            e.policy_mask += [1] * len(ids)  # sampled by the policy
            e.episode["env/turns"] += 1
            e.finish_reason = out.finish_reason
            if out.finish_reason != "stop" or ids[-1] not in tools.stop_ids:
                continue  # over: an end of sequence, the length, an abort
            if turn + 1 == tools.max_turns:
                e.finish_reason = "length"  # a tool call past max_turns
                continue
            envs[i], reply = env_step(tools, envs[i], rows[i], tools.decode(ids), e.episode)
            if reply is None:
                continue
            if len(e.output_ids) + len(reply) >= sampling.max_new_tokens:
                e.finish_reason = "length"  # no room left for the policy's next turn
            else:
                e.output_ids += reply
                e.logprobs += [0.0] * len(reply)  # env text: no behaviour log-prob
                e.policy_mask += [0] * len(reply)
                live.append(i)
        if not live:
            break
    return eps


def env_step(
    tools: Tools, env, row: dict, text: str, counts: dict
) -> tuple[object, list | None]:
    """(env, the reply's ids or None: the episode is over) of env.step(text) on a daemon thread (a
    hung call keeps it), the env made by tools.make(row) first; a failure is counted, said once."""
    global _ENV_FAILED
    out, start = [], time.perf_counter()

    def call() -> None:
        try:
            made = tools.make(row) if env is None else env
            reply = made.step(text)
            if not isinstance(reply, (str, type(None))):
                raise TypeError(f"step returned a {type(reply).__name__}, not a str or None")
            out.append((made, None if reply is None else tools.encode(reply), None))
        except Exception as e:
            out.append((env, None, f"{type(e).__name__}: {e}"))

    (worker := threading.Thread(target=call, daemon=True)).start()
    worker.join(ENV_TIMEOUT_S)
    env, reply, error = out[0] if out else (env, None, f"a call took over {ENV_TIMEOUT_S:g}s")
    counts["env/seconds"] += time.perf_counter() - start
    counts["env/tool_calls"] += 1
    counts["env/errors"] += error is not None
    if error and not _ENV_FAILED:
        _ENV_FAILED = True
        print(
            f"warning: an --env step failed ({error}); its episode ends there, scored as it "
            "stands (counted in env/errors; said once)",
            flush=True,
        )
    return env, reply


# -----------------------------------------------------------------------------
# SGLang, in-process or remote: its facts that bite (read from its source, 0.5.10-0.5.23) inline
def completion_from_sglang(out: dict, stop_ids: list[int]) -> Completion:
    """Ids from output_token_logprobs [(logprob, id, None)], never misaligned. A stop sampled as
    the last allowed token is "length" in SGLang <= 0.5.17, "stop" from 0.5.18: tokens decide."""
    meta = out["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs]
    # {"type": "stop" | "length" | "abort", ...}; None: it never finished
    reason = (meta.get("finish_reason") or {"type": "abort"})["type"]
    if ids and ids[-1] in stop_ids:
        reason = "stop"
    return Completion(ids, [float(p[0]) for p in pairs], reason)


def _sampling_dict(sampling: SamplingParams, max_new_tokens: int, seed: int) -> dict:
    return dataclasses.asdict(sampling) | {
        "max_new_tokens": max_new_tokens,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": int(seed) & 0x7FFFFFFF,
    }


def _check_logprob_env() -> None:
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(
            "SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would return T=1 "
            "log-probs, the trainer's are log_softmax(logits / T). Unset it."
        )


def engine_dtype(
    model_path: str, requested: str | None = "auto", fp32_as: torch.dtype | None = None
) -> torch.dtype:
    """SGLang's dtype for the weights (a sync rounds them once): `requested` (its --dtype), else the
    config's; an fp32 config runs in `fp32_as`, or SGLang's float16 (Gemma: bfloat16)."""
    if requested not in (None, "auto"):  # half, float16, bfloat16, float or float32
        return getattr(torch, requested)
    from transformers import AutoConfig

    # transformers 4.56+: a torch.dtype (from the config's "dtype" or "torch_dtype"), or None
    cfg = AutoConfig.from_pretrained(model_path)
    if cfg.dtype not in (None, torch.float32):
        return cfg.dtype
    return fp32_as or (
        torch.bfloat16 if cfg.model_type.startswith("gemma") else torch.float16
    )


def iter_buckets(
    named: Iterator[tuple[str, torch.Tensor]], device: torch.device | str
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(name, tensor) -> (~SYNC_BUCKET_MB bucket on `device`, is_last); a big one alone."""
    bucket, size = [], 0
    for name, t in named:
        t = t.to(device)
        if bucket and size + t.nbytes > SYNC_BUCKET_MB * 2**20:
            yield bucket, False  # t is still to come
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.nbytes
    if bucket:
        yield bucket, True


def _succeeded(result, what: str, at: str = "") -> None:
    """Raise if an SGLang control call failed: it returns its failures, never raising them. `at`:
    where, as the caller knows it (" at step 3", " at step 3 on http://host:30000")."""
    if isinstance(result, tuple):  # the in-process Engine's (success, message)
        result = {"success": result[0], "message": result[1]}
    get = result.get if isinstance(result, dict) else lambda k, d: getattr(result, k, d)
    if not get("success", True):
        message = get("message", "") or "(no message)"
        raise RuntimeError(f"SGLang {what} failed{at}: {message}")


def _start_shielded(start: Callable):
    """start() (an in-process sglang.Engine) with what its processes inherit set for them."""
    # Its scheduler and detokenizer (spawn: fork + exec) share our process group: a terminal's
    # Ctrl-C would kill them mid-step. Spawned while SIGINT is ignored they never see it
    # (SIG_IGN survives exec, Python keeps it, they set no handler: 0.5.10-0.5.23).
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    names = (*TORCHRUN_VARS, GRAPH_ENV)  # ours are put back as they were
    hidden = {
        k: os.environ.pop(k)
        for k in [*os.environ]
        if k in names or k.startswith("TORCHELASTIC_")
    }
    # release_memory_occupation frees CUDA graphs only if this is set when its scheduler
    # starts (inherited; a bool env, default off, 0.5.10-0.5.23); only its processes read it
    os.environ[GRAPH_ENV] = "1"
    try:
        return start()
    finally:
        os.environ.pop(GRAPH_ENV)
        os.environ.update(hidden)
        if main:
            signal.signal(signal.SIGINT, old)


class SGLangEngine(Engine):
    """One in-process `sglang.Engine` (tp=1) on this rank's GPU, shared with the trainer. Make it
    before the trainer allocates: SGLang sizes its KV cache from the GPU memory free at start. It
    is left released, holding no weights (version -1): push them before the first generate."""

    overlaps = ""  # it must free the GPU memory the trainer trains in

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        device: torch.device | str = "cuda",
        deterministic: bool = False,
        **engine_kwargs,
    ):
        import sglang  # lazy: an optional extra

        _check_logprob_env()
        self.dtype = engine_dtype(model_path, fp32_as=torch.bfloat16)  # passed to SGLang too
        self.device, self.version, self.released = torch.device(device), -1, set()
        # SGLang's GPU_MEMORY_TYPE_* (sglang.srt.constants, the same 0.5.10-0.5.23)
        self.tags = ["kv_cache", "weights", "cuda_graph"]
        # SGLang probes for free ports, binding them later: engines started together (torchrun's
        # ranks, two jobs on one host) may pick the same. In-process it binds nccl_port (its
        # scheduler's store) and port (DP attention's TCP ZMQ): two free ones, picked by the OS.
        # both held while the OS picks: distinct
        with socket.socket() as a, socket.socket() as b:
            a.bind(("", 0)), b.bind(("", 0))
            ports = {"port": a.getsockname()[1], "nccl_port": b.getsockname()[1]}
        kw = {
            "model_path": model_path,
            "mem_fraction_static": SGLANG_MEM_FRACTION,
            "enable_memory_saver": True,
            "skip_tokenizer_init": True,
            "base_gpu_id": self.device.index or 0,
            "tp_size": 1,
            "random_seed": seed,
            "dtype": str(self.dtype).removeprefix("torch."),
            # an fp32 lm_head: bf16 logits would make pi/pi_behave != 1 at equal weights
            "enable_fp32_lm_head": True,
        }
        if deterministic:  # the only mode in which SGLang honours a request's sampling_seed
            kw["enable_deterministic_inference"] = True
        measure = self.device.type == "cuda"
        free = lambda: torch.cuda.mem_get_info(self.device)[0] if measure else 0
        before = free()
        self.engine = _start_shielded(lambda: sglang.Engine(**kw | ports | engine_kwargs))
        running = free()
        # its state while the trainer trains; released weights come back uninitialised (without
        # --enable-weights-cpu-backup): version -1 until update_weights pushes them
        self.release_memory()
        # even released, its scheduler keeps a CUDA context and untagged buffers
        self.held = (before - running, before - free()) if measure else None

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        groups: list | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Completion]:
        if self.version < 0:
            raise RuntimeError(
                "SGLangEngine.generate before update_weights: the engine starts "
                "released, and released weights come back uninitialised"
            )
        if not prompt_ids:
            return []
        self._resume(*self.tags)  # never without a KV cache
        limits = _limits(prompt_ids, sampling, seeds, max_new_tokens)
        outs = self.engine.generate(
            input_ids=prompt_ids,
            sampling_params=[_sampling_dict(sampling, n, s) for n, s in zip(limits, seeds)],
            return_logprob=True,
        )
        return [completion_from_sglang(o, sampling.stop_token_ids) for o in outs]

    def release_memory(self) -> None:
        """An idle engine (generate has returned) releases memory (enable_memory_saver); resuming an
        unreleased tag raises. The KV cache returns after the push: the buckets are freed first."""
        if tags := [t for t in self.tags if t not in self.released]:
            _succeeded(
                self.engine.release_memory_occupation(tags=tags),
                f"release_memory_occupation({tags})",
            )
            self.released.update(tags)

    def resume_memory(self) -> None:
        self._resume("weights")  # the KV cache comes back after update_weights

    def _resume(self, *wanted: str) -> None:
        if tags := [t for t in wanted if t in self.released]:
            torch.cuda.empty_cache()  # else SGLang may fail to map its memory back (sglang #14092)
            _succeeded(
                self.engine.resume_memory_occupation(tags=tags),
                f"resume_memory_occupation({tags})",
                f" at step {self.version}",
            )
            self.released.difference_update(tags)

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        """By CUDA IPC in the engine's dtype (NCCL on one GPU fails: "Duplicate GPU detected")."""
        # engine.call(**kwargs), raising the failure it reports
        ok = lambda call, **kw: _succeeded(
            getattr(self.engine, call)(**kw), call, f" at step {version}"
        )
        self.version = version
        self.resume_memory()
        # from SGLang 0.5.21 (whose Engine has these) tensor updates outside a session fail
        session = hasattr(self.engine, "begin_weight_update")
        if session:
            ok("begin_weight_update")
        try:
            named = iter_full_tensors(model, self.dtype)
            for bucket, last in iter_buckets(named, self.device):
                ok("update_weights_from_tensor", named_tensors=bucket, flush_cache=last)
        finally:
            if session:
                ok("end_weight_update")
        self._resume(*self.tags)
        # its prefix cache holds the old weights' KV
        ok("flush_cache")

    def shutdown(self) -> None:
        if self.engine:
            self.engine.shutdown()
            self.engine = None


def http_request(
    url: str,
    path: str,
    payload: dict | None = None,
    retries: int = HTTP_RETRIES,
    timeout: float = HTTP_TIMEOUT_S,
    failed: int = 0,
):
    """POST `payload` (None: GET) to url + path; the JSON (or text) reply. A timeout, connection
    error or 5xx is retried with back-off; another refusal raises HTTPError. `failed`: the caller's
    own failed tries before this call (counted in the error)."""
    data = None if payload is None else json.dumps(payload).encode()  # POST, else GET
    req = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(HTTP_BACKOFF_S * 2 ** (attempt - 1))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                code, body = None, r.read().decode()
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode(errors="replace")
        except OSError as e:  # URLError, TimeoutError, ConnectionError
            last = f"{type(e).__name__}: {getattr(e, 'reason', e)}"
            continue
        with suppress(json.JSONDecodeError):
            body = json.loads(body)  # else the text
        if code is None:
            return body
        if code < 500:
            raise HTTPError(url + path, code, body)
        last = f"HTTP {code}: {body}"
    raise RuntimeError(
        f"SGLang server {url}{path} failed {failed + retries + 1} times; last error: {last}"
    )


class HTTPError(RuntimeError):
    def __init__(self, url: str, status: int, body):
        super().__init__(f"{url}: HTTP {status}: {body}")
        self.status, self.body = status, body


def groupable(info: dict) -> bool:
    """Whether a server (/server_info) can join a weight group: SGLang joins each scheduler as
    rank_offset + tp_rank (PP stages collide), refuses DP replicas (not DP attention: inside TP)."""
    pp, dp = (int(info.get(k) or 1) for k in ("pp_size", "dp_size"))
    return pp == 1 and (dp == 1 or bool(info.get("enable_dp_attention")))


def weight_group_ranks(url: str, info: dict) -> int:
    if not groupable(info):
        raise UserError(
            f"--weight-sync nccl: the SGLang server {url} runs pp_size="
            f"{info.get('pp_size') or 1}, dp_size={info.get('dp_size') or 1}; SGLang's "
            "update_weights_from_distributed joins only its TP ranks (use --weight-sync "
            "disk, or a server per replica)"
        )
    return int(info.get("tp_size") or 1)


def route_address(url: str) -> str:
    """This host's address on the route to `url` (a UDP connect sends nothing), not 127.0.1.1."""
    parts = urllib.parse.urlsplit(url)
    family, kind, _, _, addr = socket.getaddrinfo(
        parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, kind) as s:
        s.connect(addr)
        return s.getsockname()[0]


def on_this_host(url: str) -> bool:
    """Whether a server's URL names this machine: a loopback (or unspecified) address, one of the
    host name's, or one that routes to itself (an address of any of this host's interfaces)."""
    host = urllib.parse.urlsplit(url).hostname or "localhost"
    try:
        theirs = {a[4][0].partition("%")[0] for a in socket.getaddrinfo(host, None)}
    except OSError:  # unresolvable: not reachable from here either
        return False
    if any(a.is_loopback or a.is_unspecified for a in map(ipaddress.ip_address, theirs)):
        return True
    mine = set()
    with suppress(OSError):
        mine.update(socket.gethostbyname_ex(socket.gethostname())[2])
    with suppress(OSError):  # towards one of our own addresses the source is that address
        mine.add(route_address(url))
    return bool(theirs & mine)


def gpu_neighbours(device: torch.device | str | None) -> list[int] | None:
    """The ids of the processes other than this one on `device`'s GPU, or None where that cannot be
    told. nvidia-smi (wherever the driver is; torch.cuda.list_gpu_processes needs pynvml) by UUID:
    CUDA_VISIBLE_DEVICES renumbers torch's indices. In a container it may list host process ids:
    with our own context on that GPU and our id not among them, one of them may be us."""
    try:
        index = torch.device(device or "cuda").index
        index = torch.cuda.current_device() if index is None else index
        # nvidia-smi's has a "GPU-" prefix, torch's none
        gpu = str(torch.cuda.get_device_properties(index).uuid).removeprefix("GPU-")
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid",
                "--format=csv,noheader",
                f"--id=GPU-{gpu}",
            ],
            capture_output=True,
            timeout=60,
        )
    except Exception:  # no CUDA, no driver tools, an old torch: unknown
        return None
    if out.returncode:
        return None
    pids = {int(w) for w in out.stdout.split() if w.isdigit()}
    if not pids or os.getpid() in pids or not torch._C._cuda_hasPrimaryContext(index):
        return sorted(pids - {os.getpid()})
    return None


def auto_weight_sync(
    infos: dict, group_backend: str, device: torch.device | str | None
) -> tuple[str, str]:
    """--weight-sync auto: (nccl or disk, why). nccl wherever a group can form (disk writes the
    whole model and every server reloads it, every step), except with a server that may share
    rank 0's GPU: NCCL between two processes on one GPU fails ("Duplicate GPU detected"), and
    SGLang says nothing of its GPU's identity (/server_info: ids relative to its own
    CUDA_VISIBLE_DEVICES), so a server on this host is judged by the processes on our GPU.
    `infos`: each server's /server_info, by its URL."""
    if group_backend == "nccl" and not torch.cuda.is_available():
        return "disk", "no CUDA here for an NCCL weight group"
    bad = [u for u, info in infos.items() if not groupable(info)]
    if bad:
        return "disk", f"the SGLang server {bad[0]} runs PP stages or DP replicas"
    local = [u for u in infos if on_this_host(u)] if group_backend == "nccl" else []
    others = gpu_neighbours(device) if local else []
    if others is None:
        return "disk", (
            f"the SGLang server {local[0]} runs on this host and whether it shares "
            "rank 0's GPU cannot be told (NCCL fails on a shared GPU)"
        )
    if others:
        return "disk", (
            f"the SGLang server {local[0]} runs on this host and process(es) "
            f"{', '.join(map(str, others[:4]))} share rank 0's GPU (NCCL fails on a "
            "shared GPU)"
        )
    why = "a weight group can form with every server"
    if local:
        why += f" ({local[0]} is on this host, but no other process is on rank 0's GPU)"
    return "nccl", why


class RemoteSGLangEngine(Engine):
    """SGLang servers over HTTP: every rank generates; rank 0 alone pushes weights, others wait."""

    overlaps = "thread"  # the servers generate while the trainer trains

    def __init__(
        self,
        urls: list[str],
        model_path: str,
        run_dir: str,
        weight_sync: str = "auto",
        deterministic: bool = False,
        group_backend: str = "nccl",
        device: torch.device | str | None = None,
    ):
        _check_logprob_env()
        self.urls = [u.rstrip("/") for u in urls]
        self.model_path, self.run_dir = model_path, run_dir
        self.group_backend, self.group, self.version = group_backend, None, 0
        self.pool = ThreadPoolExecutor(HTTP_THREADS, thread_name_prefix="sglang-http")
        # servers without sessions (SGLang < 0.5.21)
        self.sessionless = set()
        self.wait_healthy(HEALTH_TIMEOUT_S)
        self.infos = {u: http_request(u, "/server_info") for u in self.urls}
        if weight_sync == "auto":
            weight_sync, why = auto_weight_sync(self.infos, group_backend, device)
            print0(f"--weight-sync auto: {weight_sync} ({why})")
        self.weight_sync = weight_sync
        # a server no weight group can include fails now, not at the first sync
        self.group_sizes = [
            weight_group_ranks(u, self.infos[u]) for u in self.urls if weight_sync == "nccl"
        ]
        info = self.infos[self.urls[0]]  # the first server's
        self.sync_dtype = engine_dtype(model_path, info.get("dtype"))
        random = [
            u for u, i in self.infos.items() if not i.get("enable_deterministic_inference")
        ]
        if deterministic and random:
            raise UserError(
                f"--rollout-backend sglang_deterministic: the SGLang server {random[0]} "
                "runs without deterministic inference; launch it with "
                "--enable-deterministic-inference"
            )
        if self.sync_dtype != torch.float32 and not info.get("enable_fp32_lm_head"):
            print0(
                f"warning: the SGLang server {self.urls[0]} computes its lm_head in "
                f"{self.sync_dtype}: pi/pi_behave != 1 at equal weights (launch it with "
                "--enable-fp32-lm-head)"
            )

    def _call(self, url: str, route: str, payload: dict, retries: int = HTTP_RETRIES) -> None:
        """POST a control route: a refusal (400, success false) raises naming call, step, server."""
        try:
            out = http_request(url, f"/{route}", payload, retries)
        except HTTPError as e:
            if e.status == 404:
                raise
            out = (
                e.body
                if isinstance(e.body, dict) and "success" in e.body
                else {"success": False, "message": e.body}
            )
        _succeeded(out, route, f" at step {self.version} on {url}")

    def _all(self, fn, *args) -> Iterator:
        """fn(url, *args) for every server, all submitted now: their results in order (list()
        waits for them, raising the first failure)."""
        return self.pool.map(lambda u: fn(u, *args), self.urls)

    def wait_healthy(self, timeout: float) -> None:
        """Poll GET /health_generate until 200 (503: loading), saying once what it waits for."""
        start = time.monotonic()
        for url in self.urls:
            said = False
            while True:
                try:
                    http_request(url, "/health_generate", None, 0, HEALTH_POLL_S)
                    break
                except RuntimeError as e:  # HTTPError included
                    last = str(e).rpartition("last error: ")[2]
                if time.monotonic() - start >= timeout:
                    raise UserError(
                        f"--rollout-url {url}: no healthy SGLang server after "
                        f"{timeout:g}s (GET /health_generate: {last}); is it running "
                        "and reachable from here?"
                    )
                if not said:
                    print0(f"waiting for the SGLang server {url} (/health_generate: {last})")
                said = True
                time.sleep(min(1.0, timeout / 50))

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        seeds: list[int],
        groups: list | None = None,
        max_new_tokens: list[int] | None = None,
    ) -> list[Completion]:
        limits = _limits(prompt_ids, sampling, seeds, max_new_tokens)
        # group key -> its index: groups round robin, offset by rank
        group = {}
        url = lambda k: self.urls[(group.setdefault(k, len(group)) + rank()) % len(self.urls)]
        keys = groups or [tuple(p) for p in prompt_ids]
        # every request in flight at once (the pool outnumbers a batch), results in order
        # (the servers read here, in the prompts' order, as map submits)
        args = map(url, keys), prompt_ids, itertools.repeat(sampling), seeds, limits
        return list(self.pool.map(self._generate_one, *args))

    def _generate_one(
        self, url: str, prompt: list[int], sampling: SamplingParams, seed: int, budget: int
    ) -> Completion:
        """A /generate whose deadline grows with its budget (HTTP_TIMEOUT_S + its tokens at
        MIN_TOKENS_PER_S). Past it the request is aborted there and SGLang answers with the
        tokens so far; an aborted request (by us or by the server) is resubmitted as prompt +
        those tokens, the same seed, the budget less them (ABORT_RESUBMITS times). A timeout, a
        dropped connection or a 5xx: aborted there too, then tried again (HTTP_RETRIES)."""
        ids, logprobs, failures, aborts = [], [], 0, 0
        while len(ids) < budget:
            left, rid = budget - len(ids), uuid.uuid4().hex
            payload = {
                "input_ids": prompt + ids,
                "sampling_params": _sampling_dict(sampling, left, seed),
                "return_logprob": True,
                "rid": rid,
            }
            deadline = HTTP_TIMEOUT_S + left / MIN_TOKENS_PER_S
            watchdog = threading.Timer(deadline, self._abort, (url, rid))
            watchdog.start()
            try:  # no retries here: a failed post is aborted there first, below
                timeout = deadline + ABORT_TIMEOUT_S
                out = http_request(url, "/generate", payload, 0, timeout, failures)
            except HTTPError:  # a refusal: trying again would be refused again
                raise
            except RuntimeError:  # its message counts every failed post
                # it may still run there: abort it, back off, post again
                failures += 1
                if failures > HTTP_RETRIES:
                    raise
                self._abort(url, rid)
                time.sleep(HTTP_BACKOFF_S * 2 ** (failures - 1))
                continue
            finally:
                watchdog.cancel()
            c = completion_from_sglang(out, sampling.stop_token_ids)
            ids += c.output_ids
            logprobs += c.logprobs
            aborts += c.finish_reason == "abort"
            if c.finish_reason != "abort" or aborts > ABORT_RESUBMITS:
                return Completion(ids, logprobs, c.finish_reason)
        return Completion(ids, logprobs, "length")

    def _abort(self, url: str, rid: str) -> None:
        """Best effort: a dead server has nothing left to abort; an unknown rid is a no-op."""
        with suppress(RuntimeError):
            http_request(url, "/abort_request", {"rid": rid}, 0, ABORT_TIMEOUT_S)

    @torch.no_grad()
    def update_weights(self, model: nn.Module, version: int) -> None:
        self.version, named = version, iter_full_tensors(model, self.sync_dtype)
        if rank() == 0:
            (self._sync_disk if self.weight_sync == "disk" else self._sync_nccl)(named)
        else:
            for _ in named:  # take part in the gathers only
                pass
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # no rank generates before rank 0 has pushed the weights

    def _sync_disk(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """The servers load weights_sync/step_<version>. Never in a begin/end session: the load
        post-processes the weights and leaves it unmarked, so end would post-process again."""
        from safetensors.torch import save_file

        # copies: tied weights share no storage
        tensors = {n: t.to("cpu", copy=True).contiguous() for n, t in named}
        root = Path(self.run_dir, "weights_sync").absolute()
        root.mkdir(parents=True, exist_ok=True)
        final, tmp = root / f"step_{self.version:06d}", tempfile.mkdtemp(dir=root)
        weights = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
        for src in Path(self.model_path).glob("*"):  # none: a hub name
            if src.is_file() and not src.name.endswith(weights):  # config, tokenizer
                shutil.copy2(src, tmp)
        save_file(tensors, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        list(self._all(self._call, "update_weights_from_disk", {"model_path": str(final)}))
        for old in root.glob("step_*"):
            if old != final:  # older syncs
                shutil.rmtree(old, ignore_errors=True)

    def _session(self, url: str, which: str) -> None:
        """From SGLang 0.5.21 distributed updates run only within /begin_ and /end_weight_update."""
        if url not in self.sessionless:
            try:
                self._call(url, f"{which}_weight_update", {})
            except HTTPError:  # 404
                self.sessionless.add(url)

    def _sync_nccl(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        list(self._all(self._session, "begin"))
        try:
            if self.group is None:
                self._init_weight_group()
            device = "cuda" if self.group_backend == "nccl" else "cpu"
            for bucket, last in iter_buckets(named, device):
                names, tensors = zip(*bucket)
                meta = {
                    "names": names,
                    "group_name": self.group_name,
                    "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors],
                    "flush_cache": last,
                }
                # no retry: a receive re-posted pairs with nothing
                posts = self._all(self._call, "update_weights_from_distributed", meta, 0)
                for t in tensors:  # the servers' receives, posted above, wait for these
                    dist.broadcast(t, src=0, group=self.group)
                list(posts)
        finally:
            list(self._all(self._session, "end"))

    def _init_weight_group(self) -> None:
        """Rank 0 and the servers' GPUs (from their rank_offset), outside the torchrun world, built
        as SGLang's init_custom_process_group builds its side so that both derive the same keys."""
        from torch.distributed import distributed_c10d as c10d

        sizes, backend = self.group_sizes, self.group_backend
        host = route_address(self.urls[0])
        self.group_name, world = f"nanoareal_weights_{uuid.uuid4().hex[:8]}", 1 + sum(sizes)
        timeout = timedelta(seconds=WEIGHT_GROUP_TIMEOUT_S)
        # the store hosted here (port 0: a free one, bound at once), not by rendezvous(): under
        # torchrun (TORCHELASTIC_USE_AGENT_STORE) that makes every rank a client and none a host
        store = dist.TCPStore(
            host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        posts = [
            self.pool.submit(
                self._call,
                u,
                "init_weights_update_group",
                {
                    "master_address": host,
                    "master_port": store.port,
                    "rank_offset": 1 + sum(sizes[:i]),
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": backend,
                },
                0,
            )
            for i, u in enumerate(self.urls)
        ]
        self.group, _ = c10d._new_process_group_helper(
            world,
            0,
            [],
            c10d.Backend(backend),
            c10d.PrefixStore(self.group_name, store),
            group_name=self.group_name,
            timeout=timeout,
        )
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(world)}
        [p.result() for p in posts]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


# --rollout-backend: hf in the weights' dtype (bf16 on a GPU), bf16, or int4 weights; SGLang
BACKENDS = ("hf", "hf_bf16", "hf_int4", "sglang", "sglang_deterministic")


def check_rollout_config(backend: str, urls: list[str], weight_sync: str, cuda: bool) -> None:
    """Every combination of rollout flags and the GPU-only settings, before anything loads."""
    local = backend.startswith("sglang") and not urls
    for bad, why in [
        (backend.startswith("hf") and urls, "--rollout-url needs --rollout-backend sglang"),
        (
            urls and weight_sync == "tensor",
            "--weight-sync tensor needs an in-process engine (drop --rollout-url)",
        ),
        (
            local and weight_sync not in ("auto", "tensor"),
            "the in-process SGLang engine syncs "
            f"weights by tensor, not {weight_sync!r} (use --rollout-url for disk/nccl)",
        ),
        (
            local and not cuda,
            "--rollout-backend sglang without --rollout-url runs SGLang in-process and "
            "needs a GPU; there is none (pass --rollout-url, or --rollout-backend hf)",
        ),
        (
            local and importlib.util.find_spec("sglang") is None,
            "--rollout-backend sglang runs "
            "SGLang in-process, but sglang is not installed (pip install -e '.[gpu]'; see README)",
        ),
    ]:
        if bad:
            raise UserError(f"config error: {why}")


def make_engine(cfg, device: torch.device, share: bool = False) -> Engine:
    """The engine --rollout-backend names, for cfg.model on this rank's device."""
    backend = cfg.rollout_backend
    deterministic = backend == "sglang_deterministic"
    if cfg.rollout_url:  # with an sglang backend: check_rollout_config refuses hf
        return RemoteSGLangEngine(
            cfg.rollout_url,
            cfg.model,
            cfg.run_dir,
            cfg.weight_sync,
            deterministic,
            device=device,
        )
    if backend.startswith("sglang"):
        return SGLangEngine(cfg.model, cfg.seed, device, deterministic)
    dtype = torch.bfloat16 if backend == "hf_bf16" or device.type == "cuda" else None
    # the trainer's own tensors can serve only the trainer's precision (hf)
    return HFEngine(
        cfg.model, device, dtype, share=share and backend == "hf", int4=backend == "hf_int4"
    )


def is_url(name: str) -> bool:
    return name.startswith(("http://", "https://"))


class Scorer:
    """A teacher served by SGLang: the log-prob of every sampled token, by a prefill-only
    /generate (input_ids prompt + completion, max_new_tokens 0, logprob_start_len at the prompt's
    last token: input_token_logprobs' first entry is None, the rest score the completion).
    SGLang computes input log-probs at temperature 1 (0.5.13+): the trainer refuses another."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.pool = ThreadPoolExecutor(HTTP_THREADS, thread_name_prefix="teacher")

    def score(self, samples: list[Sample]) -> list[torch.Tensor]:
        """At temperature 1: the trainer refuses another with a served teacher."""
        return list(self.pool.map(self._score, samples))

    def _score(self, sample: Sample) -> torch.Tensor:
        prompt, output = sample.prompt_ids, sample.completion.output_ids
        payload = {
            "input_ids": prompt + output,
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        }
        out = http_request(self.url, "/generate", payload)
        pairs = out["meta_info"]["input_token_logprobs"][1:]
        if [int(p[1]) for p in pairs] != output:
            raise RuntimeError(
                f"teacher {self.url}: input_token_logprobs do not score the "
                "completion's tokens"
            )
        return torch.tensor([float(p[0]) for p in pairs], dtype=torch.float32)


# -----------------------------------------------------------------------------
# the batches in flight (--max-staleness)
class Rollouts:
    """Batch s is sampled by step max(0, s - K)'s weights, K = --max-staleness: take(s) starts the
    batches up to s + K (< steps) and returns s (through `share`); wait() lets those in flight
    finish: weights change only between batches. `overlap`: "process", a forked child (one torch
    thread) inheriting the engine (weights in shared memory), data and reward; "thread"; "" inline.
    If the child dies (a signal to the job), the trainer makes its batches by the same weights."""

    def __init__(
        self,
        make_batch,
        staleness: int,
        overlap: str,
        pending: dict[int, list],
        steps: int | None = None,
        share=lambda batch: batch,
    ):
        self.make_batch, self.staleness, self.steps = make_batch, staleness, steps
        self.share, self.batches = share, dict(pending)
        self.overlap = overlap if staleness > 0 else ""
        self.pool = self.conn = None
        if self.overlap == "thread":
            self.pool = ThreadPoolExecutor(
                1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
            )
        elif self.overlap == "process":
            # else a warning per fork
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            fork = multiprocessing.get_context("fork")
            self.conn, child = fork.Pipe()
            args = (make_batch, child, self.conn)
            fork.Process(target=_serve_batches, args=args, daemon=True).start()
            child.close()

    def describe(self) -> str:
        if not self.staleness:
            return "synchronous rollouts"
        how = (
            f"overlapped with training (a rollout {self.overlap})"
            if self.overlap
            else "not overlapped (colocated engine)"
        )
        return f"rollouts {self.staleness} step(s) ahead, {how}"

    def take(self, step: int) -> list:
        for s in range(step, step + self.staleness + 1):
            if s not in self.batches and (s == step or self.steps is None or s < self.steps):
                self.batches[s] = self._start(s)
        return self.share(self._made(step, self.batches.pop(step)))

    def wait(self) -> dict[int, list]:
        """Every batch in flight finished; returns the batches made ahead (for a checkpoint)."""
        self.batches = {s: self._made(s, b) for s, b in self.batches.items()}
        return self.batches

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)
        if self.conn:
            self.conn.close()  # the child's recv() ends: it exits

    def _start(self, step: int):
        if self.pool:
            return self.pool.submit(self.make_batch, step)
        if self.conn:
            with suppress(OSError):  # a dead child: _made makes the batch here
                self.conn.send(step)
            return IN_CHILD
        return self.make_batch(step)

    def _made(self, step: int, batch):
        if batch is not IN_CHILD:
            return batch.result() if isinstance(batch, Future) else batch
        try:  # batches come back in the order they were asked for: this one is the oldest
            if self.conn:
                s, batch, error = self.conn.recv()
                if error:
                    raise RuntimeError(f"the rollout process failed on step {s}:\n{error}")
                return batch
        except (EOFError, OSError):  # the child is gone: from now on batches are made here
            self.conn = None
        return self.make_batch(step)


def _serve_batches(make_batch, conn, trainer_end) -> None:
    """The rollout process: make_batch(step) for each step asked, until the trainer hangs up."""
    trainer_end.close()  # so that recv() ends if the trainer dies, too
    # Ctrl-C is the trainer's: it saves, then closes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a job's end: the trainer makes what it needs
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # GNU OpenMP hangs a fork whose parent ran threads if it runs more
    torch.set_num_threads(1)
    while True:
        try:
            step = conn.recv()
        except EOFError:
            return
        try:
            conn.send((step, make_batch(step), None))
        except Exception:
            conn.send((step, None, traceback.format_exc()))
