"""Dense retrieval against brute-force numpy references: exact search, HNSW recall, re-scoring invariants."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragcore.encoder import exact_scores
from retrieval_service.knowledge import dense
from retrieval_service.knowledge.build import build_kb
from retrieval_service.knowledge.kb import KB_INDEX, KnowledgeBase

from .conftest import KNOWN, tiny_corpus


def brute_force(vectors: np.ndarray, queries: np.ndarray, k: int, metric: str = "ip"):
    """Reference: float64 scores, sorted by (-score, id)."""
    v, q = vectors.astype(np.float64), queries.astype(np.float64)
    scores = q @ v.T if metric == "ip" else -((q[:, None, :] - v[None]) ** 2).sum(-1)
    order = np.lexsort((np.broadcast_to(np.arange(len(v)), scores.shape), -scores), axis=-1)[:, :k]
    return order, np.take_along_axis(scores, order, -1)


def clustered(n: int, d: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((32, d))
    x = centers[rng.integers(0, 32, n)] + 0.5 * rng.standard_normal((n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("scores, ids, matched, expected", [
    ([1.0, 2.0, 2.0], [7, 9, 3], None, [2, 1, 0]),          # tie on 2.0 goes to id 3. Not [1, 2, 0]
    ([0.5, 0.5], [4, 2], None, [1, 0]),
    ([0.0, 0.1, 0.0], [1, 2, 0], [True, True, False], [1, 0, 2]),  # unmatched last even with a smaller id
])
def test_rank_order(scores, ids, matched, expected):
    assert dense.rank_order(np.array(scores, np.float32), np.array(ids), matched).tolist() == expected


@given(st.integers(1, 6), st.integers(1, 9), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_exact_scores_do_not_depend_on_batch_shape(b, k, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 24)).astype(np.float32)
    c = rng.standard_normal((b, k, 24)).astype(np.float32)
    full = exact_scores(q, c)
    for i in range(b):
        one = exact_scores(q[i:i + 1], c[i:i + 1, ::-1])[0][::-1]
        assert np.array_equal(full[i], one)  # bit-identical, the property ScoreCandidates relies on


@given(st.integers(1, 4), st.integers(1, 300), st.integers(1, 40), st.sampled_from(["ip", "l2"]),
       st.sampled_from([np.float16, np.float32]), st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_exact_scores_equal_the_float64_formula(b, k, d, metric, dtype, seed):
    """Bit for bit the one-shot float64 formula, also across the slices of candidates scored at a time."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, d)).astype(np.float32)
    c = rng.standard_normal((b, k, d)).astype(dtype)
    q64, c64 = q.astype(np.float64)[:, None, :], c.astype(np.float64)
    want = ((q64 * c64).sum(-1) if metric == "ip" else -((q64 - c64) ** 2).sum(-1)).astype(np.float32)
    assert np.array_equal(exact_scores(q, c, metric), want)


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_vector_index_exact_search_matches_brute_force(metric):
    x = clustered(2000, 32)
    queries = clustered(24, 32, seed=1)
    vi = dense.VectorIndex("t", metric, dense.build_flat(x, metric), vectors=x)
    for batch in (1, 5, 24):  # below and above faiss's BLAS threshold
        dense.configure_faiss(2)
        hits = vi.search(queries[:batch], 10)
        ref_ids, ref_scores = brute_force(x, queries[:batch], 10, metric)
        for (ids, scores), r_ids, r_scores in zip(hits, ref_ids, ref_scores):
            assert ids.tolist() == r_ids.tolist()
            np.testing.assert_allclose(scores, r_scores, rtol=1e-6, atol=1e-6)


# (stored dtype, kb_fp16_scan, batch size, how the exact search runs, which index proposes the candidates)
FP16_SCAN_CASES = [
    (np.float16, "kernel", 1, "kernel", "exact"),
    (np.float16, "kernel", 9, "kernel", "exact"),       # one pass for the batch: a group of 8, then 1
    (np.float16, "faiss", 1, "faiss-fp16", "exact_fp16"),
    (np.float16, "faiss", 4, "faiss-fp16", "exact_fp16"),
    (np.float16, "faiss", 5, "faiss-fp16", "exact"),    # above the cut: the float32 BLAS scan. Not once per query
    (np.float16, "off", 1, "faiss", "exact"),
    (np.float32, "kernel", 1, "faiss", "exact"),        # float32 vectors get no float16 scan: it would round them
    (np.float32, "faiss", 1, "faiss", "exact"),
]


