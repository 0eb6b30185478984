"""What the replicated client (ragcore/replicated.py) leaves to gRPC, against real Draft servers on loopback:
health checking takes a NOT_SERVING replica out and puts it back, gRPC retries a transient UNAVAILABLE inside the
caller's deadline (and never a RESOURCE_EXHAUSTED), a restarted replica is back without a call finding out, and
the health Watch streams of many clients hold no server threads."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.errors import ResourceExhausted, Unavailable
from ragcore.grpc_shell import RunningServer, start_server
from ragcore.replicated import RETRY_POLICY, ReplicatedClient, service_config, service_name
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import DraftServicer
from tools.launcher import free_port

DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
WAIT_S = 20.0  # bound on gRPC's own state changes (health: milliseconds; reconnect backoff: at most 1 s)


class CountingDatastore:
    """Drafts one node and counts every attempt that reached it; the next `unavailable` attempts answer
    UNAVAILABLE and the next `busy` ones RESOURCE_EXHAUSTED, each after `stall_s`."""

    vocab_size = 100

    def __init__(self):
        self.lock = threading.Lock()
        self.attempts: list[tuple[float, float | None]] = []  # (monotonic start, the deadline the server saw)
        self.unavailable = self.busy = 0
        self.stall_s = 0.0

    @property
    def drafts(self) -> int:
        return len(self.attempts)

    def draft(self, ctx, **kwargs) -> DraftTree:
        time.sleep(self.stall_s)
        with self.lock:
            if self.unavailable > 0:
                self.unavailable -= 1
                raise Unavailable("store reconnecting")
            if self.busy > 0:
                self.busy -= 1
                raise ResourceExhausted("busy: retry later")
        return DraftTree(np.array([7], np.int32), np.array([-1], np.int32))


class Deadlines(grpc.ServerInterceptor):
    """Records, for every Draft attempt, when it arrived and the deadline it carried (monotonic time)."""

    def __init__(self, ds: CountingDatastore):
        self.ds = ds

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.endswith("/Draft"):
            return handler
        inner = handler.unary_unary

        def unary(request, context):
            now = time.monotonic()
            left = context.time_remaining()
            with self.ds.lock:
                self.ds.attempts.append((now, now + left if left is not None else None))
            return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)


class Refused(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _server(port: int = 0, max_concurrent_rpcs: int = 64) -> tuple[RunningServer, CountingDatastore]:
    """The retrieval server's Draft service (its servicer in the gRPC shell) over a CountingDatastore."""
    ds = CountingDatastore()
    cfg = RetrievalConfig(port=port, workers=4, max_concurrent_rpcs=max_concurrent_rpcs)
    servicer = DraftServicer(cfg, datastore=ds)

    def add(server: grpc.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
        return [DRAFT_SERVICE]

    running = start_server(add, host="127.0.0.1", port=port, workers=cfg.workers,
                           max_concurrent_rpcs=cfg.max_concurrent_rpcs, max_message_bytes=cfg.max_message_bytes,
                           interceptors=[Deadlines(ds)])
    running.set_serving(True)
    return running, ds


def _client(targets: str, **kw) -> ReplicatedClient:
    kw.setdefault("timeout_s", 2.0)
    return ReplicatedClient(targets, draft_pb2_grpc.DraftServiceStub, failure=Refused, what="retrieval service",
                            **kw)


def _request() -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(context=pack_tokens([1, 2]))


def _until(check, timeout_s: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@pytest.fixture
def two():
    servers = [_server(), _server()]
    yield servers
    for running, _ in servers:
        running.stop(0)


def test_the_health_checked_service_is_the_one_the_stub_calls():
    assert service_name(draft_pb2_grpc.DraftServiceStub) == DRAFT_SERVICE  # Not "" (the whole server's status)


def test_a_not_serving_replica_gets_no_calls_until_it_serves_again(two):
    (a, ds_a), (b, ds_b) = two
    client = _client(f"{a.address},{b.address}", retry_after_s=60)
    try:
        for _ in range(4):  # both connected and in rotation
            client.call("Draft", _request())
        assert ds_a.drafts > 0 and ds_b.drafts > 0
        replica_a = client.replicas[0]

        a.set_serving(False, [DRAFT_SERVICE])  # draining, loading or a corrupted datastore say this
        assert _until(lambda: not replica_a.up(time.monotonic()))
        before_a, before_b, calls = ds_a.drafts, ds_b.drafts, client.calls
        for _ in range(6):
            assert client.call("Draft", _request()).tokens  # Not failed: the other replica answers
        assert ds_a.drafts == before_a  # Not asked once while NOT_SERVING
        assert ds_b.drafts == before_b + 6 and client.calls == calls + 6  # no failed attempt first

        a.set_serving(True, [DRAFT_SERVICE])
        assert _until(lambda: replica_a.up(time.monotonic()))  # Not after retry_after_s (a minute)
        for _ in range(4):
            client.call("Draft", _request())
        assert ds_a.drafts > before_a  # back in rotation
    finally:
        client.close()


def test_every_replica_not_serving_asks_none():
    running, ds = _server()
    client = _client(running.address)
    try:
        client.call("Draft", _request())
        running.set_serving(False, [DRAFT_SERVICE])
        assert _until(lambda: not client.replicas[0].up(time.monotonic()))
        drafts, calls = ds.drafts, client.calls
        with pytest.raises(Refused) as e:
            client.call("Draft", _request())
        assert e.value.kind == "unavailable" and "failed recently" in str(e.value)
        assert (ds.drafts, client.calls) == (drafts, calls)  # Not a call that waits for its deadline
    finally:
        client.close()
        running.stop(0)


@pytest.mark.parametrize("case, unavailable, succeeds, attempts", [
    # (case, UNAVAILABLE answers before a good one, the call succeeds, attempts the server sees)
    ("one transient UNAVAILABLE", 1, True, 2),  # Not a failed draft: gRPC asked again
    ("two transient UNAVAILABLE", 2, True, 3),
    ("UNAVAILABLE throughout", 10, False, RETRY_POLICY["maxAttempts"]),  # Not retried without end
])
def test_grpc_retries_a_transient_unavailable_on_the_same_replica(case, unavailable, succeeds, attempts):
    running, ds = _server()
    client = _client(running.address, retry_after_s=60)
    ds.unavailable = unavailable
    try:
        if succeeds:
            assert client.call("Draft", _request()).tokens, case
        else:
            with pytest.raises(Refused) as e:
                client.call("Draft", _request())
            assert e.value.kind == "unavailable" and "UNAVAILABLE" in str(e.value), case
            # A healthy replica that keeps answering UNAVAILABLE is skipped for retry_after_s: gRPC sees it READY.
            with pytest.raises(Refused) as again:
                client.call("Draft", _request())
            assert "failed recently" in str(again.value), case
        assert ds.drafts == attempts, case
        assert client.calls == 1, case  # gRPC's retries, Not our failover loop
    finally:
        client.close()
        running.stop(0)


def test_a_busy_replica_is_not_retried_by_grpc():
    """RESOURCE_EXHAUSTED is call()'s to back off from: every attempt the server sees is one of ours."""
    running, ds = _server()
    client = _client(running.address, timeout_s=0.3, retry_after_s=60)
    ds.busy = 2
    try:
        assert client.call("Draft", _request()).tokens
        assert ds.drafts == client.calls == 3  # Not more attempts than calls: gRPC asked nothing again
    finally:
        client.close()
        running.stop(0)


def test_a_retry_never_outlives_the_callers_deadline():
    running, ds = _server()
    client = _client(running.address, retry_after_s=60)
    ds.unavailable, ds.stall_s = 10, 0.1  # every attempt fails late
    try:
        deadline = time.monotonic() + 0.25
        with pytest.raises(Refused) as e:
            client.call("Draft", _request(), deadline=deadline)
        returned = time.monotonic()
        assert e.value.kind == "unavailable", str(e.value)
        assert ds.drafts >= 2  # gRPC retried within the time, Not only one attempt
        starts = [start for start, _ in ds.attempts]
        assert all(start < deadline for start in starts)  # Not an attempt begun after the deadline
        # Every attempt carried the caller's deadline, Not a fresh timeout of its own (10 ms: clock rounding).
        assert all(seen is not None and seen <= deadline + 0.01 for _, seen in ds.attempts), (deadline, ds.attempts)
        assert returned < deadline + 1.0  # the call ended at its deadline (generous for a loaded machine)
    finally:
        ds.stall_s = 0.0
        client.close()
        running.stop(0)


def test_a_restarted_replica_is_back_without_a_call():
    """The channel reconnects on its own within its short backoff: the first call after a restart is served."""
    port = free_port()
    running, ds = _server(port)
    client = _client(running.address, retry_after_s=60)
    replica = client.replicas[0]
    try:
        client.call("Draft", _request())
        running.stop(0)
        assert _until(lambda: not replica.up(time.monotonic()))
        with pytest.raises(Refused):
            client.call("Draft", _request())  # no replica left: fails at once
        running, ds = _server(port)
        assert _until(lambda: replica.up(time.monotonic()))  # Not after retry_after_s (a minute)
        assert client.call("Draft", _request()).tokens
        assert ds.drafts == 1
    finally:
        client.close()
        running.stop(0)


def test_health_watches_of_many_clients_hold_no_server_threads():
    """Every worker process keeps one health Watch open per replica. With a handler thread held per Watch, a
    server with few threads would have none left for calls, and gRPC's own call limit would refuse the rest."""
    running, _ = _server(max_concurrent_rpcs=1)  # 4 + 4 handler threads, gRPC's own limit 6 calls at once
    # In one process channels share a subchannel, and so one Watch, unless each has its own pool: 12 "workers".
    options = [("grpc.service_config", service_config(DRAFT_SERVICE)), ("grpc.use_local_subchannel_pool", 1)]
    workers = [grpc.insecure_channel(running.address, options=options) for _ in range(12)]
    client = _client(running.address)
    try:
        for ch in workers:  # READY once its own Watch answered SERVING
            grpc.channel_ready_future(ch).result(timeout=10)
        assert client.call("Draft", _request(), timeout_s=5.0).tokens  # Not DEADLINE_EXCEEDED, Not RESOURCE_EXHAUSTED
    finally:
        client.close()
        for ch in workers:
            ch.close()
        running.stop(0)
