"""KnowledgeBase: the ScoreCandidates ordering property, input validation, opening a bad KB, resumed builds."""

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import passages as P
from retrieval_service.knowledge.build import build_kb
from retrieval_service.knowledge.kb import KBInputError, KBOpenError, KnowledgeBase, RetrieverUnavailable

from .conftest import KNOWN, tiny_corpus

RETRIEVERS = ["edr", "adr", "sr"]
QUERY_WORDS = ("json decode string list sorted insert heap push pop calendar month text wrap fraction csv "
               "reader writer dialect capital mountain coffee volcano chess plants sunlight error index").split()


def window_query(kb, doc: int, start: int, length: int) -> str:
    """A query as RaLMSpec makes them: a window of words (here from a passage, so it has matches)."""
    title, text = kb.passages.get([doc])[0]
    words = (title + " " + text).split()
    start = start % max(1, len(words) - 1)
    return " ".join(words[start:start + length])


queries = st.one_of(
    st.lists(st.sampled_from(QUERY_WORDS), min_size=1, max_size=6).map(" ".join),
    st.tuples(st.integers(0, 10_000), st.integers(0, 200), st.integers(3, 32)),
)


@pytest.mark.parametrize("retriever", RETRIEVERS)
@given(query=queries, data=st.data())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_score_candidates_top1_property(kb, retriever, query, data):
    n = len(kb.passages)
    text = query if isinstance(query, str) else window_query(kb, query[0] % n, query[1], query[2])
    hits = kb.search(retriever, 10, texts=[text]).hits[0]
    cands = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=20, unique=True), label="candidates")
    if len(hits.ids) and data.draw(st.booleans(), label="include top-1"):
        pos = data.draw(st.integers(0, len(cands)), label="position")
        cands = cands[:pos] + [int(hits.ids[0])] + cands[pos:]
        cands = list(dict.fromkeys(cands))
    cs = kb.score_candidates(retriever, np.array(cands), text=text)
    assert sorted(cs.order.tolist()) == list(range(len(cands)))
    if len(hits.ids) and int(hits.ids[0]) in cands:
        assert cands[cs.order[0]] == int(hits.ids[0])  # the KB's top-1 is the cache's top-1
    # Any doc both lists hold gets the same score (dense: bit-identical; BM25: up to Anserini's tie offsets).
    tol = 0.0 if retriever != "sr" else 1e-5
    for i, s in zip(hits.ids.tolist(), hits.scores):
        if i in cands:
            assert abs(cs.scores[cands.index(i)] - s) <= tol


@pytest.mark.parametrize("retriever", RETRIEVERS)
def test_score_candidates_ranks_the_full_top_k_like_search(kb, retriever):
    for _, _, text in KNOWN:
        hits = kb.search(retriever, 10, texts=[text]).hits[0]
        shuffled = np.random.default_rng(1).permutation(hits.ids)
        cs = kb.score_candidates(retriever, shuffled, text=text)
        assert shuffled[cs.order].tolist() == hits.ids.tolist()


def test_query_vectors_can_be_reused(kb):
    res = kb.search("edr", 5, texts=["heap push pop"])
    again = kb.search("edr", 5, vectors=res.query_vectors)
    assert again.hits[0].ids.tolist() == res.hits[0].ids.tolist()
    cs = kb.score_candidates("edr", res.hits[0].ids, vector=res.query_vectors[0])
    assert np.array_equal(cs.scores, res.hits[0].scores)


