"""The float16 scan kernel (fp16_scan.cpp) against a brute-force reference, on each instruction set it has.

Vectors and queries hold small integers, so every dot product is exact in float32 whatever the summation order:
the kernel's ids, ties included, must equal the reference's (score desc, then id asc) exactly.
"""

import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragcore.encoder import exact_scores
from ragcore.machine import usable_cores
from retrieval_service.knowledge import fp16_scan

# The AVX-512 path where this CPU has it, plus the AVX2 + F16C path (x86-64-v3: the AMD EPYC machines) and the
# scalar one (x86-64: no F16C), both of which run here too.
LEVELS = ["native", "x86-64-v3", "x86-64"]


@pytest.fixture(scope="module", params=LEVELS)
def lib(request):
    return fp16_scan.load(request.param)


def reference(x: np.ndarray, q: np.ndarray, k: int, metric: str) -> list[list[int]]:
    xf, qf = x.astype(np.float64), q.astype(np.float64)
    scores = qf @ xf.T
    if metric == "l2":
        scores = 2 * scores - (xf * xf).sum(1)
    out = []
    for row in scores:
        valid = np.flatnonzero(~np.isnan(row))
        order = valid[np.lexsort((valid, -row[valid]))]
        out.append(order[:k].tolist())
    return out


def integer_rows(rng: np.random.Generator, n: int, d: int, lo: int = -3, hi: int = 4) -> np.ndarray:
    return rng.integers(lo, hi, (n, d)).astype(np.float16)


# (scenario, n, d, queries, k, threads)
CASES = [
    ("one row, one query", 1, 16, 1, 1, 1),
    ("k larger than n: padded with -1", 5, 16, 2, 9, 1),
    ("d not a multiple of 8 or 16: the scalar tail", 300, 21, 3, 7, 1),
    ("more than one row block (512)", 1500, 32, 5, 20, 1),
    ("9 queries: a full group of 8 and a group of 1", 700, 48, 9, 10, 1),
    ("17 queries, k above the 2k selection buffer's first fill", 1200, 40, 17, 300, 1),
    ("two threads sharing chunks of 16 K rows", 140_000, 16, 3, 12, 2),
    # 8 threads on this 2-core box: helpers wait for a core, the caller scans their unfinished chunks again.
    ("more threads than cores: chunks scanned twice, merged once", 600_000, 8, 2, 40, 8),
]


@pytest.mark.parametrize("scenario, n, d, nq, k, threads", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_kernel_equals_brute_force(lib, scenario, n, d, nq, k, threads, metric):
    rng = np.random.default_rng(n + d)
    x, q = integer_rows(rng, n, d), integer_rows(rng, nq, d).astype(np.float32)
    scores, ids = fp16_scan.Fp16Scan(lib, x, metric).search(q, k, threads=threads)
    ref = reference(x, q, k, metric)
    for i in range(nq):
        found = ids[i][ids[i] >= 0].tolist()
        assert found == ref[i], scenario  # Not merely the same set: best first, ties to the smaller id
        assert (ids[i][len(found):] == -1).all() and np.isneginf(scores[i][len(found):]).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 1200), d=st.integers(1, 70), nq=st.integers(1, 12), k=st.integers(1, 40),
       metric=st.sampled_from(["ip", "l2"]), seed=st.integers(0, 2**16))
def test_kernel_equals_brute_force_random_shapes(n, d, nq, k, metric, seed):
    rng = np.random.default_rng(seed)
    x, q = integer_rows(rng, n, d, -2, 3), integer_rows(rng, nq, d, -2, 3).astype(np.float32)
    _, ids = fp16_scan.Fp16Scan(fp16_scan.load("native"), x, metric).search(q, k)
    assert [row[row >= 0].tolist() for row in ids] == reference(x, q, k, metric)


def test_duplicate_rows_tie_to_the_smaller_id(lib):
    x = np.tile(np.array([[1, 2, 3, 4]], np.float16), (2000, 1))  # every row ties
    _, ids = fp16_scan.Fp16Scan(lib, x, "ip").search(np.ones((1, 4), np.float32), 5)
    assert ids[0].tolist() == [0, 1, 2, 3, 4]  # Not the last rows scanned


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_ties_go_to_the_smaller_id_whatever_thread_scans_them(threads):
    x = np.tile(np.array([[1, 2, 3, 4]], np.float16), (300_000, 1))  # every row ties, in every chunk
    x[[7, 150_001]] = 3  # two better rows (12 vs 10), one in a late chunk
    _, ids = fp16_scan.Fp16Scan(fp16_scan.load(), x, "ip").search(np.ones((1, 4), np.float32), 6, threads=threads)
    assert ids[0].tolist() == [7, 150_001, 0, 1, 2, 3]  # Not a row of a later chunk, not a row twice


