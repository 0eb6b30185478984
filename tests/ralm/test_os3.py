"""OS³: the closed-form objective against brute-force enumeration of every right/wrong pattern of a round, the
chosen stride against an exhaustive search over s, and the γ̂ estimator on scenario tables."""

from __future__ import annotations

import itertools
import math

import pytest

from generation_service.augment.os3 import (
    OS3Config,
    StrideScheduler,
    best_stride,
    expected_rate,
    expected_verified,
    round_time,
)


def brute_force(gamma: float, s: int, a: float, b: float, async_verify: bool,
                overlap: str = "step") -> tuple[float, float]:
    """(E[verified steps], E[round time]) by enumerating all 2^s outcomes of s independent speculation steps.

    The round keeps the steps before the first wrong one and redoes that one with the true passage (i + 1 steps
    settled); all right -> s. Sync: s·a + b. Async: the verification runs while the last step does, so an all-right
    round costs (s − 1)·a + max(a, b); otherwise the overlapped step is thrown away: (s − 1)·a + a + b.
    Async with whole-round overlap: the next round's s steps run during the verification; all right -> the next
    round can be sent after max(s·a, b); otherwise its steps are redone after the verification: b + s·a.
    """
    e_ver = e_time = 0.0
    for pattern in itertools.product((True, False), repeat=s):
        p = math.prod(gamma if ok else 1.0 - gamma for ok in pattern)
        first_wrong = next((i for i, ok in enumerate(pattern) if not ok), None)
        verified = s if first_wrong is None else first_wrong + 1
        if not async_verify:
            t = s * a + b
        elif overlap == "round":
            t = max(s * a, b) if first_wrong is None else b + s * a
        elif first_wrong is None:
            t = (s - 1) * a + max(a, b)
        else:
            t = (s - 1) * a + a + b
        e_ver += p * verified
        e_time += p * t
    return e_ver, e_time


GRID = [(g, a, b) for g in (0.0, 0.2, 0.6, 0.9, 1.0) for a, b in ((0.01, 0.03), (0.2, 0.03), (0.05, 0.05),
                                                                    (0.001, 0.5))]


MODES = [(False, "step"), (True, "step"), (True, "round")]  # (async_verify, overlap)


@pytest.mark.parametrize("async_verify,overlap", MODES)
@pytest.mark.parametrize("gamma,a,b", GRID)
def test_objective_matches_enumeration(gamma, a, b, async_verify, overlap):
    for s in range(1, 9):
        e_ver, e_time = brute_force(gamma, s, a, b, async_verify, overlap)
        assert expected_verified(gamma, s) == pytest.approx(e_ver, rel=1e-9)
        assert round_time(gamma, s, a, b, async_verify, overlap) == pytest.approx(e_time, rel=1e-9)
        assert expected_rate(gamma, s, a, b, async_verify, overlap) == pytest.approx(e_ver / e_time, rel=1e-9)


@pytest.mark.parametrize("async_verify,overlap", MODES)
@pytest.mark.parametrize("gamma,a,b", GRID)
def test_best_stride_is_the_exhaustive_argmax(gamma, a, b, async_verify, overlap):
    rates = {s: (lambda ev, t: ev / t)(*brute_force(gamma, s, a, b, async_verify, overlap)) for s in range(1, 11)}
    best = best_stride(gamma, a, b, s_max=10, async_verify=async_verify, overlap=overlap)
    assert rates[best] >= max(rates.values()) * (1 - 1e-9)
    assert all(rates[s] < rates[best] * (1 + 1e-9) for s in range(1, best))  # ties go to the smaller stride


@pytest.mark.parametrize("gamma,a,b,want", [
    (0.6, 0.010, 0.030, 3),  # the docstring's worked example: retrieval-bound -> speculate 3 steps
    (0.6, 0.200, 0.030, 1),  # generation-bound (our CPU): Not 3 -- a wrong guess wastes a whole 200 ms step
    (0.0, 0.010, 0.030, 1),  # never right: one step per verification
])
def test_scenarios(gamma, a, b, want):
    assert best_stride(gamma, a, b) == want


def test_async_objective_prefers_overlap():
    # b == a: async hides the verification behind a step, so at equal stride it is never slower than sync.
    for g in (0.2, 0.6):
        for s in range(1, 6):
            assert round_time(g, s, 0.05, 0.05, True) <= round_time(g, s, 0.05, 0.05, False)


def test_scheduler_estimates_and_starts_at_one():
    sched = StrideScheduler(OS3Config(window=5, gamma_max=0.6))
    assert sched.next_stride() == 1  # Not 3: OS³ starts at s = 1 before anything is measured
    sched.record_verification(3, 3)
    sched.record_verification(1, 3)
    assert sched.gamma() == 0.6  # MLE 4 / (4 + 1) = 0.8, capped at γ_max; Not 0.8
    sched.record_latency(speculation_s=0.01, verification_s=0.03)
    assert sched.next_stride() == best_stride(0.6, 0.01, 0.03, 16)
    for _ in range(5):
        sched.record_verification(0, 2)
    assert sched.gamma() == 0.0  # the window (w = 5) forgot the early successes; Not 4 / 10
    assert sched.history[0] == 1


