"""Fuzz the KnowledgeService (Search, ScoreCandidates, GetDocuments, Info) over a tiny KB with exact dense and
BM25 retrievers (ADR absent on purpose): OK, INVALID_ARGUMENT naming the field, or UNAVAILABLE for a retriever
that is not loaded; never INTERNAL, UNKNOWN or a hang. k = 0 and k = 10^9 included."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from proto import knowledge_pb2 as pb
from tests.fuzz.wire import BAD_UTF8, FUZZ, check, ldelim

S = "/ragserve.v1.KnowledgeService/"
U32 = 2**32 - 1
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE}
DIM = 384

good_text = st.text(min_size=1, max_size=30)
# Lucene query syntax, control characters, emoji, long and empty strings.
wild_text = st.text(max_size=60) | st.sampled_from(['', '"', '*:*', 'a AND (b OR', '\\\\', 'title:x^10', '~~~', '?',
                                                    '\x00', '\U0001F600' * 10, 'x' * 3000, ' ' * 50])
vectors = (st.integers(0, 3).map(lambda n: np.random.default_rng(n).normal(size=(n, DIM)).astype("<f4").tobytes())
           | st.binary(max_size=64)
           | st.sampled_from([np.full(DIM, np.nan, "<f4").tobytes(), np.full(DIM, np.inf, "<f4").tobytes(),
                              np.zeros(DIM, "<f4").tobytes(), np.zeros(DIM + 1, "<f4").tobytes()]))
ids = (st.lists(st.integers(0, 11), min_size=1, max_size=8)
       | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40)).map(lambda v: np.asarray(v, "<i8").tobytes())
ks = st.sampled_from([0, 1, 5, 50, 51, 10**9, U32])


good_retriever = st.sampled_from(["edr", "sr"])
wild_retriever = st.sampled_from(["adr", "", "EDR", "bm25", "sr\x00"])
good_vectors = st.integers(1, 3).map(lambda n: np.random.default_rng(n).normal(size=(n, DIM)).astype("<f4").tobytes())
good_ids = st.lists(st.integers(0, 11), min_size=1, max_size=8).map(lambda v: np.asarray(v, "<i8").tobytes())


@st.composite
def searches(draw) -> pb.SearchRequest:
    """A plausible request with 0-2 fields replaced by wild values (so every check gets reached)."""
    wild = draw(st.sets(st.sampled_from(["retriever", "k", "query", "index", "ef_search"]), max_size=2))
    retriever = draw(wild_retriever if "retriever" in wild else good_retriever)
    req = pb.SearchRequest(retriever=retriever, k=draw(ks if "k" in wild else st.integers(1, 50)),
                           with_text=draw(st.booleans()), with_query_vectors=draw(st.booleans()))
    if "query" in wild:
        if draw(st.booleans()):
            req.texts.extend(draw(st.lists(wild_text, max_size=10)))
        else:
            req.vectors = draw(vectors)
    elif retriever == "sr" or draw(st.booleans()):
        req.texts.extend(draw(st.lists(good_text, min_size=1, max_size=8)))
    else:
        req.vectors = draw(good_vectors)
    if "index" in wild:
        req.index = draw(st.sampled_from(["kb", "knnlm", "x" * 100]))
    if "ef_search" in wild:
        req.ef_search = draw(st.sampled_from([1, 16, 10**6, U32]))
    return req


@st.composite
def score_requests(draw) -> pb.ScoreCandidatesRequest:
    wild = draw(st.sets(st.sampled_from(["retriever", "query", "ids"]), max_size=2))
    retriever = draw(wild_retriever if "retriever" in wild else good_retriever)
    req = pb.ScoreCandidatesRequest(retriever=retriever, ids=draw(ids if "ids" in wild else good_ids))
    if "query" in wild:
        if draw(st.booleans()):
            req.text = draw(wild_text)
        else:
            req.vector = draw(vectors)
    elif retriever == "sr" or draw(st.booleans()):
        req.text = draw(good_text)
    else:
        req.vector = draw(good_vectors.map(lambda b: b[:DIM * 4]))
    return req


def _go(raw, method: str, data: bytes) -> None:
    code, details, _ = raw.unary(S + method, data)
    event(f"{method} {code.name} {details.split(':')[0][:30]}")
    check(code, details, ALLOWED)


@FUZZ
@given(req=searches())
def test_search(fuzz_knowledge, req):
    _go(fuzz_knowledge, "Search", req.SerializeToString())


@FUZZ
@given(req=score_requests())
def test_score_candidates(fuzz_knowledge, req):
    _go(fuzz_knowledge, "ScoreCandidates", req.SerializeToString())


@FUZZ
@given(doc_ids=ids, with_vectors=st.booleans())
def test_get_documents(fuzz_knowledge, doc_ids, with_vectors):
    _go(fuzz_knowledge, "GetDocuments", pb.GetDocumentsRequest(ids=doc_ids, with_vectors=with_vectors).SerializeToString())


@FUZZ
@given(method=st.sampled_from(["Search", "ScoreCandidates", "GetDocuments", "Info"]), data=st.binary(max_size=200))
def test_random_bytes(fuzz_knowledge, method, data):
    _go(fuzz_knowledge, method, data)


@pytest.mark.parametrize("bad", BAD_UTF8)
def test_invalid_utf8_query_is_invalid_argument(fuzz_knowledge, bad):
    code, details, _ = fuzz_knowledge.unary(S + "Search", ldelim(1, b"sr") + ldelim(4, b"fine") + ldelim(4, bad))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "texts[1]: invalid UTF-8 in a string field")
    code, details, _ = fuzz_knowledge.unary(S + "ScoreCandidates", ldelim(1, b"edr") + ldelim(3, bad))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "text: invalid UTF-8 in a string field")


def test_still_serving_after_the_fuzz(fuzz_knowledge):
    code, details, reply = fuzz_knowledge.unary(S + "Search", pb.SearchRequest(
        retriever="sr", k=3, texts=["json decoder"]).SerializeToString())
    assert code == grpc.StatusCode.OK, details
    assert len(pb.SearchResponse.FromString(reply).results) == 1
