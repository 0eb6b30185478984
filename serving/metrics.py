"""Prometheus metrics: one registry per service, served on its own HTTP endpoint (`metrics_port`, 0 = off).

Each process exports only its own service's families (tests run both services in one process, so the
registries are per service, not per process), without the `_created` series prometheus_client adds.

- gRPC server metrics (a grpc_shell call observer, so the code is the one the client got: a reply after the
  deadline is DEADLINE_EXCEEDED, one over the size limit RESOURCE_EXHAUSTED, a stream the client left
  CANCELLED), named like go-grpc-prometheus so stock dashboards work:
  grpc_server_started_total, grpc_server_handled_total{grpc_code}, grpc_server_handling_seconds.
- Generation, what vLLM users look for: requests running/waiting, prompt and generation token counters, time to
  first token, inter-token latency, end-to-end latency, finished requests by finish reason; speculation per
  decoding mode: forward steps, draft tokens proposed/accepted, accepted length per step (M = _sum / _count),
  degraded steps; latency of the worker's own retrieval/KB RPCs by method and code.
- Retrieval: latency per RPC and retriever (draft source or KB retriever), batch sizes, datastore/KB sizes.

The endpoint binds to 127.0.0.1 unless `metrics_host` says otherwise; with `metrics_tls_cert/key` it serves
HTTPS and with `metrics_auth_file` ("user:password") it requires HTTP basic auth.

    running.closers.append(serve_http(cfg.metrics_port, "retrieval", host=cfg.metrics_host))   # in build_server
    curl -s 127.0.0.1:9100/metrics | grep ragserve_

Label values are bounded (method names, status codes, decoding modes, retrievers); never request data.
"""

from __future__ import annotations

import base64
import functools
import hmac
import ssl
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
                               generate_latest, make_wsgi_app)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

# Latency buckets (seconds): sub-ms drafting up to multi-second generations.
_LATENCY = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_GAP = (.005, .01, .02, .03, .05, .075, .1, .15, .2, .3, .5, 1, 2.5)
_ACCEPTED = tuple(range(1, 17)) + (24, 32, 64)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SERVICES = ("retrieval", "generation")


class _NoCreated(Collector):
    """The registry's families without the `<name>_created` samples (a start timestamp per series that
    doubles the exposition and that dashboards do not use)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _Grpc:
    """Server RPC metrics (each service's registry has its own)."""

    def __init__(self, r: CollectorRegistry):
        g = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.", g, registry=r)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by the status code the "
                               "client got.", g + ("grpc_code",), registry=r)
        self.handling = Histogram("grpc_server_handling_seconds", "RPC handling time (until the last message).",
                                  g, buckets=_LATENCY, registry=r)


class _Generation(_Grpc):
    def __init__(self, r: CollectorRegistry):
        super().__init__(r)
        d = ("decoding",)
        self.running = Gauge("ragserve_generation_requests_running", "Requests on the model now.", registry=r)
        self.waiting = Gauge("ragserve_generation_requests_waiting", "Requests queued for the model.", registry=r)
        self.prompt_tokens = Counter("ragserve_generation_prompt_tokens_total", "Prompt tokens of finished "
                                     "requests.", d, registry=r)
        self.tokens = Counter("ragserve_generation_tokens_total", "Completion tokens generated.", d, registry=r)
        self.requests = Counter("ragserve_generation_requests_total", "Finished generations.",
                                d + ("finish_reason",), registry=r)
        self.ttft = Histogram("ragserve_generation_time_to_first_token_seconds",
                              "From request accepted (queued) to its first token.", d, buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("ragserve_generation_inter_token_seconds",
                                     "Time per output token after the first.", d, buckets=_TOKEN_GAP, registry=r)
        self.e2e = Histogram("ragserve_generation_e2e_request_seconds",
                             "From request accepted (queued) to its last token.", d, buckets=_LATENCY, registry=r)
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
        self.retrieval_rpc = Histogram("ragserve_generation_retrieval_rpc_seconds",
                                       "The worker's calls to the retrieval/knowledge service, by method and code.",
                                       ("method", "grpc_code"), buckets=_LATENCY, registry=r)
        self.serving_config = Gauge("ragserve_generation_serving_config_info",
                                    "1 for the dtype / torch threads / device the worker serves with.",
                                    ("dtype", "threads", "device"), registry=r)
        self.step_ms = Gauge("ragserve_generation_calibrated_step_milliseconds",
                             "Calibrated ms of one decode pass with `rows` rows (last token + draft nodes).",
                             ("rows",), registry=r)


class _Retrieval(_Grpc):
    def __init__(self, r: CollectorRegistry):
        super().__init__(r)
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
def get(service: str) -> Any:
    """The metrics of `service` ("retrieval" | "generation"), created on first use (not at import)."""
    if service not in SERVICES:
        raise ValueError(f"service: {service!r} is not one of {SERVICES}")
    r = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    m = (_Retrieval if service == "retrieval" else _Generation)(r)
    m.registry = r
    m.exported = CollectorRegistry(auto_describe=False)
    m.exported.register(_NoCreated(r))
    return m


def exposition(service: str) -> str:
    """What `service`'s /metrics serves, in the text format; for tests and debugging."""
    return generate_latest(get(service).exported).decode()


# ------------------------------------------------------------------------------------------------ /metrics

class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes are not news
        pass


def _basic_auth(app, credentials: bytes):
    want = b"Basic " + base64.b64encode(credentials)

    def guarded(environ, start_response):
        got = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(got, want):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="ragserve metrics"'),
                                            ("Content-Type", "text/plain")])
        return [b"authorization required\n"]

    return guarded


