"""kNN-LM datastore: one entry per corpus token, built with the serving model, served as a named vector index.

Entry of document d at token position p (1 <= p < len(d)):
    key   = the model's final hidden state (the input of its output layer) after reading d[..p-1]
    value = d[p], the token that came next
Entries are numbered document by document, position by position, so entry i + 1 is what followed entry i in the
corpus. RaLMSpec's kNN-LM cache relies on exactly that spatial locality (after retrieving entry j, cache j+1..j+n).

Why the final hidden state and not the last FFN input (which Khandelwal et al. found slightly better): it is the
vector the serving pass already computes for its logits, it exists under that meaning for every HF causal LM
(no hook into one architecture's layers), and build and serving read it the same way.

Why the retrieval service returns entry ids and the worker maps them to next tokens itself: the vector Search
stays generic (no knowledge.proto change), values cost 4 bytes per entry, and the worker needs the values and
keys of entries that were *not* hits anyway (the cache's j+1..j+n), which Search cannot return.

Long documents are cut into windows of `window` tokens overlapping by `overlap`: every key after a document's
first window has seen at least `overlap` tokens of context.

On disk: the layout of ragcore/knn_store.py (keys.npy is memory-mapped by the retrieval service for the exact
index and re-scoring, and by the worker for cache fill).
Build: corpus -> tokens -> key chunks (resumable, written atomically) -> keys/values -> HNSW (checkpointed) -> knn.json
Chunk files are named by their entry range and a hash of the tokens they read, so a rerun with another
--max-entries reuses every chunk before the cut. On a machine with spare cores two helper processes shorten the
build: --keys-from-end computes the missing chunks backwards, --hnsw-follow inserts chunks into the HNSW
checkpoint as they land (the build resumes from it). One torch thread per process: on an oversubscribed CPU a
multi-threaded pass stalls at every barrier (measured under load 12 on 2 cores: 2 threads >10x slower than 1).

    python -m tools.knn_build --out ~/.cache/ragserve/knnlm/docs --max-entries 1000000 \
        --threads 1 --window 256 --overlap 32 --chunk-entries 4096 --hnsw-m 16 --hnsw-ef-construction 48
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Sequence

import faiss
import numpy as np
import torch
from tqdm import tqdm

from generation_service.config import DTYPE_CHOICES
from generation_service.engine.calibrate import calibrated_model
from generation_service.model.target import load_model, set_threads
from ragcore.knn_store import (
    DEFAULT_DIR,
    DEFAULT_NAME,
    DOCS_FILE,
    FORMAT,
    HELD_OUT_DOCS_FILE,
    HELD_OUT_FILE,
    HNSW_FILE,
    KEY_DTYPES,
    KEYS_FILE,
    MANIFEST,
    TOKENS_FILE,
    VALUES_FILE,
    check_datastore,
    entry_offsets,
    open_datastore,
)
from ragcore.model_files import tokenizer_identity
from ragcore.process import offline_process
from retrieval_service.knowledge import passages as P

log = logging.getLogger(__name__)

SOURCES = ("rst", "docstrings")
KEY_KIND = "final_hidden_state"


# ------------------------------------------------------------------------------------------- pure cores


def plan_windows(length: int, window: int, overlap: int) -> list[tuple[int, int, int]]:
    """Windows over one document of `length` tokens -> [(start, stop, keep_from)]: the pass reads
    tokens[start:stop] and stores the entries whose value position p lies in [max(keep_from, start + 1), stop).
    Every p in [1, length) is stored exactly once.

    plan_windows(10, 4, 1) -> [(0, 4, 0), (3, 7, 4), (6, 10, 7)]   # not [(0, 4, 0), (4, 8, 4), ...]: no context
    """
    if window < 2 or not 0 <= overlap < window:
        raise ValueError(f"window/overlap: need window >= 2 and 0 <= overlap < window, got {window}/{overlap}")
    if length < 2:
        return []
    out = [(0, min(window, length), 0)]
    while out[-1][1] < length:
        keep = out[-1][1]
        start = keep - overlap
        out.append((start, min(start + window, length), keep))
    return out


def stable_rank(key: str) -> int:
    """A deterministic pseudo-random rank of a document key (the corpus order and the held-out split)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little")


