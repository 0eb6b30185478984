"""Standard gRPC hygiene shared by both servers.

- grpc.health.v1: every service starts NOT_SERVING and is switched to SERVING only once its indexes or
  model are loaded and warmed up (the caller decides when).
- Reflection, so grpcurl and friends can discover the API.
- Backpressure: `maximum_concurrent_rpcs` makes gRPC itself answer RESOURCE_EXHAUSTED beyond the limit.
- Graceful stop on SIGTERM/SIGINT: health goes NOT_SERVING, new calls are refused, in-flight calls get
  `grace_s` seconds to finish.
- Requests that do not decode (e.g. invalid UTF-8 in a string field) get INVALID_ARGUMENT naming the field,
  not gRPC's INTERNAL (serving.security.DecodeErrorInterceptor, always installed, innermost).
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.security import DecodeErrorInterceptor

log = logging.getLogger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class RunningServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    services: list[str]
    # Called after the gRPC server stopped (e.g. the metrics HTTP endpoint's shutdown).
    closers: list[Callable[[], None]] = field(default_factory=list)
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set_serving(self, serving: bool = True) -> None:
        status = _SERVING if serving else _NOT_SERVING
        for name in ["", *self.services]:
            self.health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """Refuse new calls, let in-flight ones finish for up to grace_s, then return."""
        if self._stopped.is_set():
            return
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        for close in self.closers:
            close()
        self._stopped.set()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_server(
    add_servicers: Callable[[grpc.Server], Sequence[str]],
    *,
    host: str,
    port: int,
    workers: int,
    max_concurrent_rpcs: int | None,
    max_message_bytes: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    credentials: grpc.ServerCredentials | None = None,
    thread_initializer: Callable[[], None] | None = None,
) -> RunningServer:
    """Build, bind and start a server whose services report NOT_SERVING until `set_serving()`.

    add_servicers registers the application servicers and returns their full service names.
    port 0 binds a free port (tests); the bound port is in the result.
    thread_initializer runs once in every handler thread: per-thread settings such as OpenMP's thread count,
    which omp_set_num_threads in the main thread does not give to threads started later.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rpc", initializer=thread_initializer),
        maximum_concurrent_rpcs=max_concurrent_rpcs or None,
        options=options,
        interceptors=[*interceptors, DecodeErrorInterceptor()],
    )
    names = list(add_servicers(server))
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"could not bind {address}")
    running = RunningServer(server=server, port=bound, health=health_servicer, services=names)
    running.set_serving(False)
    server.start()
    return running


def install_signal_handlers(running: RunningServer, grace_s: float, on_stop: Callable[[], None] | None = None) -> None:
    """SIGTERM/SIGINT → graceful stop in a helper thread (signal handlers must return quickly)."""

    def _handler(signum, _frame) -> None:
        log.info("signal %s: draining for up to %.1f s", signal.Signals(signum).name, grace_s)

        def _stop() -> None:
            running.stop(grace_s)
            if on_stop is not None:
                on_stop()

        threading.Thread(target=_stop, name="graceful-stop", daemon=True).start()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def wait_until_serving(target: str, timeout_s: float = 60.0, service: str = "",
                       credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Poll the standard health service until SERVING (used by launchers, tests and compose healthchecks)."""
    import time

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
