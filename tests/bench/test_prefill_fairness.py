"""bench.prefill_fairness at a tiny size against an in-process worker: every cell runs and the JSON holds the
figures the issue's targets are read from."""

from __future__ import annotations

import json

import pytest

from tests.bench.workers import in_process_worker

pytestmark = pytest.mark.model


def test_prefill_fairness_smoke(tmp_path):
    from bench.prefill_fairness import main

    out = tmp_path / "pf.json"
    with in_process_worker(prefill_chunk=64, default_decoding="ar") as address:
        assert main(["--target", address, "--prompt-tokens", "200", "--streams", "2", "--stream-tokens", "12",
                     "--rounds", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["order"] for r in result["rounds"]] == [["streams", "long", "loaded"], ["loaded", "long", "streams"]]
    for r in result["rounds"]:
        assert r["solo_ttft_s"] > 0 and r["loaded_ttft_s"] > 0
        assert r["streams_alone"]["tokens"] > 0 and not r["streams_alone"]["errors"]  # Not an empty cell
    pooled = result["pooled"]
    assert pooled["ttft_ratio"] > 0 and set(pooled["targets"]) == {"itl_p95_ratio_le_3", "ttft_ratio_le_1_5"}
    assert {"cpu", "cpu_flags", "code"} <= set(result["machine"]) and len(result["loadavg_end"]) == 3
