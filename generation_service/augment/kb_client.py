"""Client side of the KnowledgeService (proto/knowledge.proto) for the generation worker's RAG loops.

Unlike drafting (which may silently degrade to AR decoding), a RAG step cannot go on without its passage, so
every failure is surfaced: a replica that is down, overloaded, not loaded, or a missed deadline becomes
`KBUnavailable` (the request then falls back to sequential retrieval or fails with UNAVAILABLE); a request the
KB rejects as malformed becomes `KBRequestError` (INVALID_ARGUMENT). Replicas, failover and deadlines are
ragcore/replicated.py's.

    kb = KBClient("127.0.0.1:50051", timeout_ms=2000)
    reply = kb.search("edr", 20, texts=["how do I sort a dict"], with_vectors=True)
    reply.hits[0].ids, reply.hits[0].vectors          # int64 [n], float32 [n, 384]
    fut = kb.search_async("sr", 20, texts=[...])      # gRPC future: fut.done(), fut.result() (raises KBUnavailable)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
import numpy as np

from generation_service import metrics
from proto import knowledge_pb2, knowledge_pb2_grpc
from ragcore.errors import InvalidArgument, Unavailable
from ragcore.replicated import Replica, ReplicatedClient
from ragcore.wire import pack_f32, pack_ids, read_array

DEFAULT_TIMEOUT_MS = 2000.0


class KBUnavailable(Unavailable):
    """The knowledge service could not answer in time (the message says which replica and why)."""

    def __init__(self, why: str):
        super().__init__(f"knowledge service unavailable: {why}")


class KBRequestError(InvalidArgument):
    """The knowledge service rejected the request as invalid (INVALID_ARGUMENT); retrying cannot help. To the
    worker's own client it is the `rag` options that led to it."""

    def __init__(self, problem: str):
        super().__init__("rag", f"the knowledge service rejected it: {problem}")


@dataclass
class Document:
    id: int
    title: str
    text: str


@dataclass
class Hits:
    ids: np.ndarray  # int64 [n], best first
    scores: np.ndarray  # float32 [n]
    vectors: np.ndarray | None = None  # float32 [n, D] when asked for
    documents: list[Document] | None = None  # when asked for

    @property
    def top1(self) -> int | None:
        return int(self.ids[0]) if len(self.ids) else None


@dataclass
class SearchReply:
    hits: list[Hits]  # one per query, in request order
    query_vectors: np.ndarray | None  # float32 [B, D] when asked for (dense retrievers)
    encode_ms: float  # server time encoding text queries
    search_ms: float  # server time of the batched index search
    rpc_s: float = 0.0  # wall time of the call as the client saw it (wire included)


@dataclass
class Candidates:
    scores: np.ndarray  # float32 [n], aligned with the request ids
    order: np.ndarray  # int32 [n], positions best first in Search's own order
    query_vector: np.ndarray | None
    encode_ms: float
    score_ms: float


def parse_search(reply: knowledge_pb2.SearchResponse, rpc_s: float = 0.0) -> SearchReply:
    dim = int(reply.dim)
    hits = []
    for h in reply.results:
        vecs = read_array(h.vectors, "<f4", dim) if h.vectors and dim else None
        docs = [Document(int(d.id), d.title, d.text) for d in h.documents] if len(h.documents) else None
        hits.append(Hits(read_array(h.ids, "<i8"), read_array(h.scores, "<f4"), vecs, docs))
    qv = read_array(reply.query_vectors, "<f4", dim) if reply.query_vectors and dim else None
    return SearchReply(hits, qv, reply.encode_ms, reply.search_ms, rpc_s)


def _failure(kind: str, message: str) -> Exception:
    return KBRequestError(message) if kind == "request" else KBUnavailable(message)


class SearchFuture:
    """A Search in flight. done() never blocks; result() waits and returns a SearchReply or raises
    KBUnavailable / KBRequestError. `finished_at` is the perf_counter time the reply arrived (for OS³'s b)."""

    def __init__(self, client: "KBClient", replica: Replica | None, future, started: float,
                 error: Exception | None = None):
        self._client, self._replica, self._future = client, replica, future
        self.started = started
        self.finished_at: float | None = None
        self._error = error
        if future is not None:
            future.add_done_callback(self._mark)

    def _mark(self, _fut) -> None:
        self.finished_at = time.perf_counter()

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def add_done_callback(self, fn) -> None:
        """fn(self) once the reply (or the failure) is there; at once if it is (engine/effects.py Wait)."""
        if self._future is None:
            fn(self)
        else:
            self._future.add_done_callback(lambda _f: fn(self))

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def result(self) -> SearchReply:
        if self._future is None:
            raise self._error
        try:
            reply = self._future.result()
        except grpc.FutureCancelledError:
            raise KBUnavailable("verification was cancelled") from None
        except grpc.RpcError as e:
            raise self._client.failed(self._replica, e) from None
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return parse_search(reply, end - self.started)


