"""Dense retrieval: resumable passage encoding and named faiss vector indexes (the encoder and the exact scoring
function live in ragcore/encoder.py: the generation worker uses them too, without faiss).

One `VectorIndex` holds an exact index (EDR) and optionally an approximate one (HNSW, ADR) over the same
vectors. Exact search is memory-bound: it streams every stored vector once. Where the stored vectors are float16
(KB embeddings built with --float16, kNN-LM keys) they are loaded into memory as they are and scanned by
fp16_scan.cpp, which widens each block of rows in registers and multiplies it with up to 8 queries at once, so a
batch of 8 costs ~2 single searches (faiss would read a float32 copy, twice the bytes, or its float16 copy once per
query). Otherwise (float32 vectors, no compiler) the exact index is faiss's IndexFlat, with faiss's float16 copy
for batches of up to 4 queries when the vectors are float16. The KB's passage embeddings are the index named "kb";
kNN-LM datastores register more named indexes (model hidden states, L2 metric) searched through the same Search.

Scores are "higher is better": inner product, or minus the squared L2 distance. faiss only proposes
candidates; every returned score is recomputed by `exact_scores` from the stored vectors (float16 vectors: by
the kernel's copy of it, fp16_scan.candidate_scores, the same bits), and ties are broken by the smaller id.
ScoreCandidates uses the same function, so a doc's score does not depend on whether it came from a search or a
candidate list, and the search top-1 is the top-1 of any candidate set holding it.
(faiss's own scores come from BLAS or SIMD kernels whose last bits depend on the batch size.)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import faiss
import numpy as np
from threadpoolctl import threadpool_limits

from ragcore.encoder import METRICS, Encoder, passage_input
from retrieval_service.knowledge import fp16_scan
from retrieval_service.knowledge.encode_pool import EncodeWork, chunk_path, encode_spans, write_chunk

EMBEDDINGS_FILE = "embeddings.npy"
HNSW_FILE = "hnsw.faiss"
META_FILE = "meta.json"
STATS_FILE = "stats.json"  # chunks/: encoding time and rows over the runs of a resumed build
# Extra faiss candidates re-scored exactly: a doc that wins after exact re-scoring is within float rounding
# of faiss's k-th score, so it is among these unless more than `margin` docs tie to ~1e-7.
RESCORE_MARGIN = 16
# How exact search reads float16-stored vectors (config kb_fp16_scan). The kernel (fp16_scan.cpp) scans the float16
# rows once for a whole batch of queries: several times faster than faiss's float32 IndexFlat for small batches, and
# unlike faiss's float16 copy (scanned once per query) its cost grows slowly with the batch. It scans an in-memory
# copy, not the memory-mapped file (4 KiB pages: the prefetcher stops at every page boundary); prefetching rows into
# L2 and tiling 2 rows per loaded query chunk made batches several times cheaper, and several FMA chains per query
# keep a single query from being latency-bound (bench.kb, docs/benchmarks.md).
FP16_SCANS = ("kernel", "faiss", "off")
# "faiss": batches of up to this many queries scan faiss's float16 copy, larger ones the float32 IndexFlat.
FP16_SCAN_MAX_BATCH = 4


# ------------------------------------------------------------------------------------------- pure cores

def rank_order(scores: np.ndarray, ids: np.ndarray, matched: np.ndarray | None = None) -> np.ndarray:
    """Positions sorted best first: matched before unmatched, higher score, then smaller id.

    rank_order([1, 2, 2], [7, 9, 3]) -> [2, 1, 0]   # ties go to id 3, not 9
    """
    scores = np.asarray(scores, dtype=np.float32)
    keys = [np.asarray(ids, dtype=np.int64), -scores.astype(np.float64)]
    if matched is not None:
        keys.append(~np.asarray(matched, dtype=bool))
    return np.lexsort(keys).astype(np.int32)


def recall_at(approx_ids: np.ndarray, exact_ids: np.ndarray, k: int) -> float:
    """Fraction of the exact top-k found in the approximate top-k (k=1: same top-1), averaged over queries."""
    a, e = np.asarray(approx_ids)[:, :k], np.asarray(exact_ids)[:, :k]
    hits = [len(set(a[i].tolist()) & set(e[i][e[i] >= 0].tolist())) / max(1, int((e[i] >= 0).sum()))
            for i in range(len(e))]
    return float(np.mean(hits)) if hits else 0.0


def configure_faiss(threads: int, blas_threshold: int = 4) -> None:
    """OpenMP threads for faiss, and BLAS from `blas_threshold` queries on: the default (20) scans the whole
    matrix once per query below 20, so a batch of 8 would cost 8 scans instead of one sgemm. numpy's own
    OpenBLAS (exact re-scoring) is capped too: uncapped it spins one thread per core next to faiss's.

    OpenMP's thread count is per thread: a thread started after this call (a gRPC handler) still gets one
    OpenMP thread per core unless it calls this itself (retrieval_service/server.py runs it in every handler
    thread). On a small machine a Search next to the worker's LM pass with 2 OpenMP threads took much longer
    than alone."""
    faiss.omp_set_num_threads(max(1, threads))
    threadpool_limits(limits=max(1, threads), user_api="blas")
    faiss.cvar.distance_compute_blas_threshold = max(1, blas_threshold)


def faiss_metric(metric: str) -> int:
    if metric not in METRICS:
        raise ValueError(f"metric: {metric!r} is not one of {METRICS}")
    return faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2


def build_flat(vectors: np.ndarray, metric: str = "ip") -> faiss.Index:
    """vectors: [N, D] -> IndexFlatIP / IndexFlatL2 (exact) holding a float32 copy."""
    n, d = vectors.shape
    index = faiss.IndexFlatIP(d) if faiss_metric(metric) == faiss.METRIC_INNER_PRODUCT else faiss.IndexFlatL2(d)
    for start in range(0, n, 65536):  # chunks: a float16 memmap is upcast a slice at a time
        index.add(np.ascontiguousarray(vectors[start:start + 65536], dtype=np.float32))
    if metric == "l2":
        index.sync_l2norms()  # else every batched (BLAS) search recomputes all |x|^2 first: a second pass
    return index


def build_fp16_scan(vectors: np.ndarray, metric: str = "ip") -> faiss.Index | None:
    """vectors: [N, D] float16 -> an exhaustive float16 index (IndexScalarQuantizer QT_fp16); None for other
    dtypes, whose float16 rounding would change the candidates."""
    if vectors.dtype != np.float16:
        return None
    n, d = vectors.shape
    index = faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss_metric(metric))
    for start in range(0, n, 65536):
        index.add(np.ascontiguousarray(vectors[start:start + 65536], dtype=np.float32))
    return index


def exact_indexes(vectors: np.ndarray, metric: str, fp16: str = "kernel", scan_threads: int = 0,
                  scan_bounds: int = fp16_scan.BOUND_DIMS
                  ) -> tuple[faiss.Index | fp16_scan.Fp16Scan, faiss.Index | None, np.ndarray]:
    """The exact index for `vectors` [N, D] as config kb_fp16_scan asks (one of FP16_SCANS) -> (exact, faiss's
    float16 copy or None, the vectors to re-score from: the in-memory float16 rows the kernel scans, else
    `vectors` as given). "kernel" falls back to "faiss" when the kernel cannot be built; float32 vectors always
    get the IndexFlat alone. scan_threads, scan_bounds: config kb_scan_threads, kb_scan_bounds (Fp16Scan)."""
    if fp16 not in FP16_SCANS:
        raise ValueError(f"kb_fp16_scan: {fp16!r} is not one of {FP16_SCANS}")
    if fp16 == "kernel" and vectors.dtype == np.float16 and fp16_scan.library() is not None:
        rows = np.empty(vectors.shape, np.float16)  # anonymous memory: the page-cache mapping scans slower
        for start in range(0, len(vectors), 65536):
            rows[start:start + 65536] = vectors[start:start + 65536]
        return fp16_scan.open_scan(rows, metric, scan_threads, scan_bounds), None, rows
    return build_flat(vectors, metric), (build_fp16_scan(vectors, metric) if fp16 == "faiss" else None), vectors


def build_hnsw(vectors: np.ndarray, metric: str = "ip", m: int = 32, ef_construction: int = 200,
               progress: Callable[[int], None] | None = None) -> faiss.IndexHNSWFlat:
    """vectors: [N, D] -> IndexHNSWFlat(M, efConstruction)."""
    n, d = vectors.shape
    if m < 2 or ef_construction < 1:
        raise ValueError(f"hnsw: M={m} must be >= 2 and efConstruction={ef_construction} >= 1")
    index = faiss.IndexHNSWFlat(d, m, faiss_metric(metric))
    index.hnsw.efConstruction = ef_construction
    step = 8192
    for start in range(0, n, step):
        index.add(np.ascontiguousarray(vectors[start:start + step], dtype=np.float32))
        if progress is not None:
            progress(min(step, n - start))
    return index


# ----------------------------------------------------------------------------- resumable passage encoding

def encode_passages(records: Callable[[int, int], Iterator[dict]], n: int, out_dir: Path, encoder: Encoder, *,
                    fingerprint: str, dtype: str = "float32", chunk: int = 4096, batch_size: int = 64,
                    progress=None, reuse: Callable[[int, int], np.ndarray | None] | None = None,
                    pool: EncodeWork | None = None, workers: int = 1) -> Path:
    """Encode passages [0, n) into out_dir/embeddings.npy ([n, dim], float32 or float16).

    Work is cut into chunks written atomically to out_dir/chunks/; a rerun skips finished chunks (same
    passages fingerprint, encoder and dtype), then the chunks are assembled into one memory-mappable .npy.
    reuse(start, stop): rows another KB already encoded for these very passages (prefix_rows), or None.
    pool, workers: with workers > 1 and more than one chunk left, the chunks are encoded by that many processes
    (encode_pool.py; pool says what they load), else here by `encoder`, in order.
    """
    if dtype not in ("float32", "float16"):
        raise ValueError(f"dtype: {dtype!r} is not float32 or float16")
    chunks = out_dir / "chunks"
    meta = {"fingerprint": fingerprint, "encoder": encoder.name, "encoder_dtype": encoder.dtype,
            "dim": encoder.dim, "dtype": dtype, "chunk": chunk, "n": n}
    meta_path = chunks / META_FILE
    if chunks.is_dir() and (not meta_path.is_file() or json.loads(meta_path.read_text()) != meta):
        shutil.rmtree(chunks)  # left over from other passages or settings: not resumable
    chunks.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(meta_path, json.dumps(meta))
    # Encoding time summed over the runs of a resumed build (a large KB takes several), with the rows it covers.
    stats_path = chunks / STATS_FILE
    stats = {"encode_seconds": 0.0, "encoded_rows": 0, "copied_rows": 0}
    if stats_path.is_file():
        stats.update(json.loads(stats_path.read_text()))
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]

    def done(span: tuple[int, int], key: str, seconds: float = 0.0) -> None:
        stats[key] += span[1] - span[0]
        stats["encode_seconds"] += seconds
        _atomic_write_text(stats_path, json.dumps(stats))
        if progress is not None:
            progress.update(span[1] - span[0])

    todo = []
    for span in spans:
        path = chunk_path(chunks, span)
        if path.is_file():
            try:
                if np.load(path, mmap_mode="r").shape == (span[1] - span[0], encoder.dim):
                    if progress is not None:
                        progress.update(span[1] - span[0])
                    continue
            except ValueError:
                pass  # torn or foreign file: encode again
        vecs = reuse(*span) if reuse is not None else None
        if vecs is None:
            todo.append(span)
            continue
        write_chunk(path, vecs)
        done(span, "copied_rows")
    if pool is not None and workers > 1 and len(todo) > 1:
        last = time.perf_counter()
        for span in encode_spans(pool, todo, workers):  # wall time: the workers run at once
            now = time.perf_counter()
            done(span, "encoded_rows", now - last)
            last = now
    else:
        for span in todo:
            t0 = time.perf_counter()
            texts = [passage_input(r["title"], r["text"]) for r in records(*span)]
            write_chunk(chunk_path(chunks, span), encoder.encode(texts, batch_size=batch_size).astype(dtype))
            done(span, "encoded_rows", time.perf_counter() - t0)
    final = out_dir / EMBEDDINGS_FILE
    tmp = out_dir / (EMBEDDINGS_FILE + ".tmp.npy")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n, encoder.dim))
    for span in spans:
        arr[span[0]:span[1]] = np.load(chunk_path(chunks, span))
    arr.flush()
    del arr
    os.replace(tmp, final)
    final_meta = {k: meta[k] for k in ("fingerprint", "encoder", "encoder_dtype", "dim", "dtype", "n")}
    _atomic_write_text(out_dir / META_FILE, json.dumps({**final_meta, "build": stats}))
    shutil.rmtree(chunks)
    return final


def prefix_rows(parent_dense: Path, *, encoder: str, encoder_dtype: str, dtype: str,
                dim: int) -> Callable[[int, int], np.ndarray | None]:
    """Rows [start, stop) of another KB's embeddings (finished, or the chunks of a build still encoding), if it
    used the same encoder settings; the caller has checked that its passages begin with ours."""
    want = {"encoder": encoder, "encoder_dtype": encoder_dtype, "dtype": dtype, "dim": dim}

    def same(meta_path: Path) -> bool:
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        return {k: meta.get(k, "float32" if k == "encoder_dtype" else None) for k in want} == want

    def rows(start: int, stop: int) -> np.ndarray | None:
        final = parent_dense / EMBEDDINGS_FILE
        if final.is_file() and same(parent_dense / META_FILE):
            arr = np.load(final, mmap_mode="r")
            return np.array(arr[start:stop]) if stop <= len(arr) else None
        chunks = parent_dense / "chunks"
        if not same(chunks / META_FILE):
            return None
        parts = []
        for path in sorted(chunks.glob("*-*.npy")):  # names: start-stop, zero-padded
            try:
                a, b = (int(x) for x in path.name[:-4].split("-"))
            except ValueError:
                continue  # a .tmp being written
            if b <= start or a >= stop:
                continue
            parts.append((a, b, path))
        out = np.empty((stop - start, dim), dtype=dtype)
        covered = 0
        for a, b, path in parts:
            lo, hi = max(a, start), min(b, stop)
            out[lo - start:hi - start] = np.load(path, mmap_mode="r")[lo - a:hi - a]
            covered += hi - lo
        return out if covered == stop - start else None

    return rows


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ vector index

@dataclass
class VectorIndex:
    """A named set of vectors with an exact index and optionally an approximate one.

    vectors: [N, D] stored vectors (memmap ok) used to re-score candidates and to return vectors; None for
    an index that cannot give them back (then faiss's scores are returned as they are).
    exact: faiss's IndexFlat or the float16 kernel's scan (exact_indexes).
    exact_fp16: faiss's float16 copy of the vectors (build_fp16_scan), used instead of an IndexFlat `exact` for
    exact searches of at most `fp16_max_batch` queries.
    """

    name: str
    metric: str
    exact: faiss.Index | fp16_scan.Fp16Scan | None
    approx: faiss.Index | None = None
    vectors: np.ndarray | None = None
    default_ef_search: int = 128
    rescore_margin: int = RESCORE_MARGIN
    info: dict = field(default_factory=dict)
    exact_fp16: faiss.Index | None = None
    fp16_max_batch: int = FP16_SCAN_MAX_BATCH

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"{self.name}: metric {self.metric!r} is not one of {METRICS}")
        if self.exact is None and self.approx is None:
            raise ValueError(f"{self.name}: needs an exact or an approximate index")
        base = self.exact if self.exact is not None else self.approx
        self.dim = int(base.d)
        self.size = int(base.ntotal)
        if self.exact_fp16 is not None and self.exact is None:
            raise ValueError(f"{self.name}: a float16 scan needs the exact index beside it (large batches)")
        for idx in (self.exact, self.approx, self.exact_fp16):
            if idx is not None and (idx.d != self.dim or idx.ntotal != self.size):
                raise ValueError(f"{self.name}: exact and approximate indexes disagree "
                                 f"({idx.ntotal}x{idx.d} vs {self.size}x{self.dim})")
        if self.vectors is not None and tuple(self.vectors.shape) != (self.size, self.dim):
            raise ValueError(f"{self.name}: vectors {tuple(self.vectors.shape)} do not match the index "
                             f"({self.size}, {self.dim})")

    @property
    def retrievers(self) -> list[str]:
        return [r for r, idx in (("edr", self.exact), ("adr", self.approx)) if idx is not None]

    def search(self, queries: np.ndarray, k: int, *, approx: bool = False,
               ef_search: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """queries: [B, D] float32 -> per query (ids int64 [n], scores float32 [n]), n <= k, best first.

        One faiss call for the whole batch (a matrix of queries), then exact re-scoring of k + margin
        candidates per query.
        """
        index = self.approx if approx else self.exact
        if index is None:
            raise LookupError(f"{self.name}: no {'approximate' if approx else 'exact'} index")
        if not approx and self.exact_fp16 is not None and len(queries) <= self.fp16_max_batch:
            index = self.exact_fp16
        kk = min(self.size, k + (self.rescore_margin if self.vectors is not None else 0))
        if kk == 0:
            return [(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in range(len(queries))]
        q = np.ascontiguousarray(queries, dtype=np.float32)  # [B, D]
        params = None
        if approx and isinstance(index, faiss.IndexHNSW):
            params = faiss.SearchParametersHNSW(efSearch=max(ef_search or self.default_ef_search, kk))
        if isinstance(index, fp16_scan.Fp16Scan):
            # Higher-is-better scores; only the ids are used below (the kernel's index always has its vectors).
            dist, ids = index.search(q, kk)
        else:
            dist, ids = index.search(q, kk, params=params)  # [B, kk], [B, kk]
        if self.vectors is None:
            scores = -dist if self.metric == "l2" else dist
            return [(row_ids[row_ids >= 0][:k].astype(np.int64), row_s[row_ids >= 0][:k].astype(np.float32))
                    for row_ids, row_s in zip(ids, scores)]
        valid = ids >= 0
        safe = np.where(valid, ids, 0)
        scores = fp16_scan.candidate_scores(self.vectors, q, safe, self.metric)  # one call for the whole batch
        scores[~valid] = -np.inf
        order = np.lexsort((ids, -scores.astype(np.float64)), axis=-1)  # [B, kk]
        ids = np.take_along_axis(ids, order, -1)[:, :k]
        scores = np.take_along_axis(scores, order, -1)[:, :k]
        return [(row_ids[row_ids >= 0].astype(np.int64), row_s[row_ids >= 0]) for row_ids, row_s in zip(ids, scores)]

    @property
    def exact_kind(self) -> str:
        """How exact search runs: "kernel", "faiss-fp16" (faiss's float16 copy for small batches), "faiss"
        (float32 IndexFlat), or "" (no exact index)."""
        if isinstance(self.exact, fp16_scan.Fp16Scan):
            return "kernel"
        if self.exact is None:
            return ""
        return "faiss-fp16" if self.exact_fp16 is not None else "faiss"

    def score(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """query: [D], ids: [n] -> [n] float32, the exact scores search() returns for those docs."""
        if self.vectors is None:
            raise LookupError(f"{self.name}: the index keeps no vectors, so candidates cannot be scored")
        return fp16_scan.candidate_scores(self.vectors, np.asarray(query, np.float32)[None, :],
                                          np.asarray(ids, dtype=np.int64)[None, :], self.metric)[0]

    def get_vectors(self, ids: np.ndarray) -> np.ndarray:
        """ids: [n] -> [n, D] float32."""
        if self.vectors is not None:
            return np.asarray(fp16_scan.candidate_rows(self.vectors, ids), dtype=np.float32)
        base = self.exact if self.exact is not None else self.approx
        return np.stack([base.reconstruct(int(i)) for i in ids]) if len(ids) else np.zeros((0, self.dim), np.float32)

    def warmup(self, rounds: int = 3) -> None:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((8, self.dim)).astype(np.float32)
        for _ in range(rounds):
            for b in (1, 8):
                if self.exact is not None:
                    self.search(q[:b], 10)
                if self.approx is not None:
                    self.search(q[:b], 10, approx=True)
        if self.vectors is not None and self.size:
            # Touch the stored vectors once so the first requests do not pay for page faults.
            step = max(1, self.size // 4096)
            float(np.asarray(self.vectors[::step], dtype=np.float32).sum())


def open_kb_vectors(dense_dir: Path, *, fingerprint: str, n: int, load_exact: bool, load_approx: bool,
                    ef_search: int = 128, rescore_margin: int = RESCORE_MARGIN,
                    fp16: str = "kernel", scan_threads: int = 0,
                    scan_bounds: int = fp16_scan.BOUND_DIMS) -> VectorIndex:
    """The KB's dense index: embeddings.npy (memmap) + its exact index (exact_indexes; `fp16`, `scan_threads`
    and `scan_bounds` are config kb_fp16_scan, kb_scan_threads and kb_scan_bounds) + hnsw.faiss if present."""
    meta_path = dense_dir / META_FILE
    emb_path = dense_dir / EMBEDDINGS_FILE
    if not meta_path.is_file() or not emb_path.is_file():
        raise FileNotFoundError(f"{dense_dir}: no {EMBEDDINGS_FILE}/{META_FILE}")
    meta = json.loads(meta_path.read_text())
    if meta.get("fingerprint") != fingerprint or meta.get("n") != n:
        raise ValueError(f"{dense_dir}: embeddings were built for other passages "
                         f"(n={meta.get('n')} vs {n}); rebuild with the build CLI")
    vectors = np.load(emb_path, mmap_mode="r")  # [N, D] float32|float16
    if vectors.shape != (n, meta["dim"]) or str(vectors.dtype) != meta["dtype"]:
        raise ValueError(f"{emb_path}: shape {vectors.shape} {vectors.dtype} does not match its meta "
                         f"({n}, {meta['dim']}) {meta['dtype']}")
    t0 = time.perf_counter()
    exact, exact_fp16 = None, None
    if load_exact:
        exact, exact_fp16, vectors = exact_indexes(vectors, "ip", fp16, scan_threads, scan_bounds)
    flat_s = time.perf_counter() - t0
    approx = None
    hnsw_path = dense_dir / HNSW_FILE
    hnsw_meta: dict = {}
    if load_approx and hnsw_path.is_file():
        hnsw_meta = json.loads((dense_dir / "hnsw.json").read_text())
        if hnsw_meta.get("fingerprint") != fingerprint:
            raise ValueError(f"{hnsw_path}: built for other passages; rebuild with the build CLI")
        try:
            approx = faiss.read_index(str(hnsw_path))
        except RuntimeError as e:
            raise ValueError(f"{hnsw_path}: cannot be read ({e}); rebuild with the build CLI") from None
    return VectorIndex("kb", "ip", exact, approx, vectors, default_ef_search=ef_search,
                       rescore_margin=rescore_margin,
                       info={"encoder": meta.get("encoder"), "encoder_dtype": meta.get("encoder_dtype", "float32"),
                             "dtype": meta["dtype"], "flat_build_s": flat_s,
                             "hnsw": hnsw_meta},
                       exact_fp16=exact_fp16)


def load_vector_index(name: str, *, metric: str, exact_path: str | Path | None = None,
                      approx_path: str | Path | None = None, vectors_path: str | Path | None = None,
                      ef_search: int = 128) -> VectorIndex:
    """A named vector index from files (faiss write_index files, an .npy of the stored vectors [N, D]), for
    KnowledgeBase.add_vector_index; e.g. kNN-LM keys: exact_path=keys.flat.faiss, vectors_path=keys.npy."""
    def read(path):
        if path is None:
            return None
        try:
            return faiss.read_index(str(path))
        except RuntimeError as e:
            raise ValueError(f"{path}: cannot be read as a faiss index ({e})") from None

    vectors = np.load(vectors_path, mmap_mode="r") if vectors_path is not None else None
    return VectorIndex(name, metric, read(exact_path), read(approx_path), vectors, default_ef_search=ef_search)
