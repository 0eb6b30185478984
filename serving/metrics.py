"""Prometheus metrics for both services: one registry per process, an HTTP endpoint on `metrics_port` (0 = off).

- gRPC server metrics (a server interceptor), named like go-grpc-prometheus so stock dashboards work:
  grpc_server_started_total, grpc_server_handled_total{grpc_code}, grpc_server_handling_seconds.
- Generation: time to first token, inter-token latency, tokens generated, forward steps, draft tokens
  proposed/accepted, accepted length per step (mean accepted length M = _sum / _count), queue depth.
- Retrieval: latency per RPC and retriever (draft source or KB retriever), batch sizes, datastore/KB sizes.

    running.closers.append(serve_http(cfg.metrics_port, cfg.host))   # in build_server
    curl -s 127.0.0.1:9100/metrics | grep ragserve_

Label values are bounded (method names, status codes, decoding modes, retrievers); never request data.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               start_http_server)

# Latency buckets (seconds): sub-ms drafting up to multi-second generations.
_LATENCY = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_GAP = (.005, .01, .02, .03, .05, .075, .1, .15, .2, .3, .5, 1, 2.5)
_ACCEPTED = tuple(range(1, 17)) + (24, 32, 64)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        g = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.", g, registry=r)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code.",
                               g + ("grpc_code",), registry=r)
        self.handling = Histogram("grpc_server_handling_seconds", "RPC handling time (until the last message).",
                                  g, buckets=_LATENCY, registry=r)
        # Generation worker.
        d = ("decoding",)
        self.ttft = Histogram("ragserve_generation_time_to_first_token_seconds",
                              "From request accepted (queued) to its first token.", d, buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("ragserve_generation_inter_token_seconds",
                                     "Time per output token after the first.", d, buckets=_TOKEN_GAP, registry=r)
        self.tokens = Counter("ragserve_generation_tokens_total", "Completion tokens generated.", d, registry=r)
        self.requests = Counter("ragserve_generation_requests_total", "Finished generations.",
                                d + ("finish_reason",), registry=r)
        self.steps = Counter("ragserve_generation_forward_steps_total", "Decode forward passes (after prefill).",
                             d, registry=r)
        self.accepted_length = Histogram("ragserve_generation_accepted_length",
                                         "Tokens emitted per decode forward pass; mean = M.", d, buckets=_ACCEPTED,
                                         registry=r)
        self.proposed = Counter("ragserve_generation_draft_tokens_proposed_total", "Draft tokens proposed.", d,
                                registry=r)
        self.accepted = Counter("ragserve_generation_draft_tokens_accepted_total", "Draft tokens accepted.", d,
                                registry=r)
        self.degraded = Counter("ragserve_generation_degraded_steps_total",
                                "Steps decoded without a draft because retrieval failed.", d, registry=r)
        self.queue_depth = Gauge("ragserve_generation_queue_depth", "Requests waiting for the model.", registry=r)
        self.running = Gauge("ragserve_generation_running", "Requests on the model now (0 or 1).", registry=r)
        self.serving_config = Gauge("ragserve_generation_serving_config_info",
                                    "1 for the dtype / torch threads / device the worker serves with.",
                                    ("dtype", "threads", "device"), registry=r)
        self.step_ms = Gauge("ragserve_generation_calibrated_step_milliseconds",
                             "Calibrated ms of one decode pass with `rows` rows (last token + draft nodes).",
                             ("rows",), registry=r)
        # Retrieval service.
        self.retrieval_seconds = Histogram("ragserve_retrieval_request_seconds",
                                           "Successful retrieval RPC latency by method and retriever/source.",
                                           ("method", "retriever"), buckets=_LATENCY, registry=r)
        self.batch = Histogram("ragserve_retrieval_batch_size", "Queries per batched call.", ("method",),
                               buckets=_BATCH, registry=r)
        self.ds_tokens = Gauge("ragserve_retrieval_datastore_tokens", "Tokens in the suffix-array datastore.",
                               registry=r)
        self.ds_documents = Gauge("ragserve_retrieval_datastore_documents", "Documents in the datastore.",
                                  registry=r)
        self.ds_shards = Gauge("ragserve_retrieval_datastore_shards", "Datastore shards.", registry=r)
        self.ds_bytes = Gauge("ragserve_retrieval_datastore_bytes", "Datastore size on disk.", registry=r)
        self.learned = Gauge("ragserve_retrieval_learned_tokens", "Tokens held by the online-learning shards.",
                             registry=r)
        self.kb_passages = Gauge("ragserve_retrieval_kb_passages", "Passages in the knowledge base.", registry=r)
        self.kb_vectors = Gauge("ragserve_retrieval_kb_index_vectors", "Vectors per KB vector index.", ("index",),
                                registry=r)


@functools.cache
def get() -> _Metrics:
    """The process-wide metrics (created on first use, not at import)."""
    return _Metrics()


def serve_http(port: int, host: str = "127.0.0.1") -> Callable[[], None]:
    """Start the /metrics HTTP endpoint on port (0 = off); returns a function that stops it."""
    if not port:
        return lambda: None
    httpd, thread = start_http_server(port, addr=host, registry=get().registry)

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return close


def exposition() -> str:
    """The current metrics in the text format (what /metrics serves); for tests and debugging."""
    from prometheus_client import generate_latest

    return generate_latest(get().registry).decode()


# ------------------------------------------------------------------------------------------ server interceptor

def _code(context: grpc.ServicerContext, default: grpc.StatusCode) -> grpc.StatusCode:
    try:
        code = context.code()
    except Exception:  # an implementation without code() (grpc_testing)
        code = None
    return code if isinstance(code, grpc.StatusCode) else default


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts started/handled RPCs by method and status code and times them (stream RPCs until the last message).

    on_done(method, request, seconds, code) is called after each RPC (e.g. per-retriever latency).
    Put it first in the interceptor list so it also counts calls the auth check refuses.
    """

    def __init__(self, on_done: Callable[[str, Any, float, grpc.StatusCode], None] | None = None):
        self._m = get()
        self._on_done = on_done

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler  # unknown method (gRPC answers UNIMPLEMENTED) or a client stream (none in our API)
        full = handler_call_details.method  # /package.Service/Method
        service, _, method = full.lstrip("/").rpartition("/")
        kind = "server_stream" if handler.response_streaming else "unary"
        labels = (service, method, kind)
        m, on_done = self._m, self._on_done

        def finish(request, t0: float, code: grpc.StatusCode) -> None:
            dt = time.perf_counter() - t0
            m.handled.labels(*labels, code.name).inc()
            m.handling.labels(*labels).observe(dt)
            if on_done is not None:
                try:
                    on_done(method, request, dt, code)
                except Exception:  # metrics never break a call
                    pass

        if not handler.response_streaming:
            inner = handler.unary_unary

            def unary(request, context):
                m.started.labels(*labels).inc()
                t0 = time.perf_counter()
                code = grpc.StatusCode.UNKNOWN
                try:
                    reply = inner(request, context)
                    code = _code(context, grpc.StatusCode.OK)
                    return reply
                except BaseException:
                    code = _code(context, grpc.StatusCode.UNKNOWN)
                    raise
                finally:
                    finish(request, t0, code)

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=handler.response_serializer)

        inner_stream = handler.unary_stream

        def stream(request, context):
            m.started.labels(*labels).inc()
            t0 = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                yield from inner_stream(request, context)
                code = _code(context, grpc.StatusCode.OK)
            except GeneratorExit:  # the client went away; gRPC dropped the stream
                code = grpc.StatusCode.CANCELLED
                raise
            except BaseException:
                code = _code(context, grpc.StatusCode.UNKNOWN)
                raise
            finally:
                finish(request, t0, code)

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


