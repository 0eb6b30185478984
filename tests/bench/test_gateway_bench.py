"""bench.gateway at a tiny size against the gateway tests' real worker and gateway: every figure present and sane,
the JSON written."""

from __future__ import annotations

import json

from bench import gateway as bench_gateway
from tests.gateway_api.conftest import _worker, gateway, tm, worker  # noqa: F401  (the shared fixtures)


def test_gateway_bench_smoke(worker, gateway, tmp_path):
    out = tmp_path / "gateway.json"
    assert bench_gateway.main(["--worker", worker.address, "--gateway", gateway.url, "--requests", "4",
                               "--streams", "2", "--stream-tokens", "4", "--ttft-pairs", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cpu"] and len(data["loadavg_start"]) == 3
    assert data["stream_ms"]["tokens_direct"] == data["stream_ms"]["tokens_gateway"] == 4  # Not cut short
    assert data["httpx2"]["stream_ms"]["tokens_gateway"] == 4
    for figures in (data, data["httpx2"]):  # the standard library's client, and the OpenAI SDK's transport
        for side in ("request_ms", "stream_ms", "ttft_ms", "ttft_cached_ms"):
            assert figures[side]["direct_p50"] > 0 and figures[side]["gateway_p50"] > 0
        assert set(figures["targets"]) == {"request_overhead_ms", "stream_overhead_ms_per_token", "ttft_ratio"}
        assert all(isinstance(t["met"], bool) for t in figures["targets"].values())
    assert data["httpx2"]["ttft_ms"]["direct_p50"] == data["ttft_ms"]["direct_p50"]  # one series of direct calls
