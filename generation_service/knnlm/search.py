"""The retrieval side of kNN-LM: Search calls to the retrieval service (sync or in flight), the datastore backend that
maps entry ids to next tokens, and the true distributions a round is verified against.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import astuple, dataclass, field, replace
from typing import Iterator, Sequence

import grpc
import numpy as np
import torch

from generation_service.augment.kb_client import KBClient, KBUnavailable, parse_search
from generation_service.augment.os3 import OS3Config, StrideScheduler
from generation_service.augment.round_gate import SharedRoundCosts
from generation_service.engine.effects import Effects, call
from generation_service.knnlm.cache import key_norms
from generation_service.knnlm.distribution import mixed_distribution
from generation_service.knnlm.options import KnnLmOptions, KnnLmStats
from generation_service.model.target import TargetModel
from ragcore.errors import InvalidArgument, Unavailable
from ragcore.knn_store import KnnDatastore, open_datastore
from ragcore.model_files import tokenizer_identity


class KnnRetrievalError(Unavailable):
    """Search failed (service down, deadline, bad reply): the request fails (gRPC UNAVAILABLE)."""

    def __init__(self, why: str):
        super().__init__(f"kNN-LM retrieval failed: {why}")


class KnnSearchClient:
    """Batched vector Search over one named index through the worker's KnowledgeService client (kb_client)."""

    def __init__(self, target: str, index: str = "knnlm", *, timeout_ms: float = 10_000.0, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        self.kb = KBClient(target, timeout_ms=timeout_ms, token=token, credentials=credentials)
        self.target, self.index = target, index

    def search(self, queries: np.ndarray, k: int, retriever: str, ef_search: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """queries: float32 [B, D] -> per query (ids int64 [k'], scores float32 [k']), best first.
        KnnRetrievalError when the service cannot answer; KBRequestError (a bug or a server limit) propagates."""
        req = KBClient.search_request(retriever, k, vectors=queries, ef_search=ef_search, index=self.index)
        try:
            reply = parse_search(self.kb.call("Search", req))
        except KBUnavailable as e:
            raise KnnRetrievalError(str(e)) from None
        return self.hits(reply, len(queries))

    def hits(self, reply, n_queries: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A parsed SearchReply -> per query (ids, scores); KnnRetrievalError unless it answers every query."""
        if len(reply.hits) != n_queries:
            raise KnnRetrievalError(f"Search on {self.target}: {len(reply.hits)} results for {n_queries} queries")
        return [(h.ids, h.scores) for h in reply.hits]

    def search_async(self, queries: np.ndarray, k: int, retriever: str, ef_search: int = 0) -> "PendingSearch":
        """Start a batched Search and return at once; PendingSearch.result() waits for it."""
        fut = self.kb.search_async(retriever, k, vectors=queries, ef_search=ef_search, index=self.index)
        return PendingSearch(self, fut, np.asarray(queries, np.float32), k, retriever, ef_search)

    def index_info(self):
        """The service's VectorIndexInfo for our index, or None if it is not served there (KBUnavailable if down)."""
        return next((i for i in self.kb.info().indexes if i.name == self.index), None)

    def close(self) -> None:
        self.kb.close()


class PendingSearch:
    """A verification Search in flight (kb_client.SearchFuture on one replica). Once done(), settled() gives the
    hits, or None if that replica failed: then retry() asks again through KBClient.call, which fails over to the
    other replicas (a blocking call: a Call effect in the loop)."""

    def __init__(self, client: KnnSearchClient, future, queries: np.ndarray, k: int, retriever: str, ef_search: int):
        self.client, self.future, self.queries = client, future, queries
        self.k, self.retriever, self.ef_search = k, retriever, ef_search
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self.future.done()

    def add_done_callback(self, fn) -> None:
        self.future.add_done_callback(lambda _f: fn(self))

    def settled(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Once done(): the hits (`finished_at` = the perf_counter time they arrived), None if the replica failed."""
        try:
            reply = self.future.result()
        except KBUnavailable:
            return None
        self.finished_at = self.future.finished_at or time.perf_counter()
        return self.client.hits(reply, len(self.queries))

    def retry(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The same Search again, failing over to the other replicas (blocking)."""
        hits = self.client.search(self.queries, self.k, self.retriever, self.ef_search)
        self.finished_at = time.perf_counter()
        return hits


@dataclass
class KnnBackend:
    """What kNN-LM needs besides the model: Search on the retrieval service + the datastore's values/keys."""

    datastore: KnnDatastore
    client: KnnSearchClient
    # OS³ state pooled over this backend's requests, per setting that shapes a round: a 48-token request has ~10
    # rounds, and learning γ and the latencies from s_init again in each one spent most of them (ralm_gate pools
    # RaLMSpec's the same way).
    _schedulers: dict[tuple, StrideScheduler] = field(default_factory=dict, repr=False)
    # The round gate's costs per kind of round, pooled the same way (ralm_gate.SharedRoundCosts).
    round_costs: SharedRoundCosts = field(default_factory=SharedRoundCosts, repr=False)
    # The service runs concurrent exact Searches of the index as one scan (its VectorIndexInfo, read by
    # verify_served): then concurrent kNN-LM requests already share what speculation would save (`crowded`).
    shared_scans: bool = False
    # ‖key‖² float32 [N] of every entry, for the speculation caches' fills (key_norms; None = per fill).
    key_norms: np.ndarray | None = field(default=None, repr=False)
    _active: int = field(default=0, repr=False)  # kNN-LM requests decoding now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as decoding while inside."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def crowded(self) -> bool:
        """Other kNN-LM requests decode beside this one and their Searches share scans. Then a speculative round
        has nothing left to save: concurrent one-query Searches already cost one scan (4 of them about as much as
        one alone), while speculation adds its cache work, thrown passes and a batch of several queries per
        request. Served, speculating was faster for 1 client and slower from 2 clients on."""
        return self.shared_scans and self._active > 1

    def scheduler(self, opts: "KnnLmOptions", cfg: OS3Config) -> StrideScheduler:
        """The worker's OS³ scheduler for requests with these options (the stride excepted: it is OS³'s)."""
        key = (astuple(cfg), replace(opts, stride=0))
        with self._lock:
            return self._schedulers.setdefault(key, StrideScheduler(cfg))

    @classmethod
    def open(cls, datastore: str, target: str, index: str = "", **client_kwargs) -> "KnnBackend":
        ds = open_datastore(datastore)
        return cls(ds, KnnSearchClient(target, index or ds.name, **client_kwargs), key_norms=key_norms(ds))

    def check_model(self, tm: TargetModel) -> None:
        """The datastore must have been built with this model's tokenizer and hidden size (ValueError if not)."""
        want = self.datastore.meta.get("tokenizer_id")
        if want and want != tokenizer_identity(tm.tokenizer):
            raise InvalidArgument("knnlm_datastore", f"{self.datastore.path} was built with tokenizer {want}, the model's "
                             f"is {tokenizer_identity(tm.tokenizer)}")
        hidden = tm.model.get_output_embeddings().weight.shape[1]
        if hidden != self.datastore.dim:
            raise InvalidArgument("knnlm_datastore", f"keys of dimension {self.datastore.dim}, the model's hidden size is "
                             f"{hidden}")

    def check(self, opts: KnnLmOptions) -> None:
        """Request-level limits that depend on the datastore (ValueError naming the field)."""
        if opts.k > self.datastore.size:
            raise InvalidArgument("k", f"{opts.k} exceeds the datastore size ({self.datastore.size} entries)")

    def verify_served(self) -> str | None:
        """None if the retrieval service serves an index matching our datastore, else why not."""
        try:
            info = self.client.index_info()
        except KBUnavailable as e:
            return f"retrieval service {self.client.target}: {e}"
        if info is None:
            return f"retrieval service {self.client.target} has no vector index {self.client.index!r}"
        if info.size != self.datastore.size or info.dim != self.datastore.dim:
            return (f"index {info.name!r} on {self.client.target} is {info.size}x{info.dim}, the datastore "
                    f"{self.datastore.path} is {self.datastore.size}x{self.datastore.dim}")
        self.shared_scans = bool(info.shared_scans)
        return None

    def close(self) -> None:
        self.client.close()


def true_distributions(backend: KnnBackend, queries: np.ndarray, logits: Sequence[torch.Tensor], opts: KnnLmOptions,
                       stats: KnnLmStats) -> Effects:
    """One batched Search (a Call) for B queries [B, D] -> (p float64 [V] per query, retrieved entry ids per
    query).

    A failed Search raises KnnRetrievalError (the request fails with UNAVAILABLE). It does not fall back to p_LM:
    unlike a missing draft, which only costs speed, a token decided without its neighbours is a different
    model's answer, and the client asked for the kNN-LM's.
    """
    t0 = time.perf_counter()
    hits = yield call(backend.client.search, queries, opts.k, opts.retriever, opts.ef_search)
    out = hit_distributions(backend, hits, logits, opts, stats)
    stats.retrieval_ms += (time.perf_counter() - t0) * 1e3
    return out


def hit_distributions(backend: KnnBackend, hits: list[tuple[np.ndarray, np.ndarray]],
                      logits: Sequence[torch.Tensor], opts: KnnLmOptions,
                      stats: KnnLmStats) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Search results of B queries + their LM logits -> (p float64 [V] per query, retrieved ids per query)."""
    stats.kb_calls += 1
    stats.kb_queries += len(hits)
    values = backend.datastore.values
    dists = [mixed_distribution(lg, scores, np.asarray(values[ids]), opts) for lg, (ids, scores) in zip(logits, hits)]
    return dists, [ids for ids, _ in hits]


