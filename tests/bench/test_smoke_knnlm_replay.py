"""bench.knnlm_replay at a tiny size through its entry point: a datastore built with the real model from a few
stdlib docstrings, two held-out prompts, the baseline's trajectories through the real retrieval service (the bench
starts it as a process), then every replayed setting and the cost model written to the record."""

from __future__ import annotations

import argparse
import json
import textwrap

import numpy as np
import pytest

from bench import knnlm_replay
from generation_service.knnlm.options import KnnLmOptions
from tests.conftest import real_model

pytestmark = pytest.mark.model


def test_knnlm_replay_writes_every_setting(tmp_path, monkeypatch, capsys):
    from tools.knn_build import build_datastore, save_held_out

    tm = real_model("fp32")
    docs = [(f"doc{i}", np.asarray(tm.tokenizer(t, add_special_tokens=False)["input_ids"][:160], np.int32))
            for i, t in enumerate([json.__doc__, textwrap.TextWrapper.__doc__, argparse.__doc__])]
    # The bench searches exactly (edr): no HNSW graph, whose build would be most of the run.
    store = build_datastore(tmp_path / "knn", docs, tm, window=64, overlap=16, hnsw=False, progress=False)
    held = np.asarray(tm.tokenizer(textwrap.dedent.__doc__ * 2, add_special_tokens=False)["input_ids"], np.int32)
    save_held_out(store, [("held0", held[:40]), ("held1", held[40:80]), ("short", held[:8])])
    monkeypatch.chdir(tmp_path)  # the retrieval process logs under ./var
    out = tmp_path / "replay.json"
    knnlm_replay.main(["--datastore", str(store), "--prompts", "2", "--prompt-tokens", "16", "--new-tokens", "6",
                       "--k", "16", "--strides", "2,4", "--capacities", "64", "--dtype", "fp32",
                       "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["setup"]["prompts"] == 2  # Not the 8-token document: shorter than --prompt-tokens
    assert res["model_dtype"] == "fp32" and res["setup"]["k"] == 16 and res["setup"]["datastore_entries"] > 0
    assert set(res["costs"]) == {"pass_s", "search_1_s", "search_2_s", "search_4_s"}
    assert all(v > 0 for v in res["costs"].values())
    default = KnnLmOptions().cache_capacity
    assert [(r["stride"], r["cache_capacity"]) for r in res["replays"]] == [(2, default), (4, default), (4, 64)]
    for r in res["replays"]:
        assert r["tokens"] == 2 * (6 - 1)  # every baseline step after each prompt's first, replayed once
        assert 0.0 <= r["guess_accuracy"] <= 1.0 and r["modelled_x"] > 0 and r["ceiling_x"] >= r["modelled_x"]
    assert res["machine"]["cpu"] and len(res["loadavg_end"]) == 3
    assert "costs (median s)" in capsys.readouterr().out
