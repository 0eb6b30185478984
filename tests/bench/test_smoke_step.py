"""bench.step at a tiny size through its entry point: the lean fp32 forward's real passes at q = 1 and 2, solo and
batched, over a short cached prefix, without the llama.cpp anchor. The record holds every cell's samples and the
fields print_table and the docs read."""

from __future__ import annotations

import json

import pytest

from bench import step

pytestmark = pytest.mark.model


def test_step_writes_every_cell(tmp_path, monkeypatch, capsys):
    from ragcore.model_files import default_model_dir, is_model_dir

    if not is_model_dir(default_model_dir()):
        pytest.skip("default model not prepared (make model)")
    # Prefilling nine caches of the real prefix is most of a tiny run; the passes' code is the same at any length.
    monkeypatch.setattr(step, "PREFIX", 16)
    monkeypatch.setattr(step, "BATCH", 2)
    out = tmp_path / "step.json"
    step.main(["--formats", "fp32", "--forwards", "lean", "--rows", "1,2", "--reps", "1", "--threads", "1",
               "--no-anchor", "--json", str(out)])
    res = json.loads(out.read_text())
    assert list(res["results"]) == ["lean/fp32"]  # Not every format: only the one asked for
    cells = res["results"]["lean/fp32"]
    assert set(cells) == {"batch1", "batch2", "median_vs_first_row_count"}
    for batch in ("batch1", "batch2"):
        assert set(cells[batch]) == {"1", "2"}
        for q in ("1", "2"):
            assert len(cells[batch][q]["samples"]) == 1  # the warm-up round is not recorded
            assert 0 < cells[batch][q]["min_ms"] <= cells[batch][q]["median_ms"]
    assert cells["median_vs_first_row_count"]["1"] == 1.0
    assert res["llama_cpp"] == {f: {"status": "skipped (--no-anchor)"} for f in ("q4_1", "fp32")}
    assert res["rows"] == [1, 2] and res["reps"] == 1 and res["threads"] == 1 and res["prefix_tokens"] == 16
    assert res["machine"]["cpu"] and res["q4_kernel_isa"] and res["kernel_level"] == "this CPU's best"
    assert res["command"].startswith("python -m bench.step --formats fp32 ")  # what regenerates the record
    assert "lean/fp32 x1" in capsys.readouterr().out
