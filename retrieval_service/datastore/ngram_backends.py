"""Open a CREST n-gram store by spec: a store file (embedded, memory-mapped) or a redis:// URL, optionally with an
embedded copy that answers while Redis is down.

    store = open_ngram_store("~/.cache/ragserve/crest/code.crest")          # embedded
    store = open_ngram_store("redis://127.0.0.1:6379/0", namespace="code")  # Redis
"""

from __future__ import annotations

from retrieval_service.datastore.ngram_redis import RedisNgramStore
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore, FallbackNgramStore, StoreUnavailable


def is_redis_url(spec: str) -> bool:
    return spec.startswith(("redis://", "rediss://", "unix://"))


def open_ngram_store(spec: str, *, namespace: str = "crest", expected_tokenizer_id: str | None = None,
                     timeout_ms: float = 50.0, fallback: str = ""):
    """A store file path, or a redis:// URL (then `namespace` names the store inside Redis); with `fallback`
    (an embedded store file) a Redis outage is answered from that copy instead of raising StoreUnavailable."""
    if not spec:
        raise ValueError("CREST store: give a store file path or a redis:// URL")
    if not is_redis_url(spec):
        if fallback:
            raise ValueError(f"crest_fallback {fallback!r} only applies to a Redis store, got the file {spec!r}")
        return EmbeddedNgramStore.open(spec, expected_tokenizer_id)
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
