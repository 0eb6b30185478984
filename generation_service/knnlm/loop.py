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
import math
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass, field, replace
from typing import Callable, Iterator, Sequence

import grpc
import numpy as np
import torch

from generation_service.augment.kb_client import KBClient, KBUnavailable, parse_search
from generation_service.augment.os3 import OS3Config, StrideScheduler
from generation_service.augment.round_gate import (
    ASYNC,
    MIN_SEARCH_SHARE,
    SEQUENTIAL,
    SYNC,
    RoundGate,
    SharedRoundCosts,
    async_by_default,
)
from generation_service.engine.effects import (
    Effects,
    Emit,
    Wait,
    ar_pass,
    call,
    prefill_passes,
    run_inline,
    run_solo,
)
from generation_service.engine.speculative import (
    FINISH_CANCELLED,
    SpeculationStats,
    StreamChunk,
    cut_emitted,
    stream_tokenizer,
    text_chunks,
)
from generation_service.engine.steps import check_prompt
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import TargetModel, cache_length, new_cache
from ragcore.errors import FailedPrecondition, InvalidArgument, Unavailable
from ragcore.knn_store import KnnDatastore, open_datastore
from ragcore.model_files import tokenizer_identity
from ragcore.wire import clip

log = logging.getLogger(__name__)

RETRIEVERS = ("edr", "adr")
MAX_K = 1024
MAX_STRIDE = 64
# Weight of the old average of a step's time alone (no Search in flight) per new such step.
ALONE_DECAY = 0.8
F16_DOT_MAX = 16384.0  # |q·key| bound a float16 look-up scales to (float16's largest finite is 65504)
# OS³ for kNN-LM. γ̂ cap: RaLMSpec's 0.6 suits document-level retrieval, but the next token is more predictable
# from cached successor entries (per-step accuracy 0.8-0.97 measured on the 1 M-entry docs datastore), and a cap
# of 0.6 made OS³ pick strides 3-5 where 8 was 25 % faster; 0.9 let two lucky early rounds jump to 16 and roll
# back most of it. First stride 4, not 1: with a verification costing ~8 LM passes, warm-up rounds of one step
# each cost more than a wrong first guess does.
KNN_GAMMA_MAX = 0.8
KNN_OS3 = OS3Config(gamma_max=KNN_GAMMA_MAX, s_init=4, overlap="round")  # async: the whole next round overlaps
# Rounds of each kind a worker measures before its round gate picks the cheapest (RoundGate's explore). With one,
# served on the Zen 4 (1 M keys, k = 1024), one unlucky first round (a wrong early guess throws most of a round
# away) kept a stride-4 worker on baseline steps for all of its next 4 requests (1.01x the base).
KNN_GATE_EXPLORE = 3
# RoundGate's far_behind for kNN-LM: none. An arm's early rounds (short OS³ strides, a cold cache) cost 2-3x its
# later ones, so a sync arm measured at 0.07 s per token in a worker's first request was never probed again while
# async rounds at 0.03-0.05 won for 80 rounds; sync rounds measured later ran at 0.025. A kNN-LM round is
# ~0.1-0.2 s, so a probe of the losing arm is cheap.
KNN_GATE_FAR_BEHIND = math.inf


