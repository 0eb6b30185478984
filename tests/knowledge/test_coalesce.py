"""SearchCoalescer: exact Searches queued together run as one batched search, each caller getting exactly its
solo answer (batched == solo), its own errors, nothing for callers that left."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from proto import knowledge_pb2 as pb, knowledge_pb2_grpc
from ragcore.wire import pack_f32
from retrieval_service.knowledge.coalesce import SearchCall, SearchCoalescer
from retrieval_service.knowledge.kb import KBInputError, SearchStopped

from .conftest import KNOWN

TEXTS = [q for _, _, q in KNOWN]


def vectors_of(kb, texts) -> np.ndarray:
    return kb.search("edr", 1, texts=list(texts)).query_vectors


def call(k, texts=None, vectors=None, gone=lambda: False, key=("edr", "", 0)):
    return SearchCall(key, k, list(texts) if texts else None, vectors, gone)


def assert_solo(kb, c: SearchCall) -> None:
    """The call's result is what kb.search gives it alone: same ids, scores and query vectors."""
    got = c.outcome()
    want = kb.search(c.key[0], c.k, texts=c.texts, vectors=c.vectors, index=c.key[1], ef_search=c.key[2])
    assert [h.ids.tolist() for h in got.hits] == [h.ids.tolist() for h in want.hits]
    for g, w in zip(got.hits, want.hits):
        np.testing.assert_array_equal(g.scores, w.scores)
    np.testing.assert_array_equal(got.query_vectors, want.query_vectors)


# (calls as (k, queries: "t<i,j>" texts i..j-1 | "v<i,j>" their vectors), batches run, calls answered by another's)
SCENARIOS = [
    ([(4, "t0,3")], 1, 0),                                 # alone: one search
    ([(4, "t0,2"), (10, "t2,4"), (1, "t4,5")], 1, 2),       # k 4, 10, 1: one search at k 10, each cut to its own
    ([(4, "v0,2"), (7, "v2,5")], 1, 1),                    # vector queries join vector queries
    ([(4, "t0,2"), (4, "v2,4")], 2, 0),                    # Not one search: texts and vectors do not mix
]


@pytest.mark.parametrize("spec, batches, joined", SCENARIOS)
def test_queued_calls_share_one_search_and_equal_their_solo_answers(kb, spec, batches, joined):
    vecs = vectors_of(kb, TEXTS)
    calls = []
    for k, q in spec:
        lo, hi = map(int, q[1:].split(","))
        calls.append(call(k, texts=TEXTS[lo:hi]) if q[0] == "t" else call(k, vectors=vecs[lo:hi]))
    co = SearchCoalescer(kb.search, max_queries=64, max_results=65536)
    for c in calls:
        co.add(c)
    for c in calls:  # as the executor runs the queued work items, in order
        co.run(c)
    assert (co.batches, co.joined) == (batches, joined)
    for c in calls:
        assert_solo(kb, c)


def test_a_bad_call_gets_its_error_and_the_others_their_answers(kb):
    good, bad = call(4, texts=TEXTS[:2]), call(4, texts=["x" * 100_000])  # longer than kb_limit_query_chars
    co = SearchCoalescer(kb.search, max_queries=64, max_results=65536)
    co.add(good), co.add(bad)
    co.run(good)
    with pytest.raises(KBInputError):
        co.run(bad)
    assert_solo(kb, good)


def test_callers_that_left_are_not_searched(kb):
    stay, left = call(4, texts=TEXTS[:1]), call(4, texts=TEXTS[1:3], gone=lambda: True)
    co = SearchCoalescer(kb.search, max_queries=64, max_results=65536)
    co.add(stay), co.add(left)
    co.run(stay)
    assert co.joined == 0 and len(stay.outcome().hits) == 1  # Not 3 queries searched
    with pytest.raises(SearchStopped):
        co.run(left)


