"""What a kNN-LM request may ask (KnnLmOptions), its defaults and tuning constants, and what it reports (KnnLmStats)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from generation_service.augment.os3 import OS3Config
from generation_service.augment.round_gate import MIN_SEARCH_SHARE, async_by_default
from ragcore.errors import InvalidArgument
from ragcore.wire import clip

RETRIEVERS = ("edr", "adr")
MAX_K = 1024
MAX_STRIDE = 64
# Weight of the old average of a step's time alone (no Search in flight) per new such step.
ALONE_DECAY = 0.8
F16_DOT_MAX = 16384.0  # |q·key| bound a float16 look-up scales to (float16's largest finite is 65504)
# OS³ for kNN-LM. γ̂ cap: RaLMSpec's 0.6 suits document-level retrieval, but the next token is more predictable
# from cached successor entries (per-step accuracy mostly above 0.8), and a cap of 0.6 made OS³ pick strides 3-5
# where 8 was clearly faster; 0.9 let two lucky early rounds jump to 16 and roll back most of it. First stride 4, not 1: with a verification costing ~8 LM passes, warm-up rounds of one step
# each cost more than a wrong first guess does.
KNN_GAMMA_MAX = 0.8
KNN_OS3 = OS3Config(gamma_max=KNN_GAMMA_MAX, s_init=4, overlap="round")  # async: the whole next round overlaps
# Rounds of each kind a worker measures before its round gate picks the cheapest (RoundGate's explore). With one,
# served, one unlucky first round (a wrong early guess throws most of a round away) kept a stride-4 worker on
# baseline steps for all of its next requests (no faster than the base).
KNN_GATE_EXPLORE = 3
# RoundGate's far_behind for kNN-LM: none. An arm's early rounds (short OS³ strides, a cold cache) cost a multiple
# of its later ones, so a sync arm measured in a worker's first request was never probed again while async rounds
# won round after round, though sync rounds measured later were the cheaper. A kNN-LM round is short, so a probe of
# the losing arm is cheap.
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
    # rows) cost several times a look-up over the whole cache. The replay (bench.knnlm_replay) and the served A/B
    # (bench.knnlm) chose m = 64 in 8,192 entries (docs/benchmarks.md).
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


