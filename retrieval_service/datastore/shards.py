"""Suffix-array shards on disk: format, atomic resumable writer, memory-mapped reader, checks.

A datastore is a directory:
    datastore.json        manifest, written last (its presence means the build finished)
    shard-00000.rsa ...   one file per shard, each written to a temp name and renamed (atomic)

A shard file (little-endian, sections 4096-aligned so they memory-map as typed arrays):
    0   magic b"RGSSA\\x00\\x00\\x01"
    8   uint64 header length H
    16  uint64 xxh3_64 of the header bytes
    24  header: UTF-8 JSON (format version, tokenizer identity, vocab size, counts, dtypes, section table with
        per-section xxh3_64 checksums, the corpus key and source range used to resume a build)
    align(24 + H): sections, offsets relative to this point
        tokens      uint16|uint32 [N]      documents, each followed by SEP (0xFFFF / 0xFFFFFFFF, never a token)
        sa          int32 [N]              suffix array of tokens (all N suffixes; SEP sorts after every token)
        bucket      int64 [vocab + 1]      suffixes starting with token t are sa[bucket[t]:bucket[t+1]]
        doc_starts  int64 [docs + 1]       start of each document in tokens; doc_starts[-1] = N

Worked example, documents [5, 6, 5] and [6], vocab 8 (uint16):
    tokens = [5, 6, 5, SEP, 6, SEP]   sa = [0, 2, 1, 4, 5, 3]   bucket[5:8] = [0, 2, 4]   doc_starts = [0, 4, 6]
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numba as nb
import numpy as np
import xxhash

from ragcore.errors import DataLoss, FailedPrecondition
from retrieval_service.datastore import container
from retrieval_service.datastore.map_guard import MappedFile

FORMAT = "ragserve-suffix-array"
FORMAT_VERSION = 1
MAGIC = b"RGSSA\x00\x00\x01"
MANIFEST = "datastore.json"
SHARD_GLOB = "shard-*.rsa"
_PREFIX = container.PREFIX
_ALIGN = 4096
# libdivsufsort's 32-bit entry point sorts at most 2**31 - 1 bytes; tokens are sorted as big-endian bytes.
_MAX_SA_BYTES = 2**31 - 1
_SECTIONS = ("tokens", "sa", "bucket", "doc_starts")
_JIT = dict(nogil=True, cache=True)


class DatastoreError(FailedPrecondition, ValueError):
    """A datastore is missing, incomplete, corrupted, or does not fit the caller (message says which)."""


class TokenizerMismatch(DatastoreError):
    """The datastore was built with a different tokenizer than the caller's."""


