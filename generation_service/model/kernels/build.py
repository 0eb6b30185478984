"""The CPU kernel extension: built once per machine, loaded, or reported missing.

Four sources, one module: q4_kernel.cpp (linears straight from GGUF blocks, Q4_1 / Q8_0, and the same tiling over
dense fp32 weights; on CPUs with AMX or AVX512-BF16 also the bf16-activation path of the q4_1_bf16 format),
lean_forward.cpp (LeanForward: the whole decoder pass of model/lean_llama.py in one call), int8_linear.cpp (the q4_1_i8
format's int8-activation linears) and claim_pool.cpp (the threads their loops run on: pieces claimed by whichever
thread is free).

Built with torch's C++ extension loader (g++ and ninja) for this CPU (-march=native: AVX-512 here, AVX2 on an AVX2
box, scalar elsewhere), into $RAGSERVE_HOME/kernels/<hash of source, torch version, compiler flags, CPU flags>/,
so a second process loads the cached .so instead of compiling again. `make install` builds it (the first build is
the slow one);
without a compiler `kernel()` returns None: the q4_1 format falls back to the exactly dequantized fp32 weights
(same values, fp32 memory traffic) and the lean forward runs its ops from Python, with a warning.

    python -m generation_service.model.kernels.build     # build (or find) the kernel and print the ISA it was built for
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import logging
import subprocess
import time
from pathlib import Path
from types import ModuleType

import torch

from ragcore.machine import X86_LEVELS, best_level, cpu_info, prebuild_levels
from ragcore.model_files import ragserve_home

log = logging.getLogger(__name__)

# One extension: the block-quantized linears and the fused lean forward built on them.
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("q4_kernel.cpp", "lean_forward.cpp", "claim_pool.cpp",
                                                         "int8_linear.cpp", "cpu_kernels.h"))
# -fopenmp: at::parallel_for (the load-time conversions; the passes' loops use claim_pool.cpp's threads) is a header
# template whose `omp parallel` needs it; the library then needs libgomp.so.1, which resolves to the copy torch already
# loaded: one OpenMP pool.
_LDFLAGS = ("-fopenmp",)


# Prebuilt variants (`--prebuild`, the container images): the x86-64 levels of ragcore.machine; the best level this
# CPU runs is loaded.
LEVELS = X86_LEVELS


def cpu_level() -> str:
    """The best of LEVELS this CPU runs, or '' (another architecture, an older CPU)."""
    return best_level(LEVELS)


def build_dir(march: str = "native") -> Path:
    """Where the extension for `march` lives: native builds hash this CPU's flags too, level builds do not."""
    h = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES))
    h.update(f"{torch.__version__}|{' '.join(_cflags(march) + _LDFLAGS)}".encode())
    # The checkout too: torch's build files name the sources by absolute path, so two checkouts of the same code
    # sharing one build directory rebuilt it (~80 s on 2 cores) each time the other one had loaded it.
    h.update(str(_SOURCES[0].resolve().parent).encode())
    if march == "native":
        h.update(" ".join(cpu_info()[1]).encode())
        return ragserve_home() / "kernels" / f"blockquant-{h.hexdigest()[:16]}"
    return ragserve_home() / "kernels" / f"prebuilt-{march}-{h.hexdigest()[:16]}"


# Levels GCC has no -march name for: a base level plus instruction-set flags.
_MARCH = {"x86-64-v4-bf16": ("-march=x86-64-v4", "-mavx512bf16")}


def _cflags(march: str) -> tuple[str, ...]:
    return ("-O3", *_MARCH.get(march, (f"-march={march}",)), "-fno-math-errno", "-fopenmp")


def _name(out: Path) -> str:
    return f"ragserve_blockquant_{out.name.split('-')[-1]}"


# A build takes a minute or two on 2 cores; a lock this much older is a dead build's.
STALE_LOCK_S = 600.0


