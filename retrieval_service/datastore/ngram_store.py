"""CREST n-gram store: precomputed REST draft trees for the most frequent n-grams, looked up by context suffix.

    store = EmbeddedNgramStore.open("~/.cache/ragserve/crest/code.crest")   # one memory-mapped file
    (Redis: ngram_redis.py; either one by spec: ngram_backends.open_ngram_store)
    tree = store.lookup(context_ids, max_nodes=64)   # DraftTree; matched_suffix = n of the hit, 0 = no hit

Lookup. The context's suffixes are probed from the longest stored n down to 1; the first stored n-gram wins and
its tree (trimmed to max_nodes, see ngram_codec) is the draft. Each probe is O(1): one hash, a few slots.

Embedded file (little-endian; written to a temp file, fsynced, renamed):
    0   magic b"RGCREST\\x01"
    8   uint64 header length H
    16  uint64 xxh3_64 of the header bytes
    24  header: UTF-8 JSON (format, version, tokenizer identity, vocab size, token dtype, max_n, n-grams per n,
        hash and compression parameters, draft parameters, build provenance, sections with xxh3_64 checksums)
    align64(24 + H): sections (offsets relative to this point, 64-aligned)
        index    uint64 [S]  open-addressing slots: fingerprint << 32 | record offset; 0 = empty
        records  uint8  [R]  per n-gram: u8 n | key tok[n] | u16 payload length | payload (ngram_codec)
        zdict    uint8  [D]  the zstd dictionary of the payloads (may be empty)

Why open addressing in our own file rather than LMDB: one file that memory-maps as typed arrays, probed by one
numba kernel that tries every suffix length without the GIL or a Python call per probe (all five in one call);
nothing to install; a deterministic layout covered by our own header and checksums (LMDB brings its own file
format, a lock file, a B+tree walk of O(log n) pages per key and a cursor API per probe). The table is
read-only after the build, so the usual weakness of open addressing (deletes, growth) does not arise. Linear
probing at load <= 0.6 keeps ~1.5 probes per lookup; the 32-bit fingerprint skips nearly every foreign key
without touching the record, and a match is confirmed against the key stored in the record (never a false hit).

Hash: splitmix64's finalizer folded over (n, tokens); the same values at build and probe (numba, uint64 math).
"""

from __future__ import annotations

import json
import mmap
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numba as nb
import numpy as np
import xxhash

from ragcore.draft_tree import DraftTree, as_context
from ragcore.errors import Unavailable
from retrieval_service.datastore import container
from retrieval_service.datastore.map_guard import MappedFile
from retrieval_service.datastore.ngram_codec import Codec, decode_payload, trim_tree
from retrieval_service.datastore.shards import DatastoreCorrupted, DatastoreError, TokenizerMismatch, token_dtype

__all__ = ["NgramStoreError", "NgramStoreCorrupted", "StoreUnavailable", "TokenizerMismatch", "EmbeddedNgramStore", "FallbackNgramStore",
           "StoreRecords", "write_store", "read_header", "store_size", "record_nbytes",
           "build_id", "FORMAT", "FORMAT_VERSION"]

FORMAT = "ragserve-crest"
FORMAT_VERSION = 1
MAGIC = b"RGCREST\x01"
_PREFIX = container.PREFIX
_ALIGN = 64
_SECTIONS = ("index", "records", "zdict")
LOAD_FACTOR = 0.6
_JIT = dict(nogil=True, cache=True)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class NgramStoreError(DatastoreError):
    """A CREST store is missing, corrupted, incomplete or does not fit the caller (the message says which)."""


class NgramStoreCorrupted(DatastoreCorrupted, NgramStoreError):
    """The store file changed under the server (DATA_LOSS; the message names the file, not its server path)."""


class StoreUnavailable(Unavailable):
    """The store's backend cannot answer right now (Redis down or timing out): a transient condition."""


# ----------------------------------------------------------------------------------------------------------------
# Kernels: hash, index build, probe. records: uint8 [R]; a record at offset o is
# u8 n | tok[n] | u16 L | payload[L] with tok of `tb` bytes.


