"""The one client plumbing: a gRPC service behind one or more replicas.

Every client in the project (the worker's drafting client, its knowledge-base client, the kNN-LM search client)
calls through a ReplicatedClient: comma-separated targets, one channel each, bearer token and TLS, message size
limits. gRPC watches each replica by the channel's service config: health checking (grpc.health.v1 Watch) takes
a NOT_SERVING replica (loading, draining, a corrupted datastore) out of READY and puts it back once SERVING; a lost
connection is retried within a second, so a restarted replica is READY again without a call finding out; a
transient UNAVAILABLE is asked again on the same replica, a few milliseconds apart, never past the call's deadline.
What gRPC lacks is here: round-robin over the replicas, skipping those in TRANSIENT_FAILURE (a dead service
costs no call at all, not a timeout per call), failover to the next within the caller's deadline, backing off a
busy one, and skipping for `retry_after_s` a replica that answered a server fault on a connection gRPC deems
healthy.

Failures come back as the caller's own exception types (`failure(kind, message)`), so drafting can degrade to
AR while a RAG step fails the request:
- "request": the server refused the request itself (INVALID_ARGUMENT, FAILED_PRECONDITION): every replica would
  say the same, so no failover and the replica stays in rotation;
- "unavailable": anything else (down, overloaded, deadline, a bad reply).

    kb = ReplicatedClient("10.0.0.1:50051,10.0.0.2:50051", KnowledgeServiceStub, timeout_s=2.0, failure=my_errors)
    reply = kb.call("Search", request, deadline=time.monotonic() + 1.0)
"""

from __future__ import annotations

import importlib
import itertools
import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from grpc import _common

