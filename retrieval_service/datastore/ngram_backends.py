"""Open a CREST n-gram store by spec: a store file (embedded, memory-mapped), a redis:// URL or a
redis+cluster:// URL, optionally with an embedded copy that answers while Redis is down.

    store = open_ngram_store("~/.cache/ragserve/crest/code.crest")          # embedded
    store = open_ngram_store("redis://127.0.0.1:6379/0", namespace="code")  # Redis
    store = open_ngram_store("redis+cluster://10.0.0.1:7000,10.0.0.2:7000", namespace="code")  # Redis Cluster

A single Redis that is down makes lookups raise StoreUnavailable (the Draft RPC answers UNAVAILABLE); a cluster
failing over makes them return empty drafts (counted, on_degraded) - see ngram_cluster.py for why.
"""

from __future__ import annotations

from typing import Callable

from retrieval_service.datastore.ngram_cluster import ClusterNgramStore, is_cluster_url
from retrieval_service.datastore.ngram_redis import RedisNgramStore
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore, FallbackNgramStore, StoreUnavailable


def is_redis_url(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://")) or is_cluster_url(spec)


def open_ngram_store(spec: str, *, namespace: str = "crest", expected_tokenizer_id: str | None = None,
                     timeout_ms: float = 50.0, fallback: str = "",
                     on_degraded: Callable[[str, int], None] | None = None):
    """A store file path, or a redis:// / redis+cluster:// URL (then `namespace` names the store inside Redis);
    with `fallback` (an embedded store file) a Redis outage is answered from that copy instead of raising
    StoreUnavailable (single node) or returning empty drafts (cluster). on_degraded(reason, contexts): called
    when a cluster store answers contexts without the cluster."""
    if not spec:
        raise ValueError("CREST store: give a store file path, a redis:// or a redis+cluster:// URL")
    if not is_redis_url(spec):
        if fallback:
            raise ValueError(f"crest_fallback {fallback!r} only applies to a Redis store, got the file {spec!r}")
        return EmbeddedNgramStore.open(spec, expected_tokenizer_id)
    if is_cluster_url(spec):
        local = EmbeddedNgramStore.open(fallback, expected_tokenizer_id) if fallback else None
        return ClusterNgramStore(spec, namespace, expected_tokenizer_id=expected_tokenizer_id, timeout_ms=timeout_ms,
                                 fallback=local, on_degraded=on_degraded)
    store = RedisNgramStore(spec, namespace, expected_tokenizer_id=expected_tokenizer_id, timeout_ms=timeout_ms)
    if not fallback:
        return store
    local = EmbeddedNgramStore.open(fallback, expected_tokenizer_id)
    try:
        store.connect()
    except StoreUnavailable:
        # Redis is down at start-up: serve from the copy; the Redis side re-checks on its first good answer.
        store.assume_header(local.header, local.zdict())
    return FallbackNgramStore(store, local)
