"""Exact top-k over float16 vectors, one pass over the vectors per batch of queries (fp16_scan.cpp).

Why a kernel of our own: an exact scan is memory-bound, and faiss has no float16 scan that reads the vectors once
for a batch (its fp16 scalar quantizer scans once per query; IndexFlat needs a float32 copy, twice the bytes).
What it gains over the alternatives: see dense.py's FP16_SCAN note.

Built with g++ for this CPU (-march=native) into $RAGSERVE_HOME/kernels/fp16scan-native-<hash of source, flags,
CPU flags>/ on first use (once; `make install` does it), written atomically so concurrent processes can race
safely, and called through ctypes (which drops the GIL for the call). The container image, which has no compiler,
carries builds for PREBUILT levels and loads the best one its CPU runs. Without either, `library()` is None and
dense.py keeps faiss.

    python -m retrieval_service.knowledge.fp16_scan     # build (or find) it and print the ISA it was built for
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from ragcore.encoder import METRICS, exact_scores
from ragcore.files import compile_shared_library
from ragcore.machine import best_level, cpu_info, prebuild_levels, usable_cores
from ragcore.model_files import ragserve_home

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fp16_scan.cpp")
# libstdc++ and libgcc linked in: the library must load in the retrieval image, which has neither a compiler nor
# g++'s runtime libraries.
_FLAGS = ("-O3", "-fno-math-errno", "-pthread", "-shared", "-fPIC", "-std=c++17", "-static-libstdc++",
          "-static-libgcc")
# Levels the container image prebuilds (`--prebuild`): the AVX-512 and the AVX2 + F16C code paths.
PREBUILT = ("x86-64-v4", "x86-64-v3")
_I64P = ctypes.POINTER(ctypes.c_int64)
_F32P = ctypes.POINTER(ctypes.c_float)


def build_dir(march: str = "native") -> Path:
    """Where the library for `march` (a GCC -march name) lives; native builds hash this CPU's flags too."""
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(" ".join((*_FLAGS, march)).encode())
    if march == "native":
        h.update(" ".join(cpu_info()[1]).encode())
    return ragserve_home() / "kernels" / f"fp16scan-{march}-{h.hexdigest()[:16]}"


def build(march: str = "native") -> Path:
    """Compile the library for `march` unless it is there already; raises when it cannot. Other levels than
    native (x86-64-v3: AVX2 + F16C, x86-64: scalar) let tests run the code paths of other CPUs here."""
    out = build_dir(march) / "libfp16scan.so"
    if out.is_file():
        return out
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no C++ compiler (g++) on PATH")
    return compile_shared_library([compiler, *_FLAGS, f"-march={march}"], _SOURCE, out)


