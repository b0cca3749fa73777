"""A stand-in SGLang HTTP server, backed by a small HF model through rollout.HFEngine, and the
tiny model it serves in tests (`save_tiny_llama`).

Requests, responses and their order follow SGLang's own source (entrypoints/http_server.py,
managers/io_struct.py, managers/schedule_batch.py, model_executor weight updaters), per version:

    POST /generate {"input_ids", "sampling_params", "return_logprob", "rid"} (or lists of them;
      "cached_tokens" counts the longest prefix of input_ids served before: its prefix cache)
      -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
          "completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id, null]]}}.
      It stops on the request's stop_token_ids and the model's eos ids (config.json,
      generation_config.json, the tokenizer's), none with ignore_eos. A stop sampled as the last
      allowed token finishes "length" before 0.5.18 (check_finished tests the length first),
      "stop" from 0.5.18 (update_finish_state tests the tokens first).
      Context (context_len: the model's max_position_embeddings): the tokenizer manager refuses
      input_len >= context_len, and input_len + max_new_tokens >= context_len (0.5.10) or >
      context_len (0.5.11+): one bad request fails the whole batch, 400. Its scheduler then caps
      max_new_tokens at max_req_len - input_len - 1 and aborts input_len >= max_req_len - 5,
      max_req_len = context_len - 1 (a token pool never smaller here).
      A request aborted while it runs (/abort_request with its rid) answers at once with the
      tokens it has so far, finish_reason {"type": "abort"}.
      With "logprob_start_len" k (and return_logprob), also "input_token_logprobs": [None] and
      the log-probs of tokens k+1.. at temperature 1; max_new_tokens 0 generates nothing (a
      prefill-only request: a teacher's scores).
    POST /abort_request {"rid"}     200; recorded in `aborted`, a request still running aborts
    GET  /health_generate           200, 503 while starting
    GET  /server_info               `info` (tp/pp/dp sizes, dtype, ...) and version
    POST /update_weights_from_disk  {"model_path"} -> {"success", "message", ...} (400 on failure);
                                    loads and post-processes the weights, never needs a session
    POST /begin_weight_update, /end_weight_update (from 0.5.21, else 404) -> {"success",
                                    "message"}, 400 when refused; end post-processes the weights
                                    unless a tensor/distributed update ran in the session
    POST /init_weights_update_group {"master_address", "master_port", "rank_offset",
                                    "world_size", "group_name", "backend"}: tp_size processes join
                                    the group as rank_offset + tp_rank, as SGLang's schedulers do
    POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
                                    "flush_cache"}: receives the broadcasts (from 0.5.21 only in a
                                    session) and loads them

Faults (each counts down per /generate): `abort_after` = (n_requests, k_tokens), `fail_5xx` = n,
`slow` = (n, seconds) before it answers, `drip` = (n, seconds per token): its tokens come that
slowly (an /abort_request meanwhile cuts the answer there); `gate_at` = n holds every /generate
until n are in flight (5 s at most); `start_delay` keeps /health_generate at 503;
`refuse_session` = a message refuses /begin_weight_update.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rollout import HFEngine, SamplingParams

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                 "sampling_seed", "skip_special_tokens", "no_stop_trim", "ignore_eos",
                 "min_new_tokens"}


class _Server(ThreadingHTTPServer):
    daemon_threads, request_queue_size = True, 256  # a whole batch connects at once

    def handle_error(self, request, client_address):  # a client that timed out and hung up
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class StandinSGLangServer:
    def __init__(self, model_path: str, version: str = "0.5.23", start_delay: float = 0.0,
                 tp_size: int = 1):
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.engine = HFEngine(model_path)
        self.model_path, self.version = model_path, version
        v = tuple(int(x) for x in version.split(".")[:3])
        self.session_routes, self.stop_first = v >= (0, 5, 21), v >= (0, 5, 18)
        self.info = {"tp_size": tp_size, "pp_size": 1, "dp_size": 1, "dtype": "float32",
                     "enable_deterministic_inference": False, "enable_fp32_lm_head": False}
        self.refuse_at_limit = v < (0, 5, 11)  # input + max_new_tokens >= context_len refused
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = AutoConfig.from_pretrained(model_path)
        self.context_len = config.max_position_embeddings
        eos = [config.eos_token_id, self.tokenizer.eos_token_id]
        try:
            eos.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
        except OSError:  # no generation_config.json
            pass
        self.eos_ids = {i for x in eos for i in (x if isinstance(x, list) else [x])
                        if i is not None}
        self.ready_at = time.monotonic() + start_delay
        self.lock = threading.Lock()  # one forward (or weight load) at a time, like one GPU
        self.calls: list[str] = []
        self.generate_bodies: list[dict] = []
        self.cache: list[list[int]] = []  # the sequences served (its radix cache, never evicted)
        self.cached: dict[str, int] = {}  # rid -> the cached_tokens it was sent
        self.finishes: dict[str, dict] = {}  # rid -> the finish_reason sent
        self.aborted: list[str] = []
        self.in_flight = self.peak_in_flight = 0  # /generate requests being served at once
        self.flight = threading.Condition()
        self.gate_at: int | None = None
        self.abort_after: tuple[int, int] | None = None
        self.fail_5xx = 0
        self.slow: tuple[int, float] | None = None
        self.drip: tuple[int, float] | None = None
        self.refuse_session: str | None = None
        self.session: dict | None = None  # {"loaded": bool} while a weight-update session is open
        self.post_processed = 0  # weight post-processing passes (process_weights_after_loading)
        self.members: list = []  # (process, pipe) per TP rank in the weight-update group
        self.group_inits: list[dict] = []  # /init_weights_update_group bodies
        self.unknown_weights: list[str] = []
        self.httpd = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> StandinSGLangServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        for proc, conn in self.members:
            conn.send(None)
            proc.join(10)

    # -- SGLang semantics

    def _fault(self) -> tuple[str | None, object]:
        with self.lock:
            if self.fail_5xx > 0:
                self.fail_5xx -= 1
                return "5xx", 0.0
            if self.slow and self.slow[0] > 0:
                self.slow = (self.slow[0] - 1, self.slow[1])
                return "slow", self.slow[1]
            if self.abort_after and self.abort_after[0] > 0:
                self.abort_after = (self.abort_after[0] - 1, self.abort_after[1])
                return "abort", float(self.abort_after[1])
            if self.drip and self.drip[0] > 0:
                self.drip = (self.drip[0] - 1, self.drip[1])
                return "drip", self.drip[1]
        return None, 0.0

    def _validate(self, input_ids: list[int], sp: dict) -> None:
        """The tokenizer manager's checks (_validate_one_request), before anything is scheduled."""
        n, max_new = len(input_ids), sp.get("max_new_tokens")
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        total = n + int(max_new or 0)
        if max_new is not None and (total > self.context_len or (
                self.refuse_at_limit and total == self.context_len)):
            raise ValueError(f"Requested token count exceeds the model's maximum context length "
                             f"of {self.context_len} tokens. You requested a total of {total} "
                             f"tokens: {n} tokens from the input messages and {max_new} tokens "
                             "for the completion.")

    def _generate_one(self, input_ids: list[int], sp: dict, rid: str, abort_k: int | None,
                      start: int | None = None) -> dict:
        t0 = time.monotonic()
        if unknown := set(sp) - SAMPLING_KEYS:
            raise ValueError("SamplingParams.__init__() got an unexpected keyword argument "
                             f"{sorted(unknown)[0]!r}")
        max_req_len = self.context_len - 1  # the scheduler's: silently caps, aborts long inputs
        max_new = min(int(sp.get("max_new_tokens", 128)), max_req_len - len(input_ids) - 1)
        stops = [] if sp.get("ignore_eos") else sorted(set(sp.get("stop_token_ids") or [])
                                                       | self.eos_ids)
        sampling = SamplingParams(max(max_new, 0), float(sp.get("temperature", 1.0)),
                                  float(sp.get("top_p", 1.0)), int(sp.get("top_k", -1)), stops)
        if len(input_ids) >= max_req_len - 5:  # handle_generate_request: aborted, unscheduled
            ids, lps = [], []
            finish = {"type": "abort", "message": f"Input length ({len(input_ids)} tokens) "
                      f"exceeds the maximum allowed length ({max_req_len - 5} tokens).",
                      "status_code": 400, "err_type": "BadRequestError"}
        else:
            with self.lock:
                c = self.engine.generate([input_ids], sampling,
                                         [int(sp.get("sampling_seed", 0))])[0]
            ids, lps = c.output_ids, c.logprobs
            if c.finish_reason == "stop" and (self.stop_first or len(ids) < max_new):
                finish = {"type": "stop", "matched": ids[-1]}
            else:  # FINISH_LENGTH(length=max_new_tokens)
                finish = {"type": "length", "length": max_new}
        if (abort_k is not None and abort_k < len(ids)) or rid in self.aborted:
            cut = 0 if abort_k is None else abort_k  # aborted before it ran: nothing generated
            ids, lps = ids[:cut], lps[:cut]
            finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                      "err_type": None}
        self.finishes[rid] = finish
        with self.lock:  # cached_tokens: the longest prefix of input_ids served before, as SGLang's
            cached = max((next((j for j, (a, b) in enumerate(zip(input_ids, seq)) if a != b),
                                min(len(input_ids), len(seq))) for seq in self.cache), default=0)
            self.cache.append(input_ids + ids)
            self.cached[rid] = min(cached, len(input_ids) - 1)  # one token is always computed
        return {"text": self.tokenizer.decode(ids), "output_ids": ids,
                "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                              "completion_tokens": len(ids), "cached_tokens": self.cached[rid],
                              "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                              "e2e_latency": time.monotonic() - t0}
                | ({} if start is None else {"input_token_logprobs": self._inputs(input_ids,
                                                                                   start)})}

    def _inputs(self, input_ids: list[int], start: int) -> list:
        """input_token_logprobs from logprob_start_len `start` (SGLang's tokenizer manager:
        [None] + the log-probs of tokens start+1.. given their prefix), at temperature 1
        (0.5.13+: plain log_softmax, whatever the request's temperature)."""
        with self.lock, torch.no_grad():
            ids = torch.tensor([input_ids])
            logp = self.engine.model(input_ids=ids, use_cache=False).logits[0].float()
            logp = logp.log_softmax(-1)
        values = [None] + [logp[j - 1, input_ids[j]].item()
                           for j in range(start + 1, len(input_ids))]
        return [[v, t, None] for v, t in zip(values, input_ids[start:])]

    def _drip(self, out: dict, seconds: float, rid: str) -> dict:
        """`out` as a slow server gives it: a token every `seconds`; aborted meanwhile, the tokens
        so far with finish_reason abort (the scheduler's FINISH_ABORT for a running request)."""
        ids = out["output_ids"]
        for k in range(len(ids)):
            time.sleep(seconds)
            if rid in self.aborted:
                meta = out["meta_info"]
                pairs = meta["output_token_logprobs"][:k]
                abort = {"type": "abort", "message": "Abort before finished"}
                self.finishes[rid] = abort
                return out | {"output_ids": ids[:k], "meta_info": meta | {
                    "finish_reason": abort, "completion_tokens": k,
                    "output_token_logprobs": pairs}}
        return out

    def _load(self, tensors: dict) -> None:
        own = self.engine.model.state_dict()
        with self.lock, torch.no_grad():
            for k, v in tensors.items():
                if k in own:
                    own[k].copy_(v)
                else:  # SGLang only logs a warning
                    self.unknown_weights.append(k)

    def _load_from_disk(self, model_path: str) -> tuple[bool, str]:
        from safetensors.torch import load_file

        path = os.path.join(model_path, "model.safetensors")
        if not os.path.exists(path):
            return False, f"Failed to get weights iterator: {path} not found"
        new = load_file(path)
        if missing := [k for k in self.engine.model.state_dict() if k not in new]:
            return False, f"missing weights {missing[:3]}"
        self._load(new)
        self.post_processed += 1  # load_weights_and_postprocess; the session is not marked
        return True, "Succeeded to update model weights."

    def _session(self, begin: bool) -> tuple[bool, str]:
        if begin and self.refuse_session:
            return False, self.refuse_session
        if begin == (self.session is not None):
            return False, ("a weight-update session is already open; call end_weight_update() "
                           "first" if begin else "no weight-update session is open; call "
                           "begin_weight_update() first")
        if not begin and not self.session["loaded"]:
            self.post_processed += 1  # end_weight_update(run_post_load=True)
        self.session = {"loaded": False} if begin else None
        return True, "Success"

    def _init_group(self, body: dict) -> tuple[bool, str]:
        self.group_inits.append(body)
        ctx = mp.get_context("spawn")  # SGLang's schedulers are processes of their own
        for tp_rank in range(self.info["tp_size"]):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_group_member, daemon=True, args=(
                there, body["master_address"], body["master_port"], body["world_size"],
                body["rank_offset"] + tp_rank, body["group_name"], body.get("backend", "nccl")))
            proc.start()
            self.members.append((proc, here))
        results = [conn.recv() for _, conn in self.members[-self.info["tp_size"]:]]
        return next((r for r in results if not r[0]), results[0])

    def _update_from_distributed(self, body: dict) -> tuple[bool, str]:
        if self.session_routes and self.session is None:
            return False, ("update_weights_from_distributed must run between "
                           "begin_weight_update() and end_weight_update()")
        for _, conn in self.members:
            conn.send(body)
        received = [conn.recv() for _, conn in self.members]
        self._load(received[0])
        if self.session is not None:
            self.session["loaded"] = True
        return True, "Succeeded to update parameter online."

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _send(self, code: int, body) -> None:
                data = (json.dumps(body) if not isinstance(body, str) else body).encode()
                self.send_response(code)
                kind = "application/json" if not isinstance(body, str) else "text/plain"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _result(self, ok: bool, message: str, **extra) -> None:
                self._send(200 if ok else 400, {"success": ok, "message": message} | extra)

            def do_GET(self):
                server.calls.append(self.path)
                if self.path == "/health_generate":
                    if time.monotonic() < server.ready_at:
                        return self._send(503, {"error": "server is starting"})
                    return self._send(200, "")
                if self.path == "/server_info":
                    return self._send(200, server.info | {"version": server.version})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                server.calls.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0)))
                                  or b"{}")
                route = self.path
                if route == "/generate":
                    return self._generate(body)
                if route == "/abort_request":
                    server.aborted.append(body.get("rid", ""))
                    return self._send(200, "")
                if route == "/flush_cache":
                    return self._send(200, "Cache flushed.\n")
                if route == "/update_weights_from_disk":
                    return self._result(*server._load_from_disk(body["model_path"]),
                                        num_paused_requests=0)
                if route in ("/begin_weight_update", "/end_weight_update") and \
                        server.session_routes:
                    return self._result(*server._session(route == "/begin_weight_update"))
                if route == "/init_weights_update_group":
                    return self._result(*server._init_group(body))
                if route == "/update_weights_from_distributed":
                    return self._result(*server._update_from_distributed(body))
                self._send(404, {"detail": "Not Found"})

            def _generate(self, body: dict):
                with server.flight:
                    server.in_flight += 1
                    server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
                    server.flight.notify_all()
                    server.flight.wait_for(lambda: server.in_flight >= (server.gate_at or 0), 5)
                try:
                    self._generate_in_flight(body)
                finally:
                    with server.flight:
                        server.in_flight -= 1

            def _generate_in_flight(self, body: dict):
                server.generate_bodies.append(body)
                fault, arg = server._fault()
                if fault == "5xx":
                    return self._send(503, {"error": "injected failure"})
                if fault == "slow":
                    time.sleep(arg)
                sp = body.get("sampling_params") or {}
                ids = body["input_ids"]
                batch = bool(ids) and isinstance(ids[0], list)
                rows = ids if batch else [ids]
                sps = sp if isinstance(sp, list) else [sp] * len(rows)
                rid = body.get("rid")
                rids = rid if isinstance(rid, list) else [f"{rid}-{i}" if batch else rid
                                                          for i in range(len(rows))]
                abort_k = int(arg) if fault == "abort" else None
                try:
                    for r, s in zip(rows, sps):  # every request first: one bad fails them all
                        server._validate(r, s)
                    start = body.get("logprob_start_len") if body.get("return_logprob") else None
                    outs = [server._generate_one(r, s, i, abort_k, start)
                            for r, s, i in zip(rows, sps, rids)]
                except ValueError as e:
                    return self._send(400, {"error": {"message": str(e)}})
                if fault == "drip":  # its tokens come `arg` s apart; an abort cuts them there
                    outs = [server._drip(o, arg, i) for o, i in zip(outs, rids)]
                self._send(200, outs if batch else outs[0])

        return Handler


