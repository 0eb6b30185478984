"""The CPU kernels as another machine runs them: the AVX2 build (x86-64-v3, what an AVX2-only EPYC loads) on this
CPU, through the fused-forward tests (fused == ops path; every tree row == the AR steps of its path, bit for bit;
the row-attention kernel the build reports). A CPU whose best level is already x86-64-v3 runs them natively."""

from __future__ import annotations

import sys

import pytest

from generation_service.model.kernels import build as q4_kernel
from tests.generation import avx2_rerun

pytestmark = pytest.mark.model

LEVEL = avx2_rerun.LEVEL


@pytest.mark.slow
def test_fused_forward_tests_pass_on_the_avx2_build():
    reason = avx2_rerun.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    run = avx2_rerun.take()  # started at collection, at nice 19 beside the other tests (avx2_rerun.py)
    try:
        code, out = run.result()
    finally:
        run.stop()
    assert code == 0, out[-6000:]
    assert " passed" in out and " skipped" not in out, out[-2000:]
    assert q4_kernel.build(LEVEL).isa() == "avx2"  # built by the run (~30 s the first time per source version)


@pytest.mark.slow
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


@pytest.mark.parametrize("lock_age_s, removed", [
    (3600.0, True),    # a build killed an hour ago: cleared, or load() would wait for it forever
    (30.0, False),     # a build in progress: Not removed, load() waits for it
    (None, False),     # no lock: nothing to do
])
def test_a_dead_builds_lock_is_cleared(tmp_path, lock_age_s, removed):
    import os
    import time

    from generation_service.model.kernels.build import clear_stale_lock

    lock = tmp_path / "lock"
    if lock_age_s is not None:
        lock.touch()
        t = time.time() - lock_age_s
        os.utime(lock, (t, t))
    assert clear_stale_lock(tmp_path) == removed
    assert lock.exists() == (lock_age_s is not None and not removed)


def test_each_checkout_builds_in_its_own_directory(tmp_path, monkeypatch):
    """torch's build files name the sources by absolute path: two checkouts of the same code sharing one build
    directory rebuilt it each time the other had loaded it. Same sources, same place -> same directory."""
    here = q4_kernel.build_dir("x86-64-v3")
    copy = tmp_path / "checkout" / "kernels"
    copy.mkdir(parents=True)
    for p in q4_kernel._SOURCES:
        (copy / p.name).write_bytes(p.read_bytes())
    assert q4_kernel.build_dir("x86-64-v3") == here  # Not a new directory per call
    monkeypatch.setattr(q4_kernel, "_SOURCES", tuple(copy / p.name for p in q4_kernel._SOURCES))
    assert q4_kernel.build_dir("x86-64-v3") != here  # Not the other checkout's directory