@nb.njit(**_JIT)
def _mix(h):
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@nb.njit(**_JIT)
def key_hash(keys, start, n) -> np.uint64:
    """64-bit hash of the n tokens keys[start:start+n] (any integer array)."""
    h = _mix(np.uint64(n) * _GOLDEN)
    for j in range(n):
        h = _mix(h ^ (np.uint64(keys[start + j]) + _GOLDEN))
    return h


@nb.njit(**_JIT)
def _read_tok(records, o, tb) -> np.int64:
    v = np.int64(0)
    for b in range(tb):
        v |= np.int64(records[o + b]) << (8 * b)
    return v


@nb.njit(**_JIT)
def _key_equal(records, off, tb, keys, start, n) -> bool:
    if np.int64(records[off]) != n:
        return False
    for j in range(n):
        if _read_tok(records, off + 1 + j * tb, tb) != np.int64(keys[start + j]):
            return False
    return True


@nb.njit(**_JIT)
def _find(index, records, tb, keys, start, n) -> np.int64:
    """Offset of the record holding keys[start:start+n], or -1."""
    s = np.uint64(index.shape[0])
    if s == 0:
        return -1
    h = key_hash(keys, start, n)
    fp = h >> np.uint64(32)
    if fp == 0:
        fp = np.uint64(1)
    i = h % s
    while True:
        v = index[i]
        if v == 0:
            return -1
        if (v >> np.uint64(32)) == fp:
            off = np.int64(v & np.uint64(0xFFFFFFFF))
            if _key_equal(records, off, tb, keys, start, n):
                return off
        i = i + np.uint64(1)
        if i == s:
            i = np.uint64(0)


@nb.njit(**_JIT)
def probe_longest(index, records, tb, present, ctx):
    """ctx: int32 [T]; present: bool [max_n + 1] (present[n] = the store holds n-grams of length n).

    Returns (record offset, n) of the longest stored suffix of ctx, or (-1, 0).
    """
    t = ctx.shape[0]
    for n in range(min(present.shape[0] - 1, t), 0, -1):
        if present[n]:
            off = _find(index, records, tb, ctx, t - n, n)
            if off >= 0:
                return off, n
    return np.int64(-1), 0


@nb.njit(**_JIT)
def build_index(records, tb, offsets, slots):
    """Open-addressing table over the records at `offsets` (int64 [R]) -> uint64 [slots]; -1 offset = error."""
    index = np.zeros(slots, np.uint64)
    s = np.uint64(slots)
    for r in range(offsets.shape[0]):
        off = offsets[r]
        n = np.int64(records[off])
        keys = np.empty(n, np.int64)
        for j in range(n):
            keys[j] = _read_tok(records, off + 1 + j * tb, tb)
        h = key_hash(keys, 0, n)
        fp = h >> np.uint64(32)
        if fp == 0:
            fp = np.uint64(1)
        i = h % s
        while index[i] != 0:
            i = i + np.uint64(1)
            if i == s:
                i = np.uint64(0)
        index[i] = (fp << np.uint64(32)) | np.uint64(off)
    return index


@nb.njit(**_JIT)
def record_offsets(records, tb, count):
    """Walk `count` consecutive records -> (offsets int64 [count], end offset); -1 end if they overrun."""
    out = np.empty(count, np.int64)
    o = np.int64(0)
    size = records.shape[0]
    for r in range(count):
        if o >= size:
            return out, np.int64(-1)
        n = np.int64(records[o])
        lo = o + 1 + n * tb
        if lo + 2 > size:
            return out, np.int64(-1)
        length = np.int64(records[lo]) | (np.int64(records[lo + 1]) << 8)
        out[r] = o
        o = lo + 2 + length
    if o > size:
        return out, np.int64(-1)
    return out, o


# ----------------------------------------------------------------------------------------------------------------
# Writing


@dataclass
class StoreRecords:
    """What goes into a store: n-gram keys with their (possibly compressed) payloads, in store order."""

    keys: list[np.ndarray]  # int [n] each
    payloads: list[bytes]
    zdict: bytes
    compression: str  # "zstd" | "none"


