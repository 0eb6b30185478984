"""bench/int8_quality.py at a tiny size: two windows of the docs corpus through q4_1 and q4_1_i8, the record written."""

import json

import pytest

from bench import int8_quality

pytestmark = pytest.mark.model


def test_smoke_writes_the_record(tmp_path, capsys):
    from ragcore.model_files import default_model_dir, is_model_dir

    if not is_model_dir(default_model_dir()):
        pytest.skip("default model not prepared (make model)")
    out = tmp_path / "q.json"
    int8_quality.main(["--tokens", "64", "--window", "32", "--stride", "50", "--json", str(out)])
    res = json.loads(out.read_text())
    assert res["tokens"] == 64 and res["windows"] == 2
    for fmt in ("q4_1", "q4_1_i8"):
        assert 1.0 < res["results"][fmt]["perplexity"] < 1e4  # Not 0, inf or NaN
    assert res["results"]["q4_1"]["nll"] != res["results"]["q4_1_i8"]["nll"]  # two formats, not one twice
    assert 0.5 < res["perplexity_ratio"] < 2.0 and 0.0 <= res["greedy_agreement"] <= 1.0
    assert res["machine"]["cpu"] and "load_before" in res
    assert "q4_1_i8 / q4_1" in capsys.readouterr().out
