"""Iterative retrieval-augmented generation: RaLMSeq (In-Context RALM) and RaLMSpec, which gives the same
output faster by retrieving speculatively from a per-request cache and verifying in batches.

RaLMSeq, one step per `stride` (k = 4) tokens:
    query = the last 32 tokens of prompt + output -> KB top-1 -> model input = passage (<= 256 tokens) + prompt
    (+ passage <= 512) + output -> generate the next k tokens greedily.
  The passage is prepended, so a new passage invalidates every KV row; while it stays the same the KV cache of
  the whole prefix is kept and the step only decodes (`reuse_kv`; stats count prefill tokens with and without).
  The caches of the last `revisit_passages` passages left behind are kept too: a step that returns to one (27 of
  136 passage changes did, 1 M passages) prefills only the output written since, not passage + prompt again.
RaLMSpec, rounds of s speculative steps:
    speculate    rank the cached passages for the step's query with the retriever's own scoring (ralm/cache.py)
                 and generate the step with the cache's top-1, checkpointing the model state before it
    verify       one batched Search with the round's s queries (sync: after the round; async: a gRPC future
                 started with the round's last step, which runs while it is in flight and is cut short as soon
                 as the answer says it is wrong)
    settle       find the first step whose speculated passage is not the KB's top-1, restore the checkpoint
                 taken before it (KV cache, tokens, random stream), generate that step with the true passage;
                 add the hits (top-`prefetch` of every query) to the cache
    OS³          picks s from the measured speculation accuracy and step/verification latencies (augment/os3.py)
    gate         beyond the paper, every round is one of sequential (s = 0) / sync / async, whichever costs
                 least per committed step as measured (augment/round_gate.py; pooled over a worker's requests, which
                 also share one probe schedule): where retrieval is cheap
                 a wrong guess throws away more generation than speculation saves, and where the KB shares the
                 model's cores an async verification slows the step it overlaps.
    sequential   a step of RaLMSpec without speculation (the first one, s = 0, after a KB failure) waits only for
                 RaLMSeq's own Search (same query, same top-1); when the next round may speculate, that Search
                 asks for the top-`prefetch` to fill the cache (a little more than top-1, where a second search
                 beside the step slowed its forward passes badly on a small machine).
Every committed step ran with the passage RaLMSeq would have retrieved and the same model computation (same KV
reuse decisions, same kernels), so the output is identical; only committed tokens are ever emitted. If the KB
fails during speculation the unverified steps are dropped and the request continues with sequential retrieval;
if that fails too the request fails with KBUnavailable (UNAVAILABLE), never with a wrong answer.

    for chunk in ralm_stream(tm, prompt_ids, SamplingParams(max_new_tokens=128), RagParams(retriever="edr"), r):
        ...  # r: a Retriever (ralm_retrieval.KBRetriever); the last chunk carries stats and rag_stats
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from generation_service.augment.round import run_rounds
from generation_service.augment.round_gate import (
    MIN_SEARCH_SHARE,
    SharedRoundCosts,
)
from generation_service.engine.effects import Effects, Emit, ar_pass, call, prefill_passes, run_inline, run_solo
from generation_service.engine.passage_rows import passage_budget
from generation_service.engine.speculative import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    SpeculationStats,
    StreamChunk,
    stream_tokenizer,
    text_chunks,
)
from generation_service.engine.steps import check_prompt
from generation_service.model.sampling import Sampler, SamplingParams
from generation_service.model.target import TargetModel, cache_length, new_cache
from generation_service.ralm.retrieval import Retriever
from generation_service.ralm.rounds import RagRounds, passage_effects
from ragcore.errors import InvalidArgument
from ragcore.wire import clip

RETRIEVERS = ("edr", "adr", "sr")
ENCODERS = ("server", "local")
MAX_PREFETCH = 256


def _int_in(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise InvalidArgument(f"rag.{name}", f"must be an integer in [{lo}, {hi}], got {value!r}")


@dataclass(frozen=True)
class RagParams:
    """One RAG request's knobs. Defaults: the paper's setting, RaLMSpec with every component (P, S, A)."""

    retriever: str = "edr"  # edr (exact dense) | adr (HNSW) | sr (BM25)
    stride: int = 4  # k: tokens generated per retrieval
    query_tokens: int = 32  # query = the last N tokens of prompt + output
    max_passage_tokens: int = 256
    max_prompt_tokens: int = 512  # passage + prompt
    speculate: bool = True  # RaLMSpec; False = RaLMSeq
    prefetch: int = 20  # hits cached per verified query (and per sequential step's search); 0 = top-1
    os3: bool = True  # OS³ picks the speculation stride; off = fixed spec_stride
    spec_stride: int = 3
    async_verify: bool = True
    encoder: str = "server"  # dense queries encoded by the KB (server) or in the worker (local)
    reuse_kv: bool = True  # keep the KV cache while the passage stays the same
    # With reuse_kv: earlier passages whose KV caches are kept (least recently used out), so that returning to one
    # prefills only the output since; each costs a cache of passage + prompt + output (job_kv_rows reserves it).
    revisit_passages: int = 2
    ef_search: int = 0  # adr: efSearch for every call of the request; 0 = ralm_retrieval.ADR_EF_SEARCH
    cache_capacity: int = 512
    os3_window: int = 5
    # Cap on OS³'s accuracy estimate. A low cap such as 0.6 held strides at 2 where guesses were mostly right, and
    # speculation gained less over RaLMSeq than with 0.9 (bench.ralm).
    gamma_max: float = 0.9
    s_max: int = 16
    # Each round's kind (sequential s = 0 / sync / async) by measured cost (augment/round_gate.py); False = every round
    # as configured (tests of the mechanics pin it).
    adaptive: bool = True
    # Searches under this share of a sequential step: RaLMSeq's steps only (ralm_gate.MIN_SEARCH_SHARE); 0 = the
    # measured costs always decide (tests on small KBs, where every search is cheap).
    min_search_share: float = MIN_SEARCH_SHARE

    def __post_init__(self) -> None:
        if self.retriever not in RETRIEVERS:
            raise InvalidArgument("rag.retriever", f"{clip(self.retriever)} is not one of {', '.join(RETRIEVERS)}")
        if self.encoder not in ENCODERS:
            raise InvalidArgument("rag.encoder", f"{clip(self.encoder)} is not one of {', '.join(ENCODERS)}")
        _int_in("stride", self.stride, 1, 256)
        _int_in("query_tokens", self.query_tokens, 1, 4096)
        _int_in("max_passage_tokens", self.max_passage_tokens, 0, 8192)
        _int_in("max_prompt_tokens", self.max_prompt_tokens, 1, 1 << 20)
        _int_in("prefetch", self.prefetch, 0, MAX_PREFETCH)
        _int_in("spec_stride", self.spec_stride, 1, 64)
        _int_in("ef_search", self.ef_search, 0, 1 << 16)
        _int_in("cache_capacity", self.cache_capacity, 1, 1 << 16)
        _int_in("os3_window", self.os3_window, 1, 1024)
        _int_in("revisit_passages", self.revisit_passages, 0, 64)
        _int_in("s_max", self.s_max, 1, 64)
        if not (isinstance(self.gamma_max, (int, float)) and 0.0 <= self.gamma_max <= 1.0):
            raise InvalidArgument("rag.gamma_max", f"must lie in [0, 1], got {self.gamma_max!r}")
        if not (isinstance(self.min_search_share, (int, float)) and 0.0 <= self.min_search_share <= 1.0):
            raise InvalidArgument("rag.min_search_share", f"must lie in [0, 1], got {self.min_search_share!r}")
        for name in ("speculate", "os3", "async_verify", "reuse_kv", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"rag.{name}", f"must be a bool, got {getattr(self, name)!r}")

    @property
    def mode(self) -> str:
        return "ralmspec" if self.speculate else "ralmseq"

    @property
    def round_key(self) -> tuple:
        """What shapes a round's cost besides the request: the key its costs are pooled under in a worker."""
        return (self.retriever, self.stride, self.os3, self.spec_stride, self.async_verify, self.prefetch > 1,
                self.encoder, self.ef_search)