class DatastoreCorrupted(DataLoss, DatastoreError):
    """Drafting met data no valid shard holds (an index outside the arrays, a token outside the vocabulary), or a
    store file changed under the server: the files changed or were crafted behind the load-time verification. The
    message names the file(s) relative to their store (it reaches clients); `paths` are the server paths (logs)."""

    def __init__(self, message: str, paths: Sequence[Path | None] = ()):
        super().__init__(message)
        self.paths = tuple(str(p) for p in paths if p is not None)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id and the separator fit (ids < 0xFFFF), else uint32."""
    if not 1 <= vocab_size < 2**32 - 1:
        raise ValueError(f"vocab_size must lie in [1, 2**32 - 1), got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 0xFFFF else np.dtype(np.uint32)


def separator(dtype: np.dtype) -> int:
    return int(np.iinfo(dtype).max)


def max_shard_length(dtype: np.dtype) -> int:
    """Longest tokens array (documents + separators) one shard may hold."""
    return _MAX_SA_BYTES // np.dtype(dtype).itemsize


# ----------------------------------------------------------------------------------------------------------------
# Building one shard in memory


@nb.njit(**_JIT)
def _keep_token_starts(sa_bytes, itemsize):
    """In place: keep byte-suffix-array entries that start a token, as token indices; returns how many."""
    j = 0
    for i in range(sa_bytes.shape[0]):
        v = sa_bytes[i]
        if v % itemsize == 0:
            sa_bytes[j] = v // itemsize
            j += 1
    return j


@nb.njit(**_JIT)
def _count_tokens(tokens, vocab_size, sep):
    """-> (counts int64 [vocab + 1] with counts[vocab] = separators, first bad position or -1)."""
    counts = np.zeros(vocab_size + 1, np.int64)
    bad = -1
    for i in range(tokens.shape[0]):
        t = np.int64(tokens[i])
        if t == sep:
            counts[vocab_size] += 1
        elif t < vocab_size:
            counts[t] += 1
        elif bad < 0:
            bad = i
    return counts, bad


def concat_documents(docs: list[np.ndarray], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """docs: list of int [len_d] -> (tokens [sum(len_d) + docs] each doc followed by SEP, doc_starts int64 [docs+1])."""
    dtype = token_dtype(vocab_size)
    sep = separator(dtype)
    tokens = np.empty(sum(len(d) for d in docs) + len(docs), dtype)
    doc_starts = np.empty(len(docs) + 1, np.int64)
    pos = 0
    for i, d in enumerate(docs):
        if len(d) and (int(d.min()) < 0 or int(d.max()) >= vocab_size):
            raise ValueError(f"document {i} holds token ids {int(d.min())}..{int(d.max())} outside the vocabulary "
                             f"[0, {vocab_size})")
        doc_starts[i] = pos
        tokens[pos : pos + len(d)] = d
        pos += len(d)
        tokens[pos] = sep
        pos += 1
    doc_starts[len(docs)] = pos
    return tokens, doc_starts


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """tokens: uint16|uint32 [N] -> int32 [N], built by libdivsufsort (OpenMP) on the big-endian bytes.

    Comparing big-endian byte strings that start on token boundaries is comparing token sequences, so the byte
    suffix array filtered to multiples of the item size is the token suffix array. Peak memory: the byte copy
    (N * itemsize) plus the int32 byte suffix array (4 * N * itemsize), compacted in place and returned as a view.
    """
    from pydivsufsort.dll import libdivsufsort  # builders only: serving never sorts suffixes

    itemsize = tokens.dtype.itemsize
    n_bytes = tokens.shape[0] * itemsize
    if n_bytes > _MAX_SA_BYTES:
        raise ValueError(f"shard of {tokens.shape[0]} tokens exceeds {max_shard_length(tokens.dtype)}; "
                         f"use smaller shards")
    if tokens.shape[0] == 0:
        return np.zeros(0, np.int32)
    big_endian = tokens.astype(tokens.dtype.newbyteorder(">")).view(np.uint8)
    out = np.empty(n_bytes, np.int32)
    rc = libdivsufsort.divsufsort(big_endian.ctypes.data_as(ctypes.c_void_p),
                                  out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int32(n_bytes))
    del big_endian
    if rc != 0:
        raise RuntimeError(f"libdivsufsort failed with code {rc}")
    kept = _keep_token_starts(out, itemsize)
    assert kept == tokens.shape[0], (kept, tokens.shape[0])
    return out[:kept]


@dataclass
class Shard:
    """One searchable shard: memory-mapped from a file, or in memory (a delta shard of recent outputs)."""

    tokens: np.ndarray  # uint16|uint32 [N] (read-only)
    sa: np.ndarray  # int32 [N]
    bucket: np.ndarray  # int64 [vocab + 1]
    doc_starts: np.ndarray  # int64 [docs + 1]
    header: dict
    path: Path | None = None
    _mmap: mmap.mmap | None = field(default=None, repr=False)
    guard: MappedFile | None = field(default=None, repr=False)  # watches the file for changes while it serves

    @property
    def name(self) -> str:
        """The file named relative to its store (what messages to clients say; never a server path)."""
        return self.path.name if self.path is not None else "in-memory shard"

    @property
    def num_tokens(self) -> int:
        return int(self.header["num_tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.header["num_documents"])

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def separator(self) -> int:
        return int(self.header["separator"])

    @property
    def nbytes(self) -> int:
        return self.path.stat().st_size if self.path is not None else sum(
            a.nbytes for a in (self.tokens, self.sa, self.bucket, self.doc_starts))

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.doc_starts[i] : self.doc_starts[i + 1] - 1]

    @staticmethod
    def from_documents(docs: list[np.ndarray], *, vocab_size: int, tokenizer_id: str,
                       extra: dict | None = None) -> "Shard":
        """Build a shard in memory (read-only arrays, same layout as on disk)."""
        dtype = token_dtype(vocab_size)
        docs = [np.asarray(d) for d in docs if len(d) > 0]
        for i, d in enumerate(docs):
            if d.ndim != 1 or not np.issubdtype(d.dtype, np.integer):
                raise ValueError(f"document {i} must be 1-D integer token ids, got shape {d.shape} dtype {d.dtype}")
        tokens, doc_starts = concat_documents(docs, vocab_size)
        if tokens.shape[0] > max_shard_length(dtype):
            raise ValueError(f"{tokens.shape[0]} tokens do not fit one shard (max {max_shard_length(dtype)})")
        counts, bad = _count_tokens(tokens, vocab_size, separator(dtype))
        if bad >= 0:
            raise ValueError(f"token id {int(tokens[bad])} at position {bad} is outside the vocabulary "
                             f"[0, {vocab_size})")
        sa = suffix_array(tokens)
        bucket = np.zeros(vocab_size + 1, np.int64)
        np.cumsum(counts[:vocab_size], out=bucket[1:])
        header = {
            "format": FORMAT, "version": FORMAT_VERSION, "tokenizer_id": tokenizer_id, "vocab_size": vocab_size,
            "token_dtype": dtype.name, "sa_dtype": "int32", "separator": separator(dtype),
            "length": int(tokens.shape[0]), "num_tokens": int(tokens.shape[0] - len(docs)),
            "num_documents": len(docs), **(extra or {}),
        }
        for a in (tokens, sa, bucket, doc_starts):
            a.flags.writeable = False
        return Shard(tokens, sa, bucket, doc_starts, header)

    # ------------------------------------------------------------------------------------------------------------
    # On disk

    def write(self, path: str | os.PathLike) -> Path:
        """Write atomically (temp file in the same directory, fsync, rename)."""
        path = Path(path)
        arrays = dict(tokens=self.tokens, sa=self.sa, bucket=self.bucket, doc_starts=self.doc_starts)
        sections, offset = {}, 0
        for name in _SECTIONS:
            a = arrays[name]
            sections[name] = {"offset": offset, "nbytes": int(a.nbytes), "dtype": a.dtype.str,
                              "xxh3_64": xxhash.xxh3_64_hexdigest(memoryview(np.ascontiguousarray(a)).cast("B"))}
            offset = _align(offset + a.nbytes)
        header = {**{k: v for k, v in self.header.items() if k != "sections"}, "sections": sections}
        blob = json.dumps(header, sort_keys=True).encode("utf-8")
        prefix = _PREFIX.pack(MAGIC, len(blob), xxhash.xxh3_64_intdigest(blob))
        data_start = _align(len(prefix) + len(blob))
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(prefix + blob)
                for name in _SECTIONS:
                    f.seek(data_start + sections[name]["offset"])
                    f.write(memoryview(np.ascontiguousarray(arrays[name])).cast("B"))
                f.truncate(data_start + offset)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.header, self.path = header, path
        return path

    @staticmethod
    def open(path: str | os.PathLike, expected_tokenizer_id: str | None = None) -> "Shard":
        """Memory-map a shard file after a fast structural check (no data pages are read except two)."""
        path = Path(path)
        header, data_start = read_header(path)
        if expected_tokenizer_id is not None and header["tokenizer_id"] != expected_tokenizer_id:
            raise TokenizerMismatch(
                f"{path} was built with tokenizer {header['tokenizer_id']!r}, but the caller uses "
                f"{expected_tokenizer_id!r}; rebuild the datastore with the serving model's tokenizer")
        size = path.stat().st_size
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            guard = MappedFile(f.fileno(), mm, path, path.name)
        if hasattr(mmap, "MADV_RANDOM"):
            mm.madvise(mmap.MADV_RANDOM)  # binary search: readahead would only inflate RSS
        arrays = {}
        for name in _SECTIONS:
            s = header["sections"][name]
            dtype = np.dtype(s["dtype"])
            start = data_start + s["offset"]
            if start + s["nbytes"] > size or s["nbytes"] % dtype.itemsize:
                raise DatastoreError(f"{path} is truncated or corrupted: section {name!r} "
                                     f"[{start}, {start + s['nbytes']}) does not fit the file size {size}")
            arrays[name] = np.frombuffer(mm, dtype=dtype, count=s["nbytes"] // dtype.itemsize, offset=start)
        shard = Shard(arrays["tokens"], arrays["sa"], arrays["bucket"], arrays["doc_starts"], header, path, mm, guard)
        _check_structure(shard)
        return shard


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def read_header(path: Path) -> tuple[dict, int]:
    """-> (header, data_start). Raises DatastoreError naming what is wrong."""
    return container.read_header(
        path, magic=MAGIC, fmt=FORMAT, version=FORMAT_VERSION, align_to=_ALIGN,
        what="a ragserve suffix-array shard", short="shard", error=DatastoreError)


def _check_structure(shard: Shard) -> None:
    """Cheap consistency of sizes and the few values that pin the layout (touches two or three pages)."""
    h, where = shard.header, shard.path or "in-memory shard"
    dtype = token_dtype(int(h["vocab_size"]))
    problems = []
    if shard.tokens.dtype != dtype or h["separator"] != separator(dtype):
        problems.append(f"token dtype {shard.tokens.dtype} / separator {h['separator']} "
                        f"do not fit vocab {h['vocab_size']}")
    n = int(h["length"])
    if shard.tokens.shape[0] != n or shard.sa.shape[0] != n:
        problems.append(f"tokens/sa lengths {shard.tokens.shape[0]}/{shard.sa.shape[0]} differ from header length {n}")
    if shard.bucket.shape[0] != int(h["vocab_size"]) + 1:
        problems.append(f"bucket table has {shard.bucket.shape[0]} entries, expected vocab_size + 1")
    if shard.doc_starts.shape[0] != int(h["num_documents"]) + 1:
        problems.append(f"doc_starts has {shard.doc_starts.shape[0]} entries, expected num_documents + 1")
    if int(h["num_tokens"]) + int(h["num_documents"]) != n:
        problems.append(f"num_tokens {h['num_tokens']} + num_documents {h['num_documents']} != length {n}")
    if not problems and n:
        if int(shard.tokens[-1]) != separator(dtype):
            problems.append("the last token is not a document separator")
        if int(shard.bucket[-1]) != int(h["num_tokens"]) or int(shard.doc_starts[-1]) != n:
            problems.append("bucket / doc_starts totals disagree with the header counts")
    if problems:
        raise DatastoreError(f"{where} is corrupted: " + "; ".join(problems))


@nb.njit(**_JIT)
def _first_bad_token(tokens, vocab_size, sep):
    """Index of the first value that is neither a token id < vocab_size nor the separator, or -1."""
    for i in range(tokens.shape[0]):
        t = np.int64(tokens[i])
        if t >= vocab_size and t != sep:
            return i
    return -1


@nb.njit(**_JIT)
def _first_bad_sa(sa, n):
    """Index of the first suffix-array entry outside [0, n), or -1."""
    for i in range(sa.shape[0]):
        v = np.int64(sa[i])
        if v < 0 or v >= n:
            return i
    return -1


def _check_tables(shard: Shard) -> None:
    """The small tables that steer every search: bucket and doc_starts non-decreasing within [0, length]."""
    where, n = shard.path or "in-memory shard", int(shard.header["length"])
    for name, table, first, last in (("bucket", shard.bucket, 0, shard.num_tokens),
                                     ("doc_starts", shard.doc_starts, 0, n)):
        if len(table) and (int(table[0]) != first or int(table[-1]) != last or (np.diff(table) < 0).any()):
            raise DatastoreError(f"{where} is corrupted: the {name} table is not non-decreasing from {first} to "
                                 f"{last}; rebuild the datastore")


def _verify_section(shard: Shard, name: str, data_start: int) -> None:
    """One section: xxh3_64 against the header and, for tokens / sa, every value in range (one chunked read)."""
    path, sec = shard.path, shard.header["sections"][name]
    dtype = np.dtype(sec["dtype"])
    n, vocab, sep = int(shard.header["length"]), shard.vocab_size, shard.separator

    def check(chunk: memoryview, offset: int) -> None:
        values = np.frombuffer(chunk, dtype=dtype)
        base = offset // dtype.itemsize
        if name == "tokens":
            i = _first_bad_token(values, vocab, sep)
            if i >= 0:
                raise DatastoreError(f"{path} is corrupted: token {int(values[i])} at position {base + i} is outside "
                                     f"the vocabulary [0, {vocab}) and not the separator; rebuild the datastore")
        elif name == "sa":
            i = _first_bad_sa(values, n)
            if i >= 0:
                raise DatastoreError(f"{path} is corrupted: suffix-array entry {base + i} = {int(values[i])} is "
                                     f"outside [0, {n}); rebuild the datastore")

    try:
        got = container.hash_file_range(path, data_start + sec["offset"], sec["nbytes"],
                                        check if name in ("tokens", "sa") else None)
    except OSError as e:
        raise DatastoreError(f"{path} is truncated or unreadable: {e}") from None
    if got != sec["xxh3_64"]:
        raise DatastoreError(f"{path} is corrupted: section {name!r} checksum {got} != {sec['xxh3_64']}; "
                             f"rebuild the datastore")


def verify_shards(shards: Sequence[Shard], *, threads: int = 0,
                  cache: str | os.PathLike | None = None) -> list[tuple[Path, str]]:
    """Full content verification of on-disk shards before they serve: every section's xxh3_64 checksum, every
    suffix-array entry within [0, N), every token in the vocabulary (or the separator), and the bucket /
    doc_starts tables ordered. DatastoreError names the file and what is wrong.

    Fast: sections are read in 8 MiB chunks with pread (not through the map, so RSS does not grow) and verified
    in parallel on `threads` threads (0 = one per core); files that passed are remembered in `cache` (a JSON file,
    None = no cache) by identity -- path, size, mtime_ns, ctime_ns, inode, device, header checksum -- so an
    unchanged file is not read again. Returns [(path, "verified" | "cached")]. In-memory shards are skipped.
    """
    known = container.VerifiedCache(cache)
    report: list[tuple[Path, str]] = []
    todo: list[tuple[Shard, dict, int]] = []
    for shard in shards:
        if shard.path is None:
            continue
        try:
            ident = container.file_identity(shard.path, container.header_digest(shard.path))
        except OSError as e:
            raise DatastoreError(f"cannot read shard {shard.path}: {e}") from None
        if known.is_verified(shard.path, ident):
            report.append((shard.path, "cached"))
            continue
        _, data_start = read_header(shard.path)
        todo.append((shard, ident, data_start))
    tasks = [(shard, name, start) for shard, _, start in todo for name in _SECTIONS]
    if tasks:
        workers = max(1, min(threads or os.cpu_count() or 1, len(tasks)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verify") as pool:
            futures = [pool.submit(_verify_section, *t) for t in tasks]
            for f in futures:  # the first failure in shard/section order, after every task ended
                f.exception()
            for f in futures:
                f.result()
        for shard, _, _ in todo:
            _check_tables(shard)
        known.add({shard.path: ident for shard, ident, _ in todo})
        report += [(shard.path, "verified") for shard, _, _ in todo]
    return report


def verify_checksums(shard: Shard) -> None:
    """Full read of every section against the header's xxh3_64 checksums (DatastoreError on mismatch)."""
    arrays = dict(tokens=shard.tokens, sa=shard.sa, bucket=shard.bucket, doc_starts=shard.doc_starts)
    for name in _SECTIONS:
        want = shard.header["sections"][name]["xxh3_64"]
        got = xxhash.xxh3_64_hexdigest(memoryview(arrays[name]).cast("B"))
        if got != want:
            raise DatastoreError(f"{shard.path} is corrupted: section {name!r} checksum {got} != {want}")


