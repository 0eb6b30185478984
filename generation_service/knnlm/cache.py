"""The per-request neighbour cache RaLMSpec speculates from: successor entries of every real retrieval, searched
exactly by key in process.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from typing import Sequence

import numpy as np
import torch

from generation_service.knnlm.options import F16_DOT_MAX
from ragcore.knn_store import KnnDatastore

log = logging.getLogger(__name__)

_STAGING = threading.local()
NORM_ROWS = 2048  # rows per float32 temporary of squared_norms (4.7 MB at D = 576)


def _staging(rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, dim] buffer of this thread, kept between calls: a fill gathers its keys into it. Why: a fresh
    16 K x 576 array page-faults its 19 MB (float16) at every fill. Per thread: caches fill on the engine's model
    thread, one at a time, so one buffer serves all its requests."""
    buf = getattr(_STAGING, "buf", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] != dim or buf.dtype != dtype:
        buf = _STAGING.buf = torch.empty((rows, dim), dtype=dtype)
    return buf[:rows]


def squared_norms(keys: torch.Tensor) -> np.ndarray:
    """keys float16|float32 [m, D] -> ‖key‖² float32 [m], summed in float32. In slices of NORM_ROWS: one float32
    copy of 16 K rows (38 MB) is fresh memory at every call, and faulting it in took most of the call's time."""
    out = np.empty(len(keys), np.float32)
    for i in range(0, len(keys), NORM_ROWS):
        rows = keys[i:i + NORM_ROWS]
        out[i:i + NORM_ROWS] = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square_().numpy()
    return out


def oldest(stamp: np.ndarray, m: int) -> np.ndarray:
    """stamp: int [C] fill rounds (-1 = empty) -> m slot indices with the smallest stamps (among equal stamps,
    the first slots). Two passes over the few distinct rounds, not np.argpartition: the stamps take a handful of
    values, which made its selection a visible cost per fill.

    oldest([3, -1, 2, 3, 2], 3) -> [1, 2, 4]
    """
    rounds, counts = np.unique(stamp, return_counts=True)  # ascending
    if m >= stamp.size:
        return np.arange(stamp.size)
    t = int(np.searchsorted(np.cumsum(counts), m))  # the round where the m-th oldest slot falls
    below = np.flatnonzero(stamp < rounds[t])
    return np.concatenate((below, np.flatnonzero(stamp == rounds[t])[: m - below.size]))


def key_norms(ds: KnnDatastore) -> np.ndarray:
    """‖key‖² float32 [N] of every datastore entry, as squared_norms computes a fill's. Once per worker, at start:
    it reads every key once (1.15 GB for 1 M x 576 float16, usually in the page cache from the retrieval service;
    a fraction of a second) and keeps 4 MB."""
    t = time.perf_counter()
    with warnings.catch_warnings():  # "not writable": only read
        warnings.simplefilter("ignore", UserWarning)
        out = squared_norms(torch.from_numpy(ds.keys))
    log.info("kNN-LM datastore %s: key norms of %d entries in %.1f s", ds.path, ds.size, time.perf_counter() - t)
    return out


