"""make soak at a tiny size (~10 s) against the in-process services: every kind of call runs, the expected
failures are expected, greedy replies repeat exactly, and the report says so."""

from __future__ import annotations

import json

import pytest

from loadtests.soak import EXPECTED, Soak, drift_pct, main, summarize

pytestmark = pytest.mark.model


@pytest.mark.parametrize("first, last, expected", [
    (100.0, 104.0, 4.0),
    (100.0, 90.0, -10.0),
    (None, 5.0, None),  # nothing measured after the warm-up: no figure, Not 0
])
def test_drift(first, last, expected):
    assert drift_pct(first, last) == expected


def test_a_different_greedy_reply_or_an_unexpected_code_fails_the_run():
    soak = Soak("127.0.0.1:1", "127.0.0.1:1", 1.0, 4, 1)
    soak.greedy_reply(0, [1, 2], 0.1)
    soak.greedy_reply(0, [1, 2], 0.1)
    soak.record("bad", "INVALID_ARGUMENT")
    assert summarize(soak, [], 60.0, 5.0)["ok"]
    soak.greedy_reply(0, [1, 3], 0.1)  # Not the first reply's tokens
    assert not summarize(soak, [], 60.0, 5.0)["ok"]
    soak.greedy["different"] = 0
    soak.record("ar", "INTERNAL")
    r = summarize(soak, [], 60.0, 5.0)
    assert not r["ok"] and r["unexpected_errors"] == 1


@pytest.mark.slow
def test_soak_smoke(tmp_path, tm, datastore):
    from retrieval_service.config import RetrievalConfig
    from retrieval_service.server import build_server
    from tests.integration.conftest import start_generation

    retrieval = build_server(RetrievalConfig(port=0, workers=2), datastore=datastore)
    running, servicer = start_generation(tm, retrieval.address)
    out = tmp_path / "soak.json"
    try:
        code = main(["--generation", running.address, "--retrieval", retrieval.address, "--minutes", "0.15",
                     "--clients", "2", "--max-new-tokens", "4", "--prompts", "1", "--sample-s", "2",
                     "--json", str(out)])
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)
    r = json.loads(out.read_text())
    assert code == 0 and r["ok"], r
    assert r["unexpected_errors"] == 0 and r["greedy_outputs"].get("identical", 0) >= 2
    for kind in ("ar", "rest", "draft", "health", "bad"):
        assert kind in r["by_kind"], kind
    assert set(r["by_kind"]["bad"]) <= EXPECTED["bad"]
    assert len(r["rss_mb"]) >= 2

@pytest.mark.parametrize("rss, ok", [
    ([(20.0, 1000.0), (60.0, 1040.0)], True),   # +4 %: within the bound
    ([(20.0, 1000.0), (60.0, 1100.0)], False),  # +10 %: memory grew, Not a pass
    ([(20.0, 1000.0), (60.0, 900.0)], True),    # -10 %: memory given back, Not a failure
])
def test_only_rss_growth_fails_the_run(rss, ok):
    soak = Soak("127.0.0.1:1", "127.0.0.1:1", 1.0, 4, 1)
    soak.greedy_reply(0, [1, 2], 0.1)
    assert summarize(soak, rss, 60.0, 5.0)["ok"] is ok
