"""Bounded float16 scans (fp16_topk_bounded, fp16_scan.ScanBounds): the full scan's answer, bit for bit.

The reference is the full scan (tests/knowledge/test_fp16_scan.py checks it against brute force): a bounded search
must return the same ids and the same float32 scores, on every instruction set, whatever the data does to the
bounds; and on data with dominant directions it must score fewer rows (else the test could pass with no pruning).
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragcore.machine import best_level
from retrieval_service.knowledge import fp16_scan

# native (AVX-512 with VNNI's vpdpwssd where the CPU has it), x86-64-v4 (AVX-512 without VNNI: pmaddwd + add, the
# container's prebuilt AVX-512 level) where the CPU runs it, AVX2 and scalar.
LEVELS = ["native", "x86-64-v4", "x86-64-v3", "x86-64"]


def runnable(level: str) -> bool:
    return level != "x86-64-v4" or best_level(("x86-64-v4",)) == "x86-64-v4"


@pytest.fixture(scope="module", params=LEVELS)
def lib(request):
    if not runnable(request.param):
        pytest.skip(f"this CPU does not run {request.param}")
    return fp16_scan.load(request.param)


@pytest.fixture(autouse=True)
def small_indexes_are_bounded(monkeypatch):
    monkeypatch.setattr(fp16_scan, "BOUND_MIN_ROWS", 0)  # tests use thousands of rows, not millions


def low_rank(rng: np.random.Generator, n: int, d: int, rank: int = 6, noise: float = 0.05,
             scale: float = 1.0) -> np.ndarray:
    """Rows near a `rank`-dimensional subspace (hidden states have a few dominant directions)."""
    basis = rng.standard_normal((rank, d)) * np.linspace(3, 1, rank)[:, None]
    x = rng.standard_normal((n, rank)) @ basis + noise * rng.standard_normal((n, d))
    return (scale * x).astype(np.float16)


def data(kind: str, rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    if kind == "low rank":
        return low_rank(rng, n, d)
    if kind == "isotropic":
        return rng.standard_normal((n, d)).astype(np.float16)
    if kind == "integers, many ties":
        return rng.integers(-2, 3, (n, d)).astype(np.float16)
    if kind == "tiny values (float16 subnormals)":
        return low_rank(rng, n, d, scale=1e-4)
    if kind == "large values (squared norms beyond float16)":
        return low_rank(rng, n, d, scale=300.0)
    if kind == "duplicate rows":
        return np.repeat(low_rank(rng, n // 4, d), 4, axis=0)
    if kind == "a round of consecutive states":  # a kNN-LM round: each query a step further along one text
        return np.cumsum(low_rank(rng, n, d, noise=0.2).astype(np.float32) * 0.3, axis=0).astype(np.float16)
    raise ValueError(kind)


def assert_same(full, bounded) -> None:
    (s0, i0), (s1, i1) = full, bounded
    np.testing.assert_array_equal(i1, i0)
    np.testing.assert_array_equal(s1.view(np.int32), s0.view(np.int32))  # bit for bit, -inf padding included


# (scenario: data kind, n, d, queries, k, bound columns, threads)
CASES = [
    ("low rank", 6000, 64, 1, 20, 16, 1),
    ("low rank", 6000, 64, 9, 20, 16, 2),
    ("low rank", 20_000, 96, 3, 100, 32, 8),  # more threads than cores: tasks run twice, merged once
    ("isotropic", 5000, 48, 4, 30, 16, 2),  # the bounds prune little; the answer stays the full scan's
    ("integers, many ties", 5000, 32, 5, 25, 8, 2),
    ("tiny values (float16 subnormals)", 5000, 64, 3, 20, 16, 1),
    ("large values (squared norms beyond float16)", 5000, 64, 3, 20, 16, 1),
    ("duplicate rows", 6000, 64, 2, 30, 16, 2),
    ("low rank", 5000, 21, 2, 15, 8, 1),  # d not a multiple of 8 or 16: the exact score's scalar tail
    ("a round of consecutive states", 6000, 64, 8, 40, 16, 2),  # alike queries: their passing rows overlap
    ("a round of consecutive states", 6000, 64, 37, 40, 16, 2),  # more queries than one bit mask holds (32)
    # k large enough for step 1's sampled starting bar (starting_bars in fp16_scan.cpp)
    ("integers, many ties", 20_000, 32, 3, 200, 8, 2),
    ("a round of consecutive states", 30_000, 64, 8, 300, 16, 2),
    # bounds of more than kStreamBytes (8 MB): streamed to the workspace; n odd, so the query rows start unaligned
    ("low rank", 140_003, 16, 16, 20, 8, 2),
]


@pytest.mark.parametrize("kind, n, d, nq, k, dims, threads", CASES, ids=[f"{c[0]} n={c[1]} d={c[2]} q={c[3]}"
                                                                        for c in CASES])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_bounded_search_equals_the_full_scan(lib, kind, n, d, nq, k, dims, threads, metric, monkeypatch):
    rng = np.random.default_rng(n + d + nq)
    x = data(kind, rng, n, d)
    q = np.concatenate([data(kind, rng, nq - 1, d), x[:1]]).astype(np.float32)  # one query is a stored row
    if kind == "a round of consecutive states":
        q = x[1000:1000 + nq].astype(np.float32) + 0.01 * rng.standard_normal((nq, d)).astype(np.float32)
        monkeypatch.setattr(fp16_scan, "BOUND_MAX_BATCH", 64)  # one kernel call for the whole batch
    bounds = fp16_scan.scan_bounds(x, metric, dims)
    scan = fp16_scan.Fp16Scan(lib, x, metric, threads, bounds)
    full = scan.search(q, k, bounded=False)
    s, i, scored = scan.search_counted(q, k)
    assert_same(full, (s, i))
    assert (scored >= min(n, 2 * k)).all() and (scored <= n + 2 * k).all()
    if kind in ("low rank", "a round of consecutive states"):
        assert scored.mean() < 0.5 * n  # Not a full scan in disguise


def test_the_bound_holds_for_every_row():
    """The bound's arithmetic (float64 here, int8 rows and int16 weights as the kernel has them) against the exact
    float64 score of every row, with the slack; rows beyond the clipped steps (CLIP_QUANTILE) included."""
    rng = np.random.default_rng(1)
    for metric in ("ip", "l2"):
        x = low_rank(rng, 3000, 40, noise=0.3)
        x[::300] *= 20  # outliers: their projections are clipped to 127 steps, the rest is in their dn
        q = np.concatenate([low_rank(rng, 5, 40), 1000 * low_rank(rng, 1, 40)]).astype(np.float32)
        b = fp16_scan.scan_bounds(x, metric, 10)
        ub = b.upper(q)
        xf, qf = x.astype(np.float64), q.astype(np.float64)
        exact = qf @ xf.T
        if metric == "l2":
            exact = 2 * exact - (xf * xf).sum(1)
        assert (ub >= exact).all(), metric
        # ... and not vacuous: most rows' bounds are below the 20th best score
        assert (ub < np.sort(exact, axis=1)[:, -20][:, None]).mean() > 0.5


def test_nan_rows_and_queries():
    rng = np.random.default_rng(2)
    x = low_rank(rng, 4000, 32)
    bounds = fp16_scan.scan_bounds(x, "l2", 8)
    x[[5, 17]] = np.nan  # after the bounds are built: their bounds are finite, their scores NaN
    scan = fp16_scan.Fp16Scan(fp16_scan.load(), x, "l2", 2, bounds)
    q = np.stack([x[0], x[0]]).astype(np.float32)
    q[1, 3] = np.nan  # every score NaN: nothing is selected
    s, i = scan.search(q, 10)
    assert_same(scan.search(q, 10, bounded=False), (s, i))
    assert 5 not in i[0] and 17 not in i[0] and (i[1] == -1).all()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), d=st.integers(2, 70), nq=st.integers(1, 10), k=st.integers(1, 60),
       dims=st.integers(2, 20), rank=st.integers(1, 10), metric=st.sampled_from(["ip", "l2"]),
       seed=st.integers(0, 2**16))
def test_bounded_equals_full_random_shapes(n, d, nq, k, dims, rank, metric, seed):
    rng = np.random.default_rng(seed)
    x = low_rank(rng, n, d, rank=rank)
    q = low_rank(rng, nq, d, rank=rank).astype(np.float32)
    scan = fp16_scan.Fp16Scan(fp16_scan.load("native"), x, metric, 2, fp16_scan.scan_bounds(x, metric, dims))
    assert_same(scan.search(q, k, bounded=False), scan.search(q, k))


# (scenario, vectors, bound columns, bounds kept)
OPEN = [
    ("dominant directions: kept", "low rank", 32, True),
    ("no dominant directions: dropped (sample queries would score most rows)", "isotropic", 32, False),
    ("bounds off (config kb_scan_bounds = 0)", "low rank", 0, False),
    ("as many columns as the vectors: nothing to gain", "low rank", 64, False),
]


@pytest.mark.parametrize("scenario, kind, dims, kept", OPEN, ids=[c[0] for c in OPEN])
def test_open_scan_keeps_bounds_that_pay(scenario, kind, dims, kept):
    x = data(kind, np.random.default_rng(4), 40_000, 64)
    scan = fp16_scan.open_scan(x, "l2", 2, dims, probe_k=50)
    assert (scan.bounds is not None) == kept, scenario


def test_small_indexes_keep_plain_scans(monkeypatch):
    monkeypatch.setattr(fp16_scan, "BOUND_MIN_ROWS", 65536)
    x = low_rank(np.random.default_rng(5), 5000, 64)
    assert fp16_scan.open_scan(x, "l2", 2, 16).bounds is None
    scan = fp16_scan.Fp16Scan(fp16_scan.load(), x, "l2", 2, fp16_scan.scan_bounds(x, "l2", 16))
    assert (scan.search_counted(x[:2].astype(np.float32), 10)[2] == 5000).all()  # a full scan


def test_bounds_for_other_vectors_are_rejected():
    x = low_rank(np.random.default_rng(6), 3000, 32)
    with pytest.raises(ValueError, match="bounds"):
        fp16_scan.Fp16Scan(fp16_scan.load(), x[:2000], "l2", 1, fp16_scan.scan_bounds(x, "l2", 8))


def test_large_batches_run_in_slices(monkeypatch):
    monkeypatch.setattr(fp16_scan, "BOUND_MAX_BATCH", 3)  # 7 queries: slices of 3, 3, 1
    rng = np.random.default_rng(7)
    x = low_rank(rng, 6000, 48)
    q = low_rank(rng, 7, 48).astype(np.float32)
    scan = fp16_scan.Fp16Scan(fp16_scan.load(), x, "l2", 2, fp16_scan.scan_bounds(x, "l2", 16))
    s, i, scored = scan.search_counted(q, 25)
    assert_same(scan.search(q, 25, bounded=False), (s, i))
    assert (scored < 6000).all()
    assert len(scan._workspace.ub) == 3 * 6000  # Not 7 x N


def test_queries_unlike_the_rows_are_scanned_instead(lib):
    """Inner products of queries orthogonal to the rows' subspace: every row's bound (|q| |x| on the residual) is
    above tau, so those queries are scanned (one pass for all of them); the others of the batch stay bounded, and
    every answer is the full scan's."""
    rng = np.random.default_rng(8)
    x = low_rank(rng, 8000, 64)
    top = np.linalg.svd(x[:2000].astype(np.float64), full_matrices=False)[2][:6]  # the rows' subspace
    far = rng.standard_normal((3, 64))
    far = (far - far @ top.T @ top).astype(np.float32)
    near = low_rank(rng, 2, 64).astype(np.float32)
    q = np.concatenate([near[:1], far, near[1:]])
    scan = fp16_scan.Fp16Scan(lib, x, "ip", 2, fp16_scan.scan_bounds(x, "ip", 16))
    s, i, scored = scan.search_counted(q, 20)
    assert_same(scan.search(q, 20, bounded=False), (s, i))
    assert (scored[1:4] == 8000).all()  # scanned (a bounded search whose rows all passed would say 8000 + 40)
    assert (scored[[0, 4]] < 8000 // 8).all()  # Not dragged into the scan


@pytest.mark.parametrize("dims", [-1, 1])
def test_bad_bound_columns_name_the_flag(dims):
    with pytest.raises(ValueError, match="^kb_scan_bounds: "):
        fp16_scan.open_scan(low_rank(np.random.default_rng(9), 100, 16), "l2", 1, dims)
