"""bench.crest through its entry point at a tiny size: one HumanEval prompt's greedy output from the real model, a
code datastore built here from a few stdlib modules, a REST sample and the full store against CREST stores at the
sample's size (combined and single-n), the lookup latency of the embedded store against Redis (a redis-server of
the bench's own), the real tree-verified check of the simulated M, and the plot. Every store must have been
simulated, and the real check must reproduce the AR output exactly (lossless)."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from bench import crest
from ragcore.model_files import default_model_dir, is_model_dir, load_tokenizer, tokenizer_identity
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
from tests.bench.threads import torch_threads

pytestmark = pytest.mark.model

# Real code nobody here wrote, small enough to count and build stores from in a moment.
STDLIB_PARTS = ("json", "textwrap.py", "functools.py", "heapq.py", "bisect.py")
MAX_N = 3
NEW_TOKENS = 8


def code_datastore(path: Path) -> SuffixArrayDatastore:
    tokenizer = load_tokenizer(default_model_dir())
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for part in STDLIB_PARTS for f in (sorted((root / part).rglob("*.py")) if (root / part).is_dir()
                                                  else [root / part])]
    docs = [np.asarray(tokenizer(f.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"], np.int32)
            for f in files]
    return SuffixArrayDatastore.build(docs, path, vocab_size=len(tokenizer), tokenizer_id=tokenizer_identity(tokenizer),
                                      progress=False)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not found (make system-packages)")
def test_crest_main_writes_a_record(tmp_path):
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    ds = code_datastore(tmp_path / "code")
    out, plot = tmp_path / "crest.json", tmp_path / "crest.png"
    with torch_threads():
        assert crest.main(["--workload", "humaneval", "--json", str(out), "--plot", str(plot), "--limit", "1",
                           "--max-new-tokens", str(NEW_TOKENS), "--datastore", str(ds.path), "--max-n", str(MAX_N),
                           "--fractions", "0.5,1", "--crest-max-fraction", "0.5", "--crest-extra", "",
                           "--single-max-fraction", "0.5", "--dtype", "fp32", "--threads", "1", "--real-prompts",
                           "1", "--real-max-new-tokens", str(NEW_TOKENS), "--cache", str(tmp_path / "cache")]) == 0
    rec = json.loads(out.read_text())
    assert plot.stat().st_size > 0
    assert (rec["prompts"], rec["max_new_tokens"], rec["dtype"]) == (1, NEW_TOKENS, "fp32")
    assert rec["corpus"]["tokens"] == ds.num_tokens and rec["crest_build"]["max_n"] == MAX_N
    rest = sorted(p["fraction"] for p in rec["points"] if p["store"] == "rest")
    assert rest == [0.5, 1.0]  # Not a sample left out
    kinds = {(p["strategy"], p["n"]) for p in rec["points"] if p["store"] == "crest"}
    assert ("combined", None) in kinds and {n for s, n in kinds if s == "single"} == set(range(1, MAX_N + 1))
    for p in rec["points"]:
        assert p["bytes"] > 0 and p["steps"] >= 1 and 1.0 <= p["mean_accepted_length"] <= NEW_TOKENS
    assert [p["fraction"] for p in rec["rest_min_suffix_1"]] == [0.5, 1.0]
    assert rec["lookup_latency_ms"]["lookups"] > 0 and rec["lookup_p50_ms"]["redis"] > 0
    for name in ("rest-full", "crest"):
        check = rec["real_check"][name]
        assert check["identical_to_ar"] == [True]  # Not a tree verification that changed the greedy output
        assert check["real_M"] >= 1.0 and check["simulated_M"] >= 1.0
    assert rec["targets"]["full_rest"]["bytes"] == max(p["bytes"] for p in rec["points"] if p["store"] == "rest")
