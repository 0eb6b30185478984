"""How a batched pass drafts at all: decided by measurement, per batch size.

Drafting costs a batch twice. The nodes' rows lengthen the pass, which the draft budget weighs
(draft_budget.batch_sizes). And the drafting itself: a remote draft is an RPC served by the retrieval service,
which on a small machine runs on the same cores as the model, and even in-process drafts cost each request its
draft, its estimates and its tree layout on the model thread (at 16 requests a few ms against a 40 ms pass, while
almost no node pays there). Both depend on the deployment and the batch, so they are measured: tokens per ms of
whole steps (drafting + pass + commit) per arm — `remote` (the drafter as asked), `local` (in-process drafts only)
and `none` (no drafting: the AR step) — an exponential average per bucket of decoding requests (2, 4, 8, 16, ...).
A step's rate is taken relative to the calibrated cost of an AR pass over its own requests (record's ar_ms): a
bucket spans several batch sizes (9 to 16 requests), and 16 requests emit ~1.4x the tokens per ms of 9 whatever the
arm, so raw rates would credit an arm with the batch size it happened to be measured at. Seen in a 16-client run:
remote drafts held 50 % of the steps at 0.29 tokens/ms against 0.37 without.
An arm's rate is its tokens over its time across its last `window` steps (each step's tokens weighted by its AR
pass's ms as above), not an average of per-step rates: a step's rate is noisy and skewed (acceptance varies, and on
2 cores the model thread is now and then descheduled for several ms), and an exponential average of them (0.8 per
step) rated in-process drafts at 8 clients (Sapphire Rapids, `rest`) below AR steps, which then took 37-60 % of the
steps, while over the same steps drafts emitted 0.546 tokens/ms and AR steps 0.439 (forced to in-process drafts
alone, 557 tokens/s against the gate's 472).
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
    explore: int = 16  # every explore-th step of a bucket tries an arm that currently looks worse
    near: float = 0.9  # a runner-up rated within this share of the best is tried every explore // 4 steps
    window: int = 32  # steps per arm and bucket the rate is taken over
    rate: dict[tuple[int, str], float] = field(default_factory=dict)  # (bucket, arm) -> rate (record)
    # (bucket, arm) -> its last steps as (tokens, ms), the tokens weighted as the rate is (record)
    samples: dict[tuple[int, str], deque] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)  # steps decided per bucket
    chosen: dict[tuple[int, str], int] = field(default_factory=dict)  # (bucket, arm) -> steps it ran

    def choose(self, n_decoding: int, arms: Sequence[str]) -> str:
        """The arm for a step with n_decoding requests decoding. arms: in order of preference at a tie (drafting
        first); each is measured once before any is preferred."""
        b = bucket(n_decoding)
        k = self.steps[b] = self.steps.get(b, 0) + 1
        unmeasured = [a for a in arms if (b, a) not in self.rate]
        if unmeasured:
            arm = unmeasured[0]
        else:
            ranked = sorted(arms, key=lambda a: -self.rate[(b, a)])  # stable: a tie keeps the earlier arm
            if len(ranked) > 1 and k % self.explore == 0:  # every arm now and then
                arm = ranked[1 + (k // self.explore) % (len(ranked) - 1)]
            elif len(ranked) > 1 and k % max(2, self.explore // 4) == 0 and (
                    self.rate[(b, ranked[1])] >= self.near * self.rate[(b, ranked[0])]):
                # A close runner-up, often: its rate is from steps long past while the best's is fresh, and the
                # batch's phase moves them (a dip of the best handed AR steps 20-60 % of a run at 8 clients, each
                # episode lasting until rare explore steps had refreshed the drafts' rate).
                arm = ranked[1]
            else:
                arm = ranked[0]
        self.chosen[(b, arm)] = self.chosen.get((b, arm), 0) + 1
        return arm

    def record(self, n_decoding: int, arm: str, tokens: int, ms: float, ar_ms: float = 0.0) -> None:
        """A step of n_decoding requests with `arm` emitted `tokens` in `ms` (drafting, pass and commit). ar_ms:
        the expected ms of an AR pass over those requests; the rate is then (tokens / n) / (ms / ar_ms), 1.0 = as
        fast as that AR pass (0: raw tokens per ms)."""
        if ms <= 0:
            return
        key = (bucket(n_decoding), arm)
        weighted = tokens if ar_ms <= 0 else tokens * ar_ms / max(n_decoding, 1)
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
