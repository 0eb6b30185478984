"""Overload on the retrieval service: gRPC's maximum_concurrent_rpcs refuses calls beyond the limit with
RESOURCE_EXHAUSTED instead of queueing them without bound (the generation worker's bounded queue is tested in
tests/integration/test_faults.py)."""

from __future__ import annotations

import threading

import grpc
import numpy as np

from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server


class BlockingDatastore:
    """Drafts block until released, so a test controls how many calls are in flight."""

    vocab_size = 100

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def draft(self, ctx, **kwargs) -> DraftTree:
        self.entered.release()
        self.release.wait(30)
        return DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))


def _draft(stub, out: list, lock: threading.Lock) -> None:
    try:
        stub.Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2, 3])), timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    with lock:
        out.append(code)


def test_calls_beyond_max_concurrent_rpcs_get_resource_exhausted():
    ds = BlockingDatastore()
    running = build_server(RetrievalConfig(port=0, workers=8, max_concurrent_rpcs=2), datastore=ds)
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            held = [threading.Thread(target=_draft, args=(stub, codes, lock)) for _ in range(2)]
            for t in held:
                t.start()
            for _ in held:  # both are inside the servicer now
                assert ds.entered.acquire(timeout=30)
            extra = [threading.Thread(target=_draft, args=(stub, codes, lock)) for _ in range(3)]
            for t in extra:
                t.start()
            for t in extra:
                t.join(30)
            refused = list(codes)
            ds.release.set()
            for t in held:
                t.join(30)
            # Once the load is gone the server answers again.
            stub.Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2, 3])), timeout=30)
    finally:
        ds.release.set()
        running.stop(0)
    assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3  # Not queued behind the blocked calls
    assert codes.count(grpc.StatusCode.OK) == 2  # the two in flight finish normally


def _handled(code: str) -> float:
    from ragcore import metrics as core_metrics

    m = core_metrics.get("retrieval")
    return m.handled.labels("ragserve.v1.DraftService", "Draft", "unary", code)._value.get()


def test_health_answers_and_refusals_are_counted_while_every_call_slot_is_taken():
    """Every handler thread the configuration asks for is held by a call: health checks still answer SERVING at
    once (they are outside the call limit and have threads of their own), and each refused call is counted with its
    code (Not refused by gRPC where no metric sees it)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ds = BlockingDatastore()
    running = build_server(RetrievalConfig(port=0, workers=2, max_concurrent_rpcs=2), datastore=ds)
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    before = _handled("RESOURCE_EXHAUSTED")
    health: list[int] = []
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            held = [threading.Thread(target=_draft, args=(stub, codes, lock)) for _ in range(2)]
            for t in held:
                t.start()
            for _ in held:
                assert ds.entered.acquire(timeout=30)
            extra = [threading.Thread(target=_draft, args=(stub, codes, lock)) for _ in range(4)]
            for t in extra:
                t.start()
            for t in extra:
                t.join(30)
            checker = health_pb2_grpc.HealthStub(ch)
            for _ in range(10):  # a generous deadline for a loaded CI box; a starved check never answers at all
                health.append(checker.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
            ds.release.set()
            for t in held:
                t.join(30)
    finally:
        ds.release.set()
        running.stop(0)
    assert health == [health_pb2.HealthCheckResponse.SERVING] * 10  # Not DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4
    assert _handled("RESOURCE_EXHAUSTED") - before == 4  # Not 0: every refusal is in the metrics
