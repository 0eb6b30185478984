"""Sequential steps inside RaLMSpec (the first step, and every round the RoundGate runs as s = 0) put RaLMSeq's
retrieval on the critical path -- one Search, the same query, the same top-1 -- and, when speculation may read the
cache soon, that same Search fetches the top-`prefetch` for the cache (no second Search running beside the step's
forward passes). Output stays RaLMSeq's; the fetched hits reach the cache."""

from __future__ import annotations

import time

import pytest

from generation_service.ralm.loop import RagParams
from generation_service.ralm.retrieval import KBRetriever, Query
from tests.ralm.conftest import run_rag

pytestmark = pytest.mark.model
STRIDE = 2


class Recorder:
    """The real KBRetriever, recording every Search (k, blocking or future, queries) and optionally slowing each
    speculative cache ranking down by `spec_delay_s` (a slow ScoreCandidates: the gate must then stop
    speculating and run sequential steps)."""

    def __init__(self, inner: KBRetriever, spec_delay_s: float = 0.0):
        self.inner, self.spec_delay_s = inner, spec_delay_s
        self.blocking: list[tuple[int, bool, int]] = []  # (k, sequential, queries)
        self.futures: list[tuple[int, int]] = []  # (k, queries)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def search(self, queries: list[Query], k: int, *, sequential: bool):
        self.blocking.append((k, sequential, len(queries)))
        return self.inner.search(queries, k, sequential=sequential)

    def search_async(self, queries: list[Query], k: int):
        self.futures.append((k, len(queries)))
        return self.inner.search_async(queries, k)

    def speculate(self, query: Query, cache) -> int | None:
        if self.spec_delay_s:
            time.sleep(self.spec_delay_s)
        return self.inner.speculate(query, cache)


@pytest.mark.parametrize("prefetch,spec_delay_s,min_sequential", [
    (20, 0.3, 3),  # slow speculation: the gate runs most steps sequentially; each must cost what B's costs
    (20, 0.0, 1),  # only the first step (empty cache) is sequential
    (0, 0.3, 3),   # no prefetch: the top-1 alone
])
def test_sequential_steps_search_once_and_fill_the_cache_only_when_wanted(tm, kb_client, prompts, reference,
                                                                         prefetch, spec_delay_s, min_sequential):
    want = reference("edr", 0, STRIDE)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=True, async_verify=False, prefetch=prefetch,
                    min_search_share=0.0)  # the test KB's searches are cheap: let the measured costs decide
    box: dict = {}
    got, st = run_rag(tm, kb_client, prompts[0], rag,
                      wrap=lambda r: box.setdefault("r", Recorder(r, spec_delay_s)))
    rec: Recorder = box["r"]
    assert got == want  # Not an output changed by when the cache filled
    n_seq = st.strides.count(0)
    assert n_seq >= min_sequential
    seq_searches = [(k, n) for k, sequential, n in rec.blocking if sequential]
    assert len(seq_searches) == n_seq  # one Search per sequential step (no blank queries in this prompt)
    assert rec.futures == []  # Not a second Search beside the step (sync verification: no future at all)
    split = st.sequential_retrieval_ms + st.speculation_retrieval_ms + st.verification_wait_ms
    assert split == pytest.approx(st.retrieval_ms, rel=1e-9)  # the R split accounts for all of R
    if spec_delay_s:
        assert st.speculation_retrieval_ms >= spec_delay_s * 1e3  # the slowed ranking is speculative R, Not sequential R
    fills = [k for k, n in seq_searches if k > 1]
    if prefetch > 1:
        # the top-k only while the cache may be read soon (the first step; before a probe once the gate runs
        # sequential steps), the top-1 otherwise
        assert set(k for k, _ in seq_searches) <= {1, prefetch} and 1 <= len(fills) == st.prefetches
        if spec_delay_s:
            assert len(fills) < n_seq  # Not the top-k for every step the gate ran sequentially
        assert st.cache_size > st.retrievals  # Not only the top-1s: the fetched hits landed in the cache
    else:
        assert fills == [] and st.prefetches == 0  # Not a top-k nobody asked for


def test_psa_with_prefetch_equals_ralmseq_when_the_gate_goes_sequential(tm, kb_client, prompts, reference):
    # Async verification and background prefetches in flight together, speculation slowed so the gate mixes
    # sequential steps and speculative rounds.
    want = reference("edr", 1, STRIDE)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=True, async_verify=True, prefetch=20, min_search_share=0.0)
    got, st = run_rag(tm, kb_client, prompts[1], rag, wrap=lambda r: Recorder(r, 0.15))
    assert got == want
    assert 0 in st.strides and any(s > 0 for s in st.strides)  # both kinds of step ran
    assert not st.fallback


def test_reply_texts_are_tokenized_only_when_prepended(tm, kb_client, prompts):
    from generation_service.engine.passage_rows import passage_budget

    rag = RagParams(retriever="edr")
    retr = KBRetriever(kb_client, "edr", tm.tokenizer, passage_budget(len(prompts[0]), rag))
    reply = kb_client.search("edr", 20, texts=["push an item onto a heap"], with_text=True)
    retr.remember(reply)
    assert retr._tokens == {}  # Not 20 passages tokenized on the critical path when the reply arrived
    calls = retr.calls
    doc = reply.hits[0].top1
    want = retr._tokenize(reply.hits[0].documents[0].title, reply.hits[0].documents[0].text)
    assert retr.passage(doc) == want and retr.calls == calls  # the stored text, Not a GetDocuments round trip
    assert list(retr._tokens) == [doc]


def test_fixed_stride_rounds_run_at_the_configured_stride_probes_included(tm, kb_client, prompts, reference):
    # A probe of one step costs a step plus a whole search, never less than a sequential step: where search is
    # slow, speculation measured that way never won. Every speculative round must be the arm as configured.
    want = reference("edr", 0, STRIDE)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, spec_stride=3, async_verify=False, prefetch=20,
                    min_search_share=0.0)
    got, st = run_rag(tm, kb_client, prompts[0], rag)
    assert got == want
    spec = [s for s in st.strides if s > 0]
    assert spec and set(spec) == {3}  # Not a one-step probe
