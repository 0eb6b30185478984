"""Prometheus plumbing: one registry per service, served on its own HTTP endpoint (`metrics_port`, 0 = off).

Each service declares its own families in its own module (retrieval_service/metrics.py,
generation_service/metrics.py: `declare(name, Families)`); a deployed process runs one service and so holds one
registry. Tests run both services in one process, which is why registries are keyed by service name. Exports
leave out the `_created` series prometheus_client adds.

- gRPC server metrics (ServerMetrics, every service) (a grpc_shell call observer, so the code is the one the client got: a reply after the
  deadline is DEADLINE_EXCEEDED, one over the size limit RESOURCE_EXHAUSTED, a stream the client left
  CANCELLED), named like go-grpc-prometheus so stock dashboards work:
  grpc_server_started_total, grpc_server_handled_total{grpc_code}, grpc_server_handling_seconds.
- Client call timing (instrument_channel), for a service's own calls to another.

The endpoint binds to 127.0.0.1 unless `metrics_host` says otherwise; with `metrics_tls_cert/key` it serves
HTTPS (with `metrics_tls_client_ca` it requires a client certificate that CA signed) and with `metrics_auth_file`
("user:password") it requires HTTP basic auth. It serves `/metrics` only (any other path: 404). It is
prometheus_client's threaded WSGI server, except that the TLS handshake runs in each connection's own thread with a
timeout: prometheus_client's start_wsgi_server wraps the listening socket, so accept() itself shakes hands and one
idle TCP client blocks every scrape behind it.

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
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

# Latency buckets (seconds): sub-ms drafting up to multi-second generations.
LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)


class _NoCreated(Collector):
    """The registry's families without the `<name>_created` samples (a start timestamp per series that
    doubles the exposition and that dashboards do not use)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class ServerMetrics:
    """Server RPC metrics, the families every service has (a service's metrics class extends it)."""

    def __init__(self, r: CollectorRegistry):
        g = ("grpc_service", "grpc_method", "grpc_type")
        self.started = Counter("grpc_server_started_total", "RPCs started on the server.", g, registry=r)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by the status code the "
                               "client got.", g + ("grpc_code",), registry=r)
        self.handling = Histogram("grpc_server_handling_seconds", "RPC handling time (until the last message).",
                                  g, buckets=LATENCY_BUCKETS, registry=r)


_declared: dict[str, Callable[[CollectorRegistry], Any]] = {}
_lock = threading.Lock()


def declare(service: str, families: Callable[[CollectorRegistry], Any]) -> None:
    """Register the metric families of `service`: `families(registry)` builds them (a ServerMetrics subclass).
    Each service declares its own in its metrics module; nothing is created until get() asks."""
    _declared[service] = families


@functools.cache
def _build(service: str) -> Any:
    if service not in _declared:
        raise ValueError(f"service: {service!r} declared no metrics (declared: {sorted(_declared)})")
    r = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    m = _declared[service](r)
    m.registry = r
    m.exported = CollectorRegistry(auto_describe=False)
    m.exported.register(_NoCreated(r))
    return m


def get(service: str) -> Any:
    """The metrics of `service`, created on first use (not at import)."""
    with _lock:
        return _build(service)


def exposition(service: str) -> str:
    """What `service`'s /metrics serves, in the text format; for tests and debugging."""
    return generate_latest(get(service).exported).decode()


# ------------------------------------------------------------------------------------------------ /metrics

METRICS_PATH = "/metrics"
CONNECTION_TIMEOUT_S = 10.0  # a scrape connection that sends nothing this long (or stalls its handshake) is closed


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # scrapes are not news
        pass


class _MetricsServer(ThreadingWSGIServer):
    """Every connection in its own thread from accept on: its TLS handshake included, with a timeout."""

    tls: ssl.SSLContext | None = None

    def get_request(self):
        sock, addr = self.socket.accept()  # plain TCP: nothing here waits on the client
        sock.settimeout(CONNECTION_TIMEOUT_S)
        return sock, addr

    def process_request_thread(self, request, client_address) -> None:
        if self.tls is not None:
            try:
                request = self.tls.wrap_socket(request, server_side=True)  # the handshake, in this thread
            except (OSError, ValueError):  # an idle, plain-HTTP or untrusted client: its connection only
                self.shutdown_request(request)
                return
        super().process_request_thread(request, client_address)


def _only_metrics_path(app):
    def routed(environ, start_response):
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: metrics are at /metrics\n"]
        return app(environ, start_response)

    return routed


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
               auth_file: str = "", tls_client_ca: str = "") -> Callable[[], None]:
    """Start `service`'s /metrics endpoint on host:port (0 = off); returns a function that stops it.

    tls_cert + tls_key: HTTPS; tls_client_ca: also require a client certificate this CA signed. auth_file: a file
    holding "user:password"; scrapes must send it as HTTP basic auth.
    """
    if not port:
        return lambda: None
    app = make_wsgi_app(get(service).exported)
    if auth_file:
        creds = Path(auth_file).read_text().strip()
        if ":" not in creds:
            raise ValueError(f"metrics_auth_file: {auth_file} must hold 'user:password'")
        app = _basic_auth(app, creds.encode())
    tls = None
    if tls_cert or tls_key or tls_client_ca:
        if not (tls_cert and tls_key):
            raise ValueError("metrics_tls_cert/metrics_tls_key: give both the certificate and its private key")
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(tls_cert, tls_key)
        if tls_client_ca:
            tls.load_verify_locations(tls_client_ca)
            tls.verify_mode = ssl.CERT_REQUIRED
    httpd = make_server(host, port, _only_metrics_path(app), _MetricsServer, handler_class=_QuietHandler)
    httpd.tls = tls
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


def serve_config(cfg: Any, service: str) -> Callable[[], None]:
    """serve_http from a service config's metrics_port / metrics_host / metrics_tls_cert / metrics_tls_key /
    metrics_auth_file fields."""
    return serve_http(cfg.metrics_port, service, host=getattr(cfg, "metrics_host", "127.0.0.1"),
                      tls_cert=getattr(cfg, "metrics_tls_cert", ""), tls_key=getattr(cfg, "metrics_tls_key", ""),
                      auth_file=getattr(cfg, "metrics_auth_file", ""),
                      tls_client_ca=getattr(cfg, "metrics_tls_client_ca", ""))


# ----------------------------------------------------------------------------------------------- gRPC client

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


def instrument_channel(channel: grpc.Channel, histogram: Histogram) -> grpc.Channel:
    """`channel` with every unary call timed in `histogram` (labels: method, grpc_code)."""
    return grpc.intercept_channel(channel, _ClientMetrics(histogram))
