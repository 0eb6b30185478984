"""kNN-LM datastore on disk: the format, opening it memory-mapped, and its invariant checker.

Shared by the builder (tools/knn_build.py, which has the full story), the retrieval service (which serves the keys
as a named vector index, retrieval_service/knowledge/knn_index.py) and the generation worker (which maps entry ids
to next tokens and fills its speculation cache from the same memory-mapped keys and values).

Entry of document d at token position p (1 <= p < len(d)):
    key   = the model's final hidden state after reading d[..p-1];  value = d[p], the token that came next
Entries are numbered document by document, so entry i + 1 is what followed entry i in the corpus.

On disk (one directory):
    keys.npy     float16|float32 [N, D]  memory-mapped
    values.npy   int32 [N]               next-token ids
    tokens.npy   int32 [T]               the tokenized corpus, documents concatenated (checks, held-out split)
    docs.npy     int64 [n_docs + 1, 2]   (token offset, entry offset) of each document, then the totals
    hnsw.faiss                           the ADR index (IndexHNSWFlat, L2); the exact index is built at load
    knn.json                             the manifest, written last: a directory without it is not a datastore
    heldout.npy, heldout_docs.npy         held-out documents (int32 tokens, offsets): perplexity text, prompts
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

FORMAT = 1
KEYS_FILE, VALUES_FILE, TOKENS_FILE, DOCS_FILE = "keys.npy", "values.npy", "tokens.npy", "docs.npy"
HNSW_FILE, MANIFEST = "hnsw.faiss", "knn.json"
HELD_OUT_FILE, HELD_OUT_DOCS_FILE = "heldout.npy", "heldout_docs.npy"
DEFAULT_NAME = "knnlm"
DEFAULT_DIR = Path.home() / ".cache" / "ragserve" / "knnlm" / "docs"
KEY_DTYPES = ("float16", "float32")


def entry_offsets(doc_lengths: Sequence[int]) -> np.ndarray:
    """Document token lengths [n] -> entry offsets int64 [n + 1] (a document of L tokens has L - 1 entries)."""
    per_doc = np.maximum(np.asarray(doc_lengths, dtype=np.int64) - 1, 0)
    return np.concatenate(([0], np.cumsum(per_doc))).astype(np.int64)


def entry_positions(docs: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """docs: int64 [n_docs + 1, 2] (token offset, entry offset); ids: entry ids [m] -> token index [m] of each
    entry's value in tokens.npy (its context is the tokens of the same document before that index)."""
    ids = np.asarray(ids, dtype=np.int64)
    d = np.searchsorted(docs[:, 1], ids, side="right") - 1  # [m] document of each entry
    return docs[d, 0] + (ids - docs[d, 1]) + 1


def load_held_out(path: str | Path) -> list[np.ndarray]:
    """The held-out documents saved next to a datastore -> [int32 tokens]."""
    path = Path(path).expanduser()
    tokens = np.load(path / HELD_OUT_FILE)
    offsets = np.load(path / HELD_OUT_DOCS_FILE)
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


@dataclass
class KnnDatastore:
    """A built datastore, memory-mapped read-only."""

    path: Path
    meta: dict
    keys: np.ndarray    # float16|float32 [N, D] memmap
    values: np.ndarray  # int32 [N] memmap
    tokens: np.ndarray  # int32 [T] memmap
    docs: np.ndarray    # int64 [n_docs + 1, 2]

    @property
    def size(self) -> int:
        return int(self.values.shape[0])

    @property
    def dim(self) -> int:
        return int(self.keys.shape[1])

    @property
    def name(self) -> str:
        return self.meta.get("name", DEFAULT_NAME)

    def context(self, i: int) -> np.ndarray:
        """The tokens entry i's key has read (its document up to the value, window cuts aside)."""
        pos = int(entry_positions(self.docs, np.array([i]))[0])
        d = int(np.searchsorted(self.docs[:, 0], pos, side="right") - 1)
        return np.asarray(self.tokens[self.docs[d, 0]:pos])


def open_datastore(path: str | Path) -> KnnDatastore:
    """Open a built datastore; ValueError / FileNotFoundError naming what is missing or inconsistent."""
    path = Path(path).expanduser()
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"kNN-LM datastore {path}: no {MANIFEST} (build it with "
                                f"`python -m tools.knn_build --out {path}`)")
    meta = json.loads((path / MANIFEST).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"kNN-LM datastore {path}: format {meta.get('format')} != {FORMAT}; rebuild")
    keys = np.load(path / KEYS_FILE, mmap_mode="r")
    values = np.load(path / VALUES_FILE, mmap_mode="r")
    tokens = np.load(path / TOKENS_FILE, mmap_mode="r")
    docs = np.load(path / DOCS_FILE)
    n, d = meta["n"], meta["dim"]
    if keys.shape != (n, d) or str(keys.dtype) != meta["dtype"] or values.shape != (n,) or values.dtype != np.int32:
        raise ValueError(f"kNN-LM datastore {path}: keys {keys.shape} {keys.dtype} / values {values.shape} do not "
                         f"match the manifest ({n}, {d}) {meta['dtype']}; rebuild")
    if docs.ndim != 2 or docs.shape[1] != 2 or int(docs[-1, 1]) != n or int(docs[-1, 0]) != tokens.shape[0]:
        raise ValueError(f"kNN-LM datastore {path}: {DOCS_FILE} does not match the entries/tokens; rebuild")
    return KnnDatastore(path, meta, keys, values, tokens, docs)


def check_datastore(ds: KnnDatastore, sample: int = 0) -> None:
    """Invariant checker: every entry's value is the token after its context (all entries, or `sample` random
    ones), offsets are consistent, keys are finite. Raises ValueError naming the first broken entry."""
    lengths = np.diff(ds.docs[:, 0])
    if np.any(lengths < 0) or not np.array_equal(ds.docs[:, 1], entry_offsets(lengths)):
        raise ValueError(f"{ds.path}: document offsets are inconsistent")
    ids = (np.arange(ds.size) if not sample
           else np.random.default_rng(0).choice(ds.size, size=min(sample, ds.size), replace=False))
    pos = entry_positions(ds.docs, ids)
    bad = np.asarray(ds.tokens)[pos] != np.asarray(ds.values)[ids]
    if bad.any():
        i = int(ids[np.argmax(bad)])
        raise ValueError(f"{ds.path}: entry {i} has value {int(ds.values[i])} but the corpus token after its "
                         f"context is {int(ds.tokens[pos[np.argmax(bad)]])}")
    rows = np.asarray(ds.keys[np.sort(ids[: min(len(ids), 4096)])], dtype=np.float32)
    if not np.all(np.isfinite(rows)):
        raise ValueError(f"{ds.path}: non-finite keys")
