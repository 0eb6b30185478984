"""ThreadGovernor: per-pass thread counts from measured pass times (engine/threads.py), against a simulated machine.

The simulation: a pass of r rows costs curve_t(r) x slowdown(t, load), where `load` is how many cores other
processes keep busy. A 2-thread team on 2 cores with one busy core is ~100x slower (measured: 953 vs 7.3 ms/token);
one thread is not slowed while a core is free. The reference is the brute-force best count for each load.
"""
from __future__ import annotations

import pytest

from generation_service.engine.threads import (
    EXPLORE_S,
    IDLE_RETRY_SHARE,
    MAX_EXPLORE_S,
    WINDOW_MS,
    IdleMeter,
    ThreadGovernor,
)
from generation_service.model.step_cost import StepCost

COSTS = {1: StepCost([1, 8, 64], [11.3, 19.0, 246.7]), 2: StepCost([1, 8, 64], [7.7, 13.4, 169.6])}
CORES = 2


def slowdown(threads: int, load: int) -> float:
    """Measured through the server (q4_1, 2-core EPYC, busy single-threaded processes in other sessions):
    2 threads 7.3 / 953 / 83 ms per token beside 0 / 1 / 2 busy processes, 1 thread 11.9 / 12.1 / 17.6."""
    if threads == 2:
        return {0: 1.0, 1: 130.0, 2: 11.0}[load]
    return max(1.0, (load + 1) / CORES)  # one thread time-shares once every core is taken


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(g: ThreadGovernor, clock: Clock, load: int, seconds: float, rows: int = 1, idle: bool = False) -> dict:
    """Passes for `seconds` of simulated time; returns {threads: passes} and the total ms."""
    used: dict[int, int] = {}
    end = clock.t + seconds
    while clock.t < end:
        free = max(CORES - load - g.current, 0) if idle else 0
        n = g.choose(rows, float(free) if idle else None)
        ms = float(COSTS[n].pass_ms(rows)) * slowdown(n, load)
        clock.t += ms / 1e3
        g.record(n, rows, ms)
        used[n] = used.get(n, 0) + 1
    return used


@pytest.mark.parametrize("load, best, not_best", [
    (0, 2, 1),  # free cores: every thread helps
    (1, 1, 2),  # one busy core: a 2-thread team waits at every barrier
    (2, 1, 2),  # both busy: one thread time-shares, two collapse
])
def test_settles_on_the_brute_force_best_count(load, best, not_best):
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    run(g, clock, load, 10.0)
    brute = min(COSTS, key=lambda t: float(COSTS[t].pass_ms(1)) * slowdown(t, load))
    assert brute == best
    used = run(g, clock, load, 60.0)
    assert g.current == best and g.current != not_best
    assert used[best] / sum(used.values()) > 0.95  # retries of the loser stay rare


def test_contention_costs_a_bounded_share_of_time():
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    run(g, clock, 1, 120.0)
    ms_per_pass = 120e3 / sum(run(g, clock, 1, 120.0).values())
    # The best count alone: 11.3 ms; retries of 2 threads (770 ms each, backing off to MAX_EXPLORE_S) add the rest.
    assert ms_per_pass < 11.3 * 1.15, ms_per_pass
    assert ms_per_pass < 7.7 * 100 / 10  # Not the stuck 2-thread team


def test_returns_to_all_threads_when_the_load_goes():
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    run(g, clock, 1, 200.0)  # long enough for the retries to back off to the maximum
    assert g.current == 1
    run(g, clock, 0, MAX_EXPLORE_S + 1.0)
    assert g.current == 2  # a retry found the cores free: Not stuck at one thread


def test_idle_cores_bring_the_retry_forward():
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    run(g, clock, 1, 200.0, idle=True)
    assert g.current == 1
    t0 = clock.t
    while g.current != 2 and clock.t - t0 < MAX_EXPLORE_S:
        run(g, clock, 0, 0.1, idle=True)
    assert clock.t - t0 <= MAX_EXPLORE_S * IDLE_RETRY_SHARE + 0.2  # a share of the backoff, Not all of it


def test_noise_does_not_flip_the_count():
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    for i in range(2000):
        n = g.choose(1)
        ms = float(COSTS[n].pass_ms(1)) * (1.3 if i % 3 == 0 else 0.9)  # +-30 % jitter, no contention
        clock.t += ms / 1e3
        g.record(n, 1, ms)
    assert g.current == 2 and g.switches <= 2


@pytest.mark.parametrize("every, spike, switches", [
    (40, 6.0, 0),   # a pass that lost its core for a slice now and then: Not a reason for one thread
    (10, 4.0, 0),   # often, but the window's time still goes mostly to normal passes
])
def test_single_slow_passes_do_not_flip_the_count(every, spike, switches):
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    used = {1: 0, 2: 0}
    for i in range(3000):
        n = g.choose(1)
        ms = float(COSTS[n].pass_ms(1)) * (spike if n == 2 and i % every == every - 1 else 1.0)
        clock.t += ms / 1e3
        g.record(n, 1, ms)
        used[n] += 1
    assert g.current == 2 and g.switches == switches
    assert used[1] / 3000 < 0.01  # only the retries


