"""Count the n-grams (n = 1..m) of a suffix-array datastore and keep the top-T most frequent for each n.

    counts = count_ngrams(SuffixArrayDatastore.open(path), max_n=5, top=200_000)
    counts.ngrams[3]   # int32 [t_3, 3], most frequent first (ties: lexicographic order)
    counts.counts[3]   # int64 [t_3]

Why the suffix array. Its entries list every position in order of the tokens that follow, so all occurrences of
an n-gram are one contiguous run, for every n at once. One sequential pass that compares each entry's first m
tokens with the previous entry's (their common prefix length l) closes, for every n > l, the run of the previous
n-gram: its length is that n-gram's count. Exact counts, no hashing, no spill files, and the only memory besides
the memory-mapped datastore is one bounded heap of T entries per n (streaming: peak anonymous memory is
O(m * T), whatever the corpus size). Several shards are merged on the fly (a k-way merge of the shards' runs by
their m-token prefix), so a sharded datastore counts exactly like one big shard.

Document separators: an n-gram never spans one. The comparison stops at a separator, and a run counts for n only
if its first entry has n tokens before the next separator.

Worked example, documents [5, 6, 5] and [6], m = 2 (SEP = separator):
    suffixes in suffix-array order: 5 6 5 SEP | 5 SEP | 6 5 SEP | 6 SEP | SEP | SEP
    n = 1: 5 x2, 6 x2;  n = 2: (5, 6) x1, (6, 5) x1   ((5, SEP) and (6, SEP) cross a separator: not n-grams)
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import numba as nb
import numpy as np
from tqdm import tqdm

from retrieval_service.datastore.suffix_array import shard_tuple

_JIT = dict(nogil=True, cache=True)
# Merged suffix-array entries per kernel call: progress updates frequent enough to watch, rare enough to cost nothing.
_CHUNK = 2_000_000


@dataclass(frozen=True)
class NgramCounts:
    """Top n-grams per n, most frequent first; ties in lexicographic token order (deterministic)."""

    max_n: int
    ngrams: dict[int, np.ndarray]  # n -> int32 [t_n, n]
    counts: dict[int, np.ndarray]  # n -> int64 [t_n], non-increasing
    distinct: dict[int, int] = field(default_factory=dict)  # n -> number of distinct n-grams in the corpus
    total: dict[int, int] = field(default_factory=dict)  # n -> number of n-gram occurrences in the corpus
    peak_rss_mb: float = 0.0  # process peak RSS after counting (includes touched memory-mapped pages)

    def top(self, n: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(ngrams int32 [min(t, t_n), n], counts) of the t most frequent n-grams."""
        if n not in self.ngrams:
            raise ValueError(f"n must lie in [1, {self.max_n}], got {n!r}")
        return self.ngrams[n][:t], self.counts[n][:t]


# ----------------------------------------------------------------------------------------------------------------
# Kernels. One merged entry = (shard s, position p); its m-prefix is tokens_s[p : p + m] cut at the first SEP.


@nb.njit(**_JIT)
def _prefix_cmp(ta, pa, tb, pb, m, sep) -> int:
    """Compare the SEP-cut m-prefixes at ta[pa:], tb[pb:]: -1, 0, 1 (SEP sorts after every token, as in the SA).

    Never reads past an array: each shard ends with SEP, and the loop returns at the first SEP.
    """
    for j in range(m):
        x = np.int64(ta[pa + j])
        y = np.int64(tb[pb + j])
        if x != y:
            return -1 if x < y else 1
        if x == sep:
            return 0
    return 0


@nb.njit(**_JIT)
def _lcp(ta, pa, tb, pb, m, sep) -> int:
    """Common prefix length of the two positions, capped at m, stopping at a separator."""
    j = 0
    while j < m:
        x = ta[pa + j]
        if x != tb[pb + j] or np.int64(x) == sep:
            break
        j += 1
    return j


@nb.njit(**_JIT)
def _valid_len(t, p, m, sep) -> int:
    """Tokens before the next separator, capped at m (an n-gram starts here iff n <= this)."""
    j = 0
    while j < m and np.int64(t[p + j]) != sep:
        j += 1
    return j


