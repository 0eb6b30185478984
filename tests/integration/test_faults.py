"""Retrieval down, overload, cancellation and deadlines: requests degrade or are refused cleanly, never wrong."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from generation_service.client import GenerationClient
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server as build_retrieval
from tests.integration.conftest import PROMPTS, start_generation
from tools.launcher import free_port

pytestmark = pytest.mark.model
N_TOKENS = 24


def test_retrieval_down_degrades_to_ar_and_recovers(tm, datastore, client):
    port = free_port()
    cfg = RetrievalConfig(port=port, workers=2)
    retrieval = build_retrieval(cfg, datastore=datastore)
    # A generous draft deadline (as the shared `generation` fixture has): with the default 50 ms a loaded CI box
    # degrades a step of the healthy phase now and then. A stopped service still fails fast (connection refused).
    running, servicer = start_generation(tm, retrieval.address, retry_after_s=0.2, draft_timeout_ms=5000)
    try:
        with GenerationClient(running.address) as c:
            want = client.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="ar", ignore_eos=True, timeout=300)
            ok = c.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="rest", ignore_eos=True, timeout=300)
            assert not ok.stats.degraded
            retrieval.stop(0)
            down = c.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="rest", ignore_eos=True, timeout=300)
            assert list(down.token_ids) == list(want.token_ids)  # Not a failed or different answer
            assert down.stats.degraded and down.stats.degraded_steps > 0
            assert down.stats.degraded_reason  # says why
            retrieval = build_retrieval(cfg, datastore=datastore)  # back on the same port
            for _attempt in range(20):  # the channel reconnects within its (short) backoff
                back = c.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="rest", ignore_eos=True, timeout=300)
                assert list(back.token_ids) == list(want.token_ids)
                if not back.stats.degraded:
                    break
                time.sleep(0.2)
            assert not back.stats.degraded, back.stats.degraded_reason
            assert back.stats.draft_tokens_accepted > 0  # drafting resumed
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)


def test_full_queue_answers_resource_exhausted(tm, retrieval):
    running, servicer = start_generation(tm, retrieval.address, queue_size=1, max_batch=1)
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def call() -> None:
        with GenerationClient(running.address) as c:
            try:
                c.generate(PROMPTS[1], max_new_tokens=48, decoding="ar", ignore_eos=True, timeout=300)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
        with lock:
            codes.append(code)

    try:
        threads = [threading.Thread(target=call) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        running.stop(0)
        servicer.worker.stop()
    # One running + one queued fit; the rest are refused instead of piling up.
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
    assert codes.count(grpc.StatusCode.OK) >= 2
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}  # Not INTERNAL


def test_cancelled_stream_frees_the_worker(client):
    stream = client.stream(PROMPTS[0], max_new_tokens=2000, decoding="ar", ignore_eos=True, timeout=600)
    first = next(stream)
    assert first.token_ids
    stream.cancel()
    # A 2000-token request would hold the worker for minutes; after cancel the next one runs at once.
    t0 = time.monotonic()
    reply = client.generate(PROMPTS[1], max_new_tokens=4, decoding="ar", timeout=120)
    assert reply.usage.completion_tokens >= 1
    assert time.monotonic() - t0 < 60


def test_deadline_exceeded_is_reported_and_work_stops(client):
    with pytest.raises(grpc.RpcError) as err:
        client.generate(PROMPTS[0], max_new_tokens=2000, decoding="ar", ignore_eos=True, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reply = client.generate(PROMPTS[1], max_new_tokens=4, decoding="ar", timeout=120)
    assert reply.usage.completion_tokens >= 1


def _handled(method: str, code: str) -> float:
    from generation_service import metrics

    return metrics.get().handled.labels("ragserve.v1.GenerationService", method, "unary" if method == "Generate"
                                        else "server_stream", code)._value.get()


def _until(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.parametrize("how, code", [
    ("deadline", "DEADLINE_EXCEEDED"),  # Not CANCELLED: the deadline passed while it was queued
    ("cancel", "CANCELLED"),
])
def test_queued_work_leaves_the_queue_when_its_caller_does(tm, retrieval, how, code):
    """One request runs (max_batch 1) and another waits in the queue. When the waiting one's deadline passes or its
    caller cancels, it leaves the queue at once (Not when the batch slot frees) and is counted with its code."""
    running, servicer = start_generation(tm, retrieval.address, queue_size=2, max_batch=1)
    engine = servicer.worker.engine
    method = "Generate" if how == "deadline" else "GenerateStream"
    before = _handled(method, code)
    try:
        with GenerationClient(running.address) as c:
            long = c.stream(PROMPTS[0], max_new_tokens=2000, decoding="ar", ignore_eos=True, timeout=600)
            assert next(long).token_ids  # running
            if how == "deadline":
                with pytest.raises(grpc.RpcError) as err:
                    c.generate(PROMPTS[1], max_new_tokens=4, decoding="ar", timeout=1.0)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            else:
                queued = c.stream(PROMPTS[1], max_new_tokens=4, decoding="ar", timeout=600)
                assert _until(lambda: engine.jobs.qsize() == 1)
                queued.cancel()
            assert _until(lambda: engine.jobs.qsize() == 0, 5.0)  # out of the queue; Not held behind `long`
            assert _until(lambda: _handled(method, code) - before == 1, 5.0), code
            assert len(engine.running) == 1  # the long request still runs: the slot never freed
            long.cancel()
    finally:
        running.stop(0)
        servicer.worker.stop()


def test_a_restarted_retrieval_service_drafts_again_once_the_channel_reconnects(tm, datastore):
    """A stopped retrieval service is skipped (its channel leaves READY); once the restarted service's channel has
    reconnected it is back at once (Not after retry_after_s, here a minute: requests meanwhile ran fully degraded)."""
    port = free_port()
    cfg = RetrievalConfig(port=port, workers=2)
    retrieval = build_retrieval(cfg, datastore=datastore)
    running, servicer = start_generation(tm, retrieval.address, retry_after_s=60.0, draft_timeout_ms=5000)
    replica = servicer.worker.link.client.replicas[0]
    try:
        with GenerationClient(running.address) as c:
            assert not c.generate(PROMPTS[0], max_new_tokens=8, decoding="rest", timeout=300).stats.degraded
            retrieval.stop(0)
            # 32 tokens: a request that starts by skipping the remote source (its drafts were useless) still asks it
            # again in the background after the skipped stretch, and that failed ask must say degraded.
            down = c.generate(PROMPTS[0], max_new_tokens=32, decoding="rest", timeout=300).stats
            assert down.degraded, down
            assert not replica.up(time.monotonic())  # skipped while it is down
            retrieval = build_retrieval(cfg, datastore=datastore)  # back on the same port
            end = time.monotonic() + 20  # the channel's reconnect backoff is at most 1 s; a loaded box is slow
            while not replica.up(time.monotonic()) and time.monotonic() < end:
                time.sleep(0.05)
            assert replica.up(time.monotonic())  # Not skipped for the rest of the minute
            back = c.generate(PROMPTS[0], max_new_tokens=8, decoding="rest", timeout=300)
            assert not back.stats.degraded, back.stats.degraded_reason
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)


@pytest.mark.parametrize("field", ["knnlm", "rag"])
def test_a_mode_this_worker_has_no_backend_for_is_a_failed_precondition(tm, retrieval, field):
    from proto import generation_pb2

    running, servicer = start_generation(tm, retrieval.address, kb_target="")
    try:
        with GenerationClient(running.address) as c:
            request = generation_pb2.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=4)
            if field == "knnlm":
                request.knnlm.k = 8
            else:
                request.rag.retriever = "edr"
            with pytest.raises(grpc.RpcError) as err:
                c.stub.Generate(request, timeout=60)
    finally:
        running.stop(0)
        servicer.worker.stop()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # Not INVALID_ARGUMENT: the request is fine
    assert "no " in err.value.details()