@dataclass
class RagStats:
    """Per-request RAG statistics; field names and units (ms) match proto RagStats."""

    mode: str = "ralmseq"
    retriever: str = ""
    retrieval_ms: float = 0.0  # R: retrieval on the critical path (query encoding, searches, cache ranking,
    #                            waiting for verification, passage texts)
    generation_ms: float = 0.0  # G: model forward passes, including work later thrown away
    kb_calls: int = 0
    retrievals: int = 0  # retrieval points of the committed output (steps)
    speculative_steps: int = 0  # speculated steps that were verified
    speculation_hits: int = 0  # ... whose speculated passage was the KB's top-1
    strides: list[int] = field(default_factory=list)  # per round; 0 = a sequential step
    rollbacks: int = 0
    wasted_generation_ms: float = 0.0  # generation of steps rolled back or cut short
    prefill_tokens: int = 0
    prefills: int = 0
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    cache_size: int = 0
    fallback: bool = False  # the KB failed during speculation; the rest ran with sequential retrieval
    fallback_reason: str = ""
    prefetches: int = 0  # sequential steps that also fetched the top-k_fetch into the cache (one search)
    # R split: sequential steps (RaLMSeq's search) + speculative ranking (query, cache top-1, passage, starting an
    # async verification) + waiting for verifications (and a mismatched step's passage) = retrieval_ms
    sequential_retrieval_ms: float = 0.0
    speculation_retrieval_ms: float = 0.0
    verification_wait_ms: float = 0.0
    held_changes: int = 0  # guessed passage changes not acted on: verified first (ralm_gate.hold_change)
    held_change_hits: int = 0  # ... whose guess was the KB's passage
    revisits: int = 0  # prefills that took up an earlier passage's kept KV rows (only the output since)
    in_order_verifications: int = 0  # sync verifications asked one query at a time (round_gate.in_order_pays)

    @property
    def speculation_accuracy(self) -> float:
        return self.speculation_hits / self.speculative_steps if self.speculative_steps else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["speculation_accuracy"] = self.speculation_accuracy
        return d


