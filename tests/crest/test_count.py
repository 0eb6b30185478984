"""N-gram counting over the suffix array vs brute force (every window of every document in a Counter)."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from retrieval_service.datastore.ngram_count import count_ngrams

from .conftest import datastore_of


def brute(docs: list[list[int]], n: int) -> list[tuple[tuple[int, ...], int]]:
    """All n-grams inside documents, most frequent first, ties in lexicographic order."""
    c = Counter(tuple(d[i:i + n]) for d in docs for i in range(len(d) - n + 1))
    return sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))


def got(counts, n: int) -> list[tuple[tuple[int, ...], int]]:
    return [(tuple(r.tolist()), int(c)) for r, c in zip(counts.ngrams[n], counts.counts[n])]


def test_count_scenarios():
    # The module's worked example: [5, 6, 5] and [6]; (5, SEP) and (6, SEP) are not bigrams.
    c = count_ngrams(datastore_of([[[5, 6, 5], [6]]], vocab_size=8), 3, 10, progress=False)
    assert got(c, 1) == [((5,), 2), ((6,), 2)]  # Not [((6,), 2), ((5,), 2)]: ties go lexicographic
    assert got(c, 2) == [((5, 6), 1), ((6, 5), 1)]  # Not including (5, SEP) / (6, SEP)
    assert got(c, 3) == [((5, 6, 5), 1)]
    assert (c.distinct, c.total) == ({1: 2, 2: 2, 3: 1}, {1: 4, 2: 2, 3: 1})
    # Document boundaries: [1, 2] + [3] must not count (2, 3), even when adjacent on disk.
    c = count_ngrams(datastore_of([[[1, 2], [3], [2, 3]]], vocab_size=8), 2, 10, progress=False)
    assert got(c, 2) == [((1, 2), 1), ((2, 3), 1)]  # Not ((2, 3), 2)
    # The same n-gram in two shards counts once with the summed count.
    c = count_ngrams(datastore_of([[[4, 4, 1]], [[4, 4]], [[2, 4, 4]]], vocab_size=8), 2, 10, progress=False)
    assert got(c, 2)[0] == ((4, 4), 3)  # Not three entries of count 1
    # top keeps the most frequent, the lexicographically smaller on ties.
    c = count_ngrams(datastore_of([[[3, 1, 3, 2, 3, 1]]], vocab_size=8), 1, 2, progress=False)
    assert got(c, 1) == [((3,), 3), ((1,), 2)]  # Not [((3,), 3), ((2,), 1)]
    # top = 0 keeps nothing but still counts.
    c = count_ngrams(datastore_of([[[3, 1]]], vocab_size=8), 2, 0, progress=False)
    assert got(c, 1) == [] and c.distinct == {1: 2, 2: 1}


def test_count_rejects_bad_arguments(small_ds):
    with pytest.raises(ValueError, match="max_n must be an integer in \\[1, 64\\], got 0"):
        count_ngrams(small_ds, 0, 10, progress=False)
    with pytest.raises(ValueError, match="top must be an integer >= 0, got -1"):
        count_ngrams(small_ds, 2, -1, progress=False)


docs_strategy = st.lists(st.lists(st.integers(0, 5), max_size=14), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(shards=st.lists(docs_strategy, min_size=1, max_size=3), max_n=st.integers(1, 4), top=st.integers(0, 12))
def test_count_matches_brute_force(shards, max_n, top):
    if not any(len(d) for docs in shards for d in docs):
        return  # a datastore needs at least one token
    shards = [docs if any(docs) else [[0]] for docs in shards]
    docs = [d for s in shards for d in s]
    c = count_ngrams(datastore_of(shards, vocab_size=8), max_n, top, progress=False)
    for n in range(1, max_n + 1):
        want = brute(docs, n)
        assert got(c, n) == want[:top]
        assert c.distinct[n] == len(want)
        assert c.total[n] == sum(k for _, k in want)


def test_count_reports_peak_rss(small_ds):
    c = count_ngrams(small_ds, 3, 5, progress=False)
    assert c.peak_rss_mb > 0
    assert np.all(np.diff(c.counts[3]) <= 0)  # most frequent first
