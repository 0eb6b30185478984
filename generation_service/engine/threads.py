"""Intra-op threads per forward pass, chosen from measured pass costs: fewer threads when the cores are contended.

Why: when another process keeps one of the cores busy (the retrieval service's Search in its own container, a second
tenant, a build), a 2-thread team shares the other core's time with it: with at::parallel_for's fixed ranges every
loop waited for the thread that lost its core, for a whole scheduler slice; with the kernels' claimed loops
(claim_pool.cpp) the other thread does most of the work meanwhile, but the team is still a few times slower. On a
2-core machine beside one busy process one thread can be far faster than two, and with the cores free two are
faster than one (bench.contention, docs/benchmarks.md). Neither count is right everywhere, so the engine
measures: each pass's time over the calibrated cost of its rows gives a slowdown ratio per thread count, the count
with the least expected time runs, and the others are tried again now and then (backing off while they lose) so
the worker returns to all its threads once the other load is gone.

Pure bookkeeping over a clock: the engine sets torch's threads and times the passes.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from generation_service.model.step_cost import StepCost

# An arm's slowdown is its measured over its calibrated ms across its passes of the last WINDOW_MS of pass time:
# a contended team's one pass is long enough to fill the window alone, so a real change of load is seen at once,
# while one pass that lost its core for a scheduler slice is one pass among dozens. An average of per-pass ratios
# (EWMA) moved to one thread on such single passes: at one client (short 1-row passes, each delta waking a gRPC
# thread) an occasional slow pass sent a sizeable share of the passes to one thread, and the mean pass grew well
# above the median.
WINDOW_MS = 250.0
# Fewer threads must be this much cheaper before the engine moves to them: the calibrated curves predict a pass
# only roughly (prompt chunks of other sizes, attention over longer caches), and the counts' slowdowns are measured
# at different moments. Back to more threads as soon as they are cheaper (the calibrated choice). Why not a wider
# margin such as 1.5: with the kernels' claimed loops (claim_pool.cpp) a 2-thread team beside one busy process is
# only a few times slower, no longer orders of magnitude, and one thread there is cheaper than two but not by 1.5:
# with that margin the worker stayed on two, as slow as a fixed two-thread worker (bench.contention).
SWITCH_MARGIN = 1.25
STALE_S = 1.0  # passes older than this leave the window: after a pause the next pass is measured alone
EXPLORE_S = 4.0  # first retry of a losing count after this long; doubled each time it loses again
MAX_EXPLORE_S = 32.0  # at most this long; a retry that loses costs one slow pass (a long one when contended)
# More threads are retried sooner while the machine shows the idle cores they need (the other load has gone):
# after IDLE_RETRY_S, or IDLE_RETRY_SHARE of the backoff if longer (a burst of other load may be back by then):
# at most 1 s on one thread once the cores are free (a larger share kept a worker whose neighbour had stopped on
# one thread for whole requests). Behind a steadily busy neighbour the cores never look idle.
IDLE_RETRY_S = 0.5
IDLE_RETRY_SHARE = 1 / 32
IDLE_NEEDED = 0.75  # idle cores per extra thread


@dataclass
class _Arm:
    threads: int
    cost: StepCost
    ratio: float = 1.0  # measured / calibrated ms over its passes in `recent` (1.0 before any)
    recent: deque = field(default_factory=deque)  # (clock, measured ms, calibrated ms) of its last passes
    measured_ms: float = 0.0  # sums over `recent`
    calibrated_ms: float = 0.0
    seen: float = -math.inf  # clock of its last measured pass
    tried: float = -math.inf  # clock of its last retry (a pass that failed is not measured)
    wait_s: float = EXPLORE_S  # next retry this long after the last one

    def expected_ms(self, rows: int) -> float:
        return self.ratio * float(self.cost.pass_ms(rows))

    def add(self, now: float, ms: float, rows: int) -> None:
        """A pass of `rows` rows took `ms`: into the window, passes older than STALE_S or beyond WINDOW_MS out."""
        calibrated = max(float(self.cost.pass_ms(rows)), 1e-6)
        self.recent.append((now, ms, calibrated))
        self.measured_ms += ms
        self.calibrated_ms += calibrated
        while len(self.recent) > 1 and (now - self.recent[0][0] > STALE_S
                                        or self.measured_ms - self.recent[0][1] >= WINDOW_MS):
            _, old_ms, old_calibrated = self.recent.popleft()
            self.measured_ms -= old_ms
            self.calibrated_ms -= old_calibrated
        if len(self.recent) == 1:  # exact again: running sums drift over millions of passes
            self.measured_ms, self.calibrated_ms = ms, calibrated
        self.ratio = self.measured_ms / self.calibrated_ms


class ThreadGovernor:
    """costs: the calibrated pass curve of each thread count (same dtype); start: the count to begin with.

        g = ThreadGovernor({1: cost_1t, 2: cost_2t}, start=2)
        n = g.choose(rows)            # before a pass
        g.record(n, rows, ms)         # after it
    """

    def __init__(self, costs: Mapping[int, StepCost], start: int, clock: Callable[[], float] = time.monotonic):
        if start not in costs:
            raise ValueError(f"start={start} has no cost curve (have {sorted(costs)})")
        if any(t < 1 for t in costs):
            raise ValueError(f"thread counts must be >= 1, got {sorted(costs)}")
        self._clock = clock
        now = clock()
        self.arms = {t: _Arm(t, c, seen=now) for t, c in sorted(costs.items())}
        self.start = start  # the calibrated choice (the count the served cost curve is for)
        self.current = start
        self.switches = 0  # times the chosen count changed (stats, logs)

    def choose(self, rows: int, idle_cores: float | None = None) -> int:
        """The thread count for a pass of `rows` rows: a loser due for a retry, else the cheapest expected
        (moving to fewer threads only past SWITCH_MARGIN). idle_cores: the machine's idle cores
        lately (None = unknown)."""
        now = self._clock()
        for arm in self.arms.values():
            if arm.threads == self.current:
                continue
            since = now - max(arm.seen, arm.tried)
            idle = (idle_cores is not None and arm.threads > self.current
                    and idle_cores >= IDLE_NEEDED * (arm.threads - self.current))
            if since >= arm.wait_s or (idle and since >= max(IDLE_RETRY_S, arm.wait_s * IDLE_RETRY_SHARE)):
                arm.tried = now
                return arm.threads
        best = min(self.arms.values(), key=lambda a: a.expected_ms(rows))
        if best.threads != self.current and self._better(best, rows):
            self.current = best.threads
            self.switches += 1
        return self.current

    def _better(self, arm: _Arm, rows: int) -> bool:
        margin = SWITCH_MARGIN if arm.threads < self.current else 1.0
        return arm.expected_ms(rows) * margin < self.arms[self.current].expected_ms(rows)

    def record(self, threads: int, rows: int, ms: float) -> None:
        """A pass of `rows` rows took `ms` with `threads` threads."""
        arm = self.arms.get(threads)
        if arm is None or not (ms > 0 and math.isfinite(ms)):
            return
        now = self._clock()
        arm.add(now, ms, rows)
        arm.seen = now
        if threads != self.current:  # a retry: back off while it loses, retry soon again once it wins
            arm.wait_s = EXPLORE_S if self._better(arm, rows) else min(2 * arm.wait_s, MAX_EXPLORE_S)

    def expected_ms(self, rows: int) -> float:
        """What a pass of `rows` rows costs now with the current count (calibrated cost x measured slowdown)."""
        return self.arms[self.current].expected_ms(rows)

    def report(self) -> str:
        return ", ".join(f"{a.threads}t x{a.ratio:.2f}" for a in self.arms.values()) + \
            f" -> {self.current}t ({self.switches} switches)"


class IdleMeter:
    """The machine's spare cores since the previous reading, from /proc/stat (None where there is none): idle and
    iowait time, and time of niced processes (background work that yields to us, like a KB build at nice 19).
    Read at most every min_s; in between the last value is returned."""

    def __init__(self, path: str = "/proc/stat", min_s: float = 0.2, clock: Callable[[], float] = time.monotonic):
        self._path, self._min_s, self._clock = path, min_s, clock
        self._last = self._read()
        self._at = clock()
        self.value: float | None = None

    def _read(self) -> tuple[float, float, int] | None:
        try:
            with open(self._path) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        fields = [float(x) for x in lines[0].split()[1:]]
        cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
        return fields[1] + fields[3] + fields[4], sum(fields[:8]), max(cpus, 1)  # nice, idle, iowait

    def sample(self) -> float | None:
        now = self._clock()
        if self._last is None or now - self._at < self._min_s:
            return self.value
        cur = self._read()
        if cur is not None and cur[1] > self._last[1]:
            self.value = (cur[0] - self._last[0]) / (cur[1] - self._last[1]) * cur[2]
            self._last, self._at = cur, now
        return self.value
