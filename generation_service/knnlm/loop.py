"""kNN-LM decoding (Khandelwal et al. 2020) with RaLMSpec's token-level speculative retrieval.

Key: q = the model's final hidden state at the last position (the input of its output layer, after the final
norm), not the last FFN input that Khandelwal et al. found slightly better. Why: serving gets it for free from the
single-token pass it runs anyway (a forward hook on the output layer, no second pass and no hook into one
architecture's blocks), it means the same thing for every HF causal LM, and the datastore builder
(tools/knn_build.py) reads the very same tensor, so build and serving cannot drift apart.

Next-token distribution:
    p(v) = λ·p_kNN(v) + (1 − λ)·p_LM(v),   p_kNN(v) = Σ_{neighbour j: value_j = v} softmax_j(score_j / T)
score_j = −‖q − key_j‖² as the retrieval service returns it (L2, higher is better) for the k nearest datastore
entries. Worked example: scores [0, −ln 3], values [2, 4], T = 1 -> p_kNN = {2: 0.75, 4: 0.25}; with λ = 0.4 and a
uniform p_LM over 5 tokens, p = [0.12, 0.12, 0.42, 0.12, 0.22].

Baseline: one Search per generated token (`speculate=False`).
RaLMSpec (`speculate=True`): after every real retrieval the local `NeighbourCache` takes the n datastore entries
that follow each neighbour (entry j+1 continues entry j's text, so it is a likely neighbour of the next query).
A speculation step takes the k nearest *cached* entries instead of calling the service, picks the token and runs
the LM on it; after s steps one batched Search verifies all s queries. A step is right when its speculated token
equals the token the true neighbours give (not the neighbour set); at the first wrong step the KV cache rolls
back and the true token is emitted. s is fixed or chosen by OS³ (generation_service/augment/os3.py). With async
verification (the default) the next round is speculated while the Search is in flight, assuming the round in
flight is all right; on two cores the LM pass and the service's Search then run side by side.

Lossless: every emitted token is the greedy pick of the true distribution for a context made of emitted tokens
only, computed from the same single-token LM pass and the same Search scores as the baseline's, so the output
equals the baseline's token for token (speculation only decides which LM passes are wasted). Greedy only.

    backend = KnnBackend.open("~/.cache/ragserve/knnlm/docs", "127.0.0.1:50051")
    tokens, stats = generate_tokens(tm, prompt_ids, SamplingParams(max_new_tokens=64),
                                    KnnLmOptions(k=1024, speculate=True), backend)

Retrieval down: a failed Search raises KnnRetrievalError and the request fails (gRPC UNAVAILABLE), after the
tokens already streamed (each of which was verified). It does not degrade to p_LM as drafting degrades to AR:
tokens decided without neighbours would be another model's output under the kNN-LM's name.

The retrieval service answers Search with entry ids and scores; the worker maps ids to next tokens (and reads the
keys of cached successor entries) through the datastore's memory-mapped values.npy / keys.npy, which it opens
read-only (see tools/knn_build.py for why).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import numpy as np
import torch

from generation_service.augment.os3 import OS3Config
from generation_service.augment.round import Round, Settled, run_rounds
from generation_service.augment.round_gate import ASYNC, SEQUENTIAL, SYNC, RoundGate
from generation_service.engine.effects import Effects, Emit, Wait, call, run_solo
from generation_service.engine.speculative import (
    FINISH_CANCELLED,
    SpeculationStats,
    StreamChunk,
    cut_emitted,
    stream_tokenizer,
    text_chunks,
)
from generation_service.engine.steps import check_prompt
from generation_service.knnlm.cache import NeighbourCache
from generation_service.knnlm.distribution import mixed_distribution, next_token
from generation_service.knnlm.options import (
    ALONE_DECAY,
    KNN_GATE_EXPLORE,
    KNN_GATE_FAR_BEHIND,
    KNN_OS3,
    KnnLmOptions,
    KnnLmStats,
)
from generation_service.knnlm.passes import _truncate, lm_prefill_passes, lm_step_passes
from generation_service.knnlm.search import KnnBackend, PendingSearch, hit_distributions, true_distributions
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import TargetModel, cache_length, new_cache
from ragcore.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ decode loops


def _check_prompt(tm: TargetModel, prompt_ids, params: SamplingParams) -> np.ndarray:
    if not params.greedy:
        raise InvalidArgument("temperature", "kNN-LM decoding is greedy only (leave temperature unset or 0)")
    return check_prompt(tm, prompt_ids, params).astype(np.int64)


@dataclass
class KnnStreamChunk(StreamChunk):
    knnlm: KnnLmStats | None = None  # final chunk only


class KnnRequest:
    """One kNN-LM request (the baseline, or RaLMSpec-style speculation when opts.speculate) as a decoding loop over
    effects (engine/effects.py): run alone by decode / generate_stream, or beside other requests by the engine.

        req = KnnRequest(tm, prompt_ids, params, opts, backend)   # InvalidArgument for a bad request
        for tokens, finish in run_solo(tm, req.effects()): ...
        chunk = req.final_chunk(finish, ids, text, n_tokens, total_ms)
    """

    chunk = KnnStreamChunk  # its text chunks

    def __init__(self, tm: TargetModel, prompt_ids, params: SamplingParams, opts: KnnLmOptions, backend: KnnBackend,
                 *, stats: KnnLmStats | None = None, os3: OS3Config | None = None,
                 is_cancelled: Callable[[], bool] | None = None):
        self.prompt = _check_prompt(tm, prompt_ids, params)
        backend.check(opts)
        self.tm, self.params, self.opts, self.backend, self.os3 = tm, params, opts, backend, os3
        self.stats = stats if stats is not None else KnnLmStats()
        self.stats.mode, self.stats.retriever, self.stats.k = opts.mode, opts.retriever, opts.k
        self.cancelled = is_cancelled or (lambda: False)

    def effects(self) -> Effects:
        """The loop: effects, Emit(new output tokens, finish reason); the last Emit carries the reason."""
        tm, stats = self.tm, self.stats
        if self.cancelled():
            yield Emit([], FINISH_CANCELLED)
            return
        t0 = time.perf_counter()
        kv = new_cache(tm)
        logits, hidden = yield from lm_prefill_passes(tm, kv, self.prompt)
        stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        eos = frozenset() if self.params.ignore_eos else tm.eos_token_ids
        loop = _Loop(tm, kv, self.params.max_new_tokens, eos, self.opts, self.backend, stats, self.cancelled,
                     self.os3, (logits, hidden))
        with self.backend.running():
            yield from (_speculative if self.opts.speculate else _baseline)(loop)

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> KnnStreamChunk:
        knn = self.stats
        stats = SpeculationStats(
            decoding="knnlm", forward_steps=knn.tokens if not self.opts.speculate else knn.tokens + knn.wasted_passes,
            verify_ms=knn.generation_ms, prefill_ms=knn.prefill_ms,  # retrieval and speculation: knnlm stats
            total_ms=total_ms, draft_tokens_proposed=knn.speculated, draft_tokens_accepted=knn.correct)
        return KnnStreamChunk(ids, text, finish_reason=finish, stats=stats, prompt_tokens=len(self.prompt),
                              completion_tokens=n_tokens, knnlm=knn)


def decode(tm: TargetModel, prompt_ids, params: SamplingParams, opts: KnnLmOptions, backend: KnnBackend, *,
           stats: KnnLmStats | None = None, os3: OS3Config | None = None,
           is_cancelled: Callable[[], bool] | None = None) -> Iterator[tuple[list[int], str | None]]:
    """Token-level kNN-LM generation alone: yields (new output tokens, finish reason); the last item has the
    reason."""
    req = KnnRequest(tm, prompt_ids, params, opts, backend, stats=stats, os3=os3, is_cancelled=is_cancelled)
    yield from run_solo(tm, req.effects())


@dataclass
class _Loop:
    """A kNN-LM request's decoding state, shared by the baseline steps and the speculation rounds.

    Invariant: the kv cache holds the passes of the prompt, the emitted tokens and the unverified guesses, except
    the very last token's pass while `head` is None."""

    tm: TargetModel
    kv: object
    max_new: int
    eos: frozenset
    opts: KnnLmOptions
    backend: KnnBackend
    stats: KnnLmStats
    cancelled: Callable[[], bool]
    os3: OS3Config | None
    head: tuple[torch.Tensor, np.ndarray] | None  # LM state (logits [V], hidden [D]) after the last token
    n_out: int = 0  # tokens emitted (and yielded)
    last_token: int = -1  # the last token (emitted or guessed); its pass is pending while head is None