@pytest.mark.parametrize("dtype, mode, batch, kind, proposer", FP16_SCAN_CASES)
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_exact_search_of_every_kind_gives_the_exact_answer(metric, dtype, mode, batch, kind, proposer,
                                                           monkeypatch):
    x = clustered(3000, 48).astype(dtype)
    queries = clustered(batch, 48, seed=7)
    exact, copy, vectors = dense.exact_indexes(x, metric, mode)
    vi = dense.VectorIndex("t", metric, exact, vectors=vectors, exact_fp16=copy)
    assert vi.exact_kind == kind
    assert vectors.dtype == dtype and np.array_equal(vectors, x)  # the kernel's in-memory rows are the stored ones
    used = []

    def recording(name: str, search):
        def wrapped(*args, **kwargs):
            used.append(name)
            return search(*args, **kwargs)
        return wrapped

    for name in ("exact", "exact_fp16"):
        if getattr(vi, name) is not None:
            monkeypatch.setattr(getattr(vi, name), "search", recording(name, getattr(vi, name).search))
    hits = vi.search(queries, 10)
    assert used == [proposer]
    ref_ids, ref_scores = brute_force(x.astype(np.float32), queries, 10, metric)
    for (ids, scores), r_ids, r_scores in zip(hits, ref_ids, ref_scores):
        assert ids.tolist() == r_ids.tolist()  # the float32 answer, whichever index proposed the candidates
        np.testing.assert_allclose(scores, r_scores, rtol=1e-5, atol=1e-5)


def test_unknown_fp16_scan_mode_is_named():
    with pytest.raises(ValueError, match="kb_fp16_scan"):
        dense.exact_indexes(np.zeros((4, 8), np.float16), "ip", "fast")


def test_fp16_scan_needs_the_float32_index_beside_it():
    x = clustered(100, 8).astype(np.float16)
    with pytest.raises(ValueError, match="float16 scan"):
        dense.VectorIndex("t", "ip", None, dense.build_hnsw(x.astype(np.float32), m=8, ef_construction=20),
                          vectors=x, exact_fp16=dense.build_fp16_scan(x))


def test_kb_edr_matches_brute_force(kb, encoder):
    vi = kb.vector_indexes[KB_INDEX]
    emb = np.asarray(vi.vectors, dtype=np.float32)
    queries = encoder.encode([q for _, _, q in KNOWN] + ["parse a CSV file", "priority queue push pop"])
    res = kb.search("edr", 8, vectors=queries)
    ref_ids, ref_scores = brute_force(emb, queries, 8)
    for h, r_ids, r_scores in zip(res.hits, ref_ids, ref_scores):
        assert h.ids.tolist() == r_ids.tolist()
        np.testing.assert_allclose(h.scores, r_scores, rtol=1e-6, atol=1e-6)
    # Text queries go through the same encoder: same hits as the vectors.
    by_text = kb.search("edr", 8, texts=[q for _, _, q in KNOWN])
    assert [h.ids.tolist() for h in by_text.hits] == [h.ids.tolist() for h in res.hits[:len(KNOWN)]]


def test_kb_known_answers_for_dense(kb):
    for retriever in ("edr", "adr"):
        res = kb.search(retriever, 3, texts=[q for _, _, q in KNOWN])
        assert [int(h.ids[0]) for h in res.hits] == list(range(len(KNOWN))), retriever


def test_hnsw_recall_floor():
    x = clustered(4000, 32)
    queries = clustered(200, 32, seed=2)
    vi = dense.VectorIndex("t", "ip", dense.build_flat(x), dense.build_hnsw(x, "ip", m=16, ef_construction=80),
                           vectors=x, default_ef_search=64)
    exact = np.stack([ids for ids, _ in vi.search(queries, 10)])
    approx = np.stack([ids for ids, _ in vi.search(queries, 10, approx=True)])
    assert dense.recall_at(approx, exact, 1) >= 0.95
    assert dense.recall_at(approx, exact, 10) >= 0.90
    # A tiny efSearch must not be able to break the floor silently: recall grows with efSearch.
    low = np.stack([ids for ids, _ in vi.search(queries, 10, approx=True, ef_search=10)])
    assert dense.recall_at(low, exact, 10) <= dense.recall_at(approx, exact, 10)


def test_kb_adr_recall_is_exact_on_the_tiny_kb(kb, encoder):
    queries = encoder.encode([f"{t} {x}" for t, x in kb.passages.get(range(0, len(kb.passages), 6))])
    exact = [h.ids for h in kb.search("edr", 10, vectors=queries).hits]
    approx = [h.ids for h in kb.search("adr", 10, vectors=queries).hits]
    assert dense.recall_at(np.stack(approx), np.stack(exact), 1) == 1.0
    assert dense.recall_at(np.stack(approx), np.stack(exact), 10) >= 0.98