@pytest.mark.parametrize("call, field", [
    (lambda kb: kb.search("edr", 5, texts=[]), "texts"),                            # empty batch
    (lambda kb: kb.search("edr", 5, texts=["q"] * 17), "texts"),                    # oversized (limit 16)
    (lambda kb: kb.search("sr", 5, texts=["q"] * 17), "texts"),
    (lambda kb: kb.search("edr", 0, texts=["q"]), "k"),
    (lambda kb: kb.search("edr", 51, texts=["q"]), "k"),                             # limit 50
    (lambda kb: kb.search("bm42", 5, texts=["q"]), "retriever"),
    (lambda kb: kb.search("edr", 5, vectors=np.zeros((2, 7), np.float32)), "vectors"),  # wrong dimension
    (lambda kb: kb.search("edr", 5, vectors=np.full((1, 384), np.nan, np.float32)), "vectors"),
    (lambda kb: kb.search("sr", 5, vectors=np.zeros((1, 384), np.float32)), "vectors"),
    (lambda kb: kb.search("edr", 5, texts=["   "]), "texts[0]"),
    (lambda kb: kb.search("edr", 5, texts=["q"], index="nope"), "index"),
    (lambda kb: kb.score_candidates("edr", np.array([0, 10**6]), text="q"), "ids[1]"),  # unknown doc id
    (lambda kb: kb.score_candidates("sr", np.array([-1]), text="q"), "ids[0]"),
    (lambda kb: kb.score_candidates("edr", np.array([], np.int64), text="q"), "ids"),
    (lambda kb: kb.score_candidates("edr", np.arange(65), text="q"), "ids"),          # limit 64
    (lambda kb: kb.score_candidates("edr", np.array([1]), text=""), "text"),
    (lambda kb: kb.documents(np.array([3, 999_999])), "ids[1]"),
])
def test_bad_input_names_the_field(kb, call, field):
    with pytest.raises(KBInputError) as e:
        call(kb)
    assert str(e.value).startswith(field + ":") or str(e.value).startswith(field + " "), str(e.value)


def test_absent_retriever_is_unavailable(edr_only_kb):
    assert edr_only_kb.retrievers == ["edr"]
    assert len(edr_only_kb.search("edr", 3, texts=["x"]).hits[0].ids) == 3
    for retriever in ("adr", "sr"):
        with pytest.raises(RetrieverUnavailable):
            edr_only_kb.search(retriever, 3, texts=["x"])
        with pytest.raises(RetrieverUnavailable):
            edr_only_kb.score_candidates(retriever, np.array([0]), text="x")


def test_open_refuses_missing_and_corrupted_kbs(tmp_path, kb_dir, kb_config, encoder):
    with pytest.raises(KBOpenError, match="no kb.json"):
        KnowledgeBase.open(tmp_path / "missing", kb_config, encoder=encoder)
    bad = tmp_path / "bad"
    shutil.copytree(kb_dir, bad)
    np.save(bad / "dense" / "embeddings.npy", np.zeros((3, 384), np.float32))  # truncated embeddings
    with pytest.raises(KBOpenError, match="embeddings.npy"):
        KnowledgeBase.open(bad, RetrievalConfig(kb_retrievers="edr"), encoder=encoder, warmup=False)
    shutil.rmtree(bad)
    shutil.copytree(kb_dir, bad)
    (bad / "dense" / "hnsw.faiss").write_bytes(b"not a faiss index")
    with pytest.raises(KBOpenError, match="hnsw.faiss"):
        KnowledgeBase.open(bad, RetrievalConfig(kb_retrievers="adr"), encoder=encoder, warmup=False)
    shutil.rmtree(bad)
    shutil.copytree(kb_dir, bad)
    with open(bad / "passages.jsonl", "r+b") as f:  # same length, different bytes
        f.seek(10)
        f.write(b"X")
    with pytest.raises(KBOpenError, match="passages.jsonl is corrupted: checksum"):
        KnowledgeBase.open(bad, RetrievalConfig(kb_retrievers="edr"), encoder=encoder, warmup=False)


def test_rebuild_resumes_without_redoing_work(kb_dir, encoder, capsys):
    before = json.loads((kb_dir / "kb.json").read_text())
    after = build_kb(kb_dir, tiny_corpus(), retrievers=("edr", "adr", "sr"), corpus={"source": "tests"},
                     hnsw_m=8, hnsw_ef_construction=64, chunk=48, encoder=encoder, progress=False)
    out = capsys.readouterr().out
    assert "reusing" in out and "embeddings: up to date" in out and "hnsw: up to date" in out
    assert "lucene: up to date" in out
    assert after["fingerprint"] == before["fingerprint"] and after["build"] == before["build"]