def _baseline(loop: _Loop) -> Effects:
    """Retrieval at every token: Search(q_t) -> p_t -> token -> LM pass -> q_{t+1}."""
    while True:
        if loop.cancelled():
            yield Emit([], FINISH_CANCELLED)
            return
        _, finish, _ = yield from _baseline_step(loop)
        if finish:
            return


def _baseline_step(loop: _Loop, fill: Callable[[np.ndarray], None] | None = None) -> Effects:
    """One baseline step from the LM state loop.head: Search, token, Emit, then the LM pass on the token unless
    that finished the request (loop.head is then None). `fill(retrieved ids)` runs between the Search and the Emit.
    Returns (the token, finish reason or None, seconds in the Search and its distribution)."""
    stats = loop.stats
    t = time.perf_counter()
    (p,), retrieved = yield from true_distributions(loop.backend, loop.head[1][None, :], [loop.head[0]], loop.opts,
                                                    stats)
    search_s = time.perf_counter() - t
    token = next_token(p)
    if fill is not None:
        fill(retrieved[0])
    out, finish = cut_emitted([token], loop.max_new - loop.n_out, loop.eos)
    loop.n_out += len(out)
    stats.tokens = loop.n_out
    yield Emit(out, finish)
    if finish:
        loop.head = None
        return token, finish, search_s
    t = time.perf_counter()
    loop.head = yield from lm_step_passes(loop.tm, loop.kv, token)
    stats.generation_ms += (time.perf_counter() - t) * 1e3
    return token, None, search_s


