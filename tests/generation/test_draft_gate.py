"""engine/draft_gate.py: remote drafts in a batch only where measured steps say they pay."""

from __future__ import annotations

import pytest

from generation_service.engine.draft_gate import LOCAL, NONE, REMOTE, DraftGate, bucket


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32)])
def test_bucket(n, expected):
    assert bucket(n) == expected


ARMS = (REMOTE, LOCAL)


def _measured(on_rate: float, off_rate: float, n: int = 8) -> DraftGate:
    g = DraftGate(explore=4)
    assert g.choose(n, ARMS) == REMOTE  # nothing measured: with remote drafts first
    g.record(n, REMOTE, int(on_rate * 100), 100.0)
    assert g.choose(n, ARMS) == LOCAL  # then without
    g.record(n, LOCAL, int(off_rate * 100), 100.0)
    return g


# (tokens/ms with remote drafts, without) -> the choices of steps 3..6 (after one measured step each; explore = 4:
# a runner-up within `near` of the best waits 2 steps after its last run, a far one 4).
SCENARIOS = [
    ("drafts pay", 1.5, 1.0, [REMOTE, REMOTE, REMOTE, LOCAL]),
    ("drafts cost more than they bring", 0.8, 1.0, [LOCAL, LOCAL, REMOTE, LOCAL]),
    ("a tie keeps drafting, and tries the other every other step", 1.0, 1.0, [REMOTE, LOCAL, REMOTE, LOCAL]),
]