@nb.njit(**_JIT)
def _worse(hc, hq, a, b) -> bool:
    """Heap order: entry a ranks below b (fewer occurrences; equal counts -> later in lexicographic order)."""
    if hc[a] != hc[b]:
        return hc[a] < hc[b]
    return hq[a] > hq[b]


@nb.njit(**_JIT)
def _heap_push(hc, hq, hs, hp, size, cap, count, seq, s, p) -> int:
    """Bounded min-heap (root = worst kept entry) over rows hc/hq/hs/hp [cap]; returns the new size."""
    if cap == 0:
        return size
    if size < cap:
        i = size
        hc[i], hq[i], hs[i], hp[i] = count, seq, s, p
        while i > 0:
            parent = (i - 1) >> 1
            if _worse(hc, hq, i, parent):
                hc[i], hc[parent] = hc[parent], hc[i]
                hq[i], hq[parent] = hq[parent], hq[i]
                hs[i], hs[parent] = hs[parent], hs[i]
                hp[i], hp[parent] = hp[parent], hp[i]
                i = parent
            else:
                break
        return size + 1
    # Full: replace the root only by a strictly better entry (equal count + later seq is worse).
    if count < hc[0] or (count == hc[0] and seq > hq[0]):
        return size
    hc[0], hq[0], hs[0], hp[0] = count, seq, s, p
    i = 0
    while True:
        left = 2 * i + 1
        if left >= size:
            break
        w = left
        right = left + 1
        if right < size and _worse(hc, hq, right, left):
            w = right
        if _worse(hc, hq, w, i):
            hc[i], hc[w] = hc[w], hc[i]
            hq[i], hq[w] = hq[w], hq[i]
            hs[i], hs[w] = hs[w], hs[i]
            hp[i], hp[w] = hp[w], hp[i]
            i = w
        else:
            break
    return size


@nb.njit(**_JIT)
def _next_entry(toks, sas, n_shards, cursors, m, sep):
    """Pop the smallest m-prefix among the shards' cursors (ties -> lowest shard) -> (shard, position)."""
    best = -1
    for s in range(n_shards):
        if cursors[s] >= sas[s].shape[0]:
            continue
        if best < 0:
            best = s
        elif _prefix_cmp(toks[s], np.int64(sas[s][cursors[s]]), toks[best], np.int64(sas[best][cursors[best]]),
                         m, sep) < 0:
            best = s
    p = np.int64(sas[best][cursors[best]])
    cursors[best] += 1
    return best, p


@nb.njit(**_JIT)
def _close(k, run_len, run_s, run_p, run_ok, seq, distinct, total, hc, hq, hs, hp, hsize, cap):
    """End the current run of length k+1 n-grams: count it and offer it to that n's heap."""
    if run_len[k] > 0 and run_ok[k]:
        distinct[k] += 1
        total[k] += run_len[k]
        hsize[k] = _heap_push(hc[k], hq[k], hs[k], hp[k], hsize[k], cap, run_len[k], seq[k], run_s[k], run_p[k])
        seq[k] += 1


@nb.njit(**_JIT)
def scan_chunk(toks, sas, n_shards, sep, m, steps, cursors, state, run_len, run_s, run_p, run_ok, seq, distinct,
               total, hc, hq, hs, hp, hsize, cap) -> int:
    """Advance the merged scan by up to `steps` entries; returns how many were consumed (0 = done).

    toks/sas: tuples of shard arrays (entries >= n_shards are padding); cursors int64 [S] next SA index per shard;
    state int64 [3] = (entries seen, previous shard, previous position); per n (index k = n - 1): run_len,
    run_s, run_p, run_ok, seq, distinct, total int64 [m]; heaps hc, hq, hs, hp [m, cap], hsize [m].
    """
    remaining = 0
    for s in range(n_shards):
        remaining += sas[s].shape[0] - cursors[s]
    todo = min(steps, remaining)
    for _ in range(todo):
        s, p = _next_entry(toks, sas, n_shards, cursors, m, sep)
        if state[0] == 0:
            lcp = 0
        else:
            lcp = _lcp(toks[state[1]], state[2], toks[s], p, m, sep)
        vlen = -1
        for k in range(m):
            if k + 1 > lcp:
                _close(k, run_len, run_s, run_p, run_ok, seq, distinct, total, hc, hq, hs, hp, hsize, cap)
                if vlen < 0:
                    vlen = _valid_len(toks[s], p, m, sep)
                run_len[k] = 1
                run_s[k] = s
                run_p[k] = p
                run_ok[k] = 1 if vlen >= k + 1 else 0
            else:
                run_len[k] += 1
        state[0] += 1
        state[1] = s
        state[2] = p
    return todo


