"""Tree mask / position ids / pruning / KV gather against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from generation_service.model.tree_attention import (
    dfs_layout,
    gather_kv,
    prune_depth,
    tree_ancestors,
    tree_children,
    tree_depths,
    tree_mask,
    tree_position_ids,
)


@st.composite
def bfs_trees(draw, max_nodes: int = 40):
    """Random tree in BFS order: parents[i] < i and depth non-decreasing."""
    n = draw(st.integers(0, max_nodes))
    raw = [draw(st.integers(-1, i - 1)) for i in range(n)]  # any parent-before-child tree
    depth = []
    for p in raw:
        depth.append(1 if p < 0 else depth[p] + 1)
    order = sorted(range(n), key=lambda i: depth[i])  # stable: parents (smaller depth) come first
    new = {old: k for k, old in enumerate(order)}
    parents = np.array([-1 if raw[o] < 0 else new[raw[o]] for o in order], np.int32)
    tokens = np.array([draw(st.integers(0, 9)) for _ in range(n)], np.int32)
    return tokens, parents


def ref_ancestors(parents: np.ndarray) -> np.ndarray:
    """Walk up the parent chain from every row; row 0 is the root, node i is row i + 1."""
    q = len(parents) + 1
    anc = np.zeros((q, q), bool)
    for r in range(q):
        anc[r, 0] = True
        node = r - 1
        while node >= 0:
            anc[r, node + 1] = True
            node = int(parents[node])
    return anc


def ref_depth(parents: np.ndarray, i: int) -> int:
    d = 0
    while i >= 0:
        d, i = d + 1, int(parents[i])
    return d


@settings(max_examples=200, deadline=None)
@given(bfs_trees(), st.integers(0, 7))
def test_mask_and_positions_match_brute_force(tree, past):
    tokens, parents = tree
    q = len(tokens) + 1
    anc = ref_ancestors(parents)
    assert np.array_equal(tree_ancestors(parents), anc)
    mask = tree_mask(parents, past, torch.float32)
    assert mask.shape == (1, 1, q, past + q)
    allowed = (mask[0, 0] == 0).numpy()
    assert allowed[:, :past].all()  # every row sees the whole cached past
    assert np.array_equal(allowed[:, past:], anc)
    assert (mask[0, 0][~torch.from_numpy(allowed)] == torch.finfo(torch.float32).min).all()
    pos = tree_position_ids(parents, past)
    assert pos.tolist() == [[past] + [past + ref_depth(parents, i) for i in range(len(parents))]]


def test_mask_worked_example():
    # Continuations "a b", "a c", "d" -> tokens [a, d, b, c], parents [-1, -1, 0, 0].
    parents = np.array([-1, -1, 0, 0], np.int32)
    allowed = (tree_mask(parents, 2, torch.bfloat16)[0, 0, :, 2:] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0],
                       [1, 0, 1, 0, 0],
                       [1, 1, 0, 1, 0],  # b sees a, not d  # Not [1, 1, 1, 1, 0] (a causal mask)
                       [1, 1, 0, 0, 1]]  # c does not see its sibling b
    assert tree_position_ids(parents, 10).tolist() == [[10, 11, 11, 12, 12]]
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 2]


@settings(max_examples=100, deadline=None)
@given(bfs_trees(), st.integers(0, 6), st.booleans())
def test_prune_depth_keeps_exactly_shallow_nodes(tree, max_depth, depth_first):
    tokens, parents = tree
    if depth_first:  # any parent-before-child order must work, not only BFS
        tokens, parents = dfs_layout(tokens, parents, np.ones(len(tokens), np.float32))
    keep, p = prune_depth(parents, max_depth)
    assert keep.tolist() == [i for i in range(len(parents)) if ref_depth(parents, i) <= max_depth]
    paths = ref_paths(tokens, parents)
    assert ref_paths(tokens[keep], p) == [paths[i] for i in keep]


def ref_paths(tokens, parents) -> list[tuple[int, ...]]:
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(int(tokens[j]))
            j = int(parents[j])
        out.append(tuple(reversed(path)))
    return out


@settings(max_examples=150, deadline=None)
@given(bfs_trees(), st.randoms(use_true_random=False))
def test_dfs_layout_keeps_the_tree_and_makes_the_best_path_contiguous(tree, rnd):
    _, parents = tree
    tokens = np.arange(len(parents), dtype=np.int32)  # unique tokens: a path names its node
    scores = np.array([rnd.random() for _ in tokens], np.float32)
    t, p = dfs_layout(tokens, parents, scores)
    assert np.all(p < np.arange(len(p)))
    # Same set of (path -> score): a permutation of the nodes with their ancestry intact.
    by_path = {path: s for path, s in zip(ref_paths(tokens, parents), scores.tolist())}
    assert sorted(ref_paths(t, p)) == sorted(by_path)
    # Greedy descent by score from the root visits nodes 0, 1, 2, ...  # Not BFS positions
    node, i = -1, 0
    while True:
        kids = [j for j in range(len(p)) if p[j] == node]
        if not kids:
            break
        best = max(kids, key=lambda j: (by_path[ref_paths(t, p)[j]], -j))
        assert best == i
        node, i = best, i + 1


def test_children_first_duplicate_wins():
    tokens = np.array([5, 7, 5, 9], np.int32)
    parents = np.array([-1, -1, -1, 0], np.int32)
    assert tree_children(tokens, parents) == {(-1, 5): 0, (-1, 7): 1, (0, 9): 3}  # Not (-1, 5): 2


def _cache(layers: int, length: int, seed: int = 0):
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for i in range(layers):
        k = torch.randn(1, 3, length, 4, generator=g)
        v = torch.randn(1, 3, length, 4, generator=g)
        cache.update(k, v, i)
    return cache


@pytest.mark.parametrize("path", [
    [],            # nothing accepted: keep past + root only
    [0, 1, 2],     # leftmost chain: a crop
    [1, 3, 6],     # a later branch: rows must move down
    [2],
])
def test_gather_kv_keeps_root_and_path_rows(path):
    past, q = 5, 8
    cache = _cache(2, past + q)
    before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    gather_kv(cache, past, path)
    keep = list(range(past + 1)) + [past + 1 + p for p in path]
    assert cache.get_seq_length() == past + 1 + len(path)
    for (k, v), layer in zip(before, cache.layers):
        assert torch.equal(layer.keys, k[:, :, keep]) and torch.equal(layer.values, v[:, :, keep])
    # The next update appends after the kept rows (DynamicLayer concatenates).
    cache.update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 0)
    assert cache.layers[0].keys.shape[2] == past + 2 + len(path)


class _Cache:
    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


@settings(max_examples=150, deadline=None)
@given(bfs_trees(max_nodes=24), st.integers(0, 300), st.integers(1, 8), st.integers(0, 49151))
def test_tree_segment_on_the_cpu_equals_the_torch_built_one(tree, past, min_rows, last):
    """tree_segment builds a CPU float32 pass's rows in numpy (no GIL-releasing torch calls): the same ids,
    positions and mask as tree_mask / tree_position_ids, pad rows included."""
    from types import SimpleNamespace

    from generation_service.engine.steps import tree_segment

    tokens, parents = tree
    tm = SimpleNamespace(min_rows=min_rows, device=torch.device("cpu"), dtype=torch.float32)
    seg = tree_segment(tm, _Cache(past), last, tokens, parents)
    n_pad = max(0, min_rows - 1 - len(tokens))
    tokens_p = np.concatenate((tokens, np.full(n_pad, last, np.int32)))
    parents_p = np.concatenate((parents, np.full(n_pad, -1, np.int32)))
    assert seg.ids.dtype == torch.int64 and seg.ids.tolist() == [last] + tokens_p.tolist()
    assert torch.equal(seg.positions, tree_position_ids(parents_p, past)[0])
    if len(tokens_p) == 0:
        assert seg.mask is None  # the AR step: causal
    else:
        assert seg.mask.dtype == torch.float32 and torch.equal(seg.mask, tree_mask(parents_p, past, torch.float32)[0, 0])
