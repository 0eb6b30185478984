"""bench.serving at a tiny size through its entry point: the services started as a user starts them
(tools.launcher, the worker at fp32), one MT-Bench prompt with ar and pld for 8 tokens. The record holds the worker's
calibration block, per-prompt rows for both methods, the summary, the first-vs-warm request and the comparison with
the calibrated AR step."""

from __future__ import annotations

import json

import pytest

from bench import serving
from ragcore.model_files import ragserve_home

# The bench starts retrieval and a worker as processes (imports, model load, warm-up) and stops them: half a
# minute on 2 cores before any request, beyond the fast tier's budget.
pytestmark = [pytest.mark.model, pytest.mark.slow]

STDLIB = ragserve_home() / "datastores" / "stdlib"


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_serving_runs_every_method(tmp_path, capsys):
    out = tmp_path / "serving.json"
    assert serving.main(["--workloads", "mtbench", "--methods", "ar,pld", "--limit", "1", "--max-new-tokens", "8",
                         "--docs-datastore", str(STDLIB), "--dtype", "fp32", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res["workloads"]) == ["mtbench"]  # Not humaneval or docs-chat: only the workload asked for
    w = res["workloads"]["mtbench"]
    assert w["worker"]["dtype"] == "fp32" and w["worker"]["candidates"]
    [row] = w["per_prompt"]
    assert set(row) == {"ar", "pld"}
    for name, r in row.items():
        assert r["tokens"] > 0 and r["finish"] and r["ms_per_token"] > 0 and r["ttft_ms"] > 0, name
    assert set(w["summary"]) == {"ar", "pld"} and w["summary"]["ar"]["speedup_vs_ar"] == 1.0
    assert w["summary"]["pld"]["identical_to_ar"] == 1  # greedy fp32: pld reproduces ar
    assert w["first_request"]["method"] == "ar" and w["first_request"]["same_tokens"]
    assert w["ttft_by_prompt_length"] is None  # the TTFT study runs with humaneval only
    assert w["ar_vs_inprocess"]["calibrated_ar_step_ms"] > 0
    assert res["machine"]["cpu"] and len(res["loadavg_end"]) == 3
    assert "first request after start (ar)" in capsys.readouterr().out