@dataclass
class StepClock:
    """Splits a speculation step run beside a Search in flight into the time a step takes alone (its round's
    cost) and the rest (the slowdown the Search beside it caused: the async round's cost). A sync round after
    an async one would otherwise pay for that Search, and the gate kept choosing async where sync rounds were
    faster per request (a small machine shared with the retrieval service)."""

    alone_s: float | None = None  # a step with an LM pass and no Search in flight, averaged (ALONE_DECAY)

    def seed(self, pass_s: float) -> None:
        """A first estimate (a baseline step's LM pass) until a speculation step runs alone."""
        if self.alone_s is None:
            self.alone_s = pass_s

    def split(self, step_s: float, passed: bool, beside: bool) -> tuple[float, float]:
        """A step of step_s seconds (passed: it ran an LM pass; beside: a Search was in flight) -> (seconds
        charged to its round, seconds charged to the Search beside it). Steps without a pass are not compared:
        they take a fraction of one with a pass.

        split(0.012, True, True) with alone_s 0.008 -> (0.008, 0.004);  split(0.006, True, True) -> (0.006, 0)"""
        if passed and not beside:
            old = step_s if self.alone_s is None else self.alone_s
            self.alone_s = (1 - ALONE_DECAY) * step_s + ALONE_DECAY * old
        if not (passed and beside) or self.alone_s is None:
            return step_s, 0.0
        slowed = max(0.0, step_s - self.alone_s)
        return step_s - slowed, slowed


@dataclass
class _Step:
    """One speculation step: the LM state it guessed from and the guess."""

    query: np.ndarray  # float32 [D]: the final hidden state after the previous token
    logits: torch.Tensor  # [V]: the LM's next-token logits there
    guess: int  # the token the cached neighbours give


@dataclass
class _Sent:
    """A round's verification Search in flight."""

    search: PendingSearch
    sent: float  # perf_counter when the Search was sent
    spec_s: float  # speculation time of its steps (LM passes + cache guesses)
    passes: int  # LM passes among them (the first step after the prompt has none)
    t_hits: float = 0.0  # perf_counter when its hits were in


def round_gate(opts: KnnLmOptions, backend: KnnBackend) -> RoundGate:
    """The gate choosing each round's kind for a request: async and sync rounds and baseline steps (sequential)
    when opts.adaptive, else the one kind async_verify names. Costs are pooled per setting that shapes a round."""
    configured = ASYNC if opts.async_verify else SYNC
    arms = (([ASYNC] if opts.async_verify else []) + [SYNC, SEQUENTIAL]) if opts.adaptive else [configured]
    return RoundGate(arms, shared=backend.round_costs, key=("knnlm", opts, tuple(arms)), explore=KNN_GATE_EXPLORE,
                     min_search_share=opts.min_search_share, far_behind=KNN_GATE_FAR_BEHIND)