# ----------------------------------------------------------------------------------------------------------------
# Invariants (slow, exhaustive; for tests and `check_datastore`)


@nb.njit(**_JIT)
def _sa_problem(tokens, sa):
    """-> (kind, index): kind 0 ok, 1 entry out of range, 2 duplicate entry, 3 neighbours out of order.

    Linear-time check (Burkhardt & Kärkkäinen): a permutation is the suffix array iff for every neighbour pair
    (a, b) either tokens[a] < tokens[b], or they are equal and the suffix after a ranks before the suffix after
    b (a suffix that ends first is the smaller). Comparing whole suffixes instead would cost O(n * LCP), hours
    on a code corpus full of duplicated files.
    """
    n = tokens.shape[0]
    rank = np.full(n, -1, np.int32)  # shards hold < 2**31 tokens
    for i in range(n):
        v = sa[i]
        if v < 0 or v >= n:
            return 1, i
        if rank[v] >= 0:
            return 2, i
        rank[v] = i
    for i in range(n - 1):
        a = sa[i]
        b = sa[i + 1]
        if tokens[a] != tokens[b]:
            if tokens[a] > tokens[b]:
                return 3, i
        elif a + 1 == n:
            continue
        elif b + 1 == n or rank[a + 1] > rank[b + 1]:
            return 3, i
    return 0, -1


