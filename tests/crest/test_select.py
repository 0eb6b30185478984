"""Selection rules: single-n top-t, combined equal t per n, and sizing by a byte budget."""

import pytest

from retrieval_service.datastore.crest_build import CandidatePool, choose_take, write_from_pool
from retrieval_service.datastore.ngram_count import count_ngrams
from retrieval_service.datastore.ngram_select import largest_t_within, take_for
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore


def test_take_scenarios():
    available = {1: 3, 2: 10, 3: 7}
    # Combined: the same t for every n, capped where a corpus has fewer n-grams.
    assert take_for(available, "combined", 5) == {1: 3, 2: 5, 3: 5}  # Not {1: 5, ...} nor a total of 5
    # Single: only that n.
    assert take_for(available, "single", 5, n=2) == {2: 5}  # Not {1: 5} or every n
    assert take_for(available, "single", 50, n=3) == {3: 7}
    assert take_for(available, "combined", 0) == {1: 0, 2: 0, 3: 0}


def test_take_rejects_bad_arguments():
    with pytest.raises(ValueError, match="strategy must be one of .* got 'both'"):
        take_for({1: 3}, "both", 1)
    with pytest.raises(ValueError, match="needs n in \\[1, 1\\], got 2"):
        take_for({1: 3}, "single", 1, n=2)
    with pytest.raises(ValueError, match="do not pass n"):
        take_for({1: 3}, "combined", 1, n=1)
    with pytest.raises(ValueError, match="t must be an integer >= 0, got -1"):
        take_for({1: 3}, "combined", -1)


def test_largest_t_within_scenarios():
    size = lambda t: 100 + 10 * t  # noqa: E731
    assert largest_t_within(155, size, 1000) == 5  # Not 6 (160 > 155)
    assert largest_t_within(160, size, 1000) == 6  # exactly on the budget fits
    assert largest_t_within(10**9, size, 7) == 7  # capped by the candidates
    with pytest.raises(ValueError, match="budget 99 bytes is below the smallest possible store \\(100 bytes\\)"):
        largest_t_within(99, size, 10)


@pytest.mark.parametrize("strategy,n", [("combined", None), ("single", 2)])
def test_budget_gives_the_largest_store_that_fits(small_ds, tmp_path, strategy, n):
    counts = count_ngrams(small_ds, 3, 500, progress=False)
    pool = CandidatePool(small_ds, counts, compression="none", progress=False)
    full_t, full = choose_take(pool, strategy, t=500, n=n)
    full_size = pool.size(full, {**pool.meta(strategy, n), "t": 0})
    budget = full_size * 2 // 3
    t, take = choose_take(pool, strategy, budget=budget, n=n)
    path = write_from_pool(pool, tmp_path / "b.crest", strategy, t, take, n)
    store = EmbeddedNgramStore.open(path)
    assert path.stat().st_size <= budget  # Not over the budget
    assert pool.size(take_for(pool.available, strategy, t + 1, n), {**pool.meta(strategy, n), "t": 0}) > budget
    assert path.stat().st_size == pool.size(take, {**pool.meta(strategy, n), "t": 0})  # the size formula is exact
    per_n = {int(k): v for k, v in store.header["ngrams_per_n"].items() if v}
    if strategy == "single":
        assert set(per_n) == {2}  # Not other n
    else:
        assert all(v == min(t, pool.available[k]) for k, v in per_n.items())  # equal t per n
    # The kept n-grams are the most frequent ones of their n.
    keys = [tuple(k.tolist()) for k, _ in store.items()]
    want = [tuple(r.tolist()) for m in sorted(take) for r in counts.ngrams[m][:take[m]]]
    assert keys == want
