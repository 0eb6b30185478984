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
        loop = _speculative if self.opts.speculate else _baseline
        with self.backend.running():
            yield from loop(tm, kv, logits, hidden, self.params.max_new_tokens, eos, self.opts, self.backend, stats,
                            self.cancelled, self.os3)

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


def _baseline(tm, kv, logits, hidden, max_new, eos, opts, backend, stats, cancelled, _os3):
    """Retrieval at every token: Search(q_t) -> p_t -> token -> LM pass -> q_{t+1}."""
    n_out, head = 0, (logits, hidden)
    while True:
        if cancelled():
            yield Emit([], FINISH_CANCELLED)
            return
        n_out, _, finish, head, _ = yield from _baseline_step(tm, kv, head, max_new, n_out, eos, opts, backend, stats)
        if finish:
            return


def _baseline_step(tm, kv, head, max_new, n_out, eos, opts, backend, stats,
                   fill: Callable[[np.ndarray], None] | None = None) -> Effects:
    """One baseline step from the LM state `head` = (logits, hidden): Search, token, Emit, then the LM pass on the
    token unless that finished the request. `fill(retrieved ids)` runs between the Search and the Emit.
    Returns (tokens emitted so far, the token, finish reason or None, the LM state after the pass or None,
    seconds in the Search and its distribution)."""
    t = time.perf_counter()
    (p,), retrieved = yield from true_distributions(backend, head[1][None, :], [head[0]], opts, stats)
    search_s = time.perf_counter() - t
    token = next_token(p)
    if fill is not None:
        fill(retrieved[0])
    out, finish = cut_emitted([token], max_new - n_out, eos)
    n_out += len(out)
    stats.tokens = n_out
    yield Emit(out, finish)
    if finish:
        return n_out, token, finish, None, search_s
    t = time.perf_counter()
    head = yield from lm_step_passes(tm, kv, token)
    stats.generation_ms += (time.perf_counter() - t) * 1e3
    return n_out, token, None, head, search_s


@dataclass
class StepClock:
    """Splits a speculation step run beside a Search in flight into the time a step takes alone (its round's
    cost) and the rest (the slowdown the Search beside it caused: the async round's cost). A sync round after
    an async one would otherwise pay for that Search, and the gate kept choosing async where sync rounds were
    10-20 % faster per request (2 cores shared with the retrieval service)."""

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
class _Round:
    """Steps sent to one batched verification Search."""

    steps: list[_Step]
    search: PendingSearch
    sent: float  # perf_counter when the Search was sent
    spec_s: float  # speculation time of its steps (LM passes + cache guesses)
    passes: int  # LM passes among them (the first step after the prompt has none)
    arm: str  # ASYNC (the next round is speculated while its Search runs) or SYNC
    beside_s: float = 0.0  # how much slower the steps run beside its Search were than steps run alone


def round_gate(opts: KnnLmOptions, backend: KnnBackend) -> RoundGate:
    """The gate choosing each round's kind for a request: async and sync rounds and baseline steps (sequential)
    when opts.adaptive, else the one kind async_verify names. Costs are pooled per setting that shapes a round."""
    configured = ASYNC if opts.async_verify else SYNC
    arms = (([ASYNC] if opts.async_verify else []) + [SYNC, SEQUENTIAL]) if opts.adaptive else [configured]
    return RoundGate(arms, shared=backend.round_costs, key=("knnlm", opts, tuple(arms)), explore=KNN_GATE_EXPLORE,
                     min_search_share=opts.min_search_share, far_behind=KNN_GATE_FAR_BEHIND)