# --------------------------------------------------------------------------------------------- corpus


def corpus_documents(tokenizer, sources: Sequence[str] = ("rst",), held_out_every: int = 25,
                     max_entries: int = 0) -> tuple[list[tuple[str, np.ndarray]], list[tuple[str, np.ndarray]]]:
    """The docs corpus tokenized -> (datastore documents, held-out documents), each [(key, int32 tokens)].

    Documents are shuffled by a hash of their key (so a `max_entries` prefix samples every part of the docs,
    not just the alphabetically first directories); one in `held_out_every` is held out (perplexity, benchmark
    prompts) and never enters the datastore. The last datastore document is cut so the total is max_entries.
    """

    bad = set(sources) - set(SOURCES)
    if bad or not sources:
        raise ValueError(f"sources: {sorted(bad) or 'none'} not in {SOURCES}")
    if held_out_every < 2:
        raise ValueError(f"held_out_every: {held_out_every} must be >= 2")
    docs = list(P.iter_rst_documents()) if "rst" in sources else []
    if "docstrings" in sources:
        docs += list(P.iter_documents(rst=False, site=False))  # the standard library's docstrings
    docs.sort(key=lambda d: (stable_rank(d.key), d.key))
    train: list[tuple[str, np.ndarray]] = []
    held: list[tuple[str, np.ndarray]] = []
    entries = 0
    for doc in docs:
        text = "\n\n".join(doc.sections)
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)
        if ids.size < 2:
            continue
        if stable_rank("held-out:" + doc.key) % held_out_every == 0:
            held.append((doc.key, ids))
            continue
        if max_entries and entries >= max_entries:
            continue  # keep scanning: the held-out set must not depend on max_entries
        if max_entries and entries + ids.size - 1 > max_entries:
            ids = ids[: max_entries - entries + 1]
        train.append((doc.key, ids))
        entries += ids.size - 1
    return train, held


# ------------------------------------------------------------------------------------------ key passes


def decoder_hidden(tm, ids: np.ndarray):
    """ids: int [L] -> final hidden states float32 [L, D] (row j: after reading ids[..j]), one causal pass.

    The decoder stack without the output layer: its last_hidden_state is what the output layer multiplies (for
    Llama-style models after the final norm), and skipping the [L, vocab] logits saves ~20 % of the pass.
    """

    with torch.inference_mode():
        x = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].to(tm.device)  # [1, L]
        out = tm.model.get_decoder()(input_ids=x, use_cache=False)
        return out.last_hidden_state[0].float().cpu().numpy()  # [L, D]


def chunk_plan(doc_lengths: Sequence[int], window: int, overlap: int,
               chunk_entries: int) -> list[list[tuple[int, int, int, int]]]:
    """Group the windows of all documents, in order, into chunks of >= chunk_entries entries (the last may be
    smaller) -> per chunk [(doc, start, stop, keep_from)]. The plan is a pure function of its arguments, so a
    resumed build cuts the same chunks."""
    chunks: list[list[tuple[int, int, int, int]]] = [[]]
    n = 0
    for d, length in enumerate(doc_lengths):
        for start, stop, keep in plan_windows(int(length), window, overlap):
            chunks[-1].append((d, start, stop, keep))
            n += stop - max(keep, start + 1)
            if n >= chunk_entries:
                chunks.append([])
                n = 0
    return [c for c in chunks if c]


