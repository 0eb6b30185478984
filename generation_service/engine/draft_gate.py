"""Whether a batched pass asks the retrieval service for drafts at all: decided by measurement, per batch size.

A remote draft costs a batch twice. Its rows lengthen the pass, which the draft budget weighs
(draft_budget.batch_sizes). And the drafting itself: every request's draft is an RPC served by the retrieval
service, which on a small machine runs on the same cores as the model, and the pass waits for the slowest of them.
That second cost depends on the deployment (cores, replicas, datastore) and grows with the batch, so it is measured:
tokens per ms of whole steps (drafting + pass + commit) with remote drafts and without (in-process drafts only),
an exponential average per bucket of decoding requests (2, 4, 8, 16, ...). The better one is used; the other is
tried every `explore` steps, so a change in load or acceptance is noticed. Either way every request's output is
the same: a step without a remote draft verifies a smaller (or empty) tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def bucket(n: int) -> int:
    """The power of two at or above n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


@dataclass
class DraftGate:
    explore: int = 16  # every explore-th step of a bucket tries the choice that currently looks worse
    decay: float = 0.8  # weight of the old average per new step
    rate: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, remote) -> tokens per ms
    steps: dict[int, int] = field(default_factory=dict)  # steps decided per bucket

    def remote(self, n_decoding: int) -> bool:
        """Ask for remote drafts in a step with n_decoding requests decoding?"""
        b = bucket(n_decoding)
        k = self.steps[b] = self.steps.get(b, 0) + 1
        on, off = self.rate.get((b, True)), self.rate.get((b, False))
        if on is None or off is None:  # measure both first: with, then without
            return on is None
        better = on >= off
        return (not better) if k % self.explore == 0 else better

    def record(self, n_decoding: int, remote: bool, tokens: int, ms: float) -> None:
        """A step of n_decoding requests emitted `tokens` in `ms` (drafting, pass and commit)."""
        if ms <= 0:
            return
        key = (bucket(n_decoding), remote)
        r = tokens / ms
        old = self.rate.get(key)
        self.rate[key] = r if old is None else self.decay * old + (1 - self.decay) * r
