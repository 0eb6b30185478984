"""kNN-LM datastores as named vector indexes of the knowledge base (ids = entry ids, metric l2)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import faiss

from ragcore.knn_store import HNSW_FILE, open_datastore
from retrieval_service.knowledge import dense

log = logging.getLogger(__name__)


def open_vector_index(path: str | Path, *, load_exact: bool = True, load_approx: bool = True,
                      ef_search: int = 128, rescore_margin: int = 16,
                      fp16: str = "kernel", scan_threads: int = 0, scan_bounds: int = dense.fp16_scan.BOUND_DIMS):
    """A datastore as the retrieval service's named vector index (metric l2, ids = entry ids): EDR = the exact
    index of dense.exact_indexes over keys.npy (`fp16`, `scan_threads`, `scan_bounds` are config kb_fp16_scan,
    kb_scan_threads, kb_scan_bounds; float16 keys are scanned in memory by the float16 kernel), ADR = hnsw.faiss. Search
    re-scores candidates exactly from the keys."""
    ds = open_datastore(path)
    exact, exact_fp16, keys = None, None, ds.keys
    if load_exact:
        exact, exact_fp16, keys = dense.exact_indexes(ds.keys, "l2", fp16, scan_threads, scan_bounds)
    approx = None
    if load_approx and (ds.path / HNSW_FILE).is_file():
        approx = faiss.read_index(str(ds.path / HNSW_FILE))
        if approx.ntotal != ds.size or approx.d != ds.dim:
            raise ValueError(f"{ds.path / HNSW_FILE}: {approx.ntotal}x{approx.d} for a datastore of "
                             f"{ds.size}x{ds.dim}; rebuild")
    if exact is None and approx is None:
        raise ValueError(f"kNN-LM datastore {ds.path}: neither edr nor adr requested/available")
    return dense.VectorIndex(ds.name, "l2", exact, approx, keys, default_ef_search=ef_search,
                             rescore_margin=rescore_margin, info={"path": str(ds.path), "kind": "knnlm"},
                             exact_fp16=exact_fp16)


def add_to_kb(kb, paths: str, cfg) -> None:
    """Register each comma-separated datastore directory on `kb` as a named vector index (warmed up)."""
    wanted = {r.strip() for r in cfg.kb_retrievers.split(",") if r.strip()} if cfg.kb_retrievers else {"edr", "adr"}
    for p in (s.strip() for s in paths.split(",")):
        if not p:
            continue
        t0 = time.perf_counter()
        vi = open_vector_index(p, load_exact="edr" in wanted, load_approx="adr" in wanted,
                               ef_search=cfg.kb_ef_search, rescore_margin=cfg.kb_rescore_margin,
                               fp16=cfg.kb_fp16_scan, scan_threads=cfg.kb_scan_threads,
                               scan_bounds=cfg.kb_scan_bounds)
        vi.warmup()
        kb.add_vector_index(vi)
        log.info("kNN-LM index %r (%d x %d, %s, exact search: %s) from %s ready in %.1f s", vi.name, vi.size,
                 vi.dim, "+".join(vi.retrievers), vi.exact_kind or "none", p, time.perf_counter() - t0)
