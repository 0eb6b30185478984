"""kNN-LM datastores as named vector indexes of the knowledge base (ids = entry ids, metric l2)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import faiss
import numpy as np

from ragcore.knn_store import HNSW_FILE, open_datastore
from retrieval_service.knowledge import dense

log = logging.getLogger(__name__)


def open_vector_index(path: str | Path, *, load_exact: bool = True, load_approx: bool = True,
                      ef_search: int = 128, rescore_margin: int = 16,
                      fp16_max_batch: int = dense.FP16_SCAN_MAX_BATCH):
    """A datastore as the retrieval service's named vector index (metric l2, ids = entry ids): EDR = IndexFlatL2
    built from keys.npy at load (with cached norms, so a batch of queries costs one pass over the keys; float16
    keys also get a float16 copy for searches of up to `fp16_max_batch` queries, 0 = none), ADR = hnsw.faiss.
    Search re-scores candidates exactly from the memory-mapped keys."""
    ds = open_datastore(path)
    exact = None
    if load_exact:
        exact = faiss.IndexFlatL2(ds.dim)
        for s in range(0, ds.size, 65536):
            exact.add(np.ascontiguousarray(ds.keys[s:s + 65536], dtype=np.float32))
        # Without cached norms every batched (BLAS) search first recomputes all ||key||^2: a second pass.
        exact.sync_l2norms()
    exact_fp16 = dense.build_fp16_scan(ds.keys, "l2") if load_exact and fp16_max_batch > 0 else None
    approx = None
    if load_approx and (ds.path / HNSW_FILE).is_file():
        approx = faiss.read_index(str(ds.path / HNSW_FILE))
        if approx.ntotal != ds.size or approx.d != ds.dim:
            raise ValueError(f"{ds.path / HNSW_FILE}: {approx.ntotal}x{approx.d} for a datastore of "
                             f"{ds.size}x{ds.dim}; rebuild")
    if exact is None and approx is None:
        raise ValueError(f"kNN-LM datastore {ds.path}: neither edr nor adr requested/available")
    return dense.VectorIndex(ds.name, "l2", exact, approx, ds.keys, default_ef_search=ef_search,
                             rescore_margin=rescore_margin, info={"path": str(ds.path), "kind": "knnlm"},
                             exact_fp16=exact_fp16, fp16_max_batch=fp16_max_batch)


def add_to_kb(kb, paths: str, cfg) -> None:
    """Register each comma-separated datastore directory on `kb` as a named vector index (warmed up)."""
    wanted = {r.strip() for r in cfg.kb_retrievers.split(",") if r.strip()} if cfg.kb_retrievers else {"edr", "adr"}
    for p in (s.strip() for s in paths.split(",")):
        if not p:
            continue
        t0 = time.perf_counter()
        vi = open_vector_index(p, load_exact="edr" in wanted, load_approx="adr" in wanted,
                               ef_search=cfg.kb_ef_search, rescore_margin=cfg.kb_rescore_margin,
                               fp16_max_batch=cfg.kb_fp16_scan_batch)
        vi.warmup()
        kb.add_vector_index(vi)
        log.info("kNN-LM index %r (%d x %d, %s) from %s ready in %.1f s", vi.name, vi.size, vi.dim,
                 "+".join(vi.retrievers), p, time.perf_counter() - t0)