def load(march: str = "native") -> ctypes.CDLL:
    """Build (or find) and load the library for `march`; raises when it cannot."""
    lib = ctypes.CDLL(str(build(march)))
    lib.fp16_topk.restype = ctypes.c_int
    lib.fp16_topk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, _I64P, _F32P]
    lib.fp16_topk_bounded.restype = ctypes.c_int
    lib.fp16_topk_bounded.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int,
                                      *[ctypes.c_void_p] * 6, ctypes.c_int64, ctypes.c_int, _F32P, _I64P, _F32P, _I64P]
    lib.fp16_rows_f32.restype = ctypes.c_int
    lib.fp16_rows_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, _I64P, ctypes.c_int64, _F32P]
    lib.fp16_exact_scores.restype = ctypes.c_int
    lib.fp16_exact_scores.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                      _I64P, ctypes.c_int64, ctypes.c_int, _F32P]
    lib.fp16_isa.restype = ctypes.c_char_p
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernel for this CPU: a prebuilt level when one is installed for it, else built here; None when neither
    works (no compiler, a failed build: logged once)."""
    level = best_level(PREBUILT)
    if level and (build_dir(level) / "libfp16scan.so").is_file():
        try:
            return load(level)
        except OSError as e:
            log.warning("prebuilt float16 scan kernel does not load (%s); building it here", e)
    try:
        return load("native")
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("float16 scan kernel unavailable (%s): exact search uses faiss",
                    detail.strip().splitlines()[0] if detail.strip() else type(e).__name__)
        return None


# Bounded scans (fp16_topk_bounded). Columns of the bound array: principal directions plus the residual's norm.
# More columns score fewer rows per query but cost more per row: on the kNN-LM keys (the LM's final hidden states)
# 160 was where batched searches stopped getting cheaper, while a single query's pass is memory-bound and barely
# changes (a batch pays for the rows it scores).
BOUND_DIMS = 160
# Below this many rows a full scan is cheap, and the bounds' m best rows would be most of them.
BOUND_MIN_ROWS = 65536
# The bound is exact arithmetic's (with its quantisation terms: ScanBounds); it must hold for the kernel's float32
# score of float16 data too. float32 sums of d products move a score by ~d 2^-24 |q| |x| (3e-5 at d = 576), the
# float32 projection of a row by about as much, the bound's own float32 arithmetic by ~2^-22. The slack covers
# them: eps (|q|^2 + |x|^2) >= 2 eps |q| |x|, half on the row and half on the query.
BOUND_SLACK = 2.0 ** -10
# Largest |value| of the int8 projection and of a query's int16 weights.
ROW_STEPS, WEIGHT_STEPS = 127, 32767
# The quantisation terms are computed in float64 and stored as float32: this much extra covers both roundings.
INFLATE = 1 + 2.0 ** -12
# A principal column's step is this quantile of the sample's |projection| over ROW_STEPS, not the maximum over
# ROW_STEPS: finer steps for most rows, and the few beyond it are clipped (their error is in their own |delta|).
# On the kNN-LM keys 0.999 gave the fewest rows whose bound reaches the true k-th score (a tighter quantile clips
# too many rows, the maximum wastes steps), and fewer than the per-query term this replaced.
CLIP_QUANTILE = 0.999
# An index whose sample queries would score more than this share of its rows keeps plain scans.
BOUND_MAX_SHARE = 0.3
# Queries per bounded call: its workspace is this many x N floats per calling thread (64 MB at 1 M rows).
BOUND_MAX_BATCH = 16
# Rows per block of the bound array (kLanes in fp16_scan.cpp).
LANES = 16


@dataclass(frozen=True)
class ScanBounds:
    """Per row r of [N, D] vectors, upper bounds of each query's score (fp16_topk_bounded). With V = `basis`, the
    row's projection x_h = V^T x and residual x_r = x - V x_h (the query's q_h, q_r alike),
    q.x = q_h.x_h + q_r.x_r <= q_h.x_h + |q_r| |x_r| (Cauchy-Schwarz on the residual). The row side is stored as
    int8 steps of a scale per column: P = [clip(rint(x_h / scale), +-127), ceil(|x_r| / scale_r)], and the row's
    rounding error delta = x_h - P_h scale_h kept as its norm dn (rounded up); the query side qp = [q_h, |q_r|] as
    int16 steps W = rint(qp scale / s_q) of one scale per query. Then

        qp . p <= s_q (W . P) + s_q / 2 * max_r sum |P_r|  +  |q_h| dn

    (the rounding of W, over the largest row; the row's rounding, by Cauchy-Schwarz), so ub = a (W . P) - c + e +
    g dn with a = alpha s_q, g = alpha |q_h|, e = alpha s_q / 2 * l1max + the slack: the kernel's exact int32 sums
    and four float32 operations per row (e's first term and g carry INFLATE). With the per-row sum |P_r| in place of
    the largest (a load and a product more per row and query, for a few percent of the slack) the KB's searches got
    slightly slower, so the largest it is. The int8 projection passes about as many rows as float32 weights would,
    and BOUND_DIMS columns of it as few as the narrower float16 projection it replaced, in fewer bytes; clipped steps
    and dn: CLIP_QUANTILE.

    basis [D, cols - 1] float32 (orthonormal: principal directions of a sample), proj int8 in blocks of LANES
    rows, column pairs interleaved ([ceil(N / LANES), dp / 2, LANES, 2], the kernel's layout; dp = cols rounded up
    to even, a zero column pads), scale [dp] float64, c and dn [N] float32, l1max and alpha as the kernel takes
    them."""

    basis: np.ndarray
    proj: np.ndarray
    scale: np.ndarray
    c: np.ndarray
    dn: np.ndarray
    l1max: float
    alpha: float

    @property
    def dims(self) -> int:
        """dp: the bound array's columns (even)."""
        return 2 * self.proj.shape[1]

    def rows(self) -> np.ndarray:
        """P as int8 [N, dp] (a copy)."""
        return self.proj.transpose(0, 2, 1, 3).reshape(-1, self.dims)[:len(self.c)]

    def project(self, q: np.ndarray) -> np.ndarray:
        """q [B, D] -> qp [B, dp] float64: [V^T q, |residual|, 0 (the pad)]."""
        q64, basis = np.asarray(q, np.float64), self.basis.astype(np.float64)
        head = q64 @ basis
        qp = np.zeros((len(q64), self.dims))
        qp[:, :basis.shape[1]] = head
        qp[:, basis.shape[1]] = np.linalg.norm(q64 - head @ basis.T, axis=1)
        return qp

    def queries(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """q [B, D] float32 -> (W as int16 pairs [B, dp / 2] int32, a, e, g [B] float32), the query side."""
        qp = self.project(q)
        w = qp * self.scale
        w[~np.isfinite(w)] = 0.0  # a NaN query: e is NaN, so no bound passes (nor does any score)
        step = np.abs(w).max(axis=1) / WEIGHT_STEPS
        step[step == 0] = 1.0
        weights = np.rint(w / step[:, None]).astype(np.int16)  # |w / step| <= 32767
        e = (BOUND_SLACK * np.einsum("ij,ij->i", np.asarray(q, np.float64), np.asarray(q, np.float64))
             + self.alpha * INFLATE * 0.5 * step * self.l1max)
        g = self.alpha * INFLATE * np.linalg.norm(qp[:, :self.basis.shape[1]], axis=1)
        return (np.ascontiguousarray(weights).view(np.int32), (self.alpha * step).astype(np.float32),
                e.astype(np.float32), g.astype(np.float32))

    def upper(self, q: np.ndarray) -> np.ndarray:
        """The kernel's bounds [B, N] in float64 (tests)."""
        weights, a, e, g = (np.asarray(t, np.float64) if i else t for i, t in enumerate(self.queries(q)))
        dots = weights.view(np.int16).astype(np.float64) @ self.rows().astype(np.float64).T
        return a[:, None] * dots - self.c + e[:, None] + g[:, None] * self.dn


def scan_bounds(vectors: np.ndarray, metric: str, dims: int = BOUND_DIMS, sample: int = 65536,
                seed: int = 0, chunk: int = 65536) -> ScanBounds | None:
    """The bounds of `vectors` [N, D] (fp16_topk_bounded) over `dims` columns (dims - 1 principal directions of
    a sample of rows, and the residual's norm); None when they would not be smaller than the rows (dims >= D) or
    the rows are not finite."""
    n, d = vectors.shape
    if dims < 2 or dims >= d or n == 0:
        return None
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.choice(n, min(n, sample), replace=False))
    x = np.asarray(vectors[rows], dtype=np.float64)
    if not np.isfinite(x).all():
        return None
    centred = x - x.mean(axis=0)
    _, vecs = np.linalg.eigh(centred.T @ centred)  # ascending
    basis = np.ascontiguousarray(vecs[:, ::-1][:, :dims - 1], dtype=np.float32)
    h = dims - 1  # principal columns; then the residual's
    clip = np.quantile(np.abs(x.astype(np.float32) @ basis), CLIP_QUANTILE, axis=0)
    dp = dims + dims % 2
    proj = np.zeros((-(-n // LANES) * LANES, dp), np.float32)  # padded to whole blocks (and an even width)
    norms = np.empty(n, np.float32)  # squared_norms' values, from the chunks converted here anyway
    for s in range(0, n, chunk):
        v = np.asarray(vectors[s:s + chunk], dtype=np.float32)
        norms[s:s + len(v)] = np.einsum("ij,ij->i", v, v)
        head = v @ basis
        proj[s:s + len(v), :h] = head
        proj[s:s + len(v), h] = np.linalg.norm(v - head @ basis.T, axis=1)  # not sqrt(|x|^2 - |head|^2)
    top = np.abs(proj).max(axis=0).astype(np.float64)
    if not np.isfinite(top).all():
        return None
    top[:h] = np.where(clip > 0, np.minimum(clip, top[:h]), top[:h])
    # A step per column; the residual's is a hair larger, so its values rounded up stay within 127 steps.
    scale = np.where(top > 0, top / ROW_STEPS, 1.0)
    scale[h] *= 1 + 2.0 ** -20
    steps = np.empty(proj.shape, np.int8)
    l1max = 0.0
    dn = np.zeros(len(proj), np.float32)
    for s in range(0, len(proj), chunk):
        p = proj[s:s + chunk] / scale  # float64
        p[:, :h] = np.clip(np.rint(p[:, :h]), -ROW_STEPS, ROW_STEPS)
        p[:, h:] = np.ceil(p[:, h:])
        steps[s:s + chunk] = p
        l1max = max(l1max, float(np.abs(p).sum(axis=1).max()))
        # |delta| rounded up: float32's rounding (2^-24) is below the factor's 2^-20
        dn[s:s + chunk] = np.linalg.norm(proj[s:s + chunk, :h] - p[:, :h] * scale[:h], axis=1) * (1 + 2.0 ** -20)
    del proj
    if metric == "l2":
        c, alpha = norms * np.float32(1 - BOUND_SLACK), 2.0
    else:
        c, alpha = -BOUND_SLACK * norms, 1.0
    blocks = steps.reshape(-1, LANES, dp // 2, 2).transpose(0, 2, 1, 3)
    return ScanBounds(basis, np.ascontiguousarray(blocks), scale, c.astype(np.float32), dn[:n], l1max, alpha)


class Fp16Scan:
    """Exact search over float16 vectors [N, D] (a memmap is fine: it is scanned in place, no copy).

    search(q [B, D] float32, k) -> (scores [B, k] float32, ids [B, k] int64), best first, -1 ids past N. Scores
    are q.x (ip) or 2 q.x - |x|^2 (l2: minus the squared distance plus |q|^2), float32 math on the exact float16
    values; ties go to the smaller id.

    threads (config kb_scan_threads): threads of one search, 0 = one per core this process may use. A batch is
    compute-bound (it scales with the threads given), and the kernel shares rows out in chunks, so a thread
    that finds its core busy (a generation worker's pass beside the search) scans less and the others take its
    share: served kNN-LM on 2 cores was faster with 2 fixed threads than with 1, also with async verification (LM
    passes beside the search). A snapshot of idle cores (/proc/loadavg) chose 1 thread for most searches: the
    calling worker's threads are still running when its request arrives.

    bounds (scan_bounds): the same answer, bit for bit, from a pass over the bounds and the rows whose bound
    reaches the k-th best score (fp16_topk_bounded): on the kNN-LM keys a fraction of a full scan's time. Queries
    the bounds cannot prune for (unlike the rows: random vectors leave most of the keys above the bar) are scanned
    instead, together: bounded, they cost more than a full scan.
    """

    def __init__(self, lib: ctypes.CDLL, vectors: np.ndarray, metric: str, threads: int = 0,
                 bounds: ScanBounds | None = None):
        if metric not in METRICS:
            raise ValueError(f"metric: {metric!r} is not one of {METRICS}")
        if vectors.dtype != np.float16 or vectors.ndim != 2 or not vectors.flags.c_contiguous:
            raise ValueError(f"vectors: need a C-contiguous [N, D] float16 array, got {vectors.dtype} "
                             f"{vectors.shape}")
        self._lib = lib
        self.vectors = vectors
        self.metric = metric
        self.ntotal, self.d = (int(s) for s in vectors.shape)
        self.sq_norms = squared_norms(vectors) if metric == "l2" else None
        if threads < 0:
            raise ValueError(f"threads: {threads} must be >= 0 (0 = one per usable core)")
        self.threads = threads or usable_cores()
        if bounds is not None and len(bounds.c) != self.ntotal:
            raise ValueError(f"bounds: {len(bounds.c)} rows for {self.ntotal} vectors")
        self.bounds = bounds
        self._workspace = threading.local()  # per calling thread: [B * N] float32 bounds of a bounded search

    def search(self, queries: np.ndarray, k: int, threads: int = 0,
               bounded: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """bounded: None = with the bounds when there are some; False = a full scan."""
        scores, ids, _ = self.search_counted(queries, k, threads, bounded)
        return scores, ids

    def search_counted(self, queries: np.ndarray, k: int, threads: int = 0,
                       bounded: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """search(), plus the rows scored per query [B] int64 (N for a full scan, or a query scanned instead)."""
        q = np.ascontiguousarray(queries, dtype=np.float32)  # [B, D]
        if q.ndim != 2 or q.shape[1] != self.d:
            raise ValueError(f"queries: shape {q.shape} does not match dimension {self.d}")
        if k <= 0:
            raise ValueError(f"k: {k} must be positive")
        ids = np.empty((len(q), k), np.int64)
        scores = np.empty((len(q), k), np.float32)
        scored = np.full(len(q), self.ntotal, np.int64)
        norms = self.sq_norms.ctypes.data if self.sq_norms is not None else None
        threads = threads or self.threads
        b = self.bounds if bounded is not False else None
        m = 2 * k
        if b is not None and self.ntotal >= max(BOUND_MIN_ROWS, 8 * m) and len(q):
            rc = 0
            for s in range(0, len(q), BOUND_MAX_BATCH):  # the bounds' workspace stays BOUND_MAX_BATCH x N floats
                qs = q[s:s + BOUND_MAX_BATCH]
                weights, a, e, g = b.queries(qs)
                ub = self._bound_buffer(len(qs) * self.ntotal)
                rc = rc or self._lib.fp16_topk_bounded(
                    self.vectors.ctypes.data, self.ntotal, self.d, qs.ctypes.data, len(qs), norms, k,
                    b.proj.ctypes.data, b.dims, weights.ctypes.data, a.ctypes.data, b.c.ctypes.data, e.ctypes.data,
                    g.ctypes.data, b.dn.ctypes.data, m, threads,
                    ub.ctypes.data_as(_F32P), ids[s:].ctypes.data_as(_I64P), scores[s:].ctypes.data_as(_F32P),
                    scored[s:].ctypes.data_as(_I64P))
        else:
            rc = self._lib.fp16_topk(self.vectors.ctypes.data, self.ntotal, self.d, q.ctypes.data, len(q), norms, k,
                                     threads, ids.ctypes.data_as(_I64P), scores.ctypes.data_as(_F32P))
        if rc != 0:
            raise ValueError(f"fp16_topk rejected n={self.ntotal} d={self.d} queries={len(q)} k={k}")
        return scores, ids, scored

    def _bound_buffer(self, size: int) -> np.ndarray:
        buf = getattr(self._workspace, "ub", None)
        if buf is None or len(buf) < size:
            buf = self._workspace.ub = np.empty(size, np.float32)
        return buf

    def bounded_share(self, queries: np.ndarray, k: int) -> float:
        """Mean share of rows a bounded search of `queries` scores (1.0 without bounds)."""
        _, _, scored = self.search_counted(queries, k)
        return float(scored.mean() / max(1, self.ntotal))


def candidate_rows(vectors: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """vectors[ids] [len(ids), D] for exact re-scoring: float32 when the kernel widens them (C-contiguous
    float16 rows), else numpy's gather in their own dtype (exact_scores takes either). IndexError for an id out
    of range, as numpy's."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    lib = library() if vectors.dtype == np.float16 and vectors.ndim == 2 and vectors.flags.c_contiguous else None
    if lib is None:
        return vectors[ids]
    out = np.empty((len(ids), vectors.shape[1]), np.float32)
    if lib.fp16_rows_f32(vectors.ctypes.data, len(vectors), vectors.shape[1], ids.ctypes.data_as(_I64P), len(ids),
                         out.ctypes.data_as(_F32P)) != 0:
        raise IndexError(f"ids: outside [0, {len(vectors)})")
    return out


def candidate_scores(vectors: np.ndarray, queries: np.ndarray, ids: np.ndarray, metric: str) -> np.ndarray:
    """queries [B, D], ids [B, K] -> [B, K] float32: exact_scores(queries, vectors[ids], metric), the same bits,
    computed by the kernel from the float16 rows in place when it can (C-contiguous float16 vectors), else by
    numpy. IndexError for an id out of range."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    lib = library() if vectors.dtype == np.float16 and vectors.ndim == 2 and vectors.flags.c_contiguous else None
    if lib is None:
        return exact_scores(q, candidate_rows(vectors, ids.ravel()).reshape(*ids.shape, vectors.shape[1]), metric)
    if metric not in METRICS:
        raise ValueError(f"metric: {metric!r} is not one of {METRICS}")
    if q.ndim != 2 or ids.ndim != 2 or len(q) != len(ids) or q.shape[1] != vectors.shape[1]:
        raise ValueError(f"queries {q.shape} and ids {ids.shape} do not match vectors {vectors.shape}")
    out = np.empty(ids.shape, np.float32)
    if lib.fp16_exact_scores(vectors.ctypes.data, len(vectors), vectors.shape[1], q.ctypes.data, len(q),
                             ids.ctypes.data_as(_I64P), ids.shape[1], int(metric == "l2"),
                             out.ctypes.data_as(_F32P)) != 0:
        raise IndexError(f"ids: outside [0, {len(vectors)})")
    return out


def squared_norms(vectors: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """[N, D] -> [N] float32 |x|^2, a slice at a time (a memmap is never upcast whole)."""
    out = np.empty(len(vectors), np.float32)
    for s in range(0, len(vectors), chunk):
        v = np.asarray(vectors[s:s + chunk], dtype=np.float32)
        out[s:s + chunk] = np.einsum("ij,ij->i", v, v)
    return out


def open_scan(vectors: np.ndarray, metric: str, threads: int = 0, bound_dims: int = BOUND_DIMS,
              probe_k: int = 1024) -> Fp16Scan | None:
    """An Fp16Scan over `vectors` when they are float16 and the kernel loads; else None (faiss then).

    bound_dims (config kb_scan_bounds): columns of its bounds, 0 = none. Bounds are kept only for at least
    BOUND_MIN_ROWS rows and when 16 rows of the index, as queries for probe_k neighbours, score at most
    BOUND_MAX_SHARE of the rows (vectors with no dominant directions gain nothing from them)."""
    if bound_dims < 0 or bound_dims == 1:
        raise ValueError(f"kb_scan_bounds: {bound_dims} must be 0 (off) or at least 2 columns")
    if vectors.dtype != np.float16 or not vectors.flags.c_contiguous:
        return None
    lib = library()
    if lib is None:
        return None
    bounds = None
    if bound_dims and len(vectors) >= BOUND_MIN_ROWS:
        t0 = time.perf_counter()
        with threadpool_limits(limits=usable_cores(), user_api="blas"):  # the service keeps BLAS to 1 thread
            bounds = scan_bounds(vectors, metric, bound_dims)
    scan = Fp16Scan(lib, vectors, metric, threads, bounds)
    if bounds is not None:
        probe = np.asarray(vectors[np.linspace(0, len(vectors) - 1, 16).astype(np.int64)], dtype=np.float32)
        share = scan.bounded_share(probe, min(probe_k, len(vectors) // 16))
        keep = share <= BOUND_MAX_SHARE
        log.info("float16 scan of %d x %d: bounds over %d columns %s (probe queries score %.1f %% of the rows; "
                 "%.1f s)", *vectors.shape, bound_dims, "kept" if keep else "dropped", 100 * share,
                 time.perf_counter() - t0)
        if not keep:
            scan.bounds = None
    return scan


def main() -> None:
    levels = prebuild_levels(argparse.ArgumentParser(description=__doc__.splitlines()[0]), PREBUILT)
    for level in levels:
        if best_level((level,)):
            print(f"float16 scan kernel for {level}: {load(level).fp16_isa().decode()} ({build_dir(level)})")
        else:  # code built for a level this CPU lacks may raise SIGILL when it runs
            print(f"float16 scan kernel for {level}: built, not loaded (this CPU lacks it) ({build(level)})")
    if levels:
        return
    lib = library()
    if lib is None:
        raise SystemExit("float16 scan kernel: not built (see the warning above)")
    print(f"float16 scan kernel: {lib.fp16_isa().decode()} ({lib._name})")


if __name__ == "__main__":
    main()
