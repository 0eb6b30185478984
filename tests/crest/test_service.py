"""CREST through the services, in process on free loopback ports: the Draft RPC's source="crest" (embedded and
Redis), UNAVAILABLE when Redis is down, and a generation whose Redis dies mid-run finishing degraded with
exactly the autoregressive output."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.ngram_redis import push_to_redis
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore
from retrieval_service.server import build_server

from .conftest import REDIS_TIMEOUT_MS, corpus
from .test_store import same_tree


@pytest.fixture(scope="module")
def store_path(small_ds, tmp_path_factory):
    path = tmp_path_factory.mktemp("crest-svc") / "small.crest"
    build_store(small_ds, path, max_n=3, t=25, progress=False)
    return path


def draft(stub, ctx, source="crest", max_nodes=64):
    reply = stub.Draft(draft_pb2.DraftRequest(context=pack_tokens(ctx), params=draft_pb2.DraftParams(
        source=source, max_nodes=max_nodes)), timeout=30)
    return DraftTree.from_bytes(reply.tokens, reply.parents, reply.scores, reply.source_p,
                                    matched_suffix=reply.matched_suffix,
                                num_matches=reply.num_matches)


class Service:
    def __init__(self, cfg: RetrievalConfig, **indexes):
        self.running = build_server(cfg, **indexes)
        self.channel = grpc.insecure_channel(self.running.address)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.running.stop(0)


def test_draft_rpc_serves_crest_from_both_backends(redis_server, store_path):
    embedded = EmbeddedNgramStore.open(store_path)
    push_to_redis(embedded, redis_server.url, "crest:svc", progress=False)
    ctxs = [d[:k] for d in corpus()[:20] for k in (2, 4) if len(d) >= k]
    for cfg in (RetrievalConfig(port=0, crest=str(store_path)),
                RetrievalConfig(port=0, crest=redis_server.url, crest_namespace="crest:svc",
                                crest_timeout_ms=REDIS_TIMEOUT_MS)):
        svc = Service(cfg)
        try:
            info = svc.stub.Info(draft_pb2.DatastoreInfoRequest(), timeout=30)
            assert "crest" in info.sources and info.tokenizer_id == embedded.tokenizer_id
            for ctx in ctxs:
                assert same_tree(draft(svc.stub, ctx, max_nodes=7), embedded.lookup(ctx, 7))
            batch = svc.stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[
                draft_pb2.DraftRequest(context=pack_tokens(c), params=draft_pb2.DraftParams(source="crest"))
                for c in ctxs]), timeout=30)
            assert [r.matched_suffix for r in batch.responses] == [embedded.lookup(c).matched_suffix for c in ctxs]
        finally:
            svc.close()


def test_redis_down_answers_unavailable_and_no_store_failed_precondition(redis_server, store_path):
    embedded = EmbeddedNgramStore.open(store_path)
    push_to_redis(embedded, redis_server.url, "crest:svc", progress=False)
    svc = Service(RetrievalConfig(port=0, crest=redis_server.url, crest_namespace="crest:svc",
                                  crest_timeout_ms=REDIS_TIMEOUT_MS))
    plain = Service(RetrievalConfig(port=0))
    fallback = Service(RetrievalConfig(port=0, crest=redis_server.url, crest_namespace="crest:svc",
                                       crest_timeout_ms=REDIS_TIMEOUT_MS, crest_fallback=str(store_path)))
    try:
        ctx = corpus()[0][:3]
        draft(svc.stub, ctx)
        redis_server.stop()
        with pytest.raises(grpc.RpcError) as err:
            draft(svc.stub, ctx)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # Not INTERNAL, Not an empty tree
        assert "Redis unavailable" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            svc.stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[draft_pb2.DraftRequest(
                context=pack_tokens(ctx), params=draft_pb2.DraftParams(source="crest"))]), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # The embedded copy answers while Redis is down.
        assert same_tree(draft(fallback.stub, ctx), embedded.lookup(ctx))
        with pytest.raises(grpc.RpcError) as err:
            draft(plain.stub, ctx)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # a server without a CREST store
        assert "needs a CREST store" in err.value.details()
    finally:
        for s in (svc, plain, fallback):
            s.close()


# ----------------------------------------------------------------------------------------------------------------
# End to end with the real model (fp32: speculative output must equal autoregressive output exactly)


class StopRedisAt:
    """A CREST store that stops the Redis server right before its k-th lookup: 'Redis dies mid-generation' at a
    deterministic step (no sleeps, no races)."""

    def __init__(self, store, server, k: int):
        self.store, self.server, self.k, self.calls = store, server, k, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def _count(self) -> None:
        self.calls += 1
        if self.calls == self.k:
            self.server.stop()

    def lookup(self, ctx, max_nodes=64):
        self._count()
        return self.store.lookup(ctx, max_nodes)

    def lookup_batch(self, contexts, max_nodes=64):  # DraftBatch: the worker asks a pass's drafts in one call
        self._count()
        return self.store.lookup_batch(contexts, max_nodes)


@pytest.fixture(scope="module")
def tm():
    from tests.conftest import real_model

    return real_model("fp32")


@pytest.fixture(scope="module")
def real_store(tmp_path_factory):
    """A CREST store over a few stdlib packages, tokenized with the serving model's tokenizer."""
    from ragcore.model_files import default_model_dir, load_tokenizer, tokenizer_identity
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
    from tests.integration.conftest import stdlib_documents

    tok = load_tokenizer(default_model_dir())
    docs = [np.asarray(tok(t, add_special_tokens=False)["input_ids"], np.int32) for t in stdlib_documents()]
    d = tmp_path_factory.mktemp("crest-real")
    ds = SuffixArrayDatastore.build(docs, d / "ds", vocab_size=len(tok), tokenizer_id=tokenizer_identity(tok),
                                    progress=False)
    build_store(ds, d / "stdlib.crest", max_n=5, t=400, progress=False)
    return EmbeddedNgramStore.open(d / "stdlib.crest")


@pytest.mark.model
def test_generation_survives_redis_dying_mid_run(tm, real_store, redis_server):
    from generation_service.client import GenerationClient
    from retrieval_service.datastore.ngram_redis import RedisNgramStore
    from tests.integration.conftest import PROMPTS, start_generation

    push_to_redis(real_store, redis_server.url, "crest:stdlib", progress=False)
    remote = RedisNgramStore(redis_server.url, "crest:stdlib", timeout_ms=REDIS_TIMEOUT_MS)
    dying = StopRedisAt(remote, redis_server, k=4)  # three good drafts, then Redis is gone for good
    retrieval = build_server(RetrievalConfig(port=0), crest=dying)
    running, servicer = start_generation(tm, retrieval.address, retry_after_s=0.05, draft_timeout_ms=5000)
    try:
        with GenerationClient(running.address) as c:
            want = c.generate(PROMPTS[0], max_new_tokens=40, decoding="ar", ignore_eos=True, timeout=600)
            got = c.generate(PROMPTS[0], max_new_tokens=40, decoding="crest", ignore_eos=True, timeout=600)
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)
    assert list(got.token_ids) == list(want.token_ids)  # Not a failed request, Not a different output
    assert got.stats.decoding == "crest"
    assert got.stats.draft_tokens_proposed > 0  # CREST drafted before Redis died
    assert got.stats.degraded and got.stats.degraded_steps > 0  # ... and the rest decoded AR
    assert "UNAVAILABLE" in got.stats.degraded_reason or "unavailable" in got.stats.degraded_reason
    assert dying.calls >= 4
