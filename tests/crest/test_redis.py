"""The Redis backend against a real redis-server of our own: same answers as the embedded store, outages
reported as StoreUnavailable (never empty drafts), re-pushes picked up, the embedded fallback."""

import numpy as np
import pytest

from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.ngram_backends import open_ngram_store
from retrieval_service.datastore.ngram_redis import RedisNgramStore, push_to_redis
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    FallbackNgramStore,
    NgramStoreError,
    StoreUnavailable,
)

from .conftest import REDIS_TIMEOUT_MS, VOCAB, corpus
from .test_store import same_tree


@pytest.fixture(scope="module")
def stores(small_ds, tmp_path_factory):
    d = tmp_path_factory.mktemp("crest-redis")
    a = build_store(small_ds, d / "a.crest", max_n=3, t=25, progress=False)["path"]
    b = build_store(small_ds, d / "b.crest", max_n=3, t=5, progress=False)["path"]
    return EmbeddedNgramStore.open(a), EmbeddedNgramStore.open(b)


def contexts(count: int = 200, seed: int = 2) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    docs = corpus()
    out = []
    for _ in range(count):
        d = docs[rng.integers(0, len(docs))] + [int(rng.integers(0, VOCAB))]
        end = int(rng.integers(1, len(d) + 1))
        out.append(d[max(0, end - 5):end])
    return out


def test_redis_and_embedded_give_identical_answers(redis_server, stores):
    embedded, _ = stores
    report = push_to_redis(embedded, redis_server.url, "crest:small", batch=7, progress=False)
    assert report["ngrams"] == embedded.num_records
    remote = RedisNgramStore(redis_server.url, "crest:small", expected_tokenizer_id=embedded.tokenizer_id,
                             timeout_ms=REDIS_TIMEOUT_MS)
    ctxs = contexts()
    for max_nodes in (64, 3):
        for ctx in ctxs:
            assert same_tree(remote.lookup(ctx, max_nodes), embedded.lookup(ctx, max_nodes)), ctx
        batch = remote.lookup_batch(ctxs, max_nodes)  # one pipelined round trip
        assert all(same_tree(r, embedded.lookup(c, max_nodes)) for r, c in zip(batch, ctxs))
    assert sum(remote.lookup(c).matched_suffix > 0 for c in ctxs) > 50  # real hits, not empty agreement


def test_redis_outages_raise_store_unavailable(redis_server, stores):
    embedded, _ = stores
    push_to_redis(embedded, redis_server.url, "crest:small", progress=False)
    remote = RedisNgramStore(redis_server.url, "crest:small", timeout_ms=REDIS_TIMEOUT_MS)
    ctx = contexts(1)[0]
    remote.lookup(ctx)
    # Redis restarted empty (no persistence): the sentinel is gone -> unavailable, Not an empty draft.
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    with pytest.raises(StoreUnavailable, match="holds no CREST store 'crest:small'"):
        remote.lookup(ctx)
    # Stopped: a fast StoreUnavailable naming the URL, Not a hang or a redis-py exception.
    redis_server.stop()
    with pytest.raises(StoreUnavailable, match=f"at {redis_server.url}: Redis unavailable"):
        remote.lookup(ctx)
    with pytest.raises(StoreUnavailable):
        remote.lookup_batch([ctx, ctx])
    # Back (empty): the store must be pushed again; until then it is missing, Not served from stale keys.
    redis_server.start()
    with pytest.raises(StoreUnavailable, match="holds no CREST store"):
        remote.lookup(ctx)
    push_to_redis(embedded, redis_server.url, "crest:small", progress=False)
    assert same_tree(remote.lookup(ctx), embedded.lookup(ctx))


def test_missing_store_is_an_error_not_an_outage(redis_server):
    remote = RedisNgramStore(redis_server.url, "crest:nothing")
    with pytest.raises(NgramStoreError, match="holds no CREST store 'crest:nothing'"):
        remote.connect()
    with pytest.raises(ValueError, match="namespace must be 1-200 characters"):
        RedisNgramStore(redis_server.url, "bad namespace")


def test_a_new_push_replaces_the_old_build(redis_server, stores):
    big, small = stores
    push_to_redis(big, redis_server.url, "crest:small", progress=False)
    push_to_redis(big, redis_server.url, "crest:other", progress=False)  # another store, same Redis
    remote = RedisNgramStore(redis_server.url, "crest:small", timeout_ms=REDIS_TIMEOUT_MS)
    ctxs = contexts(50)
    assert all(same_tree(remote.lookup(c), big.lookup(c)) for c in ctxs)
    report = push_to_redis(small, redis_server.url, "crest:small", progress=False)
    assert report["dropped_keys"] == big.num_records + 2  # the old build's n-grams, zdict and sentinel
    # The running reader switches to the new build at its next lookup.
    assert all(same_tree(remote.lookup(c), small.lookup(c)) for c in ctxs)  # Not the old build's trees
    other = RedisNgramStore(redis_server.url, "crest:other", timeout_ms=REDIS_TIMEOUT_MS)  # Not dropped with crest:small's old build
    assert all(same_tree(other.lookup(c), big.lookup(c)) for c in ctxs)


def test_embedded_fallback_answers_while_redis_is_down(redis_server, stores):
    embedded, _ = stores
    push_to_redis(embedded, redis_server.url, "crest:small", progress=False)
    store = open_ngram_store(redis_server.url, namespace="crest:small", fallback=str(embedded.path),
                             timeout_ms=REDIS_TIMEOUT_MS)
    assert isinstance(store, FallbackNgramStore)
    ctxs = contexts(30)
    assert all(same_tree(store.lookup(c), embedded.lookup(c)) for c in ctxs) and store.fallbacks == 0
    redis_server.stop()
    assert all(same_tree(store.lookup(c), embedded.lookup(c)) for c in ctxs)  # Not StoreUnavailable
    assert store.fallbacks == len(ctxs)
    # Redis down already at start-up: the embedded copy's header is used until Redis answers.
    late = open_ngram_store(redis_server.url, namespace="crest:small", fallback=str(embedded.path),
                             timeout_ms=REDIS_TIMEOUT_MS)
    assert same_tree(late.lookup(ctxs[0]), embedded.lookup(ctxs[0]))


def test_crest_drafter_proposes_store_trees_and_reports_outages(redis_server, stores):
    from generation_service.drafting.drafters import CrestDrafter, DraftUnavailable

    embedded, _ = stores
    push_to_redis(embedded, redis_server.url, "crest:drafter", progress=False)
    local, remote = CrestDrafter(embedded), CrestDrafter(RedisNgramStore(redis_server.url, "crest:drafter", timeout_ms=REDIS_TIMEOUT_MS))
    ctxs = [np.asarray(c, np.int32) for c in contexts(40)]
    for max_nodes in (64, 4):
        assert all(same_tree(remote.propose(c, max_nodes), embedded.lookup(c, max_nodes)) for c in ctxs)
        assert all(len(local.propose(c, max_nodes)) <= max_nodes for c in ctxs)  # Not the untrimmed tree
    redis_server.stop()
    with pytest.raises(DraftUnavailable, match="Redis unavailable"):  # Not StoreUnavailable: the loop degrades
        remote.propose(ctxs[0], 64)
    assert same_tree(local.propose(ctxs[0], 64), embedded.lookup(ctxs[0], 64))
