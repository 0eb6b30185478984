"""The KB slow or down during speculation: the request completes with RaLMSeq's output through sequential
retrieval, or fails with KBUnavailable (UNAVAILABLE over gRPC) -- it never emits a token written with an
unverified passage."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import pytest

from generation_service.augment.kb_client import KBClient, KBUnavailable
from generation_service.ralm.loop import RagParams
from tests.ralm.conftest import run_rag, start_kb_server
from tools.launcher import free_port

pytestmark = pytest.mark.model
STRIDE = 2


@pytest.mark.parametrize("async_verify", [False, True])
def test_slow_kb_during_speculation_falls_back_to_sequential(tm, kb_client, prompts, reference, async_verify):
    want = reference("edr", 0, STRIDE)
    # Speculative calls (ScoreCandidates, verification) get 0.1 ms: every one of them misses its deadline.
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, async_verify=async_verify, adaptive=False)
    got, st = run_rag(tm, kb_client, prompts[0], rag, spec_timeout_s=1e-4, spec_slack=0.0)
    assert got == want  # Not a shorter output or one written with the unverified guess
    assert st.fallback and "DEADLINE_EXCEEDED" in st.fallback_reason
    assert st.speculative_steps == 0  # nothing speculative was committed


class SlowVerifications:
    """The real retriever, whose verifications (non-sequential searches) get a 0.1 ms deadline, whatever the KB's
    measured latency: each one misses it on the real KB server, while the cache lookups of the speculative steps
    keep their own."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def search(self, queries, k, *, sequential):
        if sequential:
            return self.inner.search(queries, k, sequential=True)
        kept = self.inner.spec_timeout_s, self.inner.spec_slack
        self.inner.spec_timeout_s, self.inner.spec_slack = 1e-4, 0.0
        try:
            return self.inner.search(queries, k, sequential=False)
        finally:
            self.inner.spec_timeout_s, self.inner.spec_slack = kept


def test_a_worker_learns_from_a_verification_that_missed_its_deadline(tm, kb_client, prompts, reference):
    """Verifications that outrun the speculative deadline: the first request pays one failed round and falls back;
    the worker's pooled costs then keep the next request on RaLMSeq's steps. Not: every request paying it."""
    from generation_service.augment.round_gate import SharedRoundCosts

    want = reference("edr", 0, STRIDE)
    shared = SharedRoundCosts()
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, async_verify=False, min_search_share=0.0)
    runs = [run_rag(tm, kb_client, prompts[0], rag, wrap=SlowVerifications, round_costs=shared) for _ in range(2)]
    (first, st1), (second, st2) = runs
    assert first == second == want
    assert st1.fallback and "DEADLINE_EXCEEDED" in st1.fallback_reason
    assert not st2.fallback and st2.speculative_steps == 0  # sequential steps only: no round to fail


class StopsKB:
    """The real retriever; after `after` sequential searches the KB server is stopped for real."""

    def __init__(self, inner, server, after: int):
        self.inner, self.server, self.after, self.searches = inner, server, after, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def search(self, queries, k, *, sequential):
        hits = self.inner.search(queries, k, sequential=sequential)
        self.searches += 1
        if self.searches == self.after:
            self.server.stop(0)
        return hits


@pytest.mark.parametrize("async_verify", [False, True])
def test_kb_down_during_speculation_fails_unavailable_never_wrong(tm, rag_kb, prompts, reference, async_verify):
    want = reference("edr", 0, STRIDE)
    server = start_kb_server(rag_kb, port=free_port())
    kb = KBClient(server.address, timeout_ms=3000)
    emitted: list[int] = []
    try:
        from generation_service.engine.passage_rows import passage_budget
        from generation_service.model.sampling import SamplingParams
        from generation_service.ralm.loop import RagStats, ralm_decode
        from generation_service.ralm.retrieval import KBRetriever

        rag = RagParams(retriever="edr", stride=STRIDE, async_verify=async_verify, min_search_share=0.0)  # speculate
        retr = StopsKB(KBRetriever(kb, "edr", tm.tokenizer, passage_budget(len(prompts[0]), rag)), server, after=1)
        stats = RagStats()
        with pytest.raises(KBUnavailable):
            for tokens, _ in ralm_decode(tm, prompts[0], SamplingParams(max_new_tokens=len(want), ignore_eos=True),
                                         rag, retr, stats=stats):
                emitted += tokens
        assert emitted == want[:len(emitted)]  # what came out before the failure is RaLMSeq's prefix
        assert len(emitted) < len(want)
        assert stats.fallback  # speculation failed first, then sequential retrieval failed too
    finally:
        kb.close()
        server.stop(0)