# The server refused the request itself: another replica would say the same.
_REQUEST_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION})
# Our own deadline or cancel: says nothing about the replica's health.
_CALLER_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# Overloaded, not broken: the replica sheds load (a bounded queue). Never skipped, and not one of gRPC's retry
# codes: gRPC would ask the same replica again at once, while call() backs off and asks again within the call's
# time (BUSY_BACKOFF_S, doubling up to BUSY_BACKOFF_MAX_S) and still sees the status to report it. A worker
# decoding many RAG requests at once keeps more searches in flight than a knowledge service admits.
_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED
BUSY_BACKOFF_S = 0.005
BUSY_BACKOFF_MAX_S = 0.2
# gRPC's own retries of UNAVAILABLE on one replica: short, because failing over to another replica is the better
# answer to a replica that keeps saying it (a drafting call has 50 ms by default).
RETRY_POLICY = {"maxAttempts": 3, "initialBackoff": "0.005s", "maxBackoff": "0.02s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}
_DOWN = frozenset({grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN})

Failure = Callable[[str, str], Exception]  # (kind: "request" | "unavailable", message) -> exception to raise


def split_targets(target: str) -> list[str]:
    """'a:1,b:2' -> ['a:1', 'b:2']; a dns:/// target stays one (gRPC balances it itself, round_robin)."""
    return [t.strip() for t in target.split(",") if t.strip()]


def service_name(stub_class: type) -> str:
    """DraftServiceStub -> 'ragserve.v1.DraftService', from the descriptor of the stub's generated module."""
    pb2 = importlib.import_module(stub_class.__module__.removesuffix("_grpc"))
    return pb2.DESCRIPTOR.services_by_name[stub_class.__name__.removesuffix("Stub")].full_name


def service_config(service: str) -> str:
    return json.dumps({
        # Health checking applies under round_robin (also over one address), not under pick_first.
        "loadBalancingConfig": [{"round_robin": {}}],
        "healthCheckConfig": {"serviceName": service},
        "methodConfig": [{"name": [{"service": service}], "retryPolicy": RETRY_POLICY}],
    })


@dataclass
class Replica:
    target: str
    channel: grpc.Channel
    stub: Any  # over the channel, instrumented when asked for
    down_until: float = 0.0  # answered a server fault on a healthy connection: skipped until then

    def state(self) -> grpc.ChannelConnectivity:
        """The channel's state now. grpcio's sync channel has no public getter (grpc.aio's get_state is one), and
        subscribe() reports from a polling thread, after a failed call has returned (the tests pin this: a second
        call after every replica failed asks none)."""
        state = self.channel._channel.check_connectivity_state(False)
        return _common.CYGRPC_CONNECTIVITY_STATE_TO_CHANNEL_CONNECTIVITY[state]

    def up(self, now: float) -> bool:
        state = self.state()
        if state != grpc.ChannelConnectivity.READY:
            self.down_until = 0.0  # the connection that answered the fault is gone: the channel's state rules now
        return state not in _DOWN and self.down_until <= now


class ReplicatedClient:
    def __init__(self, target: str, stub_class: type, *, failure: Failure, timeout_s: float,
                 retry_after_s: float = 1.0, max_message_bytes: int = 64 << 20, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None,
                 instrument: Callable[[grpc.Channel], grpc.Channel] | None = None, what: str = "service"):
        """target: "host:port" or several comma-separated; timeout_s: per-call default; token: bearer token ("" =
        none); credentials: TLS (None = plaintext); instrument: wraps each channel (metrics); what: names the
        service in messages."""
        targets = split_targets(target)
        if not targets:
            raise ValueError(f"{what}: no target given")
        if not timeout_s > 0:
            raise ValueError(f"{what}: timeout must be > 0, got {timeout_s!r}")
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.service_config", service_config(service_name(stub_class))),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self.replicas: list[Replica] = []
        for t in targets:
            ch = grpc.secure_channel(t, credentials, options=options) if credentials else \
                grpc.insecure_channel(t, options=options)
            self.replicas.append(Replica(t, ch, stub_class(instrument(ch) if instrument is not None else ch)))
        self._next = itertools.cycle(range(len(self.replicas)))
        self._lock = threading.Lock()
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.what = what
        self._failure = failure
        self.last_error = ""  # the last failure that was the replica's (quoted when all are down)
        self.calls = 0  # RPCs attempted (gRPC's own retries of one are one)

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self.replicas]

    def close(self) -> None:
        for r in self.replicas:
            r.channel.close()

    def healthy(self) -> list[Replica]:
        """Replicas to try, in round-robin order, skipping those that are down; raises when none is left."""
        now = time.monotonic()
        with self._lock:
            start = next(self._next)
        n = len(self.replicas)
        order = [self.replicas[(start + i) % n] for i in range(n)]
        alive = [r for r in order if r.up(now)]
        if not alive:
            why = self.last_error or ", ".join(f"{r.target} {r.state().name}" for r in order)
            raise self._failure("unavailable", f"all {self.what} replicas failed recently (last error: {why})")
        return alive

    def budget(self, deadline: float | None, timeout_s: float | None) -> float:
        """Seconds this call may take: the per-call timeout, cut to the caller's deadline (monotonic time)."""
        budget = self.timeout_s if timeout_s is None else timeout_s
        if deadline is not None:
            budget = min(budget, deadline - time.monotonic())
        if budget <= 0:
            raise self._failure("unavailable", f"the request deadline leaves no time for the {self.what}")
        return budget

    def failed(self, replica: Replica | None, e: grpc.RpcError) -> Exception:
        """The caller's exception for a failed call; skips a replica that answered a fault on a healthy
        connection (one that is down or NOT_SERVING is out of READY, which healthy() sees)."""
        code = e.code()
        msg = f"{replica.target if replica is not None else self.what}: {code.name} {e.details() or ''}".strip()
        if code in _REQUEST_CODES:
            return self._failure("request", msg)
        if replica is not None and code not in _CALLER_CODES and code != _BUSY:
            self.last_error = msg
            if replica.state() == grpc.ChannelConnectivity.READY:
                replica.down_until = time.monotonic() + self.retry_after_s
        return self._failure("unavailable", msg)

    def call(self, method: str, request, *, deadline: float | None = None, timeout_s: float | None = None):
        """`method` on the first healthy replica, failing over to the next within the deadline; while every replica
        that answered was busy (RESOURCE_EXHAUSTED), back off and ask again within the same time."""
        end = time.monotonic() + self.budget(deadline, timeout_s)
        pause = BUSY_BACKOFF_S
        busy_err: Exception | None = None  # the last RESOURCE_EXHAUSTED of this call
        while True:
            err: Exception | None = None
            busy = False
            timed_out = False
            for r in self.healthy():
                budget = min(self.budget(deadline, timeout_s), end - time.monotonic())
                if budget <= 0:  # a busy machine can spend a short budget before the first replica is asked
                    raise err or self._failure("unavailable", f"{self.what}: DEADLINE_EXCEEDED before a replica "
                                                              "was asked")
                self.calls += 1
                try:
                    # Not wait_for_ready: a replica that lost READY since healthy() fails at once, the next is asked.
                    return getattr(r.stub, method)(request, timeout=budget, metadata=self.metadata,
                                                   wait_for_ready=False)
                except grpc.RpcError as e:
                    err = self.failed(r, e)
                    if e.code() in _REQUEST_CODES:
                        raise err from None
                    if e.code() == _BUSY:
                        busy, busy_err = True, err
                    timed_out = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait = min(pause, end - time.monotonic() - BUSY_BACKOFF_S)  # the last pause leaves time to ask again
            if not busy or wait <= 0:
                if timed_out and busy_err is not None:
                    # Busy until the last ask, which then ran out of time (a slow machine): the cause is the
                    # load, and RESOURCE_EXHAUSTED tells the caller to back off.
                    raise busy_err
                raise err or self._failure("unavailable", "no replica tried")
            time.sleep(wait)
            pause = min(2 * pause, BUSY_BACKOFF_MAX_S)

    def call_future(self, method: str, request, *, deadline: float | None = None,
                    timeout_s: float | None = None) -> tuple[Replica, grpc.Future]:
        """Start `method` on one healthy replica and return at once (failover is the caller's retry)."""
        r = self.healthy()[0]
        budget = self.budget(deadline, timeout_s)
        self.calls += 1
        return r, getattr(r.stub, method).future(request, timeout=budget, metadata=self.metadata,
                                                 wait_for_ready=False)
