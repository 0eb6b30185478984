"""bench.concurrency at a tiny size through its entry point: the services started as a user starts them
(tools.launcher, the worker at fp32), one client of ar for a two-second window over a two-prompt mix. The record
holds the cell with its requests and summary, the pooled figures per method, the targets and the plot."""

from __future__ import annotations

import json

import pytest

from bench import concurrency
from ragcore.model_files import ragserve_home

# The bench starts retrieval and a worker as processes (imports, model load, warm-up) and stops them: half a
# minute on 2 cores before any request, beyond the fast tier's budget.
pytestmark = [pytest.mark.model, pytest.mark.slow]

STDLIB = ragserve_home() / "datastores" / "stdlib"


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_concurrency_runs_the_cell(tmp_path, capsys):
    out = tmp_path / "conc.json"
    assert concurrency.main(["--levels", "1", "--methods", "ar", "--duration-s", "2", "--warmup-s", "0",
                             "--prompts", "1", "--max-new-tokens", "8", "--dtype", "fp32", "--datastore", str(STDLIB),
                             "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["prompts"] == 2 and res["skipped"] == []  # one code and one chat prompt; Not cut short
    [cell] = res["cells"]
    assert (cell["method"], cell["concurrency"], cell["round"]) == ("ar", 1, 0) and cell["stuck_clients"] == 0
    assert cell["records"] and cell["summary"]
    assert list(res["by_method"]) == ["ar"] and res["worker"]["dtype"] == "fp32"
    assert isinstance(res["targets"], dict) and res["targets"]
    assert (tmp_path / "conc.png").stat().st_size > 0
    assert res["machine"]["cpu"] and len(res["loadavg_end"]) == 3
    assert "wrote" in capsys.readouterr().out
