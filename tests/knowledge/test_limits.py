"""Oversized Searches are refused before any work (INVALID_ARGUMENT naming the field and the limit); a Search whose
caller is gone stops within a chunk; Draft stays fast while the knowledge base is busy (own executor, capped)."""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from proto import draft_pb2, draft_pb2_grpc, knowledge_pb2 as pb, knowledge_pb2_grpc
from ragcore.encoder import Encoder
from ragcore.wire import pack_f32, pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge.kb import SEARCH_CHUNK, KnowledgeBase
from retrieval_service.server import build_server

STDLIB_DATASTORE = Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve")) / "datastores" / "stdlib"


@pytest.fixture(scope="module")
def big_encoder() -> Encoder:
    """Its own query cache, large enough to count what a Search encoded."""
    return Encoder(threads=1, cache_size=8192)


def _server(kb_dir, encoder, **cfg):
    config = RetrievalConfig(port=0, kb_warmup_s=0.5, **cfg)
    kb = KnowledgeBase.open(kb_dir, config, encoder=encoder)
    return build_server(config, kb=kb), kb


def _texts(tag: str, n: int, words: int = 8) -> list[str]:
    return [f"{tag} {i} " + " ".join(f"word{(i * 7 + j) % 997}" for j in range(words)) for i in range(n)]


def _encoded(encoder: Encoder, texts: list[str]) -> int:
    with encoder._lock:
        return sum(t in encoder._cache for t in texts)


# (scenario, server limits, request builder, field the message starts with, text the message must hold)
OVERSIZED = [
    ("1024 queries x k 1024 with vectors (the 38 s / 5.5 GB request)", dict(),
     lambda t: pb.SearchRequest(retriever="edr", k=1024, texts=t(1024), with_vectors=True), "k: ",
     "1024 queries x k 1024 = 1048576 results exceeds the limit of 65536"),
    ("vector queries x k over the result limit", dict(),
     lambda t: pb.SearchRequest(retriever="edr", k=100, vectors=pack_f32(np.ones((700, 384)))), "k: ",
     "700 queries x k 100 = 70000 results"),
    ("BM25 over the result limit", dict(),
     lambda t: pb.SearchRequest(retriever="sr", k=1000, texts=t(100)), "k: ", "100000 results"),
    ("reply over a 1 MiB message limit", dict(max_message_bytes=1 << 20),
     lambda t: pb.SearchRequest(retriever="edr", k=50, texts=t(100), with_vectors=True), "k: ",
     "over the 1.0 MiB message limit"),
]


@pytest.mark.parametrize("scenario,limits,build,field,says", OVERSIZED, ids=[c[0] for c in OVERSIZED])
def test_oversized_search_is_refused_before_any_work(kb_dir, big_encoder, scenario, limits, build, field, says):
    running, kb = _server(kb_dir, big_encoder, limit_batch=1024, kb_limit_k=1024, **limits)
    texts = []

    def t(n):
        texts.extend(_texts(scenario, n))
        return texts[-n:]

    try:
        with grpc.insecure_channel(running.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            t0 = time.perf_counter()
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(build(t), timeout=60)
            took = time.perf_counter() - t0
            # Not RESOURCE_EXHAUSTED "Sent message larger than max" after the work was done.
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert err.value.details().startswith(field) and says in err.value.details(), err.value.details()
            assert _encoded(big_encoder, texts) == 0  # nothing was encoded: refused before the work
            assert took < 5, took
            ok = stub.Search(pb.SearchRequest(retriever="edr", k=5, texts=["capital city of France"]), timeout=30)
            assert len(ok.results) == 1  # still serving
    finally:
        running.stop(0)


def test_a_search_within_the_limits_is_answered(kb_dir, big_encoder):
    running, kb = _server(kb_dir, big_encoder, limit_batch=1024, kb_limit_k=1024)
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            res = stub.Search(pb.SearchRequest(retriever="edr", k=1024, texts=_texts("fits", 64), with_text=True),
                              timeout=120)
        assert len(res.results) == 64 and all(len(h.documents) == len(kb.passages) for h in res.results)
    finally:
        running.stop(0)


def test_search_stops_when_the_deadline_passes(kb_dir, big_encoder):
    """1024 long queries take seconds to encode; a 0.5 s deadline stops the work within one chunk."""
    # The work bounds raised: this is about the deadline inside a batch the bounds would refuse up front.
    running, kb = _server(kb_dir, big_encoder, limit_batch=1024, kb_limit_k=10, kb_limit_search_chars=10**6,
                          kb_limit_encode_tokens=10**6)
    texts = _texts("deadline", 1024, words=60)
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.Search(pb.SearchRequest(retriever="edr", k=1, texts=texts), timeout=0.5)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            stable_since, last = time.monotonic(), -1
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and time.monotonic() - stable_since < 2.0:
                n = _encoded(big_encoder, texts)
                if n != last:
                    stable_since, last = time.monotonic(), n
                time.sleep(0.1)
            # Not all 1024: the executor stopped at the first chunk boundary after the deadline.
            assert last <= 3 * SEARCH_CHUNK, last
            ok = stub.Search(pb.SearchRequest(retriever="sr", k=3, texts=["json decoder"]), timeout=30)
            assert len(ok.results) == 1
    finally:
        running.stop(0)


@pytest.mark.skipif(not (STDLIB_DATASTORE / "datastore.json").exists(), reason="stdlib datastore not prepared")
def test_draft_stays_fast_under_kb_load(kb_dir, encoder):
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

    ds = SuffixArrayDatastore.open(STDLIB_DATASTORE)
    ds.warmup()
    config = RetrievalConfig(port=0, workers=8, kb_warmup_s=0.5)
    running = build_server(config, datastore=ds, kb=KnowledgeBase.open(kb_dir, config, encoder=encoder))
    ctx = pack_tokens(np.asarray(ds.shards[0].tokens[5000:5016]))
    request = draft_pb2.DraftRequest(context=ctx, params=draft_pb2.DraftParams(max_nodes=32))
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def searcher(i: int) -> None:  # a client searching flat out, backing off when told the KB is busy
        with grpc.insecure_channel(running.address) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            j = 0
            while not stop.is_set():
                j += 1
                try:
                    stub.Search(pb.SearchRequest(retriever="edr", k=10, texts=_texts(f"load {i} {j}", 64),
                                                 with_text=True), timeout=60)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                    time.sleep(0.05)
                with lock:
                    outcomes[code] = outcomes.get(code, 0) + 1

    def draft_ms(stub, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Draft(request, timeout=30)
            out.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.002)
        return out

    load = [threading.Thread(target=searcher, args=(i,)) for i in range(8)]
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            alone = draft_ms(stub, 200)
            for t in load:
                t.start()
            time.sleep(1.0)
            busy = draft_ms(stub, 300)
    finally:
        stop.set()
        for t in load:
            t.join(120)
        running.stop(0)
    p50_alone, p50_busy = statistics.median(alone), statistics.median(busy)
    print(f"Draft p50 alone {p50_alone:.3f} ms, under KB load {p50_busy:.3f} ms "
          f"(p90 {np.percentile(busy, 90):.2f} ms); searches {outcomes}")
    assert outcomes.get("OK", 0) >= 1 and set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    # Before: KB calls took every handler thread and both cores, Draft p50 ~300 ms. The bound is relative to the
    # same call alone on this machine (~0.5 ms on a quiet Zen 4, 2.4 ms on an AVX2-only Zen 1), with room for a
    # shared box's noise: the regression it guards against is 100x, not 3x.
    assert p50_busy < max(2.0, 3.0 * p50_alone), (p50_alone, p50_busy)
