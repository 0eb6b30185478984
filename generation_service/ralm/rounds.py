"""RaLMSpec as a policy of the shared speculation round (augment/round.py): a guess is a step generated with the
passage the cache ranks first for its query, checked against the KB's top-1 for the same query; a rollback
restores the checkpoint taken before the first wrong step, which then runs again with the true passage.

Beyond the round's skeleton: a guessed passage *change* may be held (its query joins the round's verification and
the step runs with the KB's passage: round_gate.hold_change); an async round's verification is in flight while
the round's own last step runs, which stops as soon as the answer says it is wrong; a KB failure drops the
unverified round and the request goes on with sequential retrieval (`fallback`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from generation_service.augment.kb_client import Hits, KBUnavailable, SearchReply
from generation_service.augment.os3 import OS3Config, StrideScheduler
from generation_service.augment.round import Round, Settled, first_mismatch
from generation_service.augment.round_gate import (
    ASYNC,
    SEQUENTIAL,
    SYNC,
    RoundGate,
    SharedRoundCosts,
    prefill_slowdown,
    round_cost,
)
from generation_service.engine.effects import Effects, Emit, Wait, call
from generation_service.ralm.cache import PassageCache
from generation_service.ralm.retrieval import Query, Retriever


def passage_effects(retr: Retriever, doc: int | None, *, sequential: bool = True) -> Effects:
    """retr.passage(doc): here when the retriever has its text already, else a Call (a GetDocuments round trip)."""
    if doc is None or retr.has_passage(doc):
        return retr.passage(doc, sequential=sequential)
    return (yield call(retr.passage, doc, sequential=sequential))




def resolve_true(queries: list[Query | None], hits: list[Hits], prev: int | None) -> list[int | None]:
    """The KB's passage for every step of a round: hits are for the non-blank queries in order; a blank query
    keeps the previous step's passage (prev = the last committed step's)."""
    out: list[int | None] = []
    it = iter(hits)
    cur = prev
    for q in queries:
        if q is not None:
            cur = next(it).top1
        out.append(cur)
    return out


class _Verification:
    """One round's verification, in flight (start) or run as a Call (run), parsed once.

    In order (specs given) it asks one query at a time, each sent once the one before has answered and confirmed
    its step's guess (specs[i]), and stops at the first step the KB contradicts: the steps after it are never
    committed, so where the KB does not batch their searches would be thrown away (round_gate.in_order_pays).
    Its chain advances whenever done() is asked: between the passes of an async round's last step, and while
    verify waits."""

    def __init__(self, retr: Retriever, queries: list[Query | None], k: int, prev: int | None,
                 specs: list[int | None] | None = None):
        self.queries, self.prev, self.k, self.specs = queries, prev, k, specs
        self.asked = [q for q in queries if q is not None]
        self.batched = specs is None
        self.future = None
        self.reply_hits: list[Hits] | None = None
        self.error = ""
        self.latency_s: float | None = None
        self._true: list[int | None] | None = None
        self._retr = retr
        self._hits: list[Hits] = []  # in order: the answers so far
        self._step = 0  # in order: the step judged next (its query is the one in flight)
        if not self.asked:
            self.reply_hits = []
            self.latency_s = 0.0

    def start(self) -> "_Verification":
        """Send it (async verification: the round's last step runs while it is in flight)."""
        if self.reply_hits is None:
            if self.batched:
                self.future = self._retr.search_async(self.asked, self.k)
            else:
                self.latency_s = 0.0
                self._send_next(self.prev)
        return self

    def run(self) -> Effects:
        """Sync verification: one blocking batched search (a Call), or in order one search after another."""
        if self.reply_hits is not None:
            return
        if not self.batched:
            self.start()
            while not self.done():
                yield Wait(self.future)
            return
        t0 = time.perf_counter()
        try:
            self.reply_hits = yield call(self._retr.search, self.asked, self.k, sequential=False)
        except KBUnavailable as e:
            self.error = str(e) or "verification failed"
        self.latency_s = time.perf_counter() - t0

    def _send_next(self, cur: int | None) -> None:
        """In order: send the next step's query; a blank one keeps the passage (cur), judged without a search."""
        while self._step < len(self.queries):
            q = self.queries[self._step]
            if q is not None:
                self.future = self._retr.search_async([q], self.k)
                return
            if self._judge(cur):
                return

    def _judge(self, cur: int | None) -> bool:
        """In order: the KB's passage for step self._step is cur. True once the verification is finished."""
        i = self._step
        self._step += 1
        if (i < len(self.specs) and self.specs[i] != cur) or self._step == len(self.queries):
            self.queries = self.queries[:i + 1]  # the true passages up to the wrong step: all that is used
            self.asked = [q for q in self.queries if q is not None]
            self.reply_hits, self.future = self._hits, None
            return True
        return False

    def done(self) -> bool:
        if self.batched or self.future is None:
            return self.future is None or self.future.done()
        if not self.future.done():
            return False
        try:
            reply: SearchReply = self.future.result()
        except KBUnavailable as e:
            self.error, self.future = str(e) or "verification failed", None
            return True
        self._retr.remember(reply)
        self._hits.append(reply.hits[0])
        self.latency_s += reply.rpc_s
        if not self._judge(reply.hits[0].top1):
            self._send_next(reply.hits[0].top1)
        return self.future is None

    def settle(self) -> list[int | None] | None:
        """Once done() -> the true passage per step (None on failure, see .error); in order, up to the wrong step."""
        if self._true is not None or self.error:
            return self._true
        if self.reply_hits is None:
            try:
                reply: SearchReply = self.future.result()
            except KBUnavailable as e:
                self.error = str(e) or "verification failed"
                return None
            self._retr.remember(reply)
            self.reply_hits = reply.hits
            self.latency_s = reply.rpc_s
        self._true = resolve_true(self.queries, self.reply_hits, self.prev)
        return self._true


@dataclass
class _Guess:
    doc: int | None  # the passage the step ran with (None: no passage yet, a blank query kept it)


@dataclass
class _RoundState:
    """One speculative round being built and settled."""

    s: int  # its stride
    prev_spec: int | None  # the passage of the step before the next one (speculated or committed)
    ckpts: list = field(default_factory=list)  # per step: the runner's checkpoint before it
    queries: list[Query | None] = field(default_factory=list)  # per step (+ a held one)
    specs: list[int | None] = field(default_factory=list)  # per step: its speculated passage
    step_s: list[float] = field(default_factory=list)  # per step run to its end: its time
    guess_waste: list[float] = field(default_factory=list)  # per step: its change guess's prefill x the chance it
    #                                                         is wrong (s)
    held: list[int | None] = field(default_factory=list)  # a guessed passage change not acted on
    ver: _Verification | None = None
    r_round: float = 0.0  # retrieval time on the critical path (s)
    failure: str = ""
    stop: bool = False  # no further step in this round
    true: list[int | None] | None = None
    waste_s: float = 0.0  # generation a rollback threw away
    wasted_prefill_ms: float = 0.0  # prefills from the wrong step on
    after_miss_prefill_ms: float = 0.0  # prefills of the steps after the wrong one


class RagRounds:
    """RaLMSpec's side of the round, over a StepRunner (ralm/loop.py) that holds the output and the model state."""

    pipelines = False  # an async round's verification overlaps its own last step, not the next round

    def __init__(self, runner, retr: Retriever, rag, stats, cancelled: Callable[[], bool],
                 round_costs: SharedRoundCosts | None = None):
        self.runner, self.retr, self.rag, self.stats, self.cancelled = runner, retr, rag, stats, cancelled
        self.cache = PassageCache(rag.cache_capacity, retr.dim)
        os3 = OS3Config(window=rag.os3_window, gamma_max=rag.gamma_max, s_init=1, s_max=rag.s_max,
                        async_verify=rag.async_verify)
        self.sched = (None if not rag.os3 else StrideScheduler(os3) if round_costs is None
                      else round_costs.scheduler(rag.round_key, os3))
        # Every speculative config, with or without OS³, measures its kinds of round and runs the cheapest
        # (augment/round_gate.py): sequential steps where retrieval is too cheap to hide, sync verification where a
        # search beside the step slows it more than the overlap saves.
        configured = ASYNC if rag.async_verify else SYNC
        self.gate = RoundGate(([ASYNC] if rag.async_verify else []) + [SYNC, SEQUENTIAL] if rag.adaptive
                              else [configured], window=rag.os3_window, shared=round_costs, key=rag.round_key,
                              min_search_share=rag.min_search_share)
        self.k_fetch = max(1, rag.prefetch)
        self.prev: int | None = None  # true passage of the last committed step
        self.committed = 0
        self.fallback = ""
        self.search_s = 0.0  # the last KB search's latency (a sequential step's or a verification's): what
        #                      holding costs
        self.base_prefill = [0.0, 0]  # ms and tokens of the sequential steps' prefills: the uncontended rate
        self.arm = SEQUENTIAL
        self.t_round, self.prefill_before, self.tokens_before = 0.0, 0.0, 0
        self.round = _RoundState(0, None)

    def _cache_hits(self, hits: list[Hits]) -> None:
        for h in hits:
            if len(h.ids):
                self.cache.add(h.ids[:self.k_fetch], h.vectors[:self.k_fetch] if self.retr.dim else None)
        self.stats.cache_size = len(self.cache)

    def _take_output(self) -> list[int]:
        toks = self.runner.out[self.committed:]
        self.committed = len(self.runner.out)
        return toks

    def cancel(self, rnd: Round) -> None:
        ver = rnd.pending.ver
        if ver is not None and ver.future is not None:
            ver.future.cancel()

    def begin(self, arm: str | None) -> tuple[int, str]:
        stats = self.stats
        self.arm = SEQUENTIAL if self.fallback or len(self.cache) == 0 else self.gate.choose()
        self.t_round, self.prefill_before, self.tokens_before = time.perf_counter(), stats.prefill_ms, \
            stats.prefill_tokens
        if self.arm == SEQUENTIAL:
            return 0, SEQUENTIAL
        # A round that only measures an arm (not measured yet, or a probe of a losing one) runs it as it would run:
        # a one-step probe costs a step plus a whole search, never less than a sequential step, so where a search
        # is expensive speculation lost every probe and was never chosen.
        s = self.sched.next_stride(async_verify=self.arm == ASYNC) if self.sched is not None else self.rag.spec_stride
        stats.strides.append(s)
        self.round = _RoundState(s, self.prev)
        return s, self.arm

    def sequential(self) -> Effects:
        """A sequential step: on the critical path RaLMSeq's retrieval, the same query and the same top-1 (the KB's
        top-1 does not depend on k, which verification relies on too). When speculation may read the cache soon
        (the gate speculates, or probes at the next step) the search asks for the top-k_fetch: a little more than
        k = 1, where a second search running beside the step slowed its forward passes."""
        runner, retr, stats, gate = self.runner, self.retr, self.stats, self.gate
        t0 = time.perf_counter()
        q = retr.query(runner.window())
        if q is None:
            doc = self.prev
        else:
            fill = self.k_fetch > 1 and not self.fallback and gate.cache_wanted()
            hits = yield call(retr.search, [q], self.k_fetch if fill else 1, sequential=True)  # KBUnavailable:
            self._cache_hits(hits)  # fails the request; the top-1 at least: speculation can start next step
            stats.prefetches += fill
            doc = hits[0].top1
        passage = yield from passage_effects(retr, doc)
        r = time.perf_counter() - t0
        self.search_s = r
        stats.retrieval_ms += r * 1e3
        stats.sequential_retrieval_ms += r * 1e3
        stats.retrievals += 1
        stats.strides.append(0)
        yield from runner.step_passes(doc, passage)
        self.base_prefill[0] += stats.prefill_ms - self.prefill_before  # nothing of this request's runs beside it
        self.base_prefill[1] += stats.prefill_tokens - self.tokens_before
        if q is not None and not self.fallback:
            wall = time.perf_counter() - self.t_round
            gate.record(SEQUENTIAL, round_cost(wall, (stats.prefill_ms - self.prefill_before) / 1e3, 1))
            gate.record_search(r, wall)
        self.prev = doc
        yield Emit(self._take_output(), runner.finish)
        return runner.finish

    def may_guess(self, guesses: list[_Guess], inflight: Round | None) -> bool:
        return self.runner.finish is None and not self.round.stop

    def _abort(self) -> bool:
        """Between forward passes of the step in flight beside an async verification: stop once it says wrong."""
        r = self.round
        if not r.ver.done():
            return False
        true = r.ver.settle()
        return true is None or first_mismatch(r.specs, true) is not None

    def guess(self, inflight: Round | None) -> Effects:
        runner, retr, rag, stats, gate, r = self.runner, self.retr, self.rag, self.stats, self.gate, self.round
        i = len(r.specs)
        ck = runner.checkpoint()
        t0 = time.perf_counter()
        try:
            q = retr.query(runner.window())
            if q is None:
                d = r.prev_spec
            elif retr.dim:  # ranked here against the cached vectors
                d = retr.speculate(q, self.cache)
            else:  # ranked by the KB (ScoreCandidates)
                d = yield call(retr.speculate, q, self.cache)
            expected = 0.0
            if q is not None and rag.adaptive and rag.reuse_kv and d != runner.cache_doc:
                # The mean prefill so far, revisits included. Pricing each guess by what it would prefill (a kept
                # passage: only the output since) served slower from 4 clients.
                prefill_s = stats.prefill_ms / max(1, stats.prefills) / 1e3
                if gate.hold_change(prefill_s, self.search_s):
                    r.queries.append(q)  # verified with the round; the step then runs with the KB's passage
                    r.held.append(d)
                    dt = time.perf_counter() - t0
                    r.r_round += dt
                    stats.speculation_retrieval_ms += dt * 1e3
                    r.stop = True
                    return None
                expected = gate.change_waste(prefill_s)
            passage = yield from passage_effects(retr, d, sequential=False)
        except KBUnavailable as e:
            r.failure = f"speculation: {e}"
            dt = time.perf_counter() - t0
            r.r_round += dt
            stats.speculation_retrieval_ms += dt * 1e3
            r.stop = True
            return None
        r.ckpts.append(ck)
        r.queries.append(q)
        r.specs.append(d)
        r.guess_waste.append(expected)
        if self.arm == ASYNC and i == r.s - 1:  # in flight during this step
            in_order = gate.verify_in_order(r.s)
            r.ver = _Verification(retr, r.queries, self.k_fetch, self.prev, r.specs if in_order else None).start()
            stats.in_order_verifications += in_order
        dt = time.perf_counter() - t0
        r.r_round += dt
        stats.speculation_retrieval_ms += dt * 1e3
        ok = yield from runner.step_passes(d, passage, self._abort if r.ver is not None else None)
        if ok:
            r.step_s.append(time.perf_counter() - t0)
        r.prev_spec = d
        if not ok:
            r.stop = True
        return _Guess(d)

    def value(self, g: _Guess) -> int | None:
        return g.doc

    def send(self, guesses: list[_Guess], arm: str) -> Round:
        """An async round's verification started with its last step (guess); a sync round's runs in verify."""
        return Round(guesses, self.round, self.arm)

    def verify(self, rnd: Round) -> Effects:
        r, stats = self.round, self.stats
        true = None
        if not r.failure and (r.ckpts or r.held):
            t0 = time.perf_counter()
            if r.ver is None:  # sync, or the output ended before the round's last step
                in_order = self.gate.verify_in_order(len(r.specs))
                r.ver = _Verification(self.retr, r.queries, self.k_fetch, self.prev, r.specs if in_order else None)
                yield from r.ver.run()
                stats.in_order_verifications += in_order
            while not r.ver.done():  # in order: a Wait per query
                yield Wait(r.ver.future)
            true = r.ver.settle()
            if true is not None and r.ver.latency_s is not None and r.ver.batched:
                self.gate.record_verification(r.ver.latency_s, len(r.ver.asked))
            dt = time.perf_counter() - t0
            r.r_round += dt
            stats.verification_wait_ms += dt * 1e3
            if true is None:
                r.failure = f"verification: {r.ver.error}"
        if r.failure:
            # Nothing unverified may be emitted: drop the whole round, go on with sequential retrieval.
            if r.ver is not None and r.ver.future is not None:
                r.ver.future.cancel()
            if r.ckpts:
                self.runner.restore(r.ckpts[0])
            self.fallback = r.failure
            stats.fallback, stats.fallback_reason = True, r.failure[:500]
            stats.retrieval_ms += r.r_round * 1e3
            # The round committed nothing: it cost its whole time for RaLMSeq's next step. Recorded, a worker's
            # later requests learn from it (a KB whose verifications outrun --kb-spec-timeout-ms made every
            # request pay one such round before falling back).
            self.gate.record(self.arm, time.perf_counter() - self.t_round, 1)
            return None
        r.true = true
        return true

    def rollback(self, rnd: Round, settled: Settled) -> None:
        r, stats, m = self.round, self.stats, settled.matched
        g_before = stats.generation_ms
        r.wasted_prefill_ms = stats.prefill_ms - r.ckpts[m].prefill_ms
        if m + 1 < len(r.ckpts):
            r.after_miss_prefill_ms = stats.prefill_ms - r.ckpts[m + 1].prefill_ms
        self.runner.restore(r.ckpts[m])
        r.waste_s = (g_before - r.ckpts[m].generation_ms) / 1e3
        stats.wasted_generation_ms += r.waste_s * 1e3
        stats.rollbacks += 1

    def commit(self, rnd: Round, settled: Settled) -> Effects:
        runner, retr, rag, stats, gate, r = self.runner, self.retr, self.rag, self.stats, self.gate, self.round
        specs, true = r.specs, r.true
        self._cache_hits(r.ver.reply_hits)
        if r.ver.latency_s:
            self.search_s = r.ver.latency_s
        m = settled.matched if settled.wrong else None
        matched = settled.matched
        stats.speculative_steps += len(specs)
        stats.speculation_hits += matched
        for i, d in enumerate(specs[:len(specs) if m is None else m + 1]):  # the guesses judged, scored
            gate.record_step_guess(d == true[i])
            if d != (self.prev if i == 0 else specs[i - 1]):
                gate.record_change_guess(d == true[i])
        if self.sched is not None and specs:
            self.sched.record_verification(matched, len(specs))
            self.sched.record_latency(speculation_s=sum(r.step_s) / len(r.step_s) if r.step_s else None,
                                      verification_s=r.ver.latency_s, queries=len(r.ver.asked) or None)
        if m is not None:  # rolled back to before step m: it runs again with the true passage, not speculative
            t0 = time.perf_counter()
            passage = yield from passage_effects(retr, true[m])  # KBUnavailable: fails the request (no fallback)
            dt = time.perf_counter() - t0
            r.r_round += dt
            stats.verification_wait_ms += dt * 1e3
            yield from runner.step_passes(true[m], passage)
        n_committed = len(specs) if m is None else m + 1
        if r.held and m is None and runner.finish is None:
            # The held step, with the passage the KB gave for its query (asked from the verified context).
            doc = true[len(specs)]
            gate.record_change_guess(r.held[0] == doc)
            stats.held_changes += 1
            stats.held_change_hits += r.held[0] == doc
            t0 = time.perf_counter()
            passage = yield from passage_effects(retr, doc)
            dt = time.perf_counter() - t0
            r.r_round += dt
            stats.verification_wait_ms += dt * 1e3
            yield from runner.step_passes(doc, passage)
            n_committed += 1
        self.prev = true[n_committed - 1]
        stats.retrieval_ms += r.r_round * 1e3
        stats.retrievals += n_committed
        # With reuse_kv a change guess's prefill counts at its expected waste instead of what this one guess
        # happened to waste: a wrong one throws away far more than a search, and one such round kept an arm's
        # windowed mean above the sequential one's until probes, doubling apart, replaced it. Prefills slowed by a
        # search beside them (async verification) count only at the sequential steps' rate as RaLMSeq's work.
        slow = prefill_slowdown(stats.prefill_ms - self.prefill_before, stats.prefill_tokens - self.tokens_before,
                                *self.base_prefill)
        round_prefill_s = (stats.prefill_ms - self.prefill_before) / 1e3 / slow
        if rag.reuse_kv:
            cost = round_cost(time.perf_counter() - self.t_round, round_prefill_s, n_committed,
                              thrown_prefill_s=r.after_miss_prefill_ms / 1e3 / slow, guess_waste=r.guess_waste)
        else:  # every step prefills: what a rollback threw away is the guess's cost as measured
            cost = round_cost(time.perf_counter() - self.t_round, round_prefill_s, n_committed,
                              thrown_prefill_s=r.wasted_prefill_ms / 1e3 / slow)
        gate.record(self.arm, cost, n_committed)
        yield Emit(self._take_output(), runner.finish)
        return runner.finish