def clear_stale_lock(out: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `out`/lock if a build left it more than max_age_s ago; True if removed.

    Why: torch's cpp_extension.load takes the lock while it builds and every other process waits for it to go
    (FileBaton, no timeout), so a build killed midway (Ctrl-C in `make install`, a test run stopped) left every
    later start of the worker waiting forever. Seen: a clean clone's `make test` stuck on an AVX2 build's lock
    left by an interrupted run until it was removed by hand."""
    lock = out / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age_s:
        return False  # a build in progress: wait for it as torch does
    log.warning("removing %s: left by a build %.0f s ago that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def build(march: str = "native") -> ModuleType:
    """Compile (or find up to date) the extension for `march` and load it; raises when it cannot be built."""
    from torch.utils import cpp_extension

    out = build_dir(march)
    out.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(out)
    return cpp_extension.load(name=_name(out), sources=_cpp_sources(), extra_cflags=list(_cflags(march)),
                              extra_ldflags=list(_LDFLAGS), build_directory=str(out), verbose=False)


def compile_only(march: str) -> Path:
    """Compile (or find up to date) the extension for `march` without loading it: the container images prebuild
    levels their build machine may not run, and importing the module runs code built for that level (pybind11's
    initialisation, compiled with -march=sapphirerapids, raised SIGILL on an AVX2-only CI host)."""
    # torch has no public build-without-import; this is load()'s own build step (torch pinned in pyproject.toml).
    from torch.utils import cpp_extension

    out = build_dir(march)
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension._write_ninja_file_and_build_library(
        name=_name(out), sources=_cpp_sources(), extra_cflags=list(_cflags(march)), extra_cuda_cflags=[],
        extra_sycl_cflags=[], extra_ldflags=list(_LDFLAGS), extra_include_paths=[], build_directory=str(out),
        verbose=False, with_cuda=False, with_sycl=False)
    return out / f"{_name(out)}.so"


def _cpp_sources() -> list[str]:
    return [str(p) for p in _SOURCES if p.suffix == ".cpp"]


_level_override = ""  # load_level's choice


def load_level(level: str) -> None:
    """Make kernel() load the variant for `level` (one of LEVELS; built here when missing) instead of the best one
    for this CPU: a machine of that level's kernels, run on this one (benchmarks, tests). Call before kernel()."""
    global _level_override
    if level not in LEVELS:
        raise ValueError(f"unknown x86-64 level {level!r}; one of {', '.join(LEVELS)}")
    if kernel.cache_info().currsize:
        raise RuntimeError("the CPU kernels are already loaded in this process")
    build(level)
    _level_override = level


def _load_prebuilt() -> ModuleType | None:
    level = _level_override or cpu_level()
    if not level:
        return None
    out = build_dir(level)
    so = out / f"{_name(out)}.so"
    if not so.is_file():
        return None
    spec = importlib.util.spec_from_file_location(_name(out), so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def kernel() -> ModuleType | None:
    """The compiled module (q4_1_linear, q8_0_linear, f32_linear, the dequantizers, LeanForward, isa): a prebuilt
    variant for this CPU's level when one is installed (container images), else built here for this CPU; None when
    neither works (no compiler, no ninja, a failed build): the reason is logged once."""
    if _level_override:
        return _load_prebuilt()  # load_level built it; a failure here is the caller's to see
    try:
        module = _load_prebuilt()
        if module is not None:
            return module
    except (OSError, ImportError) as e:
        log.warning("prebuilt CPU kernels do not load (%s); building them here", e)
    try:
        return build("native")
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:
        log.warning("CPU kernels unavailable (%s): q4_1 runs on dequantized fp32 weights and the lean forward runs "
                    "its ops from Python", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description="Compile the CPU kernels (block-quantized linears, fused lean forward) "
                                 "into $RAGSERVE_HOME/kernels and print the instruction set they use.")
    levels = prebuild_levels(ap, LEVELS)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for level in levels:
        if best_level((level,)):
            print(f"CPU kernels for {level}: {build(level).isa()} ({build_dir(level)})")
        else:
            print(f"CPU kernels for {level}: built, not loaded (this CPU lacks it) ({compile_only(level)})")
    if not levels:
        k = kernel()
        print(f"CPU kernels: {k.isa() if k is not None else 'unavailable'} ({k.__file__ if k is not None else ''})")


if __name__ == "__main__":
    main()
