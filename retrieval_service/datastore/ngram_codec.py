"""Compact binary encoding of CREST draft trees, and trimming a stored tree to a smaller node budget.

One precomputed tree is a *payload* (the same bytes in the embedded file and as a Redis value), optionally one
zstd frame compressed with the store's shared dictionary (trained on the store's own trees: one small tree
alone compresses poorly, with a dictionary it shrinks markedly). Raw payload, little-endian:

    u8      k            nodes (<= 255)
    u16     num_matches  datastore occurrences the tree was drafted from
    tok[k]  tokens       BFS order; tok = uint16 when the vocabulary fits, else uint32
    u8[k]   parents + 1  0 = child of the context's last token (BFS: parent index < own index)
    u16[k]  counts       rows through the node (REST's node weight; non-increasing along a path)

Columns, not interleaved nodes: each column compresses on its own statistics.

Worked example, tree [a, d, b] with parents [-1, -1, 0], counts [2, 1, 1], 2 matches, uint16 tokens:
    03 | 02 00 | a_lo a_hi d_lo d_hi b_lo b_hi | 00 00 01 | 02 00 01 00 01 00

Trimming. A stored tree holds the top-`max_nodes` nodes of REST's counted trie. The kernels select nodes by
(count desc, depth asc, path order) and emit BFS order (depth, then path order within a depth), so within a
depth the BFS index is the path order: top-k of the stored tree by (count desc, depth asc, BFS index asc) is
exactly the tree REST would draft with max_nodes = k (a child never outranks its parent, so it stays connected).
"""

from __future__ import annotations

import threading

import numba as nb
import numpy as np

_JIT = dict(nogil=True, cache=True)
MAX_NODES = 255  # parents are stored as uint8 (parent + 1)
MAX_COUNT = 0xFFFF  # counts and num_matches are uint16: max_matches must not exceed it
COMPRESSIONS = ("zstd", "none")


def encode_payload(tokens: np.ndarray, parents: np.ndarray, counts: np.ndarray, num_matches: int,
                   tok_dtype: np.dtype) -> bytes:
    """tokens int [k], parents int [k] (-1 = root child), counts [k] (integral), num_matches -> raw payload."""
    k = int(tokens.shape[0])
    if k > MAX_NODES:
        raise ValueError(f"a stored tree holds at most {MAX_NODES} nodes, got {k}")
    if not 0 <= num_matches <= MAX_COUNT:
        raise ValueError(f"num_matches must lie in [0, {MAX_COUNT}], got {num_matches}")
    c = np.asarray(counts)
    if k and (c.min() < 0 or c.max() > MAX_COUNT or np.any(c != np.round(c))):
        raise ValueError(f"counts must be integers in [0, {MAX_COUNT}], got {c.min()}..{c.max()}")
    head = np.array([k], np.uint8).tobytes() + np.array([num_matches], "<u2").tobytes()
    return (head + np.asarray(tokens).astype(np.dtype(tok_dtype).newbyteorder("<")).tobytes()
            + (np.asarray(parents) + 1).astype(np.uint8).tobytes() + c.astype("<u2").tobytes())


def decode_payload(raw: bytes, tok_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Raw payload -> (tokens int32 [k], parents int32 [k], counts float32 [k], num_matches)."""
    k = raw[0]
    tb = np.dtype(tok_dtype).itemsize
    if len(raw) != 3 + k * (tb + 3):
        raise ValueError(f"payload of {len(raw)} bytes does not hold {k} nodes of {tb}-byte tokens")
    num_matches = int.from_bytes(raw[1:3], "little")
    tokens = np.frombuffer(raw, np.dtype(tok_dtype).newbyteorder("<"), k, 3).astype(np.int32)
    parents = np.frombuffer(raw, np.uint8, k, 3 + k * tb).astype(np.int32) - 1
    counts = np.frombuffer(raw, "<u2", k, 3 + k * (tb + 1)).astype(np.float32)
    return tokens, parents, counts, num_matches


# ----------------------------------------------------------------------------------------------------------------
# zstd with a shared dictionary


def train_dictionary(raw_payloads: list[bytes], size: int) -> bytes:
    """A zstd dictionary for these payloads (deterministic for the same input); b"" if too few samples."""
    import zstandard  # optional: only zstd-compressed stores need it

    if len(raw_payloads) < 16 or sum(map(len, raw_payloads)) < 8 * size:
        return b""  # zstd's trainer needs a reasonable sample; tiny stores are stored raw
    try:
        return zstandard.train_dictionary(size, raw_payloads).as_bytes()
    except zstandard.ZstdError:
        return b""


class Codec:
    """Compress / decompress payloads of one store (compression "zstd" with an optional dictionary, or "none").

    Decompressors are per thread: a zstandard context must not be shared by threads (the gRPC server drafts on a
    thread pool).
    """

    def __init__(self, compression: str, zdict: bytes = b"", level: int = 9):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.compression = compression
        self.zdict = bytes(zdict)
        self.level = level
        self._local = threading.local()

    def _dict(self):
        import zstandard  # optional: only zstd-compressed stores need it

        return zstandard.ZstdCompressionDict(self.zdict) if self.zdict else None

    def compress(self, raw: bytes) -> bytes:
        if self.compression == "none":
            return raw
        c = getattr(self._local, "c", None)
        if c is None:
            import zstandard  # optional: only zstd-compressed stores need it

            c = zstandard.ZstdCompressor(level=self.level, dict_data=self._dict(), write_checksum=False,
                                         write_content_size=True, write_dict_id=False)
            self._local.c = c
        return c.compress(raw)

    def decompress(self, payload: bytes) -> bytes:
        if self.compression == "none":
            return payload
        d = getattr(self._local, "d", None)
        if d is None:
            import zstandard  # optional: only zstd-compressed stores need it

            d = zstandard.ZstdDecompressor(dict_data=self._dict())
            self._local.d = d
        return d.decompress(payload)


# ----------------------------------------------------------------------------------------------------------------
# Trimming


@nb.njit(**_JIT)
def trim_tree(tokens, parents, counts, k):
    """Top-k nodes of a BFS tree by (count desc, depth asc, index asc), still in BFS order.

    tokens/parents int32 [n], counts float32 [n] -> (tokens, parents, counts) of min(n, k) nodes.
    """
    n = tokens.shape[0]
    if k >= n:
        return tokens, parents, counts
    depth = np.empty(n, np.int64)
    keys = np.empty(n, np.int64)
    for i in range(n):
        depth[i] = 1 if parents[i] < 0 else depth[parents[i]] + 1
        # counts <= 65535, depth <= n <= 255, index < 256: one integer key, smaller = better.
        keys[i] = (np.int64(65535) - np.int64(counts[i])) * 65536 + depth[i] * 256 + i
    chosen = np.sort(np.argsort(keys)[:k])  # ascending index = BFS order kept
    new_index = np.full(n, -1, np.int32)
    out_t = np.empty(k, np.int32)
    out_p = np.empty(k, np.int32)
    out_c = np.empty(k, np.float32)
    for j in range(k):
        i = chosen[j]
        new_index[i] = j
        out_t[j] = tokens[i]
        out_p[j] = -1 if parents[i] < 0 else new_index[parents[i]]
        out_c[j] = counts[i]
    return out_t, out_p, out_c
