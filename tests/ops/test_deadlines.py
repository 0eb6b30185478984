"""Deadlines propagate client -> generation worker -> retrieval: a draft call never gets more time than the
request that needs it has left (and none once it is gone)."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from generation_service.client import GenerationClient
from generation_service.drafting.drafters import DraftUnavailable
from generation_service.drafting.retrieval_client import RemoteDrafter, RetrievalClient
from proto import draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc
from ragcore.grpc_shell import start_server
from tests.integration.conftest import PROMPTS, start_generation


class RecordingDraftService(draft_pb2_grpc.DraftServiceServicer):
    """Answers empty drafts and records the time each Draft / DraftBatch call had left."""

    def __init__(self) -> None:
        self.remaining: list[float | None] = []
        self.lock = threading.Lock()

    def Draft(self, request, context):
        with self.lock:
            self.remaining.append(context.time_remaining())
        return draft_pb2.DraftResponse()

    def DraftBatch(self, request, context):  # the engine asks a pass's drafts in one call
        with self.lock:
            self.remaining.append(context.time_remaining())
        return draft_pb2.DraftBatchResponse(responses=[draft_pb2.DraftResponse() for _ in request.requests])

    def Info(self, request, context):
        return draft_pb2.DatastoreInfo(vocab_size=1 << 16, sources=["context", "datastore", "merged"])


@pytest.fixture()
def recorder():
    svc = RecordingDraftService()

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(svc, server)
        return ["ragserve.v1.DraftService"]

    running = start_server(add, host="127.0.0.1", port=0, workers=4, max_concurrent_rpcs=None,
                           max_message_bytes=1 << 20)
    running.set_serving(True)
    yield svc, running.address
    running.stop(0)


def test_remote_drafter_sends_the_request_deadline(recorder):
    svc, address = recorder
    client = RetrievalClient(address, timeout_ms=60_000)  # the per-draft timeout alone would allow a minute
    try:
        RemoteDrafter(client, "datastore", deadline=time.monotonic() + 2.0).propose(np.arange(5), 8)
        RemoteDrafter(client, "datastore").propose(np.arange(5), 8)
        with pytest.raises(DraftUnavailable, match="deadline"):  # Not a call with no time left
            RemoteDrafter(client, "datastore", deadline=time.monotonic() - 0.1).propose(np.arange(5), 8)
    finally:
        client.close()
    bounded, unbounded = svc.remaining
    assert 0 < bounded <= 2.1  # Not the 60 s draft timeout
    assert 2.0 < unbounded <= 61.0  # the 60 s draft timeout (+ clock slack)
    assert len(svc.remaining) == 2


@pytest.mark.model
def test_generation_passes_the_client_deadline_to_retrieval(tm, recorder):
    svc, address = recorder
    running, servicer = start_generation(tm, address, draft_timeout_ms=600_000)
    try:
        with GenerationClient(running.address) as c:
            reply = c.generate(PROMPTS[0], max_new_tokens=6, decoding="rest", ignore_eos=True, timeout=30)
            assert reply.usage.completion_tokens == 6
            assert not reply.stats.degraded, reply.stats.degraded_reason
    finally:
        running.stop(0)
        servicer.worker.stop()
    assert svc.remaining, "the worker never asked for a draft"
    assert all(r is not None and 0 < r <= 31 for r in svc.remaining), svc.remaining  # Not the 600 s timeout


def test_a_call_without_deadline_reads_as_none(recorder):
    """gRPC reports "no deadline" as ~2**63 ns; handlers must see None, not a number that overflows time_t."""
    svc, address = recorder
    with grpc.insecure_channel(address) as channel:
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        stub.Draft(draft_pb2.DraftRequest(context=bytes(4)))  # no timeout
        stub.Draft(draft_pb2.DraftRequest(context=bytes(4)), timeout=5)
    unbounded, bounded = svc.remaining
    assert unbounded is None  # Not 9.2e9 s
    assert bounded is not None and 0 < bounded <= 5.1  # (+ clock slack)


@pytest.mark.model
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_generate_without_deadline_is_answered(tm, recorder, rpc):
    _, address = recorder
    running, servicer = start_generation(tm, address)
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            req = generation_pb2.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=3, ignore_eos=True,
                                                 decoding="ar")
            if rpc == "Generate":
                tokens = len(stub.Generate(req).token_ids)  # no timeout: Not INTERNAL (time_t overflow)
            else:
                tokens = sum(len(m.token_ids) for m in stub.GenerateStream(req))
        assert tokens == 3
    finally:
        running.stop(0)
        servicer.worker.stop()


def test_thread_initializer_runs_in_the_handler_threads():
    started: list[str] = []
    running = start_server(lambda server: [], host="127.0.0.1", port=0, workers=2, max_concurrent_rpcs=None,
                           max_message_bytes=1 << 20,
                           thread_initializer=lambda: started.append(threading.current_thread().name))
    try:
        running.set_serving(True)
        from ragcore.grpc_shell import wait_until_serving

        assert wait_until_serving(running.address, timeout_s=10.0)  # a Health.Check handled by a pool thread
        assert started and all(name.startswith("rpc") for name in started)  # Not the main thread
    finally:
        running.stop(0)
