"""The workers behind the gateway: one grpc.aio channel each, health by the standard grpc.health.v1 Watch stream,
requests in flight counted per worker, and the worker list from flags and/or a DNS name re-resolved periodically
(every A/AAAA record of a Kubernetes headless Service is one worker).

A worker is routable while its Watch stream says SERVING and it has answered GetInfo (with the gateway's token:
health needs none, so a worker that refuses the gateway's credentials stays unroutable, and /ready says so). A
broken stream (the worker died or restarted) makes it unroutable at once and the watch reconnects with backoff; a
call that fails with UNAVAILABLE does the same, so new requests go elsewhere before the next health message could
say so.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from pathlib import PurePath

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import routing
from gateway.config import GatewayConfig
from proto import generation_pb2, generation_pb2_grpc
from ragcore import security

log = logging.getLogger("gateway.workers")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_BACKOFF_S = (0.1, 0.25, 0.5, 1.0, 2.0)


@dataclass(eq=False)
class Worker:
    address: str
    channel: grpc.aio.Channel
    stub: generation_pb2_grpc.GenerationServiceStub
    serving: bool = False
    inflight: int = 0
    model: str = ""  # the worker's model directory (GetInfo), once it answered
    model_id: str = ""  # its last path component: the id clients name (derived once, read on every request)
    why: str = ""  # the kind of reason it is not serving, as last logged ("" = serving, or not yet known)
    watch: asyncio.Task | None = None
    closed: bool = False


class WorkerPool:
    """Created and used on the event loop that serves requests (start() / close() from the app's lifespan)."""

    def __init__(self, cfg: GatewayConfig):
        self.cfg = cfg
        token = security.read_token(cfg.worker_auth_token, cfg.worker_auth_token_file)
        self.metadata = security.auth_metadata(token)
        self.credentials = security.channel_credentials(cfg.worker_tls_ca, cfg.worker_tls_cert, cfg.worker_tls_key)
        self.workers: dict[str, Worker] = {}
        self._dns_task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------ membership

    async def start(self) -> None:
        for address in self.cfg.worker_list():
            self._add(address)
        if self.cfg.workers_dns:
            await self._resolve_once()
            self._dns_task = asyncio.create_task(self._resolve_forever())

    def _add(self, address: str) -> Worker:
        if address in self.workers:
            return self.workers[address]
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0),
                   ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]
        if self.credentials is not None:
            if self.cfg.worker_tls_server_name:
                options.append(("grpc.ssl_target_name_override", self.cfg.worker_tls_server_name))
            channel = grpc.aio.secure_channel(address, self.credentials, options=options)
        else:
            channel = grpc.aio.insecure_channel(address, options=options)
        w = Worker(address, channel, generation_pb2_grpc.GenerationServiceStub(channel))
        self.workers[address] = w
        w.watch = asyncio.create_task(self._watch(w))
        log.info("worker %s added", address)
        return w

    async def _remove(self, address: str) -> None:
        w = self.workers.pop(address, None)
        if w is None:
            return
        w.closed, w.serving = True, False
        if w.watch is not None:
            w.watch.cancel()
        log.info("worker %s removed (no longer in DNS)", address)
        await w.channel.close(grace=self.cfg.request_timeout_s)  # its calls in flight may finish

    async def _resolve_once(self) -> None:
        name, _, port = self.cfg.workers_dns.rpartition(":")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
        except (socket.gaierror, OSError) as e:
            log.warning("workers_dns %s: %s (keeping %d workers)", self.cfg.workers_dns, e, len(self.workers))
            return
        found = set()
        for family, _, _, _, sockaddr in infos:
            host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
            found.add(f"{host}:{sockaddr[1]}")
        static = set(self.cfg.worker_list())
        for address in sorted(found - set(self.workers)):
            self._add(address)
        for address in sorted(set(self.workers) - found - static):
            await self._remove(address)

    async def _resolve_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.dns_refresh_s)
            await self._resolve_once()

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
        for w in list(self.workers.values()):
            w.closed = True
            if w.watch is not None:
                w.watch.cancel()
            await w.channel.close(grace=None)
        self.workers.clear()

    # --------------------------------------------------------------------------------------------- health

    def _set(self, w: Worker, serving: bool, why: str = "") -> None:
        # A worker that never became routable logs why too, once per kind of reason (its reconnects repeat it).
        kind = "" if serving else why.split(":")[0]
        if w.serving != serving or kind != w.why:
            log.log(logging.INFO if serving else logging.WARNING, "worker %s %s%s", w.address,
                    "SERVING" if serving else "not serving", f": {why}" if why else "")
        w.serving, w.why = serving, kind

    async def _watch(self, w: Worker) -> None:
        failures = 0
        health = health_pb2_grpc.HealthStub(w.channel)
        while not w.closed:
            try:
                stream = health.Watch(health_pb2.HealthCheckRequest(service=""))
                why = "health stream ended"
                async for reply in stream:
                    serving = reply.status == _SERVING
                    # Health needs no token, GetInfo does: a worker that refuses the gateway's credentials (or
                    # does not answer GetInfo) would look SERVING yet fail every request, and Watch sends nothing
                    # more until its status changes. So it stays unroutable and the watch starts again later.
                    refused = await self._fetch_info(w) if serving and not w.model else ""
                    if refused:
                        why = refused
                        stream.cancel()
                        break
                    failures = 0
                    self._set(w, serving, "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(
                        reply.status))
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                why = f"{e.code().name}: {e.details()}"
            self._set(w, False, why)
            await asyncio.sleep(_BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)])
            failures += 1

    async def _fetch_info(self, w: Worker) -> str:
        """Learn the worker's model (GetInfo) -> "" or why the call failed."""
        try:
            info = await w.stub.GetInfo(generation_pb2.WorkerInfoRequest(), timeout=5.0, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            return f"GetInfo {e.code().name}: {e.details()}"
        w.model = info.model
        w.model_id = PurePath(info.model).name or info.model
        return ""

    def failed(self, w: Worker, e: grpc.aio.AioRpcError) -> None:
        """A call to w failed: an UNAVAILABLE worker takes no new requests until its health says SERVING again."""
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            self._set(w, False, f"call failed: {e.details()}")

    # -------------------------------------------------------------------------------------------- routing

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.serving]

    def model_name(self) -> str:
        """The model id served: the configured one, else the first serving worker's model directory's name."""
        if self.cfg.model_name:
            return self.cfg.model_name
        for w in self.workers.values():
            if w.model_id:
                return w.model_id
        return ""

    def pick(self, key: str, exclude: set[str] = frozenset()) -> tuple[Worker, str] | None:
        """The worker for a request with this affinity key (routing.choose), None when no worker is SERVING."""
        live = {w.address: w for w in self.healthy() if w.address not in exclude}
        if not live:
            return None
        if len(live) == 1:  # routing.choose's answer for one candidate, without hashing the key to rank it
            return next(iter(live.values())), "affinity"
        ranked = routing.rank(key, list(live))
        got = routing.choose(ranked, {a: w.inflight for a, w in live.items()}, self.cfg.busy_inflight)
        if got is None:
            return None
        return live[got[0]], got[1]
