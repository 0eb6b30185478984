"""OS³, the optimal speculation stride scheduler of RaLMSpec: how many speculative steps to run before one
batched verification.

Model (the paper's). A speculation step costs `a` seconds (the step's generation plus the speculative retrieval
from the local cache), a batched verification of s steps costs `b`. Each speculative step is right with
probability γ, independently. After s steps one verification finds the first mismatch; the steps before it are
kept and the mismatched one is corrected, so a round verifies i steps when the first mismatch is at step i and s
when there is none:

    E[verified] = Σ_{i<s} γ^i = (1 − γ^s) / (1 − γ)            (= s when γ = 1)
    sync:  time = s·a + b
    async: the verification runs while one more speculation step does; when all s steps were right (γ^s) that
           step is kept and the round costs (s − 1)·a + max(a, b); otherwise it is thrown away and the round
           costs s·a + b:
           time = (s − 1)·a + γ^s·max(a, b) + (1 − γ^s)·(a + b)
    async, whole-round overlap (overlap="round", token-level kNN-LM): the next round's s steps are speculated
           while the verification runs; they stand when the round was all right and are redone otherwise, so
           the time from one verification's start to the next is
           time = γ^s·max(s·a, b) + (1 − γ^s)·(s·a + b)

The verification's cost. The paper takes b as one constant: a batched search costs about one search (a GPU, faiss).
Not every knowledge base batches: PostgreSQL's full-text ranking costs the same per query in a batch of 16 as
alone, so b grows with s. When verifications report how many queries they carried, b(s) = b0 + b1·s is fitted
to the window's (queries, seconds) pairs (least squares, b0, b1 >= 0); until two batch sizes were seen it is the
paper's constant, and the stride never goes past twice the largest batch measured, so a cost that grows with the
batch shows before a long round pays for it.

OS³ maximizes E[verified] / time over s. γ is estimated from the last w verifications as
γ̂ = ΣM / (ΣM + #(M < s)) (M = matched speculative steps of a verification of stride s: every matched step is a
success, every verification that stopped short is one failure), capped at γ_max so a lucky streak cannot send
s to s_max; a and b are the means of the last w measurements.

Worked example (sync): γ = 0.6, a = 10 ms, b = 30 ms -> verified steps per ms for s = 1, 2, 3, 4:
1/40 = 0.0250, 1.6/50 = 0.0320, 1.96/60 = 0.0327, 2.176/70 = 0.0311 -> s = 3. With a = 200 ms (generation
dominates) and b = 30 ms: 1/230 = 0.0043 > 1.6/430 = 0.0037 -> s = 1.

    sched = StrideScheduler(OS3Config())
    s = sched.next_stride()                      # 1 until the first measurements arrive
    ... s speculation steps, timed ...;  sched.record_latency(speculation_s=per_step)
    ... one verification, timed ...;     sched.record_latency(verification_s=t); sched.record_verification(m, s)
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass


def _check_rate_args(gamma: float, a: float, b: float) -> None:
    if not (isinstance(gamma, (int, float)) and 0.0 <= gamma <= 1.0):
        raise ValueError(f"gamma must lie in [0, 1], got {gamma!r}")
    for name, v in (("a", a), ("b", b)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {v!r}")
    if a == 0.0 and b == 0.0:
        raise ValueError("a and b must not both be 0 (a round would take no time)")


def expected_verified(gamma: float, s: int) -> float:
    """Expected steps one verification of s speculative steps settles: Σ_{i<s} γ^i."""
    return float(s) if gamma >= 1.0 else (1.0 - gamma ** s) / (1.0 - gamma)


OVERLAPS = ("step", "round")


def round_time(gamma: float, s: int, a: float, b: float, async_verify: bool = False, overlap: str = "step",
               b_per_query: float = 0.0) -> float:
    """Expected seconds of one speculate-s-then-verify round (see the module docstring); the verification
    costs b + b_per_query·s."""
    b = b + b_per_query * s
    if not async_verify:
        return s * a + b
    hit = gamma ** s
    if overlap == "round":
        return hit * max(s * a, b) + (1.0 - hit) * (s * a + b)
    return (s - 1) * a + hit * max(a, b) + (1.0 - hit) * (a + b)


def expected_rate(gamma: float, s: int, a: float, b: float, async_verify: bool = False,
                  overlap: str = "step", b_per_query: float = 0.0) -> float:
    """Expected verified steps per second with stride s (the OS³ objective).

    sync: (1 − γ^s) / ((1 − γ)(s·a + b)); async: E[verified] / ((s − 1)·a + γ^s·max(a, b) + (1 − γ^s)(a + b)).
    """
    _check_rate_args(gamma, a, b + b_per_query)
    if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise ValueError(f"s must be an integer >= 1, got {s!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap must be one of {OVERLAPS}, got {overlap!r}")
    if not (math.isfinite(b_per_query) and b_per_query >= 0.0):
        raise ValueError(f"b_per_query must be a finite number >= 0 (seconds), got {b_per_query!r}")
    t = round_time(gamma, s, a, b, async_verify, overlap, b_per_query)
    return math.inf if t == 0.0 else expected_verified(gamma, s) / t


def best_stride(gamma: float, a: float, b: float, s_max: int = 16, async_verify: bool = False,
                overlap: str = "step", b_per_query: float = 0.0) -> int:
    """argmax_{1 <= s <= s_max} expected_rate; ties go to the smaller stride (less work thrown away)."""
    if isinstance(s_max, bool) or not isinstance(s_max, int) or s_max < 1:
        raise ValueError(f"s_max must be an integer >= 1, got {s_max!r}")
    _check_rate_args(gamma, a, b + b_per_query)
    best, best_rate = 1, -1.0
    for s in range(1, s_max + 1):
        r = expected_rate(gamma, s, a, b, async_verify, overlap, b_per_query)
        if r > best_rate * (1.0 + 1e-12):  # a float-level tie is not a reason to speculate further
            best, best_rate = s, r
    return best


def fit_verification_cost(batches: list[tuple[int, float]], mean_s: float) -> tuple[float, float]:
    """(b0, b1) >= 0 with b0 + b1·n the least-squares line through the (n queries, seconds) pairs; (mean_s, 0)
    while fewer than two batch sizes were seen (the paper's constant b)."""
    if len({n for n, _ in batches}) < 2:
        return mean_s, 0.0
    k = len(batches)
    mn = sum(n for n, _ in batches) / k
    mt = sum(t for _, t in batches) / k
    b1 = sum((n - mn) * (t - mt) for n, t in batches) / sum((n - mn) ** 2 for n, _ in batches)
    if b1 <= 0.0:  # a batch costs no more than a single query: the constant model
        return max(mt, 0.0), 0.0
    b0 = mt - b1 * mn
    if b0 < 0.0:  # through the origin instead: all of it per query
        return 0.0, sum(n * t for n, t in batches) / sum(n * n for n, _ in batches)
    return b0, b1


@dataclass
class OS3Config:
    window: int = 5  # w: verifications (and latency samples) the estimates look back over
    gamma_max: float = 0.6  # cap on γ̂
    s_init: int = 1  # stride before anything was measured
    s_max: int = 16
    async_verify: bool = False  # optimize the async objective
    overlap: str = "step"  # async: what runs during a verification, one step (RaLM) or the next round (kNN-LM)

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not (isinstance(self.gamma_max, (int, float)) and 0.0 <= self.gamma_max <= 1.0):
            raise ValueError(f"gamma_max must lie in [0, 1], got {self.gamma_max!r}")
        if isinstance(self.s_max, bool) or not isinstance(self.s_max, int) or self.s_max < 1:
            raise ValueError(f"s_max must be an integer >= 1, got {self.s_max!r}")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap must be one of {OVERLAPS}, got {self.overlap!r}")
        if isinstance(self.s_init, bool) or not isinstance(self.s_init, int) or not 1 <= self.s_init <= self.s_max:
            raise ValueError(f"s_init must be an integer in [1, s_max={self.s_max}], got {self.s_init!r}")


class StrideScheduler:
    """OS³ state: recent verification outcomes and latencies -> the next stride. One request's, or shared by a
    worker's requests (ralm_gate.SharedRoundCosts.scheduler), so its calls are thread-safe."""

    HISTORY = 4096  # strides kept for stats: a worker's shared scheduler must not grow without bound

    def __init__(self, cfg: OS3Config | None = None):
        self.cfg = cfg if cfg is not None else OS3Config()
        self.history: deque[int] = deque(maxlen=self.HISTORY)  # strides chosen, in order (for stats)
        w = self.cfg.window
        self._outcomes: deque[tuple[int, int]] = deque(maxlen=w)  # (matched, stride)
        self._spec: deque[float] = deque(maxlen=w)
        self._verify: deque[float] = deque(maxlen=w)
        self._batches: deque[tuple[int, float]] = deque(maxlen=w)  # (queries, seconds) of sized verifications
        self._lock = threading.Lock()

    def gamma(self) -> float | None:
        """γ̂ = ΣM / (ΣM + #(M < s)) over the window, capped at γ_max; None before the first verification."""
        if not self._outcomes:
            return None
        matched = sum(m for m, _ in self._outcomes)
        failed = sum(1 for m, s in self._outcomes if m < s)
        g = matched / (matched + failed) if matched + failed else 0.0
        return min(g, self.cfg.gamma_max)

    def latencies(self) -> tuple[float, float] | None:
        """(a, b): mean speculation-step and verification latency over the window; None until both exist."""
        if not self._spec or not self._verify:
            return None
        return sum(self._spec) / len(self._spec), sum(self._verify) / len(self._verify)

    def verification_cost(self) -> tuple[float, float]:
        """(b0, b1): a verification of n queries costs b0 + b1·n, fitted over the window's sized verifications;
        (mean latency, 0) until two batch sizes were seen. Call with latencies() not None."""
        return fit_verification_cost(list(self._batches), sum(self._verify) / len(self._verify))

    def stride_cap(self) -> int:
        """The longest stride the measurements vouch for: twice the largest batch verified (s_max before any
        verification reported its size, as the paper has it)."""
        if not self._batches:
            return self.cfg.s_max
        return max(self.cfg.s_init, min(self.cfg.s_max, 2 * max(n for n, _ in self._batches)))

    def next_stride(self, async_verify: bool | None = None) -> int:
        """The stride for the next round. async_verify: the objective of the round about to run when it is not the
        configured one (RaLMSpec's gate runs sync rounds in an async config: the async objective's s = 1 makes a
        sync round one step plus a whole search, never cheaper than a sequential step)."""
        overlapped = self.cfg.async_verify if async_verify is None else async_verify
        with self._lock:
            g, ab = self.gamma(), self.latencies()
            if g is None or ab is None or (ab[0] == 0.0 and ab[1] == 0.0):
                s = self.cfg.s_init
            else:
                b0, b1 = self.verification_cost()
                s = best_stride(g, ab[0], b0, self.stride_cap(), overlapped, self.cfg.overlap, b1) if (
                    ab[0] > 0.0 or b0 > 0.0 or b1 > 0.0) else self.cfg.s_init
            self.history.append(s)
            return s

    def record_verification(self, matched: int, stride: int) -> None:
        """matched = speculative steps of this batch that were right (0..stride)."""
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be an integer >= 1, got {stride!r}")
        if isinstance(matched, bool) or not isinstance(matched, int) or not 0 <= matched <= stride:
            raise ValueError(f"matched must be an integer in [0, stride={stride}], got {matched!r}")
        with self._lock:
            self._outcomes.append((matched, stride))

    def record_latency(self, *, speculation_s: float | None = None, verification_s: float | None = None,
                       queries: int | None = None) -> None:
        """speculation_s: one speculation step; verification_s: one batched verification (seconds) of `queries`
        queries when the caller knows it (then the verification's cost may grow with its batch)."""
        if queries is not None and verification_s is not None and queries >= 1 and math.isfinite(verification_s):
            with self._lock:
                self._batches.append((int(queries), float(verification_s)))
        for name, v, q in (("speculation_s", speculation_s, self._spec),
                           ("verification_s", verification_s, self._verify)):
            if v is None:
                continue
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
            with self._lock:
                q.append(float(v))
