"""RaLMSpec's kNN-LM cache: spatial-locality fill (entries j+1..j+n after each retrieved j), eviction of the
oldest fills, and exact nearest-neighbour look-up among the cached entries (brute force as the reference)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from generation_service.knnlm.cache import NeighbourCache, key_norms, oldest


@pytest.mark.parametrize("retrieved, n, expected", [
    ([5], 3, [6, 7, 8]),               # Not [5, 6, 7]: entry j itself predicted the *current* token
    ([5, 6], 3, [6, 7, 8, 9]),         # overlapping runs are cached once
    ([5, 100], 2, [6, 7, 101, 102]),   # one run per retrieved entry
    ("last", 3, []),                   # nothing after the last entry
    ("near_end", 3, ["n-1"]),          # a run is clipped at the datastore's end, not wrapped to entry 0
])
def test_fill_takes_the_next_n_entries(ds, retrieved, n, expected):
    size = ds.size
    if retrieved == "last":
        retrieved = [size - 1]
    elif retrieved == "near_end":
        retrieved = [size - 2]
    expected = [size - 1 if e == "n-1" else e for e in expected]
    cache = NeighbourCache(ds, next_n=n, capacity=64)
    assert cache.fill(np.array(retrieved)) == len(expected)
    assert cache.cached_ids().tolist() == expected
    # Cached keys/values are the datastore's rows of those ids.
    slots = np.argsort(cache.ids)[-len(expected):] if expected else []
    for s in slots:
        j = int(cache.ids[s])
        assert int(cache.values[s]) == int(ds.values[j])
        np.testing.assert_array_equal(cache.keys[s].float().numpy(), np.asarray(ds.keys[j], np.float32))


@pytest.mark.parametrize("fill_top, expected, not_expected", [
    (0, [6, 7, 51, 52, 91, 92], []),   # every retrieved entry's successors
    (2, [6, 7, 91, 92], [51, 52]),     # the best two (retrieved best first: 90, 5), not the third
    (1, [91, 92], [6, 7]),
])
def test_fill_top_keeps_the_best_entries_successors(ds, fill_top, expected, not_expected):
    cache = NeighbourCache(ds, next_n=2, capacity=64, fill_top=fill_top)
    cache.fill(np.array([90, 5, 50]))  # a Search's order: closest first, not ascending ids
    assert cache.cached_ids().tolist() == expected
    assert not set(not_expected) & set(cache.cached_ids().tolist())


def test_refill_counts_only_new_entries(ds):
    cache = NeighbourCache(ds, next_n=4, capacity=64)
    assert cache.fill(np.array([10])) == 4   # 11..14
    assert cache.fill(np.array([11])) == 1   # 12..15: only 15 is new
    assert cache.cached_ids().tolist() == [11, 12, 13, 14, 15]
    assert len(cache) == 5


def test_eviction_drops_the_oldest_fill(ds):
    cache = NeighbourCache(ds, next_n=3, capacity=6)
    cache.fill(np.array([0]))    # round 1: 1, 2, 3
    cache.fill(np.array([10]))   # round 2: 11, 12, 13 (full)
    cache.fill(np.array([0]))    # round 3: 1, 2, 3 refreshed, nothing new
    cache.fill(np.array([20]))   # round 4: 21, 22, 23 replace round 2's entries
    assert cache.cached_ids().tolist() == [1, 2, 3, 21, 22, 23]  # Not [11, 12, 13, ...]: those are the oldest
    assert len(cache) == 6


def rounding_bound(query: np.ndarray, keys: np.ndarray) -> float:
    """How far a cached score may be from the exact one: 2·q·key rounded to float16 (float32 keys: to float32)."""
    eps = 2.0 ** -11 if keys.dtype == np.float16 else 2.0 ** -23
    return 4.0 * eps * float(np.abs(keys.astype(np.float64) @ query.astype(np.float64)).max()) + 1e-3


@pytest.mark.parametrize("k, dtype, scale", [
    (1, "float16", 1.0), (5, "float16", 1.0), (40, "float16", 1.0), (1000, "float16", 1.0),
    (40, "float32", 1.0),     # a datastore built with --dtype float32: float32 products
    (40, "float16", 3000.0),  # |q·key| far past float16's 65504: scaled, not inf
])
def test_nearest_matches_brute_force(ds, k, dtype, scale):
    ds = replace(ds, keys=np.asarray(ds.keys, dtype))
    cache = NeighbourCache(ds, next_n=10, capacity=4096)
    cache.fill(np.arange(0, ds.size, 17))
    ids = cache.cached_ids()
    query = (np.asarray(ds.keys[ids[3]], np.float32) + 0.01) * np.float32(scale)  # scale 1: near a cached entry
    got_ids, got_scores, got_values = cache.nearest(query, k)
    keys = np.asarray(ds.keys[ids])
    d = ((keys.astype(np.float64) - query.astype(np.float64)) ** 2).sum(1)  # [n] exact, by id order
    tol = rounding_bound(query, keys)
    d_of = dict(zip(ids.tolist(), d))
    kth = np.sort(d)[min(k, len(d)) - 1]
    assert len(got_ids) == min(k, len(ids)) and len(set(got_ids.tolist())) == len(got_ids)
    # A brute-force top k up to the rounding: nothing returned is farther than the k-th by more than it, nothing
    # left out is nearer by more than it. Not the k entries nearest to an entry far away.
    assert all(d_of[j] <= kth + tol for j in got_ids.tolist())
    assert set(ids[d < kth - tol].tolist()) <= set(got_ids.tolist())
    assert scale != 1.0 or got_ids[0] == ids[3]  # Not another entry: the query sits on this one
    assert np.isfinite(got_scores).all()
    np.testing.assert_allclose(-got_scores, [d_of[j] for j in got_ids.tolist()], rtol=1e-3, atol=tol)
    assert np.all(np.diff(got_scores) <= 0)  # best first
    assert got_values.tolist() == np.asarray(ds.values[got_ids]).tolist()


def test_empty_cache_returns_nothing(ds):
    ids, scores, values = NeighbourCache(ds).nearest(np.zeros(ds.dim, np.float32), 8)
    assert ids.size == scores.size == values.size == 0


@pytest.mark.parametrize("runs", [
    [[5], [6], [7]],             # consecutive queries: overlapping successor runs
    [[5, 40], [100], [41, 6]],
    [[3], []],                   # a query without hits
])
def test_fill_many_equals_successive_fills(ds, runs):
    one, many = NeighbourCache(ds, next_n=4, capacity=64), NeighbourCache(ds, next_n=4, capacity=64)
    added = sum(one.fill(np.array(r, np.int64)) for r in runs)
    assert many.fill_many([np.array(r, np.int64) for r in runs]) == added
    assert many.cached_ids().tolist() == one.cached_ids().tolist()
    for cache in (one, many):  # rows match the datastore
        for s in np.flatnonzero(cache.ids >= 0):
            assert int(cache.values[s]) == int(ds.values[cache.ids[s]])


def test_fill_many_keeps_the_latest_queries_when_full(ds):
    cache = NeighbourCache(ds, next_n=3, capacity=4)
    cache.fill_many([np.array([0]), np.array([10]), np.array([20])])
    # The last query's run (21..23) and the newest of the rest; not entries 1..3 of the first query.
    assert cache.cached_ids().tolist() == [11, 21, 22, 23]


def reference_fill_order(runs: list[list[int]], next_n: int, size: int, capacity: int, fill_top: int = 0) -> list[int]:
    """Brute force of the ids one fill_many keeps, in priority order: each query's successors ascending (of its
    first `fill_top` retrieved entries, the best; 0 = all), latest query first, an id once (at its latest query),
    the first `capacity` of them."""
    order: list[int] = []
    for r in reversed(runs):
        best = r[:fill_top] if fill_top else r
        for j in sorted({j + i for j in best for i in range(1, next_n + 1) if j + i < size}):
            if j not in order:
                order.append(j)
    return order[:capacity]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rounds=st.lists(st.lists(st.lists(st.integers(0, 120), max_size=6), min_size=1, max_size=4),
                       min_size=1, max_size=5),
       next_n=st.integers(1, 5), capacity=st.integers(1, 24), datastore_norms=st.booleans(),
       fill_top=st.integers(0, 4))
def test_fill_many_matches_brute_force(ds, rounds, next_n, capacity, datastore_norms, fill_top):
    """Rounds of fills against a brute-force model of the cache: which ids are kept, refreshed and evicted; each
    cached row's key, value and ‖key‖², whether the norms come from the worker's array or from the filled rows;
    with every retrieved entry's successors or only the best `fill_top` entries'."""
    cache = NeighbourCache(ds, next_n=next_n, capacity=capacity, norms=key_norms(ds) if datastore_norms else None,
                           fill_top=fill_top)
    stamp: dict[int, int] = {}  # id -> last round that filled or refreshed it
    for rnd, runs in enumerate(rounds, start=1):
        wanted = reference_fill_order(runs, next_n, ds.size, capacity, fill_top)
        new = [j for j in wanted if j not in stamp]
        stamp.update({j: rnd for j in wanted})
        assert cache.fill_many([np.array(r, np.int64) for r in runs]) == len(new)
        cached = cache.cached_ids().tolist()
        assert set(wanted) <= set(cached)  # Not dropped: this round's ids always fit
        assert len(cached) == min(capacity, len(stamp))
        # Evicted ids are among the oldest stamps (ties between equally old entries may go either way).
        for j in set(stamp) - set(cached):
            assert stamp[j] <= min(stamp[c] for c in cached)
        stamp = {j: stamp[j] for j in cached}
    for s in np.flatnonzero(cache.ids >= 0):  # rows match the datastore
        assert int(cache.values[s]) == int(ds.values[cache.ids[s]])
        key = np.asarray(ds.keys[cache.ids[s]], np.float64)
        np.testing.assert_array_equal(cache.keys[s].float().numpy(), key.astype(np.float32))
        np.testing.assert_allclose(cache.norms[s], key @ key, rtol=1e-5)  # Not a stale slot's norm


def test_worker_norms_equal_the_fills_own(ds):
    """KnnBackend's precomputed ‖key‖² are the very numbers a fill computes from its rows (same function, float32
    sums), so a cache scores alike with or without them."""
    ids = np.arange(0, ds.size, 7)
    own, shared = NeighbourCache(ds, next_n=3, capacity=4096), NeighbourCache(ds, 3, 4096, norms=key_norms(ds))
    own.fill(ids)
    shared.fill(ids)
    np.testing.assert_array_equal(shared.ids, own.ids)
    np.testing.assert_array_equal(shared.norms.view(np.int32), own.norms.view(np.int32))  # bit for bit
    q = np.asarray(ds.keys[ids[5] + 1], np.float32)
    for a, b in zip(own.nearest(q, 50), shared.nearest(q, 50)):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(retrieved=st.lists(st.integers(0, 10**6), max_size=40), next_n=st.integers(1, 12), near_end=st.booleans())
def test_successors_match_brute_force(ds, retrieved, next_n, near_end):
    cache = NeighbourCache(ds, next_n=next_n, capacity=8)
    r = [ds.size - 1 - x % 15 if near_end else x % ds.size for x in retrieved]
    want = sorted({j + i for j in r for i in range(1, next_n + 1) if j + i < ds.size})
    got = cache.successors(np.array(r, np.int64))
    assert got.dtype == np.int64 and got.tolist() == want  # ascending, each id once, none past the end


@pytest.mark.parametrize("stamp, m, expected", [
    ([3, -1, 2, 3, 2], 3, [1, 2, 4]),        # empty slots first, then the oldest round; Not [0, ...] (round 3)
    ([5, 5, 5, 5], 2, [0, 1]),               # one round: its first slots
    ([1, 0, 1, 0], 4, [0, 1, 2, 3]),         # every slot
    ([2, 1], 0, []),
])
def test_oldest_slots(stamp, m, expected):
    assert sorted(oldest(np.array(stamp, np.int64), m).tolist()) == expected


@settings(max_examples=200, deadline=None)
@given(stamp=st.lists(st.integers(-1, 6), min_size=1, max_size=60), data=st.data())
def test_oldest_matches_a_stable_sort(stamp, data):
    m = data.draw(st.integers(0, len(stamp)))
    got = oldest(np.array(stamp, np.int64), m)
    assert sorted(got.tolist()) == sorted(np.argsort(stamp, kind="stable")[:m].tolist())
