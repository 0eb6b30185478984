"""Which n-grams a CREST store keeps: how many of the most frequent n-grams of each n (a "take").

Strategies (CREST's paper compares them; "combined" was its best):
    single    the t most frequent n-grams of one n
    combined  an equal number t of the most frequent n-grams for every n = 1..m (fewer where a corpus has fewer)
A store's size grows monotonically with t, so a byte budget is met by the largest t whose store fits.

    take_for(available={1: 3, 2: 10}, strategy="combined", t=5)   -> {1: 3, 2: 5}
    take_for(available={1: 3, 2: 10}, strategy="single", t=5, n=2) -> {2: 5}
"""

from __future__ import annotations

from typing import Callable

STRATEGIES = ("combined", "single")


def check_strategy(strategy: str, n: int | None, max_n: int) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "single" and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_n):
        raise ValueError(f"strategy 'single' needs n in [1, {max_n}], got {n!r}")
    if strategy == "combined" and n is not None:
        raise ValueError(f"strategy 'combined' takes every n = 1..{max_n}; do not pass n (got {n!r})")


def take_for(available: dict[int, int], strategy: str, t: int, n: int | None = None) -> dict[int, int]:
    """available: n -> candidate n-grams (most frequent first) -> n -> how many of them to keep."""
    if isinstance(t, bool) or not isinstance(t, int) or t < 0:
        raise ValueError(f"t must be an integer >= 0, got {t!r}")
    check_strategy(strategy, n, max(available, default=0))
    if strategy == "single":
        return {n: min(t, available.get(n, 0))}
    return {k: min(t, c) for k, c in sorted(available.items())}


def largest_t_within(budget: int, size_of: Callable[[int], int], t_max: int) -> int:
    """Largest t in [0, t_max] with size_of(t) <= budget (size_of non-decreasing); ValueError if even t = 0 is over.

    Binary search: O(log t_max) evaluations of size_of.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an integer number of bytes >= 1, got {budget!r}")
    floor = size_of(0)
    if floor > budget:
        raise ValueError(f"budget {budget:,} bytes is below the smallest possible store ({floor:,} bytes)")
    lo, hi = 0, t_max  # size_of(lo) <= budget
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size_of(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo
