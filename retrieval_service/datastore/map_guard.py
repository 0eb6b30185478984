"""Store files changed under a running server: detected, answered DATA_LOSS, never a crash.

A memory-mapped file that is truncated while mapped (an in-place `cp`, `rsync --inplace`, `truncate`) turns every
read of a page past its new end into SIGBUS, which kills the process; rewritten in place, the map silently shows
the new bytes, which no verification ever checked. An atomic replace (write a new file, rename it over) is safe:
the open map keeps the old inode.

Two parts, both per mapped file (MappedFile):
  * a SIGBUS handler (map_guard.c, through ctypes) that turns a fault inside a registered map into a readable
    page of zeros and counts it, so the kernel that touched it finishes (with meaningless values);
  * after every draft, fstat of the open file: its size and modification time must be those it had at open.
Either one marks the file changed; the caller discards the result and answers DATA_LOSS naming the file.
Metadata-only changes (chmod, chown, a new hard link) are not changes.

Built with the C compiler into $RAGSERVE_HOME/kernels/mapguard-<hash of source and flags>/ on first use (plain
C, no -march: the container image carries the build). Without a compiler only the fstat check runs (logged
once): a truncation that races a running draft can then still end the process.

    python -m retrieval_service.datastore.map_guard     # build (or find) it and print where it is
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np

from ragcore.files import compile_shared_library
from ragcore.model_files import ragserve_home

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("map_guard.c")
_FLAGS = ("-O2", "-shared", "-fPIC", "-std=gnu11")


def build_dir() -> Path:
    h = hashlib.sha256(_SOURCE.read_bytes())
    h.update(" ".join(_FLAGS).encode())
    return ragserve_home() / "kernels" / f"mapguard-{h.hexdigest()[:16]}"


def build() -> Path:
    """Compile the library unless it is there already (written atomically: concurrent processes may race)."""
    out = build_dir() / "libmapguard.so"
    if out.is_file():
        return out
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (gcc) on PATH")
    return compile_shared_library([compiler, *_FLAGS], _SOURCE, out)


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded guard, or None when it cannot be built or loaded (logged once)."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        log.warning("SIGBUS guard for memory-mapped stores unavailable (%s): a store file truncated while a draft "
                    "reads it can end the process", detail.splitlines()[0] if detail else type(e).__name__)
        return None
    lib.map_guard_install.restype = ctypes.c_int
    lib.map_guard_add.restype = ctypes.c_int
    lib.map_guard_add.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t]
    lib.map_guard_remove.argtypes = [ctypes.c_int]
    lib.map_guard_faults.restype = ctypes.c_int64
    lib.map_guard_faults.argtypes = [ctypes.c_int]
    lib.map_guard_capacity.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def _fault_counts() -> np.ndarray | None:
    """The C table of fault counts as an int64 array (reading it costs no call into the library)."""
    lib = library()
    if lib is None:
        return None
    table = (ctypes.c_int64 * lib.map_guard_capacity()).in_dll(lib, "map_guard_fault_counts")
    return np.ctypeslib.as_array(table)


class _Slots:
    """Hands out the C table's slots; a closed file's slot is reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 0

    def take(self, lib: ctypes.CDLL) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._next >= lib.map_guard_capacity():
                return -1
            self._next += 1
            return self._next - 1

    def give(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


_slots = _Slots()


class MappedFile:
    """One memory-mapped store file, watched for changes (see the module doc). `name` is how messages to clients
    name it (relative to its store: no server paths); `path` is for the server's own log."""

    def __init__(self, fd: int, mm: mmap.mmap, path: Path, name: str):
        self.path, self.name = path, name
        self._slot, self._fd = -1, -1
        self._fd = os.dup(fd)
        st = os.fstat(self._fd)
        self._identity = (st.st_size, st.st_mtime_ns)
        self._lib = library()
        self._counts = _fault_counts()
        if self._lib is not None and len(mm):
            if self._lib.map_guard_install() != 0:
                log.warning("SIGBUS guard not installed (sigaction failed)")
            slot = _slots.take(self._lib)
            if slot < 0:
                log.warning("SIGBUS guard: more than %d maps open; %s is checked by fstat only",
                            self._lib.map_guard_capacity(), path)
            else:
                base = np.frombuffer(mm, np.uint8).ctypes.data
                self._lib.map_guard_add(slot, base, base + len(mm))
                self._slot = slot

    def change(self) -> str | None:
        """None while the file is as it was opened, else what happened to it."""
        faults = int(self._counts[self._slot]) if self._slot >= 0 else 0
        try:
            st = os.fstat(self._fd)
        except OSError as e:  # the descriptor itself went bad (a forced unmount)
            return f"cannot be checked ({e.strerror})"
        size, mtime = self._identity
        if faults:
            return f"was truncated while being read (now {st.st_size} bytes, opened at {size})"
        if (st.st_size, st.st_mtime_ns) != (size, mtime):
            return (f"changed on disk while serving (size {size} -> {st.st_size} bytes"
                    f"{'' if st.st_mtime_ns == mtime else ', modification time changed'})")
        return None

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        if self._slot >= 0:
            self._lib.map_guard_remove(self._slot)
            _slots.give(self._slot)
            self._slot = -1
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if library() is None:
        raise SystemExit("SIGBUS guard: not built (see the warning above)")
    print(f"SIGBUS guard for memory-mapped stores: {build()}")


if __name__ == "__main__":
    main()