def serve_http(port: int, service: str, *, host: str = "127.0.0.1", tls_cert: str = "", tls_key: str = "",
               auth_file: str = "") -> Callable[[], None]:
    """Start `service`'s /metrics endpoint on host:port (0 = off); returns a function that stops it.

    tls_cert + tls_key: HTTPS. auth_file: a file holding "user:password"; scrapes must send it as HTTP basic auth.
    """
    if not port:
        return lambda: None
    app = make_wsgi_app(get(service).exported)
    if auth_file:
        creds = Path(auth_file).read_text().strip()
        if ":" not in creds:
            raise ValueError(f"metrics_auth_file: {auth_file} must hold 'user:password'")
        app = _basic_auth(app, creds.encode())
    httpd = make_server(host, port, app, ThreadingWSGIServer, handler_class=_QuietHandler)
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("metrics_tls_cert/metrics_tls_key: give both the certificate and its private key")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls_cert, tls_key)
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, name=f"metrics-{service}", daemon=True)
    thread.start()

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return close


# ----------------------------------------------------------------------------------------------- gRPC server

class GrpcMetrics:
    """grpc_shell call observer: counts started/handled RPCs by method and status code and times them.

    on_done(method, request, seconds, code) is called after each RPC (e.g. per-retriever latency).
    """

    def __init__(self, service: str, on_done: Callable[[str, Any, float, grpc.StatusCode], None] | None = None):
        self._m = get(service)
        self._on_done = on_done

    def call_started(self, call) -> None:
        self._m.started.labels(call.service, call.method, call.kind).inc()

    def call_finished(self, call) -> None:
        labels = (call.service, call.method, call.kind)
        self._m.handled.labels(*labels, call.code.name).inc()
        self._m.handling.labels(*labels).observe(call.seconds)
        if self._on_done is not None:
            self._on_done(call.method, call.request, call.seconds, call.code)


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
    """GrpcMetrics hook of the retrieval service: latency per RPC and retriever, batch sizes."""
    if code != grpc.StatusCode.OK:
        return
    retriever, batch = _retriever(method, request)
    m = get("retrieval")
    if retriever not in ("datastore", "merged", "context", "crest", "mixed", "edr", "adr", "sr", ""):
        retriever = "other"  # bounded label values: never echo a request string
    m.retrieval_seconds.labels(method, retriever).observe(seconds)
    if method in ("DraftBatch", "Search") and batch:
        m.batch.labels(method).observe(batch)


def set_datastore_size(ds, learner=None) -> None:
    m = get("retrieval")
    if ds is not None:
        for gauge, attr in ((m.ds_tokens, "num_tokens"), (m.ds_documents, "num_documents"),
                            (m.ds_shards, "num_shards"), (m.ds_bytes, "bytes_on_disk")):
            value = getattr(ds, attr, None)
            if value is not None:
                gauge.set(value)
    if learner is not None:
        m.learned.set_function(lambda: learner.learned_tokens)


def set_kb_size(num_passages: int, indexes: Iterable[tuple[str, int]] = ()) -> None:
    m = get("retrieval")
    m.kb_passages.set(num_passages)
    for name, size in indexes:
        m.kb_vectors.labels(name).set(size)


# ------------------------------------------------------------------------------------------------ generation

class GenerationObserver:
    """Per-request token timing: feed it every stream chunk of one generation, in order.

        with GenerationObserver(job.decoding, job.submitted) as obs:   # marks the request running
            for chunk in generate_stream(...):
                obs.chunk(chunk)

    submitted: time.monotonic() when the request was accepted, so TTFT and end-to-end latency include the queue
    wait. Everything is read from the chunks and the final chunk's SpeculationStats the decode loop produces.
    """

    def __init__(self, decoding: str, submitted: float):
        self._m = get("generation")
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
            m.e2e.labels(d).observe(now - self.submitted)
            m.prompt_tokens.labels(d).inc(getattr(chunk, "prompt_tokens", 0) or 0)
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
    m = get("generation")
    m.serving_config.labels(dtype, str(threads), device).set(1)
    for q, ms in zip(rows, step_ms):
        m.step_ms.labels(str(q)).set(ms)


def track_queue_depth(depth: Callable[[], int]) -> None:
    get("generation").waiting.set_function(depth)


class _ClientMetrics(grpc.UnaryUnaryClientInterceptor):
    """Times every unary call on a channel (sync, with_call and future alike) once its result is known."""

    def __init__(self, histogram: Histogram):
        self._h = histogram

    def intercept_unary_unary(self, continuation, client_call_details, request):
        t0 = time.perf_counter()
        method = client_call_details.method.rpartition("/")[2]
        future = continuation(client_call_details, request)

        def done(f) -> None:
            try:
                code = f.code()
            except Exception:  # a future cancelled before it started has no code
                code = grpc.StatusCode.CANCELLED
            self._h.labels(method, (code or grpc.StatusCode.UNKNOWN).name).observe(time.perf_counter() - t0)

        future.add_done_callback(done)
        return future


def instrument_channel(channel: grpc.Channel) -> grpc.Channel:
    """The generation worker's channel to a retrieval/knowledge service, observed in
    ragserve_generation_retrieval_rpc_seconds{method, grpc_code}."""
    return grpc.intercept_channel(channel, _ClientMetrics(get("generation").retrieval_rpc))


def serve_config(cfg: Any, service: str) -> Callable[[], None]:
    """serve_http from a service config's metrics_port / metrics_host / metrics_tls_cert / metrics_tls_key /
    metrics_auth_file fields."""
    return serve_http(cfg.metrics_port, service, host=getattr(cfg, "metrics_host", "127.0.0.1"),
                      tls_cert=getattr(cfg, "metrics_tls_cert", ""), tls_key=getattr(cfg, "metrics_tls_key", ""),
                      auth_file=getattr(cfg, "metrics_auth_file", ""))
