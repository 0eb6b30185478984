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
    ("a tie keeps drafting", 1.0, 1.0, [REMOTE, LOCAL]),
]


@pytest.mark.parametrize("name,on,off,choice", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_picks_the_measured_better_and_explores_the_other(name, on, off, choice):
    g = _measured(on, off)
    better, other = choice
    steps = [g.choose(8, ARMS) for _ in range(4)]  # steps 3..6 of the bucket; 4 is an explore step (k % 4 == 0)
    assert steps == [better, other, better, better]
    assert other != better  # not: the worse one never tried again


def test_buckets_are_measured_apart_and_bad_samples_ignored():
    g = _measured(0.5, 1.0, n=16)
    assert g.choose(16, ARMS) == LOCAL
    assert g.choose(2, ARMS) == REMOTE  # a small batch has not been measured: it starts with drafts
    g.record(2, REMOTE, 10, 0.0)  # no time: ignored, not a division by zero
    assert (2, REMOTE) not in g.rate


def test_rates_are_averaged_so_one_outlier_does_not_flip_the_choice():
    g = _measured(1.5, 1.0)
    g.record(8, REMOTE, 10, 100.0)  # one slow step with drafts (0.1 tokens/ms)
    assert g.rate[(8, REMOTE)] == pytest.approx(0.8 * 1.5 + 0.2 * 0.1)
    assert g.rate[(8, REMOTE)] > g.rate[(8, LOCAL)]  # still the better one


def test_no_drafting_wins_where_it_is_fastest_and_every_other_arm_is_still_explored():
    g = DraftGate(explore=4)
    arms = (REMOTE, LOCAL, NONE)
    for arm, rate in zip(arms, (0.9, 0.95, 1.0)):  # a big batch: drafting costs more than its nodes bring
        assert g.choose(16, arms) == arm  # each measured once, in order
        g.record(16, arm, int(rate * 100), 100.0)
    steps = [g.choose(16, arms) for _ in range(13)]  # steps 4..16 of the bucket: explores at 4, 8, 12, 16
    assert steps.count(NONE) == 9  # the AR step, Not drafts that do not pay
    assert {a for a in steps if a != NONE} == {REMOTE, LOCAL}  # Not one arm never measured again


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