def _tok_dtype(vocab_size: int) -> np.dtype:
    return token_dtype(vocab_size)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def num_slots(num_records: int) -> int:
    return max(1, int(np.ceil(num_records / LOAD_FACTOR)))


def _pack_records(keys: Sequence[np.ndarray], payloads: Sequence[bytes], tok: np.dtype) -> bytes:
    parts = []
    for key, p in zip(keys, payloads):
        if len(p) > 0xFFFF:
            raise ValueError(f"payload of {len(p)} bytes exceeds the 65535 a record holds")
        parts.append(bytes([len(key)]) + np.asarray(key).astype(tok.newbyteorder("<")).tobytes()
                     + len(p).to_bytes(2, "little") + p)
    return b"".join(parts)


def _header_blob(meta: dict, sections: dict) -> bytes:
    return json.dumps({**meta, "sections": sections}, sort_keys=True).encode("utf-8")


def _layout(meta: dict, nbytes: dict[str, int], sums: dict[str, str]) -> tuple[bytes, dict, int]:
    sections, offset = {}, 0
    for name in _SECTIONS:
        sections[name] = {"offset": offset, "nbytes": nbytes[name], "xxh3_64": sums[name]}
        offset = _align(offset + nbytes[name])
    blob = _header_blob(meta, sections)
    return blob, sections, _align(_PREFIX.size + len(blob)) + offset


def _full_meta(meta: dict, per_n: dict[int, int], compression: str) -> dict:
    num_records = sum(per_n.values())
    return {**meta, "format": FORMAT, "version": FORMAT_VERSION,
            "token_dtype": _tok_dtype(int(meta["vocab_size"])).name, "max_n": int(meta["max_n"]),
            "ngrams_per_n": {str(n): int(c) for n, c in sorted(per_n.items())}, "num_records": num_records,
            "slots": num_slots(num_records), "load_factor": LOAD_FACTOR, "hash": "splitmix64-fold-v1",
            "compression": compression}


def store_size(meta: dict, per_n: dict[int, int], records_nbytes: int, zdict_nbytes: int,
               compression: str) -> int:
    """Exact file size of a store with these contents (checksums are fixed-width, so placeholders measure it).

    per_n: n -> n-grams stored; records_nbytes: sum over records of 1 + n * token bytes + 2 + payload bytes.
    """
    full = _full_meta(meta, per_n, compression)
    nbytes = {"index": full["slots"] * 8, "records": records_nbytes, "zdict": zdict_nbytes}
    return _layout(full, nbytes, {k: "0" * 16 for k in _SECTIONS})[2]


def record_nbytes(n: int, payload_nbytes: int, vocab_size: int) -> int:
    """Bytes one record takes in the records section."""
    return 1 + n * _tok_dtype(vocab_size).itemsize + 2 + payload_nbytes


