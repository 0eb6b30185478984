"""RAG requests in the continuous-batching engine: their rows share the passes of everything else running, a request
waiting on the knowledge base holds nobody up, and each output equals the same request run alone (fp32: the fused
pass computes every row as it would alone)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from generation_service.engine.model_thread import ModelThread
from generation_service.engine.passage_rows import passage_budget
from generation_service.engine.scheduler import Engine
from generation_service.engine.speculative import decode
from generation_service.model.sampling import SamplingParams
from generation_service.ralm.loop import RagParams, RagRequest
from generation_service.ralm.retrieval import KBRetriever
from generation_service.server import Job
from tests.ralm.conftest import run_rag

pytestmark = pytest.mark.model
N = 12


@pytest.fixture(scope="module")
def tm32():
    from tests.conftest import real_model

    return real_model("fp32")


class SlowSearch:
    """A retriever whose searches take `delay_s` longer (a slow or loaded KB)."""

    def __init__(self, inner: KBRetriever, delay_s: float):
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def search(self, *args, **kwargs):
        time.sleep(self.delay_s)
        return self.inner.search(*args, **kwargs)


def _engine(tm, kb_client, wrap=None) -> Engine:
    def loop(job: Job) -> RagRequest:
        retr = KBRetriever(kb_client, job.rag.retriever, tm.tokenizer, passage_budget(len(job.prompt_ids), job.rag))
        return RagRequest(tm, job.prompt_ids, job.params, job.rag, wrap(retr) if wrap else retr,
                          is_cancelled=job.is_cancelled)

    return Engine(tm, max_batch=8, prefill_chunk=256, kv_cache_mb=512, queue_size=16, drafter=lambda job: None,
                  loop=loop, model_thread=ModelThread("test-rag-engine"))


def _job(prompt, rag: RagParams | None = None) -> Job:
    return Job(np.asarray(prompt, np.int64), SamplingParams(max_new_tokens=N, ignore_eos=True),
               rag.mode if rag else "ar", 0, None, rag=rag)


def _collect(job: Job, timeout_s: float = 300):
    """-> (tokens, finish reason, final chunk, monotonic time of the first token, of the end)."""
    tokens, first, last, t_end = [], None, None, time.monotonic() + timeout_s
    while True:
        item = job.chunks.get(timeout=max(1.0, t_end - time.monotonic()))
        if item is None:
            return tokens, last.finish_reason, last, first, time.monotonic()
        if isinstance(item, BaseException):
            raise item
        if item.token_ids and first is None:
            first = time.monotonic()
        tokens += item.token_ids
        last = item


def test_rag_requests_share_passes_and_equal_their_solo_runs(tm32, kb_client, prompts):
    rags = [RagParams(retriever="edr", stride=2), RagParams(retriever="edr", stride=2, speculate=False),
            RagParams(retriever="sr", stride=3)]
    solo = [run_rag(tm32, kb_client, prompts[i], rag, n_tokens=N) for i, rag in enumerate(rags)]
    solo_ar = [t for out, _ in decode(tm32, prompts[0], SamplingParams(max_new_tokens=N, ignore_eos=True))
               for t in out]
    engine = _engine(tm32, kb_client)
    try:
        jobs = [_job(prompts[i], rag) for i, rag in enumerate(rags)] + [_job(prompts[0]), _job(prompts[1])]
        for job in jobs:
            engine.submit(job)
        got = [_collect(j) for j in jobs]
    finally:
        engine.stop()
    for (want, _), (tokens, finish, *_), rag in zip(solo, got, rags):
        assert finish == "length" and tokens == want, rag  # Not a different passage or another request's rows
    assert got[3][0] == solo_ar
    assert engine.peak_batch >= 3  # RAG rows in the same passes as the others, Not one request at a time
    solo_passes = sum(st.prefills + st.decode_tokens for _, st in solo) + 2 * N
    assert engine.passes < solo_passes
    seq_solo, seq_batched = solo[1][1], got[1][2].rag_stats
    assert seq_batched.kb_calls == seq_solo.kb_calls  # its own round trips, Not the other requests' as well


def test_a_request_waiting_on_the_kb_holds_nobody_up(tm32, kb_client, prompts):
    rag = RagParams(retriever="edr", stride=4, speculate=False)
    want, _ = run_rag(tm32, kb_client, prompts[2], rag, n_tokens=N)
    engine = _engine(tm32, kb_client, wrap=lambda r: SlowSearch(r, 1.5))
    try:
        slow, ar = _job(prompts[2], rag), _job(prompts[0])
        engine.submit(slow)
        engine.submit(ar)
        ar_tokens, _, _, _, ar_end = _collect(ar)
        tokens, finish, _, slow_first, _ = _collect(slow)
    finally:
        engine.stop()
    assert len(ar_tokens) == N
    assert ar_end < slow_first  # the AR request finished while the RAG one waited for its first search
    assert tokens == want and finish == "length"


def test_cancelling_a_request_waiting_on_the_kb_frees_its_slot(tm32, kb_client, prompts):
    rag = RagParams(retriever="edr", stride=4, speculate=False)
    engine = _engine(tm32, kb_client, wrap=lambda r: SlowSearch(r, 5.0))
    try:
        job = _job(prompts[1], rag)
        engine.submit(job)
        time.sleep(0.5)  # admitted, its first search under way
        t0 = time.monotonic()
        job.cancelled.set()
        tokens, finish, *_ = _collect(job)
        assert finish == "cancelled" and tokens == []  # nothing unverified, Not the search's late answer
        assert time.monotonic() - t0 < 2.0  # Not after the 5 s search
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.running  # the slot is free
    finally:
        engine.stop()
