"""bench.serving.closed_loop: the benchmarks' concurrent clients (bench.knnlm / bench.ralm --clients)."""

from __future__ import annotations

import threading
import time

import pytest

from bench.serving import closed_loop


@pytest.mark.parametrize("n_requests, clients, most_at_once", [
    (8, 4, 4),   # 2 N requests from N clients
    (3, 8, 3),   # more clients than requests: the spare ones send nothing
    (5, 1, 1),   # one client: one request at a time
    (0, 2, 0),
])
def test_every_request_once_and_at_most_clients_at_once(n_requests, clients, most_at_once):
    lock, active, peak = threading.Lock(), [0], [0]

    def one(i: int) -> int:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)  # long enough for the other clients' requests to overlap this one
        with lock:
            active[0] -= 1
        return i

    out, wall = closed_loop(n_requests, clients, one)
    assert sorted(out) == list(range(n_requests))  # Not a request twice or dropped
    assert peak[0] <= clients
    assert peak[0] == most_at_once
    assert wall >= 0.0


def test_a_failed_request_raises_in_the_caller_and_stops_the_clients():
    calls = []

    def one(i: int) -> int:
        calls.append(i)
        if i == 1:
            raise RuntimeError("request 1 failed")
        time.sleep(0.01)
        return i

    with pytest.raises(RuntimeError, match="request 1 failed"):
        closed_loop(100, 2, one)
    assert len(calls) < 100  # Not the whole run after the failure


def test_ralm_clients_need_the_served_path(tmp_path):
    from bench.ralm import main

    with pytest.raises(SystemExit, match="--clients needs --serve"):
        main(["--clients", "4", "--json", str(tmp_path / "r.json")])
