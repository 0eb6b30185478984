"""engine/draft_gate.py: remote drafts in a batch only where measured steps say they pay."""

from __future__ import annotations

import pytest

from generation_service.engine.draft_gate import DraftGate, bucket


@pytest.mark.parametrize("n,expected", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (16, 16), (17, 32)])
def test_bucket(n, expected):
    assert bucket(n) == expected


def _measured(on_rate: float, off_rate: float, n: int = 8) -> DraftGate:
    g = DraftGate(explore=4)
    assert g.remote(n) is True  # nothing measured: with remote drafts first
    g.record(n, True, int(on_rate * 100), 100.0)
    assert g.remote(n) is False  # then without
    g.record(n, False, int(off_rate * 100), 100.0)
    return g


# (tokens/ms with remote drafts, without) -> the choice on the next three steps, then the exploring fourth.
SCENARIOS = [
    ("drafts pay", 1.5, 1.0, [True, False]),
    ("drafts cost more than they bring", 0.8, 1.0, [False, True]),
    ("a tie keeps drafting", 1.0, 1.0, [True, False]),
]


@pytest.mark.parametrize("name,on,off,choice", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_picks_the_measured_better_and_explores_the_other(name, on, off, choice):
    g = _measured(on, off)
    better, other = choice
    steps = [g.remote(8) for _ in range(4)]  # steps 3..6 of the bucket; 4 is an explore step (k % 4 == 0)
    assert steps == [better, other, better, better]
    assert other != better  # not: the worse one never tried again


def test_buckets_are_measured_apart_and_bad_samples_ignored():
    g = _measured(0.5, 1.0, n=16)
    assert g.remote(16) is False
    assert g.remote(2) is True  # a small batch has not been measured: it starts with drafts
    g.record(2, True, 10, 0.0)  # no time: ignored, not a division by zero
    assert (2, True) not in g.rate


def test_rates_are_averaged_so_one_outlier_does_not_flip_the_choice():
    g = _measured(1.5, 1.0)
    g.record(8, True, 10, 100.0)  # one slow step with drafts (0.1 tokens/ms)
    assert g.rate[(8, True)] == pytest.approx(0.8 * 1.5 + 0.2 * 0.1)
    assert g.rate[(8, True)] > g.rate[(8, False)]  # still the better one
