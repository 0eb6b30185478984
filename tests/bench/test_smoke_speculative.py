"""bench.speculative at a tiny size through its entry point: our ar and pld loops on one HumanEval prompt (8 new
tokens, fp32, one thread). Both methods run, every output is compared with ar's, and the record holds the summary
and per-prompt fields the docs' tables read."""

from __future__ import annotations

import json

import pytest

from bench import speculative

pytestmark = pytest.mark.model


def test_speculative_runs_every_method(tmp_path, capsys):
    from ragcore.model_files import default_model_dir, is_model_dir

    if not is_model_dir(default_model_dir()):
        pytest.skip("default model not prepared (make model)")
    out = tmp_path / "spec.json"
    speculative.main(["--methods", "ar,pld", "--limit", "1", "--max-new-tokens", "8", "--ignore-eos",
                      "--dtype", "fp32", "--threads", "1", "--json", str(out)])
    res = json.loads(out.read_text())
    assert list(res["methods"]) == ["ar", "pld"]  # Not hf-ar: the default list is not what ran
    for name in ("ar", "pld"):
        m = res["methods"][name]
        assert m["n"] == 1 and m["tokens"] == 8  # --ignore-eos: every token asked for
        assert m["identical"] == 1 and m["divergences"] == 0  # greedy pld reproduces ar in fp32
        assert m["tokens_per_s"] > 0 and m["verify_ms_per_step"] > 0 and m["speedup_vs_ar"] > 0
        [rec] = res["per_prompt"][name]
        assert rec["identical"] and rec["stats"]["decoding"] == name and "output" not in rec
    assert res["methods"]["ar"]["draft_tokens_proposed"] == 0 and res["methods"]["pld"]["mean_accepted_length"] >= 1
    assert res["dtype"] == "fp32" and res["torch_threads"] == 1 and "tree_cost" not in res
    assert res["machine"]["cpu"] and len(res["machine"]["loadavg_after"]) == 3
    assert "humaneval, fp32, greedy, 8 new tokens, 1 prompts" in capsys.readouterr().out