def test_nan_rows_are_never_selected(lib):
    x = np.ones((10, 16), np.float16)
    x[[0, 3]] = np.nan
    _, ids = fp16_scan.Fp16Scan(lib, x, "ip").search(np.ones((1, 16), np.float32), 10)
    assert ids[0].tolist() == [1, 2, 4, 5, 6, 7, 8, 9, -1, -1]


def test_real_valued_vectors_match_float32_math(lib):
    """Non-integer values: the kernel's top-k is the float32 top-k up to rounding ties (checked with a margin)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5000, 384)).astype(np.float16)
    q = rng.standard_normal((8, 384)).astype(np.float32)
    scores, ids = fp16_scan.Fp16Scan(lib, x, "ip").search(q, 10)
    exact = q.astype(np.float64) @ x.astype(np.float64).T
    for i in range(8):
        np.testing.assert_allclose(scores[i], exact[i, ids[i]], rtol=1e-5, atol=1e-4)
        assert scores[i][-1] >= np.sort(exact[i])[-10] - 1e-3  # nothing better was skipped


# (bad input, error naming it)
BAD = [
    (lambda: fp16_scan.Fp16Scan(fp16_scan.load(), np.ones((4, 8), np.float32), "ip"), "vectors"),
    (lambda: fp16_scan.Fp16Scan(fp16_scan.load(), np.ones((4, 8), np.float16), "cosine"), "metric"),
    (lambda: fp16_scan.Fp16Scan(fp16_scan.load(), np.ones((4, 8), np.float16), "ip").search(np.ones((1, 7)), 3),
     "queries"),
    (lambda: fp16_scan.Fp16Scan(fp16_scan.load(), np.ones((4, 8), np.float16), "ip").search(np.ones((1, 8)), 0),
     "k"),
]


@pytest.mark.parametrize("call, field", BAD)
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_threads_fixed_or_one_per_core():
    x = np.ones((8, 16), np.float16)
    assert fp16_scan.Fp16Scan(fp16_scan.load(), x, "ip", threads=3).threads == 3
    assert fp16_scan.Fp16Scan(fp16_scan.load(), x, "ip").threads == usable_cores()  # Not 0
    with pytest.raises(ValueError, match="threads"):
        fp16_scan.Fp16Scan(fp16_scan.load(), x, "ip", threads=-1)


# Candidate rows widened for exact re-scoring (fp16_rows_f32, candidate_rows): the same float32 values numpy's
# widening gives, bit for bit (every float16 is a float32), rows in the order asked.
# (scenario, d, ids)
ROW_CASES = [
    ("no ids", 16, []),
    ("one row", 16, [3]),
    ("d under one vector: the scalar tail only", 5, [0, 9, 4]),
    ("d not a multiple of 8 or 16", 37, [7, 7, 0, 11, 2, 5, 1]),  # a row twice: gathered twice
    ("the kNN-LM keys' width, ids descending", 576, list(range(11, -1, -1))),
]


def special_rows(n: int, d: int) -> np.ndarray:
    rng = np.random.default_rng(d)
    x = rng.standard_normal((n, d)).astype(np.float16)
    specials = np.array([np.inf, -np.inf, 0.0, -0.0, 6e-8, -6e-8, 65504, 1e-5], np.float16)  # incl. subnormals
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, min(flat.size, len(specials)), replace=False)] = specials[:min(flat.size, len(specials))]
    return x


@pytest.mark.parametrize("scenario, d, ids", ROW_CASES, ids=[c[0] for c in ROW_CASES])
def test_rows_widen_exactly(lib, scenario, d, ids):
    x = special_rows(12, d)
    ids = np.asarray(ids, np.int64)
    out = np.full((len(ids), d), np.nan, np.float32)
    assert lib.fp16_rows_f32(x.ctypes.data, len(x), d, ids.ctypes.data_as(fp16_scan._I64P), len(ids),
                             out.ctypes.data_as(fp16_scan._F32P)) == 0
    expected = x[ids].astype(np.float32)
    assert out.view(np.uint32).tolist() == expected.view(np.uint32).tolist()  # bits: -0.0 is not 0.0


def test_candidate_rows_kernel_or_numpy():
    x = special_rows(40, 24)
    ids = np.array([39, 0, 17], np.int64)
    got = fp16_scan.candidate_rows(x, ids)
    assert got.dtype == np.float32 and got.view(np.uint32).tolist() == x[ids].astype(np.float32).view(np.uint32).tolist()
    for other in (x.astype(np.float32), x[:, ::2], x.T.copy()[:, :12]):  # not float16, not C-contiguous
        want = other[ids % len(other)]
        assert np.array_equal(fp16_scan.candidate_rows(other, ids % len(other)), want)
    for bad in ([40], [-1], [0, 1, 99]):
        with pytest.raises(IndexError, match="ids"):
            fp16_scan.candidate_rows(x, np.array(bad))


# Exact scores of candidates (fp16_exact_scores, candidate_scores): ragcore.encoder.exact_scores' values bit for
# bit (the worker's RaLM cache scores passages with it and compares with the service's), on each instruction set.
# numpy's float64 sum is pairwise, with three regimes the kernel repeats. (scenario, d)
EXACT_CASES = [
    ("under 8 values: a plain sum", 5),
    ("8 values: eight running sums", 8),
    ("eight running sums and a tail of 5", 61),
    ("128: the largest single block", 128),
    ("129: halves of 64 and 65", 129),
    ("384: the KB's embeddings", 384),
    ("576: the kNN-LM keys", 576),
    ("1000: halves of unequal length, recursively", 1000),
]


def wide_values(rng: np.random.Generator, shape: tuple, dtype) -> np.ndarray:
    """Values over six decades: summation order shows in the last bits of float64 sums."""
    return (rng.standard_normal(shape) * 10 ** rng.uniform(-3, 3, shape)).astype(dtype)


def kernel_scores(lib, x: np.ndarray, q: np.ndarray, ids: np.ndarray, metric: str) -> np.ndarray:
    out = np.full(ids.shape, np.nan, np.float32)
    ids = np.ascontiguousarray(ids, np.int64)
    assert lib.fp16_exact_scores(x.ctypes.data, len(x), x.shape[1], q.ctypes.data, len(q),
                                 ids.ctypes.data_as(fp16_scan._I64P), ids.shape[1], int(metric == "l2"),
                                 out.ctypes.data_as(fp16_scan._F32P)) == 0
    return out


@pytest.mark.parametrize("scenario, d", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_exact_scores_are_numpys_bit_for_bit(lib, scenario, d, metric):
    rng = np.random.default_rng(d)
    x = wide_values(rng, (300, d), np.float16)
    q = wide_values(rng, (4, d), np.float32)
    ids = rng.integers(0, 300, (4, 50))
    ids[0, :3] = ids[0, 3]  # a row asked for more than once
    got = kernel_scores(lib, x, q, ids, metric)
    want = exact_scores(q, x[ids].astype(np.float32), metric)
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    if d >= 61:  # the check tells summation orders apart: float32 sums of the same terms differ somewhere
        terms = (x[ids].astype(np.float32) - q[:, None, :]) ** 2 if metric == "l2" else x[ids] * q[:, None, :]
        assert not np.array_equal(got, (-1 if metric == "l2" else 1) * terms.astype(np.float32).sum(-1))


@settings(max_examples=40, deadline=None)
@given(d=st.integers(1, 700), nq=st.integers(1, 5), cnt=st.integers(0, 40), metric=st.sampled_from(["ip", "l2"]),
       seed=st.integers(0, 2**16))
def test_exact_scores_random_shapes(d, nq, cnt, metric, seed):
    rng = np.random.default_rng(seed)
    x = wide_values(rng, (50, d), np.float16)
    q = wide_values(rng, (nq, d), np.float32)
    ids = rng.integers(0, 50, (nq, cnt))
    got = fp16_scan.candidate_scores(x, q, ids, metric)
    assert got.view(np.uint32).tolist() == exact_scores(q, x[ids].astype(np.float32), metric).view(np.uint32).tolist()


def test_candidate_scores_kernel_or_numpy():
    rng = np.random.default_rng(11)
    x = wide_values(rng, (40, 24), np.float16)
    q = wide_values(rng, (2, 24), np.float32)
    ids = np.array([[39, 0, 17], [5, 5, 1]], np.int64)
    want = exact_scores(q, x[ids].astype(np.float32), "l2")
    for vectors in (x, x.astype(np.float32), np.asfortranarray(x)):  # the kernel, then numpy's fallbacks
        assert np.array_equal(fp16_scan.candidate_scores(vectors, q, ids, "l2"), want)
    for bad in ([[40, 0, 1], [0, 1, 2]], [[0, 1, 2], [-1, 0, 0]]):
        with pytest.raises(IndexError, match="ids"):
            fp16_scan.candidate_scores(x, q, np.array(bad), "l2")
    with pytest.raises(ValueError, match="ids"):
        fp16_scan.candidate_scores(x, q, ids[:1], "l2")  # a row of ids per query


def test_prebuild_of_a_level_this_cpu_lacks_compiles_without_loading(monkeypatch, capsys):
    """The retrieval image prebuilds x86-64-v4 on whatever CPU builds it; code of a level that CPU lacks must be
    compiled, never loaded or run there (SIGILL)."""
    def never(*a, **k):
        raise AssertionError("a level this CPU lacks was loaded")

    monkeypatch.setattr(fp16_scan, "best_level", lambda levels: "")
    monkeypatch.setattr(fp16_scan.ctypes, "CDLL", never)
    monkeypatch.setattr(sys, "argv", ["fp16_scan", "--prebuild", "x86-64-v3"])
    fp16_scan.main()
    out = capsys.readouterr().out
    assert "float16 scan kernel for x86-64-v3: built, not loaded" in out, out
    assert (fp16_scan.build_dir("x86-64-v3") / "libfp16scan.so").is_file()
