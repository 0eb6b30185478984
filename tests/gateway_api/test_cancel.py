"""A client that goes away cancels its worker call: the worker drops the request at its next step, long before
its 400 tokens would be done."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

LONG = {"max_tokens": 400, "ragserve": {"ignore_eos": True, "decoding": "ar"}}


def _idle(servicer_engine, gw_app, timeout_s: float = 20.0) -> float:
    """Seconds until the worker runs no request and the gateway counts none in flight."""
    t0 = time.monotonic()
    pool = gw_app.state.gateway.pool
    while servicer_engine.running or servicer_engine.depth() or any(w.inflight for w in pool.workers.values()):
        assert time.monotonic() - t0 < timeout_s, "the worker still runs the abandoned request"
        time.sleep(0.02)
    return time.monotonic() - t0


@pytest.fixture
def engine(worker_servicer):
    return worker_servicer.worker.engine


def test_stream_disconnect_cancels(gateway, model_id, engine):
    body = {"model": model_id, "prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                assert engine.running  # generating
                break  # leaving the block closes the connection
    _idle(engine, gateway.app)


def test_unary_disconnect_cancels(gateway, model_id, engine):
    body = {"model": model_id, "prompt": "Once upon a time", **LONG}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gateway.url + "/v1/completions", json=body, timeout=1.0)  # the client gives up after 1 s
    _idle(engine, gateway.app)


def test_a_stream_starts_when_the_worker_accepts_it(tm, model_id):
    """The HTTP status goes out once the worker has admitted the request (its initial metadata), not with its first
    token: a request queued behind another already has its 200 and headers, gets keep-alive comments while it
    waits, and is dropped from the queue when its client leaves. Not: a client that waits for the whole queue and
    prefill before it even knows the request was accepted; a silent connection a proxy would close; an abandoned
    request that still takes the slot."""
    from tests.gateway_api.conftest import start_gateway, start_worker

    running, servicer = start_worker(tm, max_batch=1)
    gw = start_gateway(running.address, sse_ping_s=0.05)
    engine = servicer.worker.engine
    body = {"model": model_id, "prompt": "Once upon a time", "stream": True, **LONG}
    other = {**body, "prompt": "Far away, long ago"}  # not the first's prompt: no first token from its prefix cache
    try:
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=30) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # it holds the only batch slot
            with httpx.stream("POST", gw.url + "/v1/completions", json=other, timeout=5) as queued:
                assert queued.status_code == 200
                assert engine.depth() == 1 and len(engine.running) == 1  # it waits for the slot
                assert next(line for line in queued.iter_lines() if line) == ": ping"  # a comment, no data yet
            t0 = time.monotonic()
            while engine.depth():  # its client left: the worker drops it from the queue
                assert time.monotonic() - t0 < 10, "the abandoned request is still queued"
                time.sleep(0.02)
            assert len(engine.running) == 1  # the first one goes on
            with httpx.stream("POST", gw.url + "/v1/completions", json=other, timeout=5) as second:
                assert second.status_code == 200 and engine.depth() == 1
                first.close()  # the slot frees: the second's tokens follow
                assert next(line for line in second.iter_lines() if line.startswith("data: "))
    finally:
        gw.stop()
        running.stop(0)
        servicer.worker.stop()
