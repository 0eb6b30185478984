"""Whether to hold the next pass a few ms for a request about to arrive: closed-loop clients.

A pass starts as soon as the previous one ended. A client that sends its next request the moment its reply ends
(a load test's users, a benchmark's closed loop, an agent or script calling in a loop) lands just after the next
pass started and waits all of it before its first token, even when its prompt is cached and that token needs no pass
(a stream now gets that one at submit, engine/scheduler.py, but its second still waits for the pass after): on a
small machine with many clients a pass is long, and TTFT there was several times the solo one. The engine used to
absorb those arrivals by accident (a finish moved another request's KV before the next pass), and TTFT under many
clients rose sharply once that move was dropped.

So after a request finishes, the engine may wait up to `wait_s` for its replacement before the next pass — only
while arrivals have been following finishes: the median gap between an arrival and the finish just before it,
over the last `window` arrivals, is within EVIDENCE_FACTOR x `wait_s`. Open-loop traffic at a moderate rate
(arrivals unrelated to finishes) has longer gaps and never waits; a finish whose replacement came (or whose window
passed) is not waited for again. The cost is at most `wait_s` per finished request: with closed-loop clients the
holds are a tiny share of the time, TTFT falls to a fraction, and no throughput is lost (a replacement that joins
the next pass fills the batch one pass sooner; bench.concurrency, docs/benchmarks.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_EVIDENCE = 4  # arrivals seen after finishes before any wait
# A closed loop's gap is measured while the next pass runs on every core, which delays the client's reply handling
# and its next call (the more clients per core, the longer the gap); held, the cores are free and the call comes
# sooner. So the evidence allows gaps of a few holds.
EVIDENCE_FACTOR = 3.0


@dataclass
class FollowWait:
    wait_s: float  # longest hold after a finish (0 = never hold)
    window: int = 16  # arrivals whose gaps decide
    gaps: deque = field(default_factory=deque)  # seconds from the latest finish to each arrival after it (window)
    owed: int = 0  # finishes in the current hold whose replacement has not arrived
    deadline: float = 0.0  # end of the current hold
    last_finish: float | None = None
    held_s: float = 0.0  # total time passes were held (stats)

    def __post_init__(self) -> None:
        self.gaps = deque(self.gaps, maxlen=self.window)

    def finished(self, t: float) -> None:
        """A request left the batch at time t (time.monotonic())."""
        if t >= self.deadline:
            self.owed = 0
        self.owed += 1
        self.deadline = t + self.wait_s
        self.last_finish = t

    def arrived(self, submitted: float) -> None:
        """A job submitted at `submitted` (time.monotonic()) was taken from the queue."""
        if self.last_finish is not None and submitted >= self.last_finish:
            self.gaps.append(submitted - self.last_finish)
        self.owed = max(0, self.owed - 1)

    def closed_loop(self) -> bool:
        """Arrivals have been following finishes: the median of the last `window` gaps is within a few holds."""
        if self.wait_s <= 0 or len(self.gaps) < MIN_EVIDENCE:
            return False
        return sorted(self.gaps)[len(self.gaps) // 2] <= EVIDENCE_FACTOR * self.wait_s

    def remaining(self, now: float) -> float:
        """Seconds to hold the next pass for an arrival (0 = start it now)."""
        if self.owed == 0 or now >= self.deadline:
            self.owed = 0
            return 0.0
        return self.deadline - now if self.closed_loop() else 0.0

    def report(self) -> str:
        med = sorted(self.gaps)[len(self.gaps) // 2] * 1e3 if self.gaps else float("nan")
        return (f"median finish-to-arrival gap {med:.1f} ms over {len(self.gaps)} arrivals, "
                f"{'holding' if self.closed_loop() else 'not holding'} up to {self.wait_s * 1e3:.1f} ms; "
                f"held {self.held_s:.2f} s in all")
