"""KnowledgeService over a real gRPC server on 127.0.0.1:0: payloads, status codes, deadlines."""

import grpc
import numpy as np
import pytest

from proto import knowledge_pb2 as pb, knowledge_pb2_grpc
from ragcore.wire import pack_f32, pack_ids
from retrieval_service.knowledge.service import KnowledgeServicer

from .conftest import KNOWN, serve

TEXTS = [q for _, _, q in KNOWN]


def ids_of(hits) -> list[int]:
    return np.frombuffer(hits.ids, "<i8").tolist()


def scores_of(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<f4")


def status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


@pytest.mark.parametrize("retriever", ["edr", "adr", "sr"])
def test_batched_search_over_grpc_matches_in_process(stub, kb, retriever):
    res = stub.Search(pb.SearchRequest(retriever=retriever, k=4, texts=TEXTS, with_text=True, with_vectors=True,
                                       with_query_vectors=True))
    local = kb.search(retriever, 4, texts=TEXTS)
    assert len(res.results) == len(TEXTS)
    for r, h, i in zip(res.results, local.hits, range(len(TEXTS))):
        assert ids_of(r) == h.ids.tolist() and ids_of(r)[0] == i
        assert np.array_equal(scores_of(r.scores), h.scores)
        assert [d.id for d in r.documents] == h.ids.tolist() and r.documents[0].title == KNOWN[i][0]
        vecs = scores_of(r.vectors).reshape(len(h.ids), 384)
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-3)
    assert res.dim == 384
    if retriever == "sr":
        assert res.query_vectors == b"" and res.encode_ms == 0.0
    else:
        q = scores_of(res.query_vectors).reshape(len(TEXTS), 384)
        again = stub.Search(pb.SearchRequest(retriever=retriever, k=4, vectors=pack_f32(q)))
        assert [ids_of(r) for r in again.results] == [ids_of(r) for r in res.results]


@pytest.mark.parametrize("retriever", ["edr", "adr", "sr"])
def test_score_candidates_over_grpc(stub, retriever):
    top = stub.Search(pb.SearchRequest(retriever=retriever, k=10, texts=[TEXTS[2]])).results[0]
    ids = np.array(ids_of(top))[::-1].copy()
    res = stub.ScoreCandidates(pb.ScoreCandidatesRequest(retriever=retriever, text=TEXTS[2], ids=pack_ids(ids)))
    order = np.frombuffer(res.order, "<i4")
    assert ids[order].tolist() == ids_of(top)
    assert ids[order[0]] == 2
    if retriever != "sr":
        q = res.query_vector
        by_vec = stub.ScoreCandidates(pb.ScoreCandidatesRequest(retriever=retriever, vector=q, ids=pack_ids(ids)))
        assert by_vec.scores == res.scores


def test_get_documents(stub, kb):
    res = stub.GetDocuments(pb.GetDocumentsRequest(ids=pack_ids(np.array([3, 0, 3])), with_vectors=True))
    assert [(d.id, d.title) for d in res.documents] == [(3, KNOWN[3][0]), (0, KNOWN[0][0]), (3, KNOWN[3][0])]
    assert res.documents[1].text == KNOWN[0][1]
    assert res.dim == 384 and len(res.vectors) == 3 * 384 * 4


def test_info(stub, kb):
    info = stub.Info(pb.KnowledgeInfoRequest())
    assert info.num_passages == len(kb.passages) and list(info.retrievers) == ["edr", "adr", "sr"]
    assert info.indexes[0].name == "kb" and info.indexes[0].dim == 384 and info.indexes[0].metric == "ip"
    assert info.indexes[0].shared_scans  # --kb-coalesce is on by default and the index has edr


