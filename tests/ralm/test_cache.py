"""The speculative cache ranks like the KB: whenever the KB's top-1 for a query is cached, the cache's top-1 is
that doc -- by local inner products (dense) and by ScoreCandidates (dense and BM25). Plus eviction scenarios."""

from __future__ import annotations

import numpy as np
import pytest

from generation_service.ralm.cache import PassageCache
from tests.knowledge.conftest import KNOWN


def _queries(kb_client, n: int = 24) -> list[str]:
    docs, _ = kb_client.get_documents(np.arange(6, 6 + n))
    words = [d.text.split() for d in docs]
    return [q for _, _, q in KNOWN] + [" ".join(w[len(w) // 3:len(w) // 3 + 12]) for w in words if w]


def _caches(kb_client, retriever: str, q: str, rng: np.random.Generator, total: int, rounds: int = 4):
    """Random caches for query q: half of them contain the KB's top-1, half not (-> (ids, top1, contains))."""
    top = kb_client.search(retriever, 1, texts=[q]).hits[0].top1
    for r in range(rounds):
        size = int(rng.integers(1, 20))
        ids = rng.choice(total, size=size, replace=False).astype(np.int64)
        if r % 2 == 0 and top not in ids:
            ids[int(rng.integers(0, size))] = top
        yield ids, top, top in ids


def test_local_ranking_agrees_with_kb(kb_client, rag_encoder, rag_kb):
    rng = np.random.default_rng(0)
    hits = 0
    for q in _queries(kb_client):
        qv = rag_encoder.encode_queries([q])[0]
        for ids, top, contains in _caches(kb_client, "edr", q, rng, len(rag_kb.passages)):
            _, vecs = kb_client.get_documents(ids, with_vectors=True)
            cache = PassageCache(64, vecs.shape[1])
            cache.add(ids, vecs)
            cache.check()
            got = cache.top1_local(qv)
            if contains:
                assert got == top  # Not another cached doc: verification would then always reject it
                hits += 1
            else:
                assert got != top and got in ids
    assert hits >= 10


@pytest.mark.parametrize("retriever", ["edr", "sr"])
def test_score_candidates_ranking_agrees_with_kb(kb_client, rag_kb, retriever):
    rng = np.random.default_rng(1)
    hits = 0
    for q in _queries(kb_client):
        for ids, top, contains in _caches(kb_client, retriever, q, rng, len(rag_kb.passages)):
            cache = PassageCache(64)
            cache.add(ids)
            cand_ids = cache.ids.copy()
            cand = kb_client.score_candidates(retriever, cand_ids, text=q)
            got = cache.top1_from_order(cand_ids, cand.order, cand.scores, unmatched_zero=retriever == "sr")
            if contains:
                assert got == top  # Not a doc ranked by another scoring
                hits += 1
            else:
                assert got != top  # sr: None when no cached doc shares a term with the query
    assert hits >= 10


def test_ties_go_to_the_smaller_id():
    cache = PassageCache(8, 2)
    cache.add(np.array([7, 3]), np.array([[1.0, 0.0], [1.0, 0.0]], np.float32))
    assert cache.top1_local(np.array([0.5, 0.5], np.float32)) == 3  # Not 7: the KB breaks ties by id


def test_eviction_keeps_recent_and_best_hits():
    cache = PassageCache(3)
    cache.add(np.array([1, 2, 3]))  # best first: 3 is the oldest stamp
    cache.add(np.array([4]))
    assert sorted(cache.ids.tolist()) == [1, 2, 4]  # Not [2, 3, 4]: the worst-ranked hit of the old search goes
    cache.touch(2)  # a speculation hit refreshes it
    cache.add(np.array([5]))
    assert sorted(cache.ids.tolist()) == [2, 4, 5]
    cache.add(np.array([4]))  # already cached: refreshed, not duplicated
    assert len(cache) == 3 and cache.evicted == 2
    cache.check()


@pytest.mark.parametrize("capacity,dim,err", [(0, 0, "cache_capacity"), (True, 0, "cache_capacity"),
                                              (4, -1, "dim")])
def test_bad_arguments_name_the_field(capacity, dim, err):
    with pytest.raises(ValueError, match=err):
        PassageCache(capacity, dim)