@nb.njit(**_JIT)
def _separator_problem(tokens, doc_starts, sep):
    """-> index of the first document whose separators are wrong (one SEP exactly at its end), or -1."""
    for d in range(doc_starts.shape[0] - 1):
        lo = doc_starts[d]
        hi = doc_starts[d + 1]
        if hi <= lo or tokens[hi - 1] != sep:
            return d
        for i in range(lo, hi - 1):
            if tokens[i] == sep:
                return d
    return -1


def check_shard(shard: Shard) -> None:
    """Every invariant of one shard; DatastoreError listing the violations."""
    where = shard.path or "in-memory shard"
    _check_structure(shard)
    if shard.path is not None:
        verify_checksums(shard)
    problems = []
    vocab, sep = shard.vocab_size, shard.separator
    counts, bad = _count_tokens(shard.tokens, vocab, sep)
    if bad >= 0:
        problems.append(f"token {int(shard.tokens[bad])} at position {bad} is outside the vocabulary [0, {vocab})")
    if counts[vocab] != shard.num_documents:
        problems.append(f"{counts[vocab]} separators for {shard.num_documents} documents")
    d = _separator_problem(shard.tokens, shard.doc_starts, sep)
    if d >= 0:
        problems.append(f"document {d} is not closed by exactly one separator")
    expect_bucket = np.concatenate([[0], np.cumsum(counts[:vocab])])
    if not np.array_equal(expect_bucket, shard.bucket):
        problems.append("bucket table disagrees with the token counts")
    kind, i = _sa_problem(shard.tokens, shard.sa)
    if kind:
        what = {1: "entry out of range", 2: "duplicate entry", 3: "suffixes out of order"}[kind]
        problems.append(f"suffix array broken at index {i}: {what}")
    if problems:
        raise DatastoreError(f"{where} violates invariants: " + "; ".join(problems))


