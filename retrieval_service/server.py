"""Retrieval service: draft trees from suffix-array datastores (and the knowledge base when configured).

    python -m retrieval_service.server --datastore ~/.cache/ragserve/datastores/stdlib --port 50051

Stateless per request; the datastore is memory-mapped read-only and the drafting kernels release the GIL,
so concurrent calls run in parallel on the thread pool. Health reports SERVING only after every configured
index is open and its kernels are warmed up.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from proto import draft_pb2, draft_pb2_grpc
from ragcore import metrics as core_metrics, security
from ragcore.draft_tree import DraftTree, context_draft
from ragcore.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from ragcore.grpc_shell import STOP_JOIN_S, RunningServer, install_signal_handlers, start_server
from ragcore.process import offline_process
from ragcore.wire import WireError, clip, unpack_tokens
from retrieval_service import metrics
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore import container
from retrieval_service.datastore.ngram_backends import open_ngram_store
from retrieval_service.datastore.ngram_store import StoreUnavailable
from retrieval_service.datastore.online import OnlineLearner
from retrieval_service.datastore.shards import DatastoreCorrupted
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
from retrieval_service.knowledge import dense, knn_index, sparse
from retrieval_service.knowledge.backends import open_knowledge_base
from retrieval_service.knowledge.kb import KBOpenError, KnowledgeBase
from retrieval_service.knowledge.service import SERVICE_NAME as KNOWLEDGE_SERVICE, KnowledgeServicer

log = logging.getLogger("retrieval_service")

_SOURCES = ("datastore", "merged", "context", "crest")
_DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


@dataclass(frozen=True)
class DraftLimits:
    max_suffix: int
    min_suffix: int
    max_matches: int
    continuation: int
    max_nodes: int
    source: str

    def kwargs(self) -> dict:
        return dict(max_suffix=self.max_suffix, min_suffix=self.min_suffix, max_matches=self.max_matches,
                    continuation=self.continuation, max_nodes=self.max_nodes)


def resolve_limits(params: draft_pb2.DraftParams, cfg: RetrievalConfig, field: str = "params") -> DraftLimits:
    """Fill server defaults for zero fields and range-check the rest (WireError names the field)."""

    def pick(name: str, default: int, upper: int) -> int:
        value = getattr(params, name) or default
        if not 1 <= value <= upper:
            raise WireError(f"{field}.{name}", f"{value} is outside [1, {upper}]")
        return value

    max_suffix = pick("max_suffix", cfg.max_suffix, cfg.limit_max_suffix)
    min_suffix = pick("min_suffix", min(cfg.min_suffix, max_suffix), max_suffix)
    source = params.source or "datastore"
    if source not in _SOURCES:
        raise WireError(f"{field}.source", f"{clip(source)} is not one of {', '.join(_SOURCES)}")
    return DraftLimits(
        max_suffix=max_suffix,
        min_suffix=min_suffix,
        max_matches=pick("max_matches", cfg.max_matches, cfg.limit_max_matches),
        continuation=pick("continuation", cfg.continuation, cfg.limit_continuation),
        max_nodes=pick("max_nodes", cfg.max_nodes, cfg.limit_max_nodes),
        source=source,
    )


def tree_to_proto(tree: DraftTree, server_ms: float) -> draft_pb2.DraftResponse:
    tokens, parents, scores, source_p = tree.to_bytes()
    return draft_pb2.DraftResponse(
        tokens=tokens, parents=parents, scores=scores, source_p=source_p, matched_suffix=tree.matched_suffix,
        num_matches=tree.num_matches, context_matched_suffix=tree.context_matched_suffix, server_ms=server_ms,
    )


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    """Thin shell: validate, call the datastore, pack the tree."""

    def __init__(self, cfg: RetrievalConfig, datastore=None, vocab_size: int | None = None,
                 on_corrupted=None):
        self._cfg = cfg
        # Called once with the error when drafting finds the datastore corrupted (the server marks DraftService
        # NOT_SERVING: only a restart, which verifies the files again, can bring it back).
        self._on_corrupted = on_corrupted
        self._corrupted: DatastoreCorrupted | None = None
        self._corrupted_lock = threading.Lock()
        self._ds = None
        self._crest = None  # CREST n-gram store (embedded / Redis), source="crest"
        self._learner = None
        self._vocab = vocab_size
        self._ready = False
        if datastore is not None or vocab_size is not None:
            self.attach(datastore, vocab_size)

    def attach(self, datastore, vocab_size: int | None = None, learner=None, crest=None) -> None:
        """Called once the datastore is open and warm; until then calls get UNAVAILABLE."""
        self._ds = datastore
        self._learner = learner
        self._crest = crest
        self._vocab = datastore.vocab_size if datastore is not None else (
            crest.vocab_size or vocab_size if crest is not None else vocab_size)
        self._ready = True

    def _parse(self, request: draft_pb2.DraftRequest, field: str) -> tuple[np.ndarray, DraftLimits]:
        ctx = unpack_tokens(request.context, f"{field}context", vocab_size=self._vocab,
                            max_len=self._cfg.limit_context_tokens)
        limits = resolve_limits(request.params, self._cfg, f"{field}params")
        if limits.source == "crest":
            if self._crest is None:
                raise FailedPrecondition(f"{field}params.source='crest' needs a CREST store; this server has none "
                                         f"(start it with --crest FILE|redis://...)")
        elif limits.source != "context" and self._ds is None:
            raise FailedPrecondition(f"{field}params.source={clip(limits.source)} needs a datastore; this server has "
                                     "none")
        return ctx, limits

    def _draft_one(self, ctx: np.ndarray, limits: DraftLimits) -> DraftTree:
        if limits.source == "context":
            return context_draft(ctx, **limits.kwargs())
        if limits.source == "crest":  # single Redis down: StoreUnavailable -> UNAVAILABLE; a cluster: empty
            return self._drafts(lambda: self._crest.lookup(ctx, max_nodes=limits.max_nodes))
        return self._ds.draft(ctx, source=limits.source, **limits.kwargs())

    def _check_ready(self) -> None:
        if not self._ready:
            raise Unavailable("datastore is still loading")

    def _corrupted_seen(self, e: DatastoreCorrupted) -> None:
        with self._corrupted_lock:
            first, self._corrupted = self._corrupted is None, self._corrupted or e
        if first:
            log.error("datastore corrupted while drafting (Draft answers DATA_LOSS; restart to re-verify): %s "
                      "[%s]", e, ", ".join(e.paths))
            if self._on_corrupted is not None:
                self._on_corrupted(e)

    def _drafts(self, fn):
        try:
            return fn()
        except DatastoreCorrupted as e:  # answered DATA_LOSS by the shell; the service also stops reporting SERVING
            self._corrupted_seen(e)
            raise

    def Draft(self, request, context):
        self._check_ready()
        ctx, limits = self._parse(request, "")
        t0 = time.perf_counter()
        tree = self._drafts(lambda: self._draft_one(ctx, limits))
        return tree_to_proto(tree, (time.perf_counter() - t0) * 1e3)

    def DraftBatch(self, request, context):
        self._check_ready()
        n = len(request.requests)
        if not 1 <= n <= self._cfg.limit_batch:
            raise InvalidArgument("requests", f"batch of {n} is outside [1, {self._cfg.limit_batch}]")
        parsed = [self._parse(r, f"requests[{i}].") for i, r in enumerate(request.requests)]
        t0 = time.perf_counter()
        limits0 = parsed[0][1]
        same = all(lim == limits0 for _, lim in parsed)
        if same and limits0.source == "crest":
            # One call: a Redis store answers the whole batch in one round trip.
            trees = self._drafts(lambda: self._crest.lookup_batch([c for c, _ in parsed],
                                                                  max_nodes=limits0.max_nodes))
        elif self._ds is not None and limits0.source not in ("context", "crest") and same:
            # One call: the datastore spreads the batch over both cores with GIL-free kernels.
            trees = self._drafts(lambda: self._ds.draft_batch([c for c, _ in parsed], source=limits0.source,
                                                              **limits0.kwargs()))
        else:
            trees = []
            for ctx, lim in parsed:
                if context.time_remaining() is not None and context.time_remaining() <= 0:
                    raise DeadlineExceeded("deadline passed during the batch")
                trees.append(self._drafts(lambda: self._draft_one(ctx, lim)))
        ms = (time.perf_counter() - t0) * 1e3 / n
        return draft_pb2.DraftBatchResponse(responses=[tree_to_proto(t, ms) for t in trees])

    def Info(self, request, context):
        self._check_ready()
        ds = self._ds
        sources = ["context"] + (["datastore", "merged"] if ds is not None else []) + (
            ["crest"] if self._crest is not None else [])
        if ds is None:
            return draft_pb2.DatastoreInfo(vocab_size=self._vocab or 0, sources=sources,
                                           tokenizer_id=self._crest.tokenizer_id if self._crest is not None else "")
        return draft_pb2.DatastoreInfo(
            tokenizer_id=ds.tokenizer_id, vocab_size=ds.vocab_size, num_tokens=ds.num_tokens,
            num_documents=ds.num_documents, num_shards=ds.num_shards, bytes_on_disk=ds.bytes_on_disk,
            path=ds.path.name if ds.path is not None else "", sources=sources, learning=self._learner is not None,
            learned_tokens=self._learner.learned_tokens if self._learner is not None else 0,
            searchable_learned_tokens=self._learner.searchable_tokens if self._learner is not None else 0,
        )

    def Learn(self, request, context):
        self._check_ready()
        if self._learner is None:
            raise FailedPrecondition("online learning is off on this server (start it with --learn true and a "
                                     "datastore)")
        tokens = unpack_tokens(request.tokens, "tokens", vocab_size=self._vocab, max_len=self._cfg.limit_context_tokens)
        self._learner.add(tokens)
        return draft_pb2.LearnResponse(learned_tokens=self._learner.learned_tokens,
                                       documents=self._learner.documents_learned)


def verify_cache_path(cfg: RetrievalConfig) -> Path | None:
    """cfg.verify_cache resolved: "" = $RAGSERVE_HOME/cache/verified-stores.json, "off" = no cache."""
    return container.cache_path(cfg.verify_cache)


def open_indexes(cfg: RetrievalConfig):
    """Open, verify and warm up every configured index; raise a clear error naming the file if one is missing or
    corrupted (the server then never reports SERVING)."""
    datastore = None
    if cfg.datastore:
        t0 = time.perf_counter()
        datastore = SuffixArrayDatastore.open(cfg.datastore, verify=cfg.datastore_verify,
                                              verify_cache=verify_cache_path(cfg))
        if cfg.datastore_verify:
            states = [state for _, state in datastore.verification]
            log.info("datastore %s: %d shard(s) verified, %d unchanged since verified (%.2f s)", cfg.datastore,
                     states.count("verified"), states.count("cached"), time.perf_counter() - t0)
        datastore.warmup()
    return datastore


def open_crest(cfg: RetrievalConfig, datastore=None):
    """The configured CREST store (None if none), warmed up. Redis down at start-up is not fatal: a single Redis
    answers StoreUnavailable (-> UNAVAILABLE) until it is back, a cluster empty drafts (counted in
    ragserve_retrieval_crest_degraded_total); a missing or corrupted store is fatal."""
    if not cfg.crest:
        return None
    store = open_ngram_store(cfg.crest, namespace=cfg.crest_namespace, timeout_ms=cfg.crest_timeout_ms,
                             fallback=cfg.crest_fallback, on_degraded=metrics.crest_degraded,
                             expected_tokenizer_id=datastore.tokenizer_id if datastore is not None else None)
    try:
        store.warmup()
    except StoreUnavailable as e:
        log.warning("CREST store not reachable yet (no CREST drafts until it is): %s", e)
    return store


def build_server(cfg: RetrievalConfig, *, datastore=None, kb=None, crest=None) -> RunningServer:
    """Bind the port first (health answers NOT_SERVING while indexes load), then open indexes, warm up,
    and report SERVING. A missing or corrupted index stops the server with the loader's error.

    datastore / kb / crest: already-open indexes (tests, benchmarks) instead of the configured paths.
    """
    running_ref: list[RunningServer] = []
    draft = DraftServicer(cfg, on_corrupted=lambda e: running_ref[0].set_serving(False, [_DRAFT_SERVICE]))
    knowledge = KnowledgeServicer(None, cfg)  # UNAVAILABLE until a knowledge base is attached

    def add(server: grpc.Server) -> list[str]:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, server)
        return [_DRAFT_SERVICE, *knowledge.add_to_server(server)]

    auth, credentials = security.server_setup(cfg)
    running = start_server(add, host=cfg.host, port=cfg.port, workers=cfg.workers,
                           max_concurrent_rpcs=cfg.max_concurrent_rpcs, max_message_bytes=cfg.max_message_bytes,
                           interceptors=auth, observers=[core_metrics.GrpcMetrics(metrics.SERVICE, metrics.observe_retrieval)],
                           credentials=credentials,
                           # Searches run in the handler threads: they must get the faiss/BLAS thread cap too.
                           thread_initializer=lambda: dense.configure_faiss(cfg.kb_omp_threads))
    running_ref.append(running)
    try:
        running.closers.append(core_metrics.serve_config(cfg, metrics.SERVICE))
        ds = datastore if datastore is not None else open_indexes(cfg)
        learner = None
        if cfg.learn and ds is not None:
            learner = OnlineLearner(ds, directory=cfg.learn_dir or None, max_tokens=cfg.learn_max_tokens,
                                    compact_tokens=cfg.learn_compact_tokens)
        crest = crest if crest is not None else open_crest(cfg, ds)
        draft.attach(ds, vocab_size=None, learner=learner, crest=crest)
        if kb is None and cfg.kb:
            kb = open_knowledge_base(cfg.kb, cfg)  # loads, checks and warms every index
        if cfg.kb_knn_datastores:
            kb = kb if kb is not None else KnowledgeBase.vectors_only(cfg)
            knn_index.add_to_kb(kb, cfg.kb_knn_datastores, cfg)  # opens, checks and warms each kNN-LM index
        if kb is not None:
            knowledge.attach(kb)
            knowledge.warmup()
            if hasattr(kb, "watch_health"):  # a KB in a database: NOT_SERVING while it cannot be reached
                running.closers.append(kb.watch_health(
                    lambda ok: running.set_serving(ok, [KNOWLEDGE_SERVICE]), cfg.kb_pg_health_s))
            info = kb.info()
            metrics.set_kb_size(info["passages"], [(i["name"], i["size"]) for i in info["indexes"]])
        metrics.set_datastore_size(ds, learner)
    except Exception:
        running.stop(0)
        raise
    running.set_serving(True)
    return running


def serve(cfg: RetrievalConfig) -> None:
    try:
        running = build_server(cfg)
    except Exception as e:
        # A missing or corrupted index: exit non-zero with the loader's message (compose's depends_on then
        # fails at once and the launcher shows it) instead of a process that looks alive but never serves.
        log.error("retrieval service cannot serve: %s", e,
                  exc_info=not isinstance(e, (ValueError, OSError, KBOpenError)))
        sys.exit(2)
    stopped = install_signal_handlers(running, cfg.grace_s)
    log.info("retrieval service SERVING on %s:%d", cfg.host, running.port)
    running.wait()
    stopped.wait(cfg.grace_s + STOP_JOIN_S)  # the drain's last steps (see install_signal_handlers)


def main(argv: list[str] | None = None) -> None:
    cfg = RetrievalConfig.from_args(argv)
    cfg.configure_logging()
    offline_process()
    sparse.prepare_process()
    serve(cfg)


if __name__ == "__main__":
    main()
