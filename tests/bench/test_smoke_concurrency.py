"""bench.concurrency at a tiny size through its entry point: one client of ar for a two-second window over a
two-prompt mix, against an in-process worker (--target; the real model, fp32) and, in the slow tier, against the
services started as a user starts them (tools.launcher). The record holds the cell with its requests and summary,
the pooled figures per method, the targets and the plot."""

from __future__ import annotations

import json

import pytest

from bench import concurrency
from ragcore.model_files import ragserve_home
from tests.bench.workers import in_process_worker

pytestmark = pytest.mark.model

STDLIB = ragserve_home() / "datastores" / "stdlib"
ARGS = ["--levels", "1", "--methods", "ar", "--duration-s", "2", "--warmup-s", "0", "--prompts", "1",
        "--max-new-tokens", "8"]


def check_record(res: dict, out_dir) -> dict:
    assert res["settings"]["prompts"] == 2 and res["skipped"] == []  # one code and one chat prompt; Not cut short
    [cell] = res["cells"]
    assert (cell["method"], cell["concurrency"], cell["round"]) == ("ar", 1, 0) and cell["stuck_clients"] == 0
    assert cell["records"] and cell["summary"]
    assert list(res["by_method"]) == ["ar"] and res["worker"]["dtype"] == "fp32"
    assert isinstance(res["targets"], dict) and res["targets"]
    assert (out_dir / "conc.png").stat().st_size > 0
    assert res["machine"]["cpu"] and len(res["loadavg_end"]) == 3
    return cell


def test_concurrency_against_an_in_process_worker(tmp_path, capsys):
    out = tmp_path / "conc.json"
    with in_process_worker() as address:
        assert concurrency.main([*ARGS, "--target", address, "--json", str(out)]) == 0
    cell = check_record(json.loads(out.read_text()), tmp_path)
    # No service processes of its own to account: Not a 0 ms/token that reads as a free worker.
    assert cell["cpu_cores_used"] == {} and cell["worker_cpu_ms_per_token"] is None
    assert "wrote" in capsys.readouterr().out


# Starting and stopping retrieval and a worker as processes (imports, model load, warm-up) takes half a minute on
# 2 cores before any request, beyond the fast tier's budget.
@pytest.mark.slow
@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_concurrency_against_the_launched_services(tmp_path):
    out = tmp_path / "conc.json"
    assert concurrency.main([*ARGS, "--dtype", "fp32", "--datastore", str(STDLIB), "--json", str(out)]) == 0
    cell = check_record(json.loads(out.read_text()), tmp_path)
    assert cell["cpu_cores_used"]["generation"] > 0 and cell["worker_cpu_ms_per_token"] > 0
