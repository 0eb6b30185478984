"""The retrieval service's metric families (Prometheus): latency per RPC and retriever (draft source or KB
retriever), batch sizes, datastore / learned-shard / KB sizes. Plumbing (registry, /metrics endpoint, gRPC server
families) is ragcore/metrics.py.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcore import metrics as core
from ragcore.metrics import LATENCY_BUCKETS, ServerMetrics

SERVICE = "retrieval"
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RetrievalMetrics(ServerMetrics):
    def __init__(self, r: CollectorRegistry):
        super().__init__(r)
        self.retrieval_seconds = Histogram("ragserve_retrieval_request_seconds",
                                           "Successful retrieval RPC latency by method and retriever/source.",
                                           ("method", "retriever"), buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram("ragserve_retrieval_batch_size", "Queries per batched call.", ("method",),
                               buckets=_BATCH, registry=r)
        self.ds_tokens = Gauge("ragserve_retrieval_datastore_tokens", "Tokens in the suffix-array datastore.",
                               registry=r)
        self.ds_documents = Gauge("ragserve_retrieval_datastore_documents", "Documents in the datastore.",
                                  registry=r)
        self.ds_shards = Gauge("ragserve_retrieval_datastore_shards", "Datastore shards.", registry=r)
        self.ds_bytes = Gauge("ragserve_retrieval_datastore_bytes", "Datastore size on disk.", registry=r)
        self.learned = Gauge("ragserve_retrieval_learned_tokens", "Tokens held by the online-learning shards.",
                             registry=r)
        self.kb_passages = Gauge("ragserve_retrieval_kb_passages", "Passages in the knowledge base.", registry=r)
        self.crest_degraded = Counter("ragserve_retrieval_crest_degraded_total",
                                      "CREST lookups answered without their store (empty draft, or the embedded "
                                      "fallback) because Redis Cluster could not answer: unavailable = connection "
                                      "error, timeout or CLUSTERDOWN (failover); missing = the slot lost the store's "
                                      "keys.", ("reason",), registry=r)
        self.kb_vectors = Gauge("ragserve_retrieval_kb_index_vectors", "Vectors per KB vector index.", ("index",),
                                registry=r)


def _retriever(method: str, request) -> tuple[str, int]:
    """(retriever label, batch size) of a retrieval request; ("", 0) when it has none."""
    if method == "Draft":
        return request.params.source or "datastore", 1
    if method == "DraftBatch":
        sources = {r.params.source or "datastore" for r in request.requests}
        return (sources.pop() if len(sources) == 1 else "mixed"), len(request.requests)
    if method == "Search":
        return request.retriever, len(request.texts)
    if method == "ScoreCandidates":
        return request.retriever, 1
    return "", 0


def observe_retrieval(method: str, request, seconds: float, code: grpc.StatusCode) -> None:
    """GrpcMetrics hook of the retrieval service: latency per RPC and retriever, batch sizes."""
    if code != grpc.StatusCode.OK:
        return
    retriever, batch = _retriever(method, request)
    m = get()
    if retriever not in ("datastore", "merged", "context", "crest", "mixed", "edr", "adr", "sr", ""):
        retriever = "other"  # bounded label values: never echo a request string
    m.retrieval_seconds.labels(method, retriever).observe(seconds)
    if method in ("DraftBatch", "Search") and batch:
        m.batch.labels(method).observe(batch)


def crest_degraded(reason: str, contexts: int) -> None:
    """on_degraded hook of a Redis Cluster CREST store."""
    get().crest_degraded.labels(reason).inc(contexts)


def set_datastore_size(ds, learner=None) -> None:
    m = get()
    if ds is not None:
        for gauge, attr in ((m.ds_tokens, "num_tokens"), (m.ds_documents, "num_documents"),
                            (m.ds_shards, "num_shards"), (m.ds_bytes, "bytes_on_disk")):
            value = getattr(ds, attr, None)
            if value is not None:
                gauge.set(value)
    if learner is not None:
        m.learned.set_function(lambda: learner.learned_tokens)


def set_kb_size(num_passages: int, indexes: Iterable[tuple[str, int]] = ()) -> None:
    m = get()
    m.kb_passages.set(num_passages)
    for name, size in indexes:
        m.kb_vectors.labels(name).set(size)


def get() -> RetrievalMetrics:
    return core.get(SERVICE)


core.declare(SERVICE, RetrievalMetrics)
