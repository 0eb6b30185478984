"""Counted trie and top-k selection (ragcore/draft_kernels.py section 1) on hand-made rows, and against the brute-force reference."""

import numpy as np
from hypothesis import given, settings, strategies as st

from ragcore.draft_kernels import N_SOURCES, tree_from_rows
from ragcore.draft_tree import DraftTree

from . import reference as ref


def draft(rows: list[list[int]], max_nodes: int, weights=None, runs=None, sources=None) -> DraftTree:
    width = max([len(r) for r in rows] + [1])
    arr = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        arr[i, : len(r)] = r
    lens = np.array([len(r) for r in rows], np.int32)
    w = np.ones(len(rows)) if weights is None else np.asarray(weights, np.float64)
    run_starts = np.arange(len(rows) + 1) if runs is None else np.asarray(runs, np.int64)
    src = np.zeros(len(rows), np.int64) if sources is None else np.asarray(sources, np.int64)
    tok, par, score, src_p = tree_from_rows(arr, lens, w, run_starts, max_nodes, src, N_SOURCES)
    tree = DraftTree(tok, par, score, source_p=src_p)
    tree.validate()
    return tree


def brute_source_p(rows: list[list[int]], weights: list[float], sources: list[int], path: list[int]) -> list[float]:
    """Per source: weight of its non-empty rows starting with `path` / weight of all its non-empty rows."""
    out = []
    for s in range(N_SOURCES):
        total = sum(w for r, w, c in zip(rows, weights, sources) if c == s and r)
        hit = sum(w for r, w, c in zip(rows, weights, sources) if c == s and r[:len(path)] == path)
        out.append(hit / total if total > 0 else 0.0)
    return out


def test_docstring_example():
    # Rows "a b", "a c", "d" with a=1, b=2, c=3, d=4.
    tree = draft([[1, 2], [1, 3], [4]], 3)
    assert tree.paths() == [[1], [4], [1, 2]]  # Not [[1], [1, 2], [1, 3]]: top-3 keeps the heavier root child 4
    assert tree.parents.tolist() == [-1, -1, 0]
    assert tree.scores.tolist() == [2, 1, 1]


def test_scenarios():
    # Frequency wins over lexicographic order: [5] seen twice beats [1] seen once.
    assert draft([[1], [5, 1], [5, 1]], 2).paths() == [[5], [5, 1]]  # Not [[1], [5]]: [5, 1] (2) beats [1] (1)
    # Equal counts at different depths: the shallower node wins.
    assert draft([[1], [5, 1], [5, 2]], 2).paths() == [[1], [5]]  # Not [[5], [5, 1]]
    # Equal weights: the parent precedes its child, so the selection stays connected.
    assert draft([[7, 8, 9]], 2).paths() == [[7], [7, 8]]  # Not [[7], [8, 9]] or a dangling [7, 8, 9]
    # Equal weight and depth: lexicographically smaller path first.
    assert draft([[3], [2]], 1).paths() == [[2]]  # Not [[3]]
    # Budget 0 and no rows give empty trees.
    assert draft([[1, 2]], 0).paths() == []  # Not [[1]]
    assert draft([], 5).paths() == []
    # Empty rows (a match at the end of a document) add nothing.
    assert draft([[], [4]], 5).paths() == [[4]]  # Not a node for the empty row
    # Duplicate rows merge into one path with the summed count.
    assert draft([[6, 6], [6, 6]], 5).scores.tolist() == [2, 2]  # Not [1, 1, 1, 1] (no duplicate siblings)


def test_weights_and_runs():
    # Two sorted runs ([1,2],[3]) and ([1,4]) merge; weights decide the ranking, not counts.
    tree = draft([[1, 2], [3], [1, 4]], 2, weights=[0.1, 0.5, 0.1], runs=[0, 2, 3])
    assert tree.paths() == [[1], [3]]  # Not [[1], [1, 2]]: [3] weighs 0.5 > [1, 2] 0.1
    assert tree.scores.tolist() == [np.float32(0.2), np.float32(0.5)]


def test_source_p():
    # Rows: datastore "a b", "a c"; context "a b"; learned "d". Each source's share of rows through each node.
    tree = draft([[1, 2], [1, 3], [1, 2], [4]], 5, sources=[0, 0, 1, 2])
    p = {tuple(path): tree.source_p[i].tolist() for i, path in enumerate(tree.paths())}
    assert p[(1,)] == [1.0, 1.0, 0.0]  # Not [2/3, ...]: each source is normalized by its own rows
    assert p[(1, 2)] == [0.5, 1.0, 0.0]  # Not [1/3, 1/3, 0]: the context's one row agrees fully
    assert p[(4,)] == [0.0, 0.0, 1.0]  # the learned row alone
    # Weighted rows: shares follow weights, not counts.
    tree = draft([[1], [2]], 2, weights=[0.75, 0.25])
    assert tree.source_p[:, 0].tolist() == [0.75, 0.25]  # Not [0.5, 0.5]


def test_bfs_order():
    tree = draft([[1, 2, 3], [1, 2, 4], [5, 6]], 10)
    assert tree.paths() == [[1], [5], [1, 2], [5, 6], [1, 2, 3], [1, 2, 4]]  # Not depth-first [[1], [1, 2], ...]


rows_st = st.lists(st.lists(st.integers(0, 3), max_size=5), max_size=12)


@settings(max_examples=300, deadline=None)
@given(rows=rows_st, max_nodes=st.integers(0, 15), data=st.data())
def test_matches_reference(rows, max_nodes, data):
    weights = data.draw(st.lists(st.sampled_from([0.25, 1.0, 1 / 3, 0.1]), min_size=len(rows), max_size=len(rows)))
    sources = data.draw(st.lists(st.integers(0, N_SOURCES - 1), min_size=len(rows), max_size=len(rows)))
    tree = draft(rows, max_nodes, weights=weights, sources=sources)
    paths, tokens, parents, scores = ref.tree(rows, weights, max_nodes)
    assert tree.paths() == paths
    assert tree.parents.tolist() == parents
    assert np.array_equal(tree.scores, scores)
    for i, path in enumerate(paths):  # float32 of a float64 ratio; sums may differ in the last bits
        assert np.allclose(tree.source_p[i], brute_source_p(rows, weights, sources, path), rtol=1e-6, atol=1e-7)
