"""Standard gRPC hygiene shared by both servers.

- grpc.health.v1: every service starts NOT_SERVING and is switched to SERVING only once its indexes or
  model are loaded and warmed up (the caller decides when).
- Reflection, v1 and v1alpha, so grpcurl, Postman and friends (old or new) can discover the API.
- Backpressure: beyond `max_concurrent_rpcs` calls in flight the shell answers RESOURCE_EXHAUSTED (counted by the
  observers like any status). Health checks are outside the limit and have handler threads of their own
  (HEALTH_THREADS), so a busy server still answers its orchestrator; gRPC's own limit stays as a backstop at
  twice the shell's.
- Draining stop on SIGTERM/SIGINT: health goes NOT_SERVING at once and keeps answering while in-flight calls get
  up to `grace_s` seconds to finish (new calls are refused with UNAVAILABLE); only then does the listener close.
  A probe therefore sees NOT_SERVING, not "connection refused", for the whole drain.
- Every call passes through one ShellInterceptor (outermost): it works out the status the client really got
  (a reply sent after the deadline is DEADLINE_EXCEEDED, one over the message size limit RESOURCE_EXHAUSTED, a
  stream the client left CANCELLED), bounds error details (an echoed 1 MB string would exceed gRPC's metadata
  limit and reach the client as a different error), logs each failed call in one line (client errors at INFO,
  an unavailable dependency at WARNING, server faults at ERROR) and reports it to observers such as the metrics.
- Handlers raise ragcore.errors.ServiceError subclasses; the shell answers with the status the error table gives
  (INVALID_ARGUMENT, UNAVAILABLE, ...); any other exception is a bug: INTERNAL naming its type, traceback logged.
- Requests that do not decode (e.g. invalid UTF-8 in a string field) get INVALID_ARGUMENT naming the field,
  not gRPC's INTERNAL (ragcore.security.DecodeErrorInterceptor, always installed, innermost).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from ragcore import errors
from ragcore.security import HEALTH_PREFIX, DecodeErrorInterceptor

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# Error details are sent percent-encoded in the grpc-message trailer (up to 3 bytes per byte); 1000 UTF-8 bytes
# stay far below gRPC's default 8 KiB metadata limit.
MAX_DETAILS_BYTES = 1000
Code = grpc.StatusCode
# Caused by the request (or the caller's deadline / cancel / load): logged at INFO.
_CLIENT_CODES = frozenset({Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION,
                           Code.OUT_OF_RANGE, Code.UNAUTHENTICATED, Code.PERMISSION_DENIED, Code.CANCELLED,
                           Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.UNIMPLEMENTED})
# A dependency or this server is (temporarily) unable: WARNING. Anything else (INTERNAL, UNKNOWN, DATA_LOSS): ERROR.
_UNAVAILABLE_CODES = frozenset({Code.UNAVAILABLE, Code.ABORTED})
# A client whose deadline fires cancels the call a little before the server's copy of that deadline runs out (the
# timeout travels as a duration and starts later here): a cancel this close to the deadline is the deadline.
_DEADLINE_SLACK_S = 0.05
# gRPC reports "no deadline" as seconds until the end of time (~2**63 ns), which no clock arithmetic survives.
_NO_DEADLINE_S = 1e9
# Handler threads beyond the call limit: health checks (outside the limit) and quick refusals always find one.
HEALTH_THREADS = 4


def bound_details(details: str | bytes | None) -> str:
    """An error message cut to MAX_DETAILS_BYTES of UTF-8 (on a character boundary), marked when cut."""
    text = details.decode("utf-8", "replace") if isinstance(details, bytes) else (details or "")
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_DETAILS_BYTES:
        return text
    return data[:MAX_DETAILS_BYTES - 20].decode("utf-8", "ignore") + f"... ({len(data)} bytes)"


# ------------------------------------------------------------------------------------------------- calls

@dataclass
class Call:
    """One RPC as the shell saw it; observers get it at start and, with code/details/seconds set, at the end."""

    service: str  # package.Service
    method: str  # Method
    kind: str  # unary | server_stream
    request: Any
    started: float = field(default_factory=time.perf_counter)
    deadline: float | None = None  # perf_counter time the caller's deadline runs out (None = no deadline)
    code: Code = Code.OK
    details: str = ""
    seconds: float = 0.0
    reply_too_large: bool = False
    _returned: bool = False  # the handler returned (or its stream ended)
    _terminated: bool = False  # gRPC ended the RPC (status sent, cancelled or deadline passed)
    _done: bool = False


class CallObserver(Protocol):
    def call_started(self, call: Call) -> None: ...

    def call_finished(self, call: Call) -> None: ...


def time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left before the caller's deadline, None when it set none."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining >= _NO_DEADLINE_S else remaining


class _Context:
    """The servicer context handed to handlers: records the status they set and bounds its details."""

    def __init__(self, context: grpc.ServicerContext):
        self._context = context
        self.code: Code | None = None
        self.details = ""

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def time_remaining(self) -> float | None:
        return time_remaining(self._context)

    def abort(self, code: Code, details: str = "") -> None:
        self.code, self.details = code, bound_details(details)
        self._context.abort(code, self.details)

    def abort_with_status(self, status) -> None:
        self.code, self.details = status.code, bound_details(status.details)
        self._context.abort_with_status(status)

    def set_code(self, code: Code) -> None:
        self.code = code
        self._context.set_code(code)

    def set_details(self, details: str) -> None:
        self.details = bound_details(details)
        self._context.set_details(self.details)


def _gone(call: Call) -> Code:
    """Why a client is gone: its deadline ran out, or it cancelled."""
    if call.deadline is not None and time.perf_counter() >= call.deadline - _DEADLINE_SLACK_S:
        return Code.DEADLINE_EXCEEDED
    return Code.CANCELLED


def _status_after_return(context: _Context, call: Call) -> Code:
    """Status of a handler that returned normally: what it set, else what the client actually got."""
    if context.code is not None:
        return context.code
    if not context.is_active() or (call.deadline is not None and time.perf_counter() >= call.deadline):
        return _gone(call)  # the reply (or the stream's end) comes after the client gave up
    return Code.OK


def _record_raised(call: Call, context: _Context, exc: Exception) -> None:
    """A handler raised `exc`. Unless it had aborted already, abort with the status the error table (errors.py)
    gives `exc` (a bug also gets its traceback logged); the call records the status the client gets. The caller
    re-raises `exc`: gRPC then sends the recorded status."""
    if context.code is None:
        code, details = errors.status_of(exc)
        if not isinstance(exc, errors.ServiceError):
            log.error("unhandled %s in a handler", type(exc).__name__, exc_info=exc)
        with contextlib.suppress(Exception):  # abort() raises by design; the status stays recorded in context
            context.abort(code, details)
    call.code, call.details = context.code or Code.UNKNOWN, context.details


def _log_failed(call: Call) -> None:
    if call.code == Code.OK:
        return
    level = (logging.INFO if call.code in _CLIENT_CODES else
             logging.WARNING if call.code in _UNAVAILABLE_CODES else logging.ERROR)
    # One line, no traceback: an expected refusal is not a stack dump (bugs also get gRPC's own traceback).
    log.log(level, "%s/%s -> %s after %.1f ms: %s", call.service, call.method, call.code.name, call.seconds * 1e3,
            call.details.replace("\n", " ")[:300])


def _health_watch(method: str, handler: grpc.RpcMethodHandler) -> bool:
    """A grpc.health.v1 Watch stream: every health-checking client channel (ragcore/replicated.py) keeps one open.
    The health servicer answers it without a handler thread (experimental_non_blocking); any wrapper would make
    it hold one of the pool's threads for the stream's whole life."""
    return handler.response_streaming and method.startswith(HEALTH_PREFIX)


class ShellInterceptor(grpc.ServerInterceptor):
    """Outermost interceptor: true status codes, bounded details, one-line logs, observers, drain refusal."""

    def __init__(self, observers: Sequence[CallObserver] = (), max_message_bytes: int | None = None,
                 max_in_flight: int | None = None):
        self._observers = list(observers)
        self._max_reply = max_message_bytes
        self._max_in_flight = max_in_flight or None  # counted calls at once (None: no limit)
        self._lock = threading.Condition()
        self._in_flight = 0
        self.draining = False

    # -- drain -----------------------------------------------------------------------------------------------------

    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no counted call is in flight (True) or timeout_s passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)
        return True

    # -- calls -----------------------------------------------------------------------------------------------------

    def _finish(self, call: Call, counted: bool) -> None:
        with self._lock:
            if call._done:
                return
            call._done = True
        call.seconds = time.perf_counter() - call.started
        if call.reply_too_large:
            call.code = Code.RESOURCE_EXHAUSTED
            call.details = call.details or f"reply larger than the {self._max_reply}-byte message limit"
        _log_failed(call)
        for obs in self._observers:
            try:
                obs.call_finished(call)
            except Exception:  # an observer never breaks a call
                log.debug("call observer failed", exc_info=True)
        if counted:
            with self._lock:
                self._in_flight -= 1
                self._lock.notify_all()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        full = handler_call_details.method  # /package.Service/Method
        if handler is None or handler.request_streaming or _health_watch(full, handler):
            return handler  # unknown method (gRPC answers UNIMPLEMENTED), a client stream (reflection), a Watch
        service, _, method = full.lstrip("/").rpartition("/")
        kind = "server_stream" if handler.response_streaming else "unary"
        # Health must keep answering during a drain, and a Watch stream must not hold the drain up.
        counted = not full.startswith(HEALTH_PREFIX)
        observers, finish = self._observers, self._finish
        max_reply = self._max_reply

        def begin(request, raw_context) -> tuple[Call, _Context] | None:
            call = Call(service, method, kind, request)
            remaining = time_remaining(raw_context)
            if remaining is not None:
                call.deadline = call.started + remaining
            context = _Context(raw_context)
            refused = busy = False
            if counted:
                with self._lock:
                    refused = self.draining
                    busy = not refused and self._max_in_flight is not None and self._in_flight >= self._max_in_flight
                    if not refused and not busy:
                        self._in_flight += 1
            for obs in observers:
                try:
                    obs.call_started(call)
                except Exception:
                    log.debug("call observer failed", exc_info=True)
            if refused or busy:
                call.code, call.details = ((Code.UNAVAILABLE, "server is shutting down; retry on another replica")
                                           if refused else
                                           (Code.RESOURCE_EXHAUSTED, f"server busy: {self._max_in_flight} calls in "
                                            "flight (--max-concurrent-rpcs); retry later"))
                finish(call, False)
                raw_context.abort(call.code, call.details)
            # A unary reply that is never serialized (the client left first) is finished when gRPC ends the RPC.
            raw_context.add_callback(lambda: terminated(call))
            return call, context

        def terminated(call: Call) -> None:
            with self._lock:
                call._terminated = True
                returned = call._returned
            if returned:
                finish(call, counted)

        def returned(call: Call) -> None:
            with self._lock:
                call._returned = True
                ended = call._terminated
            if ended:
                finish(call, counted)

        def serializer(inner_serialize, call_holder: list):
            def serialize(message) -> bytes:
                data = inner_serialize(message) if inner_serialize is not None else message
                if max_reply is not None and len(data) > max_reply and call_holder:
                    call_holder[0].reply_too_large = True
                return data

            return serialize

        if not handler.response_streaming:
            inner = handler.unary_unary
            holder: list[Call] = []

            def unary(request, raw_context):
                call, context = begin(request, raw_context)
                holder.append(call)
                try:
                    reply = inner(request, context)
                except Exception as e:
                    _record_raised(call, context, e)
                    finish(call, counted)
                    raise
                call.code, call.details = _status_after_return(context, call), context.details
                returned(call)
                return reply  # finished by the serializer (below) or, if never sent, the termination callback

            inner_ser = handler.response_serializer
            base_ser = serializer(inner_ser, holder)

            def serialize_and_finish(message) -> bytes:
                data = base_ser(message)
                if holder:
                    finish(holder[0], counted)
                return data

            return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                       response_serializer=serialize_and_finish)

        inner_stream = handler.unary_stream
        holder_s: list[Call] = []

        def stream(request, raw_context):
            call, context = begin(request, raw_context)
            holder_s.append(call)
            try:
                yield from inner_stream(request, context)
                call.code, call.details = _status_after_return(context, call), context.details
            except GeneratorExit:  # gRPC dropped the stream: the client left, the deadline passed or a send failed
                call.code = _gone(call)
                raise
            except Exception as e:
                _record_raised(call, context, e)
                raise
            finally:
                finish(call, counted)

        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                    response_serializer=serializer(handler.response_serializer,
                                                                                   holder_s))


# ------------------------------------------------------------------------------------------------ server

@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    services: list[str]
    shell: ShellInterceptor = field(default_factory=ShellInterceptor)
    # Called after the gRPC server stopped (e.g. the metrics HTTP endpoint's shutdown).
    closers: list[Callable[[], None]] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)
    _stopping: threading.Lock = field(default_factory=threading.Lock)
    _health_lock: threading.Lock = field(default_factory=threading.Lock)
    _service_status: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool = True, services: Sequence[str] | None = None) -> None:
        """Set the named services (None = all); the overall status ("") is SERVING only while every service is:
        orchestrators and compose's healthcheck read the overall status."""
        status = _SERVING if serving else _NOT_SERVING
        with self._health_lock:
            for name in (self.services if services is None else [s for s in services if s]):
                self._service_status[name] = status
                self.health.set(name, status)
            every = all(self._service_status.get(name) == _SERVING for name in self.services)
            self.health.set("", status if services is None else _SERVING if every else _NOT_SERVING)

    def stop(self, grace_s: float | None = None) -> None:
        """Drain, then stop: health NOT_SERVING (still answering), new calls UNAVAILABLE, in-flight calls get up
        to grace_s seconds; then the listener closes. Returns once stopped (a second call waits for the first)."""
        with self._stopping:
            if self._stopped.is_set():
                return
            self.set_serving(False)
            self.shell.draining = True
            t0 = time.monotonic()
            if grace_s:
                idle = self.shell.wait_idle(grace_s)
                log.info("drained in %.1f s%s", time.monotonic() - t0,
                         "" if idle else f" ({self.shell.in_flight()} calls still running are cut off)")
            left = max(0.0, (grace_s or 0.0) - (time.monotonic() - t0))
            # The last replies may still be on the wire: give them what is left of the grace period (>= 1 s).
            self.server.stop(max(left, 1.0) if grace_s else grace_s).wait()
            for close in self.closers:
                close()
            self._stopped.set()

    def wait(self) -> None:
        self.server.wait_for_termination()