def save_tiny_llama(out, dtype=torch.float32, **config) -> str:
    """A throwaway tiny Llama with a character tokenizer (a llama model_type: see NOTES on
    tokenizers) in `out`: "<pad>" 0, "<eos>" 1 (its eos), "<unk>" 2, then "0123456789+= -*"."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789+= -*"])}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, bos_token_id=None, eos_token_id=1,
                      pad_token_id=0, **{"tie_word_embeddings": False} | config)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(out)
    return str(out)


def _group_member(conn, host: str, port: int, world_size: int, rank: int, group_name: str,
                  backend: str) -> None:
    """One SGLang scheduler's side of the weight-update group, in a process of its own: joined as
    its init_custom_process_group does (tcp:// rendezvous, PrefixStore(group_name), torch's
    _new_process_group_helper), each update received as receive_weights_from_distributed does
    (empty tensors of the announced dtypes and shapes, broadcast from rank 0)."""
    import inspect
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    try:
        timeout = timedelta(minutes=2)
        store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size,
                                                       timeout=timeout))
        store.set_timeout(timeout)
        params = inspect.signature(c10d._new_process_group_helper).parameters
        options = "backend_options" if "backend_options" in params else "pg_options"
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                               c10d.PrefixStore(group_name, store),
                                               group_name=group_name, timeout=timeout,
                                               **{options: None})
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    except Exception as e:
        conn.send((False, f"Failed to initialize custom process group: {e}."))
        return
    conn.send((True, "Succeeded to initialize custom process group."))
    while (meta := conn.recv()) is not None:
        weights = {name: torch.empty(shape, dtype=getattr(torch, dtype))
                   for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"])}
        for handle in [c10d.broadcast(w, src=0, group=pg, async_op=True)
                       for w in weights.values()]:
            handle.wait()
        conn.send(weights)