@pytest.mark.parametrize("name,on,off,steps", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_picks_the_measured_better_and_tries_the_other_after_its_wait(name, on, off, steps):
    g = _measured(on, off)
    got = [g.choose(8, ARMS) for _ in range(4)]
    assert got == steps
    assert set(got) == set(ARMS)  # not: the worse one never tried again


def test_buckets_are_measured_apart_and_bad_samples_ignored():
    g = _measured(0.5, 1.0, n=16)
    assert g.choose(16, ARMS) == LOCAL
    assert g.choose(2, ARMS) == REMOTE  # a small batch has not been measured: it starts with drafts
    g.record(2, REMOTE, 10, 0.0)  # no time: ignored, not a division by zero
    assert (2, REMOTE) not in g.rate


# (an arm's steps in order as (tokens, ms), the rate it must have, a rate it must not have)
RATE_SCENARIOS = {
    "one step: its rate": ([(150, 100.0)], 1.5, 0.0),
    "tokens over time, not a mean of step rates": ([(100, 100.0), (100, 25.0)], 200 / 125, (1.0 + 4.0) / 2),
    "a slow step counts by its time": ([(150, 100.0)] * 10 + [(20, 300.0)], 1520 / 1300, 1.5),
    "steps past the window are forgotten": ([(20, 100.0)] * 40 + [(120, 100.0)] * 32, 1.2, 0.2),
}


@pytest.mark.parametrize("name", list(RATE_SCENARIOS))
def test_rate_is_tokens_over_time_of_the_last_steps(name):
    steps, want, not_want = RATE_SCENARIOS[name]
    g = DraftGate()
    for tokens, ms in steps:
        g.record(8, REMOTE, tokens, ms)
    assert g.rate[(8, REMOTE)] == pytest.approx(want) and g.rate[(8, REMOTE)] != pytest.approx(not_want)


def test_one_slow_step_does_not_flip_the_choice():
    """The failure this estimator replaced: the best arm's one descheduled step handed the steps to a worse arm."""
    g = DraftGate(explore=1000)
    for _ in range(12):
        g.record(8, LOCAL, 130, 100.0)  # in-process drafts: 1.3x the AR pass
        g.record(8, NONE, 95, 100.0)
    g.record(8, LOCAL, 20, 100.0)  # one step 6x slower than usual
    assert [g.choose(8, (LOCAL, NONE)) for _ in range(5)] == [LOCAL] * 5  # Not: NONE until an explore step


def _run(g: DraftGate, rates: dict[str, float], steps: int, n: int = 8) -> list[str]:
    """`steps` steps of a bucket, each arm emitting at its fixed rate: the arms chosen, in order."""
    chosen = []
    for _ in range(steps):
        arm = g.choose(n, tuple(rates))
        g.record(n, arm, int(rates[arm] * 100), 100.0)
        chosen.append(arm)
    return chosen


def test_no_drafting_wins_where_it_is_fastest_and_every_other_arm_is_still_tried():
    g = DraftGate(explore=4)
    arms = {REMOTE: 0.7, LOCAL: 0.8, NONE: 1.0}  # a big batch: drafting costs more than its nodes bring
    steps = _run(g, arms, 40, n=16)
    assert steps[:3] == [REMOTE, LOCAL, NONE]  # each measured once, in order
    assert steps.count(NONE) >= 32  # the AR step, Not drafts that do not pay
    assert {REMOTE, LOCAL} <= set(steps[3:])  # Not one arm never measured again


# (the arms' rates, steps) -> how often the worse arm runs in them: at most, and more than (its first measurement
# included). Losing trials double its wait (16, 32, ... up to max_wait 256): over 1000 steps 1 + 6 runs, not the 62
# of a fixed wait of 16; a close runner-up starts at a wait of 4.
BACKOFF_SCENARIOS = {
    "far and losing: ever rarer": ({NONE: 1.0, LOCAL: 0.8}, 1000, 8, 4),
    "close and losing: ever rarer too": ({NONE: 1.0, LOCAL: 0.95}, 1000, 10, 5),
    "far and losing, a short run: its first trials": ({NONE: 1.0, LOCAL: 0.7}, 34, 3, 1),
}


@pytest.mark.parametrize("name", list(BACKOFF_SCENARIOS))
def test_a_losing_arm_is_tried_ever_less_often(name):
    rates, n_steps, at_most, more_than = BACKOFF_SCENARIOS[name]
    worse = min(rates, key=rates.get)
    runs = _run(DraftGate(), rates, n_steps).count(worse)
    assert more_than < runs <= at_most


def test_a_winning_trial_is_repeated_soon_and_the_arm_takes_over():
    """In-process drafts now pay (1.3x AR), but their window still holds a slow phase (0.5): their trials win, so
    they are tried after the short wait, and their rate catches up within a few dozen trials, not hundreds."""
    g = DraftGate()
    for _ in range(32):
        g.record(8, LOCAL, 50, 100.0)
        g.record(8, NONE, 100, 100.0)
    steps = _run(g, {LOCAL: 1.3, NONE: 1.0}, 200)
    took_over = next(i for i in range(len(steps)) if steps[i:i + 20] == [LOCAL] * 20)
    assert took_over < 120  # Not: ~320 steps at one trial every 16
    assert steps[-50:].count(LOCAL) >= 45


def test_a_losing_trial_lengthens_only_that_arms_wait():
    g = DraftGate(explore=4, max_wait=16)
    _run(g, {LOCAL: 0.5, REMOTE: 0.6, NONE: 1.0}, 60)
    assert g.wait(8, LOCAL, NONE) == 16 and g.wait(8, REMOTE, NONE) == 16  # capped at max_wait
    g.record(8, NONE, 100, 100.0)
    g.trial[8] = (REMOTE, 1.0)
    g.record(8, REMOTE, 120, 100.0)  # a trial faster than the best: its next trial comes soon
    assert g.wait(8, REMOTE, NONE) == 2 and g.wait(8, LOCAL, NONE) == 16


def test_report_counts_each_arms_steps_per_bucket():
    g = _measured(1.5, 1.0)  # steps 1, 2: remote, local
    for _ in range(4):  # steps 3..6: remote, remote, remote, local (its first trial)
        g.choose(8, ARMS)
    g.choose(2, (LOCAL, NONE))  # another bucket, nothing measured there yet
    assert g.chosen == {(8, REMOTE): 4, (8, LOCAL): 2, (2, LOCAL): 1}
    report = g.report()
    assert report == "2 decoding: local 100% at rate 0.000; 8 decoding: local 33% at rate 1.000, remote 67% at " \
                     "rate 1.500"
    assert "none" not in report  # an arm that never ran is not reported


def test_rates_relative_to_the_ar_pass_compare_batch_sizes_of_one_bucket():
    """9 and 16 requests share bucket 16. AR passes over 16 rows take 50 ms, over 9 rows 32 ms (16 tokens in 50 ms,
    9 in 32: raw rates 0.32 and 0.28). An arm measured at 9 requests that is as fast as AR there must not look worse
    than an arm measured at 16 that is 10 % slower than AR."""
    raw, rel = DraftGate(), DraftGate()
    for g, ar in ((raw, (0.0, 0.0)), (rel, (32.0, 50.0))):
        g.record(9, NONE, 9, 32.0, ar[0])  # exactly the AR pass at 9 requests
        g.record(16, REMOTE, 16, 55.0, ar[1])  # 10 % slower than the AR pass at 16
    assert raw.rate[(16, REMOTE)] > raw.rate[(16, NONE)]  # raw: the batch size decides (the bias)
    assert rel.rate[(16, NONE)] == pytest.approx(1.0)
    assert rel.rate[(16, REMOTE)] == pytest.approx(50.0 / 55.0)
    assert rel.rate[(16, NONE)] > rel.rate[(16, REMOTE)]  # relative: the arm decides
