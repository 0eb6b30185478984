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


# (tokens/ms with remote drafts, without) -> the choice on the next three steps, then the exploring fourth.
SCENARIOS = [
    ("drafts pay", 1.5, 1.0, [REMOTE, LOCAL]),
    ("drafts cost more than they bring", 0.8, 1.0, [LOCAL, REMOTE]),
    ("a tie keeps drafting, and tries the other every other step", 1.0, 1.0, [REMOTE, LOCAL]),
]


@pytest.mark.parametrize("name,on,off,choice", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_picks_the_measured_better_and_explores_the_other(name, on, off, choice):
    g = _measured(on, off)
    better, other = choice
    steps = [g.choose(8, ARMS) for _ in range(4)]  # steps 3..6 of the bucket; 4 is an explore step (k % 4 == 0)
    near = g.rate[(8, other)] >= g.near * g.rate[(8, better)]  # a close runner-up is also tried on even steps
    assert steps == [better, other, better, other if near else better]
    assert other != better  # not: the worse one never tried again


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


def test_no_drafting_wins_where_it_is_fastest_and_every_other_arm_is_still_explored():
    g = DraftGate(explore=4)
    arms = (REMOTE, LOCAL, NONE)
    for arm, rate in zip(arms, (0.7, 0.8, 1.0)):  # a big batch: drafting costs more than its nodes bring
        assert g.choose(16, arms) == arm  # each measured once, in order
        g.record(16, arm, int(rate * 100), 100.0)
    steps = [g.choose(16, arms) for _ in range(13)]  # steps 4..16 of the bucket: explores at 4, 8, 12, 16
    assert steps.count(NONE) == 9  # the AR step, Not drafts that do not pay
    assert {a for a in steps if a != NONE} == {REMOTE, LOCAL}  # Not one arm never measured again


# runner-up's rate against the best's 1.0 -> how often it runs in steps 3..34 of a bucket (explore = 16)
RUNNER_UP_SCENARIOS = {
    "close: every 4th step": (0.95, 8),
    "far: every 16th step only": (0.7, 2),
}


@pytest.mark.parametrize("name", list(RUNNER_UP_SCENARIOS))
def test_a_close_runner_up_is_tried_often_a_far_one_rarely(name):
    rate, runs = RUNNER_UP_SCENARIOS[name]
    g = DraftGate()
    for arm, r in ((LOCAL, 1.0), (NONE, rate)):
        assert g.choose(8, (LOCAL, NONE)) == arm
        g.record(8, arm, int(r * 100), 100.0)
    steps = [g.choose(8, (LOCAL, NONE)) for _ in range(32)]
    assert steps.count(NONE) == runs and steps.count(LOCAL) == 32 - runs


def test_report_counts_each_arms_steps_per_bucket():
    g = _measured(1.5, 1.0)  # steps 1, 2: remote, local
    for _ in range(4):  # steps 3..6: remote, local (explore), remote, remote
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