@pytest.mark.parametrize("n, per_query_s, want, not_want", [
    (3, 0.0, 2.0, None),  # nothing measured yet: the configured deadline
    (3, 0.05, 2.0, 0.3),  # a fast KB: the configured deadline, Not 2 x 3 x 50 ms
    (3, 0.7, 4.2, 2.0),  # full-text ranking at 0.7 s a query: room for three, Not a certain miss at 2 s
    (16, 0.7, 10.0, 22.4),  # never past the sequential calls' own deadline
])
def test_speculative_timeout_scales_with_the_measured_latency(n, per_query_s, want, not_want):
    from generation_service.ralm.retrieval import speculative_timeout

    got = speculative_timeout(n, per_query_s, configured_s=2.0, ceiling_s=10.0, slack=2.0)
    assert got == pytest.approx(want)
    assert not_want is None or got != pytest.approx(not_want)


class NoBatching:
    """The real retriever, slowed as a KB whose search does not batch (full-text ranking in a database): every
    search waits PER_QUERY_S per query it carries, on top of the real search; a search in flight answers that
    much later (and says so in its rpc_s), while the caller goes on."""

    PER_QUERY_S = 0.08

    def __init__(self, inner):
        self.inner = inner
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="slow-kb")

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _slow(self, queries) -> None:
        time.sleep(self.PER_QUERY_S * len(queries))

    def search(self, queries, k, *, sequential):
        self._slow(queries)
        return self.inner.search(queries, k, sequential=sequential)

    def search_async(self, queries, k):
        def late():
            self._slow(queries)
            reply = self.inner.search_async(queries, k).result()
            return dataclasses.replace(reply, rpc_s=reply.rpc_s + self.PER_QUERY_S * len(queries))

        return self._pool.submit(late)


def test_os3_keeps_the_stride_short_where_verifications_do_not_batch(tm, kb_client, prompts, reference):
    """Every round speculative (no gate), OS³ on, a KB whose verification of s queries costs s searches: the strides
    stay short and the output is RaLMSeq's. Not the paper's constant verification cost, which measured at s = 1
    would run strides of 6 or more (each verification ~0.5 s of 80 ms queries)."""
    from generation_service.augment.os3 import best_stride
    from generation_service.augment.round_gate import SharedRoundCosts

    want = reference("edr", 0, STRIDE)
    shared = SharedRoundCosts()
    rag = RagParams(retriever="edr", stride=STRIDE, os3=True, async_verify=False, adaptive=False)
    got, st = run_rag(tm, kb_client, prompts[0], rag, wrap=NoBatching, round_costs=shared)
    assert got == want
    spec = [s for s in st.strides if s > 0]
    assert len(spec) >= 3 and max(spec) <= 3, st.strides
    assert best_stride(0.9, 0.02, NoBatching.PER_QUERY_S, 16) >= 6  # what the constant model would have run


class CountingQueries(NoBatching):
    """NoBatching that also counts the queries the KB was asked, and whose cache guesses the first of every three
    steps wrong (another passage than its top-1)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.asked = 0
        self.guesses = 0

    def _slow(self, queries) -> None:
        self.asked += len(queries)
        super()._slow(queries)

    def speculate(self, query, cache):
        d = self.inner.speculate(query, cache)
        self.guesses += 1
        if d is None or self.guesses % 3 != 1:
            return d
        return d - 1 if d > 0 else d + 1


@pytest.mark.parametrize("async_verify", [False, True])
def test_where_the_kb_does_not_batch_verifications_stop_at_the_first_wrong_guess(tm, kb_client, prompts,
                                                                                  async_verify):
    """Every round speculative at stride 3 over a KB whose batch of s queries costs s searches, a wrong guess in
    every third step: once a batched verification has shown that, the rounds are verified a query at a time up to
    the first wrong guess, so no search is thrown away; the output is RaLMSeq's. Not the batched verification's
    waste: the searches of the steps after a wrong guess, asked again for the steps that replace them."""
    from generation_service.augment.round_gate import SharedRoundCosts

    n = 12  # 6 steps: one sequential, a batched round, then in-order ones (each commits one step)
    want, _ = run_rag(tm, kb_client, prompts[0], RagParams(retriever="edr", stride=STRIDE, speculate=False),
                      n_tokens=n)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, spec_stride=3, async_verify=async_verify,
                    adaptive=False)
    wrapped: list[CountingQueries] = []
    got, st = run_rag(tm, kb_client, prompts[0], rag, round_costs=SharedRoundCosts(), n_tokens=n,
                      wrap=lambda r: wrapped.append(CountingQueries(r)) or wrapped[-1])
    assert got == want
    assert st.in_order_verifications >= 2 and st.rollbacks >= 1, (st.strides, st.rollbacks, st.in_order_verifications)
    # Every search is some committed step's, but for the first, batched verification (at most 3 queries).
    assert wrapped[0].asked <= st.retrievals + 3, (wrapped[0].asked, st.retrievals)
