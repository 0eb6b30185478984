"""The benchmark's REST samples: nested random document samples holding at least the asked share of tokens."""

import numpy as np

from bench.crest import accepted_length
from bench.crest_stores import sample_documents

from .conftest import corpus, datastore_of


def test_samples_are_nested_and_cover_the_fraction():
    docs = corpus(seed=3, docs=200)
    ds = datastore_of([docs[:120], docs[120:]])
    total = sum(len(d) for d in docs if d)
    by_pair = {(s, i): len(ds.shards[s].document(i)) for s in range(2) for i in range(ds.shards[s].num_documents)}
    previous: set = set()
    for f in (0.01, 0.1, 0.5, 1.0):
        got = sample_documents(ds, f, seed=0)
        tokens = sum(by_pair[p] for p in got)
        assert tokens >= f * total  # Not short of the fraction
        assert tokens - max(by_pair[p] for p in got) < f * total  # the shortest such prefix, Not more documents
        assert previous <= set(got)  # nested: a larger sample holds every smaller one
        assert got == sorted(got)  # corpus order
        previous = set(got)
    assert len(previous) == len(by_pair)  # 100 % = every document
    assert sample_documents(ds, 0.1, seed=0) != sample_documents(ds, 0.1, seed=1)  # Not a fixed prefix


def test_accepted_length_scenarios():
    # Tree: root children 5 and 7; 5 -> 6 -> 9, 5 -> 8.
    tokens, parents = np.array([5, 7, 6, 8, 9]), np.array([-1, -1, 0, 0, 2])
    assert accepted_length(tokens, parents, np.array([5, 6, 9, 1])) == 3
    assert accepted_length(tokens, parents, np.array([5, 8, 9])) == 2  # Not 3: 9 hangs under 6, not under 8
    assert accepted_length(tokens, parents, np.array([6, 9])) == 0  # Not 2: 6 is not a root child
    assert accepted_length(tokens[:0], parents[:0], np.array([5])) == 0