class KBClient(ReplicatedClient):
    def __init__(self, target: str, *, timeout_ms: float = DEFAULT_TIMEOUT_MS, retry_after_s: float = 1.0,
                 max_message_bytes: int = 64 << 20, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        """target: "host:port" or several comma-separated; token: bearer token ("" = none); credentials: TLS."""
        super().__init__(target, knowledge_pb2_grpc.KnowledgeServiceStub, failure=_failure,
                         timeout_s=timeout_ms / 1e3, retry_after_s=retry_after_s, max_message_bytes=max_message_bytes,
                         token=token, credentials=credentials, instrument=metrics.instrument_channel,
                         what="knowledge service")

    # ---------------------------------------------------------------------------------------------- RPCs

    @staticmethod
    def search_request(retriever: str, k: int, *, texts=None, vectors: np.ndarray | None = None,
                       with_text: bool = False, with_vectors: bool = False, with_query_vectors: bool = False,
                       ef_search: int = 0, index: str = "") -> knowledge_pb2.SearchRequest:
        req = knowledge_pb2.SearchRequest(retriever=retriever, k=k, with_text=with_text, with_vectors=with_vectors,
                                          with_query_vectors=with_query_vectors, ef_search=ef_search, index=index)
        if texts:
            req.texts.extend(texts)
        if vectors is not None:
            req.vectors = pack_f32(vectors)
        return req

    def search(self, retriever: str, k: int, *, deadline: float | None = None, timeout_s: float | None = None,
               **kwargs) -> SearchReply:
        """One batched Search (texts=[...] or vectors=[B, D]); see search_request for the options."""
        req = self.search_request(retriever, k, **kwargs)
        t0 = time.perf_counter()
        reply = self.call("Search", req, deadline=deadline, timeout_s=timeout_s)
        return parse_search(reply, time.perf_counter() - t0)

    def search_async(self, retriever: str, k: int, *, deadline: float | None = None,
                     timeout_s: float | None = None, **kwargs) -> SearchFuture:
        """Start a Search and return at once (gRPC future on one replica; failover is the caller's retry)."""
        req = self.search_request(retriever, k, **kwargs)
        started = time.perf_counter()
        try:
            replica, future = self.call_future("Search", req, deadline=deadline, timeout_s=timeout_s)
        except KBUnavailable as e:
            return SearchFuture(self, None, None, started, e)
        return SearchFuture(self, replica, future, started)

    def score_candidates(self, retriever: str, ids: np.ndarray, *, text: str = "", vector: np.ndarray | None = None,
                         deadline: float | None = None, timeout_s: float | None = None) -> Candidates:
        req = knowledge_pb2.ScoreCandidatesRequest(retriever=retriever, text=text,
                                                   ids=pack_ids(ids))
        if vector is not None:
            req.vector = pack_f32(vector)
        reply = self.call("ScoreCandidates", req, deadline=deadline, timeout_s=timeout_s)
        qv = read_array(reply.query_vector, "<f4") if reply.query_vector else None
        return Candidates(read_array(reply.scores, "<f4"), read_array(reply.order, "<i4"), qv,
                          reply.encode_ms, reply.score_ms)

    def get_documents(self, ids, *, with_vectors: bool = False, deadline: float | None = None,
                      timeout_s: float | None = None) -> tuple[list[Document], np.ndarray | None]:
        req = knowledge_pb2.GetDocumentsRequest(ids=pack_ids(ids),
                                                with_vectors=with_vectors)
        reply = self.call("GetDocuments", req, deadline=deadline, timeout_s=timeout_s)
        docs = [Document(int(d.id), d.title, d.text) for d in reply.documents]
        vecs = read_array(reply.vectors, "<f4", int(reply.dim)) if reply.vectors and reply.dim else None
        return docs, vecs

    def info(self, timeout_s: float = 5.0) -> knowledge_pb2.KnowledgeInfo:
        return self.call("Info", knowledge_pb2.KnowledgeInfoRequest(), timeout_s=timeout_s)