def write_store(path: str | os.PathLike, records: StoreRecords, meta: dict) -> Path:
    """Write an embedded store atomically. meta: tokenizer_id, vocab_size, max_n and provenance fields."""
    for k in ("tokenizer_id", "vocab_size", "max_n"):
        if k not in meta:
            raise ValueError(f"store meta needs {k!r}")
    if len(records.keys) != len(records.payloads):
        raise ValueError(f"{len(records.keys)} keys but {len(records.payloads)} payloads")
    path = Path(path).expanduser()
    tok = _tok_dtype(int(meta["vocab_size"]))
    max_n = int(meta["max_n"])
    per_n = {n: 0 for n in range(1, max_n + 1)}
    for key in records.keys:
        if not 1 <= len(key) <= max_n:
            raise ValueError(f"n-gram of length {len(key)} outside [1, max_n={max_n}]")
        per_n[len(key)] += 1
    blob = _pack_records(records.keys, records.payloads, tok)
    if len(blob) >= 1 << 32:
        raise ValueError(f"records take {len(blob)} bytes; the format's 32-bit offsets allow < 4 GiB")
    rec = np.frombuffer(blob, np.uint8)
    offsets, end = record_offsets(rec, tok.itemsize, len(records.keys))
    assert end == len(blob)
    slots = num_slots(len(records.keys))
    index = build_index(rec, tok.itemsize, offsets, slots)
    arrays = {"index": index.astype("<u8").tobytes(), "records": blob, "zdict": records.zdict}
    sums = {k: xxhash.xxh3_64_hexdigest(v) for k, v in arrays.items()}
    full = _full_meta(meta, per_n, records.compression)
    assert full["slots"] == slots
    header, sections, total = _layout(full, {k: len(v) for k, v in arrays.items()}, sums)
    prefix = _PREFIX.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header))
    data_start = _align(_PREFIX.size + len(header))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prefix + header)
            for name in _SECTIONS:
                f.seek(data_start + sections[name]["offset"])
                f.write(arrays[name])
            f.truncate(total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_header(path: Path) -> tuple[dict, int]:
    """-> (header, data_start); NgramStoreError naming what is wrong."""
    return container.read_header(
        path, magic=MAGIC, fmt=FORMAT, version=FORMAT_VERSION, align_to=_ALIGN, what="a CREST store",
        short="CREST store", error=NgramStoreError,
        missing=f"CREST store {str(path)!r} does not exist; build it with "
                f"python -m retrieval_service.datastore.crest_build")


def build_id(header: dict) -> str:
    """Content identity of a store (its records and dictionary checksums): names its keys in Redis."""
    sec = header["sections"]
    return f"{sec['records']['xxh3_64']}{sec['zdict']['xxh3_64']}"


class _TreeDecoder:
    """Payload bytes -> trimmed DraftTree; shared by the embedded and Redis backends (identical answers)."""

    def __init__(self, header: dict, zdict: bytes):
        self.tok = np.dtype(header["token_dtype"])
        self.max_n = int(header["max_n"])
        self.codec = Codec(header["compression"], zdict)
        self.present = np.zeros(self.max_n + 1, np.bool_)
        for n, c in header["ngrams_per_n"].items():
            self.present[int(n)] = int(c) > 0

    def tree(self, payload: bytes, n: int, max_nodes: int) -> DraftTree:
        tokens, parents, counts, m = decode_payload(self.codec.decompress(payload), self.tok)
        if max_nodes < tokens.shape[0]:
            tokens, parents, counts = trim_tree(tokens, parents, counts, max_nodes)
        return DraftTree(tokens, parents, counts, matched_suffix=n, num_matches=m)


def check_lookup_args(context_ids, max_nodes: int, max_n: int) -> np.ndarray:
    """Boundary check -> int32 context tail (only the last max_n tokens are ever probed)."""
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, (int, np.integer)) or max_nodes < 0:
        raise ValueError(f"max_nodes must be an integer >= 0, got {max_nodes!r}")
    ctx = np.asarray(context_ids)
    if ctx.ndim != 1:
        raise ValueError(f"context_ids must be 1-D, got shape {ctx.shape}")
    return as_context(ctx[-max_n:] if max_n else ctx[:0])