@pytest.mark.parametrize("request_, field", [
    (pb.SearchRequest(retriever="edr", k=3), "texts"),                              # empty batch
    (pb.SearchRequest(retriever="sr", k=3, texts=["q"] * 17), "texts"),             # oversized batch
    (pb.SearchRequest(retriever="edr", k=0, texts=["q"]), "k"),
    (pb.SearchRequest(retriever="edr", k=1000, texts=["q"]), "k"),
    (pb.SearchRequest(retriever="", k=3, texts=["q"]), "retriever"),
    (pb.SearchRequest(retriever="dpr", k=3, texts=["q"]), "retriever"),
    (pb.SearchRequest(retriever="edr", k=3, vectors=b"\0" * 12), "vectors"),          # 3 floats, dim 384
    (pb.SearchRequest(retriever="edr", k=3, vectors=b"\0" * 7), "vectors"),           # not whole floats
    (pb.SearchRequest(retriever="sr", k=3, vectors=pack_f32(np.zeros(384))), "vectors"),
    (pb.SearchRequest(retriever="edr", k=3, texts=["q"], vectors=pack_f32(np.zeros(384))), "texts"),
    (pb.SearchRequest(retriever="edr", k=3, texts=["q"], index="knnlm"), "index"),
    (pb.SearchRequest(retriever="sr", k=3, texts=["q"], index="kb"), "index"),     # proto: must be "" for sr
    (pb.SearchRequest(retriever="sr", k=3, texts=["q" * 20_000]), "texts[0]"),     # over kb_limit_query_chars
])
def test_search_bad_input_is_invalid_argument(stub, request_, field):
    code, details = status(lambda: stub.Search(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details


@pytest.mark.parametrize("request_, field", [
    (pb.ScoreCandidatesRequest(retriever="edr", text="q"), "ids"),                   # empty candidates
    (pb.ScoreCandidatesRequest(retriever="edr", text="q", ids=pack_ids(np.arange(65))), "ids"),
    (pb.ScoreCandidatesRequest(retriever="sr", text="q", ids=pack_ids([1, 123456])), "ids[1]"),
    (pb.ScoreCandidatesRequest(retriever="edr", text="q", ids=b"\0" * 5), "ids"),
    (pb.ScoreCandidatesRequest(retriever="edr", ids=pack_ids([1])), "text"),
    (pb.ScoreCandidatesRequest(retriever="adr", vector=pack_f32(np.zeros(100)), ids=pack_ids([1])), "vector"),
    (pb.ScoreCandidatesRequest(retriever="sr", text="q" * 20_000, ids=pack_ids([1])), "text: "),  # Not "text[0]"
])
def test_score_candidates_bad_input_is_invalid_argument(stub, request_, field):
    code, details = status(lambda: stub.ScoreCandidates(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), details


def test_get_documents_unknown_id_is_invalid_argument(stub):
    code, details = status(lambda: stub.GetDocuments(pb.GetDocumentsRequest(ids=pack_ids([0, -5]))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("ids[1]"), details
    code, details = status(lambda: stub.GetDocuments(pb.GetDocumentsRequest()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("ids"), details


def test_absent_index_is_unavailable_not_a_crash(edr_only_kb, kb_config):
    running, channel = serve(KnowledgeServicer(edr_only_kb, kb_config))
    try:
        s = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        for retriever in ("adr", "sr"):
            code, details = status(lambda: s.Search(pb.SearchRequest(retriever=retriever, k=2, texts=["x"])))
            assert code == grpc.StatusCode.UNAVAILABLE and retriever in details
        assert len(s.Search(pb.SearchRequest(retriever="edr", k=2, texts=["x"])).results) == 1  # still serving
    finally:
        channel.close()
        running.stop(0)


def test_not_loaded_is_unavailable(kb_config):
    running, channel = serve(KnowledgeServicer(None, kb_config))
    try:
        s = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        code, _ = status(lambda: s.Search(pb.SearchRequest(retriever="edr", k=2, texts=["x"])))
        assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        running.stop(0)


def test_deadline_is_respected(stub):
    code, _ = status(lambda: stub.Search(pb.SearchRequest(retriever="sr", k=5, texts=TEXTS), timeout=1e-4))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server is fine afterwards.
    assert len(stub.Search(pb.SearchRequest(retriever="sr", k=5, texts=TEXTS), timeout=30).results) == len(TEXTS)
