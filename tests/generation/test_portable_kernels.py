"""The CPU kernels as another machine runs them: the AVX2 build (x86-64-v3, what an AVX2-only EPYC loads) on this
CPU, through the fused-forward tests (fused == ops path; every tree row == the AR steps of its path, bit for bit;
the row-attention kernel the build reports). A CPU whose best level is already x86-64-v3 runs them natively."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from generation_service import q4_kernel
from ragcore.model_files import default_model_dir, is_model_dir

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
LEVEL = "x86-64-v3"


def test_fused_forward_tests_pass_on_the_avx2_build():
    if q4_kernel.cpu_level() in ("", LEVEL):
        pytest.skip(f"this CPU's best level is {q4_kernel.cpu_level() or 'none'}: the other tests run that build")
    if not is_model_dir(default_model_dir()):
        pytest.skip("default model not prepared (make model)")
    assert q4_kernel.build(LEVEL).isa() == "avx2"  # ~30 s the first time per source version
    env = dict(os.environ, RAGSERVE_TEST_KERNEL_LEVEL=LEVEL)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "tests/generation/test_lean_fused.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout, run.stdout[-2000:]