def _reflection_v1_file() -> None:
    """Register grpc.reflection.v1 in the default descriptor pool (grpcio-reflection ships v1alpha only).

    v1 is v1alpha renamed (same messages, same field numbers), so v1alpha's servicer answers v1 clients
    unchanged; the descriptor makes the v1 service itself describable.
    """
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fdp.ClearField("options")

    def rename(messages) -> None:
        for m in messages:
            for f in m.field:
                if f.type_name.startswith(old):
                    f.type_name = new + f.type_name[len(old):]
            rename(m.nested_type)

    rename(fdp.message_type)
    for s in fdp.service:
        for m in s.method:
            m.input_type = new + m.input_type[len(old):]
            m.output_type = new + m.output_type[len(old):]
    pool.AddSerializedFile(fdp.SerializeToString())


def _add_reflection(server: grpc.Server, names: Sequence[str]) -> None:
    _reflection_v1_file()
    servicer = reflection.ReflectionServicer([*names, reflection.SERVICE_NAME, REFLECTION_V1])
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {"ServerReflectionInfo": handler}),
        grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),
    ))


def start_server(
    add_servicers: Callable[[grpc.Server], Sequence[str]],
    *,
    host: str,
    port: int,
    workers: int,
    max_concurrent_rpcs: int | None,
    max_message_bytes: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    observers: Sequence[CallObserver] = (),
    credentials: grpc.ServerCredentials | None = None,
    thread_initializer: Callable[[], None] | None = None,
) -> RunningServer:
    """Build, bind and start a server whose services report NOT_SERVING until `set_serving()`.

    add_servicers registers the application servicers and returns their full service names.
    interceptors (e.g. auth) run inside the shell; observers (e.g. metrics) see every call with its true status.
    port 0 binds a free port (tests); the bound port is in the result.
    thread_initializer runs once in every handler thread: per-thread settings such as OpenMP's thread count,
    which omp_set_num_threads in the main thread does not give to threads started later.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    shell = ShellInterceptor(observers, max_message_bytes=max_message_bytes, max_in_flight=max_concurrent_rpcs)
    # Every admitted call holds a handler thread while it runs (a Generate for its whole generation): with fewer
    # threads than the limit, a health check would wait in the pool's queue behind calls nobody answers yet.
    threads = max(workers, max_concurrent_rpcs or 0) + HEALTH_THREADS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc", initializer=thread_initializer),
        maximum_concurrent_rpcs=2 * max_concurrent_rpcs + HEALTH_THREADS if max_concurrent_rpcs else None,
        options=options,
        interceptors=[shell, *interceptors, DecodeErrorInterceptor()],
    )
    names = list(add_servicers(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _add_reflection(server, [*names, health.SERVICE_NAME])
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    running = RunningServer(server=server, port=bound, health=health_servicer, services=names, shell=shell)
    running.set_serving(False)
    server.start()
    return running


# Beyond the grace period: the shutdown hooks' own bound (an engine finishing its pass, pools joining).
STOP_JOIN_S = 60.0


def install_signal_handlers(running: RunningServer, grace_s: float,
                            on_stop: Callable[[], None] | None = None) -> threading.Event:
    """SIGTERM/SIGINT → draining stop in a helper thread (signal handlers must return quickly).

    Returns an event set once the stop, on_stop included, has finished: the main thread waits for it after
    running.wait() so the process never exits while on_stop still joins threads that run native code (an
    interpreter finalizing under a forward pass aborts with SIGABRT).
    """
    stopped = threading.Event()

    def _handler(signum, _frame) -> None:
        log.info("signal %s: NOT_SERVING, draining for up to %.1f s", signal.Signals(signum).name, grace_s)

        def _stop() -> None:
            try:
                running.stop(grace_s)
                if on_stop is not None:
                    on_stop()
            finally:
                stopped.set()

        threading.Thread(target=_stop, name="graceful-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stopped


def wait_until_serving(target: str, timeout_s: float = 60.0, service: str = "",
                       credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Poll the standard health service until SERVING (used by launchers, tests and compose healthchecks)."""
    deadline = time.monotonic() + timeout_s
    with (grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == _SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    return False
