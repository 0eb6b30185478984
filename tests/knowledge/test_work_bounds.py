"""One Search's work is bounded and shared: a batch over the characters or encoder-token bound is refused before
any encoding, naming the limit; the deadline stops a batch between encoder steps of CHUNK_TOKENS; a small Search
takes the express lane and is answered while a large batch is still encoding (before: one valid Search of 1024
texts x 10,000 characters held the knowledge base ~100 s, a concurrent 1-query Search hit its deadline behind it,
and a deadline stopped the batch only at a 64-query chunk boundary). Counts and ordering, not wall-clock ratios."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from proto import knowledge_pb2, knowledge_pb2_grpc
from retrieval_service.knowledge.kb import CHUNK_TOKENS, KBInputError, SearchStopped
from retrieval_service.knowledge.service import KnowledgeServicer
from tests.knowledge.conftest import serve

WORDS = ("parse json decoder heap queue bisect calendar fraction textwrap module function value string list "
         "object return index search").split()


def texts(n: int, chars: int, seed: int) -> list[str]:
    """n distinct texts of about `chars` characters (never seen by the encoder cache before)."""
    rng = np.random.default_rng(seed)
    return [f"{seed}-{i} " + " ".join(rng.choice(WORDS, chars // 6)) for i in range(n)]


def cached(encoder, batch: list[str]) -> int:
    return sum(t in encoder._cache for t in batch)


@pytest.fixture
def bounded(kb):
    return dataclasses.replace(kb, limits=dataclasses.replace(kb.limits, max_search_chars=20_000,
                                                              max_encode_tokens=2_000))


# (scenario, texts, limit the message must name, what it must not be)
REFUSED = [
    ("characters over the bound", texts(4, 6_000, 1), "kb_limit_search_chars"),
    ("encoder tokens over the bound", texts(12, 1_200, 2), "kb_limit_encode_tokens"),
]


@pytest.mark.parametrize("scenario,batch,limit", REFUSED, ids=[r[0] for r in REFUSED])
def test_too_much_work_is_refused_before_encoding(bounded, scenario, batch, limit):
    with pytest.raises(KBInputError) as err:
        bounded.search("edr", 3, texts=batch)
    assert err.value.field == "texts" and limit in str(err.value), str(err.value)
    assert cached(bounded.encoder, batch) == 0  # Not encoded first and refused after


def test_a_batch_within_the_bounds_runs(bounded):
    batch = texts(6, 1_000, 3)
    assert int(bounded.encoder.count_tokens(batch).sum()) <= 2_000
    res = bounded.search("edr", 3, texts=batch)
    assert len(res.hits) == 6 and cached(bounded.encoder, batch) == 6


def test_the_deadline_stops_a_batch_between_encoder_steps(kb):
    batch = texts(12, 2_000, 4)  # ~12 x 256 tokens: one SEARCH_CHUNK, six encoder steps
    per_step = CHUNK_TOKENS // int(kb.encoder.count_tokens(batch[:1])[0])
    asked = []

    def should_stop() -> bool:  # the caller leaves once the first step is encoded
        asked.append(cached(kb.encoder, batch))
        return len(asked) > 1

    with pytest.raises(SearchStopped):
        kb.search("edr", 3, texts=batch, should_stop=should_stop)
    assert cached(kb.encoder, batch) == per_step  # Not all 12 (the chunk boundary was the only stop before)


def test_a_small_search_is_answered_while_a_large_batch_encodes(kb, kb_config):
    servicer = KnowledgeServicer(kb, kb_config)
    servicer.warmup()  # loads the express lane's encoder
    running, channel = serve(servicer)
    stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
    big = texts(14, 2_000, 5)
    done: list[int] = []
    try:
        worker = threading.Thread(target=lambda: done.append(len(stub.Search(
            knowledge_pb2.SearchRequest(retriever="edr", k=3, texts=big), timeout=600).results)))
        worker.start()
        deadline = time.monotonic() + 300
        while cached(kb.encoder, big) == 0 and time.monotonic() < deadline:  # the batch is encoding
            time.sleep(0.005)
        small = stub.Search(knowledge_pb2.SearchRequest(retriever="edr", k=3, texts=["capital city of France"]),
                            timeout=600)
        encoded_when_answered = cached(kb.encoder, big)
        worker.join(600)
        assert len(small.results) == 1 and done == [14]
        assert encoded_when_answered < len(big), encoded_when_answered  # Not after the whole batch
    finally:
        channel.close()
        running.stop(0)
        servicer.close()
