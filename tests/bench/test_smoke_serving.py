"""bench.serving at a tiny size through its entry point: one MT-Bench prompt with ar and pld for 8 tokens, against
an in-process worker (--target; the real model, fp32) and, in the slow tier, against the services started as a user
starts them (tools.launcher). The record holds the worker block, per-prompt rows for both methods, the summary, the
first-vs-warm request and the comparison with the AR step."""

from __future__ import annotations

import json

import pytest

from bench import serving
from ragcore.model_files import ragserve_home
from tests.bench.workers import in_process_worker

pytestmark = pytest.mark.model

STDLIB = ragserve_home() / "datastores" / "stdlib"
ARGS = ["--workloads", "mtbench", "--methods", "ar,pld", "--limit", "1", "--max-new-tokens", "8", "--repeats", "2"]


def check_record(res: dict) -> dict:
    assert list(res["workloads"]) == ["mtbench"]  # Not humaneval or docs-chat: only the workload asked for
    w = res["workloads"]["mtbench"]
    assert w["worker"]["dtype"] == "fp32"
    [row] = w["per_prompt"]
    assert set(row) == {"ar", "pld"}
    [cold] = w["cold_prefill"]  # the prompt's untimed prefill before its methods
    assert cold["ttft_ms"] > 0
    assert row["ar"]["server_prefill_ms"] == row["pld"]["server_prefill_ms"] == 0.0  # both met the prompt cached
    for name, r in row.items():
        assert r["tokens"] == 8 and r["finish"] and r["ms_per_token"] > 0 and r["ttft_ms"] > 0, name
        assert len(r["ms_runs"]) == 2 and r["ms"] in r["ms_runs"] and r["runs_identical"], name  # the median run
    noise = w["ar_against_itself"]  # ar's second run against its first
    assert noise["repeats"] == 2 and 0 < noise["worst"] <= noise["median"] <= 1.0
    assert set(w["summary"]) == {"ar", "pld"} and w["summary"]["ar"]["speedup_vs_ar"] == 1.0
    assert w["summary"]["pld"]["identical_to_ar"] == 1  # greedy fp32: pld reproduces ar
    assert w["first_request"]["method"] == "ar" and w["first_request"]["same_tokens"]
    assert w["ttft_by_prompt_length"] is None  # the TTFT study runs with humaneval only
    assert w["ar_vs_inprocess"]["server_ar_decode_ms_per_token"] > 0
    assert res["machine"]["cpu"] and len(res["loadavg_end"]) == 3
    return w


def test_serving_against_an_in_process_worker(tmp_path, capsys):
    out = tmp_path / "serving.json"
    with in_process_worker() as address:
        assert serving.main([*ARGS, "--target", address, "--json", str(out)]) == 0
    w = check_record(json.loads(out.read_text()))
    assert w["page_cache_warm_s"] == 0.0  # the target's datastore is its own: not read here
    assert "calibrated_ar_step_ms" not in w["ar_vs_inprocess"]  # an uncalibrated worker: nothing to hold it against
    assert "first request after start (ar)" in capsys.readouterr().out


# Starting and stopping retrieval and a worker as processes (imports, model load, warm-up) takes half a minute on
# 2 cores before any request, beyond the fast tier's budget.
@pytest.mark.slow
@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_serving_against_the_launched_services(tmp_path):
    out = tmp_path / "serving.json"
    assert serving.main([*ARGS, "--docs-datastore", str(STDLIB), "--dtype", "fp32", "--json", str(out)]) == 0
    w = check_record(json.loads(out.read_text()))
    assert w["worker"]["candidates"] and w["ar_vs_inprocess"]["calibrated_ar_step_ms"] > 0