@dataclass(frozen=True)
class KnnLmOptions:
    """Per-request kNN-LM settings (proto KnnLmOptions; zero/unset wire fields take these defaults)."""

    retriever: str = "edr"  # edr = exact (faiss IndexFlatL2) | adr = HNSW
    k: int = 1024  # neighbours per query, 1..1024 and at most the datastore size
    lam: float = 0.25  # λ, weight of p_kNN
    temperature: float = 10.0  # T of the softmax over −‖q − key‖² (squared distances here are ~10²..10³)
    # RaLMSpec (the default, as for RAG: the tokens are the baseline's and the round gate runs baseline steps where
    # speculation does not pay); False = the baseline: one Search per token.
    speculate: bool = True
    stride: int = 0  # speculation steps per verification; 0 = OS³
    # Speculate the next round while the verification Search is in flight. Default: only on a worker with
    # ASYNC_MIN_CORES usable cores (async_by_default).
    async_verify: bool = field(default_factory=async_by_default)
    # Each round's kind (async / sync / a baseline step) by measured cost per emitted token (ralm_gate.RoundGate,
    # pooled over the worker's requests); False = every round as async_verify says. Not on the wire.
    adaptive: bool = True
    # Below this share of a baseline step's time in its Search, the gate runs baseline steps only (ralm_gate's
    # MIN_SEARCH_SHARE: speculation can at most hide the Search). 0 = always weigh every kind. Not on the wire.
    min_search_share: float = MIN_SEARCH_SHARE
    cache_next: int = 10  # n: datastore entries after each retrieved one that enter the cache
    cache_capacity: int = 8192  # cached entries kept (most recently filled first)
    # Successors of each query's best m neighbours enter the cache (0 = of all k). Why not all k: a guess is decided
    # by the closest neighbours (softmax over −‖q − key‖² / T), and a fill of every neighbour's successors (~10^4
    # rows) cost ~3 ms a round, a look-up over 16 K entries 0.6 ms. See the README's kNN-LM limits for the replay
    # and the served A/B that chose m = 64 in 8,192 entries.
    cache_fill_top: int = 64
    ef_search: int = 0  # adr: HNSW efSearch (0 = server default; raised to k + margin by the service)

    def __post_init__(self) -> None:
        if self.retriever not in RETRIEVERS:
            raise InvalidArgument("retriever", f"{clip(self.retriever)} is not one of {', '.join(RETRIEVERS)}")
        _check_int("k", self.k, 1, MAX_K)
        if not (isinstance(self.lam, (int, float)) and 0.0 <= float(self.lam) <= 1.0):
            raise InvalidArgument("lambda", f"{self.lam!r} is outside [0, 1]")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise InvalidArgument("temperature", f"{self.temperature!r} must be a finite number > 0")
        _check_int("stride", self.stride, 0, MAX_STRIDE)
        _check_int("cache_next", self.cache_next, 1, 64)
        _check_int("cache_capacity", self.cache_capacity, 1, 1 << 20)
        _check_int("cache_fill_top", self.cache_fill_top, 0, MAX_K)
        _check_int("ef_search", self.ef_search, 0, 1 << 16)
        if not isinstance(self.adaptive, bool):
            raise InvalidArgument("adaptive", f"{self.adaptive!r} is not a bool")
        if not (isinstance(self.min_search_share, (int, float)) and 0.0 <= self.min_search_share <= 1.0):
            raise InvalidArgument("min_search_share", f"{self.min_search_share!r} is outside [0, 1]")

    @property
    def mode(self) -> str:
        """The name stats and benchmarks use: base | s<stride> | os3, + "-sync" without async verification."""
        if not self.speculate:
            return "base"
        return ("os3" if self.stride == 0 else f"s{self.stride}") + ("" if self.async_verify else "-sync")


def _check_int(name: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}", f"{value!r} is outside [{lo}, {hi}]")


@dataclass
class KnnLmStats:
    """Per-request kNN-LM statistics (proto KnnLmStats). R = retrieval, G = generation (LM passes)."""

    mode: str = "base"
    retriever: str = ""
    k: int = 0
    tokens: int = 0
    retrieval_ms: float = 0.0  # R: Search calls (wall, gRPC included) + true next-token distributions
    generation_ms: float = 0.0  # G: single-token LM passes after prefill
    speculation_ms: float = 0.0  # cache look-ups, speculative distributions and cache fills
    prefill_ms: float = 0.0
    kb_calls: int = 0
    kb_queries: int = 0
    speculated: int = 0  # speculation steps that were verified
    correct: int = 0  # ... whose token was right
    speculation_accuracy: float = 0.0
    verifications: int = 0
    rollbacks: int = 0  # verifications that found a wrong step
    wasted_passes: int = 0  # LM passes on speculated tokens that were thrown away
    overlapped: int = 0  # speculation steps run while a verification Search was in flight (async)
    strides: list[int] = field(default_factory=list)  # steps of each verification in order; 0 = a baseline step
    cache_entries: int = 0  # cache size at the end

    def as_dict(self) -> dict:
        """Keyword arguments for generation_pb2.KnnLmStats(**stats.as_dict())."""
        return asdict(self)


# ---------------------------------------------------------------------------------------------------- math