def _speculative(tm, kv, logits, hidden, max_new, eos, opts, backend, stats, cancelled, os3):
    """RaLMSpec rounds: speculation steps from the cache, one batched verification Search per round, roll back
    at the first wrong step; or, where the gate measures that speculation does not pay, baseline steps.

    A step guesses the next token from the cached neighbours of the current LM state; the LM pass on a guess runs
    lazily, when the next step needs its state, so a sync round never runs the pass of its last guess before
    the verification says whether it is kept. In an async round the Search is in flight while the next round
    is speculated on the assumption that every guess was right: its first LM pass (on the last guess) and
    further steps overlap the Search, and are kept when the verification confirms the whole round (γ^s of the
    time), thrown away otherwise. At most one round is in flight.

    Which kind each round is (async, sync, or one baseline step: Search, token, LM pass) is the gate's choice
    (ralm_gate.RoundGate, `round_gate`), each kind timed per emitted token. A round is charged its own work
    wherever it ran: its steps at the time a step takes alone, the time spent waiting for and settling its
    verification, the next round's steps its rollback threw away, and, for an async round, how much its Search
    slowed the steps run beside it (their time over a step alone: StepClock). Not the wall time between
    settles: a lone async round between sync ones would then look like a sync round. Why a gate: on two cores
    shared with the retrieval service an async round's passes run ~1.5x slower, and where a Search is cheap
    none of it pays.

    Invariant: the kv cache holds the passes of the prompt, the emitted tokens and the unverified guesses, except
    the very last token's pass while `head` is None. The tokens emitted are always the greedy picks of true
    distributions (real Search, LM logits) over a context of emitted tokens only, whatever was speculated.
    """
    cache = NeighbourCache(backend.datastore, opts.cache_next, opts.cache_capacity, backend.key_norms,
                           opts.cache_fill_top)
    sched = None
    if opts.stride == 0:
        sched = backend.scheduler(opts, replace(os3 or KNN_OS3, async_verify=opts.async_verify))
    gate = round_gate(opts, backend)
    prompt_len = cache_length(kv)
    n_out = 0  # tokens emitted (and yielded)
    head: tuple[torch.Tensor, np.ndarray] | None = (logits, hidden)  # LM state after the last token
    last_token = -1  # the last token of the sequence (emitted or guessed); its pass is pending while head is None
    steps: list[_Step] = []  # speculated, not yet sent
    spec_s, passes = 0.0, 0  # speculation time and LM passes of `steps`
    inflight: _Round | None = None
    stride = 0
    clock = StepClock()
    stale = False  # the cache missed the fills of crowded steps: refill it with a baseline step first
    crowded = False  # other requests share the scans (backend.crowded), asked at each round's start
    arm: str | None = None  # kind of the round being built; None = ask the gate when the next one starts

    def unverified() -> int:
        return len(steps) + (len(inflight.steps) if inflight else 0)

    while True:
        if cancelled():
            if inflight:
                inflight.search.future.cancel()
            yield Emit([], FINISH_CANCELLED)
            return
        if not steps:
            stride = sched.next_stride() if sched is not None else opts.stride
            crowded = opts.adaptive and backend.crowded()
            if arm is None:
                # The first token is a baseline step: with nothing cached a round would guess the LM's token. So is
                # every step while other requests share the scans (crowded), and the first after: it refills the
                # cache, which crowded steps leave alone.
                arm = SEQUENTIAL if crowded or stale or not (len(cache) or not opts.adaptive) else gate.choose()
        if arm == SEQUENTIAL and inflight is None:
            # A baseline step: Search(q_t) -> token -> LM pass, exactly the baseline's work.
            t_step = time.perf_counter()
            if head is None:
                head = yield from lm_step_passes(tm, kv, last_token)
                stats.generation_ms += (time.perf_counter() - t_step) * 1e3

            def fill(retrieved: np.ndarray) -> None:
                if crowded:
                    return
                if stale or gate.cache_wanted() or not len(cache):  # a speculative round may come next: keep it warm
                    t_fill = time.perf_counter()
                    cache.fill(retrieved)
                    stats.speculation_ms += (time.perf_counter() - t_fill) * 1e3
                stats.cache_entries = len(cache)

            stats.strides.append(0)
            gen_ms = stats.generation_ms
            n_out, last_token, finish, head, search_s = yield from _baseline_step(tm, kv, head, max_new, n_out, eos,
                                                                                  opts, backend, stats, fill)
            if head is not None:  # its LM pass ran alone: a first estimate of a step's time
                clock.seed((stats.generation_ms - gen_ms) / 1e3)
            stale = crowded
            if finish:
                return
            step_s = time.perf_counter() - t_step
            if not crowded:  # a crowded step's costs are another regime's (requests share its scan)
                gate.record(SEQUENTIAL, step_s)
                gate.record_search(search_s, step_s)
            arm = None
            continue
        # 1. Speculate up to the stride; while a round is in flight, stop as soon as its answer is there. Only an
        # async round is speculated beside one: a sync round or a baseline step waits for the answer first.
        while ((arm == ASYNC or (arm == SYNC and inflight is None)) and len(steps) < stride
               and unverified() < max_new - n_out
               and not (steps and steps[-1].guess in eos)
               and not (not steps and inflight and inflight.steps[-1].guess in eos)
               and not (inflight and inflight.search.done())):
            t = time.perf_counter()
            passed = head is None
            if passed:
                head = yield from lm_step_passes(tm, kv, last_token)
                stats.generation_ms += (time.perf_counter() - t) * 1e3
                passes += 1
            q_logits, q = head
            t_guess = time.perf_counter()
            _, scores, values = cache.nearest(q, opts.k)
            guess = next_token(mixed_distribution(q_logits, scores, values, opts))
            stats.speculation_ms += (time.perf_counter() - t_guess) * 1e3
            steps.append(_Step(q, q_logits, guess))
            stats.overlapped += inflight is not None
            own_s, slowed_s = clock.split(time.perf_counter() - t, passed, inflight is not None)
            spec_s += own_s
            if inflight is not None:
                inflight.beside_s += slowed_s
            head, last_token = None, guess
        # 2. Send the round if nothing is in flight (sync: then wait for it at once).
        if inflight is None:
            if not steps:
                raise AssertionError("kNN-LM speculation produced no step")  # stride >= 1 and budget left
            queries = np.stack([st.query for st in steps])
            inflight = _Round(steps, backend.client.search_async(queries, opts.k, opts.retriever, opts.ef_search),
                              time.perf_counter(), spec_s, passes, arm)
            steps, spec_s, passes, arm = [], 0.0, 0, None
            if inflight.arm == ASYNC:
                continue
        # 3. Settle the round in flight.
        rnd, inflight = inflight, None
        t = time.perf_counter()
        if not rnd.search.done():
            yield Wait(rnd.search)
        hits = rnd.search.settled()
        if hits is None:  # that replica failed: once more, failing over
            hits = yield call(rnd.search.retry)
        t_hits = time.perf_counter()
        log.debug("round of %d: sent %.3f, search %.3f s, settled after %.3f s; %d steps built meanwhile",
                  len(rnd.steps), rnd.sent, rnd.search.finished_at - rnd.sent, t_hits - rnd.sent, len(steps))
        dists, retrieved = hit_distributions(backend, hits, [st.logits for st in rnd.steps], opts, stats)
        emitted: list[int] = []
        for p, st in zip(dists, rnd.steps):
            emitted.append(next_token(p))
            if emitted[-1] != st.guess:
                break
        stats.retrieval_ms += (time.perf_counter() - t) * 1e3
        n_steps = len(rnd.steps)
        matched = len(emitted) - (emitted[-1] != rnd.steps[len(emitted) - 1].guess)
        t_fill = time.perf_counter()
        cache.fill_many(retrieved[:len(emitted)])  # queries past the first wrong step read a wrong context
        stats.speculation_ms += (time.perf_counter() - t_fill) * 1e3
        # OS³'s b: the Search's own wall time (overlapped or not) + the distributions and the cache fill.
        verify_s = (rnd.search.finished_at - rnd.sent) + (time.perf_counter() - t_hits)
        stats.verifications += 1
        stats.speculated += n_steps
        stats.correct += matched
        stats.rollbacks += matched < n_steps
        stats.strides.append(n_steps)
        stats.speculation_accuracy = stats.correct / stats.speculated
        stats.cache_entries = len(cache)
        if sched is not None:
            sched.record_verification(matched, n_steps)
            # a = one step with its LM pass: a round without passes (the first, right after the prompt) would
            # make speculation look free and send OS³ to its longest stride.
            sched.record_latency(speculation_s=rnd.spec_s / n_steps if rnd.passes else None,
                                 verification_s=verify_s)
        thrown_s = 0.0
        if matched < n_steps:
            # Roll back: everything after the wrong guess (the rest of this round, the next round's steps).
            keep = prompt_len + n_out + len(emitted) - 1  # passes of the emitted tokens but the corrected one
            stats.wasted_passes += max(0, cache_length(kv) - keep)
            _truncate(kv, keep)
            thrown_s = spec_s
            steps, spec_s, passes, head, last_token = [], 0.0, 0, None, emitted[-1]
        gate.record(rnd.arm, (rnd.spec_s + rnd.beside_s + time.perf_counter() - t + thrown_s) / len(emitted),
                    len(emitted))
        out, finish = cut_emitted(emitted, max_new - n_out, eos)
        n_out += len(out)
        stats.tokens = n_out
        yield Emit(out, finish)
        if finish:
            return


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
