"""bench.draft_simulation through its entry point at a tiny size: the real model's greedy output of one HumanEval
prompt (generated into a cache of this test's own), replayed against the stdlib datastore for every source and
budget of the table, REST's first-k sampling and the whole --tune sweep (the experimental merges read the
datastore's kernels directly: the first thing to break when they change)."""

from __future__ import annotations

import json

import pytest

from bench import draft_simulation
from ragcore.model_files import default_model_dir, is_model_dir, ragserve_home
from tests.bench.threads import torch_threads

pytestmark = pytest.mark.model

STDLIB = ragserve_home() / "datastores" / "stdlib"
NEW_TOKENS = 12


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_draft_simulation_main_writes_a_record(tmp_path, monkeypatch):
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    monkeypatch.setattr(draft_simulation, "_CACHE", tmp_path / "cache")  # not the checkout's var/
    out = tmp_path / "sim.json"
    # fp32: transformers' bf16 decode costs seconds per token on a CPU without bf16 matmuls.
    with torch_threads(1):
        draft_simulation.main(["--prompts", "1", "--new-tokens", str(NEW_TOKENS), "--dtype", "fp32", "--datastore",
                               str(STDLIB), "--tune", "--json", str(out)])
    rec = json.loads(out.read_text())
    cached = json.loads(next((tmp_path / "cache").glob(f"humaneval_greedy_*_{NEW_TOKENS}_fp32.json")).read_text())
    assert len(cached) == 1 and 1 <= len(cached[0]["output_ids"]) <= NEW_TOKENS
    tokens = len(cached[0]["output_ids"])

    assert (rec["prompts"], rec["new_tokens"], rec["dtype"]) == (1, NEW_TOKENS, "fp32")
    assert rec["datastore"] == str(STDLIB) and rec["datastore_tokens"] > 0
    cells = {f"{s}/{b}" for s in draft_simulation.SOURCES for b in draft_simulation.BUDGETS}
    assert set(rec["defaults"]) == cells  # Not a source or budget left out
    for cell in rec["defaults"].values():
        assert cell["tokens"] == tokens and 1 <= cell["steps"] <= tokens
        assert cell["M"] == pytest.approx(tokens / cell["steps"])  # M counts every output token once
    assert set(rec["datastore_first_k_sampling"]) == {"M16", "M32", "M64"}
    assert all(1.0 <= m <= tokens for m in rec["datastore_first_k_sampling"].values())
    labels = [r["config"] for r in rec["tuning"]]
    assert len(labels) == len(set(labels)) > 20  # every sweep ran, each config once
    assert any(lb.startswith("raw counts") for lb in labels) and any("(L/16)^" in lb for lb in labels)
    assert all(1.0 <= r["M32"] <= tokens and 1.0 <= r["M64"] <= tokens for r in rec["tuning"])
