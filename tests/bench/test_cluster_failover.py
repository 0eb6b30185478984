"""loadtests.cluster_failover at smoke size: a real 6-node cluster, the retrieval service as a process, Draft
clients and the probe for a few seconds with a primary SIGKILLed; the JSON record says what the full run says."""

from __future__ import annotations

import json

import pytest

from loadtests.cluster_failover import back_after, main
from tools.redis_cluster import binaries


@pytest.mark.parametrize("rounds, killed_at, first, stable", [
    ([(1.0, 4, 0, 4), (2.0, 0, 4, 4), (3.0, 4, 0, 4), (4.0, 4, 0, 4)], 1.5, 1.5, 1.5),  # empty, then back
    ([(2.0, 4, 0, 4), (3.0, 2, 2, 4), (4.0, 4, 0, 4)], 1.5, 0.5, 2.5),  # back once, lost again: stable later
    ([(2.0, 0, 4, 4), (3.0, 3, 1, 4)], 1.5, None, None),  # Not back: some probes still empty
    ([(1.0, 4, 0, 4)], 1.5, None, None),  # nothing after the kill
])
def test_back_after(rounds, killed_at, first, stable):
    assert back_after(rounds, killed_at) == (first, stable)


@pytest.mark.slow
def test_smoke_run_writes_a_passing_record(tmp_path):
    if binaries() is None:
        pytest.skip("redis-server / redis-cli not found (`make system-packages`)")
    from retrieval_service.datastore.crest_build import build_store
    from tests.crest.conftest import corpus, datastore_of

    store = build_store(datastore_of([corpus()]), tmp_path / "s.crest", max_n=3, t=25, progress=False)["path"]
    out = tmp_path / "r.json"
    code = main(["--store", store, "--no-generation", "--duration", "7", "--kill-at", "1.5", "--clients", "1",
                 "--timeout-ms", "500", "--target-back-s", "5.5", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["callers"]["errors"] == 0 and r["probe"]["errors"] == 0  # Not UNAVAILABLE to a Draft caller
    assert r["probe"]["wrong"] == 0
    assert r["probe"]["empty_rounds_after_kill"] > 0  # the killed primary's drafts really went away...
    assert r["probe"]["back_stable_s"] is not None  # ...and came back
    assert r["degraded_metric"].get("unavailable", 0) > 0  # counted by the service
    assert code == 0 and r["passed"]
    for key in ("machine", "load_average", "cpu_class", "timeline", "phases"):
        assert key in r
