"""The CPU kernel extension: built once per machine, loaded, or reported missing.

Two sources, one module: q4_kernel.cpp (linears straight from GGUF blocks, Q4_1 / Q8_0, and the same tiling over
dense fp32 weights) and lean_forward.cpp (LeanForward: the whole decoder pass of lean_llama.py in one call).

Built with torch's C++ extension loader (g++ and ninja) for this CPU (-march=native: AVX-512 here, AVX2 on an AVX2
box, scalar elsewhere), into $RAGSERVE_HOME/kernels/<hash of source, torch version, compiler flags, CPU flags>/,
so a second process loads the cached .so in well under a second. `make install` builds it (first build ~1 min);
without a compiler `kernel()` returns None: the q4_1 format falls back to the exactly dequantized fp32 weights
(same values, fp32 memory traffic) and the lean forward runs its ops from Python, with a warning.

    python -m generation_service.q4_kernel     # build (or find) the kernel and print the ISA it was built for
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import subprocess
from pathlib import Path
from types import ModuleType

import torch

from ragcore.machine import cpu_info
from ragcore.model_files import ragserve_home

log = logging.getLogger(__name__)

# One extension: the block-quantized linears and the fused lean forward built on them.
_SOURCES = tuple(Path(__file__).with_name(n) for n in ("q4_kernel.cpp", "lean_forward.cpp", "cpu_kernels.h"))
# -fopenmp: at::parallel_for is a header template whose `omp parallel` needs it (without, the kernel runs on one
# thread); the library then needs libgomp.so.1, which resolves to the copy torch already loaded: one thread pool.
_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def build_dir() -> Path:
    h = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES))
    h.update(f"{torch.__version__}|{' '.join(_CFLAGS + _LDFLAGS)}|{' '.join(cpu_info()[1])}".encode())
    return ragserve_home() / "kernels" / f"blockquant-{h.hexdigest()[:16]}"


@functools.lru_cache(maxsize=1)
def kernel() -> ModuleType | None:
    """The compiled module (q4_1_linear, q8_0_linear, q4_1_dequantize, q8_0_dequantize, isa), or None when it
    cannot be built here (no compiler, no ninja, a failed build); the reason is logged once."""
    from torch.utils import cpp_extension

    out = build_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name=f"ragserve_blockquant_{out.name.split('-')[-1]}", sources=[str(p) for p in _SOURCES if p.suffix == ".cpp"],
                                  extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS), build_directory=str(out), verbose=False)
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as e:
        log.warning("block-quantized kernel unavailable (%s): q4_1 runs on dequantized fp32 weights instead",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def main() -> None:
    argparse.ArgumentParser(description="Compile the block-quantized (q4_1 / q8_0) linear kernel for this CPU into "
                            "$RAGSERVE_HOME/kernels and print the instruction set it uses.").parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    k = kernel()
    print(f"block-quantized kernel: {k.isa() if k is not None else 'unavailable'} ({build_dir()})")


if __name__ == "__main__":
    main()
