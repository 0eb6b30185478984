"""Small file helpers shared by both services and the tools."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path


def write_json_atomic(path: Path, data: object) -> None:
    """Write data as JSON so that a crash mid-write leaves the old file or none, never a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile_shared_library(command: list[str], source: Path, out: Path) -> Path:
    """`out` compiled from `source` by `command` (compiler and flags) unless it is there already. Written
    atomically (concurrent processes may race to build it) and readable by all: a copy prebuilt in a container
    image as root is loaded by the image's non-root user. Raises CalledProcessError when the compiler fails."""
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=out.suffix, dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([*command, str(source), "-o", tmp], check=True, capture_output=True, text=True)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out