def knn_distribution(scores: np.ndarray, values: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """scores: float [k] (−squared distance, higher = closer), values: int [k] -> (tokens int64 [u] ascending,
    probs float64 [u]) = softmax(scores / T) summed per value.

    knn_distribution([0, -ln 3], [2, 4], 1.0) -> ([2, 4], [0.75, 0.25])   # not [0.5, 0.5]: closer weighs more
    """
    if len(scores) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    z = np.asarray(scores, dtype=np.float64) / temperature  # [k]
    w = np.exp(z - z.max())
    w /= w.sum()
    tokens, inverse = np.unique(np.asarray(values, dtype=np.int64), return_inverse=True)  # [u], [k]
    return tokens, np.bincount(inverse, weights=w, minlength=tokens.size)


def interpolate(lm_logits: torch.Tensor, tokens: np.ndarray, probs: np.ndarray, lam: float) -> np.ndarray:
    """lm_logits: [V], (tokens [u], probs [u]) from knn_distribution -> p float64 [V] = λ·p_kNN + (1 − λ)·p_LM.
    No neighbours (tokens empty): p = (1 − λ)·p_LM, whose argmax is the LM's.

    In numpy on the calling thread, not torch: torch splits ops over more than 32 K elements across its OpenMP
    team, whose threads then spin ~2 ms (GOMP_SPINCOUNT) on the cores that the next LM pass and Search need.
    Served on a 2-core Zen 5 (bench.knnlm --serve, 12 requests x 48 tokens, k = 1024, new / old alternated 4
    times) the baseline took 0.70 / 0.73 / 0.83 / 0.70 s per request against 0.89 / 0.80 / 0.82 / 0.78 with
    torch's softmax here (mean 0.90x), OS³ sync 0.59 / 0.63 / 0.68 / 0.60 against 0.72 / 0.69 / 0.68 / 0.63
    (0.92x)."""
    lg = lm_logits.detach().cpu()
    if lg.dtype not in (torch.float32, torch.float64):
        lg = lg.float()
    p = lg.numpy().astype(np.float64)  # [V], a copy
    p -= p.max()
    np.exp(p, out=p)
    p /= p.sum()
    p *= 1.0 - lam
    if tokens.size:
        p[tokens] += probs * lam  # tokens are unique (knn_distribution)
    return p


def next_token(p: np.ndarray) -> int:
    """Greedy pick; ties go to the smallest token id (np.argmax returns the first maximum)."""
    return int(np.argmax(p))


def mixed_distribution(lm_logits: torch.Tensor, scores: np.ndarray, values: np.ndarray,
                       opts: KnnLmOptions) -> np.ndarray:
    """lm_logits [V] + one query's neighbours (scores [k], values [k]) -> p float64 [V]."""
    tokens, probs = knn_distribution(scores, values, opts.temperature)
    return interpolate(lm_logits, tokens, probs, opts.lam)


# ------------------------------------------------------------------------------------------ local cache


_STAGING = threading.local()
NORM_ROWS = 2048  # rows per float32 temporary of squared_norms (4.7 MB at D = 576)


def _staging(rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A [rows, dim] buffer of this thread, kept between calls: a fill gathers its keys into it. Why: a fresh
    16 K x 576 array page-faults its 19 MB (float16) at every fill, ~7 ms. Per thread: caches fill on the
    engine's model thread, one at a time, so one buffer serves all its requests."""
    buf = getattr(_STAGING, "buf", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] != dim or buf.dtype != dtype:
        buf = _STAGING.buf = torch.empty((rows, dim), dtype=dtype)
    return buf[:rows]


def squared_norms(keys: torch.Tensor) -> np.ndarray:
    """keys float16|float32 [m, D] -> ‖key‖² float32 [m], summed in float32. In slices of NORM_ROWS: one float32
    copy of 16 K rows (38 MB) is fresh memory at every call, and faulting it in took 13 of its 15 ms."""
    out = np.empty(len(keys), np.float32)
    for i in range(0, len(keys), NORM_ROWS):
        rows = keys[i:i + NORM_ROWS]
        out[i:i + NORM_ROWS] = torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32).square_().numpy()
    return out


def oldest(stamp: np.ndarray, m: int) -> np.ndarray:
    """stamp: int [C] fill rounds (-1 = empty) -> m slot indices with the smallest stamps (among equal stamps,
    the first slots). Two passes over the few distinct rounds, not np.argpartition: the stamps take a handful of
    values, which made its selection ~1.8 ms per fill for 16 K slots.

    oldest([3, -1, 2, 3, 2], 3) -> [1, 2, 4]
    """
    rounds, counts = np.unique(stamp, return_counts=True)  # ascending
    if m >= stamp.size:
        return np.arange(stamp.size)
    t = int(np.searchsorted(np.cumsum(counts), m))  # the round where the m-th oldest slot falls
    below = np.flatnonzero(stamp < rounds[t])
    return np.concatenate((below, np.flatnonzero(stamp == rounds[t])[: m - below.size]))


def key_norms(ds: KnnDatastore) -> np.ndarray:
    """‖key‖² float32 [N] of every datastore entry, as squared_norms computes a fill's. Once per worker, at start:
    it reads every key once (1.15 GB for 1 M x 576 float16, usually in the page cache from the retrieval service;
    0.2 s on a Zen 5 core) and keeps 4 MB."""
    t = time.perf_counter()
    with warnings.catch_warnings():  # "not writable": only read
        warnings.simplefilter("ignore", UserWarning)
        out = squared_norms(torch.from_numpy(ds.keys))
    log.info("kNN-LM datastore %s: key norms of %d entries in %.1f s", ds.path, ds.size, time.perf_counter() - t)
    return out


class NeighbourCache:
    """RaLMSpec's kNN-LM cache: datastore entries (id, key, value) filled by spatial locality.

    fill(ids) adds entries j+1..j+n for every retrieved entry j (not j itself: j's value is the token that
    followed j's context, j+1 is the entry one token later). When full, the entries filled longest ago are
    replaced (an entry filled again counts as new). nearest(q, k) is the speculative retrieval: the k cached
    entries closest to q in L2, best first.

    fill_top = m keeps only the successors of the m best retrieved entries (a Search's order); 0 = of all.

    Storage is preallocated [capacity, D] and overwritten in place: with k = 1024, n = 10 and every neighbour a
    fill brings ~10^4 entries, and growing arrays by concatenation would copy the whole cache (~40 MB) on every
    token.
    Keys stay in the datastore's dtype. With float16 keys (the builder's default) a fill copies rows as they are
    and a look-up reads half the bytes. Replaying 6 requests' fills (4 queries each, k = 1024, 16 K x 576 keys,
    Zen 4, torch's 2 threads): a fill 16.6 -> 6.7 ms, a look-up 3.0-3.7 -> 1.2 ms (also: no copy of the filled
    slots while the cache is not full). The look-up's q·key is then rounded to float16 (~11 bits), which moved no
    guess: replaying 16 baseline trajectories x 63 steps, strides 4 and 8, the guesses' accuracy was 0.957 /
    0.949 in both precisions (the look-up only guesses; the Search decides).
    """

    def __init__(self, datastore: KnnDatastore, next_n: int = 10, capacity: int = 16384,
                 norms: np.ndarray | None = None, fill_top: int = 0):
        self.ds, self.next_n, self.capacity = datastore, next_n, capacity
        self.fill_top = fill_top  # successors of each query's `fill_top` best neighbours only (0 = of all)
        # ‖key‖² float32 [N] of every datastore entry (KnnBackend.key_norms), gathered at a fill; None = computed
        # from the filled rows.
        self._ds_norms = norms
        d = datastore.dim
        self.ids = np.full(capacity, -1, np.int64)  # [C] entry id per slot, -1 = empty
        half = datastore.keys.dtype == np.float16
        self.keys = torch.zeros((capacity, d), dtype=torch.float16 if half else torch.float32)  # [C, D]
        self.norms = np.zeros(capacity, np.float32)  # [C] ‖key‖² (from the stored key, in float32)
        # Largest ‖key‖ cached: bounds |q·key| so a float16 product can be scaled below float16's overflow.
        self._max_norm = 0.0
        self._keys = self.keys.numpy()  # the same memory, for numpy's row writes
        with warnings.catch_warnings():  # "not writable": this view is only read
            warnings.simplefilter("ignore", UserWarning)
            self._ds_keys = torch.from_numpy(datastore.keys)
        self.values = np.zeros(capacity, np.int64)  # [C]
        self.stamp = np.full(capacity, -1, np.int64)  # [C] fill round (-1 = empty), for eviction
        # [N] slot of each datastore entry, -1 = not cached: membership by one gather instead of np.isin over the
        # whole cache at every fill (4 MB per request for 1 M entries, allocated at the first fill).
        self._slot_of: np.ndarray | None = None
        self._round = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def cached_ids(self) -> np.ndarray:
        """The entry ids in the cache, ascending (for tests and stats)."""
        return np.sort(self.ids[self.ids >= 0])

    def successors(self, retrieved: np.ndarray) -> np.ndarray:
        """retrieved: entry ids [m] -> unique ids j+1..j+n inside the datastore, ascending.

        successors([5, 6]) with n = 3 -> [6, 7, 8, 9]   # not [5, 6, ...]: a retrieved entry is not its own successor
        """
        # The union of the runs [j+1, j+n] as pieces of consecutive ids, not np.unique over all m * n of them
        # (0.9 vs 0.06 ms for 1024 neighbours, n = 10: 4 per 8-query round before fill_many stopped early).
        start = np.sort(np.asarray(retrieved, dtype=np.int64)) + 1  # [m] run starts, ascending
        end = np.minimum(start + self.next_n, self.ds.size)  # [m] exclusive, clipped at the datastore's end
        keep = start < end
        start, end = start[keep], end[keep]
        if start.size == 0:
            return np.zeros(0, np.int64)
        new_piece = np.ones(start.size, bool)
        new_piece[1:] = start[1:] > np.maximum.accumulate(end)[:-1]  # touches no earlier run
        first = np.flatnonzero(new_piece)
        lo, hi = start[first], np.maximum.reduceat(end, first)  # [p] pieces [lo, hi)
        lengths = hi - lo
        before = np.concatenate(([0], np.cumsum(lengths)[:-1]))  # ids of earlier pieces
        return np.repeat(lo - before, lengths) + np.arange(lengths.sum())

    def fill(self, retrieved: np.ndarray) -> int:
        """Add the successors of one query's retrieved entries; returns how many entries were new."""
        return self.fill_many([retrieved])

    def _wanted(self, retrieved: Sequence[np.ndarray]) -> np.ndarray:
        """Successor ids of several queries, latest query first, unique, at most `capacity` of them (ascending
        within each query). Stops at the query that fills the cache: with k = 1024, n = 10 and every neighbour one
        query brings ~10^4 entries, so the older queries of a long round would only be sorted to be dropped."""
        taken = np.zeros(0, np.int64)  # sorted union so far
        runs: list[np.ndarray] = []
        n = 0
        for r in reversed(retrieved):
            succ = self.successors(r[: self.fill_top] if self.fill_top else r)
            if n:
                succ = succ[~np.isin(succ, taken, assume_unique=True)]
            runs.append(succ[: self.capacity - n])
            n += len(runs[-1])
            if n >= self.capacity:
                break
            taken = np.sort(np.concatenate((taken, succ)))  # disjoint: succ holds only ids not taken
        return np.concatenate(runs) if runs else np.zeros(0, np.int64)

    def fill_many(self, retrieved: Sequence[np.ndarray]) -> int:
        """fill() for several queries' retrieved entries (in query order) as one update; returns how many entries
        were new. One datastore gather instead of one per query: consecutive queries' successors overlap heavily
        (entry j+1 is often the next query's neighbour). When they do not all fit, later queries' successors win,
        as with successive fills; within one query the lowest ids do."""
        self._round += 1
        succ = np.sort(self._wanted(retrieved))  # ascending ids read the memmap in order
        if succ.size == 0:
            return 0
        if self._slot_of is None:
            self._slot_of = np.full(self.ds.size, -1, np.int32)
        slot = self._slot_of[succ]
        known = slot >= 0
        self.stamp[slot[known]] = self._round  # refreshed: kept as long as new entries
        new = succ[~known]
        if new.size:
            # Slots: empty ones first, then the oldest fills (this round's refreshed entries are never evicted
            # while older ones remain, since their stamp is the largest).
            slots = oldest(self.stamp, new.size)
            old = self.ids[slots]
            self._size += int(np.count_nonzero(old < 0))
            self._slot_of[old[old >= 0]] = -1
            self._slot_of[new] = slots
            keys = _staging(new.size, self.keys.shape[1], self.keys.dtype)
            # [m, D], ascending ids: the memmap in order. torch's gather, not np.take: 1.3 vs 5.0 ms for 16 K rows.
            torch.index_select(self._ds_keys, 0, torch.from_numpy(new), out=keys)
            self.ids[slots] = new
            self._keys[slots] = keys.numpy()  # numpy's row writes: 1.0 ms where index_copy_ took 1.7
            # The datastore's norms when the cache has them: computing them took 1.4 of a 4.9 ms fill of ~14 K rows
            # (Zen 5, 1 M keys; with them 3.0 ms).
            norms = self._ds_norms[new] if self._ds_norms is not None else squared_norms(keys)
            self.norms[slots] = norms
            self._max_norm = max(self._max_norm, math.sqrt(float(norms.max())))
            self.values[slots] = np.asarray(self.ds.values[new], dtype=np.int64)
            self.stamp[slots] = self._round
        return int(new.size)

    def nearest(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """query: float32 [D] -> (ids [m], scores float32 [m] = −‖q − key‖², values [m]), m = min(k, len), best
        first (ties: smaller id). With float16 keys q·key is rounded to float16 (relative error ~2^-11), so
        entries closer than that may trade places: a guess, which the verification Search settles."""
        if self._size == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
        q = np.asarray(query, dtype=np.float32)
        dots = self._dots(q)  # [C] q·key, one GEMV instead of [C, D] differences
        scores = 2.0 * dots - self.norms - float(q @ q)
        if self._size < self.capacity:
            scores[self.ids < 0] = -np.inf
        m = min(k, self._size)
        part = torch.topk(torch.from_numpy(scores), m, sorted=False).indices.numpy()
        order = part[np.lexsort((self.ids[part], -scores[part]))]
        return self.ids[order], scores[order].astype(np.float32), self.values[order]

    def _dots(self, q: np.ndarray) -> np.ndarray:
        """q float32 [D] -> q·key float32 [C] over every slot (empty ones too)."""
        if self.keys.dtype == torch.float32:
            return self.keys.numpy() @ q  # numpy's GEMV: 1.0 ms where torch.mv took 3.1 (16 K x 576, Zen 4)
        # A power of two keeps q exact in float16's range and |q·key| <= ‖q‖·max‖key‖ below its overflow.
        shift = max(0, math.ceil(math.log2(max(float(np.linalg.norm(q)) * self._max_norm, 1.0) / F16_DOT_MAX)))
        q16 = torch.from_numpy(q * np.float32(2.0 ** -shift)).to(torch.float16)
        dots = torch.nn.functional.linear(q16[None], self.keys)[0].float()
        return dots.numpy() * np.float32(2.0 ** shift)


# ---------------------------------------------------------------------------------------- retrieval side


class KnnRetrievalError(Unavailable):
    """Search failed (service down, deadline, bad reply): the request fails (gRPC UNAVAILABLE)."""

    def __init__(self, why: str):
        super().__init__(f"kNN-LM retrieval failed: {why}")


class KnnSearchClient:
    """Batched vector Search over one named index through the worker's KnowledgeService client (kb_client)."""

    def __init__(self, target: str, index: str = "knnlm", *, timeout_ms: float = 10_000.0, token: str = "",
                 credentials: grpc.ChannelCredentials | None = None):
        self.kb = KBClient(target, timeout_ms=timeout_ms, token=token, credentials=credentials)
        self.target, self.index = target, index

    def search(self, queries: np.ndarray, k: int, retriever: str, ef_search: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """queries: float32 [B, D] -> per query (ids int64 [k'], scores float32 [k']), best first.
        KnnRetrievalError when the service cannot answer; KBRequestError (a bug or a server limit) propagates."""
        req = KBClient.search_request(retriever, k, vectors=queries, ef_search=ef_search, index=self.index)
        try:
            reply = parse_search(self.kb.call("Search", req))
        except KBUnavailable as e:
            raise KnnRetrievalError(str(e)) from None
        return self.hits(reply, len(queries))

    def hits(self, reply, n_queries: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A parsed SearchReply -> per query (ids, scores); KnnRetrievalError unless it answers every query."""
        if len(reply.hits) != n_queries:
            raise KnnRetrievalError(f"Search on {self.target}: {len(reply.hits)} results for {n_queries} queries")
        return [(h.ids, h.scores) for h in reply.hits]

    def search_async(self, queries: np.ndarray, k: int, retriever: str, ef_search: int = 0) -> "PendingSearch":
        """Start a batched Search and return at once; PendingSearch.result() waits for it."""
        fut = self.kb.search_async(retriever, k, vectors=queries, ef_search=ef_search, index=self.index)
        return PendingSearch(self, fut, np.asarray(queries, np.float32), k, retriever, ef_search)

    def index_info(self):
        """The service's VectorIndexInfo for our index, or None if it is not served there (KBUnavailable if down)."""
        return next((i for i in self.kb.info().indexes if i.name == self.index), None)

    def close(self) -> None:
        self.kb.close()


class PendingSearch:
    """A verification Search in flight (kb_client.SearchFuture on one replica). Once done(), settled() gives the
    hits, or None if that replica failed: then retry() asks again through KBClient.call, which fails over to the
    other replicas (a blocking call: a Call effect in the loop)."""

    def __init__(self, client: KnnSearchClient, future, queries: np.ndarray, k: int, retriever: str, ef_search: int):
        self.client, self.future, self.queries = client, future, queries
        self.k, self.retriever, self.ef_search = k, retriever, ef_search
        self.finished_at: float | None = None

    def done(self) -> bool:
        return self.future.done()

    def add_done_callback(self, fn) -> None:
        self.future.add_done_callback(lambda _f: fn(self))

    def settled(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Once done(): the hits (`finished_at` = the perf_counter time they arrived), None if the replica failed."""
        try:
            reply = self.future.result()
        except KBUnavailable:
            return None
        self.finished_at = self.future.finished_at or time.perf_counter()
        return self.client.hits(reply, len(self.queries))

    def retry(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The same Search again, failing over to the other replicas (blocking)."""
        hits = self.client.search(self.queries, self.k, self.retriever, self.ef_search)
        self.finished_at = time.perf_counter()
        return hits


@dataclass
class KnnBackend:
    """What kNN-LM needs besides the model: Search on the retrieval service + the datastore's values/keys."""

    datastore: KnnDatastore
    client: KnnSearchClient
    # OS³ state pooled over this backend's requests, per setting that shapes a round: a 48-token request has ~10
    # rounds, and learning γ and the latencies from s_init again in each one spent most of them (ralm_gate pools
    # RaLMSpec's the same way).
    _schedulers: dict[tuple, StrideScheduler] = field(default_factory=dict, repr=False)
    # The round gate's costs per kind of round, pooled the same way (ralm_gate.SharedRoundCosts).
    round_costs: SharedRoundCosts = field(default_factory=SharedRoundCosts, repr=False)
    # The service runs concurrent exact Searches of the index as one scan (its VectorIndexInfo, read by
    # verify_served): then concurrent kNN-LM requests already share what speculation would save (`crowded`).
    shared_scans: bool = False
    # ‖key‖² float32 [N] of every entry, for the speculation caches' fills (key_norms; None = per fill).
    key_norms: np.ndarray | None = field(default=None, repr=False)
    _active: int = field(default=0, repr=False)  # kNN-LM requests decoding now
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as decoding while inside."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1

    def crowded(self) -> bool:
        """Other kNN-LM requests decode beside this one and their Searches share scans. Then a speculative round
        has nothing left to save: concurrent one-query Searches already cost one scan (4 on the 1 M keys, Zen 4:
        ~45 ms, as one alone), while speculation adds its cache work, thrown passes and a batch of several
        queries per request. Served, 32 tokens, base vs OS³ speculation: 1 client 1.6-1.9x faster speculating;
        2 clients 33.6 vs 31.3 tokens/s, 4 clients 49.3 vs 36.5."""
        return self.shared_scans and self._active > 1

    def scheduler(self, opts: "KnnLmOptions", cfg: OS3Config) -> StrideScheduler:
        """The worker's OS³ scheduler for requests with these options (the stride excepted: it is OS³'s)."""
        key = (astuple(cfg), replace(opts, stride=0))
        with self._lock:
            return self._schedulers.setdefault(key, StrideScheduler(cfg))

    @classmethod
    def open(cls, datastore: str, target: str, index: str = "", **client_kwargs) -> "KnnBackend":
        ds = open_datastore(datastore)
        return cls(ds, KnnSearchClient(target, index or ds.name, **client_kwargs), key_norms=key_norms(ds))

    def check_model(self, tm: TargetModel) -> None:
        """The datastore must have been built with this model's tokenizer and hidden size (ValueError if not)."""
        want = self.datastore.meta.get("tokenizer_id")
        if want and want != tokenizer_identity(tm.tokenizer):
            raise InvalidArgument("knnlm_datastore", f"{self.datastore.path} was built with tokenizer {want}, the model's "
                             f"is {tokenizer_identity(tm.tokenizer)}")
        hidden = tm.model.get_output_embeddings().weight.shape[1]
        if hidden != self.datastore.dim:
            raise InvalidArgument("knnlm_datastore", f"keys of dimension {self.datastore.dim}, the model's hidden size is "
                             f"{hidden}")

    def check(self, opts: KnnLmOptions) -> None:
        """Request-level limits that depend on the datastore (ValueError naming the field)."""
        if opts.k > self.datastore.size:
            raise InvalidArgument("k", f"{opts.k} exceeds the datastore size ({self.datastore.size} entries)")

    def verify_served(self) -> str | None:
        """None if the retrieval service serves an index matching our datastore, else why not."""
        try:
            info = self.client.index_info()
        except KBUnavailable as e:
            return f"retrieval service {self.client.target}: {e}"
        if info is None:
            return f"retrieval service {self.client.target} has no vector index {self.client.index!r}"
        if info.size != self.datastore.size or info.dim != self.datastore.dim:
            return (f"index {info.name!r} on {self.client.target} is {info.size}x{info.dim}, the datastore "
                    f"{self.datastore.path} is {self.datastore.size}x{self.datastore.dim}")
        self.shared_scans = bool(info.shared_scans)
        return None

    def close(self) -> None:
        self.client.close()


def true_distributions(backend: KnnBackend, queries: np.ndarray, logits: Sequence[torch.Tensor], opts: KnnLmOptions,
                       stats: KnnLmStats) -> Effects:
    """One batched Search (a Call) for B queries [B, D] -> (p float64 [V] per query, retrieved entry ids per
    query).

    A failed Search raises KnnRetrievalError (the request fails with UNAVAILABLE). It does not fall back to p_LM:
    unlike a missing draft, which only costs speed, a token decided without its neighbours is a different
    model's answer, and the client asked for the kNN-LM's.
    """
    t0 = time.perf_counter()
    hits = yield call(backend.client.search, queries, opts.k, opts.retriever, opts.ef_search)
    out = hit_distributions(backend, hits, logits, opts, stats)
    stats.retrieval_ms += (time.perf_counter() - t0) * 1e3
    return out


def hit_distributions(backend: KnnBackend, hits: list[tuple[np.ndarray, np.ndarray]],
                      logits: Sequence[torch.Tensor], opts: KnnLmOptions,
                      stats: KnnLmStats) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Search results of B queries + their LM logits -> (p float64 [V] per query, retrieved ids per query)."""
    stats.kb_calls += 1
    stats.kb_queries += len(hits)
    values = backend.datastore.values
    dists = [mixed_distribution(lg, scores, np.asarray(values[ids]), opts) for lg, (ids, scores) in zip(logits, hits)]
    return dists, [ids for ids, _ in hits]


# -------------------------------------------------------------------------------------------- LM passes


@contextmanager
def _output_layer_input(tm: TargetModel):
    """Capture what the output layer multiplies (the final hidden states [1, q, D]) during the passes inside."""
    box: list[torch.Tensor] = []
    # Passes through forward() run the lean forward when there is one (it fills the sink), direct calls of the
    # transformers model fire the hook: each pass appends exactly once.
    if tm.lean is not None:
        tm.lean.hidden_sink = box
    handle = tm.model.get_output_embeddings().register_forward_hook(lambda _m, inp, _out: box.append(inp[0]))
    try:
        yield box
    finally:
        handle.remove()
        if tm.lean is not None:
            tm.lean.hidden_sink = None


def lm_prefill_passes(tm: TargetModel, kv, prompt: np.ndarray) -> Effects:
    """prompt: int [P] -> (logits [V] of the last position, its final hidden state float32 [D]); kv holds P rows."""
    logits, hidden = yield from prefill_passes(tm, kv, torch.from_numpy(prompt.astype(np.int64)).to(tm.device),
                                               hidden=True)
    return logits, hidden.float().cpu().numpy()


def lm_step_passes(tm: TargetModel, kv, token: int) -> Effects:
    """One single-token pass (the AR step the other decoding modes use, pad rows included) -> (logits [V],
    hidden float32 [D]); kv grows by one row."""
    logits, hidden = yield from ar_pass(tm, kv, token, hidden=True)
    return logits, hidden.float().cpu().numpy()


def lm_prefill(tm: TargetModel, kv, prompt: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """lm_prefill_passes alone."""
    return run_inline(tm, lm_prefill_passes(tm, kv, prompt))


def lm_step(tm: TargetModel, kv, token: int) -> tuple[torch.Tensor, np.ndarray]:
    """lm_step_passes alone."""
    return run_inline(tm, lm_step_passes(tm, kv, token))


def _truncate(kv, length: int) -> None:
    """Roll the KV cache back to its first `length` rows (transformers' crop takes the rows to drop, negated)."""
    drop = cache_length(kv) - length
    if drop > 0:
        kv.crop(-drop)


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