@pytest.mark.parametrize("max_queries, max_results, batches", [
    (3, 65536, 2),   # 2 + 2 queries do not fit 3: the third call (1 query) joins the first, the second runs alone
    (64, 15, 2),     # queries x k: 2 x 4 + 2 x 4 > 15
    (64, 65536, 1),
])
def test_batches_stay_within_the_limits(kb, max_queries, max_results, batches):
    calls = [call(4, texts=TEXTS[0:2]), call(4, texts=TEXTS[2:4]), call(4, texts=TEXTS[4:5])]
    co = SearchCoalescer(kb.search, max_queries=max_queries, max_results=max_results)
    for c in calls:
        co.add(c)
    for c in calls:
        co.run(c)
    assert co.batches == batches
    for c in calls:
        assert_solo(kb, c)


def test_concurrent_grpc_searches_share_a_scan(kb, kb_config):
    """Through the service: 4 Searches that queue behind a busy KB executor run as one search, and each reply
    equals the same Search sent alone."""
    from ragcore.grpc_shell import start_server
    from retrieval_service.knowledge.service import KnowledgeServicer

    servicer = KnowledgeServicer(kb, kb_config)
    running = start_server(servicer.add_to_server, host="127.0.0.1", port=0, workers=8, max_concurrent_rpcs=None,
                           max_message_bytes=16 << 20)
    running.set_serving(True)
    vecs = vectors_of(kb, TEXTS)
    requests = [pb.SearchRequest(retriever="edr", k=k, vectors=pack_f32(vecs[i:i + 2])) for i, k in
                enumerate([3, 5, 1, 4])]
    release = threading.Event()
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            solo = [stub.Search(r, timeout=30) for r in requests]
            servicer._executor().submit(release.wait, 30)  # the executor is busy: Searches queue behind it
            co = servicer._coalescer(kb)
            before = co.joined
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(stub.Search, r, timeout=30) for r in requests]
                deadline = time.monotonic() + 20
                while len(co._pending) < len(requests) and time.monotonic() < deadline:
                    time.sleep(0.01)
                release.set()
                replies = [f.result() for f in futures]
    finally:
        release.set()
        running.stop(0)
        servicer.close()
    assert co.joined - before == len(requests) - 1  # one search for the four; Not four
    for got, want in zip(replies, solo):
        assert [r.ids for r in got.results] == [r.ids for r in want.results]
        assert [r.scores for r in got.results] == [r.scores for r in want.results]


def test_a_search_waits_for_the_calls_the_last_one_saw_and_not_alone(kb):
    """Closed-loop clients in two halves: after a search of 2 calls the next search waits (boundedly) for its
    second call instead of running alone; a lone client never waits."""
    co = SearchCoalescer(kb.search, max_queries=64, max_results=65536, wait_share=1e5)  # waits up to 1e5 searches (~s)
    first = [call(4, texts=TEXTS[0:1]), call(4, texts=TEXTS[1:2])]
    for c in first:
        co.add(c)
    co.run(first[0]), co.run(first[1])
    assert (co.batches, co.waits) == (1, 0)  # nothing expected yet: no wait
    late, early = call(4, texts=TEXTS[2:3]), call(4, texts=TEXTS[3:4])
    co.add(early)
    runner = threading.Thread(target=co.run, args=(early,))
    runner.start()
    time.sleep(0.005)
    co.add(late)  # arrives while `early`'s search waits for a second call
    runner.join(30)
    co.run(late)
    assert (co.batches, co.joined, co.waits) == (2, 2, 1)  # Not 3 searches
    for c in first + [early, late]:
        assert_solo(kb, c)

    alone = SearchCoalescer(kb.search, max_queries=64, max_results=65536, wait_share=1e5)
    for q in range(3):
        c = call(4, texts=TEXTS[q:q + 1])
        alone.add(c)
        alone.run(c)
    assert (alone.batches, alone.waits) == (3, 0)  # Not a wait: one client's calls never overlap
