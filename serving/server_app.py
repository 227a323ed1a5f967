"""`online-spec serve` and its HTTP routes: OpenAI `/v1/completions` and `/v1/chat/completions`,
SGLang's `/generate`, `/health`, `/server_info`, `/metrics`, `/v1/models`.

In: a `SpecServer` (serving/server.py), which owns the engine, its thread and the metrics. Out:
a FastAPI app. Every generating route does the same three things: read the body (413 beyond
`max_body_bytes`), then parse, validate and tokenize it off the event loop, on one worker thread
(400 with a message on anything we cannot honour: invalid JSON, nesting too deep, a lone
surrogate, out-of-range parameters), `server.submit` (503 when the queue is full, 400 for a
prompt too long), then read the request's outputs from its queue — as SSE events when streaming,
into one body otherwise. A client that goes away (stream closed, or disconnect noticed while a
non-streaming request waits) has its request aborted, which frees its engine slot.
`HttpThread` serves the app from a background thread (tests, benches).

    online-spec serve --host 127.0.0.1 --port 30000 [--draft DIR] [--num-steps 3] [--max-batch 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import torch
import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from collector.publisher import PublisherConfig
from online_spec.config import add_config_args, config_from_args
from online_spec.drift import DriftConfig
from serving import api
from serving.api import ApiError
from serving.control import ControlConfig
from serving.engine import EngineConfig
from serving.head_bank import BankConfig
from serving.server import ServerConfig, SpecServer, build_server
from serving.server_detok import TextStream
from serving.server_loop import EngineError, RequestStream

log = logging.getLogger(__name__)


TAG_HEADER = "x-traffic-tag"
DISCONNECT_POLL_S = 1.0


class _Job:
    """One generating request as the route sees it: its stream, text and bookkeeping."""

    def __init__(self, server: SpecServer, endpoint: str, stream: RequestStream, stop: list[str]):
        self.server, self.endpoint, self.stream = server, endpoint, stream
        self.text = TextStream(server.tokenizer, stop)
        self.done = False
        self.failed = False  # an EngineError ended it

    @property
    def rid(self) -> str:
        return self.stream.request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.request.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        """Tokens the engine committed to the request (read once it finished)."""
        return len(self.stream.request.output_ids)

    def usage(self) -> dict:
        return api.usage(self.prompt_tokens, self.completion_tokens)

    async def events(self) -> AsyncIterator[str]:
        """Text deltas as outputs arrive (the last one once finished); aborts the request if the
        consumer stops early (client disconnect, cancellation)."""
        try:
            while True:
                item = await self.stream.queue.get()
                if isinstance(item, EngineError):
                    self.failed = True
                    raise ApiError(item.status, item.message,
                                   "server_error" if item.status >= 500 else "invalid_request_error")
                self.stream.note(item)
                delta = self.text.push(item.new_token_ids)
                if self.text.matched_stop is not None and not item.finished:
                    # the stop string showed in the text before the engine's own check saw it
                    self.server.loop.abort(self.rid)
                    self.stream.finished, self.stream.finish_reason = True, "stop"
                if self.stream.finished:
                    self.done = True
                    yield delta + self.text.finish()
                    return
                if delta:
                    yield delta
        finally:
            if not self.done:
                self.server.loop.abort(self.rid)
            self._record()

    async def collect(self, request: Request) -> str:
        """Run to completion for a non-streaming response, aborting if the client disconnects."""
        async def consume():
            async for _ in self.events():
                pass
        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected")
        task.result()
        return self.text.final_text()

    def _record(self) -> None:
        s = self.stream
        outcome = "error" if self.failed else s.finish_reason if self.done else "disconnected"
        ttft = None if s.t_first is None else s.t_first - s.t_submit
        n = len(self.text.detok.ids)
        tpot = (s.t_last - s.t_first) / (n - 1) if s.t_first is not None and n > 1 else None
        self.server.metrics.on_request_done(self.endpoint, outcome or "error", self.prompt_tokens, ttft, tpot)

    def spec_meta(self) -> dict:
        s = self.stream
        return {"spec_verify_ct": s.verify_ct,
                "spec_accept_length": (s.accepted / s.verify_ct + 1.0) if s.verify_ct else 1.0,
                "spec_num_correct_drafts": s.accepted, "spec_num_proposed_drafts": s.proposed,
                "spec_accept_rate": s.accepted / s.proposed if s.proposed else 0.0,
                "draft_version": self.server.engine.head_version}


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 once it passes `limit` bytes (announced or received)."""
    announced = request.headers.get("content-length")
    if announced is not None and announced.isdigit() and int(announced) > limit:
        raise ApiError(413, f"request body of {announced} bytes exceeds the limit of {limit} bytes (--max-body-bytes)",
                       "request_too_large")
    chunks, got = [], 0
    async for chunk in request.stream():
        got += len(chunk)
        if got > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes (--max-body-bytes)",
                           "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(raw: bytes, model):
    """The JSON body as `model`, whatever Content-Type the client sent (curl -d sends a form type).
    Runs on the worker thread: a large body costs the event loop nothing."""
    try:
        data = json.loads(raw or b"null")
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # a lone surrogate ("\ud800") cannot be text
    except RecursionError:
        raise ApiError(400, "the body nests JSON too deeply") from None
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the body holds a string that is not valid Unicode ({e.reason}: a lone surrogate "
                            f"{e.object[e.start:e.end]!a})") from None
    except ValueError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ApiError(400, _validation_message(e.errors())) from None
    except RecursionError:
        raise ApiError(400, "the body nests JSON too deeply") from None