# ------------------------------------------------------------------------------------------------- retrieval

def _retriever(method: str, request) -> tuple[str, int]:
    """(retriever label, batch size) of a retrieval request; ("", 0) when it has none."""
    if method == "Draft":
        return request.params.source or "datastore", 1
    if method == "DraftBatch":
        sources = {r.params.source or "datastore" for r in request.requests}
        return (sources.pop() if len(sources) == 1 else "mixed"), len(request.requests)
    if method == "Search":
        return request.retriever, len(request.texts)
    if method == "ScoreCandidates":
        return request.retriever, 1
    return "", 0


def observe_retrieval(method: str, request, seconds: float, code: grpc.StatusCode) -> None:
    """MetricsInterceptor hook of the retrieval service: latency per RPC and retriever, batch sizes."""
    if code != grpc.StatusCode.OK:
        return
    retriever, batch = _retriever(method, request)
    m = get()
    m.retrieval_seconds.labels(method, retriever).observe(seconds)
    if method in ("DraftBatch", "Search") and batch:
        m.batch.labels(method).observe(batch)


def set_datastore_size(ds, learner=None) -> None:
    m = get()
    if ds is not None:
        for gauge, attr in ((m.ds_tokens, "num_tokens"), (m.ds_documents, "num_documents"),
                            (m.ds_shards, "num_shards"), (m.ds_bytes, "bytes_on_disk")):
            value = getattr(ds, attr, None)
            if value is not None:
                gauge.set(value)
    if learner is not None:
        m.learned.set_function(lambda: learner.learned_tokens)


