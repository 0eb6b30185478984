"""The OpenAI-compatible HTTP API (Starlette) over the worker pool (grpc.aio).

    POST /v1/completions, /v1/chat/completions   (stream: SSE, ending in `data: [DONE]`; sse.py)
    GET  /v1/models, /v1/models/{id}, /health (live), /ready (a worker is SERVING), /metrics (Prometheus)

A request becomes one worker call per prompt and choice (n fans out), routed by prefix affinity (routing.py).
Streams are opened, and the worker's acceptance awaited, before the HTTP status goes out: a refused request gets its
real status (400, 429, 503, ...), not a 200 stream holding an error. The worker accepts with its initial metadata
as soon as the request is admitted, so the response starts while the prompt is prefilled and its first token goes
out as soon as it comes (a worker that sends no early metadata accepts with its first message). After acceptance a
failure (a worker that died, the deadline) ends the stream with an error event, `data: {"error": {...}}`. A client
that goes away cancels its worker calls (gRPC cancellation: the worker stops the request at its next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import AsyncIterator, Awaitable, TypeVar

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import openai_api
from gateway.config import GatewayConfig
from gateway.errors import APIError, from_grpc
from gateway.metrics import GatewayMetrics
from gateway.openai_api import Parsed
from gateway.sse import EventStream
from gateway.workers import Worker, WorkerPool
from proto import generation_pb2

log = logging.getLogger("gateway")

WORKER_HEADER = "x-ragserve-worker"  # the worker(s) that served a request (routing is observable)
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
_MAX_ATTEMPTS = 3
T = TypeVar("T")


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # built once, not per call


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class Gateway:
    """The app's state: config, API keys, worker pool, metrics."""

    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        self.keys = [f"Bearer {k}".encode() for k in sorted(cfg.keys())]
        self.metrics = GatewayMetrics.create()
        self.pool: WorkerPool | None = None

    # ------------------------------------------------------------------------------------------ plumbing

    def check_auth(self, request: Request) -> None:
        if not self.keys:
            return
        got = request.headers.get("authorization", "").encode("utf-8", "replace")
        ok = False
        for want in self.keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(got, want)
        if not ok:
            why = "missing" if not got else "invalid"
            raise APIError(401, f"{why} API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def body(self, request: Request) -> dict:
        limit = self.cfg.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None

    def served_model(self, asked: str) -> str:
        name = self.pool.model_name()
        if not name:
            raise APIError(503, "no generation worker is serving yet", code="no_worker")
        if asked != name:
            raise APIError(404, f"The model `{asked}` does not exist (this server serves `{name}`)", param="model",
                           code="model_not_found")
        return name

    def _pick(self, key: str, tried: set[str], why: str | None) -> tuple[Worker, str]:
        got = self.pool.pick(key, tried)
        if got is None:
            if tried:
                raise APIError(503, "no other generation worker is serving", code="no_worker")
            raise APIError(503, "no generation worker is serving", code="no_worker")
        w, reason = got
        self.metrics.child(self.metrics.routed, w.address, why or reason).inc()
        return w

    def _retry(self, e: grpc.aio.AioRpcError, tried: set[str]) -> bool:
        return (e.code() in _RETRY_CODES and len(tried) < _MAX_ATTEMPTS
                and any(w.address not in tried for w in self.pool.healthy()))

    # -------------------------------------------------------------------------------------- worker calls

    async def generate(self, req: generation_pb2.GenerateRequest, key: str,
                       served: list[str]) -> generation_pb2.GenerateResponse:
        """One unary call, retried on another worker when refused (UNAVAILABLE, RESOURCE_EXHAUSTED); the worker
        that answered is appended to `served`."""
        tried: set[str] = set()
        while True:
            w = self._pick(key, tried, "retry" if tried else None)
            w.inflight += 1
            try:
                reply = await w.stub.Generate(req, timeout=self.cfg.request_timeout_s, metadata=self.pool.metadata)
                served.append(w.address)
                return reply
            except grpc.aio.AioRpcError as e:
                self.pool.failed(w, e)
                tried.add(w.address)
                if not self._retry(e, tried):
                    raise from_grpc(e, w.address) from None
            finally:
                w.inflight -= 1

    async def open_stream(self, req: generation_pb2.GenerateRequest, key: str) -> "WorkerStream":
        """A stream the worker accepted (retried elsewhere while it was refused)."""
        tried: set[str] = set()
        while True:
            w = self._pick(key, tried, "retry" if tried else None)
            s = WorkerStream(self, w, req)
            try:
                await s.start()
                return s
            except grpc.aio.AioRpcError as e:
                s.close()
                self.pool.failed(w, e)
                tried.add(w.address)
                if not self._retry(e, tried):
                    raise from_grpc(e, w.address) from None
            except BaseException:
                s.close()
                raise


class WorkerStream:
    """One GenerateStream call: started (accepted by the worker), then read to its end; close() cancels it."""

    def __init__(self, gw: Gateway, w: Worker, req: generation_pb2.GenerateRequest):
        self.gw, self.w = gw, w
        w.inflight += 1
        self._open = True
        self.call = w.stub.GenerateStream(req, timeout=gw.cfg.request_timeout_s, metadata=gw.pool.metadata)
        self.first: generation_pb2.GenerateStreamResponse | None = None

    async def start(self) -> None:
        """Until the worker accepted the request (its initial metadata) or refused it (AioRpcError)."""
        await self.call.initial_metadata()
        if self.call.done():  # a refusal comes as a status without metadata: read() raises it
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                raise APIError(502, f"worker {self.w.address} ended the stream without a reply", code="bad_gateway")
            self.first = msg

    async def messages(self) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """Every message to the final one; a failure raises APIError (and marks a dead worker)."""
        msg, self.first = self.first, None
        while True:
            if msg is None:
                try:
                    msg = await self.call.read()
                except grpc.aio.AioRpcError as e:
                    self.gw.pool.failed(self.w, e)
                    raise from_grpc(e, self.w.address) from None
                if msg is grpc.aio.EOF:
                    raise APIError(502, f"worker {self.w.address} ended the stream without a final message",
                                   code="bad_gateway")
            yield msg
            if msg.finish_reason:
                return
            msg = None

    def close(self) -> None:
        if self._open:
            self._open = False
            self.w.inflight -= 1
            self.call.cancel()  # no-op once it finished; else the worker drops the request at its next step


async def _all(coros: list, return_exceptions: bool = False) -> list:
    """asyncio.gather, without its task per call when there is one call (the common n=1 request)."""
    if len(coros) == 1:
        try:
            return [await coros[0]]
        except Exception as e:
            if not return_exceptions:
                raise
            return [e]
    return await asyncio.gather(*coros, return_exceptions=return_exceptions)


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _or_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work` unless the client disconnects first (then it is cancelled: its worker calls are cancelled).

    `work` runs in this task, not a task of its own: a watcher cancels this task when the client goes away. One
    task fewer to schedule and no asyncio.wait on the path of every request (that hop is part of the per-request
    overhead budget)."""
    handler = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _until_disconnect(request)
        gone = True
        handler.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (server shutdown): not ours to answer
        handler.uncancel()
        raise APIError(499, "client closed the request", code="client_closed") from None
    finally:
        watcher.cancel()


# ------------------------------------------------------------------------------------------------ endpoints

async def _completion(request: Request, chat: bool) -> Response:
    gw: Gateway = request.app.state.gateway
    endpoint = "chat" if chat else "completions"
    t0 = time.perf_counter()
    status = 200
    try:
        gw.check_auth(request)
        p = openai_api.parse(await gw.body(request), chat, gw.cfg.max_n, gw.cfg.affinity_chars)
        model = gw.served_model(p.model)
        if p.stream:
            return await _stream(request, gw, p, model, endpoint, t0)
        served: list[str] = []
        calls = [gw.generate(r, p.key[pi], served) for pi, choices in enumerate(p.requests) for r in choices]
        flat = await _or_disconnect(request, _all(calls))
        n = len(p.requests[0])
        results = [flat[i * n:(i + 1) * n] for i in range(len(p.requests))]
        out = openai_api.reply(p, model, results)
        gw.metrics.tokens.inc(out["usage"]["completion_tokens"])
        return Response(_dumps(out), media_type="application/json", headers={WORKER_HEADER: ",".join(served)})
    except APIError as e:
        status = e.status
        return _error_response(e)
    finally:
        gw.metrics.child(gw.metrics.requests, endpoint, str(status)).inc()
        if status == 200:
            gw.metrics.child(gw.metrics.latency, endpoint).observe(time.perf_counter() - t0)


async def _stream(request: Request, gw: Gateway, p: Parsed, model: str, endpoint: str, t0: float) -> Response:
    opened: list[WorkerStream] = []
    try:
        jobs = [gw.open_stream(r, p.key[pi]) for pi, choices in enumerate(p.requests) for r in choices]
        results = await _or_disconnect(request, _all(jobs, return_exceptions=True))
        opened = [s for s in results if isinstance(s, WorkerStream)]
        for r in results:
            if isinstance(r, BaseException):
                raise r
    except BaseException:
        for s in opened:
            s.close()
        raise
    return EventStream(_events(gw, p, model, opened, endpoint, t0), gw.cfg.sse_ping_s,
                       headers={WORKER_HEADER: ",".join(s.w.address for s in opened)})


async def _events(gw: Gateway, p: Parsed, model: str, streams: list[WorkerStream], endpoint: str,
                  t0: float) -> AsyncIterator[str]:
    """SSE events' data of all choices (merged as they come), then usage (stream_options.include_usage), then [DONE]."""
    prompt_tokens = completion_tokens = 0
    ext: list[dict] = []
    first = [True] * len(streams)
    offsets = [0] * len(streams)
    n = len(p.requests[0])
    try:
        async for index, msg in _merge(streams):
            if t0:  # the request's first message: its time to first token
                gw.metrics.child(gw.metrics.ttft, endpoint).observe(time.perf_counter() - t0)
                t0 = 0.0
            choice = openai_api.stream_choice(p, index, msg, first[index], offsets[index])
            offsets[index] += len(msg.text_delta)
            first[index] = False
            if msg.finish_reason:
                completion_tokens += msg.usage.completion_tokens
                if index % n == 0:
                    prompt_tokens += msg.usage.prompt_tokens
                ext.append(openai_api.speculation(index, msg.stats))
            yield _dumps(openai_api.chunk(p, model, [choice]))
        ext.sort(key=lambda e: e["index"])
        gw.metrics.tokens.inc(completion_tokens)
        if p.include_usage:
            yield _dumps(openai_api.chunk(p, model, [], openai_api.usage(prompt_tokens, completion_tokens),
                                          {"choices": ext}))
        yield "[DONE]"
    except APIError as e:
        log.warning("stream %s ended with an error: %s", p.id, e.message)
        yield _dumps(e.body())
    finally:
        for s in streams:
            s.close()


async def _merge(streams: list[WorkerStream]) -> AsyncIterator[tuple[int, generation_pb2.GenerateStreamResponse]]:
    """(choice index, message) from every stream as they arrive; one stream is read in place (no tasks)."""
    if len(streams) == 1:
        async for msg in streams[0].messages():
            yield 0, msg
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: WorkerStream) -> None:
        try:
            async for msg in s.messages():
                await queue.put((i, msg))
            await queue.put((i, None))
        except BaseException as e:  # noqa: BLE001 (handed to the consumer)
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def chat_completions(request: Request) -> Response:
    return await _completion(request, chat=True)


async def completions(request: Request) -> Response:
    return await _completion(request, chat=False)


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ragserve"}


async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.check_auth(request)
    except APIError as e:
        return _error_response(e)
    name = gw.pool.model_name()
    return JSONResponse({"object": "list", "data": [_model_card(name)] if name else []})


async def model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        gw.check_auth(request)
        return JSONResponse(_model_card(gw.served_model(request.path_params["model"])))
    except APIError as e:
        return _error_response(e)


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    serving = [w.address for w in gw.pool.healthy()]
    body = {"status": "ready" if serving else "no worker serving", "workers_serving": len(serving),
            "workers": len(gw.pool.workers)}
    return JSONResponse(body, status_code=200 if serving else 503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    for w in gw.pool.workers.values():
        gw.metrics.inflight.labels(w.address).set(w.inflight)
        gw.metrics.serving.labels(w.address).set(1 if w.serving else 0)
    return Response(generate_latest(gw.metrics.exported), media_type=CONTENT_TYPE_LATEST)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                    code=code))


def create_app(cfg: GatewayConfig) -> Starlette:
    gw = Gateway(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        gw.pool = WorkerPool(cfg)
        await gw.pool.start()
        if not gw.keys:
            log.warning("no API keys configured (--api-keys / --api-keys-file / RAGSERVE_GATEWAY_API_KEYS): the "
                        "gateway is open to anyone who can reach it")
        else:
            log.info("API keys: %d configured", len(gw.keys))
        try:
            yield
        finally:
            await gw.pool.close()

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.gateway = gw
    return app
