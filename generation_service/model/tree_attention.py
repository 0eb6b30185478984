"""Tree attention as data: a draft tree -> verifier inputs, 4D additive mask, position ids, KV gather.

The verifier input is q = 1 + n tokens: row 0 is the last emitted token (the tree root, not yet in the KV
cache), rows 1..n are the draft nodes in BFS order. Row r may attend to the whole cached past and to its own
ancestors-or-self inside the tree, nothing else; its position is past_len + depth (root depth 0).

Worked example, past_len = 10, tree tokens [a, d, b, c], parents [-1, -1, 0, 0] (continuations "a b", "a c", "d"):
    rows         root  a  d  b  c
    positions     10  11 11 12 12
    tree part of the mask (1 = attend):
        root   1 . . . .
        a      1 1 . . .
        d      1 . 1 . .
        b      1 1 . 1 .
        c      1 1 . . 1
After verification accepts the path a -> b (node indices [0, 2]), the cache keeps rows [root, a, b], i.e. cache
positions past_len + [0, 1, 3], packed to past_len + [0, 1, 2].
"""

from __future__ import annotations

import numpy as np
import torch


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """parents: int32 [n] (-1 = root child, parents[i] < i) -> depth of every verifier row, int64 [1 + n] (root 0)."""
    n = parents.shape[0]
    depth = np.zeros(n + 1, np.int64)
    rows = parents.astype(np.int64) + 1  # parent row of node i is parents[i] + 1 (root row = 0)
    for i in range(n):
        depth[i + 1] = depth[rows[i]] + 1
    return depth


def tree_ancestors(parents: np.ndarray) -> np.ndarray:
    """parents: int32 [n] -> bool [1 + n, 1 + n], [r, c] = row c is an ancestor of (or is) row r.

    BFS order (parents[i] < i) lets one pass copy the parent's row, so each row is built from a finished one.
    """
    n = parents.shape[0]
    anc = np.zeros((n + 1, n + 1), dtype=bool)
    anc[0, 0] = True
    rows = parents.astype(np.int64) + 1
    for i in range(n):
        anc[i + 1] = anc[rows[i]]  # the parent row is complete (it includes the parent itself)
        anc[i + 1, i + 1] = True
    return anc


def tree_mask(parents: np.ndarray, past_len: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """-> additive mask [1, 1, q, past_len + q]: 0 where attention is allowed, dtype's min elsewhere.

    The most negative finite value (not -inf) keeps softmax finite even in kernels that process masked blocks.
    """
    q = parents.shape[0] + 1
    anc = torch.from_numpy(tree_ancestors(parents)).to(device)  # [q, q]
    mask = torch.zeros((1, 1, q, past_len + q), dtype=dtype, device=device)  # [1, 1, q, kv]
    mask[0, 0, :, past_len:].masked_fill_(~anc, torch.finfo(dtype).min)
    return mask


def tree_position_ids(parents: np.ndarray, past_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """-> position ids [1, q]: past_len + depth."""
    return torch.from_numpy(tree_depths(parents) + past_len).to(device).unsqueeze(0)  # [1, q]


def tree_children(tokens: np.ndarray, parents: np.ndarray) -> dict[tuple[int, int], int]:
    """(parent node, token) -> child node; the root's children are keyed by parent -1.

    Duplicate siblings (a malformed draft) keep the first one; either would be a valid continuation.
    """
    children: dict[tuple[int, int], int] = {}
    for i, key in enumerate(zip(parents.tolist(), tokens.tolist())):
        children.setdefault(key, i)
    return children


def prune_depth(parents: np.ndarray, max_depth: int) -> tuple[np.ndarray, np.ndarray]:
    """-> (kept node indices int64 [m], their parents re-indexed int32 [m]) for nodes of depth <= max_depth.

    A kept node's parent is shallower, hence kept too, so the result is again a tree with parents[i] < i.
    """
    if max_depth <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    keep = np.flatnonzero(tree_depths(parents)[1:] <= max_depth)  # [m]
    if keep.shape[0] == parents.shape[0]:
        return keep, parents
    new_index = np.full(parents.shape[0], -1, np.int64)
    new_index[keep] = np.arange(keep.shape[0])
    kept_parents = parents[keep]
    return keep, np.where(kept_parents < 0, -1, new_index[np.maximum(kept_parents, 0)]).astype(np.int32)


def dfs_order(parents: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth-first order of a tree, higher-scored children first -> (order int64 [n], parents in that order).

    order[j] is the old index of new node j; the new parents still satisfy parents[j] < j.

    Why: in bf16 a verifier row is bit-identical to the AR row for its position only if its ancestors sit
    contiguously right before it (masked columns in between shift the fp32 accumulation blocks of the P @ V
    GEMM). Depth-first, best child first, makes the most likely path a contiguous chain - and its KV gather a
    crop. Other paths stay exact up to rounding (near-ties).
    """
    n = parents.shape[0]
    if n <= 1:
        return np.arange(n), parents
    kids: list[list[int]] = [[] for _ in range(n + 1)]  # kids[p + 1] = children of node p (kids[0] = root's)
    for i in np.lexsort((np.arange(n), -np.asarray(scores))).tolist():  # score desc, then original order
        kids[int(parents[i]) + 1].append(i)
    order: list[int] = []
    stack = kids[0][::-1]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(kids[i + 1][::-1])
    order_arr = np.asarray(order, np.int64)
    new_index = np.empty(n, np.int64)
    new_index[order_arr] = np.arange(n)
    old_parents = parents[order_arr]
    return order_arr, np.where(old_parents < 0, -1, new_index[np.maximum(old_parents, 0)]).astype(np.int32)


def dfs_layout(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tree reordered depth-first, best child first (see dfs_order) -> (tokens, parents)."""
    order, new_parents = dfs_order(parents, scores)
    return tokens[order], new_parents


def kept_rows(past_len: int, path: list[int]) -> torch.Tensor:
    """Cache positions to keep after accepting `path` (node indices): past_len + [0, path + 1] -> int64 [1 + m]."""
    return torch.tensor([past_len] + [past_len + 1 + p for p in path], dtype=torch.int64)


def gather_kv(cache, past_len: int, path: list[int]) -> None:
    """Keep the cached past, the root row and the accepted path's rows of every layer; drop the other draft rows.

    cache layers hold keys/values [B, H_kv, S, D]. When the path is the leftmost chain (nodes 0..m-1, the common
    case for a chain-shaped draft) the rows are already in place and a crop suffices; otherwise the accepted rows
    are copied down with index_select (a copy first, so overlapping source/destination is safe).
    """
    if hasattr(cache, "gather"):  # lean_llama.KVCache: one indexed copy for all layers
        cache.gather(past_len, path)
        return
    with torch.inference_mode():
        _gather_layers(cache, past_len, path)


def _gather_layers(cache, past_len: int, path: list[int]) -> None:
    """gather_kv for a transformers cache (per layer)."""
    m = len(path)
    new_len = past_len + 1 + m
    contiguous = path == list(range(m))
    src = None if contiguous else kept_rows(past_len, path)[1:]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True):
            continue
        keys, values = layer.keys, layer.values  # [B, H_kv, S, D]
        if src is not None:
            src_d = src.to(keys.device)
            keys[:, :, past_len + 1:new_len] = keys.index_select(2, src_d)
            values[:, :, past_len + 1:new_len] = values.index_select(2, src_d)
        # A view: the next cache update concatenates into a fresh tensor, so the dropped tail is never read.
        layer.keys = keys[:, :, :new_len]
        layer.values = values[:, :, :new_len]