def interrupted_encoding(tmp_path, encoder, passages: int, chunk: int):
    """Passages written to tmp_path and an in-process encoding that dies in the middle of its second chunk, as a
    killed build does -> (store, n, fingerprint, Counting, calls): Counting() encoders record each call's batch
    size in `calls` (and no longer fail)."""
    from retrieval_service.knowledge import dense
    from retrieval_service.knowledge.passages import PassageStore, write_passages

    n, fp = write_passages(tmp_path, tiny_corpus()[:passages])
    store = PassageStore(tmp_path)
    calls = []

    class Counting:
        name, dim, dtype = encoder.name, encoder.dim, encoder.dtype

        def encode(self, texts, batch_size=64):
            calls.append(len(texts))
            if len(calls) == 2:
                raise KeyboardInterrupt
            return encoder.encode(texts, batch_size)

    with pytest.raises(KeyboardInterrupt):
        dense.encode_passages(store.iter_range, n, tmp_path / "dense", Counting(), fingerprint=fp, chunk=chunk)
    return store, n, fp, Counting, calls


def test_interrupted_encoding_resumes_from_chunks(tmp_path, encoder):
    from retrieval_service.knowledge import dense

    store, n, fp, Counting, calls = interrupted_encoding(tmp_path, encoder, 10, chunk=4)
    dense.encode_passages(store.iter_range, n, tmp_path / "dense", Counting(), fingerprint=fp, chunk=4)
    assert calls == [4, 4, 4, 2]  # chunk 0 was not encoded again
    stats = json.loads((tmp_path / "dense" / "meta.json").read_text())["build"]
    assert stats["encoded_rows"] == 10 and stats["copied_rows"] == 0  # both runs counted, the dead chunk not
    assert stats["encode_seconds"] > 0
    emb = np.load(tmp_path / "dense" / "embeddings.npy")
    ref = encoder.encode([f"{t}\n{x}" for t, x in store.get(range(n))])
    np.testing.assert_allclose(emb, ref, atol=1e-5)
    assert not (tmp_path / "dense" / "chunks").exists()


def test_encoder_processes_finish_an_interrupted_encoding(tmp_path, encoder):
    """The build's default on a multi-core machine: chunks encoded by worker processes (each its own encoder) land
    as the one-process path writes them, so a build interrupted in process resumes in workers, and the result is
    the same vectors."""
    from retrieval_service.knowledge import dense
    from retrieval_service.knowledge.encode_pool import EncodeWork

    store, n, fp, Counting, calls = interrupted_encoding(tmp_path, encoder, 10, chunk=3)
    work = EncodeWork(passages_dir=str(tmp_path), chunks_dir=str(tmp_path / "dense" / "chunks"),
                      encoder_dtype=encoder.dtype, dtype="float32", batch_size=64)
    dense.encode_passages(store.iter_range, n, tmp_path / "dense", Counting(), fingerprint=fp, chunk=3,
                          pool=work, workers=2)
    assert len(calls) == 2  # the three chunks left went to the workers, not to this process
    stats = json.loads((tmp_path / "dense" / "meta.json").read_text())["build"]
    assert stats["encoded_rows"] == 10 and stats["encode_seconds"] > 0
    emb = np.load(tmp_path / "dense" / "embeddings.npy")
    ref = encoder.encode([f"{t}\n{x}" for t, x in store.get(range(n))])
    np.testing.assert_allclose(emb, ref, atol=1e-5)
    assert not np.allclose(emb[0], emb[1])  # Not one row everywhere


