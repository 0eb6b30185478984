"""Online learning: learned outputs are drafted from like any shard; compaction, eviction and restart."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from retrieval_service.datastore.online import OnlineLearner
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

TID = "test-tokenizer"
BASE = [[1, 2, 3, 4]]


def base_store() -> SuffixArrayDatastore:
    return SuffixArrayDatastore.from_documents([np.array(d) for d in BASE], vocab_size=50, tokenizer_id=TID)


def test_learned_output_becomes_draftable():
    ds = base_store()
    learner = OnlineLearner(ds, max_tokens=100, compact_tokens=50, background=False)
    assert ds.draft([7, 8], min_suffix=2).paths() == []
    learner.add(np.array([7, 8, 9, 10]))
    learner.flush()
    assert ds.draft([7, 8], min_suffix=2).paths() == [[9], [9, 10]]  # Not []: the delta shard answers
    assert ds.draft([1, 2], min_suffix=2).paths() == [[3], [3, 4]]  # the base datastore still answers
    assert learner.stats()["pending_tokens"] == 4


@pytest.mark.parametrize("outputs, compact_tokens, max_tokens, searchable", [
    ([[7, 8, 9]], 50, 100, 3),  # in the delta shard
    ([[7, 8, 9], [10, 11]], 50, 100, 5),  # two outputs in one delta
    ([[7, 8, 9, 10, 11, 12]], 6, 100, 6),  # compacted into a shard of its own
    ([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35], [40, 41]], 6, 12, 14),  # two shards and a delta
    ([[20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35], [40, 41, 42, 43, 44, 45]], 6, 12, 12),  # oldest evicted
])
def test_searchable_tokens_follow_the_rebuilds(outputs, compact_tokens, max_tokens, searchable):
    """learned_tokens counts an output once it is added; searchable_tokens once a rebuild has published it."""
    learner = OnlineLearner(base_store(), max_tokens=max_tokens, compact_tokens=compact_tokens, background=False)
    assert learner.searchable_tokens == 0
    for out in outputs[:-1]:
        learner.add(np.array(out))
        learner.flush()
    before = learner.searchable_tokens
    learner.add(np.array(outputs[-1]))
    assert learner.searchable_tokens == before  # Not yet: the last output waits for the next rebuild
    assert learner.learned_tokens > before
    learner.flush()
    assert learner.searchable_tokens == learner.learned_tokens == searchable


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(10, 14), min_size=1, max_size=8), min_size=1, max_size=6),
       st.lists(st.integers(10, 14), min_size=1, max_size=4))
def test_learned_store_drafts_like_one_built_from_everything(outputs, ctx):
    """Base + learned shards give the same tree as a datastore built from all documents at once."""
    ds = base_store()
    learner = OnlineLearner(ds, max_tokens=10_000, compact_tokens=12, background=False)
    for out in outputs:
        learner.add(np.array(out))
        learner.flush()
    everything = SuffixArrayDatastore.from_documents([np.array(d) for d in BASE + outputs], vocab_size=50,
                                                     tokenizer_id=TID)
    got, want = ds.draft(ctx, min_suffix=1), everything.draft(ctx, min_suffix=1)
    assert got.paths() == want.paths()
    assert got.matched_suffix == want.matched_suffix


def test_compaction_eviction_and_restart(tmp_path):
    ds = base_store()
    learner = OnlineLearner(ds, directory=tmp_path, max_tokens=12, compact_tokens=6, background=False)
    outputs = [[20 + i, 30 + i, 40 + i, 41, 42, 43] for i in range(4)]  # 6 tokens each: one shard per output
    for out in outputs:
        learner.add(np.array(out))
        learner.flush()
    # Bounded at 12 tokens: the two oldest outputs were evicted, their files deleted.
    assert learner.learned_tokens == 12
    assert sorted(p.name for p in tmp_path.glob("learned-*.rsa")) == ["learned-00000003.rsa", "learned-00000004.rsa"]
    assert ds.draft([20, 30], min_suffix=2).paths() == []  # Not the evicted oldest output
    assert ds.draft([23, 33], min_suffix=2).paths()[:1] == [[43]]
    # A restarted service finds its compacted learned shards again.
    fresh = base_store()
    OnlineLearner(fresh, directory=tmp_path, max_tokens=12, compact_tokens=6, background=False)
    assert fresh.draft([23, 33], min_suffix=2).paths()[:1] == [[43]]
    assert fresh.draft([20, 30], min_suffix=2).paths() == []


def test_background_thread_publishes_without_flush():
    ds = base_store()
    learner = OnlineLearner(ds, max_tokens=100, compact_tokens=50, debounce_s=0.0)
    try:
        learner.add(np.array([7, 8, 9]))
        for _ in range(200):
            if ds.draft([7, 8], min_suffix=2).paths():
                break
            import time
            time.sleep(0.01)
        assert ds.draft([7, 8], min_suffix=2).paths() == [[9]]
    finally:
        learner.close()


@pytest.mark.parametrize("bad, message", [
    (np.array([], np.int64), "non-empty"), (np.array([[1, 2]]), "1-D"), (np.array([1, 99]), r"\[0, 50\)"),
])
def test_bad_outputs_are_refused(bad, message):
    learner = OnlineLearner(base_store(), background=False, max_tokens=100, compact_tokens=10)
    with pytest.raises(ValueError, match=message):
        learner.add(bad)