def compute_chunk(tm, tokens: np.ndarray, docs: np.ndarray, windows: list[tuple[int, int, int, int]],
                  hidden: Callable = decoder_hidden) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's windows -> (keys float32 [n, D], values int32 [n]) in entry order."""
    keys, values = [], []
    for d, start, stop, keep in windows:
        doc = tokens[docs[d, 0]:docs[d + 1, 0]]
        h = hidden(tm, doc[start:stop])  # [stop - start, D]
        p = np.arange(max(keep, start + 1), stop)  # value positions stored by this window
        keys.append(h[p - 1 - start])
        values.append(doc[p])
    return np.concatenate(keys).astype(np.float32), np.concatenate(values).astype(np.int32)


def chunk_spans(tokens: np.ndarray, docs: np.ndarray, window: int, overlap: int,
                chunk_entries: int) -> list[tuple[list[tuple[int, int, int, int]], int, int, str]]:
    """The build's chunks -> [(windows, first entry, end entry, file stem)]. The stem names the entry range and a
    hash of the tokens the chunk's windows read, so a chunk file stays valid for any corpus that contains the
    same windows at the same entry offsets (a larger or smaller --max-entries shares every chunk before the cut)."""
    lengths = np.diff(docs[:, 0]).tolist()
    out, start = [], 0
    for windows in chunk_plan(lengths, window, overlap, chunk_entries):
        size = sum(stop - max(keep, s + 1) for _, s, stop, keep in windows)
        h = hashlib.sha256()
        for d, s, stop, keep in windows:
            h.update(np.asarray(tokens[docs[d, 0] + s:docs[d, 0] + stop], dtype=np.int32).tobytes())
            h.update(np.array([s, stop, keep], np.int64).tobytes())
        out.append((windows, start, start + size, f"{start:010d}-{start + size:010d}-{h.hexdigest()[:16]}"))
        start += size
    return out


# ---------------------------------------------------------------------------------------------- build


def _atomic_save(path: Path, arr: np.ndarray) -> None:
    # The pid keeps two builder processes that race for the same chunk (--keys-from-end) off each other's tmp.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp.npy")
    np.save(tmp, arr)
    os.replace(tmp, path)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _progress(total: int, desc: str, enabled: bool):

    return tqdm(total=total, desc=desc, unit="entry", unit_scale=True, disable=not enabled, smoothing=0.05)


