"""The one error table (ragcore/errors.py) through the real gRPC shell, and the one client plumbing
(ragcore/replicated.py) against real servers: failover, down-marking, refusals that must not fail over."""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest

from generation_service.augment.kb_client import KBRequestError, KBUnavailable
from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.errors import (
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from ragcore.replicated import ReplicatedClient
from ragcore.wire import WireError, pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.ngram_store import StoreUnavailable
from retrieval_service.datastore.shards import DatastoreCorrupted, TokenizerMismatch
from retrieval_service.server import build_server as build_retrieval

Code = grpc.StatusCode


class RaisingDatastore:
    """Drafts one node, or raises `error` when one is set (what a datastore, a store or a bug would raise)."""

    vocab_size = 100
    error: BaseException | None = None
    busy = 0  # the next `busy` drafts answer RESOURCE_EXHAUSTED (a loaded service shedding calls)
    stall_s = 0.0  # then each draft takes this long (a slow machine)

    def draft(self, ctx, **kwargs) -> DraftTree:
        if self.busy > 0:
            self.busy -= 1
            raise ResourceExhausted("busy: retry later")
        time.sleep(self.stall_s)
        if self.error is not None:
            raise self.error
        return DraftTree(np.array([7], np.int32), np.array([-1], np.int32))


@pytest.fixture(scope="module")
def server():
    ds = RaisingDatastore()
    running = build_retrieval(RetrievalConfig(port=0, workers=4), datastore=ds)
    yield running, ds
    running.stop(0)


def _draft(address: str, context=(1, 2)):
    with grpc.insecure_channel(address) as ch:
        return draft_pb2_grpc.DraftServiceStub(ch).Draft(draft_pb2.DraftRequest(context=pack_tokens(list(context))),
                                                         timeout=10)


TABLE = [
    # (raised in the handler, status the client gets, its details)
    (InvalidArgument("params.max_nodes", "9999 is outside [1, 1024]"), Code.INVALID_ARGUMENT,
     "params.max_nodes: 9999 is outside [1, 1024]"),
    (WireError("context", "5 bytes is not a whole number of uint32 token ids"), Code.INVALID_ARGUMENT,
     "context: 5 bytes is not a whole number of uint32 token ids"),
    (KBRequestError("k: too many"), Code.INVALID_ARGUMENT, "rag: the knowledge service rejected it: k: too many"),
    (TokenizerMismatch("built with another tokenizer"), Code.FAILED_PRECONDITION, "built with another tokenizer"),
    (FailedPrecondition("not set up"), Code.FAILED_PRECONDITION, "not set up"),
    (StoreUnavailable("redis down"), Code.UNAVAILABLE, "redis down"),  # Not INTERNAL: a dependency, not a bug
    (KBUnavailable("127.0.0.1:1: UNAVAILABLE"), Code.UNAVAILABLE,
     "knowledge service unavailable: 127.0.0.1:1: UNAVAILABLE"),
    (Unavailable("loading"), Code.UNAVAILABLE, "loading"),
    (ResourceExhausted("queue full"), Code.RESOURCE_EXHAUSTED, "queue full"),
    (DeadlineExceeded("deadline passed"), Code.DEADLINE_EXCEEDED, "deadline passed"),
    (Cancelled("caller left"), Code.CANCELLED, "caller left"),
    # Both a DatastoreError (FAILED_PRECONDITION) and DataLoss: the more specific status wins.
    (DatastoreCorrupted("shard 0: index out of range"), Code.DATA_LOSS, "shard 0: index out of range"),
    (DataLoss("bad bytes"), Code.DATA_LOSS, "bad bytes"),
    # A bug: INTERNAL naming the type. Not INVALID_ARGUMENT for a plain ValueError, Not gRPC's bare UNKNOWN.
    (ValueError("oops"), Code.INTERNAL, "internal error: ValueError: oops"),
    (KeyError("k"), Code.INTERNAL, "internal error: KeyError: 'k'"),
]


@pytest.mark.parametrize("error, code, details", TABLE, ids=[type(e).__name__ for e, _, _ in TABLE])
def test_error_table(server, error, code, details):
    running, ds = server
    ds.error = error
    try:
        with pytest.raises(grpc.RpcError) as e:
            _draft(running.address)
    finally:
        ds.error = None
    assert (e.value.code(), e.value.details()) == (code, details)
    assert _draft(running.address).tokens  # the server keeps serving after any of them


def test_invalid_argument_names_its_field():
    e = InvalidArgument("top_p", "must lie in (0, 1], got 2.0")
    assert (e.field, e.problem, str(e)) == ("top_p", "must lie in (0, 1], got 2.0", "top_p: must lie in (0, 1], got 2.0")
    assert isinstance(e, ValueError)  # library callers may still catch ValueError


# ------------------------------------------------------------------------------------------ replicated client


@pytest.fixture(scope="module")
def replica():
    """The replicated client's server, apart from `server`: there the error table's DatastoreCorrupted leaves the
    DraftService NOT_SERVING (as it must), and health-checking clients skip it."""
    ds = RaisingDatastore()
    running = build_retrieval(RetrievalConfig(port=0, workers=4), datastore=ds)
    yield running, ds
    running.stop(0)

def _dead_target() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Refused(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _client(targets: str, **kw) -> ReplicatedClient:
    return ReplicatedClient(targets, draft_pb2_grpc.DraftServiceStub, failure=Refused, timeout_s=2.0,
                            what="retrieval service", **kw)


def _request(context=(1, 2)) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(context=pack_tokens(list(context)))


def test_fails_over_to_a_live_replica_and_skips_the_dead_one(replica):
    running, _ = replica
    dead = _dead_target()
    client = _client(f"{dead},{running.address}", retry_after_s=60)
    try:
        for _ in range(4):  # round-robin starts on either replica; every call succeeds
            assert client.call("Draft", _request()).tokens
        down = [r for r in client.replicas if not r.up(time.monotonic())]
        assert [r.target for r in down] == [dead]  # Not the live one
        calls = client.calls
        client.call("Draft", _request())
        assert client.calls == calls + 1  # the dead replica is skipped, Not tried again first
    finally:
        client.close()


def test_a_refused_request_is_not_retried_elsewhere(replica):
    running, _ = replica
    client = _client(f"{running.address},{running.address}")
    try:
        with pytest.raises(Refused) as e:
            client.call("Draft", _request(context=()))  # empty context: INVALID_ARGUMENT
        assert e.value.kind == "request" and "INVALID_ARGUMENT" in str(e.value)
        assert client.calls == 1  # Not 2: every replica would refuse it the same way
        assert all(r.down_until == 0.0 for r in client.replicas)  # the replica is healthy
    finally:
        client.close()


def test_all_replicas_down_fails_fast_and_names_the_last_error():
    client = _client(f"{_dead_target()},{_dead_target()}", retry_after_s=60)
    try:
        with pytest.raises(Refused) as first:
            client.call("Draft", _request())
        assert first.value.kind == "unavailable"
        asked = client.calls
        with pytest.raises(Refused) as second:
            client.call("Draft", _request())
        assert client.calls == asked  # no call attempted while both are marked down
        assert "all retrieval service replicas failed recently" in str(second.value)
        assert "UNAVAILABLE" in str(second.value)
    finally:
        client.close()


def test_a_spent_deadline_makes_no_call(replica):
    running, _ = replica
    client = _client(running.address)
    try:
        with pytest.raises(Refused) as e:
            client.call("Draft", _request(), deadline=time.monotonic() - 1)
        assert e.value.kind == "unavailable" and "deadline" in str(e.value)
        assert client.calls == 0
    finally:
        client.close()


def test_a_budget_spent_before_any_replica_is_asked_says_deadline_exceeded(replica, monkeypatch):
    """A loaded machine can spend a short call budget before the first replica is asked (the RaLMSpec fault test's
    0.1 ms calls under `make test`): the error names the deadline, Not "no replica tried"."""
    running, _ = replica
    client = _client(running.address)
    healthy = client.healthy

    def slow_healthy():
        time.sleep(0.01)
        return healthy()

    monkeypatch.setattr(client, "healthy", slow_healthy)
    try:
        with pytest.raises(Refused) as e:
            client.call("Draft", _request(), timeout_s=0.001)
        assert e.value.kind == "unavailable" and "DEADLINE_EXCEEDED" in str(e.value)
        assert "no replica tried" not in str(e.value) and client.calls == 0
    finally:
        client.close()


@pytest.mark.parametrize("case, busy, succeeds", [
    ("busy for a moment", 2, True),  # Not failed at the first RESOURCE_EXHAUSTED
    ("busy throughout", 10_000, False),  # fails once its time is spent, Not at once and Not never
])
def test_a_busy_replica_is_asked_again_and_not_marked_down(replica, case, busy, succeeds):
    running, ds = replica
    client = ReplicatedClient(running.address, draft_pb2_grpc.DraftServiceStub, failure=Refused, timeout_s=0.3,
                              what="retrieval service", retry_after_s=60)
    ds.busy = busy
    try:
        t0 = time.perf_counter()
        if succeeds:
            assert client.call("Draft", _request()).tokens, case
            assert client.calls == busy + 1, case
        else:
            with pytest.raises(Refused) as e:
                client.call("Draft", _request())
            assert e.value.kind == "unavailable" and "RESOURCE_EXHAUSTED" in str(e.value), case
            assert 0.2 < time.perf_counter() - t0 < 1.5, case  # within its 0.3 s, after backing off
            assert client.calls > 2, case
        assert all(r.down_until == 0.0 for r in client.replicas), case  # alive, only loaded: Not marked down
    finally:
        ds.busy = 0
        client.close()


@pytest.mark.parametrize("case, busy, expected, not_expected", [
    ("busy, then the last ask runs out of time", 2, "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"),
    ("never busy, only slow", 0, "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"),
])
def test_a_call_that_was_busy_until_its_time_ran_out_says_resource_exhausted(replica, case, busy, expected,
                                                                             not_expected):
    """On a slow machine the ask after the last back-off can run out of time: the cause the caller must hear is
    the load (back off), not the deadline; a call that only timed out still says DEADLINE_EXCEEDED."""
    running, ds = replica
    client = ReplicatedClient(running.address, draft_pb2_grpc.DraftServiceStub, failure=Refused, timeout_s=0.3,
                              what="retrieval service", retry_after_s=60)
    ds.busy, ds.stall_s = busy, 0.6
    try:
        with pytest.raises(Refused) as e:
            client.call("Draft", _request())
        assert e.value.kind == "unavailable", case
        assert expected in str(e.value) and not_expected not in str(e.value), (case, str(e.value))
        # Every busy reply asked again while time was left; on a loaded machine the back-offs can spend the 0.3 s
        # before the last ask, and the answer must still name the load.
        assert (2 if busy else 1) <= client.calls <= busy + 1, case
        assert all(r.down_until == 0.0 for r in client.replicas), case
    finally:
        ds.busy, ds.stall_s = 0, 0.0
        client.close()
