"""BM25 (SR) against Lucene's own scores: every doc's raw score comes from IndexSearcher.explain."""

import numpy as np
import pytest

from retrieval_service.knowledge.sparse import CONTENTS

from .conftest import KNOWN

QUERIES = [q for _, _, q in KNOWN] + ["decode a JSON document", "insert into a sorted list", "wrap text",
                                      "the of and", "calendar month week day", "heap push pop smallest"]


def lucene_raw_scores(bm25, text: str) -> dict[int, float]:
    """Reference: Lucene's explanation of the BM25 score of every matching doc (raw, unrounded)."""
    query = bm25._generator.buildQuery(CONTENTS, bm25._analyzer, text)
    java = bm25.searcher.object  # io.anserini.search.SimpleSearcher
    searcher, reader = java.searcher, java.reader
    out = {}
    for d in range(reader.maxDoc()):
        e = searcher.explain(query, d)
        if e.isMatch():
            out[int(reader.document(d).get("id"))] = e.getValue().floatValue()
    return out


def lucene_order(raw: dict[int, float]) -> list[int]:
    return sorted(raw, key=lambda i: (-raw[i], i))  # Lucene: raw score, then the (zero-padded) id


@pytest.mark.parametrize("text", QUERIES)
def test_sr_search_ranks_by_lucene_scores(kb, text):
    raw = lucene_raw_scores(kb.bm25, text)
    hits = kb.search("sr", 10, texts=[text]).hits[0]
    assert hits.ids.tolist() == lucene_order(raw)[:10]
    # Anserini reports scores rounded to 1e-4, minus 1e-6 per tie.
    expected = np.array([round(raw[i], 4) for i in hits.ids.tolist()])
    np.testing.assert_allclose(hits.scores, expected, atol=1e-5)
    assert np.all(np.diff(hits.scores) < 0)


def test_sr_batched_search_equals_single_searches(kb):
    batched = kb.search("sr", 7, texts=QUERIES).hits
    for text, h in zip(QUERIES, batched):
        single = kb.search("sr", 7, texts=[text]).hits[0]
        assert h.ids.tolist() == single.ids.tolist()
        assert np.array_equal(h.scores, single.scores)


def test_sr_score_candidates_match_lucene(kb):
    rng = np.random.default_rng(0)
    n = len(kb.passages)
    for text in QUERIES:
        raw = lucene_raw_scores(kb.bm25, text)
        ids = rng.choice(n, size=12, replace=False)
        cs = kb.score_candidates("sr", ids, text=text)
        ranked = ids[cs.order].tolist()
        matched = [i for i in ranked if i in raw]
        assert matched == sorted(matched, key=lambda i: (-raw[i], i))
        assert ranked[:len(matched)] == matched                        # unmatched docs come last
        assert ranked[len(matched):] == sorted(ranked[len(matched):])  # ... by id
        for i, s, m in zip(ids.tolist(), cs.scores, cs.matched):
            assert m == (i in raw)
            assert s == 0.0 if not m else abs(s - round(raw[i], 4)) <= 1e-5


def test_sr_known_answers(kb):
    res = kb.search("sr", 3, texts=[q for _, _, q in KNOWN])
    assert [int(h.ids[0]) for h in res.hits] == list(range(len(KNOWN)))


def test_sr_stopword_only_query_finds_nothing(kb):
    hits = kb.search("sr", 5, texts=["the of and"]).hits[0]
    assert len(hits.ids) == 0 and hits.scores.dtype == np.float32


def test_sr_large_candidate_sets_use_the_term_set_filter(kb, monkeypatch):
    from retrieval_service.knowledge import sparse

    ids = np.arange(len(kb.passages))[::-1].copy()
    parsed_scores, parsed_rank = kb.bm25.score(QUERIES[7], ids)
    monkeypatch.setattr(sparse, "_MAX_PARSED_IDS", 4)  # force the TermInSetQuery path
    scores, rank = kb.bm25.score(QUERIES[7], ids)
    assert np.array_equal(scores, parsed_scores) and np.array_equal(rank, parsed_rank)


@pytest.mark.parametrize("text", ['json: "decode" (AND OR NOT) [x TO y] title:foo* \\ ~2 ^3 -- !', "ünïcödé 数据"])
def test_sr_query_syntax_is_just_text(kb, text):
    # Queries are analyzed as bags of words, never parsed: Lucene syntax cannot raise or change the meaning.
    hits = kb.search("sr", 5, texts=[text]).hits[0]
    cs = kb.score_candidates("sr", np.arange(10), text=text)
    assert len(hits.ids) <= 5 and len(cs.order) == 10