class EmbeddedNgramStore:
    """One memory-mapped store file; lookups are one numba probe kernel plus one payload decode."""

    backend = "embedded"

    def __init__(self, path: Path, header: dict, index: np.ndarray, records: np.ndarray, zdict: bytes,
                 mm: mmap.mmap | None, guard: MappedFile | None = None):
        self.path = path
        self._guard = guard
        self._changed: NgramStoreCorrupted | None = None
        self.header = header
        self._index = index
        self._records = records
        self._mmap = mm
        self._decoder = _TreeDecoder(header, zdict)
        self._tb = self._decoder.tok.itemsize

    @classmethod
    def open(cls, path: str | os.PathLike, expected_tokenizer_id: str | None = None,
             verify: bool = True) -> "EmbeddedNgramStore":
        """Memory-map a store; verify=True checks every section's checksum (one sequential read of the file)."""
        path = Path(path).expanduser()
        header, data_start = read_header(path)
        if expected_tokenizer_id is not None and header["tokenizer_id"] != expected_tokenizer_id:
            raise TokenizerMismatch(f"{path} was built with tokenizer {header['tokenizer_id']!r}, but the caller "
                                    f"uses {expected_tokenizer_id!r}; rebuild the CREST store")
        size = path.stat().st_size
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            guard = MappedFile(f.fileno(), mm, path, path.name)
        views = {}
        for name in _SECTIONS:
            s = header["sections"][name]
            start = data_start + int(s["offset"])
            if start + int(s["nbytes"]) > size:
                raise NgramStoreError(f"{path} is truncated or corrupted: section {name!r} "
                                      f"[{start}, {start + s['nbytes']}) does not fit the file size {size}")
            views[name] = np.frombuffer(mm, np.uint8, int(s["nbytes"]), start)
            if verify:
                got = xxhash.xxh3_64_hexdigest(views[name])
                if got != s["xxh3_64"]:
                    raise NgramStoreError(f"{path} is corrupted: section {name!r} checksum {got} != "
                                          f"{s['xxh3_64']}; rebuild the store")
        slots = int(header["slots"])
        if views["index"].shape[0] != slots * 8:
            raise NgramStoreError(f"{path} is corrupted: index holds {views['index'].shape[0]} bytes, expected "
                                  f"{slots} slots")
        index = views["index"].view("<u8").view(np.uint64)
        return cls(path, header, index, views["records"], bytes(views["zdict"]), mm, guard)

    # -- properties ------------------------------------------------------------------------------------------------

    @property
    def max_n(self) -> int:
        return self._decoder.max_n

    @property
    def tokenizer_id(self) -> str:
        return self.header["tokenizer_id"]

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"])

    @property
    def num_records(self) -> int:
        return int(self.header["num_records"])

    @property
    def bytes_on_disk(self) -> int:
        return self.path.stat().st_size

    def __repr__(self) -> str:
        return (f"EmbeddedNgramStore(path={str(self.path)!r}, ngrams={self.num_records:,}, max_n={self.max_n}, "
                f"bytes={self.bytes_on_disk:,})")

    # -- lookup ----------------------------------------------------------------------------------------------------

    def lookup(self, context_ids, max_nodes: int = 64) -> DraftTree:
        """Tree of the longest stored suffix of the context (n = max_n..1), trimmed to max_nodes."""
        ctx = check_lookup_args(context_ids, max_nodes, self.max_n)
        if self._changed is not None:
            raise NgramStoreCorrupted(str(self._changed), self._changed.paths)
        try:
            off, n = probe_longest(self._index, self._records, self._tb, self._decoder.present, ctx)
            tree = DraftTree.empty() if off < 0 else self._decoder.tree(self._payload(int(off)), int(n), max_nodes)
        except Exception:
            self._check_file()  # a payload read from a file that changed fails to decode: say that, not why
            raise
        self._check_file()
        return tree

    def _check_file(self) -> None:
        """NgramStoreCorrupted if the file changed under the server (map_guard); then every lookup fails."""
        what = self._guard.change() if self._guard is not None else None
        if what is not None:
            err = NgramStoreCorrupted(f"CREST store {self.path.name} {what}; lookups stopped: restore the file and "
                                      f"restart the server (replace store files by renaming a new file over them, "
                                      f"never in place)", [self.path])
            self._changed = self._changed or err
            raise err

    def lookup_batch(self, contexts: Sequence, max_nodes: int = 64) -> list[DraftTree]:
        return [self.lookup(c, max_nodes) for c in contexts]

    def _payload(self, off: int) -> bytes:
        n = int(self._records[off])
        lo = off + 1 + n * self._tb
        length = int(self._records[lo]) | int(self._records[lo + 1]) << 8
        return self._records[lo + 2: lo + 2 + length].tobytes()

    def items(self):
        """(key int32 [n], payload bytes) of every record, in store order (pushing to Redis, stats, tests)."""
        offsets, end = record_offsets(self._records, self._tb, self.num_records)
        if end < 0:
            raise NgramStoreError(f"{self.path} is corrupted: records overrun their section")
        tok = self._decoder.tok.newbyteorder("<")
        for off in offsets.tolist():
            n = int(self._records[off])
            key = np.frombuffer(self._records, tok, n, off + 1).astype(np.int32)
            yield key, self._payload(off)

    def zdict(self) -> bytes:
        return self._decoder.codec.zdict

    def tree_stats(self) -> dict:
        """Per n: n-grams stored, mean tree nodes, mean payload bytes (the paper's 'average tree size per n')."""
        out: dict[int, dict] = {}
        for key, payload in self.items():
            raw = self._decoder.codec.decompress(payload)
            s = out.setdefault(len(key), {"ngrams": 0, "nodes": 0, "payload_bytes": 0})
            s["ngrams"] += 1
            s["nodes"] += raw[0]
            s["payload_bytes"] += len(payload)
        return {n: {"ngrams": s["ngrams"], "mean_nodes": s["nodes"] / s["ngrams"],
                    "mean_payload_bytes": s["payload_bytes"] / s["ngrams"]} for n, s in sorted(out.items())}

    def check(self) -> dict:
        """Invariant checker: every record decodes to a valid tree and is found by its own key."""
        count = 0
        for key, payload in self.items():
            tokens, parents, counts, _ = decode_payload(self._decoder.codec.decompress(payload), self._decoder.tok)
            DraftTree(tokens, parents, counts).validate(self.vocab_size)
            off = _find(self._index, self._records, self._tb, key, 0, len(key))
            if off < 0:
                raise NgramStoreError(f"{self.path}: n-gram {key.tolist()} is not reachable through the index")
            count += 1
        if count != self.num_records:
            raise NgramStoreError(f"{self.path}: {count} records, header says {self.num_records}")
        return {"num_records": count, "slots": int(self.header["slots"])}

    def warmup(self) -> None:
        """Load the compiled kernels (numba disk cache) before reporting SERVING."""
        ctx = np.zeros(max(self.max_n, 1), np.int32)
        self.lookup(ctx, 64)
        self.lookup(ctx, 1)
        trim_tree(np.zeros(2, np.int32), np.array([-1, 0], np.int32), np.ones(2, np.float32), 1)

    def close(self) -> None:
        self._index = self._records = None  # views must go before the map closes
        if self._guard is not None:
            self._guard.close()
        self._mmap = None


