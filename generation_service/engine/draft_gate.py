"""How a pass drafts at all: decided by measurement, per batch size (for a request alone: whether its remote
source is worth its round trip).

Drafting costs a batch twice. The nodes' rows lengthen the pass, which the draft budget weighs
(draft_budget.batch_sizes). And the drafting itself: a remote draft is an RPC served by the retrieval service,
which on a small machine runs on the same cores as the model, and even in-process drafts cost each request its
draft, its estimates and its tree layout on the model thread (in a large batch a visible share of the pass, while
almost no node pays there). Both depend on the deployment and the batch, so they are measured: tokens per ms of
whole steps (drafting + pass + commit) per arm — `remote` (the drafter as asked), `local` (in-process drafts only)
and `none` (no drafting: the AR step) — an exponential average per bucket of decoding requests (1, 2, 4, 8, ...).
A step's rate is taken relative to the calibrated cost of an AR pass over its own requests (record's ar_ms): a
bucket spans several batch sizes (9 to 16 requests), and the larger batches of a bucket emit more tokens per ms
whatever the arm, so raw rates would credit an arm with the batch size it happened to be measured at (and did: a
slower arm kept a large share of the steps).
An arm's rate is its tokens over its time across its last `window` steps (each step's tokens weighted by its AR
pass's ms as above), not an average of per-step rates: a step's rate is noisy and skewed (acceptance varies, and on
a small machine the model thread is now and then descheduled), and an exponential average of them rated in-process
drafts below AR steps, which then took a large share of the steps, while over the
same steps drafts emitted more tokens per ms than AR steps did (and forcing in-process drafts served more tokens/s
than the gate did).
An arm that is not the best is tried again after a wait of steps of its bucket (`explore`; `explore // 4` for a
runner-up within `near` of the best, whose stale rate may hide that it has become the best) that doubles, up to
`max_wait`, each time its trial step comes out slower than the best's rate; after a trial step that is faster, the
next comes after the short wait (its window's rate catches up with a few such steps). Fixed waits spent about a
fifth of the steps at 8 clients on arms rated well below the AR steps; with the doubling waits they take a few percent
(less than the run-to-run variation of served throughput).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

REMOTE, LOCAL, NONE = "remote", "local", "none"


def bucket(n: int) -> int:
    """The power of two at or above n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


@dataclass
class DraftGate:
    explore: int = 16  # steps of a bucket before an arm that looks worse is tried again (its first wait)
    near: float = 0.9  # a runner-up rated within this share of the best: first wait explore // 4
    max_wait: int = 256  # the wait doubles per losing trial up to this
    window: int = 32  # steps per arm and bucket the rate is taken over
    rate: dict[tuple[int, str], float] = field(default_factory=dict)  # (bucket, arm) -> rate (record)
    # (bucket, arm) -> its last steps as (tokens, ms), the tokens weighted as the rate is (record)
    samples: dict[tuple[int, str], deque] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # steps decided per bucket
    chosen: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, arm) -> steps it ran
    last: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, arm) -> the bucket's step it last ran
    # (bucket, arm) -> trials lost in a row (-1: its last trial won)
    losses: dict[tuple[int, str], int] = field(default_factory=dict)
    # bucket -> (the arm its latest step tried instead of the best, the best's rate then)
    trial: dict[int, tuple[str, float]] = field(default_factory=dict)

    def choose(self, n_decoding: int, arms: Sequence[str]) -> str:
        """The arm for a step with n_decoding requests decoding. arms: in order of preference at a tie (drafting
        first); each is measured once before any is preferred."""
        b = bucket(n_decoding)
        k = self.steps[b] = self.steps.get(b, 0) + 1
        self.trial.pop(b, None)
        unmeasured = [a for a in arms if (b, a) not in self.rate]
        if unmeasured:
            arm = unmeasured[0]
        else:
            ranked = sorted(arms, key=lambda a: -self.rate[(b, a)])  # stable: a tie keeps the earlier arm
            arm = ranked[0]
            self.losses.pop((b, arm), None)  # the best's wait starts short once it is overtaken
            # The trial most overdue, if any: every arm keeps being measured, as often as it has lately won.
            due = [(k - self.last.get((b, a), 0) - self.wait(b, a, ranked[0]), a) for a in ranked[1:]]
            late, a = max(due, default=(-1, arm), key=lambda d: d[0])  # a tie: the better rated
            if late >= 0:
                self.trial[b] = (a, self.rate[(b, arm)])
                arm = a
        self.last[(b, arm)] = k
        self.chosen[(b, arm)] = self.chosen.get((b, arm), 0) + 1
        return arm

    def wait(self, b: int, arm: str, best: str) -> int:
        """Steps of bucket b between trials of `arm` while `best` is rated best."""
        lost = self.losses.get((b, arm), 0)
        near = self.rate[(b, arm)] >= self.near * self.rate[(b, best)]
        first = max(2, self.explore // 4) if near or lost < 0 else self.explore
        return min(first << max(lost, 0), max(self.max_wait, first))

    def record(self, n_decoding: int, arm: str, tokens: int, ms: float, ar_ms: float = 0.0) -> None:
        """A step of n_decoding requests with `arm` emitted `tokens` in `ms` (drafting, pass and commit). ar_ms:
        the expected ms of an AR pass over those requests; the rate is then (tokens / n) / (ms / ar_ms), 1.0 = as
        fast as that AR pass (0: raw tokens per ms)."""
        if ms <= 0:
            return
        b = bucket(n_decoding)
        key = (b, arm)
        weighted = tokens if ar_ms <= 0 else tokens * ar_ms / max(n_decoding, 1)
        tried, best = self.trial.pop(b, (None, 0.0))
        if tried == arm:  # judged on its own step: its window may hold a phase long past
            self.losses[key] = -1 if weighted / ms >= best else min(max(self.losses.get(key, 0), 0) + 1, 30)
        last = self.samples.setdefault(key, deque(maxlen=self.window))
        last.append((weighted, ms))
        self.rate[key] = sum(t for t, _ in last) / sum(m for _, m in last)

    def report(self) -> str:
        """One line per bucket for the log: each arm's share of the steps and its current rate."""
        lines = []
        for b in sorted(self.steps):
            arms = sorted(a for bb, a in self.chosen if bb == b)
            lines.append(f"{b} decoding: " + ", ".join(
                f"{a} {self.chosen[(b, a)] / self.steps[b]:.0%} at rate {self.rate.get((b, a), 0.0):.3f}"
                for a in arms))
        return "; ".join(lines)