class _Rounds:
    """kNN-LM speculation as a policy of the shared round (augment/round.py): a guess is a token from the cached
    neighbours of the current LM state, checked against the token the true neighbours give; a rollback truncates
    the KV cache."""

    pipelines = True

    def __init__(self, loop: _Loop):
        self.loop = loop
        opts, backend = loop.opts, loop.backend
        self.cache = NeighbourCache(backend.datastore, opts.cache_next, opts.cache_capacity, backend.key_norms,
                                    opts.cache_fill_top)
        self.sched = None
        if opts.stride == 0:
            self.sched = backend.scheduler(opts, replace(loop.os3 or KNN_OS3, async_verify=opts.async_verify))
        self.gate = round_gate(opts, backend)
        self.prompt_len = cache_length(loop.kv)
        self.clock = StepClock()
        self.stale = False  # the cache missed the fills of crowded steps: refill it with a baseline step first
        self.crowded = False  # other requests share the scans (backend.crowded), asked at each round's start
        self.spec_s, self.passes = 0.0, 0  # speculation time and LM passes of the guesses not yet sent
        self.thrown_s = 0.0  # speculation time of the next round's guesses the last rollback threw away
        self.t_settle = 0.0
        self.retrieved: list = []

    def cancelled(self) -> bool:
        return self.loop.cancelled()

    def cancel(self, rnd: Round) -> None:
        rnd.pending.search.future.cancel()

    def begin(self, arm: str | None) -> tuple[int, str]:
        loop, opts = self.loop, self.loop.opts
        stride = self.sched.next_stride() if self.sched is not None else opts.stride
        self.crowded = opts.adaptive and loop.backend.crowded()
        if arm is None:
            # The first token is a baseline step: with nothing cached a round would guess the LM's token. So is
            # every step while other requests share the scans (crowded), and the first after: it refills the
            # cache, which crowded steps leave alone.
            arm = (SEQUENTIAL if self.crowded or self.stale or not (len(self.cache) or not opts.adaptive)
                   else self.gate.choose())
        return stride, arm

    def sequential(self) -> Effects:
        """A baseline step: Search(q_t) -> token -> LM pass, exactly the baseline's work."""
        loop, stats, cache, gate, crowded = self.loop, self.loop.stats, self.cache, self.gate, self.crowded
        t_step = time.perf_counter()
        if loop.head is None:
            loop.head = yield from lm_step_passes(loop.tm, loop.kv, loop.last_token)
            stats.generation_ms += (time.perf_counter() - t_step) * 1e3

        def fill(retrieved: np.ndarray) -> None:
            if crowded:
                return
            if self.stale or gate.cache_wanted() or not len(cache):  # a speculative round may come next: warm
                t_fill = time.perf_counter()
                cache.fill(retrieved)
                stats.speculation_ms += (time.perf_counter() - t_fill) * 1e3
            stats.cache_entries = len(cache)

        stats.strides.append(0)
        gen_ms = stats.generation_ms
        token, finish, search_s = yield from _baseline_step(loop, fill)
        loop.last_token = token
        if loop.head is not None:  # its LM pass ran alone: a first estimate of a step's time
            self.clock.seed((stats.generation_ms - gen_ms) / 1e3)
        self.stale = crowded
        if finish:
            return finish
        step_s = time.perf_counter() - t_step
        if not crowded:  # a crowded step's costs are another regime's (requests share its scan)
            gate.record(SEQUENTIAL, step_s)
            gate.record_search(search_s, step_s)
        return None

    def may_guess(self, guesses: list[_Step], inflight: Round | None) -> bool:
        loop = self.loop
        unverified = len(guesses) + (len(inflight.guesses) if inflight else 0)
        return (unverified < loop.max_new - loop.n_out
                and not (guesses and guesses[-1].guess in loop.eos)
                and not (not guesses and inflight and inflight.guesses[-1].guess in loop.eos)
                and not (inflight and inflight.pending.search.done()))

    def guess(self, inflight: Round | None) -> Effects:
        """One step: the LM pass on the previous guess if it is pending, then the token the cached neighbours
        give. The pass on a guess runs lazily, when the next step needs its state, so a sync round never runs
        the pass of its last guess before the verification says whether it is kept."""
        loop, stats, opts = self.loop, self.loop.stats, self.loop.opts
        t = time.perf_counter()
        passed = loop.head is None
        if passed:
            loop.head = yield from lm_step_passes(loop.tm, loop.kv, loop.last_token)
            stats.generation_ms += (time.perf_counter() - t) * 1e3
            self.passes += 1
        q_logits, q = loop.head
        t_guess = time.perf_counter()
        _, scores, values = self.cache.nearest(q, opts.k)
        guess = next_token(mixed_distribution(q_logits, scores, values, opts))
        stats.speculation_ms += (time.perf_counter() - t_guess) * 1e3
        stats.overlapped += inflight is not None
        own_s, slowed_s = self.clock.split(time.perf_counter() - t, passed, inflight is not None)
        self.spec_s += own_s
        if inflight is not None:
            inflight.beside_s += slowed_s
        loop.head, loop.last_token = None, guess
        return _Step(q, q_logits, guess)

    def value(self, g: _Step) -> int:
        return g.guess

    def send(self, guesses: list[_Step], arm: str) -> Round:
        if not guesses:
            raise AssertionError("kNN-LM speculation produced no step")  # stride >= 1 and budget left
        opts = self.loop.opts
        queries = np.stack([st.query for st in guesses])
        search = self.loop.backend.client.search_async(queries, opts.k, opts.retriever, opts.ef_search)
        rnd = Round(guesses, _Sent(search, time.perf_counter(), self.spec_s, self.passes), arm)
        self.spec_s, self.passes = 0.0, 0
        return rnd

    def verify(self, rnd: Round) -> Effects:
        loop, sent = self.loop, rnd.pending
        self.t_settle = t = time.perf_counter()
        if not sent.search.done():
            yield Wait(sent.search)
        hits = sent.search.settled()
        if hits is None:  # that replica failed: once more, failing over
            hits = yield call(sent.search.retry)
        sent.t_hits = time.perf_counter()
        log.debug("round of %d: sent %.3f, search %.3f s, settled after %.3f s", len(rnd.guesses), sent.sent,
                  sent.search.finished_at - sent.sent, sent.t_hits - sent.sent)
        dists, self.retrieved = hit_distributions(loop.backend, hits, [st.logits for st in rnd.guesses], loop.opts,
                                                  loop.stats)
        true = [next_token(p) for p in dists]
        loop.stats.retrieval_ms += (time.perf_counter() - t) * 1e3
        return true

    def rollback(self, rnd: Round, settled: Settled) -> None:
        """Everything after the wrong guess: the rest of this round, the next round's guesses."""
        loop = self.loop
        keep = self.prompt_len + loop.n_out + len(settled.committed) - 1  # the emitted tokens' passes but the last
        loop.stats.wasted_passes += max(0, cache_length(loop.kv) - keep)
        _truncate(loop.kv, keep)
        self.thrown_s = self.spec_s
        self.spec_s, self.passes = 0.0, 0
        loop.head, loop.last_token = None, settled.committed[-1]

    def commit(self, rnd: Round, settled: Settled) -> Effects:
        loop, stats, sent = self.loop, self.loop.stats, rnd.pending
        emitted, matched, n_steps = settled.committed, settled.matched, settled.guessed
        t_fill = time.perf_counter()
        self.cache.fill_many(self.retrieved[:len(emitted)])  # queries past the first wrong step read a wrong context
        stats.speculation_ms += (time.perf_counter() - t_fill) * 1e3
        # OS³'s b: the Search's own wall time (overlapped or not) + the distributions and the cache fill.
        verify_s = (sent.search.finished_at - sent.sent) + (time.perf_counter() - sent.t_hits)
        stats.verifications += 1
        stats.speculated += n_steps
        stats.correct += matched
        stats.rollbacks += matched < n_steps
        stats.strides.append(n_steps)
        stats.speculation_accuracy = stats.correct / stats.speculated
        stats.cache_entries = len(self.cache)
        if self.sched is not None:
            self.sched.record_verification(matched, n_steps)
            # a = one step with its LM pass: a round without passes (the first, right after the prompt) would
            # make speculation look free and send OS³ to its longest stride.
            self.sched.record_latency(speculation_s=sent.spec_s / n_steps if sent.passes else None,
                                      verification_s=verify_s)
        thrown_s = self.thrown_s if settled.wrong else 0.0
        self.thrown_s = 0.0
        self.gate.record(rnd.arm, (sent.spec_s + rnd.beside_s + time.perf_counter() - self.t_settle + thrown_s)
                         / len(emitted), len(emitted))
        out, finish = cut_emitted(emitted, loop.max_new - loop.n_out, loop.eos)
        loop.n_out += len(out)
        stats.tokens = loop.n_out
        yield Emit(out, finish)
        return finish


