"""bench.serving's repeats: the run of median ms stands for a (prompt, method), and ar's odd against its even runs
is the noise floor a per-prompt ratio is held against."""

from __future__ import annotations

import pytest

from bench.serving import against_itself, median_run


def run(ms: float, tokens: tuple[int, ...] = (1, 2)) -> dict:
    return {"ms": ms, "token_ids": list(tokens)}


@pytest.mark.parametrize("ms, expected, not_expected", [
    ([5.0, 3.0, 4.0], 4.0, 5.0),  # the median run, Not the first one
    ([3.0, 5.0], 3.0, 4.0),  # an even count: the lower of the two middle runs (a real run), Not their mean
    ([7.0], 7.0, None),
])
def test_median_run(ms, expected, not_expected):
    got = median_run([run(m) for m in ms])
    assert got["ms"] == expected != not_expected
    assert got["ms_runs"] == ms and got["runs_identical"]


def test_median_run_says_when_repeats_differ():
    got = median_run([run(1.0, (1, 2)), run(2.0, (1, 3))])
    assert got["runs_identical"] is False  # Not hidden behind the median run's own tokens


@pytest.mark.parametrize("runs, median, worst", [
    ([[10.0, 10.0, 10.0, 10.0], [10.0, 10.0]], 1.0, 1.0),  # no noise
    ([[10.0, 12.0], [12.0, 10.0]], 10 / 12, 10 / 12),  # faster or slower by chance: both count as 1/1.2
    ([[10.0, 11.0, 10.0, 11.0], [8.0, 10.0, 8.0, 10.0], [10.0, 10.0, 10.0, 10.0]], 10 / 11, 0.8),
])
def test_against_itself(runs, median, worst):
    per_prompt = [{"ar": median_run([run(m) for m in ms])} for ms in runs]
    got = against_itself(per_prompt)
    assert got["median"] == pytest.approx(median) and got["worst"] == pytest.approx(worst)
    assert got["repeats"] == len(runs[0])


def test_against_itself_needs_two_repeats():
    assert against_itself([{"ar": median_run([run(10.0)])}]) is None  # Not a floor of 1.0 from a single run