@dataclass
class RagChunk(StreamChunk):
    rag_stats: RagStats | None = None  # final chunk only


# ---------------------------------------------------------------------------------------------------------------
# Model side: one step = k tokens with a given passage; checkpoints for rollback.


def decode_one(tm: TargetModel, cache, token: int) -> torch.Tensor:
    """Feed one token (not yet in the cache) -> logits [V] of the next position; the cache grows by one row.

    The AR step of every decoding loop (effects.ar_pass: pad rows in bf16 included), run alone.
    """
    return run_inline(tm, ar_pass(tm, cache, token))[0]


@dataclass
class Checkpoint:
    n_out: int  # output tokens before the step
    cache: object  # the KV cache object then (a later re-prefill makes a new one; this one is kept intact)
    cache_len: int
    cache_doc: object
    rng_state: dict
    draws: int
    generation_ms: float  # stats.generation_ms then (to measure the generation a rollback throws away)
    prefill_ms: float  # stats.prefill_ms then (the part of it that was prefill)
    kept: tuple = ()  # (doc, cache, rows) of the earlier passages' caches then, least recently used first


class StepRunner:
    """The model input is passage + prompt + output; `last` (= out[-1]) is never in the KV cache between steps."""

    def __init__(self, tm: TargetModel, prompt: np.ndarray, params: SamplingParams, rag: RagParams,
                 stats: RagStats):
        self.tm, self.prompt, self.params, self.rag, self.stats = tm, prompt, params, rag, stats
        self.sampler = Sampler(params)
        self.eos = frozenset() if params.ignore_eos else tm.eos_token_ids
        self.out: list[int] = []
        self.cache = None
        self.cache_doc: object = None
        # doc -> the KV cache of an earlier passage (rows: passage + prompt + the output then), least recent first
        self.kept: OrderedDict[object, object] = OrderedDict()
        self.finish: str | None = None

    def window(self) -> np.ndarray:
        """The last query_tokens tokens of prompt + output -> int64 [<= query_tokens]."""
        q = self.rag.query_tokens
        tail = self.out[-q:]
        head = self.prompt[max(0, len(self.prompt) - (q - len(tail))):] if len(tail) < q else self.prompt[:0]
        return np.concatenate([head.astype(np.int64), np.asarray(tail, np.int64)])

    def checkpoint(self) -> Checkpoint:
        rng = self.sampler._rng.bit_generator
        return Checkpoint(len(self.out), self.cache, cache_length(self.cache) if self.cache is not None else 0,
                          self.cache_doc, rng.state, self.sampler.draws, self.stats.generation_ms,
                          self.stats.prefill_ms, tuple((d, c, cache_length(c)) for d, c in self.kept.items()))

    def restore(self, ck: Checkpoint) -> None:
        del self.out[ck.n_out:]
        self.cache, self.cache_doc = ck.cache, ck.cache_doc
        if self.cache is not None:
            _crop_to(self.cache, ck.cache_len)
        # A kept cache taken up again after the checkpoint grew from its rows then; an evicted one is back.
        self.kept = OrderedDict((d, c) for d, c, _ in ck.kept)
        for _, c, rows in ck.kept:
            _crop_to(c, rows)
        self.sampler._rng.bit_generator.state = ck.rng_state
        self.sampler.draws = ck.draws
        self.finish = None

    def step(self, doc: int | None, passage: list[int], abort: Callable[[], bool] | None = None) -> bool:
        """step_passes alone (each pass a forward pass of its own)."""
        return run_inline(self.tm, self.step_passes(doc, passage, abort))

    def step_passes(self, doc: int | None, passage: list[int], abort: Callable[[], bool] | None = None) -> Effects:
        """Generate up to `stride` tokens with `passage` (the tokens of doc) prepended, as effects. Returns False if
        `abort` said stop (checked before every forward pass; the caller then restores a checkpoint)."""
        n = min(self.rag.stride, self.params.max_new_tokens - len(self.out))
        t0 = time.perf_counter()
        try:
            for i in range(n):
                if abort is not None and abort():
                    return False
                if i == 0 and not (self.rag.reuse_kv and self.cache is not None and self.cache_doc == doc):
                    kept = self._switch(doc, len(passage))
                    if kept is not None:  # this passage's rows and the output's up to out[:j]: the rest
                        self.cache, self.cache_doc = kept
                        self.stats.revisits += 1
                        ids = np.asarray(self.out[cache_length(kept[0]) - len(passage) - len(self.prompt):],
                                         np.int64)
                    else:
                        ids = np.concatenate([np.asarray(passage, np.int64), self.prompt.astype(np.int64),
                                              np.asarray(self.out, np.int64)])  # [P] passage + prompt + output
                        self.cache, self.cache_doc = new_cache(self.tm), doc
                    t1 = time.perf_counter()
                    logits, _ = yield from prefill_passes(self.tm, self.cache,
                                                          torch.from_numpy(ids).to(self.tm.device))  # [V]
                    self.stats.prefill_ms += (time.perf_counter() - t1) * 1e3
                    self.stats.prefill_tokens += int(ids.shape[0])
                    self.stats.prefills += 1
                else:
                    logits, _ = yield from ar_pass(self.tm, self.cache, self.out[-1])  # [V]
                    self.stats.decode_tokens += 1
                token = self.sampler.pick(logits)
                if token in self.eos:
                    self.finish = FINISH_STOP
                    return True
                self.out.append(token)
            if len(self.out) >= self.params.max_new_tokens:
                self.finish = FINISH_LENGTH
            return True
        finally:
            self.stats.generation_ms += (time.perf_counter() - t0) * 1e3

    def _switch(self, doc: object, passage_len: int) -> tuple[object, object] | None:
        """Leave the current passage for `doc`: keep the current cache (least recently used out beyond
        rag.revisit_passages) and take doc's kept cache -> (cache, doc), or None: prefill from scratch."""
        if not self.rag.reuse_kv or self.rag.revisit_passages == 0:
            return None
        if self.cache is not None:
            self.kept.pop(self.cache_doc, None)
            self.kept[self.cache_doc] = self.cache
        cache = self.kept.pop(doc, None)
        while len(self.kept) > self.rag.revisit_passages:
            self.kept.popitem(last=False)
        if cache is None:
            return None
        done = cache_length(cache) - passage_len - len(self.prompt)  # output tokens in its rows
        # Its rows end before the last output token (`last` is never cached): something is always left to feed.
        return (cache, doc) if 0 <= done < len(self.out) else None