def _speculative(loop: _Loop) -> Effects:
    """RaLMSpec rounds (augment/round.py, the policy _Rounds): speculation steps from the cache, one batched
    verification Search per round, roll back at the first wrong step; or, where the gate measures that
    speculation does not pay, baseline steps.

    In an async round the Search is in flight while the next round is speculated on the assumption that every
    guess was right: its first LM pass (on the last guess) and further steps overlap the Search, and are kept when
    the verification confirms the whole round (γ^s of the time), thrown away otherwise.

    Which kind each round is (async, sync, or one baseline step: Search, token, LM pass) is the gate's choice
    (augment/round_gate.RoundGate, `round_gate`), each kind timed per emitted token. A round is charged its own
    work wherever it ran: its steps at the time a step takes alone, the time spent waiting for and settling its
    verification, the next round's steps its rollback threw away, and, for an async round, how much its Search
    slowed the steps run beside it (their time over a step alone: StepClock). Not the wall time between
    settles: a lone async round between sync ones would then look like a sync round. Why a gate: on two cores
    shared with the retrieval service an async round's passes run markedly slower, and where a Search is cheap
    none of it pays.

    The tokens emitted are always the greedy picks of true distributions (real Search, LM logits) over a context
    of emitted tokens only, whatever was speculated.
    """
    yield from run_rounds(_Rounds(loop))


