"""RaLMSpec's per-request local cache of KB passages, and speculative retrieval over it.

The cache holds doc ids (and, for dense retrievers scored locally, their KB vectors). Speculation ranks the
cached docs for the current query with the retriever's own scoring, so the invariant verification relies on
holds: **if the KB's top-1 for a query is cached, the cache's top-1 is that doc.** Two ways to score:

- locally (dense retrievers, query vector in hand): `exact_scores` from retrieval_service.knowledge.dense, the
  very function the KB uses to re-score every hit (float64 accumulation, one rounding, so a (query, doc) score
  does not depend on which other docs are scored alongside), ties to the smaller id as the KB breaks them;
- remotely: ScoreCandidates, which returns Search's own order (BM25 needs Lucene's statistics).

Bounded: least recently added-or-hit entries go first (a speculation that hits an entry refreshes it), so
prefetching 256 docs per verification cannot grow the per-step ranking cost without limit.

Worked example: cache {7: v7, 3: v3}, query q with q·v7 = q·v3 = 0.5 -> top-1 is 3 (tie -> smaller id), as
the KB's Search would rank them.
"""

from __future__ import annotations

import numpy as np

from ragcore.encoder import exact_scores


class PassageCache:
    def __init__(self, capacity: int = 512, dim: int = 0):
        """capacity: max cached docs; dim: vector dimension for local scoring (0 = ids only)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"cache_capacity must be an integer >= 1, got {capacity!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise ValueError(f"dim must be an integer >= 0, got {dim!r}")
        self.capacity, self.dim = capacity, dim
        self._ids = np.empty(capacity, np.int64)  # live slots are [0, n)
        # float64 so scoring needs no per-call cast; float32 -> float64 is exact, so scores equal the KB's.
        self._vecs = np.empty((capacity, dim), np.float64) if dim else None
        self._stamp = np.zeros(capacity, np.int64)  # recency: larger = more recent
        self._slot: dict[int, int] = {}
        self._clock = 0
        self.n = 0
        self.evicted = 0

    def __len__(self) -> int:
        return self.n

    def __contains__(self, doc: int) -> bool:
        return int(doc) in self._slot

    @property
    def ids(self) -> np.ndarray:
        """int64 [n] cached doc ids (slot order, not ranked)."""
        return self._ids[:self.n]

    def add(self, ids: np.ndarray, vectors: np.ndarray | None = None) -> None:
        """ids: int64 [m] (best first, as a Search returns them), vectors: float32 [m, dim] when dim > 0."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if self.dim:
            if vectors is None or np.shape(vectors) != (len(ids), self.dim):
                raise ValueError(f"vectors: expected shape ({len(ids)}, {self.dim}), got "
                                 f"{None if vectors is None else np.shape(vectors)}")
        # Later (worse-ranked) hits get older stamps, so the best hits of a search survive eviction longest.
        for j in range(len(ids) - 1, -1, -1):
            doc = int(ids[j])
            self._clock += 1
            slot = self._slot.get(doc)
            if slot is None:
                if self.n < self.capacity:
                    slot = self.n
                    self.n += 1
                else:
                    slot = int(np.argmin(self._stamp[:self.n]))
                    del self._slot[int(self._ids[slot])]
                    self.evicted += 1
                self._slot[doc] = slot
                self._ids[slot] = doc
                if self._vecs is not None:
                    self._vecs[slot] = vectors[j]
            self._stamp[slot] = self._clock

    def touch(self, doc: int) -> None:
        slot = self._slot.get(int(doc))
        if slot is not None:
            self._clock += 1
            self._stamp[slot] = self._clock

    def top1_local(self, query: np.ndarray, metric: str = "ip") -> int | None:
        """query: float32 [dim] -> the cached doc the KB would rank first among the cached ones (None if empty)."""
        if self._vecs is None:
            raise ValueError("this cache keeps no vectors (dim=0); rank it with ScoreCandidates")
        if self.n == 0:
            return None
        scores = exact_scores(np.asarray(query, np.float32)[None, :], self._vecs[None, :self.n], metric)[0]  # [n]
        best = scores.max()
        doc = int(self._ids[:self.n][scores == best].min())  # ties -> smaller id, as the KB's rank_order
        self.touch(doc)
        return doc

    def top1_from_order(self, ids: np.ndarray, order: np.ndarray, scores: np.ndarray | None = None,
                        unmatched_zero: bool = False) -> int | None:
        """The first doc of a ScoreCandidates order over `ids`; with unmatched_zero (BM25) a best score of 0
        means no cached doc shares a term with the query, so the KB's top-1 is not cached: None."""
        if len(order) == 0:
            return None
        first = int(order[0])
        if unmatched_zero and scores is not None and float(scores[first]) <= 0.0:
            return None
        doc = int(ids[first])
        self.touch(doc)
        return doc

    def check(self) -> None:
        """Invariant checker (tests): slots and the id map agree, no duplicates."""
        live = self._ids[:self.n].tolist()
        if len(set(live)) != len(live):
            raise AssertionError("duplicate ids in the cache")
        if {d: s for s, d in enumerate(live)} != self._slot:
            raise AssertionError("slot map out of sync with the id array")