def set_kb_size(num_passages: int, indexes: Iterable[tuple[str, int]] = ()) -> None:
    m = get()
    m.kb_passages.set(num_passages)
    for name, size in indexes:
        m.kb_vectors.labels(name).set(size)


# ------------------------------------------------------------------------------------------------ generation

class GenerationObserver:
    """Per-request token timing: feed it every stream chunk of one generation, in order.

        with GenerationObserver(job.decoding, job.submitted) as obs:   # marks the model busy
            for chunk in generate_stream(...):
                obs.chunk(chunk)

    submitted: time.monotonic() when the request was accepted, so TTFT includes the queue wait.
    """

    def __init__(self, decoding: str, submitted: float):
        self._m = get()
        self.decoding = decoding
        self.submitted = submitted
        self._last: float | None = None

    def __enter__(self) -> "GenerationObserver":
        self._m.running.inc()
        return self

    def __exit__(self, *exc) -> None:
        self._m.running.dec()

    def chunk(self, chunk) -> None:
        m, d = self._m, self.decoding
        now = time.monotonic()
        n = len(chunk.token_ids)
        if n:
            if self._last is None:
                m.ttft.labels(d).observe(now - self.submitted)
            else:
                gap = (now - self._last) / n
                h = m.inter_token.labels(d)
                for _ in range(n):
                    h.observe(gap)
            m.tokens.labels(d).inc(n)
            self._last = now
        if chunk.finish_reason is not None:
            m.requests.labels(d, chunk.finish_reason).inc()
            s = chunk.stats
            if s is not None:
                m.steps.labels(d).inc(s.forward_steps)
                m.proposed.labels(d).inc(s.draft_tokens_proposed)
                m.accepted.labels(d).inc(s.draft_tokens_accepted)
                m.degraded.labels(d).inc(s.degraded_steps)
                h = m.accepted_length.labels(d)
                for length, count in enumerate(s.accepted_length_histogram):
                    for _ in range(count if length else 0):
                        h.observe(length)


def set_serving_config(dtype: str, threads: int, device: str, rows: Iterable[int] = (),
                       step_ms: Iterable[float] = ()) -> None:
    """What the worker serves with (calibrate.py): an info gauge and the chosen cost curve."""
    m = get()
    m.serving_config.labels(dtype, str(threads), device).set(1)
    for q, ms in zip(rows, step_ms):
        m.step_ms.labels(str(q)).set(ms)


def track_queue_depth(depth: Callable[[], int]) -> None:
    get().queue_depth.set_function(depth)