def build_datastore(out: str | Path, docs: Sequence[tuple[str, np.ndarray]], tm, *, name: str = DEFAULT_NAME,
                    dtype: str = "float16", window: int = 512, overlap: int = 128, chunk_entries: int = 16384,
                    hnsw: bool = True, hnsw_m: int = 32, hnsw_ef_construction: int = 100,
                    checkpoint_s: float = 300.0, corpus: dict | None = None, progress: bool = True) -> Path:
    """Build (or resume building) a datastore in `out` from tokenized documents with the serving model `tm`.

    Resumable: key chunks land atomically in out/chunks/ and are skipped on a rerun with the same plan (same
    tokens, model, window, dtype); the HNSW build saves a checkpoint every `checkpoint_s` seconds. knn.json is
    written last.
    """

    if dtype not in KEY_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {KEY_DTYPES}")
    if chunk_entries < 1:
        raise ValueError(f"chunk_entries: {chunk_entries} must be >= 1")
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST).is_file():
        (out / MANIFEST).unlink()  # rebuilding: the directory is not a valid datastore until the end
    t_start = time.perf_counter()
    lengths = [int(t.size) for _, t in docs]
    if not lengths or sum(lengths) - len(lengths) < 1:
        raise ValueError("docs: need at least one document of >= 2 tokens")
    tokens = np.concatenate([t for _, t in docs]).astype(np.int32)  # [T]
    doc_table = np.stack([np.concatenate(([0], np.cumsum(lengths))), entry_offsets(lengths)], axis=1)  # [n+1, 2]
    n = int(doc_table[-1, 1])
    _atomic_save(out / TOKENS_FILE, tokens)
    _atomic_save(out / DOCS_FILE, doc_table.astype(np.int64))

    model_id = {"model": str(tm.model_dir), "model_dtype": tm.dtype_name, "tokenizer_id": tokenizer_identity(tm.tokenizer)}
    plan = {"format": FORMAT, "tokens_sha256": hashlib.sha256(tokens.tobytes()).hexdigest(),
            "docs_sha256": hashlib.sha256(doc_table.astype(np.int64).tobytes()).hexdigest(), **model_id,
            "window": window, "overlap": overlap, "chunk_entries": chunk_entries, "dtype": dtype, "key": KEY_KIND}
    chunks_dir = out / "chunks"
    plan_path = chunks_dir / "plan.json"
    corpus_free = lambda p: {k: v for k, v in p.items() if k not in ("tokens_sha256", "docs_sha256")}  # noqa: E731
    if chunks_dir.is_dir() and (not plan_path.is_file()
                                or corpus_free(json.loads(plan_path.read_text())) != corpus_free(plan)):
        log.info("%s: chunks from another plan; starting over", chunks_dir)
        shutil.rmtree(chunks_dir)
    chunks_dir.mkdir(exist_ok=True)
    _atomic_text(plan_path, json.dumps(plan, sort_keys=True))

    # 1. Keys and values, chunk by chunk.
    t0 = time.perf_counter()
    dim = int(tm.model.config.get_text_config().hidden_size if hasattr(tm.model.config, "get_text_config")
              else tm.model.config.hidden_size)
    spans = chunk_spans(tokens, doc_table, window, overlap, chunk_entries)
    bar = _progress(n, "keys", progress)
    for windows, start, stop_, stem in spans:
        size = stop_ - start
        kpath = chunks_dir / f"{stem}.keys.npy"
        vpath = chunks_dir / f"{stem}.values.npy"
        done = False
        if kpath.is_file() and vpath.is_file():
            try:
                done = (np.load(kpath, mmap_mode="r").shape == (size, dim)
                        and np.load(vpath, mmap_mode="r").shape == (size,))
            except ValueError:
                done = False  # torn or foreign file: compute again
        if not done:
            keys, values = compute_chunk(tm, tokens, doc_table, windows)
            keys = keys.astype(dtype)
            if not np.all(np.isfinite(keys)):
                raise ValueError(f"keys: non-finite values in entries {start}..{stop_} when stored as {dtype} "
                                 "(hidden states out of range); rebuild with --dtype float32")
            _atomic_save(vpath, values)
            _atomic_save(kpath, keys)  # keys last: their presence marks the chunk complete
        bar.update(size)
    bar.close()
    keys_s = time.perf_counter() - t0

    # 2. Assemble one memory-mappable keys.npy / values.npy.
    tmp_k = out / (KEYS_FILE + ".tmp.npy")
    keys_mm = np.lib.format.open_memmap(tmp_k, mode="w+", dtype=dtype, shape=(n, dim))
    values = np.empty(n, np.int32)
    for _, s, e, stem in spans:
        keys_mm[s:e] = np.load(chunks_dir / f"{stem}.keys.npy")
        values[s:e] = np.load(chunks_dir / f"{stem}.values.npy")
    keys_mm.flush()
    del keys_mm
    os.replace(tmp_k, out / KEYS_FILE)
    _atomic_save(out / VALUES_FILE, values)

    # 3. HNSW (ADR).
    hnsw_meta = None
    if hnsw:
        t0 = time.perf_counter()
        keys = np.load(out / KEYS_FILE, mmap_mode="r")
        build_hnsw(keys, out / HNSW_FILE, m=hnsw_m, ef_construction=hnsw_ef_construction,
                   fingerprint=plan["tokens_sha256"], checkpoint_s=checkpoint_s, progress=progress)
        hnsw_meta = {"m": hnsw_m, "ef_construction": hnsw_ef_construction, "build_s": time.perf_counter() - t0}
    elif (out / HNSW_FILE).exists():
        (out / HNSW_FILE).unlink()

    manifest = {"format": FORMAT, "name": name, "metric": "l2", "key": KEY_KIND, "n": n, "dim": dim,
                "dtype": dtype, **model_id, "window": window, "overlap": overlap, "documents": len(docs),
                "tokens": int(tokens.size), "tokens_sha256": plan["tokens_sha256"], "corpus": corpus or {},
                "hnsw": hnsw_meta, "keys_s": keys_s, "build_s": time.perf_counter() - t_start,
                "bytes": {f: (out / f).stat().st_size for f in (KEYS_FILE, VALUES_FILE, TOKENS_FILE, DOCS_FILE, HNSW_FILE)
                          if (out / f).is_file()}}
    _atomic_text(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    shutil.rmtree(chunks_dir)
    return out


def build_hnsw(keys: np.ndarray, path: Path, *, m: int, ef_construction: int, fingerprint: str,
               checkpoint_s: float = 300.0, progress: bool = True, step: int = 16384) -> None:
    """keys [N, D] -> IndexHNSWFlat(L2) at `path`. Saves path.partial + a state file every checkpoint_s seconds;
    a rerun with the same keys and parameters continues from the checkpoint."""

    n, d = keys.shape
    partial = path.with_name(path.name + ".partial")
    state_path = path.with_name(path.name + ".partial.json")
    state = {"fingerprint": fingerprint, "m": m, "ef_construction": ef_construction, "n": n, "d": d}
    index = None
    for _ in range(3):
        if not (partial.is_file() and state_path.is_file()):
            break
        saved = json.loads(state_path.read_text())
        if {k: saved.get(k) for k in state} != state:
            break
        index = faiss.read_index(str(partial))
        if index.ntotal == saved.get("added"):
            break
        index = None  # a follower (follow_hnsw) replaced the checkpoint between the two reads: read again
    if index is None:
        index = faiss.IndexHNSWFlat(d, m, faiss.METRIC_L2)
        index.hnsw.efConstruction = ef_construction
    bar = _progress(n, "hnsw", progress)
    bar.update(index.ntotal)
    last = time.monotonic()
    for s in range(index.ntotal, n, step):
        index.add(np.ascontiguousarray(keys[s:s + step], dtype=np.float32))
        bar.update(min(step, n - s))
        if time.monotonic() - last > checkpoint_s and index.ntotal < n:
            faiss.write_index(index, str(partial) + ".tmp")
            os.replace(str(partial) + ".tmp", partial)
            _atomic_text(state_path, json.dumps({**state, "added": int(index.ntotal)}))
            last = time.monotonic()
    bar.close()
    faiss.write_index(index, str(path) + ".tmp")
    os.replace(str(path) + ".tmp", path)
    for p in (partial, state_path):
        if p.exists():
            p.unlink()


def save_held_out(out: str | Path, held: Sequence[tuple[str, np.ndarray]]) -> None:
    """Held-out documents -> out/heldout.npy (int32 tokens, concatenated) + out/heldout_docs.npy (int64 offsets
    [n + 1]): the perplexity text and benchmark prompts, never in the datastore."""
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(t.size) for _, t in held]
    _atomic_save(out / HELD_OUT_FILE, np.concatenate([t for _, t in held]).astype(np.int32) if held
                 else np.zeros(0, np.int32))
    _atomic_save(out / HELD_OUT_DOCS_FILE, np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))