def test_a_dead_encoder_process_stops_the_build_and_keeps_the_chunks(tmp_path, encoder):
    from retrieval_service.knowledge import dense
    from retrieval_service.knowledge.encode_pool import EncodeWork

    store, n, fp, Counting, calls = interrupted_encoding(tmp_path, encoder, 9, chunk=3)
    bad = EncodeWork(passages_dir=str(tmp_path / "missing"), chunks_dir=str(tmp_path / "dense" / "chunks"),
                     encoder_dtype=encoder.dtype, dtype="float32", batch_size=64)
    with pytest.raises(RuntimeError, match="died"):  # not a hang waiting for chunks nobody encodes
        dense.encode_passages(store.iter_range, n, tmp_path / "dense", Counting(), fingerprint=fp, chunk=3,
                              pool=bad, workers=2)
    assert (tmp_path / "dense" / "chunks" / "0000000000-0000000003.npy").is_file()
    dense.encode_passages(store.iter_range, n, tmp_path / "dense", Counting(), fingerprint=fp, chunk=3)
    assert calls == [3, 3, 3, 3]  # the first chunk was kept through both failures
    assert np.load(tmp_path / "dense" / "embeddings.npy").shape == (n, encoder.dim)


def test_float16_embeddings_search_like_float32(tmp_path, kb_config, encoder, edr_only_kb):
    build_kb(tmp_path, tiny_corpus()[:8], retrievers=("edr",), corpus={"source": "tests-edr"}, dtype="float16",
             encoder=encoder, progress=False)
    kb16 = KnowledgeBase.open(tmp_path, kb_config, encoder=encoder)
    assert kb16.vector_indexes["kb"].vectors.dtype == np.float16
    texts = [q for _, _, q in KNOWN]
    got = kb16.search("edr", 3, texts=texts)
    ref = edr_only_kb.search("edr", 3, texts=texts)
    assert [int(h.ids[0]) for h in got.hits] == [int(h.ids[0]) for h in ref.hits]
    cs = kb16.score_candidates("edr", got.hits[0].ids, text=texts[0])
    assert np.array_equal(cs.scores, got.hits[0].scores)  # re-scoring reads the same float16 values
    kb16.close()


class _CountingEncoder:
    """The real encoder, counting the passages it is asked to encode."""

    def __init__(self, encoder):
        self.inner, self.texts = encoder, 0
        self.name, self.dim, self.dtype = encoder.name, encoder.dim, encoder.dtype

    def encode(self, texts, batch_size=64):
        self.texts += len(texts)
        return self.inner.encode(texts, batch_size)


def test_prefix_kb_copies_the_parent_rows(tmp_path, encoder):
    corpus = tiny_corpus()[:14]
    build_kb(tmp_path / "big", corpus, retrievers=("edr",), corpus={"source": "p"}, chunk=4, encoder=encoder,
             progress=False)
    parent = np.load(tmp_path / "big" / "dense" / "embeddings.npy")
    counting = _CountingEncoder(encoder)
    build_kb(tmp_path / "small", corpus, retrievers=("edr",), corpus={"source": "p"}, limit=9, chunk=4,
             encoder=counting, embeddings_from=tmp_path / "big", progress=False)
    small = np.load(tmp_path / "small" / "dense" / "embeddings.npy")
    assert counting.texts == 0  # Not encoded again
    assert np.array_equal(small, parent[:9])
    edr = json.loads((tmp_path / "small" / "kb.json").read_text())["build"]["edr"]
    assert (edr["encoded_rows"], edr["copied_rows"]) == (0, 9)
    # Passages that are not the parent's prefix are refused, not silently paired with foreign vectors.
    with pytest.raises(ValueError, match="embeddings_from"):
        build_kb(tmp_path / "other", corpus[1:], retrievers=("edr",), corpus={"source": "q"}, limit=5,
                 encoder=counting, embeddings_from=tmp_path / "big", progress=False)


