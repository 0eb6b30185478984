"""Exact top-k over float16 vectors, one pass over the vectors per batch of queries (fp16_scan.cpp).

Why a kernel of our own: an exact scan is memory-bound, and faiss has no float16 scan that reads the vectors once
for a batch (its fp16 scalar quantizer scans once per query; IndexFlat needs a float32 copy, twice the bytes).
Measured on 1.04 M x 384 float16 vectors, one thread, Sapphire Rapids: see dense.py's FP16_SCAN note.

Built with g++ for this CPU (-march=native) into $RAGSERVE_HOME/kernels/fp16scan-native-<hash of source, flags,
CPU flags>/ on first use (~2 s; `make install` does it), written atomically so concurrent processes can race
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
import tempfile
from pathlib import Path

import numpy as np

from ragcore.encoder import METRICS
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
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, f"-march={march}", str(_SOURCE), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would hide a prebuilt copy from the image's non-root user
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(march: str = "native") -> ctypes.CDLL:
    """Build (or find) and load the library for `march`; raises when it cannot."""
    lib = ctypes.CDLL(str(build(march)))
    lib.fp16_topk.restype = ctypes.c_int
    lib.fp16_topk.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, _I64P, _F32P]
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


class Fp16Scan:
    """Exact search over float16 vectors [N, D] (a memmap is fine: it is scanned in place, no copy).

    search(q [B, D] float32, k) -> (scores [B, k] float32, ids [B, k] int64), best first, -1 ids past N. Scores
    are q.x (ip) or 2 q.x - |x|^2 (l2: minus the squared distance plus |q|^2), float32 math on the exact float16
    values; ties go to the smaller id.

    threads (config kb_scan_threads): threads of one search, 0 = one per core this process may use. A batch is
    compute-bound (8 queries over 1 M x 576 on a Zen 4 core: 113 ms on 1 thread, 58 ms on 2), and the kernel
    shares rows out in chunks, so a thread that finds its core busy (a generation worker's pass beside the
    search) scans less and the others take its share: served kNN-LM on 2 Zen 4 cores, fixed 2 threads vs 1:
    the baseline 2.61 vs 3.38 s per request, speculation with async verification (LM passes beside the search)
    1.87 vs 2.10 s. A snapshot of idle cores (/proc/loadavg) chose 1 thread for most searches: the calling
    worker's threads are still running when its request arrives.
    """

    def __init__(self, lib: ctypes.CDLL, vectors: np.ndarray, metric: str, threads: int = 0):
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

    def search(self, queries: np.ndarray, k: int, threads: int = 0) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.float32)  # [B, D]
        if q.ndim != 2 or q.shape[1] != self.d:
            raise ValueError(f"queries: shape {q.shape} does not match dimension {self.d}")
        if k <= 0:
            raise ValueError(f"k: {k} must be positive")
        ids = np.empty((len(q), k), np.int64)
        scores = np.empty((len(q), k), np.float32)
        norms = self.sq_norms.ctypes.data if self.sq_norms is not None else None
        rc = self._lib.fp16_topk(self.vectors.ctypes.data, self.ntotal, self.d, q.ctypes.data, len(q), norms, k,
                                 threads or self.threads, ids.ctypes.data_as(_I64P), scores.ctypes.data_as(_F32P))
        if rc != 0:
            raise ValueError(f"fp16_topk rejected n={self.ntotal} d={self.d} queries={len(q)} k={k}")
        return scores, ids


def squared_norms(vectors: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """[N, D] -> [N] float32 |x|^2, a slice at a time (a memmap is never upcast whole)."""
    out = np.empty(len(vectors), np.float32)
    for s in range(0, len(vectors), chunk):
        v = np.asarray(vectors[s:s + chunk], dtype=np.float32)
        out[s:s + chunk] = np.einsum("ij,ij->i", v, v)
    return out


def open_scan(vectors: np.ndarray, metric: str, threads: int = 0) -> Fp16Scan | None:
    """An Fp16Scan over `vectors` when they are float16 and the kernel loads; else None (faiss then)."""
    if vectors.dtype != np.float16 or not vectors.flags.c_contiguous:
        return None
    lib = library()
    return Fp16Scan(lib, vectors, metric, threads) if lib is not None else None


def main() -> None:
    levels = prebuild_levels(argparse.ArgumentParser(description=__doc__.splitlines()[0]), PREBUILT)
    for level in levels:
        print(f"float16 scan kernel for {level}: {load(level).fp16_isa().decode()} ({build_dir(level)})")
    if levels:
        return
    lib = library()
    if lib is None:
        raise SystemExit("float16 scan kernel: not built (see the warning above)")
    print(f"float16 scan kernel: {lib.fp16_isa().decode()} ({lib._name})")


if __name__ == "__main__":
    main()