def keys_from_end(out: str | Path, docs: Sequence[tuple[str, np.ndarray]], tm, progress: bool = True) -> int:
    """A second key process for a build running in `out`: compute its missing key chunks from the last one
    backwards, and stop at the first chunk that already exists (the forward process got there). Chunks are
    written atomically under the names the build expects, so the build skips them; at most one chunk is
    computed twice where the two meet. Returns the number of chunks computed."""
    out = Path(out).expanduser()
    plan_path = out / "chunks" / "plan.json"
    if not plan_path.is_file():
        raise FileNotFoundError(f"{plan_path}: start the build first")
    plan = json.loads(plan_path.read_text())
    lengths = [int(t.size) for _, t in docs]
    tokens = np.concatenate([t for _, t in docs]).astype(np.int32)
    if hashlib.sha256(tokens.tobytes()).hexdigest() != plan["tokens_sha256"]:
        raise ValueError(f"{out}: the running build reads another corpus (same --sources/--max-entries needed)")
    doc_table = np.stack([np.concatenate(([0], np.cumsum(lengths))), entry_offsets(lengths)], axis=1)
    spans = chunk_spans(tokens, doc_table, plan["window"], plan["overlap"], plan["chunk_entries"])
    bar = _progress(len(spans), "keys-from-end", progress)
    done = 0
    for windows, s, e, stem in reversed(spans):
        kpath = out / "chunks" / f"{stem}.keys.npy"
        if kpath.is_file() or not plan_path.is_file():
            break
        keys, values = compute_chunk(tm, tokens, doc_table, windows)
        keys = keys.astype(plan["dtype"])
        if not np.all(np.isfinite(keys)):
            raise ValueError(f"keys: non-finite values in entries {s}..{e} when stored as {plan['dtype']}")
        _atomic_save(out / "chunks" / f"{stem}.values.npy", values)
        _atomic_save(kpath, keys)
        done += 1
        bar.update(1)
    bar.close()
    return done


