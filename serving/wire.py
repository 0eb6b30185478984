"""Packed token payloads on the wire: little-endian uint32 ids, int32 parents, float32 scores/vectors.

Decoding validates at the boundary and raises WireError naming the field, which servers turn into
INVALID_ARGUMENT.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class WireError(ValueError):
    """A request field is malformed; the message starts with the field name."""


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
        raise WireError(f"token ids must be in [0, 2^32), got {int(arr.min())}..{int(arr.max())}")
    return arr.astype("<u4").tobytes()


def unpack_tokens(data: bytes, field: str, *, vocab_size: int | None = None, max_len: int | None = None,
                  allow_empty: bool = False) -> np.ndarray:
    """bytes -> int32 [n] token ids, checked against the vocabulary."""
    if len(data) % 4:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of uint32 token ids")
    arr = np.frombuffer(data, dtype="<u4")
    if not allow_empty and arr.size == 0:
        raise WireError(f"{field}: must hold at least one token id")
    if max_len is not None and arr.size > max_len:
        raise WireError(f"{field}: {arr.size} tokens exceeds the limit of {max_len}")
    if vocab_size is not None and arr.size and int(arr.max()) >= vocab_size:
        bad = int(arr[np.argmax(arr >= vocab_size)])
        raise WireError(f"{field}: token id {bad} is out of vocabulary [0, {vocab_size})")
    return arr.astype(np.int32)


def pack_f32(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype="<f4").tobytes()


def unpack_f32(data: bytes, field: str, *, dim: int | None = None) -> np.ndarray:
    if len(data) % 4:
        raise WireError(f"{field}: {len(data)} bytes is not a whole number of float32 values")
    arr = np.frombuffer(data, dtype="<f4").astype(np.float32)
    if dim is not None:
        if arr.size == 0 or arr.size % dim:
            raise WireError(f"{field}: {arr.size} floats is not a positive multiple of dimension {dim}")
        arr = arr.reshape(-1, dim)
    if not np.all(np.isfinite(arr)):
        raise WireError(f"{field}: values must be finite (found NaN or inf)")
    return arr