def _crop_to(cache, rows: int) -> None:
    """Cut `cache` back to `rows` rows (those before were never modified since they were written)."""
    extra = cache_length(cache) - rows
    if extra > 0:
        cache.crop(-extra)


# ---------------------------------------------------------------------------------------------------------------
# The loops: token level, yield (committed tokens, finish reason or None).


def _check_rag_prompt(tm: TargetModel, prompt: np.ndarray, params: SamplingParams, rag: RagParams) -> None:
    if prompt.shape[0] > rag.max_prompt_tokens:
        raise InvalidArgument("rag.max_prompt_tokens", f"the prompt has {prompt.shape[0]} tokens, more than "
                         f"{rag.max_prompt_tokens} (passage + prompt must fit)")
    total = prompt.shape[0] + passage_budget(prompt.shape[0], rag) + params.max_new_tokens
    if total > tm.max_positions:
        raise InvalidArgument("max_new_tokens", f"passage + prompt + max_new_tokens ({total}) exceeds the model's "
                         f"{tm.max_positions} positions")


class RagRequest:
    """One RAG request (RaLMSeq, or RaLMSpec when rag.speculate) as a decoding loop over effects
    (engine/effects.py): run alone by ralm_decode / ralm_stream, or beside other requests by the engine.

        req = RagRequest(tm, prompt_ids, params, rag, retriever)   # InvalidArgument for a bad request
        for tokens, finish in run_solo(tm, req.effects()): ...
        chunk = req.final_chunk(finish, ids, text, n_tokens, total_ms)
    """

    chunk = RagChunk  # its text chunks

    def __init__(self, tm: TargetModel, prompt_ids, params: SamplingParams, rag: RagParams, retriever: Retriever, *,
                 stats: RagStats | None = None, is_cancelled: Callable[[], bool] | None = None,
                 round_costs: SharedRoundCosts | None = None):
        self.prompt = check_prompt(tm, prompt_ids, params)
        self.round_costs = round_costs  # the worker's pooled round costs (RaLMSpec), if it keeps them
        _check_rag_prompt(tm, self.prompt, params, rag)
        self.rag, self.retriever = rag, retriever
        self.stats = stats if stats is not None else RagStats()
        self.stats.mode, self.stats.retriever = rag.mode, rag.retriever
        self.runner = StepRunner(tm, self.prompt, params, rag, self.stats)
        self.cancelled = is_cancelled or (lambda: False)

    def effects(self) -> Effects:
        """The loop: effects, Emit(newly committed tokens, finish reason); the last Emit carries the reason (stop,
        length, cancelled). Raises KBUnavailable if retrieval fails with nothing to fall back on."""
        calls0 = self.retriever.calls
        try:
            if self.rag.speculate:
                yield from _speculative(self.runner, self.retriever, self.rag, self.stats, self.cancelled,
                                        self.round_costs)
            else:
                yield from _sequential(self.runner, self.retriever, self.rag, self.stats, self.cancelled)
        finally:
            self.stats.kb_calls = self.retriever.calls - calls0

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> "RagChunk":
        # Retrieval time is rag_stats.retrieval_ms (a RAG request drafts nothing: draft_ms stays 0).
        r = self.stats
        stats = SpeculationStats(decoding=self.rag.mode, prefill_ms=r.prefill_ms, verify_ms=r.generation_ms,
                                 total_ms=total_ms, forward_steps=r.prefills + r.decode_tokens)
        return RagChunk(ids, text, finish_reason=finish, stats=stats, prompt_tokens=len(self.prompt),
                        completion_tokens=n_tokens, rag_stats=r)


