"""Cost-aware tree size: brute force over every subtree size, ancestor closure, and α learning."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generation_service.draft_budget import (DraftSizer, acceptance_estimates, best_size, keep_best,
                                             subtree)


def random_count_tree(rng, n):
    """A count trie like REST's: parents[i] < i and a child's count never exceeds its parent's."""
    parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int32)
    counts = np.zeros(n, np.float32)
    for i in range(n):
        cap = 100.0 if parents[i] < 0 else counts[parents[i]]
        counts[i] = float(rng.integers(1, int(cap) + 1))
    return parents, counts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=0, max_size=40), st.floats(0.001, 0.2), st.floats(0.05, 2.0))
def test_best_size_matches_brute_force(ps, cost, alpha):
    p = np.sort(np.array(ps, np.float64))[::-1]
    rates = [1.0] + [(1 + alpha * p[:n].sum()) / (1 + cost * n) for n in range(1, len(p) + 1)]
    expected = int(np.argmax(rates))
    got = best_size(p, cost, alpha)
    assert np.isclose(rates[got], rates[expected])  # same optimum (ties may pick either size)


@pytest.mark.parametrize("case, p, cost, expected, not_expected", [
    ("confident chain is kept whole", [0.95, 0.9, 0.85, 0.8], 0.02, 4, 0),
    ("scattered matches are not worth a pass", [0.01, 0.01, 0.005], 0.02, 0, 3),
    ("expensive nodes keep only the best one", [0.9, 0.05, 0.05], 0.1, 1, 3),
])
def test_best_size_scenarios(case, p, cost, expected, not_expected):
    got = best_size(np.array(p), cost, 1.0)
    assert got == expected, case
    assert got != not_expected, case


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(0, 60), st.integers(0, 10_000))
def test_keep_best_is_an_ancestor_closed_subtree(n, k, seed):
    rng = np.random.default_rng(seed)
    parents, scores = random_count_tree(rng, n)
    keep = keep_best(parents, scores, k)
    kept = set(keep.tolist())
    assert all(parents[i] < 0 or parents[i] in kept for i in keep)  # every kept node's parent is kept
    assert len(keep) == min(k, n)  # monotone counts: the best k are already connected, nothing added
    tokens = np.arange(n, dtype=np.int32) + 100
    t2, p2, s2 = subtree(tokens, parents, scores, keep)
    assert np.all(p2 < np.arange(len(p2)))
    for j, i in enumerate(keep):  # same node, same parent token
        assert t2[j] == tokens[i]
        assert (p2[j] < 0) == (parents[i] < 0)
        if p2[j] >= 0:
            assert t2[p2[j]] == tokens[parents[i]]


def test_acceptance_estimates_are_shares_of_the_root_total():
    parents = np.array([-1, -1, 0, 2], np.int32)
    counts = np.array([30, 10, 20, 5], np.float32)
    assert np.allclose(acceptance_estimates(parents, counts), [0.75, 0.25, 0.5, 0.125])
    assert not np.allclose(acceptance_estimates(parents, counts), counts / counts.sum())


def test_sizer_learns_alpha_from_acceptance():
    parents = np.array([-1, 0, 1, 2], np.int32)
    counts = np.array([10, 10, 10, 10], np.float32)  # the datastore says: certain
    tokens = np.array([5, 6, 7, 8], np.int32)
    sizer = DraftSizer(node_cost=0.05)
    t, _, _ = sizer.shrink(tokens, parents, counts)
    assert len(t) == 4 and sizer.alpha == 1.0
    for _ in range(30):  # ... but the model never agrees
        sizer.shrink(tokens, parents, counts)
        sizer.observe(0)
    assert sizer.alpha < 0.1  # it stops drafting (and predicting) once a node costs more than it is worth
    t, _, _ = sizer.shrink(tokens, parents, counts)
    assert len(t) < 4  # smaller trees once the datastore has proven optimistic
