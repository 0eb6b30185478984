"""bench.knnlm through its entry point at a tiny size, in-process mode: a kNN-LM datastore built here with the real
model from a few stdlib docstrings (tests/knnlm's corpus) plus held-out documents, the retrieval service started
by the bench as its own process, the perplexity run picking λ and T on its dev half, then the baseline, a fixed
stride and OS³ on one prompt. Speculation is lossless, so every config must give the baseline's tokens."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from bench import knnlm
from tests.bench.threads import torch_threads
from tests.conftest import real_model
from tests.knnlm.conftest import DOC_TOKENS, OVERLAP, WINDOW, doc_texts

pytestmark = pytest.mark.model

CONFIGS = ("base", "s2", "os3")
NEW_TOKENS = 6
DOCS = 2  # of tests/knnlm's four: ~300 entries, enough for k = 8


def held_out_texts() -> list[str]:
    """Text the datastore never saw (prompts and perplexity come from it)."""
    return [os.path.join.__doc__ or "", json.dumps.__doc__ or ""]


def test_knnlm_main_writes_a_record(tmp_path, monkeypatch):
    from tools.knn_build import build_datastore, save_held_out

    tm = real_model("fp32")
    tokenizer = tm.tokenizer
    tokens = lambda t: np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"][:DOC_TOKENS],  # noqa: E731
                                  np.int32)
    with torch_threads(1):
        path = build_datastore(tmp_path / "knn", [(f"doc{i}", tokens(t)) for i, t in enumerate(doc_texts()[:DOCS])],
                               tm, window=WINDOW, overlap=OVERLAP, chunk_entries=100, hnsw_m=8,
                               hnsw_ef_construction=40, progress=False)
    del tm  # the bench loads the model it serves
    save_held_out(path, [(f"held{i}", tokens(t)) for i, t in enumerate(held_out_texts())])
    monkeypatch.chdir(tmp_path)  # the retrieval service's log goes to ./var
    out = tmp_path / "knnlm.json"
    with torch_threads():
        knnlm.main(["--datastore", str(path), "--retrievers", "edr", "--k", "8", "--configs", ",".join(CONFIGS),
                    "--limit", "1", "--prompt-tokens", "16", "--max-new-tokens", str(NEW_TOKENS), "--dtype",
                    "fp32", "--threads", "1", "--ppl-tokens", "32", "--ppl-window", "16", "--ppl-k", "8",
                    "--ppl-batch", "16", "--json", str(out)])
    rec = json.loads(out.read_text())
    cells = rec["retrievers"]["edr"]["8"]
    assert set(cells) == set(CONFIGS)  # Not a config left out
    for name, cell in cells.items():
        assert cell["n"] == 1 and cell["tokens"] == NEW_TOKENS and cell["latency_s"] > 0
        assert cell["identical"] == 1, name  # Not a speculative config that changed the output
        assert cell["kb_calls"] >= 1
    assert cells["base"]["speculation_accuracy"] is None  # Not an accuracy of speculation that never ran
    ppl = rec["perplexity"]
    assert ppl["lm"] > 1 and ppl["knnlm"] > 1 and ppl["tokens"] + ppl["tokens_dev"] == 32
    assert (rec["setup"]["lambda"], rec["setup"]["temperature"]) == (ppl["lambda"], ppl["temperature"])
    assert rec["setup"]["model_dtype"] == "fp32" and rec["datastore"]["n"] > 0 and rec["wall_s"] > 0