class FallbackNgramStore:
    """Redis first; while it is unavailable, answer from an embedded copy of the same store."""

    def __init__(self, primary, fallback: EmbeddedNgramStore):
        if (primary.tokenizer_id, primary.max_n) != (fallback.tokenizer_id, fallback.max_n):
            raise NgramStoreError(f"fallback store {fallback.path} (tokenizer {fallback.tokenizer_id!r}, max_n "
                                  f"{fallback.max_n}) does not match the primary store")
        self.primary, self.fallback = primary, fallback
        self.backend = f"{primary.backend}+embedded-fallback"
        self.fallbacks = 0  # lookups answered by the fallback
        self._lock = threading.Lock()

    def __getattr__(self, name):  # properties (max_n, tokenizer_id, ...) of the primary
        return getattr(self.primary, name)

    def lookup(self, context_ids, max_nodes: int = 64) -> DraftTree:
        try:
            return self.primary.lookup(context_ids, max_nodes)
        except StoreUnavailable:
            with self._lock:
                self.fallbacks += 1
            return self.fallback.lookup(context_ids, max_nodes)

    def lookup_batch(self, contexts: Sequence, max_nodes: int = 64) -> list[DraftTree]:
        try:
            return self.primary.lookup_batch(contexts, max_nodes)
        except StoreUnavailable:
            with self._lock:
                self.fallbacks += 1
            return self.fallback.lookup_batch(contexts, max_nodes)

    def warmup(self) -> None:
        self.fallback.warmup()
        try:
            self.primary.warmup()
        except StoreUnavailable:
            pass