def test_a_kb_that_grows_a_smaller_one_encodes_only_the_new_rows(tmp_path, encoder):
    """A parent smaller than the new KB (300 K grown from a 100 K one): its rows are copied where whole chunks of
    it exist, the rest encoded; the result equals a build from scratch. Passages that begin differently are refused."""
    corpus = tiny_corpus()[:14]
    build_kb(tmp_path / "small", corpus, retrievers=("edr",), corpus={"source": "p"}, limit=8, chunk=4,
             encoder=encoder, progress=False)
    build_kb(tmp_path / "scratch", corpus, retrievers=("edr",), corpus={"source": "p"}, chunk=4, encoder=encoder,
             progress=False)
    counting = _CountingEncoder(encoder)
    build_kb(tmp_path / "grown", corpus, retrievers=("edr",), corpus={"source": "p"}, chunk=4, encoder=counting,
             embeddings_from=tmp_path / "small", progress=False)
    grown = np.load(tmp_path / "grown" / "dense" / "embeddings.npy")
    assert np.array_equal(grown, np.load(tmp_path / "scratch" / "dense" / "embeddings.npy"))
    assert counting.texts == 14 - 8  # not 14
    edr = json.loads((tmp_path / "grown" / "kb.json").read_text())["build"]["edr"]
    assert (edr["encoded_rows"], edr["copied_rows"]) == (6, 8)
    with pytest.raises(ValueError, match="embeddings_from"):
        build_kb(tmp_path / "other", corpus[1:], retrievers=("edr",), corpus={"source": "q"}, chunk=4,
                 encoder=counting, embeddings_from=tmp_path / "small", progress=False)


def test_a_prefix_kb_takes_its_passages_from_the_parent_not_the_corpus(tmp_path, encoder):
    """No passages given (a `--limit-passages N --embeddings-from` build): the parent's first N as written there,
    even when the corpus on disk has changed since (here: nothing of it is read at all)."""
    corpus = tiny_corpus()[:14]
    build_kb(tmp_path / "big", corpus, retrievers=("edr",), corpus={"source": "p"}, chunk=4, encoder=encoder,
             progress=False)
    build_kb(tmp_path / "small", None, retrievers=("edr",), limit=9, chunk=4, encoder=_CountingEncoder(encoder),
             embeddings_from=tmp_path / "big", progress=False)
    big, small = P.PassageStore(tmp_path / "big"), P.PassageStore(tmp_path / "small")
    assert len(small.offsets) - 1 == 9
    assert small.get(range(9)) == big.get(range(9))  # Not another corpus' passages
    assert (tmp_path / "small" / P.PASSAGES_FILE).read_bytes() == \
        (tmp_path / "big" / P.PASSAGES_FILE).read_bytes()[: int(big.offsets[9])]
    with pytest.raises(ValueError, match="no passages"):
        build_kb(tmp_path / "orphan", None, retrievers=("edr",), limit=3, encoder=encoder,
                 embeddings_from=tmp_path / "missing", progress=False)


def test_prefix_rows_from_a_parent_still_encoding(tmp_path, encoder):
    """The parent's finished chunks serve the prefix; rows no chunk covers yet are encoded."""
    from retrieval_service.knowledge import dense
    from retrieval_service.knowledge.passages import PassageStore, write_passages

    parent = tmp_path / "parent"
    n, fp = write_passages(parent, tiny_corpus()[:12])
    store = PassageStore(parent)
    with pytest.raises(KeyboardInterrupt):
        class Dies(_CountingEncoder):
            def encode(self, texts, batch_size=64):
                if self.texts >= 8:
                    raise KeyboardInterrupt  # chunks [0, 4) and [4, 8) are on disk
                return super().encode(texts, batch_size)

        dense.encode_passages(store.iter_range, n, parent / "dense", Dies(encoder), fingerprint=fp, chunk=4)
    rows = dense.prefix_rows(parent / "dense", encoder=encoder.name, encoder_dtype=encoder.dtype, dtype="float32",
                             dim=encoder.dim)
    ref = encoder.encode([f"{r['title']}\n{r['text']}" for r in store.iter_range(0, 12)])
    np.testing.assert_allclose(rows(2, 7), ref[2:7], atol=1e-5)
    assert rows(6, 10) is None  # [8, 10) not encoded yet
    other = dense.prefix_rows(parent / "dense", encoder=encoder.name, encoder_dtype=encoder.dtype,
                              dtype="float16", dim=encoder.dim)
    assert other(0, 4) is None  # other storage dtype: not the same vectors
