"""bench.draft_retrieval at a tiny size: every method it times (numba REST, the bare suffix search, merged, the
NumPy baseline, draft_batch on 1 and 2 threads) runs on a datastore built here, through its real entry point."""

from __future__ import annotations

import json

import numpy as np

from bench import draft_retrieval
from ragcore.draft_tree import DraftTree
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

VOCAB = 50


def _datastore(path, docs: int = 40, seed: int = 0) -> SuffixArrayDatastore:
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, VOCAB, 30)  # repeated text: contexts find matches and continuations
    arrays = [np.concatenate([rng.integers(0, VOCAB, int(rng.integers(5, 40))), motif]).astype(np.int32)
              for _ in range(docs)]
    return SuffixArrayDatastore.build(arrays, path, vocab_size=VOCAB, tokenizer_id="test-vocab-50", progress=False)


def test_numpy_baseline_agrees_with_the_kernel_on_what_it_matched(tmp_path):
    ds = _datastore(tmp_path / "ds")
    for ctx in draft_retrieval.datastore_contexts(ds, 10):
        ours = ds.draft(ctx, **draft_retrieval.REST)
        theirs = draft_retrieval.numpy_draft(ds.shards[0].tokens, ds.shards[0].sa, ctx, **draft_retrieval.REST)
        assert isinstance(theirs, DraftTree)
        assert (len(theirs) > 0) == (len(ours) > 0)  # Not a tree where the kernel drafted none


def test_entry_point_writes_a_record(tmp_path):
    ds = _datastore(tmp_path / "ds")
    out = tmp_path / "draft_retrieval.json"
    draft_retrieval.main(["--datastore", str(ds.path), "--sizes", f"600,{ds.num_tokens}", "--contexts", "12",
                          "--numpy-contexts", "4", "--contexts-from", "datastore", "--json", str(out)])
    rec = json.loads(out.read_text())
    assert sorted(int(n) for n in rec["sizes"]) == [600, ds.num_tokens]  # a prefix datastore was built and timed
    for r in rec["sizes"].values():
        assert r["n"] == 12 and r["numpy_contexts"] == 4  # Not 0: every method ran
        assert r["mean_ms"] > 0 and r["search_mean_ms"] > 0 and r["batch_threads2_ms_per_draft"] > 0
    assert rec["machine"]["cpu"] and "loadavg_start" in rec["machine"] and "code" in rec["machine"]