# γ = 0.8 (capped at 0.9), a step 125 ms, a verification 130 ms (400 K passages, exact search, 2 cores).
# The async objective already overlaps the search at s = 1; a sync round at s = 1 would be a step plus a search.
@pytest.mark.parametrize("configured,asked,want,not_want", [
    (True, None, 1, 3),    # the configured (async) objective
    (True, False, 3, 1),   # a sync round of an async config (RaLMSpec's gate): the sync optimum
    (False, None, 3, 1),
    (False, True, 1, 3),
])
def test_scheduler_stride_for_the_round_kind_asked(configured, asked, want, not_want):
    sched = StrideScheduler(OS3Config(window=5, gamma_max=0.9, async_verify=configured))
    for _ in range(4):
        sched.record_verification(4, 5)  # 16 matched, 4 failures: γ = 0.8
    sched.record_latency(speculation_s=0.125, verification_s=0.13)
    s = sched.next_stride(async_verify=asked)
    overlapped = configured if asked is None else asked
    assert s == want == best_stride(0.8, 0.125, 0.13, 16, overlapped) and s != not_want


@pytest.mark.parametrize("outcomes,want", [
    ([(2, 2), (2, 2)], 0.6),       # all right: 1.0 capped; Not 1.0
    ([(1, 2), (1, 2)], 0.5),       # 2 matched, 2 failures
    ([(0, 1), (1, 1), (0, 1)], 1 / 3),
])
def test_gamma_mle(outcomes, want):
    sched = StrideScheduler(OS3Config(window=5, gamma_max=0.6))
    for m, s in outcomes:
        sched.record_verification(m, s)
    assert sched.gamma() == pytest.approx(want)


def test_round_overlap_worked_example():
    # kNN-LM on 1 M keys: a = 60 ms per step, b = 450 ms per verification, γ = 0.75.
    # rates (steps/s) for s = 3, 4, 5, 6: 4.17, 4.45, 4.49, 4.41 -> 5 (sync: 3.67, 3.96, 4.07, 4.06).
    assert best_stride(0.75, 0.06, 0.45, 16, async_verify=True, overlap="round") == 5
    assert expected_rate(0.75, 5, 0.06, 0.45, True, "round") == pytest.approx(4.494, abs=1e-3)
    assert round_time(0.75, 5, 0.06, 0.45, True, "round") < round_time(0.75, 5, 0.06, 0.45, False)
    with pytest.raises(ValueError, match="overlap"):
        OS3Config(async_verify=True, overlap="page")


@pytest.mark.parametrize("batches, mean_s, want", [
    ([], 0.3, (0.3, 0.0)),  # nothing sized: the paper's constant b
    ([(3, 0.3), (3, 0.5)], 0.4, (0.4, 0.0)),  # one batch size says nothing about the slope
    ([(1, 0.6), (2, 1.2), (4, 2.4)], 1.4, (0.0, 0.6)),  # full-text ranking in a database: all of it per query
    ([(1, 0.10), (8, 0.17)], 0.135, (0.09, 0.01)),  # a batching scan: mostly fixed
    ([(1, 0.2), (8, 0.1)], 0.15, (0.15, 0.0)),  # a batch cheaper than one query (noise): constant, Not negative
    ([(2, 0.1), (4, 0.5)], 0.3, (0.0, 0.11)),  # an intercept below 0: the line through the origin instead
])
def test_fit_verification_cost(batches, mean_s, want):
    from generation_service.augment.os3 import fit_verification_cost

    b0, b1 = fit_verification_cost(batches, mean_s)
    assert (b0, b1) == pytest.approx(want, abs=1e-9)
    assert b0 >= 0.0 and b1 >= 0.0


def brute_best_stride(gamma, a, b0, b1, s_max):
    rates = [(sum(gamma ** i for i in range(s)) / (s * a + b0 + b1 * s), -s) for s in range(1, s_max + 1)]
    return -max(rates)[1]


@pytest.mark.parametrize("gamma, a, b0, b1", [(0.9, 0.06, 0.6, 0.0), (0.9, 0.06, 0.0, 0.6), (0.6, 0.01, 0.05, 0.01),
                                               (0.85, 0.1, 0.3, 0.05), (0.5, 0.02, 0.0, 0.0001)])
def test_best_stride_with_a_per_query_cost_equals_brute_force(gamma, a, b0, b1):
    assert best_stride(gamma, a, b0, 16, b_per_query=b1) == brute_best_stride(gamma, a, b0, b1, 16)


def test_a_verification_that_grows_with_its_batch_keeps_the_stride_short():
    """Sync rounds, γ = 0.9, a step 60 ms; each query of a verification costs 0.6 s (a database's full-text
    ranking). Measured at s = 1 the paper's constant b sends s to 6; the cap holds it at 2, and once two sizes
    are measured the fitted cost brings it back to 1. Not 6: a 6-query verification would take ~3.6 s."""
    sched = StrideScheduler(OS3Config(window=5, gamma_max=0.9))
    for _ in range(3):
        sched.record_verification(1, 1)
    sched.record_verification(0, 1)
    sched.record_latency(speculation_s=0.06, verification_s=0.6, queries=1)
    assert best_stride(0.75, 0.06, 0.6, 16) == 6  # what the constant model alone would run
    assert sched.next_stride() == 2
    sched.record_latency(verification_s=1.2, queries=2)
    assert sched.next_stride() == 1


def test_a_batching_verification_still_reaches_long_strides():
    """The same request on a KB whose batch of 16 costs little more than one query: doubling from the first
    measurement reaches the fitted optimum after a few rounds."""
    sched = StrideScheduler(OS3Config(window=5, gamma_max=0.9))
    sched.record_verification(1, 1)
    sched.record_latency(speculation_s=0.06, verification_s=0.6, queries=1)
    strides = []
    for _ in range(5):
        s = sched.next_stride()
        strides.append(s)
        sched.record_verification(s, s)
        sched.record_latency(speculation_s=0.06, verification_s=0.6 + 0.005 * s, queries=s)
    best = best_stride(0.9, 0.06, 0.6, 16, b_per_query=0.005)
    assert best > 8 and strides == [2, 4, 8, best, best]
