"""Packed array payloads on the wire, the one place they are (de)coded: little-endian uint32 token ids, int32
parents/orders, int64 doc ids, float32 scores/vectors.

unpack_* validate what a request sent (WireError names the field -> INVALID_ARGUMENT); read_array decodes a reply
of one of our own services (its shape is checked by the caller).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ragcore.errors import InvalidArgument


class WireError(InvalidArgument):
    """A request field is malformed on the wire (InvalidArgument: `field` names it)."""


def clip(value: object, limit: int = 40) -> str:
    """repr(value) for an error message, cut to `limit` characters of the value: a 1 MB string sent back in a
    status message would be refused by gRPC's metadata limit and reach the client as a different error.

    clip("rest") -> "'rest'";  clip("x" * 5000) -> "'xxxx...' (5000 characters)"
    """
    if isinstance(value, (str, bytes)) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"
    return repr(value)


def pack_tokens(ids: Iterable[int] | np.ndarray) -> bytes:
    arr = np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise WireError("tokens", f"ids must be in [0, 2^32), got {int(arr.min())}..{int(arr.max())}")
    return pack_array(arr, "<u4")


def unpack_tokens(data: bytes, field: str, *, vocab_size: int | None = None, max_len: int | None = None,
                  allow_empty: bool = False) -> np.ndarray:
    """bytes -> int32 [n] token ids, checked against the vocabulary."""
    if len(data) % 4:
        raise WireError(f"{field}", f"{len(data)} bytes is not a whole number of uint32 token ids")
    arr = np.frombuffer(data, dtype="<u4")
    if not allow_empty and arr.size == 0:
        raise WireError(f"{field}", "must hold at least one token id")
    if max_len is not None and arr.size > max_len:
        raise WireError(f"{field}", f"{arr.size} tokens exceeds the limit of {max_len}")
    if vocab_size is not None and arr.size and int(arr.max()) >= vocab_size:
        bad = int(arr[np.argmax(arr >= vocab_size)])
        raise WireError(f"{field}", f"token id {bad} is out of vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)


def pack_array(values, dtype: str) -> bytes:
    """values -> little-endian bytes of `dtype` ("<u4", "<i4", "<i8", "<f4")."""
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def read_array(data: bytes, dtype: str, dim: int = 0) -> np.ndarray:
    """Little-endian bytes of `dtype` -> a native, writable array ([n], or [n / dim, dim] with dim)."""
    arr = np.frombuffer(data, dtype=dtype).astype(np.dtype(dtype).newbyteorder("="))
    return arr.reshape(-1, dim) if dim else arr


def pack_f32(values: np.ndarray) -> bytes:
    return pack_array(values, "<f4")


def pack_ids(ids) -> bytes:
    return pack_array(ids, "<i8")


def unpack_ids(data: bytes, field: str) -> np.ndarray:
    """bytes -> int64 [n] doc ids (range checks are the index's: it knows its size)."""
    if len(data) % 8:
        raise WireError(field, f"{len(data)} bytes is not a whole number of int64 doc ids")
    return read_array(data, "<i8")


def unpack_f32(data: bytes, field: str, *, dim: int | None = None) -> np.ndarray:
    if len(data) % 4:
        raise WireError(f"{field}", f"{len(data)} bytes is not a whole number of float32 values")
    arr = read_array(data, "<f4")
    if dim is not None:
        if arr.size == 0 or arr.size % dim:
            raise WireError(f"{field}", f"{arr.size} floats is not a positive multiple of dimension {dim}")
        arr = arr.reshape(-1, dim)
    if not np.all(np.isfinite(arr)):
        raise WireError(f"{field}", "values must be finite (found NaN or inf)")
    return arr
