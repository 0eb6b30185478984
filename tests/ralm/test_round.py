"""The shared speculation round (augment/round.py) on a toy policy: the output is the true sequence whatever is
guessed, rounds end at the first wrong guess, an async round's pipelined guesses are thrown away by its rollback;
checked against a brute-force reference of sync rounds."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from generation_service.augment.round import Round, Settled, run_rounds, settle
from generation_service.augment.round_gate import ASYNC, SEQUENTIAL, SYNC
from generation_service.engine.effects import Emit, Wait


@dataclass
class ToyGuess:
    pos: int  # position in the output
    value: int


class ToyPending:
    """A verification answered after `polls` calls of done() (0: at once)."""

    def __init__(self, polls: int):
        self.polls = polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def finish(self) -> None:
        self.polls = -1


class ToyPolicy:
    """Guesses the true sequence, except at the positions in `wrong`; arms[i] is the i-th round's kind (the last
    one repeats). Records what the round did."""

    pipelines = True

    def __init__(self, truth: list[int], wrong: set[int], stride: int, arms: list[str], max_new: int, polls: int = 0):
        self.truth, self.wrong, self.stride, self.arms, self.max_new, self.polls = truth, wrong, stride, arms, \
            max_new, polls
        self.pos = 0  # output + unverified guesses
        self.n_out = 0
        self.rounds: list[tuple[str, int, int]] = []  # (kind, guesses, matched)
        self.thrown = 0  # guesses of a next round thrown away by a rollback
        self.beside = 0  # guesses made while a verification was in flight
        self.begun = 0

    def cancelled(self) -> bool:
        return False

    def cancel(self, rnd: Round) -> None:
        raise AssertionError("never cancelled")

    def begin(self, arm: str | None) -> tuple[int, str]:
        if arm is None:
            arm = self.arms[min(self.begun, len(self.arms) - 1)]
            self.begun += 1
        return self.stride, arm

    def sequential(self):
        self.rounds.append((SEQUENTIAL, 0, 0))
        self.pos += 1
        return (yield from self._emit([self.truth[self.n_out]]))

    def may_guess(self, guesses: list[ToyGuess], inflight: Round | None) -> bool:
        unverified = len(guesses) + (len(inflight.guesses) if inflight else 0)
        return unverified < self.max_new - self.n_out and not (inflight and inflight.pending.done())

    def guess(self, inflight: Round | None):
        self.beside += inflight is not None
        pos, self.pos = self.pos, self.pos + 1
        return ToyGuess(pos, self.truth[pos] + (100 if pos in self.wrong else 0))
        yield  # a generator, as a mode's guess is (its LM pass)

    def value(self, g: ToyGuess) -> int:
        return g.value

    def send(self, guesses: list[ToyGuess], arm: str) -> Round:
        return Round(guesses, ToyPending(self.polls), arm)

    def verify(self, rnd: Round):
        if not rnd.pending.done():
            yield Wait(rnd.pending)
        return [self.truth[g.pos] for g in rnd.guesses]

    def rollback(self, rnd: Round, settled: Settled) -> None:
        self.thrown += len(settled.thrown)
        self.pos = self.n_out + len(settled.committed)

    def commit(self, rnd: Round, settled: Settled):
        self.rounds.append((rnd.arm, settled.guessed, settled.matched))
        return (yield from self._emit(settled.committed))

    def _emit(self, values: list[int]):
        out = values[:self.max_new - self.n_out]
        self.n_out += len(out)
        finish = "length" if self.n_out >= self.max_new else None
        yield Emit(out, finish)
        return finish


def run(policy: ToyPolicy) -> list[int]:
    """Step the round's effects: Emits collected, a Wait answers the pending verification."""
    out: list[int] = []
    loop = run_rounds(policy)
    effect = next(loop)
    while True:
        if isinstance(effect, Emit):
            out += effect.tokens
        elif isinstance(effect, Wait):
            effect.future.finish()
        else:
            raise AssertionError(f"unexpected effect {effect!r}")
        try:
            effect = loop.send(None)
        except StopIteration:
            return out


def reference_sync_rounds(wrong: set[int], stride: int, max_new: int) -> list[tuple[str, int, int]]:
    """Brute force: sync rounds of min(stride, budget left) guesses, each ending at its first wrong guess."""
    rounds, pos = [], 0
    while pos < max_new:
        n = min(stride, max_new - pos)
        bad = [i for i in range(n) if pos + i in wrong]
        matched = bad[0] if bad else n
        rounds.append((SYNC, n, matched))
        pos += matched + (matched < n)
    return rounds