def ralm_decode(tm: TargetModel, prompt_ids, params: SamplingParams, rag: RagParams, retriever: Retriever, *,
                stats: RagStats | None = None, is_cancelled: Callable[[], bool] | None = None,
                round_costs: SharedRoundCosts | None = None) -> Iterator[tuple[list[int], str | None]]:
    """RaLMSeq or RaLMSpec (rag.speculate) alone, at token level: yields (newly committed output tokens, finish
    reason); the last item carries the finish reason (stop, length, cancelled). Raises KBUnavailable if retrieval
    fails with nothing to fall back on."""
    req = RagRequest(tm, prompt_ids, params, rag, retriever, stats=stats, is_cancelled=is_cancelled,
                     round_costs=round_costs)
    yield from run_solo(tm, req.effects())


def _sequential(runner: StepRunner, retr: Retriever, rag: RagParams, stats: RagStats,
                cancelled: Callable[[], bool]) -> Effects:
    prev: int | None = None  # passage of the previous step (a blank query keeps it)
    while runner.finish is None:
        if cancelled():
            yield Emit([], FINISH_CANCELLED)
            return
        t0 = time.perf_counter()
        q = retr.query(runner.window())
        doc = prev if q is None else (yield call(retr.search, [q], 1, sequential=True))[0].top1
        passage = yield from passage_effects(retr, doc)
        stats.retrieval_ms += (time.perf_counter() - t0) * 1e3
        stats.retrievals += 1
        start = len(runner.out)
        yield from runner.step_passes(doc, passage)
        prev = doc
        yield Emit(runner.out[start:], runner.finish)


