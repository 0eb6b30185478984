"""Facts about the machine a process runs on (CPU model and flags), for caches keyed by hardware and for reports."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_info() -> tuple[str, list[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform.processor(), []) elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or "unknown", []
    name, flags = "unknown", []
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k = k.strip()
        if k == "model name" and name == "unknown":
            name = v.strip()
        elif k == "flags" and not flags:
            flags = sorted(v.split())
    return name, flags