# ----------------------------------------------------------------------------------------------------------------
# Directory of shards: streaming resumable writer and manifest


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.rsa"


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise DatastoreError(f"{path} has no {MANIFEST}: the build did not finish (rerun it to resume) "
                             f"or this is not a datastore") from None
    except (OSError, ValueError) as e:
        raise DatastoreError(f"{path / MANIFEST} is unreadable or corrupted: {e}") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DatastoreError(f"{path / MANIFEST}: format {manifest.get('format')!r} version "
                             f"{manifest.get('version')!r}, this code reads {FORMAT!r} version {FORMAT_VERSION}")
    return manifest


def _write_json_atomic(path: Path, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class ResumePoint:
    next_shard: int  # index of the first missing shard
    next_source: int  # corpus document index the missing shard starts at
    tokens_done: int


def resume_point(out_dir: Path, corpus_key: str) -> ResumePoint:
    """Where an interrupted build continues: after the last consecutive shard built from the same corpus key."""
    if (out_dir / MANIFEST).exists():
        manifest = read_manifest(out_dir)
        if manifest.get("corpus_key") != corpus_key:
            raise DatastoreError(f"{out_dir} already holds a finished datastore built from another corpus or with "
                                 f"other settings; remove it or choose another --out")
    i, source, tokens = 0, 0, 0
    while (out_dir / shard_name(i)).exists():
        try:
            header, _ = read_header(out_dir / shard_name(i))
        except DatastoreError:
            break  # a damaged shard is rebuilt (it is overwritten atomically)
        if header.get("corpus_key") != corpus_key:
            raise DatastoreError(f"{out_dir / shard_name(i)} was built from another corpus or with other settings "
                                 f"(corpus key {header.get('corpus_key')!r} != {corpus_key!r}); "
                                 f"remove {out_dir} or choose another output path")
        source, tokens = int(header["source_end"]), tokens + int(header["num_tokens"])
        i += 1
    return ResumePoint(i, source, tokens)


def write_shards(docs: Iterable[tuple[int, np.ndarray]], out_dir: str | os.PathLike, *, vocab_size: int,
                 tokenizer_id: str, corpus_key: str, shard_tokens: int | None = None, limit_tokens: int | None = None,
                 resume: ResumePoint | None = None, progress=None, log=None) -> dict:
    """Stream (source index, token ids) documents into shards of <= shard_tokens tokens; write the manifest.

    Shards hold whole documents (a single document longer than shard_tokens gets a shard of its own), so a
    continuation never crosses a shard. `resume` (from resume_point) skips the shards already on disk; the
    caller must not yield documents before resume.next_source. `progress(tokens)` is called per document.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".shard-*.tmp"):  # left by a build killed mid-write (one build per directory)
        stale.unlink(missing_ok=True)
    dtype = token_dtype(vocab_size)
    cap = max_shard_length(dtype) - 1
    shard_tokens = cap if shard_tokens is None else int(shard_tokens)
    if not 1 <= shard_tokens <= cap:
        raise ValueError(f"shard_tokens must lie in [1, {cap}] for vocab {vocab_size}, got {shard_tokens}")
    if limit_tokens is not None and limit_tokens < 1:
        raise ValueError(f"limit_tokens must be >= 1, got {limit_tokens}")
    resume = resume or ResumePoint(0, 0, 0)
    shard_i, total = resume.next_shard, resume.tokens_done
    pending: list[np.ndarray] = []
    pending_tokens, first_source, last_source = 0, resume.next_source, resume.next_source

    def flush() -> None:
        nonlocal shard_i, pending, pending_tokens, first_source
        if not pending:
            return
        extra = {"corpus_key": corpus_key, "shard_index": shard_i, "source_start": first_source,
                 "source_end": last_source}
        if log:
            log(f"shard {shard_i}: {pending_tokens:,} tokens in {len(pending):,} documents -> suffix array")
        shard = Shard.from_documents(pending, vocab_size=vocab_size, tokenizer_id=tokenizer_id, extra=extra)
        pending, pending_tokens, first_source = [], 0, last_source
        shard.write(out / shard_name(shard_i))
        shard_i += 1

    for source, ids in _limited(docs, limit_tokens, total):
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"document {source} must be 1-D token ids, got shape {ids.shape}")
        if pending and pending_tokens + len(ids) > shard_tokens:
            flush()
            first_source = source
        if len(ids) + 1 > cap:
            raise ValueError(f"document {source} has {len(ids)} tokens, more than one shard can hold ({cap})")
        if len(ids):
            pending.append(ids)
            pending_tokens += len(ids)
            total += len(ids)
        last_source = source + 1
        if progress:
            progress(len(ids))
    flush()
    return finish_manifest(out, corpus_key=corpus_key, num_shards=shard_i)


def _limited(docs: Iterable[tuple[int, np.ndarray]], limit: int | None, done: int) -> Iterator[tuple[int, np.ndarray]]:
    """Cut the document stream at exactly `limit` tokens (the last document is truncated)."""
    for source, ids in docs:
        if limit is not None:
            room = limit - done
            if room <= 0:
                return
            ids = ids[:room]
            done += len(ids)
        yield source, ids


def finish_manifest(out: Path, *, corpus_key: str, num_shards: int) -> dict:
    shards = []
    for i in range(num_shards):
        header, _ = read_header(out / shard_name(i))
        sums = {k: v["xxh3_64"] for k, v in header["sections"].items()}
        shards.append({k: header[k] for k in ("num_tokens", "num_documents", "length", "source_start", "source_end")}
                      | {"file": shard_name(i), "sections_xxh3_64": sums})
    if not shards:
        raise DatastoreError(f"no documents with tokens were given; {out} would be an empty datastore")
    header0, _ = read_header(out / shard_name(0))
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "tokenizer_id": header0["tokenizer_id"],
        "vocab_size": header0["vocab_size"], "token_dtype": header0["token_dtype"], "corpus_key": corpus_key,
        "num_tokens": sum(s["num_tokens"] for s in shards), "num_documents": sum(s["num_documents"] for s in shards),
        "shards": shards,
    }
    _write_json_atomic(out / MANIFEST, manifest)
    return manifest


def open_shards(path: str | os.PathLike, expected_tokenizer_id: str | None = None) -> tuple[list[Shard], dict | None]:
    """A shard file or a finished datastore directory -> memory-mapped shards (+ the manifest)."""
    path = Path(path).expanduser()
    if path.is_file():
        return [Shard.open(path, expected_tokenizer_id)], None
    if not path.is_dir():
        raise DatastoreError(f"datastore {str(path)!r} does not exist")
    manifest = read_manifest(path)
    shards = []
    for entry in manifest["shards"]:
        shard = Shard.open(path / entry["file"], expected_tokenizer_id)
        sums = {k: v["xxh3_64"] for k, v in shard.header["sections"].items()}
        if sums != entry["sections_xxh3_64"] or shard.header["tokenizer_id"] != manifest["tokenizer_id"]:
            raise DatastoreError(f"{shard.path} does not belong to this datastore (its checksums or tokenizer "
                                 f"differ from {path / MANIFEST}); rebuild it")
        shards.append(shard)
    extra = sorted(p.name for p in path.glob(SHARD_GLOB) if p.name not in {e["file"] for e in manifest["shards"]})
    if extra:
        raise DatastoreError(f"{path} holds shards the manifest does not list: {extra[:3]}")
    return shards, manifest
