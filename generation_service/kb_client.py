"""Client side of the KnowledgeService (proto/knowledge.proto) for the generation worker's RAG loops.

Unlike drafting (which may silently degrade to AR decoding), a RAG step cannot go on without its passage, so
every failure is surfaced: a replica that is down, overloaded, not loaded, or a missed deadline becomes
`KBUnavailable` (the request then falls back to sequential retrieval or fails with UNAVAILABLE); a request the
KB rejects as malformed becomes `KBRequestError` (INVALID_ARGUMENT). Several replicas are used round-robin; one
that failed is skipped for `retry_after_s`.

    kb = KBClient("127.0.0.1:50051", timeout_ms=2000)
    reply = kb.search("edr", 20, texts=["how do I sort a dict"], with_vectors=True)
    reply.hits[0].ids, reply.hits[0].vectors          # int64 [n], float32 [n, 384]
    fut = kb.search_async("sr", 20, texts=[...])      # gRPC future: fut.done(), fut.result() (raises KBUnavailable)
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np

from proto import knowledge_pb2, knowledge_pb2_grpc
from serving import metrics

DEFAULT_TIMEOUT_MS = 2000.0


class KBUnavailable(RuntimeError):
    """The knowledge service could not answer in time (the message says which replica and why)."""


class KBRequestError(ValueError):
    """The knowledge service rejected the request as invalid (INVALID_ARGUMENT); retrying cannot help."""


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


def _f32(data: bytes, dim: int = 0) -> np.ndarray:
    arr = np.frombuffer(data, dtype="<f4").astype(np.float32)
    return arr.reshape(-1, dim) if dim else arr


def _ids(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i8").astype(np.int64)


def parse_search(reply: knowledge_pb2.SearchResponse, rpc_s: float = 0.0) -> SearchReply:
    dim = int(reply.dim)
    hits = []
    for h in reply.results:
        vecs = _f32(h.vectors, dim) if h.vectors and dim else None
        docs = [Document(int(d.id), d.title, d.text) for d in h.documents] if len(h.documents) else None
        hits.append(Hits(_ids(h.ids), _f32(h.scores), vecs, docs))
    qv = _f32(reply.query_vectors, dim) if reply.query_vectors and dim else None
    return SearchReply(hits, qv, reply.encode_ms, reply.search_ms, rpc_s)


def split_targets(target: str) -> list[str]:
    return [t.strip() for t in target.split(",") if t.strip()]


@dataclass
class _Replica:
    target: str
    channel: grpc.Channel
    stub: knowledge_pb2_grpc.KnowledgeServiceStub
    down_until: float = 0.0


class SearchFuture:
    """A Search in flight. done() never blocks; result() waits and returns a SearchReply or raises
    KBUnavailable / KBRequestError. `finished_at` is the perf_counter time the reply arrived (for OS³'s b)."""

    def __init__(self, client: "KBClient", replica: _Replica | None, future, started: float, error: str = ""):
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

    def cancel(self) -> None:
        if self._future is not None:
            self._future.cancel()

    def result(self) -> SearchReply:
        if self._future is None:
            raise KBUnavailable(self._error)
        try:
            reply = self._future.result()
        except grpc.FutureCancelledError:
            raise KBUnavailable("verification was cancelled") from None
        except grpc.RpcError as e:
            raise self._client._failed(self._replica, e) from None
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return parse_search(reply, end - self.started)


class KBClient:
    def __init__(self, target: str, *, timeout_ms: float = DEFAULT_TIMEOUT_MS, retry_after_s: float = 1.0,
                 max_message_bytes: int = 64 << 20, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        """target: "host:port" or several comma-separated; token: bearer token ("" = none); credentials: TLS."""
        targets = split_targets(target)
        if not targets:
            raise ValueError("kb: no target given")
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        self._replicas = []
        for t in targets:
            ch = metrics.instrument_channel(grpc.secure_channel(t, credentials, options=options) if credentials
                                            else grpc.insecure_channel(t, options=options))
            self._replicas.append(_Replica(t, ch, knowledge_pb2_grpc.KnowledgeServiceStub(ch)))
        self._next = itertools.cycle(range(len(self._replicas)))
        self._lock = threading.Lock()
        self.timeout_s = timeout_ms / 1e3
        self.retry_after_s = retry_after_s
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._last_error = ""
        self.calls = 0  # RPCs attempted (stats)

    @property
    def targets(self) -> list[str]:
        return [r.target for r in self._replicas]

    def close(self) -> None:
        for r in self._replicas:
            r.channel.close()

    # ------------------------------------------------------------------------------------------ plumbing

    def _pick(self) -> list[_Replica]:
        now = time.monotonic()
        with self._lock:
            start = next(self._next)
        order = [self._replicas[(start + i) % len(self._replicas)] for i in range(len(self._replicas))]
        return [r for r in order if r.down_until <= now]

    def _budget(self, deadline: float | None, timeout_s: float | None) -> float:
        budget = self.timeout_s if timeout_s is None else timeout_s
        if deadline is not None:
            budget = min(budget, deadline - time.monotonic())
        if budget <= 0:
            raise KBUnavailable("the request deadline leaves no time for retrieval")
        return budget

    def _failed(self, replica: _Replica | None, e: grpc.RpcError) -> Exception:
        code = e.code()
        where = replica.target if replica is not None else "kb"
        msg = f"{where}: {code.name} {e.details() or ''}".strip()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return KBRequestError(msg)
        if replica is not None and code not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            replica.down_until = time.monotonic() + self.retry_after_s
            self._last_error = msg
        return KBUnavailable(msg)

    def call(self, method: str, request, *, deadline: float | None = None, timeout_s: float | None = None):
        """Call `method` on the first healthy replica, failing over to the next within the deadline."""
        replicas = self._pick()
        if not replicas:
            raise KBUnavailable(f"knowledge service unavailable (all replicas failed recently; last error: "
                                f"{self._last_error})")
        err: Exception = KBUnavailable("no replica tried")
        for r in replicas:
            budget = self._budget(deadline, timeout_s)
            self.calls += 1
            try:
                return getattr(r.stub, method)(request, timeout=budget, metadata=self._metadata)
            except grpc.RpcError as e:
                err = self._failed(r, e)
                if isinstance(err, KBRequestError):
                    raise err from None
        raise err

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
            req.vectors = np.ascontiguousarray(vectors, dtype="<f4").tobytes()
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
        replicas = self._pick()
        if not replicas:
            return SearchFuture(self, None, None, started, f"knowledge service unavailable (all replicas failed "
                                                           f"recently; last error: {self._last_error})")
        try:
            budget = self._budget(deadline, timeout_s)
        except KBUnavailable as e:
            return SearchFuture(self, None, None, started, str(e))
        r = replicas[0]
        self.calls += 1
        return SearchFuture(self, r, r.stub.Search.future(req, timeout=budget, metadata=self._metadata), started)

    def score_candidates(self, retriever: str, ids: np.ndarray, *, text: str = "", vector: np.ndarray | None = None,
                         deadline: float | None = None, timeout_s: float | None = None) -> Candidates:
        req = knowledge_pb2.ScoreCandidatesRequest(retriever=retriever, text=text,
                                                   ids=np.ascontiguousarray(ids, dtype="<i8").tobytes())
        if vector is not None:
            req.vector = np.ascontiguousarray(vector, dtype="<f4").tobytes()
        reply = self.call("ScoreCandidates", req, deadline=deadline, timeout_s=timeout_s)
        qv = _f32(reply.query_vector) if reply.query_vector else None
        return Candidates(_f32(reply.scores), np.frombuffer(reply.order, dtype="<i4").astype(np.int32), qv,
                          reply.encode_ms, reply.score_ms)

    def get_documents(self, ids, *, with_vectors: bool = False, deadline: float | None = None,
                      timeout_s: float | None = None) -> tuple[list[Document], np.ndarray | None]:
        req = knowledge_pb2.GetDocumentsRequest(ids=np.ascontiguousarray(ids, dtype="<i8").tobytes(),
                                                with_vectors=with_vectors)
        reply = self.call("GetDocuments", req, deadline=deadline, timeout_s=timeout_s)
        docs = [Document(int(d.id), d.title, d.text) for d in reply.documents]
        vecs = _f32(reply.vectors, int(reply.dim)) if reply.vectors and reply.dim else None
        return docs, vecs

    def info(self, timeout_s: float = 5.0) -> knowledge_pb2.KnowledgeInfo:
        return self.call("Info", knowledge_pb2.KnowledgeInfoRequest(), timeout_s=timeout_s)