def _validation_message(errors) -> str:
    msgs = [f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
            for err in errors]
    return "; ".join(msgs) or "invalid request"


def _tag(request: Request, body_tag: str | None) -> str:
    return body_tag or request.headers.get(TAG_HEADER, "") or ""


def _sse_stream(job: _Job, chunks: AsyncIterator[str]) -> StreamingResponse:
    async def body():
        try:
            async for line in chunks:
                yield line
        except ApiError as e:
            yield api.sse(e.body())
        yield api.sse("[DONE]")
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})


def build_app(server: SpecServer) -> FastAPI:
    # FastAPI keeps every endpoint function in a module-level cache (fastapi.dependencies.models,
    # keyed by _CallIdentity) for the life of the process: endpoints closing over the server itself
    # would keep each server, its engine and its KV caches alive after close (a bench of 9
    # sessions reached ~19 GB). They hold a weak proxy; the caller owns the server.
    server = weakref.proxy(server)
    app = FastAPI(title="online-spec", docs_url=None, redoc_url=None)
    # parsing and tokenization: off the event loop, one at a time (one tokenizer, and 2 cores)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="http-parse")

    async def prepare(request: Request, model, make: Callable) -> tuple:
        """(body, *make(body)) for the request's JSON body, parsed, validated and tokenized on the
        worker thread; ApiError for anything the server will not run."""
        raw = await _read_body(request, server.cfg.max_body_bytes)

        def work():
            body = _parse(raw, model)
            try:
                return (body, *make(body))
            except ApiError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a chat template or tokenizer refusing the text
                raise ApiError(400, f"cannot tokenize the prompt: {type(e).__name__}: {e}", param="prompt") from None
        return await asyncio.get_running_loop().run_in_executor(pool, work)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        if e.status in (400, 413):
            server.metrics.on_rejected("invalid" if e.status == 400 else "too_large")
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        return JSONResponse(ApiError(400, _validation_message(e.errors())).body(), status_code=400)

    def start(endpoint: str, prompt_ids: list[int], params, tag: str, rid: str) -> _Job:
        return _Job(server, endpoint, server.submit(prompt_ids, params, tag, rid), params.stop)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body, params, ids = await prepare(request, api.CompletionRequest, lambda b: (
            b.sampling_params(default_max_tokens=16), b.prompt_ids(server.tokenizer)))
        job = start("completions", ids, params, _tag(request, body.tag), f"cmpl-{uuid.uuid4().hex}")
        model = server.model_name
        if not body.stream:
            text = await job.collect(request)
            return api.completion_body(job.rid, model, text, job.stream.finish_reason,
                                       job.usage())

        async def chunks():
            async for delta in job.events():
                fin = job.stream.finish_reason if job.done else None
                yield api.sse(api.completion_body(job.rid, model, delta, fin, None, chunk=True))
            if body.include_usage:
                yield api.sse(api.usage_chunk(job.rid, "text_completion", model, job.usage()))
        return _sse_stream(job, chunks())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body, params, ids = await prepare(request, api.ChatCompletionRequest, lambda b: (
            b.sampling_params(default_max_tokens=server.cfg.default_max_tokens),
            server.engine.target.encode_chat(b.chat())))
        job = start("chat", ids, params, _tag(request, body.tag), f"chatcmpl-{uuid.uuid4().hex}")
        model = server.model_name
        if not body.stream:
            text = await job.collect(request)
            return api.chat_body(job.rid, model, text, job.stream.finish_reason,
                                 job.usage())

        async def chunks():
            yield api.sse(api.chat_body(job.rid, model, "", None, None, chunk=True, first=True))
            async for delta in job.events():
                if delta:
                    yield api.sse(api.chat_body(job.rid, model, delta, None, None, chunk=True))
                if job.done:
                    yield api.sse(api.chat_body(job.rid, model, None, job.stream.finish_reason, None, chunk=True))
            if body.include_usage:
                yield api.sse(api.usage_chunk(job.rid, "chat.completion.chunk", model, job.usage()))
        return _sse_stream(job, chunks())

    @app.post("/generate")
    async def generate(request: Request):
        body, params, ids = await prepare(request, api.GenerateRequest, lambda b: (
            b.params(), b.prompt_ids(server.tokenizer)))
        rid = body.rid or uuid.uuid4().hex
        job = start("generate", ids, params, _tag(request, body.tag), rid)

        def result(text: str) -> dict:
            s = job.stream
            fin = api.sglang_finish_reason(s.finish_reason, job.text.matched_stop,
                                           s.request.output_ids[-1] if s.request.output_ids else None,
                                           job.completion_tokens) if s.finished else None
            meta = {"id": rid, "finish_reason": fin, "prompt_tokens": job.prompt_tokens,
                    "completion_tokens": job.completion_tokens if s.finished else len(job.text.detok.ids),
                    "cached_tokens": 0, "e2e_latency": time.perf_counter() - s.t_submit, **job.spec_meta()}
            ids = list(s.request.output_ids) if s.finished else list(job.text.detok.ids)
            return {"text": text, "output_ids": ids, "meta_info": meta}

        if not body.stream:
            return result(await job.collect(request))

        async def chunks():
            text = ""
            async for delta in job.events():
                text += delta
                yield api.sse(result(text))
        return _sse_stream(job, chunks())

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            return JSONResponse({"status": "engine loop stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return server.info()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "online-spec"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def root():
        return PlainTextResponse("online-spec server: see /v1/completions, /v1/chat/completions, /generate, "
                                 "/server_info, /metrics\n")

    return app


class HttpThread:
    """uvicorn serving `build_app(server)` in a background thread (tests, benches)."""

    def __init__(self, server: SpecServer, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app = build_app(server)
        self.sock = socket.socket()
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.uvicorn = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=2,
                                                     limit_concurrency=None, backlog=2048))
        self._thread = threading.Thread(target=lambda: asyncio.run(self.uvicorn.serve(sockets=[self.sock])),
                                        name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "HttpThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(10)
        self.sock.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_args(parser, ServerConfig)
    add_config_args(parser, EngineConfig)
    add_config_args(parser, DriftConfig, prefix="drift_")
    add_config_args(parser, PublisherConfig, prefix="capture_")
    add_config_args(parser, ControlConfig)
    add_config_args(parser, BankConfig, prefix="bank_")


def run(args: argparse.Namespace) -> int:
    engine_cfg = config_from_args(EngineConfig, args)
    drift_cfg = config_from_args(DriftConfig, args, prefix="drift_")
    publisher_cfg = config_from_args(PublisherConfig, args, prefix="capture_")
    cfg = config_from_args(ServerConfig, args, engine=engine_cfg, drift=drift_cfg, publisher=publisher_cfg,
                           control=config_from_args(ControlConfig, args),
                           bank=config_from_args(BankConfig, args, prefix="bank_"))
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: with the default
    # handler that kills the process before `finally` removes the token and the sockets
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    server = build_server(cfg)
    try:
        server.start()
        policy = server.engine.policy.name + (f" K={cfg.engine.num_steps}" if server.engine.policy.name == "static" else "")
        log.info("serving %s (head version %d, K policy %s, %d torch threads) on http://%s:%d", server.model_name,
                 server.engine.head_version, policy, torch.get_num_threads(), cfg.host, cfg.port)
        uvicorn.run(build_app(server), host=cfg.host, port=cfg.port, log_level=cfg.log_level)
    finally:
        server.close()
    return 0


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)
