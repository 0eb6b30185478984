"""Facts about the machine a process runs on (CPU model and flags), for caches keyed by hardware and for reports."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


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


# x86-64 microarchitecture levels as GCC's -march names them, best first, each with the /proc/cpuinfo flags a CPU
# needs to run code built for it: what the container images prebuild the C++ kernels for (they have no compiler).
X86_LEVELS = {
    # x86-64-v4 + AMX tiles and AVX512-BF16 (the q4_1_bf16 format's kernel): Sapphire Rapids and later.
    "sapphirerapids": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2",
                       "movbe", "avx512_bf16", "amx_tile", "amx_bf16"),
    # x86-64-v4 + AVX512-BF16 dot products (q4_1_bf16 without AMX): Zen 4, Zen 5, Cooper Lake.
    "x86-64-v4-bf16": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2",
                       "movbe", "avx512_bf16"),
    "x86-64-v4": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c", "bmi2", "movbe"),
    "x86-64-v3": ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"),
}


def best_level(levels) -> str:
    """The first of `levels` (names of X86_LEVELS, best first) this CPU runs, or '' (none of them, or not x86)."""
    flags = set(cpu_info()[1])
    return next((lvl for lvl in levels if flags.issuperset(X86_LEVELS[lvl])), "")


def prebuild_levels(ap, levels) -> list[str]:
    """Add --prebuild (a comma list of `levels`) to the argparse parser `ap`, parse, and return the levels asked
    for (the parser exits naming unknown ones); [] = build for this CPU."""
    ap.add_argument("--prebuild", default="", help=f"comma list of x86-64 levels to build for any CPU of that level "
                    f"instead of this CPU ({', '.join(levels)}; container images)")
    args = ap.parse_args()
    asked = [lvl for lvl in args.prebuild.split(",") if lvl]
    bad = [lvl for lvl in asked if lvl not in levels]
    if bad:
        ap.error(f"--prebuild: unknown level(s) {bad}; one of {', '.join(levels)}")
    return asked
