"""The file layout our stores share (suffix-array shards, CREST stores): a fixed prefix (magic, header length,
xxh3 of the header), a JSON header, then aligned data sections. One reader, so both formats check the same way."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import xxhash

PREFIX = struct.Struct("<8sQQ")  # magic, header length, xxh3_64 of the header


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def read_header(path: Path, *, magic: bytes, fmt: str, version: int, align_to: int, what: str, short: str,
                error: type[Exception], missing: str = "") -> tuple[dict, int]:
    """-> (header, data_start); `error` naming what is wrong. what: "a CREST store"; short: "CREST store" (for
    read errors); missing: message when the file does not exist ("" = treat as a read error)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(PREFIX.size)
            if len(prefix) < PREFIX.size:
                raise error(f"{path} is not {what} (only {len(prefix)} bytes)")
            found, n, digest = PREFIX.unpack(prefix)
            if found != magic:
                raise error(f"{path} is not {what} (magic {found!r}, expected {magic!r})")
            if n > 1 << 24:
                raise error(f"{path} is corrupted: header length {n} is implausible")
            blob = f.read(n)
    except FileNotFoundError as e:
        if missing:
            raise error(missing) from None
        raise error(f"cannot read {short} {path}: {e}") from e
    except OSError as e:
        raise error(f"cannot read {short} {path}: {e}") from e
    if len(blob) != n or xxhash.xxh3_64_intdigest(blob) != digest:
        raise error(f"{path} is corrupted: header checksum mismatch")
    header = json.loads(blob)
    if header.get("format") != fmt or header.get("version") != version:
        raise error(f"{path} has format {header.get('format')!r} version {header.get('version')!r}; "
                    f"this code reads {fmt!r} version {version}")
    return header, align(PREFIX.size + n, align_to)