def follow_hnsw(out: str | Path, *, m: int, ef_construction: int, poll_s: float = 2.0, checkpoint_s: float = 60.0,
                progress: bool = True) -> None:
    """Pre-build the HNSW checkpoint while a build process in `out` is still computing key chunks.

    The key pass is bound by the model and the HNSW insertion by faiss; on a machine with spare cores a second
    process inserting each chunk as soon as it lands takes the HNSW step off the end of the build. It writes
    exactly the checkpoint build_hnsw resumes from (hnsw.faiss.partial + state), so the build process picks it up
    (or, if it gets there first, ignores a stale one and continues its own). Run it with the same m/ef.
    """

    out = Path(out).expanduser()
    plan_path = out / "chunks" / "plan.json"
    while not plan_path.is_file():
        time.sleep(poll_s)
    plan = json.loads(plan_path.read_text())
    docs = np.load(out / DOCS_FILE)
    n = int(docs[-1, 1])
    spans = chunk_spans(np.load(out / TOKENS_FILE, mmap_mode="r"), docs, plan["window"], plan["overlap"],
                        plan["chunk_entries"])
    path = out / HNSW_FILE
    partial = path.with_name(path.name + ".partial")
    state_path = path.with_name(path.name + ".partial.json")
    index = None
    bar = _progress(n, "hnsw-follow", progress)
    last = time.monotonic()
    for _, s, e, stem in spans:
        kpath = out / "chunks" / f"{stem}.keys.npy"
        while not kpath.is_file():
            if (out / MANIFEST).is_file() or not (out / "chunks").is_dir():
                return  # the build finished (or restarted) without us
            time.sleep(poll_s)
        keys = np.load(kpath).astype(np.float32)
        if index is None:
            index = faiss.IndexHNSWFlat(keys.shape[1], m, faiss.METRIC_L2)
            index.hnsw.efConstruction = ef_construction
        index.add(keys)
        bar.update(e - s)
        if time.monotonic() - last > checkpoint_s or e == n:
            faiss.write_index(index, str(partial) + ".tmp")
            os.replace(str(partial) + ".tmp", partial)
            _atomic_text(state_path, json.dumps({"fingerprint": plan["tokens_sha256"], "m": m,
                                                 "ef_construction": ef_construction, "n": n, "d": index.d,
                                                 "added": int(index.ntotal)}))
            last = time.monotonic()
    bar.close()



# ------------------------------------------------------------------------------------------------ CLI


