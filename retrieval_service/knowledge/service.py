"""gRPC shell of the knowledge base (proto/knowledge.proto): unpack, call KnowledgeBase, pack.

    kb = KnowledgeBase.open(cfg.kb, cfg)                 # loads, checks and warms up every index
    servicer = KnowledgeServicer(kb, cfg)
    names = servicer.add_to_server(server)               # -> [SERVICE_NAME] for health/reflection

Validation lives in KnowledgeBase (KBInputError -> INVALID_ARGUMENT, RetrieverUnavailable -> UNAVAILABLE);
this layer adds the wire checks (packed byte lengths) and deadlines: a call whose deadline passes between the
encoding, search and packing stages ends with DEADLINE_EXCEEDED instead of doing the remaining work.
"""

from __future__ import annotations

import json
import logging

import grpc
import numpy as np

from proto import knowledge_pb2, knowledge_pb2_grpc
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge.kb import KB_INDEX, KBInputError, KnowledgeBase, RetrieverUnavailable
from serving.wire import WireError, pack_f32, unpack_f32

log = logging.getLogger(__name__)
SERVICE_NAME = knowledge_pb2.DESCRIPTOR.services_by_name["KnowledgeService"].full_name


# ------------------------------------------------------------------------------------------------ wire

def pack_ids(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i8").tobytes()


def unpack_ids(data: bytes, field: str) -> np.ndarray:
    if len(data) % 8:
        raise KBInputError(f"{field}: {len(data)} bytes is not a whole number of int64 doc ids")
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4").astype(np.int32)


# -------------------------------------------------------------------------------------------- servicer

class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    """Thin servicer over a KnowledgeBase; kb=None answers UNAVAILABLE until attach()."""

    def __init__(self, kb: KnowledgeBase | None, config: RetrievalConfig | None = None):
        self._cfg = config or RetrievalConfig()
        self._kb = kb

    def attach(self, kb: KnowledgeBase) -> None:
        self._kb = kb

    def add_to_server(self, server: grpc.Server) -> list[str]:
        knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    def warmup(self) -> None:
        """Run every RPC path once in-process (the KB's own warm-up ran at open)."""
        kb = self._kb
        if kb is None:
            return
        ctx = _NoContext()
        for r in kb.retrievers:
            res = self.Search(knowledge_pb2.SearchRequest(retriever=r, k=5, texts=["warm up", "the handlers"],
                                                          with_text=True), ctx)
            ids = unpack_ids(res.results[0].ids, "ids")
            if len(ids):
                self.ScoreCandidates(knowledge_pb2.ScoreCandidatesRequest(retriever=r, text="warm up",
                                                                          ids=pack_ids(ids)), ctx)
        if len(kb.passages):
            self.GetDocuments(knowledge_pb2.GetDocumentsRequest(ids=pack_ids(np.zeros(1, np.int64))), ctx)

    # ------------------------------------------------------------------------------------------ helpers

    def _ready(self, context) -> KnowledgeBase:
        if self._kb is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "knowledge base is not loaded (still loading or not configured)")
        return self._kb

    @staticmethod
    def _deadline(context, stage: str) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed {stage}")

    @staticmethod
    def _run(context, fn):
        try:
            return fn()
        except (KBInputError, WireError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RetrieverUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Exception as e:  # a bug or a JVM error: say so instead of gRPC's bare UNKNOWN
            log.exception("knowledge base call failed")
            context.abort(grpc.StatusCode.INTERNAL, f"knowledge base error: {type(e).__name__}: {e}")

    # --------------------------------------------------------------------------------------------- RPCs

    def Search(self, request, context):
        kb = self._ready(context)
        self._deadline(context, "before the search")

        def run():
            vectors = None
            if request.vectors:
                vectors = unpack_f32(request.vectors, "vectors", dim=kb.query_dim(request.retriever, request.index))
            if request.with_text and request.index not in ("", KB_INDEX):
                raise KBInputError(f"with_text: index {request.index!r} has no passages")
            vec_dim = kb.stored_dim(request.index, "with_vectors") if request.with_vectors else 0
            result = kb.search(request.retriever, request.k, texts=list(request.texts), vectors=vectors,
                               index=request.index, ef_search=request.ef_search)
            return result, vec_dim

        result, vec_dim = self._run(context, run)
        self._deadline(context, "after the search")

        def pack():
            results = []
            for h in result.hits:
                msg = knowledge_pb2.Hits(ids=pack_ids(h.ids), scores=pack_f32(h.scores))
                if request.with_text and len(h.ids):
                    msg.documents.extend(knowledge_pb2.Document(id=i, title=t, text=x)
                                         for i, t, x in kb.documents(h.ids))
                if request.with_vectors and len(h.ids):
                    msg.vectors = pack_f32(kb.passage_vectors(h.ids, "with_vectors", request.index))
                results.append(msg)
            return results

        results = self._run(context, pack)
        dim = result.query_vectors.shape[1] if result.query_vectors is not None else vec_dim
        out = knowledge_pb2.SearchResponse(results=results, dim=dim, encode_ms=result.encode_ms,
                                           search_ms=result.search_ms)
        if request.with_query_vectors and result.query_vectors is not None:
            out.query_vectors = pack_f32(result.query_vectors)
        return out

    def ScoreCandidates(self, request, context):
        kb = self._ready(context)
        self._deadline(context, "before scoring")

        def run():
            ids = unpack_ids(request.ids, "ids")
            vector = None
            if request.vector:
                vector = unpack_f32(request.vector, "vector", dim=kb.query_dim(request.retriever, request.index))
                if len(vector) != 1:
                    raise KBInputError(f"vector: {len(vector)} vectors given, ScoreCandidates takes one query")
                vector = vector[0]
            return kb.score_candidates(request.retriever, ids, text=request.text, vector=vector,
                                       index=request.index)

        res = self._run(context, run)
        out = knowledge_pb2.ScoreCandidatesResponse(scores=pack_f32(res.scores),
                                                    order=res.order.astype("<i4").tobytes(),
                                                    encode_ms=res.encode_ms, score_ms=res.score_ms)
        if request.text and res.query_vector is not None:
            out.query_vector = pack_f32(res.query_vector)
        return out

    def GetDocuments(self, request, context):
        kb = self._ready(context)

        def run():
            ids = unpack_ids(request.ids, "ids")
            docs = kb.documents(ids)
            vecs = kb.passage_vectors(ids, "with_vectors") if request.with_vectors else None
            return docs, vecs

        docs, vecs = self._run(context, run)
        self._deadline(context, "after reading the documents")
        out = knowledge_pb2.GetDocumentsResponse(
            documents=[knowledge_pb2.Document(id=i, title=t, text=x) for i, t, x in docs])
        if vecs is not None:
            out.vectors = pack_f32(vecs)
            out.dim = vecs.shape[1]
        return out

    def Info(self, request, context):
        kb = self._ready(context)
        info = kb.info()
        return knowledge_pb2.KnowledgeInfo(
            num_passages=info["passages"], retrievers=info["retrievers"], encoder=info["encoder"], path=info["path"],
            indexes=[knowledge_pb2.VectorIndexInfo(name=v["name"], dim=v["dim"], metric=v["metric"], size=v["size"],
                                                   retrievers=v["retrievers"], default_ef_search=v["ef_search"])
                     for v in info["indexes"]],
            manifest_json=json.dumps(info["manifest"], sort_keys=True))


class _NoContext:
    """Stand-in for grpc.ServicerContext when warming up the handlers in-process."""

    def time_remaining(self):
        return None

    def abort(self, code, details):
        raise RuntimeError(f"warm-up call failed: {code} {details}")
