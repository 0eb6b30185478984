"""Passage encoding in several processes: each worker loads its own encoder and encodes whole chunks, writing each
chunk file atomically, so an interrupted build resumes from the chunks on disk as the one-process path does.

Why processes: on 2 cores two processes with one torch thread each encoded clearly more passages per second than
one process with two threads (runs interleaved): at batch 32 the encoder's small matmuls spend much of a two-thread
pass waiting for each other.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ragcore.encoder import Encoder, passage_input
from ragcore.machine import usable_cores
from retrieval_service.knowledge.passages import PassageStore

Span = tuple[int, int]


@dataclass(frozen=True)
class EncodeWork:
    """What every worker needs (picklable: workers are spawned, not forked, so torch starts clean in each)."""

    passages_dir: str  # a PassageStore directory
    chunks_dir: str
    encoder_dtype: str  # ragcore.encoder.ENCODER_DTYPES
    dtype: str  # stored: float32 or float16
    batch_size: int
    threads: int = 1  # torch threads per worker


def auto_workers(threads: int) -> int:
    """Encoder processes for `threads` torch threads each: one per that many usable cores."""
    return max(1, usable_cores() // max(1, threads))


def chunk_path(chunks_dir: Path, span: Span) -> Path:
    start, stop = span
    return Path(chunks_dir) / f"{start:010d}-{stop:010d}.npy"


def write_chunk(path: Path, vecs: np.ndarray) -> None:
    """Atomically: a reader (or a resumed build) sees the whole chunk or none of it."""
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, vecs)
    os.replace(tmp, path)


def _worker(work: EncodeWork, tasks, results) -> None:
    store = PassageStore(Path(work.passages_dir))  # first: a worker that cannot read them dies before the encoder loads
    try:
        encoder = Encoder(threads=work.threads, cache_size=0, dtype=work.encoder_dtype)
        while (span := tasks.get()) is not None:
            texts = [passage_input(r["title"], r["text"]) for r in store.iter_range(*span)]
            vecs = encoder.encode(texts, batch_size=work.batch_size).astype(work.dtype)
            write_chunk(chunk_path(Path(work.chunks_dir), span), vecs)
            results.put(span)
    finally:
        store.close()


def encode_spans(work: EncodeWork, spans: list[Span], workers: int, poll_s: float = 1.0) -> Iterator[Span]:
    """Encode every span into its chunk file with `workers` processes; yields each span as its file lands.

    A worker that dies (an exception, a kill) stops the whole run with RuntimeError; the chunks written before stay
    on disk for the resumed build. The workers are stopped when the caller stops iterating (or is interrupted).
    """
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for span in spans:
        tasks.put(span)
    n = max(1, min(workers, len(spans)))
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_worker, args=(work, tasks, results), name=f"encode-{i}", daemon=True)
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        for _ in spans:
            while True:
                try:
                    yield tuple(results.get(timeout=poll_s))
                    break
                except queue.Empty:
                    failed = [p for p in procs if p.exitcode not in (None, 0)]
                    if failed:
                        raise RuntimeError(f"encoding worker {failed[0].name} died (exit code {failed[0].exitcode}); "
                                           "the chunks written so far are kept: run the build again to resume")
                    if all(p.exitcode == 0 for p in procs) and results.empty():
                        raise RuntimeError("the encoding workers finished without encoding every chunk")
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10.0
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