def main(argv: list[str] | None = None) -> None:
    offline_process()
    ap = argparse.ArgumentParser(prog="python -m tools.knn_build",
                                 description="Build a kNN-LM datastore (keys = the serving model's final hidden "
                                             "states, values = next tokens) over the docs corpus.")
    ap.add_argument("--out", default=str(DEFAULT_DIR),
                    help="datastore directory (created; a build there resumes); default %(default)s")
    ap.add_argument("--model", default="", help="local HF model directory ('' = default SmolLM2-135M-Instruct)")
    ap.add_argument("--model-dtype", default="auto", choices=DTYPE_CHOICES,
                    help="build with the format the worker serves with (auto = its calibrated choice here)")
    ap.add_argument("--dtype", default="float16", choices=KEY_DTYPES, help="stored key dtype")
    ap.add_argument("--sources", default="rst", help=f"comma list of {SOURCES}")
    ap.add_argument("--max-entries", type=int, default=1_000_000, help="0 = the whole corpus")
    ap.add_argument("--held-out-every", type=int, default=25,
                    help="hold out about one document in N from the datastore (perplexity, bench prompts); "
                         "default %(default)s")
    ap.add_argument("--window", type=int, default=512,
                    help="tokens per model pass; longer documents are cut into windows (default %(default)s)")
    ap.add_argument("--overlap", type=int, default=128,
                    help="tokens consecutive windows share: the least context of a key after the first window "
                         "(default %(default)s)")
    ap.add_argument("--chunk-entries", type=int, default=16384,
                    help="entries per resumable key chunk file (default %(default)s)")
    ap.add_argument("--no-hnsw", action="store_true", help="skip the HNSW (adr) index; only exact search is served")
    ap.add_argument("--hnsw-m", type=int, default=32, help="HNSW M: graph links per key (default %(default)s)")
    ap.add_argument("--hnsw-ef-construction", type=int, default=100,
                    help="HNSW efConstruction: candidates kept per insertion (default %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch/faiss threads (0 = all cores)")
    ap.add_argument("--name", default=DEFAULT_NAME, help="vector index name the retrieval service serves it as")
    ap.add_argument("--check", action="store_true", help="only run the invariant checker on an existing datastore")
    ap.add_argument("--keys-from-end", action="store_true",
                    help="second process: compute a running build's key chunks from the end (same corpus flags)")
    ap.add_argument("--hnsw-follow", action="store_true",
                    help="second process: insert key chunks into the HNSW checkpoint while a build runs in --out")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.hnsw_follow:
        faiss.omp_set_num_threads(max(1, args.threads))
        follow_hnsw(args.out, m=args.hnsw_m, ef_construction=args.hnsw_ef_construction)
        return
    if args.check:
        ds = open_datastore(args.out)
        check_datastore(ds)
        print(f"{ds.path}: {ds.size} entries x {ds.dim} ({ds.meta['dtype']}) OK")
        return
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
    if args.model_dtype == "auto":
        tm, _ = calibrated_model(args.model, "cpu", "auto", args.threads)
        if args.threads:
            set_threads(args.threads)
    else:
        set_threads(args.threads)
        tm = load_model(args.model, dtype=args.model_dtype)
    sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    docs, held = corpus_documents(tm.tokenizer, sources, args.held_out_every, args.max_entries)
    log.info("%d documents (%d entries) in the datastore, %d held out", len(docs),
             sum(t.size - 1 for _, t in docs), len(held))
    if args.keys_from_end:
        print(f"{keys_from_end(args.out, docs, tm)} chunks computed from the end")
        return
    save_held_out(args.out, held)
    out = build_datastore(args.out, docs, tm, name=args.name, dtype=args.dtype, window=args.window,
                          overlap=args.overlap, chunk_entries=args.chunk_entries, hnsw=not args.no_hnsw,
                          hnsw_m=args.hnsw_m, hnsw_ef_construction=args.hnsw_ef_construction,
                          corpus={"sources": list(sources), "max_entries": args.max_entries,
                                  "held_out_every": args.held_out_every})
    ds = open_datastore(out)
    check_datastore(ds, sample=100_000)
    print(json.dumps({k: ds.meta[k] for k in ("n", "dim", "dtype", "documents", "tokens", "build_s", "hnsw", "bytes")},
                     indent=1))


if __name__ == "__main__":
    main()