def generate_tokens(tm: TargetModel, prompt_ids, params: SamplingParams, opts: KnnLmOptions, backend: KnnBackend,
                    **kwargs) -> tuple[list[int], KnnLmStats]:
    """decode(), collected: (output tokens, stats)."""
    stats = KnnLmStats()
    tokens: list[int] = []
    for out, _ in decode(tm, prompt_ids, params, opts, backend, stats=stats, **kwargs):
        tokens += out
    return tokens, stats


# ------------------------------------------------------------------------------------------- text level


def generate_stream(tm: TargetModel, prompt_ids, params: SamplingParams, opts: KnnLmOptions, backend: KnnBackend, *,
                    is_cancelled: Callable[[], bool] | None = None, tokenizer="model") -> Iterator[KnnStreamChunk]:
    """Stream chunks like speculative.generate_stream; the final chunk carries SpeculationStats and KnnLmStats."""
    t0 = time.perf_counter()
    tok = stream_tokenizer(tm, tokenizer, params)
    req = KnnRequest(tm, prompt_ids, params, opts, backend, is_cancelled=is_cancelled)
    finish, ids, delta, n_tokens = yield from text_chunks(run_solo(tm, req.effects()), tok, prompt_ids, params.stop,
                                                          KnnStreamChunk)
    yield req.final_chunk(finish, ids, delta, n_tokens, (time.perf_counter() - t0) * 1e3)


def options_from_proto(msg, defaults: KnnLmOptions | None = None) -> KnnLmOptions:
    """proto KnnLmOptions -> KnnLmOptions; unset/zero fields keep `defaults`. ValueError 'knnlm.<field>: ...'."""
    d = defaults or KnnLmOptions()
    try:
        return KnnLmOptions(
            retriever=msg.retriever or d.retriever, k=msg.k or d.k,
            lam=msg.knn_weight if msg.HasField("knn_weight") else d.lam,
            temperature=msg.temperature if msg.HasField("temperature") else d.temperature,
            speculate=msg.speculate if msg.HasField("speculate") else d.speculate, stride=msg.stride,
            cache_next=msg.cache_next or d.cache_next,
            async_verify=msg.async_verify if msg.HasField("async_verify") else d.async_verify,
            cache_capacity=d.cache_capacity, ef_search=msg.ef_search or d.ef_search)
    except InvalidArgument as e:
        raise InvalidArgument(f"knnlm.{e.field}", e.problem) from None


def request_options(msg, params: SamplingParams, backend: KnnBackend | None) -> KnnLmOptions:
    """A Generate request's kNN-LM options, checked against the sampling settings and the datastore
    (ValueError whose message starts with the field)."""
    if backend is None:
        raise FailedPrecondition("this server has no kNN-LM datastore (start it with --knnlm-datastore DIR)")
    if not params.greedy:
        raise InvalidArgument("temperature", "kNN-LM decoding is greedy only (leave temperature unset or 0)")
    opts = options_from_proto(msg)
    try:
        backend.check(opts)
    except InvalidArgument as e:
        raise InvalidArgument(f"knnlm.{e.field}", e.problem) from None
    return opts
