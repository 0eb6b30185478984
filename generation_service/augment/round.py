"""The speculation round of the retrieval-augmented modes, written once; each mode is a policy over it.

A round: choose its kind (the gate: sequential, sync or async) and stride, make up to `stride` guesses from the
local cache (each guess is a step run on its guessed value), send one batched verification for them, take the
true values, keep the guesses up to the first wrong one, commit the true values up to and including it, roll back
the rest, and charge the round to the gate and OS³. In an async round the next round is guessed while the
verification is in flight, on the assumption that every guess in flight is right; a rollback throws those
guesses away too. At most one round is in flight.

    guesses [7, 7, 9]  truths [7, 7, 4]  ->  committed [7, 7, 4], matched 2   # Not [7, 7, 9]: 9 was never true

The output is the true values in order whatever was guessed (lossless): only verified values are committed.

A policy (RoundPolicy) says what a guess is and how to make, send, verify, roll back and charge one; `run_rounds`
is the loop both modes share. Everything mode-specific (KV caches, passages, neighbour caches, stats) stays in the
policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, Sequence, TypeVar

from generation_service.augment.round_gate import ASYNC, SEQUENTIAL
from generation_service.engine.effects import Effects, Emit
from generation_service.engine.speculative import FINISH_CANCELLED

G = TypeVar("G")  # a guess: the step's state and the value it guessed
P = TypeVar("P")  # a verification in flight


def first_mismatch(guessed: Sequence[Any], true: Sequence[Any]) -> int | None:
    """Index of the first guess that is not the true value, None if all match.

    first_mismatch([3, 3, 5], [3, 3, 4]) -> 2    # Not None: the last guess was wrong
    """
    for i, (g, t) in enumerate(zip(guessed, true)):
        if g != t:
            return i
    return None


@dataclass
class Round(Generic[G, P]):
    """Guesses sent to one batched verification."""

    guesses: list[G]
    pending: P  # the verification in flight (the policy's object)
    arm: str  # ASYNC (the next round is guessed while this one is verified) or SYNC
    beside_s: float = 0.0  # what the guesses made beside its verification lost to it (the policy measures it)


@dataclass
class Settled:
    """A verified round: the true values to commit and how many guesses were right."""

    committed: list[Any]  # true values up to and including the first wrong guess (all of them if none was)
    matched: int  # guesses confirmed
    guessed: int  # guesses verified
    thrown: list[Any] = field(default_factory=list)  # guesses of the next round a rollback threw away

    @property
    def wrong(self) -> bool:
        return self.matched < self.guessed


def settle(guessed: Sequence[Any], true: Sequence[Any]) -> tuple[list[Any], int]:
    """Guessed and true values of a round -> (values to commit, guesses confirmed).

    settle([7, 7, 9], [7, 7, 4]) -> ([7, 7, 4], 2);  settle([7, 7], [7, 7]) -> ([7, 7], 2)"""
    m = first_mismatch(guessed, true)
    n = len(guessed) if m is None else m
    return list(true[:len(guessed) if m is None else m + 1]), n


class RoundPolicy(Protocol[G, P]):
    """One mode's side of the round."""

    # An async round's verification runs while the next round is guessed (kNN-LM); False: while the round's own
    # last step runs, which the policy arranges (RaLM), the driver then waiting for it like a sync round's.
    pipelines: bool

    def cancelled(self) -> bool: ...

    def cancel(self, rnd: Round[G, P]) -> None:
        """The request left with `rnd` in flight: stop its verification."""

    def begin(self, arm: str | None) -> tuple[int, str]:
        """A new round starts (nothing guessed yet): -> (its stride, its kind); arm is the kind already chosen, if
        any (None: ask the gate)."""

    def sequential(self) -> Effects:
        """One step without speculation (the SEQUENTIAL arm) -> finish reason or None."""

    def may_guess(self, guesses: list[G], inflight: Round[G, P] | None) -> bool:
        """Another guess now? (budget left, the last guess not an end, the verification in flight not answered)"""

    def guess(self, inflight: Round[G, P] | None) -> Effects:
        """Make one guess (run its step) -> G, or None: no guess, the round ends here."""

    def value(self, g: G) -> Any:
        """The value a guess guessed (compared with the true one)."""

    def send(self, guesses: list[G], arm: str) -> Round[G, P]:
        """Start the verification of `guesses`."""

    def verify(self, rnd: Round[G, P]) -> Effects:
        """Wait for `rnd`'s verification -> the true value of each of its guesses (and of any the policy asked
        about beyond them), or None: it failed and the policy dropped the round."""

    def rollback(self, rnd: Round[G, P], settled: Settled) -> None:
        """Undo every step after the first wrong guess (the rest of the round and settled.thrown)."""

    def commit(self, rnd: Round[G, P], settled: Settled) -> Effects:
        """Charge the round (gate, OS³, stats) and emit the output it committed -> finish reason or None."""


def run_rounds(policy: RoundPolicy[G, P]) -> Effects:
    """Rounds until the policy finishes or the request is cancelled.

    Each round: begin (stride, kind) -> a sequential step, or guesses up to the stride -> send -> (async: guess the
    next round meanwhile) -> verify -> settle -> roll back if a guess was wrong -> commit."""
    guesses: list[G] = []  # guessed, not yet sent
    inflight: Round[G, P] | None = None
    stride, arm = 0, None
    while True:
        if policy.cancelled():
            if inflight is not None:
                policy.cancel(inflight)
            yield Emit([], FINISH_CANCELLED)
            return
        if not guesses:
            stride, arm = policy.begin(arm)
        if arm == SEQUENTIAL and inflight is None:
            if (yield from policy.sequential()):
                return
            arm = None
            continue
        # Guess up to the stride. Only an async round of a pipelining policy is guessed beside one in flight: a
        # sync round or a sequential step waits for the answer first.
        while ((inflight is None or (arm == ASYNC and policy.pipelines)) and len(guesses) < stride
               and policy.may_guess(guesses, inflight)):
            g = yield from policy.guess(inflight)
            if g is None:  # the round ends here (the policy knows why)
                break
            guesses.append(g)
        if inflight is None:
            inflight = policy.send(guesses, arm)
            guesses, arm = [], None
            if inflight.arm == ASYNC and policy.pipelines:
                continue
        rnd, inflight = inflight, None
        true = yield from policy.verify(rnd)
        if true is None:  # the verification failed: the policy dropped the round
            continue
        committed, matched = settle([policy.value(g) for g in rnd.guesses], true)
        settled = Settled(committed, matched, len(rnd.guesses))
        if settled.wrong:
            settled.thrown = guesses
            policy.rollback(rnd, settled)
            guesses = []
        if (yield from policy.commit(rnd, settled)):
            return