@nb.njit(**_JIT)
def finish(m, run_len, run_s, run_p, run_ok, seq, distinct, total, hc, hq, hs, hp, hsize, cap) -> None:
    for k in range(m):
        _close(k, run_len, run_s, run_p, run_ok, seq, distinct, total, hc, hq, hs, hp, hsize, cap)
        run_len[k] = 0


@nb.njit(**_JIT)
def gather_ngrams(toks, hs, hp, size, n):
    """Heap entries (shard, position) -> int32 [size, n] token rows."""
    out = np.empty((size, n), np.int32)
    for i in range(size):
        t = toks[hs[i]]
        for j in range(n):
            out[i, j] = t[hp[i] + j]
    return out


# ----------------------------------------------------------------------------------------------------------------
# Driver


def count_ngrams(datastore, max_n: int, top: int, *, progress: bool = True) -> NgramCounts:
    """Exact counts of every n-gram (n = 1..max_n) of `datastore`; keeps the `top` most frequent per n.

    datastore: an open SuffixArrayDatastore (any number of shards). Streaming: one pass over the merged suffix
    arrays; memory besides the memory-mapped shards is 4 int64 heaps of [max_n, top].
    """
    if isinstance(max_n, bool) or not isinstance(max_n, (int, np.integer)) or not 1 <= max_n <= 64:
        raise ValueError(f"max_n must be an integer in [1, 64], got {max_n!r}")
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 0:
        raise ValueError(f"top must be an integer >= 0, got {top!r}")
    shards = datastore.shards
    n_shards = len(shards)
    # Padded as the datastore pads them: one compiled scan serves 2-4 shards (and so on), not one per shard count.
    toks, sas = shard_tuple(shards, "tokens"), shard_tuple(shards, "sa")
    sep = shards[0].separator
    m = int(max_n)
    cursors = np.zeros(n_shards, np.int64)
    state = np.zeros(3, np.int64)
    run = [np.zeros(m, np.int64) for _ in range(7)]  # run_len, run_s, run_p, run_ok, seq, distinct, total
    hc, hq, hs, hp = (np.zeros((m, top), np.int64) for _ in range(4))
    hsize = np.zeros(m, np.int64)
    entries = sum(int(s.sa.shape[0]) for s in shards)
    with tqdm(total=entries, unit="pos", unit_scale=True, desc=f"count 1..{m}-grams", disable=not progress) as bar:
        while True:
            done = scan_chunk(toks, sas, n_shards, sep, m, _CHUNK, cursors, state, *run, hc, hq, hs, hp, hsize, top)
            if done == 0:
                break
            bar.update(done)
    finish(m, *run, hc, hq, hs, hp, hsize, top)
    distinct, total = run[5], run[6]
    ngrams, counts = {}, {}
    for k in range(m):
        size = int(hsize[k])
        order = np.lexsort((hq[k, :size], -hc[k, :size]))  # count desc, then lexicographic (scan order)
        ngrams[k + 1] = gather_ngrams(toks, hs[k, :size][order].astype(np.int64), hp[k, :size][order], size, k + 1)
        counts[k + 1] = hc[k, :size][order].copy()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return NgramCounts(m, ngrams, counts, {k + 1: int(distinct[k]) for k in range(m)},
                       {k + 1: int(total[k]) for k in range(m)}, peak)
