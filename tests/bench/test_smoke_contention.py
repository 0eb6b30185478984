"""bench.contention at a tiny size through its entry point: each of the three worker settings started as a user
starts it (tools.launcher), then one phase without and one beside a busy process, one 8-token ar request each.
The record holds every setting's worker block and both phases' figures."""

from __future__ import annotations

import json
import os

import pytest

from bench import contention
from ragcore.model_files import ragserve_home

# Three start-ups of retrieval and a worker as processes (one per thread setting, the point of the bench): over
# a minute on 2 cores, beyond the fast tier's budget.
pytestmark = [pytest.mark.model, pytest.mark.slow]

STDLIB = ragserve_home() / "datastores" / "stdlib"


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_contention_runs_every_setting(tmp_path, capsys):
    out = tmp_path / "contention.json"
    contention.main(["--tokens", "8", "--rounds", "1", "--phases", "0,1", "--busy-s", "30", "--datastore", str(STDLIB),
                     "--json", str(out)])
    res = json.loads(out.read_text())
    cores = len(os.sched_getaffinity(0))
    assert [s["generation_flags"] for s in res["settings"]] == [["--threads", str(cores)], ["--threads", "1"], []]
    for s in res["settings"]:
        assert [p["busy_processes"] for p in s["phases"]] == [0, 1]
        for p in s["phases"]:
            assert len(p["ms_per_token"]) == 1 and p["median_ms_per_token"] > 0
        assert s["worker"]["threads"] >= 1 and s["worker"]["dtype"]
    assert res["settings"][1]["worker"]["threads"] == 1  # Not the measured count: the fixed flag wins
    assert res["tokens"] == 8 and res["rounds"] == 1
    assert res["machine"]["cpu"] and len(res["machine"]["loadavg_end"]) == 3
    assert "adaptive (default flags)" in capsys.readouterr().out
