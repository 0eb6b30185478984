"""Checksums of every file of a knowledge base, written into kb.json at build and verified before SERVING.

    files = kb_files.checksums(kb_dir)             # {"dense/embeddings.npy": {"bytes": n, "xxh3_64": "..."}, ...}
    kb_files.verify(kb_dir, files, cache=path)     # KBFileError naming the file relative to the KB

Like the suffix-array datastore's sections: every file is hashed (xxh3_64, read in chunks with pread, so the
server's RSS does not grow) and files that passed are remembered by identity (size, mtime, ctime, inode) in the
verified-stores cache, so a restart does not read them again. The embeddings are also checked for non-finite
values in the same pass: a NaN would score every query NaN (and crafted files can match their checksums).
Names in messages are relative to the KB directory: they reach clients, server paths must not.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import xxhash

from retrieval_service.datastore import container

# The files a KB serves from, relative to its directory (the Lucene index: every file in its directory).
PASSAGE_FILES = ("passages.jsonl", "passages.offsets.npy")
DENSE_FILES = ("dense/embeddings.npy", "dense/meta.json", "dense/hnsw.faiss", "dense/hnsw.json")
SPARSE_META = "sparse/meta.json"
LUCENE_DIR = "sparse/lucene"
EMBEDDINGS = "dense/embeddings.npy"
MANIFEST_KEY = "files"  # kb.json's entry holding checksums()


class KBFileError(ValueError):
    """A KB file is missing, changed or corrupted; the message names it relative to the KB directory."""


def kb_file_names(kb_dir: Path) -> list[str]:
    """The KB's files that exist, relative to kb_dir, in a fixed order."""
    kb_dir = Path(kb_dir)
    names = [n for n in (*PASSAGE_FILES, *DENSE_FILES, SPARSE_META) if (kb_dir / n).is_file()]
    lucene = kb_dir / LUCENE_DIR
    if lucene.is_dir():
        names += sorted(str(p.relative_to(kb_dir)) for p in lucene.rglob("*") if p.is_file())
    return names


def _npy_data_start(path: Path) -> tuple[int, np.dtype]:
    """(byte offset of the values, dtype) of an .npy file, from its header (no value is read)."""
    values = np.load(path, mmap_mode="r")
    return int(values.offset), values.dtype


def _hash(kb_dir: Path, name: str) -> str:
    path = kb_dir / name
    size = path.stat().st_size
    if name != EMBEDDINGS:
        return container.hash_file_range(path, 0, size)
    start, dtype = _npy_data_start(path)
    head = container.hash_file_range(path, 0, start)  # the .npy header, then the values with a finiteness check

    def finite(chunk: memoryview, offset: int) -> None:
        values = np.frombuffer(chunk, dtype)
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            row = (offset // dtype.itemsize + int(bad[0]))
            raise KBFileError(f"knowledge base file {name} holds a non-finite value ({values[bad[0]]}) at element "
                              f"{row}; rebuild the embeddings")

    body = container.hash_file_range(path, start, size - start, check=finite)
    return xxhash.xxh3_64_hexdigest(f"{head}:{body}".encode())


def checksums(kb_dir: str | os.PathLike) -> dict[str, dict]:
    """{relative name: {"bytes", "xxh3_64"}} of every KB file (build time; raises KBFileError for NaN embeddings)."""
    kb_dir = Path(kb_dir)
    return {name: {"bytes": (kb_dir / name).stat().st_size, "xxh3_64": _hash(kb_dir, name)}
            for name in kb_file_names(kb_dir)}


def verify(kb_dir: str | os.PathLike, files: dict[str, dict], cache: str | os.PathLike | None = None
           ) -> list[tuple[str, str]]:
    """Every file listed in the manifest against its size and checksum, and no unlisted file where the KB reads
    (an index file that appeared later was never verified). -> [(name, "verified" | "cached")]."""
    kb_dir = Path(kb_dir)
    unlisted = sorted(set(kb_file_names(kb_dir)) - set(files))
    if unlisted:
        raise KBFileError(f"knowledge base files {', '.join(unlisted[:3])} are not in its manifest (added after the "
                          f"build?); rebuild the KB or remove them")
    known = container.VerifiedCache(cache)
    report, passed = [], {}
    for name, want in files.items():
        path = kb_dir / name
        try:
            ident = container.file_identity(path, want["xxh3_64"])
        except OSError as e:
            raise KBFileError(f"knowledge base file {name} is missing or unreadable ({e.strerror}); rebuild the KB"
                              ) from None
        if known.is_verified(path, ident):
            report.append((name, "cached"))
            continue
        if ident["size"] != want["bytes"]:
            raise KBFileError(f"knowledge base file {name} is truncated or changed: {ident['size']} bytes, the "
                              f"manifest says {want['bytes']}; rebuild the KB")
        try:
            got = _hash(kb_dir, name)
        except OSError as e:
            raise KBFileError(f"knowledge base file {name} is unreadable ({e}); rebuild the KB") from None
        if got != want["xxh3_64"]:
            raise KBFileError(f"knowledge base file {name} is corrupted: checksum {got} != {want['xxh3_64']} in "
                              f"the manifest; rebuild the KB")
        passed[path] = ident
        report.append((name, "verified"))
    known.add(passed)
    return report