class NeighbourCache:
    """RaLMSpec's kNN-LM cache: datastore entries (id, key, value) filled by spatial locality.

    fill(ids) adds entries j+1..j+n for every retrieved entry j (not j itself: j's value is the token that
    followed j's context, j+1 is the entry one token later). When full, the entries filled longest ago are
    replaced (an entry filled again counts as new). nearest(q, k) is the speculative retrieval: the k cached
    entries closest to q in L2, best first.

    fill_top = m keeps only the successors of the m best retrieved entries (a Search's order); 0 = of all.

    Storage is preallocated [capacity, D] and overwritten in place: with k = 1024, n = 10 and every neighbour a
    fill brings ~10^4 entries, and growing arrays by concatenation would copy the whole cache (~40 MB) on every
    token.
    Keys stay in the datastore's dtype. With float16 keys (the builder's default) a fill copies rows as they are
    and a look-up reads half the bytes: replayed fills and look-ups ran at less than half the time (also: no copy
    of the filled slots while the cache is not full). The look-up's q·key is then rounded to float16 (~11 bits),
    which moved no guess: replayed baseline trajectories gave the same guesses' accuracy in both precisions (the
    look-up only guesses; the Search decides).
    """

    def __init__(self, datastore: KnnDatastore, next_n: int = 10, capacity: int = 16384,
                 norms: np.ndarray | None = None, fill_top: int = 0):
        self.ds, self.next_n, self.capacity = datastore, next_n, capacity
        self.fill_top = fill_top  # successors of each query's `fill_top` best neighbours only (0 = of all)
        # ‖key‖² float32 [N] of every datastore entry (KnnBackend.key_norms), gathered at a fill; None = computed
        # from the filled rows.
        self._ds_norms = norms
        d = datastore.dim
        self.ids = np.full(capacity, -1, np.int64)  # [C] entry id per slot, -1 = empty
        half = datastore.keys.dtype == np.float16
        self.keys = torch.zeros((capacity, d), dtype=torch.float16 if half else torch.float32)  # [C, D]
        self.norms = np.zeros(capacity, np.float32)  # [C] ‖key‖² (from the stored key, in float32)
        # Largest ‖key‖ cached: bounds |q·key| so a float16 product can be scaled below float16's overflow.
        self._max_norm = 0.0
        self._keys = self.keys.numpy()  # the same memory, for numpy's row writes
        with warnings.catch_warnings():  # "not writable": this view is only read
            warnings.simplefilter("ignore", UserWarning)
            self._ds_keys = torch.from_numpy(datastore.keys)
        self.values = np.zeros(capacity, np.int64)  # [C]
        self.stamp = np.full(capacity, -1, np.int64)  # [C] fill round (-1 = empty), for eviction
        # [N] slot of each datastore entry, -1 = not cached: membership by one gather instead of np.isin over the
        # whole cache at every fill (4 MB per request for 1 M entries, allocated at the first fill).
        self._slot_of: np.ndarray | None = None
        self._round = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def cached_ids(self) -> np.ndarray:
        """The entry ids in the cache, ascending (for tests and stats)."""
        return np.sort(self.ids[self.ids >= 0])

    def successors(self, retrieved: np.ndarray) -> np.ndarray:
        """retrieved: entry ids [m] -> unique ids j+1..j+n inside the datastore, ascending.

        successors([5, 6]) with n = 3 -> [6, 7, 8, 9]   # not [5, 6, ...]: a retrieved entry is not its own successor
        """
        # The union of the runs [j+1, j+n] as pieces of consecutive ids, not np.unique over all m * n of them
        # (an order of magnitude cheaper, and it runs several times per round).
        start = np.sort(np.asarray(retrieved, dtype=np.int64)) + 1  # [m] run starts, ascending
        end = np.minimum(start + self.next_n, self.ds.size)  # [m] exclusive, clipped at the datastore's end
        keep = start < end
        start, end = start[keep], end[keep]
        if start.size == 0:
            return np.zeros(0, np.int64)
        new_piece = np.ones(start.size, bool)
        new_piece[1:] = start[1:] > np.maximum.accumulate(end)[:-1]  # touches no earlier run
        first = np.flatnonzero(new_piece)
        lo, hi = start[first], np.maximum.reduceat(end, first)  # [p] pieces [lo, hi)
        lengths = hi - lo
        before = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # ids of earlier pieces
        return np.repeat(lo - before, lengths) + np.arange(lengths.sum())

    def fill(self, retrieved: np.ndarray) -> int:
        """Add the successors of one query's retrieved entries; returns how many entries were new."""
        return self.fill_many([retrieved])

    def _wanted(self, retrieved: Sequence[np.ndarray]) -> np.ndarray:
        """Successor ids of several queries, latest query first, unique, at most `capacity` of them (ascending
        within each query). Stops at the query that fills the cache: with k = 1024, n = 10 and every neighbour one
        query brings ~10^4 entries, so the older queries of a long round would only be sorted to be dropped."""
        taken = np.zeros(0, np.int64)  # sorted union so far
        runs: list[np.ndarray] = []
        n = 0
        for r in reversed(retrieved):
            succ = self.successors(r[: self.fill_top] if self.fill_top else r)
            if n:
                succ = succ[~np.isin(succ, taken, assume_unique=True)]
            runs.append(succ[: self.capacity - n])
            n += len(runs[-1])
            if n >= self.capacity:
                break
            taken = np.sort(np.concatenate((taken, succ)))  # disjoint: succ holds only ids not taken
        return np.concatenate(runs) if runs else np.zeros(0, np.int64)

    def fill_many(self, retrieved: Sequence[np.ndarray]) -> int:
        """fill() for several queries' retrieved entries (in query order) as one update; returns how many entries
        were new. One datastore gather instead of one per query: consecutive queries' successors overlap heavily
        (entry j+1 is often the next query's neighbour). When they do not all fit, later queries' successors win,
        as with successive fills; within one query the lowest ids do."""
        self._round += 1
        succ = np.sort(self._wanted(retrieved))  # ascending ids read the memmap in order
        if succ.size == 0:
            return 0
        if self._slot_of is None:
            self._slot_of = np.full(self.ds.size, -1, np.int32)
        slot = self._slot_of[succ]
        known = slot >= 0
        self.stamp[slot[known]] = self._round  # refreshed: kept as long as new entries
        new = succ[~known]
        if new.size:
            # Slots: empty ones first, then the oldest fills (this round's refreshed entries are never evicted
            # while older ones remain, since their stamp is the largest).
            slots = oldest(self.stamp, new.size)
            old = self.ids[slots]
            self._size += int(np.count_nonzero(old < 0))
            self._slot_of[old[old >= 0]] = -1
            self._slot_of[new] = slots
            keys = _staging(new.size, self.keys.shape[1], self.keys.dtype)
            # [m, D], ascending ids: the memmap in order. torch's gather, not np.take: several times faster.
            torch.index_select(self._ds_keys, 0, torch.from_numpy(new), out=keys)
            self.ids[slots] = new
            self._keys[slots] = keys.numpy()  # numpy's row writes: cheaper than index_copy_
            # The datastore's norms when the cache has them: computing them was over a quarter of a fill.
            norms = self._ds_norms[new] if self._ds_norms is not None else squared_norms(keys)
            self.norms[slots] = norms
            self._max_norm = max(self._max_norm, math.sqrt(float(norms.max())))
            self.values[slots] = np.asarray(self.ds.values[new], dtype=np.int64)
            self.stamp[slots] = self._round
        return int(new.size)

    def nearest(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """query: float32 [D] -> (ids [m], scores float32 [m] = −‖q − key‖², values [m]), m = min(k, len), best
        first (ties: smaller id). With float16 keys q·key is rounded to float16 (relative error ~2^-11), so
        entries closer than that may trade places: a guess, which the verification Search settles."""
        if self._size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
        q = np.asarray(query, dtype=np.float32)
        dots = self._dots(q)  # [C] q·key, one GEMV instead of [C, D] differences
        scores = 2.0 * dots - self.norms - float(q @ q)
        if self._size < self.capacity:
            scores[self.ids < 0] = -np.inf
        m = min(k, self._size)
        part = torch.topk(torch.from_numpy(scores), m, sorted=False).indices.numpy()
        order = part[np.lexsort((self.ids[part], -scores[part]))]
        return self.ids[order], scores[order].astype(np.float32), self.values[order]

    def _dots(self, q: np.ndarray) -> np.ndarray:
        """q float32 [D] -> q·key float32 [C] over every slot (empty ones too)."""
        if self.keys.dtype == torch.float32:
            return self.keys.numpy() @ q  # numpy's GEMV: about a third of torch.mv's time here
        # A power of two keeps q exact in float16's range and |q·key| <= ‖q‖·max‖key‖ below its overflow.
        shift = max(0, math.ceil(math.log2(max(float(np.linalg.norm(q)) * self._max_norm, 1.0) / F16_DOT_MAX)))
        q16 = torch.from_numpy(q * np.float32(2.0 ** -shift)).to(torch.float16)
        dots = torch.nn.functional.linear(q16[None], self.keys)[0].float()
        return dots.numpy() * np.float32(2.0 ** shift)