def test_persistent_slowdown_switches_within_the_window():
    """A 2-thread team 3x slower pass after pass (a neighbour took a core): one thread within ~WINDOW_MS."""
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    for _ in range(200):
        g.record(g.choose(1), 1, float(COSTS[2].pass_ms(1)))
        clock.t += 0.0077
    for k in range(1, 100):
        n = g.choose(1)
        ms = float(COSTS[n].pass_ms(1)) * (3.0 if n == 2 else 1.0)
        clock.t += ms / 1e3
        g.record(n, 1, ms)
        if g.current == 1:
            break
    assert g.current == 1 and k * 7.7 * 3 < WINDOW_MS * 1.5, k


@pytest.mark.parametrize("bad", [{}, {0: COSTS[1], 1: COSTS[1]}])
def test_rejects_bad_curves(bad):
    with pytest.raises(ValueError):
        ThreadGovernor(bad or COSTS, start=3 if not bad else 1)


def test_first_retry_waits_explore_s():
    clock = Clock()
    g = ThreadGovernor(COSTS, start=2, clock=clock)
    assert g.choose(1) == 2
    clock.t = EXPLORE_S - 0.01
    assert g.choose(1) == 2  # Not before EXPLORE_S
    clock.t = EXPLORE_S
    assert g.choose(1) == 1


@pytest.mark.parametrize("before, after, cpus, expected", [
    ((0, 0, 100, 0), (0, 0, 150, 0), 2, 2.0),       # all idle over the window: both cores
    ((100, 0, 100, 0), (200, 0, 100, 0), 2, 0.0),   # all user time: none (Not 2)
    ((0, 0, 0, 0), (50, 50, 0, 0), 2, 1.0),         # half the time niced background work: one core spare
    ((0, 0, 0, 0), (50, 0, 0, 50), 4, 2.0),         # iowait counts as idle
])
def test_idle_meter(tmp_path, before, after, cpus, expected):
    stat = tmp_path / "stat"

    def write(user, nice, idle, iowait):
        lines = [f"cpu  {user} {nice} 0 {idle} {iowait} 0 0 0 0 0"]
        lines += [f"cpu{i} 0 0 0 0 0 0 0 0 0 0" for i in range(cpus)]
        stat.write_text("\n".join(lines + ["intr 0", "ctxt 0"]) + "\n")

    clock = Clock()
    write(*before)
    meter = IdleMeter(str(stat), clock=clock)
    write(*after)
    assert meter.sample() is None  # too soon after the first reading
    clock.t = 1.0
    assert meter.sample() == pytest.approx(expected)


def test_idle_meter_without_proc_stat(tmp_path):
    assert IdleMeter(str(tmp_path / "missing")).sample() is None


@pytest.mark.model
@pytest.mark.parametrize("dtype", ["fp32", "q4_1"])
def test_logits_do_not_depend_on_the_thread_count(dtype, tm32, tmq4):
    """The governor may change the count between any two passes of a request: lossless only if a pass's logits are
    bit-identical at every count (the lean kernels reduce each output element on one thread, in one order). The
    server checks this at start-up and keeps the count fixed where it does not hold."""
    from generation_service.model.target import same_logits_at

    assert same_logits_at(tm32 if dtype == "fp32" else tmq4, [2, 1])


def _choice(threads: int):
    from generation_service.engine.calibrate import Calibration, Choice, CostCurve

    curves = [CostCurve(dtype, t, (1, 8, 64), (ms, ms * 1.7, ms * 22)) for dtype, t, ms in
              (("q4_1", 2, 7.7), ("q4_1", 1, 11.3), ("fp32", 2, 19.0), ("fp32", 1, 28.5))]
    chosen = next(c for c in curves if (c.dtype, c.threads) == ("q4_1", threads))
    return Choice(chosen, Calibration(key={"cores": 2}, curves=curves))


@pytest.mark.parametrize("flags, threads, expected", [
    ({}, 2, [1, 2]),                                   # default flags: the served dtype's 1 and 2 thread curves
    ({"threads": 2}, 2, None),                         # a pinned count is kept (Not adapted)
    ({"adaptive_threads": False}, 2, None),            # switched off
    ({}, 1, None),                                     # one thread chosen: nothing fewer to fall back to
])
def test_server_builds_a_governor_only_for_measured_counts(flags, threads, expected):
    from generation_service.config import GenerationConfig
    from generation_service.server import thread_governor

    g = thread_governor(GenerationConfig(**flags), _choice(threads))
    assert (None if g is None else sorted(g.arms)) == expected
    if g is not None:
        assert g.current == threads and g.arms[1].cost.pass_ms(1) == pytest.approx(11.3)  # Not fp32's curve


@pytest.mark.parametrize("bf16_prefill, prefill_bf16_ms, expected_200", [
    (True, 219.0, 219.0),    # prompt chunks in bf16: their measured cost, Not decode rows extrapolated (542)
    (False, 219.0, 315.0),   # fp32 prompt linears
    (True, 0.0, 315.0),      # bf16 not measured here: the fp32 prompt
])
def test_pass_cost_predicts_prompt_passes(bf16_prefill, prefill_bf16_ms, expected_200):
    from generation_service.engine.calibrate import CostCurve

    c = CostCurve("q4_1", 2, (1, 32, 64), (7.7, 82.0, 169.6), prefill_ms=315.0, prefill_bf16_ms=prefill_bf16_ms)
    cost = c.pass_cost(bf16_prefill)
    assert float(cost.pass_ms(200)) == pytest.approx(expected_200)
    assert float(cost.pass_ms(1)) == pytest.approx(7.7) and float(cost.pass_ms(64)) == pytest.approx(169.6)
