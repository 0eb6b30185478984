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


def test_prebuild_of_a_level_this_cpu_lacks_compiles_without_loading(monkeypatch, capsys):
    """The image build prebuilds every level on whatever CPU builds it: loading a level that CPU lacks ran
    AVX-512 code on an AVX2-only CI host (SIGILL, exit 132); the build must only compile it."""
    from torch.utils import cpp_extension

    def never(*a, **k):
        raise AssertionError("a level this CPU lacks was loaded")

    monkeypatch.setattr(q4_kernel, "best_level", lambda levels: "")  # as if this CPU ran none of them
    monkeypatch.setattr(cpp_extension, "_import_module_from_library", never)
    monkeypatch.setattr(q4_kernel.importlib.util, "spec_from_file_location", never)
    monkeypatch.setattr(sys, "argv", ["q4_kernel", "--prebuild", LEVEL])
    q4_kernel.main()
    out = capsys.readouterr().out
    assert f"CPU kernels for {LEVEL}: built, not loaded" in out, out
    assert (q4_kernel.build_dir(LEVEL) / f"{q4_kernel._name(q4_kernel.build_dir(LEVEL))}.so").is_file()
