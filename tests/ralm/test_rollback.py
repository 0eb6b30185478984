"""Rollback: scenario tables for finding the first wrong step, checkpoint/restore of the real model state, and
whole requests in which constructed speculation mistakes (a retriever that guesses a wrong passage at chosen
steps) must be caught by verification and rolled back, leaving RaLMSeq's output."""

from __future__ import annotations

import numpy as np
import pytest

from generation_service.augment.kb_client import Hits
from generation_service.augment.round import first_mismatch
from generation_service.engine.passage_rows import passage_budget
from generation_service.model.sampling import SamplingParams
from generation_service.ralm.loop import RagParams, RagStats, StepRunner
from generation_service.ralm.retrieval import KBRetriever, Query
from generation_service.ralm.rounds import resolve_true
from tests.ralm.conftest import N_TOKENS, run_rag

STRIDE = 2


@pytest.mark.parametrize("spec,true,want", [
    ([3, 3, 5], [3, 3, 4], 2),         # Not None: the last step had the wrong passage
    ([3, 3, 5], [3, 3, 5], None),      # all right: nothing to roll back
    ([1, 3, 3], [3, 3, 3], 0),         # Not 1 or 2: later steps built on the wrong first one
    ([None, 2], [None, 2], None),      # blank query, no passage either way
    ([], [], None),
])
def test_first_mismatch(spec, true, want):
    assert first_mismatch(spec, true) == want


def _hits(doc: int) -> Hits:
    return Hits(np.array([doc], np.int64), np.array([1.0], np.float32))


def test_resolve_true_keeps_the_previous_passage_for_blank_queries():
    q = Query("x")
    assert resolve_true([q, None, q, None], [_hits(4), _hits(9)], prev=7) == [4, 4, 9, 9]  # Not [4, 7, 9, 7]
    assert resolve_true([None, q], [_hits(2)], prev=7) == [7, 2]


class Saboteur:
    """The real KBRetriever, except that speculation calls listed in `wrong` (0-based, in call order) return a
    passage that is not the KB's top-1 for the query (a constructed mismatch verification must catch)."""

    def __init__(self, inner: KBRetriever, wrong: set[int]):
        self.inner, self.wrong, self.n = inner, wrong, 0
        self.sabotaged = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def speculate(self, query: Query, cache) -> int | None:
        i, self.n = self.n, self.n + 1
        doc = self.inner.speculate(query, cache)
        if i not in self.wrong:
            return doc
        true = self.inner.kb.search(self.inner.retriever, 1, texts=[query.text]).hits[0].top1
        self.sabotaged += 1
        return 0 if true != 0 else 1  # a real passage, just not the right one


def expected_rollbacks(wrong: set[int], steps: int, s: int) -> int:
    """Sync rounds of fixed stride s after the first (sequential) step: a round speculates min(s, left) steps,
    commits up to and including its first wrong one (corrected) and rolls back once if there is one."""
    left, call, rollbacks = steps - 1, 0, 0
    while left > 0:
        n = min(s, left)
        bad = [j for j in range(n) if call + j in wrong]
        rollbacks += bool(bad)
        left -= bad[0] + 1 if bad else n
        call += n
    return rollbacks


@pytest.mark.parametrize("wrong", [{0}, {2}, {1, 3}, {0, 1, 2, 3, 4, 5, 6, 7}])
def test_constructed_mismatches_roll_back_sync(tm, kb_client, prompts, reference, wrong):
    want = reference("edr", 0, STRIDE)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, spec_stride=3, async_verify=False, prefetch=20,
                    adaptive=False)
    box = {}
    got, st = run_rag(tm, kb_client, prompts[0], rag, wrap=lambda r: box.setdefault("s", Saboteur(r, wrong)))
    assert got == want  # Not the continuation of a wrong passage
    assert st.rollbacks == expected_rollbacks(wrong, N_TOKENS // STRIDE, 3) and st.rollbacks > 0
    assert st.speculation_hits < st.speculative_steps
    assert st.wasted_generation_ms > 0


@pytest.mark.parametrize("wrong", [{0}, {1, 2}])
def test_constructed_mismatches_roll_back_async(tm, kb_client, prompts, reference, wrong):
    want = reference("edr", 0, STRIDE)
    rag = RagParams(retriever="edr", stride=STRIDE, os3=False, spec_stride=2, async_verify=True, prefetch=20,
                    adaptive=False)
    got, st = run_rag(tm, kb_client, prompts[0], rag, wrap=lambda r: Saboteur(r, wrong))
    assert got == want
    assert st.rollbacks >= 1


def test_restore_gives_back_the_exact_model_state(tm, kb_client, prompts):
    """Step with passage A, checkpoint, step with passage B, restore, step with A == two steps with A."""
    prompt = prompts[1]
    rag = RagParams(retriever="edr", stride=3, speculate=False)
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    retr = KBRetriever(kb_client, "edr", tm.tokenizer, passage_budget(len(prompt), rag))
    a, b = retr.passage(0), retr.passage(1)

    direct = StepRunner(tm, prompt, params, rag, RagStats())
    direct.step(0, a)
    direct.step(0, a)

    r = StepRunner(tm, prompt, params, rag, RagStats())
    r.step(0, a)
    ck = r.checkpoint()
    r.step(1, b)  # a new passage: re-prefill into a new cache object
    r.step(1, b)
    r.restore(ck)
    assert r.out == direct.out[:3] and r.cache_doc == 0
    r.step(0, a)  # the kept KV rows of A, decoding on
    assert r.out == direct.out  # Not the tokens written with passage B
    assert r.stats.prefills == 2 and direct.stats.prefills == 1
