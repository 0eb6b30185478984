"""The file layout our stores share (suffix-array shards, CREST stores): a fixed prefix (magic, header length,
xxh3 of the header), a JSON header, then aligned data sections. One reader, so both formats check the same way.

Content verification helpers: sections are hashed in chunks with pread (hash_file_range), and files that passed
are remembered by identity in a small JSON cache (VerifiedCache), so a restart does not re-read gigabytes."""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from pathlib import Path

import xxhash

PREFIX = struct.Struct("<8sQQ")  # magic, header length, xxh3_64 of the header

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------------------------------------
# Content verification: chunked hashing, and a cache of files already verified (by file identity)

CHUNK_BYTES = 8 << 20  # read size of a verification pass (a multiple of every dtype's size)


def hash_file_range(path: Path, start: int, nbytes: int, check=None, chunk: int = CHUNK_BYTES) -> str:
    """xxh3_64 hex digest of path[start:start + nbytes], read in chunks with pread.

    Not through the memory map: the pages stay in the page cache but do not count against the server's RSS (the
    map is MADV_RANDOM for binary search). check(memoryview) sees every chunk in order (e.g. a range check of
    the values) and may raise. Raises OSError if the file is shorter than the range.
    """
    h = xxhash.xxh3_64()
    buf = bytearray(min(chunk, max(nbytes, 1)))
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            want = min(len(buf), nbytes - done)
            got = os.preadv(fd, [view[:want]], start + done)
            if got <= 0:
                raise OSError(f"{path}: file ends at byte {start + done}, expected {start + nbytes}")
            h.update(view[:got])
            if check is not None:
                check(view[:got], done)
            done += got
    finally:
        os.close(fd)
    return h.hexdigest()


def file_identity(path: Path, header_digest: int | str) -> dict:
    """What must be unchanged for an earlier verification to still hold: the path, size, modification and
    status-change times (ctime cannot be set back by a user), inode and device, and the header's own checksum."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev, "header": str(header_digest)}


def header_digest(path: Path) -> int:
    """The xxh3_64 of the header stored in the file's prefix (it covers every section checksum)."""
    with open(path, "rb") as f:
        prefix = f.read(PREFIX.size)
    return PREFIX.unpack(prefix)[2] if len(prefix) == PREFIX.size else 0


def cache_path(setting: str) -> Path | None:
    """The verify_cache setting resolved: "" = $RAGSERVE_HOME/cache/verified-stores.json, "off" = no cache."""
    if setting == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    home = Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve")).expanduser()
    return home / "cache" / "verified-stores.json"


class VerifiedCache:
    """A small JSON file remembering which store files passed a full content verification, keyed by absolute path
    with their identity (file_identity); a changed file no longer matches and is verified again.

    path None = no cache (every open verifies). Concurrent writers replace the file atomically; the last one wins,
    which can only forget entries (a later open verifies again), never vouch for an unverified file.
    """

    MAX_ENTRIES = 512

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None

    def _load(self) -> dict:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data.get("entries", {}) if data.get("version") == 1 else {}
        except (OSError, ValueError, AttributeError):
            return {}  # missing or unreadable cache: verify again

    def is_verified(self, path: Path, identity: dict) -> bool:
        return self._load().get(str(Path(path).resolve())) == identity

    def add(self, verified: dict[Path, dict]) -> None:
        if self.path is None or not verified:
            return
        entries = {p: ident for p, ident in self._load().items() if Path(p).exists()}
        entries.update({str(Path(p).resolve()): ident for p, ident in verified.items()})
        entries = dict(list(entries.items())[-self.MAX_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only cache directory only costs the next start a verification pass
            log.debug("verified-stores cache %s not written: %s", self.path, e)
