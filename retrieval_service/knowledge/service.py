"""gRPC shell of the knowledge base (proto/knowledge.proto): unpack, call KnowledgeBase, pack.

    kb = open_knowledge_base(cfg.kb, cfg)                 # loads, checks and warms up every index
    servicer = KnowledgeServicer(kb, cfg)
    names = servicer.add_to_server(server)               # -> [SERVICE_NAME] for health/reflection

Validation lives in KnowledgeBase (KBInputError -> INVALID_ARGUMENT, RetrieverUnavailable -> UNAVAILABLE);
this layer adds the wire checks (packed byte lengths), the reply-size check before any work, and deadlines: a
call whose deadline passes (or whose client cancels) between the encoding, search and packing stages, or between
two chunks of a large batch, ends with DEADLINE_EXCEEDED / CANCELLED instead of doing the remaining work.

Isolation: the knowledge-base work (encode, search, score, pack) runs on its own small executor (`kb_workers`
threads, at a lower CPU priority), not on the gRPC handler threads, so a burst of heavy Searches queues there
while the latency-critical Draft calls keep a core. A KB call waiting for its result still holds a gRPC handler
thread, so at most `kb_workers + kb_queue` KB calls are admitted, and never more than `workers - 2`: two handler
threads always remain for Draft (with clients searching flat out, Draft's median latency grew by orders of
magnitude when KB calls could take every handler thread, and stayed low with the cap). Beyond the cap a KB call
gets RESOURCE_EXHAUSTED at once.

Express lane: a text Search small enough (kb.EXPRESS_TOKENS encoder tokens at most, bounded from its length) runs
on a thread of its own with an encoder of its own, so it never queues behind a large batch on the KB executor nor
waits for the batch's encoder (a batch of long texts holds the executor for seconds).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import grpc
import numpy as np

from proto import knowledge_pb2, knowledge_pb2_grpc
from ragcore.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from ragcore.wire import clip, pack_array, pack_f32, pack_ids, unpack_f32, unpack_ids
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import dense
from retrieval_service.knowledge.coalesce import SearchCall, SearchCoalescer
from retrieval_service.knowledge.deadline import call_deadline
from retrieval_service.knowledge.kb import (
    EXPRESS_TOKENS,
    KB_INDEX,
    SEARCH_CHUNK,
    KBInputError,
    KnowledgeBase,
    SearchStopped,
)

log = logging.getLogger(__name__)
SERVICE_NAME = knowledge_pb2.DESCRIPTOR.services_by_name["KnowledgeService"].full_name
T = TypeVar("T")
DRAFT_HANDLERS = 2  # gRPC handler threads KB calls may never take (Draft, Info, Learn keep them)


class KBBusy(ResourceExhausted):
    """As many KB calls as allowed are running or queued (-> RESOURCE_EXHAUSTED)."""


# -------------------------------------------------------------------------------------------- servicer

class KnowledgeServicer(knowledge_pb2_grpc.KnowledgeServiceServicer):
    """Thin servicer over a KnowledgeBase; kb=None answers UNAVAILABLE until attach()."""

    def __init__(self, kb: KnowledgeBase | None, config: RetrievalConfig | None = None):
        self._cfg = config or RetrievalConfig()
        self._kb = kb
        self._pool: ThreadPoolExecutor | None = None
        self._express: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._admitted = 0  # calls running or queued on the KB executor
        self._coalescers: dict[int, SearchCoalescer] = {}  # per KnowledgeBase (id), when kb_coalesce

    def attach(self, kb: KnowledgeBase) -> None:
        self._kb = kb

    def close(self) -> None:
        for pool in (self._pool, self._express):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------------ executor

    def _init_kb_thread(self) -> None:
        dense.configure_faiss(self._cfg.kb_omp_threads)  # OpenMP's thread count is per thread
        if self._cfg.kb_nice and hasattr(os, "setpriority"):
            try:  # Linux: a thread's nice value is its own (the tid is a "process" for setpriority)
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self._cfg.kb_nice))
            except OSError:
                pass

    def _executor(self, express: bool = False) -> ThreadPoolExecutor:
        with self._lock:
            if express:
                if self._express is None:
                    self._express = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kb-express",
                                                       initializer=self._init_kb_thread)
                return self._express
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=max(1, self._cfg.kb_workers), thread_name_prefix="kb",
                                                initializer=self._init_kb_thread)
            return self._pool

    def _offload(self, context, work: Callable[[Callable[[], bool]], T], express: bool = False) -> T:
        """Run work(should_stop) on the KB executor and wait for it. should_stop() is true once the client
        cancelled or the deadline passed; KB code checks it between stages and chunks (SearchStopped)."""
        limit = max(1, min(max(1, self._cfg.kb_workers) + self._cfg.kb_queue, self._cfg.workers - DRAFT_HANDLERS))
        with self._lock:
            if self._admitted >= limit:
                busy = self._admitted
                admitted = False
            else:
                self._admitted += 1
                admitted = True
        if not admitted:
            raise KBBusy(f"knowledge base busy: {busy} calls running or queued (limit {limit}: kb_workers + kb_queue, "
                         f"at most workers - {DRAFT_HANDLERS}); retry later")
        gone = threading.Event()
        context.add_callback(gone.set)  # runs when the RPC ends: cancelled, deadline passed (or done)

        def should_stop() -> bool:
            if gone.is_set() or not context.is_active():
                return True
            remaining = context.time_remaining()
            return remaining is not None and remaining <= 0

        def run() -> T:
            if should_stop():  # waited in the queue past the deadline: nothing to do
                raise SearchStopped("the call ended while it waited for the knowledge base")
            with call_deadline(context.time_remaining()):  # a database backend hands it on (statement_timeout)
                return work(should_stop)

        try:
            return self._executor(express).submit(run).result()
        finally:
            with self._lock:
                self._admitted -= 1

    def add_to_server(self, server: grpc.Server) -> list[str]:
        knowledge_pb2_grpc.add_KnowledgeServiceServicer_to_server(self, server)
        return [SERVICE_NAME]

    def warmup(self) -> None:
        """Run every RPC path once in-process (the KB's own warm-up ran at open)."""
        kb = self._kb
        if kb is None:
            return
        if kb.encoder is not None:
            kb.add_express_encoder(self._cfg.kb_omp_threads, self._cfg.kb_query_cache)
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
            raise Unavailable("knowledge base is not loaded (still loading or not configured)")
        return self._kb

    @staticmethod
    def _deadline(context, stage: str) -> None:
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"deadline passed {stage}")

    @staticmethod
    def _run(context, fn):
        """fn(); a search the caller left is DEADLINE_EXCEEDED or CANCELLED depending on why it left (every other
        error reaches the client through the error table, ragcore/errors.py)."""
        try:
            return fn()
        except SearchStopped as e:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(str(e)) from None
            raise

    # --------------------------------------------------------------------------------------------- RPCs

    def Search(self, request, context):
        kb = self._ready(context)
        self._deadline(context, "before the search")

        def check():
            vectors = None
            if request.vectors:
                vectors = unpack_f32(request.vectors, "vectors", dim=kb.query_dim(request.retriever, request.index))
            if request.with_text and request.index not in ("", KB_INDEX):
                raise KBInputError("with_text", f"index {clip(request.index)} has no passages")
            vec_dim = kb.stored_dim(request.index, "with_vectors") if request.with_vectors else 0
            batch = len(request.texts) or (len(vectors) if vectors is not None else 0)
            if batch and 1 <= request.k <= kb.limits.max_k and batch <= kb.limits.max_batch:
                # Before any work: 1024 queries x k 1024 with vectors would be ~1.6 GB of reply.
                kb.check_search_size(batch, request.k, index=request.index, with_text=request.with_text,
                                     with_vectors=request.with_vectors,
                                     with_query_vectors=request.with_query_vectors)
            return vectors, vec_dim

        vectors, vec_dim = self._run(context, check)
        express = self._express_lane(kb, request)
        call = None if express else self._search_call(kb, request, vectors, context)

        def work(should_stop):
            if call is not None:
                result = self._coalescer(kb).run(call)
            else:
                result = kb.search(request.retriever, request.k, texts=list(request.texts), vectors=vectors,
                                   index=request.index, ef_search=request.ef_search, should_stop=should_stop,
                                   express=express)
            if should_stop():
                raise SearchStopped("the call ended during the search")
            results = []
            for h in result.hits:
                msg = knowledge_pb2.Hits(ids=pack_ids(h.ids), scores=pack_f32(h.scores))
                if request.with_text and len(h.ids):
                    msg.documents.extend(knowledge_pb2.Document(id=i, title=t, text=x)
                                         for i, t, x in kb.documents(h.ids))
                if request.with_vectors and len(h.ids):
                    msg.vectors = pack_f32(kb.passage_vectors(h.ids, "with_vectors", request.index))
                results.append(msg)
            dim = result.query_vectors.shape[1] if result.query_vectors is not None else vec_dim
            out = knowledge_pb2.SearchResponse(results=results, dim=dim, encode_ms=result.encode_ms,
                                               search_ms=result.search_ms)
            if request.with_query_vectors and result.query_vectors is not None:
                out.query_vectors = pack_f32(result.query_vectors)
            return out

        if call is not None:
            self._coalescer(kb).add(call)
        try:
            out = self._run(context, lambda: self._offload(context, work, express))
        finally:
            if call is not None:
                self._coalescer(kb).discard(call)
        self._deadline(context, "after the search")
        return out

    @staticmethod
    def _express_lane(kb: KnowledgeBase, request) -> bool:
        """A small dense text Search: it takes the express lane (its own thread and encoder)."""
        return (kb.express_encoder is not None and bool(request.texts) and not request.vectors
                and request.retriever in ("edr", "adr") and request.index in ("", KB_INDEX)
                and kb.express_tokens(request.texts) <= EXPRESS_TOKENS)

    def _coalescer(self, kb: KnowledgeBase) -> SearchCoalescer:
        with self._lock:
            c = self._coalescers.get(id(kb))
            if c is None:
                c = self._coalescers[id(kb)] = SearchCoalescer(kb.search, max_queries=SEARCH_CHUNK,
                                                               max_results=kb.limits.max_results)
            return c

    def _search_call(self, kb: KnowledgeBase, request, vectors: np.ndarray | None, context) -> SearchCall | None:
        """The Search as a call that may join others' (SearchCoalescer), or None to run it alone: not exact,
        coalescing off, or a request the KB would reject (then it runs alone so the error is its own)."""
        n = len(request.texts) or (len(vectors) if vectors is not None else 0)
        if not (self._cfg.kb_coalesce and request.retriever == "edr" and 1 <= request.k <= kb.limits.max_k
                and 0 < n <= SEARCH_CHUNK and not (request.texts and vectors is not None)
                and kb.serves(request.retriever, request.index)):
            return None

        def gone() -> bool:
            remaining = context.time_remaining()
            return not context.is_active() or (remaining is not None and remaining <= 0)

        return SearchCall((request.retriever, request.index, request.ef_search), request.k,
                          list(request.texts) or None, vectors, gone)

    def ScoreCandidates(self, request, context):
        kb = self._ready(context)
        self._deadline(context, "before scoring")

        def run(should_stop):
            ids = unpack_ids(request.ids, "ids")
            vector = None
            if request.vector:
                vector = unpack_f32(request.vector, "vector", dim=kb.query_dim(request.retriever, request.index))
                if len(vector) != 1:
                    raise KBInputError("vector", f"{len(vector)} vectors given, ScoreCandidates takes one query")
                vector = vector[0]
            return kb.score_candidates(request.retriever, ids, text=request.text, vector=vector,
                                       index=request.index)

        res = self._run(context, lambda: self._offload(context, run))
        out = knowledge_pb2.ScoreCandidatesResponse(scores=pack_f32(res.scores),
                                                    order=pack_array(res.order, "<i4"),
                                                    encode_ms=res.encode_ms, score_ms=res.score_ms)
        if request.text and res.query_vector is not None:
            out.query_vector = pack_f32(res.query_vector)
        return out

    def GetDocuments(self, request, context):
        kb = self._ready(context)

        def run(should_stop):
            ids = kb.check_ids(unpack_ids(request.ids, "ids"), "ids")
            need = len(ids) * (kb.passages.max_record_bytes + 32)
            if need > kb.limits.max_reply_bytes:
                raise KBInputError("ids", f"{len(ids)} documents could need a {need >> 20} MiB reply, over the "
                                   f"{kb.limits.max_reply_bytes >> 20} MiB message limit; ask for fewer")
            docs = kb.documents(ids)
            vecs = kb.passage_vectors(ids, "with_vectors") if request.with_vectors else None
            return docs, vecs

        docs, vecs = self._run(context, lambda: self._offload(context, run))
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
                                                   retrievers=v["retrievers"], default_ef_search=v["ef_search"],
                                                   shared_scans=self._cfg.kb_coalesce and "edr" in v["retrievers"])
                     for v in info["indexes"]],
            manifest_json=json.dumps(info["manifest"], sort_keys=True))


class _NoContext:
    """Stand-in for grpc.ServicerContext when warming up the handlers in-process."""

    def time_remaining(self):
        return None

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        return True

    def abort(self, code, details):
        raise RuntimeError(f"warm-up call failed: {code} {details}")
