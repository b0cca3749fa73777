"""A stand-in for an SGLang HTTP server, backed by a small HF model through rollout.HFEngine.

Request and response JSON follow SGLang's native API
(python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py, managers/schedule_batch.py
FINISH_* .to_json()):

    POST /generate {"input_ids": [..] | [[..], ..], "sampling_params": {..} | [{..}, ..],
                    "return_logprob": true, "rid": ..}
      -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
          "completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id, null]],
          "e2e_latency"}}     (a list of those for a batch); finish_reason is
          {"type": "stop", "matched": id} | {"type": "length", "length": n} |
          {"type": "abort", "message", "status_code", "err_type"}
    GET  /health_generate      200, or 503 while the server is starting
    POST /flush_cache          200 text
    POST /update_weights_from_disk {"model_path"} -> {"success", "message", "num_paused_requests"}
                               (400 on failure)
    POST /begin_weight_update, /end_weight_update {} -> {"success", "message"}, only with
                               `weight_update_session=True` (SGLang >= 0.5.21); otherwise 404
                               {"detail": "Not Found"}, as FastAPI answers an unknown route
    GET  /server_info          the server's arguments ({"tp_size": 1,
                               "enable_deterministic_inference": ...}) and "version"; with
                               `legacy_info_only`, 404 (SGLang < 0.5.10)
    GET  /get_server_info      the same (deprecated route)

Faults to inject (each counts down per /generate request): `abort_after` = (n_requests,
k_tokens), `fail_5xx` = n_requests, `slow` = (n_requests, seconds). `start_delay` keeps
/health_generate at 503; `refuse_session` = a message makes /begin_weight_update answer
{"success": false, "message": ...}.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from rollout import HFEngine, SamplingParams


class _Server(ThreadingHTTPServer):
    # a client that timed out and hung up is not an error here
    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class StandinSGLangServer:
    def __init__(self, model_path: str, weight_update_session: bool = True,
                 start_delay: float = 0.0, version: str = "0.5.21-standin",
                 legacy_info_only: bool = False):
        self.engine = HFEngine(model_path)
        self.model_path = model_path
        self.weight_update_session = weight_update_session
        self.version = version
        self.ready_at = time.monotonic() + start_delay
        self.lock = threading.Lock()  # one forward at a time, like one GPU
        self.calls: list[str] = []
        self.generate_bodies: list[dict] = []
        self.abort_after: tuple[int, int] | None = None
        self.fail_5xx = 0
        self.slow: tuple[int, float] | None = None
        self.reject_sampling_seed = False
        self.in_session = False
        self.legacy_info_only = legacy_info_only
        self.deterministic = False  # --enable-deterministic-inference
        self.refuse_session: str | None = None
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        except Exception:  # a server started with skip_tokenizer_init returns "" text
            self.tokenizer = None
        self.httpd = _Server(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> StandinSGLangServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- SGLang semantics

    def _fault(self) -> tuple[str | None, float]:
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
        return None, 0.0

    def _generate_one(self, input_ids: list[int], sp: dict, rid: str, abort_k: int | None) -> dict:
        t0 = time.monotonic()
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                 "sampling_seed",
                 "skip_special_tokens", "no_stop_trim", "ignore_eos", "min_new_tokens"}
        unknown = set(sp) - known
        if unknown:
            raise ValueError("SamplingParams.__init__() got an unexpected keyword argument "
                             f"{sorted(unknown)[0]!r}")
        sampling = SamplingParams(int(sp.get("max_new_tokens", 128)),
                                  float(sp.get("temperature", 1.0)),
                                  float(sp.get("top_p", 1.0)), int(sp.get("top_k", -1)),
                                  list(sp.get("stop_token_ids") or []))
        seed = int(sp.get("sampling_seed", 0))
        with self.lock:
            c = self.engine.generate([input_ids], sampling, [seed])[0]
        ids, lps = c.output_ids, c.logprobs
        if c.finish_reason == "stop":
            finish = {"type": "stop", "matched": ids[-1]}
        else:
            finish = {"type": "length", "length": len(ids)}
        if abort_k is not None and abort_k < len(ids):
            ids, lps = ids[:abort_k], lps[:abort_k]
            finish = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                      "err_type": None}
        text = self.tokenizer.decode(ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": ids,
                "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids),
                              "completion_tokens": len(ids), "cached_tokens": 0,
                              "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                              "e2e_latency": time.monotonic() - t0}}

    def _load_from_disk(self, model_path: str) -> tuple[bool, str]:
        from safetensors.torch import load_file

        path = os.path.join(model_path, "model.safetensors")
        if not os.path.exists(path):
            return False, f"Failed to get weights iterator: {path} not found"
        new = load_file(path)
        own = self.engine.model.state_dict()
        missing = [k for k in own if k not in new]
        if missing:
            return False, f"missing weights {missing[:3]}"
        with self.lock, torch.no_grad():
            for k, v in new.items():
                own[k].copy_(v)
        return True, "Succeeded to update model weights."

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

            def do_GET(self):
                server.calls.append(self.path)
                if self.path == "/health_generate":
                    if time.monotonic() < server.ready_at:
                        return self._send(503, {"error": "server is starting"})
                    return self._send(200, "")
                if self.path == "/get_server_info" or (self.path == "/server_info"
                                                       and not server.legacy_info_only):
                    return self._send(200, {"tp_size": 1, "version": server.version,
                                            "enable_deterministic_inference":
                                                server.deterministic})
                self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                server.calls.append(self.path)
                n = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(n) or b"{}")
                if self.path == "/generate":
                    return self._generate(body)
                if self.path == "/flush_cache":
                    return self._send(200, "Cache flushed.\n")
                if self.path == "/update_weights_from_disk":
                    ok, msg = server._load_from_disk(body["model_path"])
                    return self._send(200 if ok else 400, {"success": ok, "message": msg,
                                                           "num_paused_requests": 0})
                if self.path in ("/begin_weight_update",
                                 "/end_weight_update") and server.weight_update_session:
                    begin = self.path == "/begin_weight_update"
                    if begin and server.refuse_session:
                        return self._send(200, {"success": False,
                                                "message": server.refuse_session})
                    if begin == server.in_session:
                        return self._send(400,
                                          {"error": f"{self.path}: session state is "
                                           f"{server.in_session}"})
                    server.in_session = begin
                    return self._send(200, {"success": True, "message": ""})
                self._send(404, {"detail": "Not Found"})

            def _generate(self, body: dict):
                server.generate_bodies.append(body)
                fault, arg = server._fault()
                if fault == "5xx":
                    return self._send(503, {"error": "injected failure"})
                if fault == "slow":
                    time.sleep(arg)
                sp = body.get("sampling_params") or {}
                first = sp if isinstance(sp, dict) else sp[0]
                if server.reject_sampling_seed and "sampling_seed" in first:
                    return self._send(400, {"error": "SamplingParams.__init__() got an "
                                            "unexpected keyword argument 'sampling_seed'"})
                ids = body["input_ids"]
                batch = bool(ids) and isinstance(ids[0], list)
                rows = ids if batch else [ids]
                sps = sp if isinstance(sp, list) else [sp] * len(rows)
                rid = body.get("rid")
                rids = rid if isinstance(rid, list) else [f"{rid}-{i}" if batch else rid
                                                          for i in range(len(rows))]
                abort_k = int(arg) if fault == "abort" else None
                try:
                    outs = [server._generate_one(r, s, i, abort_k)
                            for r, s, i in zip(rows, sps, rids)]
                except ValueError as e:
                    return self._send(400, {"error": {"message": str(e)}})
                self._send(200, outs if batch else outs[0])

        return Handler
