"""Brute-force references: scan every position, count every prefix in a dict, sort everything.

Deliberately naive so a reader can check them by eye; the tests compare the numba kernels against them.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

SEP = 1 << 40  # larger than any test token, like the on-disk separator


def concat(docs: list[list[int]]) -> list[int]:
    out: list[int] = []
    for d in docs:
        if len(d):
            out += [int(t) for t in d] + [SEP]
    return out


def suffix_array(tokens: list[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda p: tokens[p:])


def occurrences(tokens: list[int], pattern: list[int]) -> list[int]:
    """Start positions of `pattern`, in suffix-array order."""
    n = len(pattern)
    return [p for p in suffix_array(tokens) if tokens[p : p + n] == pattern]


def continuation(tokens: list[int], start: int, length: int) -> list[int]:
    out = []
    for t in tokens[start : start + length]:
        if t == SEP:
            break
        out.append(t)
    return out


def allocate(counts: list[int], budget: int) -> list[int]:
    """Largest remainder split of `budget` proportional to counts (ties -> lower index)."""
    total = sum(counts)
    if total <= budget:
        return list(counts)
    take = [c * budget // total for c in counts]
    rem = [c * budget - t * total for c, t in zip(counts, take)]
    for _ in range(budget - sum(take)):
        best = max((i for i in range(len(counts)) if take[i] < counts[i]), key=lambda i: (rem[i], -i))
        take[best] += 1
        rem[best] = -1
    return take


def datastore_rows(shard_docs: list[list[list[int]]], ctx: list[int], max_suffix: int, min_suffix: int,
                   max_matches: int, cont: int, sample_first: bool = False) -> tuple[int, list[list[int]]]:
    """REST over shards: longest suffix occurring in any shard, proportional evenly spaced sample per shard."""
    shards = [concat(docs) for docs in shard_docs]
    for length in range(min(max_suffix, len(ctx)), min_suffix - 1, -1):
        pattern = ctx[len(ctx) - length :]
        occ = [occurrences(tokens, pattern) for tokens in shards]
        if any(occ):
            break
    else:
        return 0, []
    take = allocate([len(o) for o in occ], max_matches)
    rows = []
    for tokens, o, k in zip(shards, occ, take):
        picks = o[:k] if sample_first else [o[i * len(o) // k] for i in range(k)]
        rows += [continuation(tokens, p + length, cont) for p in picks]
    return length, rows


def context_rows(ctx: list[int], max_suffix: int, min_suffix: int, max_matches: int, cont: int
                 ) -> tuple[int, list[list[int]]]:
    """Prompt lookup: longest suffix that occurs ending before the last position; most recent first."""
    t = len(ctx)
    for length in range(min(max_suffix, t - 1), min_suffix - 1, -1):
        pattern = ctx[t - length :]
        ends = [e for e in range(t - 2, length - 2, -1) if ctx[e - length + 1 : e + 1] == pattern]
        if ends:
            return length, [ctx[e + 1 : e + 1 + cont] for e in ends[:max_matches]]
    return 0, []


def tree(rows: list[list[int]], weights: list[float], max_nodes: int):
    """REST trie: every prefix counted; top-k by (weight desc, depth, path); BFS by (depth, path).

    Rows are summed in the kernel's order (stable; a row that ends sorts after its extensions, as a separator
    does in the suffix array), so float sums match bit for bit.
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i] + [SEP])
    weight: dict[tuple, float] = defaultdict(float)
    for i in order:
        for d in range(1, len(rows[i]) + 1):
            weight[tuple(rows[i][:d])] += weights[i]
    chosen = sorted(weight, key=lambda p: (-weight[p], len(p), p))[:max_nodes]
    bfs = sorted(chosen, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(bfs)}
    tokens = [p[-1] for p in bfs]
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in bfs]
    scores = np.array([weight[p] for p in bfs], np.float32)
    return [list(p) for p in bfs], tokens, parents, scores