TRUTH = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


@pytest.mark.parametrize("settled_in, expected", [
    (([7, 7, 9], [7, 7, 4]), ([7, 7, 4], 2)),  # wrong at the end: its true value. Not ([7, 7, 9], 2)
    (([5, 7, 7], [4, 7, 7]), ([4], 0)),  # first wrong: nothing after it. Not ([4, 7, 7], 2)
    (([7, 7], [7, 7]), ([7, 7], 2)),  # all right. Not ([7], 1)
])
def test_settle(settled_in, expected):
    assert settle(*settled_in) == expected


@pytest.mark.parametrize("wrong, stride, max_new, rounds", [
    # All guesses right: rounds of the stride, the last one cut to the budget.
    (set(), 3, 7, [(SYNC, 3, 3), (SYNC, 3, 3), (SYNC, 1, 1)]),  # Not a guess beyond the 7 tokens
    # First guess wrong: the round commits only the true first value, the next starts after it.
    ({0}, 3, 5, [(SYNC, 3, 0), (SYNC, 3, 3), (SYNC, 1, 1)]),  # Not (SYNC, 3, 2): nothing after a wrong guess counts
    # Wrong at the end of a round: all three committed (the last one corrected).
    ({2}, 3, 6, [(SYNC, 3, 2), (SYNC, 3, 3)]),
    # Every guess wrong: one value per round.
    ({0, 1, 2}, 2, 3, [(SYNC, 2, 0), (SYNC, 2, 0), (SYNC, 1, 0)]),
])
def test_sync_rounds(wrong, stride, max_new, rounds):
    policy = ToyPolicy(TRUTH, wrong, stride, [SYNC], max_new)
    assert run(policy) == TRUTH[:max_new]  # Not a wrong guess's value
    assert policy.rounds == rounds == reference_sync_rounds(wrong, stride, max_new)
    assert policy.beside == 0 and policy.thrown == 0


@pytest.mark.parametrize("seed", range(20))
def test_sync_rounds_match_the_reference(seed):
    rng = random.Random(seed)
    max_new, stride = rng.randint(1, len(TRUTH)), rng.randint(1, 4)
    wrong = {i for i in range(max_new) if rng.random() < 0.3}
    policy = ToyPolicy(TRUTH, wrong, stride, [SYNC], max_new)
    assert run(policy) == TRUTH[:max_new]
    assert policy.rounds == reference_sync_rounds(wrong, stride, max_new)


@pytest.mark.parametrize("wrong, polls, rounds, beside, thrown", [
    # Pending for 2 polls: the next round guesses 2 values beside it; all right, so they are kept and the next
    # round sends them with one more.
    (set(), 2, [(ASYNC, 3, 3), (ASYNC, 3, 3)], 2, 0),
    # The first round wrong at its end: the guesses made beside it are thrown away.
    ({2}, 2, [(ASYNC, 3, 2), (ASYNC, 3, 3)], 2, 2),  # Not thrown 0: those guesses read a wrong context
    # Answered at once: nothing is guessed beside it; the last round is cut to the budget.
    ({1}, 0, [(ASYNC, 3, 1), (ASYNC, 3, 3), (ASYNC, 1, 1)], 0, 0),
])
def test_async_rounds(wrong, polls, rounds, beside, thrown):
    policy = ToyPolicy(TRUTH, wrong, 3, [ASYNC], 6, polls=polls)
    assert run(policy) == TRUTH[:6]
    assert policy.rounds == rounds
    assert (policy.beside, policy.thrown) == (beside, thrown)


def test_sequential_steps_between_rounds():
    policy = ToyPolicy(TRUTH, {4}, 2, [SEQUENTIAL, SYNC, SEQUENTIAL, SYNC], 6)
    assert run(policy) == TRUTH[:6]
    # Not (SYNC, 2, 1) for the fourth: its first guess (position 4) is the wrong one.
    assert policy.rounds == [(SEQUENTIAL, 0, 0), (SYNC, 2, 2), (SEQUENTIAL, 0, 0), (SYNC, 2, 0), (SYNC, 1, 1)]