def test_named_vector_index_is_searchable_through_the_kb(kb):
    x = clustered(300, 16, seed=5)
    kb.add_vector_index(dense.VectorIndex("keys", "l2", dense.build_flat(x, "l2"), vectors=x))
    res = kb.search("edr", 4, vectors=x[:3], index="keys")
    assert [int(h.ids[0]) for h in res.hits] == [0, 1, 2]  # each key is its own nearest neighbour
    assert all(h.scores[0] == 0.0 for h in res.hits)       # minus squared L2 distance
    cs = kb.score_candidates("edr", np.array([5, 0, 9]), vector=x[0], index="keys")
    assert cs.order[0] == 1


def test_load_vector_index_from_files(tmp_path):
    x = clustered(500, 8, seed=3)
    dense.faiss.write_index(dense.build_flat(x, "l2"), str(tmp_path / "keys.faiss"))
    dense.faiss.write_index(dense.build_hnsw(x, "l2", m=8, ef_construction=40), str(tmp_path / "keys.hnsw"))
    np.save(tmp_path / "keys.npy", x)
    vi = dense.load_vector_index("keys", metric="l2", exact_path=tmp_path / "keys.faiss",
                                 approx_path=tmp_path / "keys.hnsw", vectors_path=tmp_path / "keys.npy")
    assert vi.retrievers == ["edr", "adr"] and (vi.size, vi.dim) == (500, 8)
    assert [int(h[0][0]) for h in vi.search(x[:5], 3, approx=True)] == [0, 1, 2, 3, 4]
    (tmp_path / "bad.faiss").write_bytes(b"junk")
    with pytest.raises(ValueError, match="bad.faiss"):
        dense.load_vector_index("bad", metric="ip", exact_path=tmp_path / "bad.faiss")


def test_thread_cap_needs_a_call_in_each_thread():
    # OpenMP's thread count is per thread: the cap set in the main thread does not reach threads started later
    # (the gRPC handlers that run Search), which is why the retrieval server passes configure_faiss as the
    # handler threads' initializer. Both halves are checked.
    import os
    import threading

    import faiss

    dense.configure_faiss(1)
    seen: dict[str, int] = {}

    def probe(name: str, initialize: bool) -> None:
        if initialize:
            dense.configure_faiss(1)
        seen[name] = faiss.omp_get_max_threads()

    for name, initialize in (("bare", False), ("initialized", True)):
        t = threading.Thread(target=probe, args=(name, initialize))
        t.start()
        t.join()
    assert faiss.omp_get_max_threads() == 1 and seen["initialized"] == 1
    if (os.cpu_count() or 1) > 1 and not os.environ.get("OMP_NUM_THREADS"):
        assert seen["bare"] > 1  # Not 1: the main thread's cap did not carry over


@pytest.mark.parametrize("fp16_scan, kind", [("kernel", "kernel"), ("faiss", "faiss-fp16"), ("off", "faiss")])
def test_float16_kb_answers_as_its_float32_rows_do(tmp_path, kb_config, encoder, fp16_scan, kind):
    """A KB built with --float16: exact search through KnowledgeBase.open, in each kb_fp16_scan mode and (faiss)
    below and above the float16 copy's batch cut, gives the brute-force answer over the stored float16 rows."""
    build_kb(tmp_path, tiny_corpus(), retrievers=("edr",), corpus={"source": "tests-fp16"}, dtype="float16",
             encoder=encoder, progress=False)
    kb = KnowledgeBase.open(tmp_path, replace(kb_config, kb_fp16_scan=fp16_scan), encoder=encoder)
    try:
        vi = kb.vector_indexes[KB_INDEX]
        assert vi.vectors.dtype == np.float16
        assert vi.exact_kind == kind
        texts = [q for _, _, q in KNOWN] + ["parse a CSV file", "priority queue push pop", "open a socket"]
        queries = encoder.encode(texts)
        ref_ids, _ = brute_force(np.asarray(vi.vectors, np.float32), queries, 6)
        for batch in (1, 3, len(texts)):  # faiss: its float16 copy, then (above the cut) the float32 index
            res = kb.search("edr", 6, vectors=queries[:batch])
            assert [h.ids.tolist() for h in res.hits] == ref_ids[:batch].tolist()
    finally:
        kb.close()
