"""Exact Searches that wait for the knowledge base at the same time run as one batched search.

Why: an exact scan streams every stored vector once whatever the number of queries (4 queries cost about as much as
one), while the KB executor runs one call at a time
(`kb_workers` 1). So four kNN-LM requests each searching one query waited for four scans one after the other;
searched together they cost about one. Only exact (`edr`) searches join: their results are exact, so the top k
of a search with a larger k is the same answer, and the candidates of one query do not depend on the others
(every returned score is recomputed from the stored vectors). HNSW results depend on k and efSearch, and BM25
takes text batches of its own, so those run alone.

    coalescer = SearchCoalescer(kb.search, max_queries=64, max_results=65536)
    call = SearchCall(("edr", "knnlm", 0), k=1024, texts=None, vectors=q, gone=lambda: False)
    coalescer.add(call)               # on the gRPC handler thread, before the call queues for the executor
    try:
        result = coalescer.run(call)  # on the executor: searched with every call added meanwhile (or done already)
    finally:
        coalescer.discard(call)

A batch is the calls added while the executor was busy, in arrival order, up to `max_queries` queries and
`max_results` queries x k. A batch that fails with a request error (one call's bad text) is searched again call
by call, so the error reaches only its own caller.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import numpy as np

from retrieval_service.knowledge.kb import Hits, KBInputError, SearchResult, SearchStopped

log = logging.getLogger(__name__)
# search(retriever, k, texts=..., vectors=..., index=..., ef_search=..., should_stop=...) -> SearchResult
SearchFn = Callable[..., SearchResult]
# The longest a search waits for the calls it expects, as a share of the group's last search: a wait that pays
# saves a whole search for the calls it gathers.
WAIT_SHARE = 0.5


@dataclass(eq=False)
class SearchCall:
    """One Search's queries: texts or vectors [n, D]; key = (retriever, index, ef_search): calls join only
    calls of the same key (and the same kind of query)."""

    key: tuple[str, str, int]
    k: int
    texts: Sequence[str] | None
    vectors: np.ndarray | None
    gone: Callable[[], bool]  # the caller cancelled or its deadline passed
    result: SearchResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False  # in a batch (searched, being searched, or dropped)

    @property
    def n(self) -> int:
        return len(self.texts) if self.texts else (0 if self.vectors is None else len(self.vectors))

    @property
    def group(self) -> Hashable:
        return self.key, bool(self.texts)

    def outcome(self) -> SearchResult:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def split_result(result: SearchResult, calls: Sequence[SearchCall]) -> list[SearchResult]:
    """One batched SearchResult -> each call's own: its queries' hits (cut to its k) and query vectors.

    split_result(hits of 3 queries, calls of n = 1 and 2, k = 5 and 2) -> [hits[0][:5]], [hits[1][:2], hits[2][:2]]
    """
    out, start = [], 0
    for c in calls:
        hits = [Hits(h.ids[:c.k], h.scores[:c.k]) for h in result.hits[start:start + c.n]]
        qv = None if result.query_vectors is None else result.query_vectors[start:start + c.n]
        out.append(SearchResult(hits, qv, result.encode_ms, result.search_ms))
        start += c.n
    return out


class SearchCoalescer:
    def __init__(self, search: SearchFn, max_queries: int, max_results: int, wait_share: float = WAIT_SHARE):
        self._search = search
        self.max_queries, self.max_results = max_queries, max_results
        self.wait_share = wait_share
        self._pending: list[SearchCall] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Per group: calls its next search expects (its last batch + the calls that arrived while it ran), that
        # search's seconds, and calls added since it started.
        self._expect: dict[Hashable, int] = {}
        self._search_s: dict[Hashable, float] = {}
        self._arrived: dict[Hashable, int] = {}
        self.batches = 0  # searches run (for stats and tests)
        self.joined = 0  # calls answered by another call's search
        self.waits = 0  # searches that waited for expected calls

    def add(self, call: SearchCall) -> None:
        with self._cond:
            self._pending.append(call)
            self._arrived[call.group] = self._arrived.get(call.group, 0) + 1
            self._cond.notify_all()

    def discard(self, call: SearchCall) -> None:
        """The call's handler is done (answered, rejected or failed): never search it."""
        with self._lock:
            if call in self._pending:
                self._pending.remove(call)

    def run(self, call: SearchCall) -> SearchResult:
        """The call's result: already there (another call's search took it), being searched by another executor
        thread (wait), or searched now with the compatible calls still pending."""
        with self._cond:
            if not call.taken:
                self._gather(call)
            batch = [] if call.taken else self._take(call)  # not added: a batch of its own
            self._arrived[call.group] = 0
        if not batch:
            call.done.wait()
            return call.outcome()
        t0 = time.perf_counter()
        self._run_batch(batch)
        with self._cond:
            self._search_s[call.group] = time.perf_counter() - t0
            self._expect[call.group] = len(batch) + self._arrived.get(call.group, 0)
        log.debug("search of %d calls (%d queries) in %.1f ms; %d calls came meanwhile", len(batch),
                  sum(c.n for c in batch), self._search_s[call.group] * 1e3, self._expect[call.group] - len(batch))
        return call.outcome()

    def _gather(self, call: SearchCall) -> None:
        """(Lock held.) Wait, at most wait_share of the group's last search, until as many calls of the group are
        pending as its last search expects. Why: closed-loop clients split into halves that take turns (a half's
        next calls come back while the other half's search runs), one search each; waiting a few ms once for the
        half about to return puts them back in step, one search for all."""
        g = call.group
        want = self._expect.get(g, 1)
        deadline = time.monotonic() + self.wait_share * self._search_s.get(g, 0.0)
        waited = False
        while not call.taken and 1 + sum(c.group == g and c is not call for c in self._pending) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waited = True
            self._cond.wait(left)
        self.waits += waited

    def _take(self, call: SearchCall) -> list[SearchCall]:
        """`call` and the pending calls of its group that fit beside it, in arrival order; removed from pending.
        Calls whose callers left are dropped (answered with SearchStopped)."""
        batch, n, k = [call], call.n, call.k
        for c in self._pending:
            if c is call or c.group != call.group:
                continue
            if c.gone():
                c.error, c.taken = SearchStopped("the call ended while it waited for the knowledge base"), True
                c.done.set()
                continue
            kk = max(k, c.k)
            if n + c.n > self.max_queries or (n + c.n) * kk > self.max_results:
                continue
            batch.append(c)
            n, k = n + c.n, kk
        for c in batch:
            c.taken = True
        self._pending = [c for c in self._pending if not c.taken]
        return batch

    def _run_batch(self, batch: list[SearchCall]) -> None:
        if len(batch) > 1:
            try:
                results = split_result(self._search_all(batch), batch)
            except KBInputError:
                results = None  # one call's input: each alone, so only that caller gets the error
            except BaseException as e:  # the KB failed (or every caller left): each caller gets the error
                results = [e] * len(batch)
            if results is not None:
                self.batches += 1
                self.joined += len(batch) - 1
                for c, r in zip(batch, results):
                    c.error, c.result = (r, None) if isinstance(r, BaseException) else (None, r)
                    c.done.set()
                return
        for c in batch:
            try:
                c.result = self._search_all([c])
            except BaseException as e:
                c.error = e
            self.batches += 1
            c.done.set()

    def _search_all(self, calls: list[SearchCall]) -> SearchResult:
        retriever, index, ef_search = calls[0].key
        k = max(c.k for c in calls)
        if calls[0].texts:
            texts, vectors = [t for c in calls for t in c.texts], None
        else:
            texts, vectors = None, np.concatenate([np.atleast_2d(c.vectors) for c in calls])
        return self._search(retriever, k, texts=texts, vectors=vectors, index=index, ef_search=ef_search,
                            should_stop=lambda: all(c.gone() for c in calls))
