"""bench.online_learning through its entry point at a tiny size: one MT-Bench prompt, both arms in both passes on
the real model over the stdlib datastore. The record must show what learning is for: the outputs of both arms
equal (drafting never changes greedy output), the learned shard holding the first pass's outputs, and the second
pass, which repeats them, drafting them from it."""

from __future__ import annotations

import json

import pytest

from bench import online_learning
from ragcore.model_files import default_model_dir, is_model_dir, ragserve_home
from tests.bench.threads import torch_threads

pytestmark = pytest.mark.model

STDLIB = ragserve_home() / "datastores" / "stdlib"
NEW_TOKENS = 12


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared (make datastore)")
def test_online_learning_main_writes_a_record(tmp_path):
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    out = tmp_path / "online.json"
    with torch_threads():
        online_learning.main(["--workload", "mtbench", "--limit", "1", "--max-new-tokens", str(NEW_TOKENS),
                              "--dtype", "fp32", "--threads", "1", "--datastore", str(STDLIB), "--json", str(out)])
    rec = json.loads(out.read_text())
    assert (rec["limit"], rec["max_new_tokens"], rec["dtype"]) == (1, NEW_TOKENS, "fp32")
    assert set(rec["passes"]) == {"1", "2"}
    for p in rec["passes"].values():
        for arm in ("learning-on", "learning-off"):
            assert p[arm]["n"] == 1 and 1 <= p[arm]["tokens"] <= NEW_TOKENS + 1  # + the final EOS, if it stopped
            assert p[arm]["identical_across_arms"] == 1  # Not 0: learning changed a greedy output
            assert p[arm]["mean_accepted_length"] >= 1.0
    assert rec["learned_tokens"] > 0 and rec["datastore_tokens"] > 0
    second = rec["passes"]["2"]  # a repeat of pass 1: the learned output drafts itself
    assert second["learning-on"]["mean_accepted_length"] > second["learning-off"]["mean_accepted_length"]
    assert second["on_vs_off"]["mean_accepted_length"] > 1.0  # Not a learner nobody drafts from
    assert rec["command"].startswith("python -m bench.online_learning") and rec["machine"]["cpus"]