def _speculative(runner: StepRunner, retr: Retriever, rag: RagParams, stats: RagStats,
                 cancelled: Callable[[], bool], round_costs: SharedRoundCosts | None = None) -> Effects:
    """RaLMSpec: the shared speculation round (augment/round.py) with RagRounds as its policy (ralm/rounds.py)."""
    yield from run_rounds(RagRounds(runner, retr, rag, stats, cancelled, round_costs))


# ---------------------------------------------------------------------------------------------------------------
# Text level.




def ralm_stream(tm: TargetModel, prompt_ids, params: SamplingParams, rag: RagParams, retriever: Retriever, *,
                is_cancelled: Callable[[], bool] | None = None, tokenizer="model",
                round_costs: SharedRoundCosts | None = None) -> Iterator[RagChunk]:
    """Stream committed output (about one chunk per step or round); the final chunk has finish_reason, stats
    (decoding = ralmseq | ralmspec) and rag_stats. tokenizer: "model" = tm.tokenizer, None = ids only."""
    t0 = time.perf_counter()
    tok = stream_tokenizer(tm, tokenizer, params)
    req = RagRequest(tm, prompt_ids, params, rag, retriever, is_cancelled=is_cancelled, round_costs=round_costs)
    finish, ids, delta, n_tokens = yield from text_chunks(run_solo(tm, req.effects()), tok, prompt_ids,
                                                          params.stop, RagChunk)
    yield req.final_chunk(finish, ids, delta, n_tokens, (time.perf_counter() - t0) * 1e3)
