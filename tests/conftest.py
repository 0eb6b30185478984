"""Fixtures shared across test packages."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ragcore.model_files import default_model_dir, is_model_dir
from ragcore.process import offline_process
from retrieval_service.knowledge import sparse

# A run that is over ends even when a test left a thread or a child behind (tests/exit_watchdog.py).
pytest_plugins = ["tests.exit_watchdog"]

# A test session is a process main: the settings each service's main makes (ragcore/process.py).
offline_process()
sparse.prepare_process()

# The CPU kernels of a lower x86-64 level than this CPU's (test_portable_kernels runs the fused-forward tests on the
# AVX2 build of an AVX-512 machine), or the best one for this CPU when unset.
KERNEL_LEVEL = os.environ.get("RAGSERVE_TEST_KERNEL_LEVEL", "")
if KERNEL_LEVEL:
    from generation_service.model.kernels import build as q4_kernel

    q4_kernel.load_level(KERNEL_LEVEL)


def real_model(dtype: str, forward: str = "auto"):
    """The real default model on CPU (the lean forward unless forward="hf"); skips the test when it has not been
    prepared (`make model`)."""
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    from generation_service.model.target import load_model

    return load_model("", dtype=dtype, device="cpu", forward=forward)


@pytest.fixture(scope="session")
def tm():
    """bf16, the serving dtype (tests/integration and tests/crest override it with fp32)."""
    return real_model("bf16")


@pytest.fixture(scope="session")
def calibrated_home(tmp_path_factory):
    """(RAGSERVE_HOME, Choice): a home holding this machine's calibration, measured once per session as a worker
    with default flags measures it (every candidate, reps=1: ~50-80 s on 2 cores), of the model prepared in the
    user's home (default_model_dir() before the home moves: pass that path on). Tests that change the cache work on
    a copy."""
    if not is_model_dir(default_model_dir()):
        pytest.skip(f"default model not prepared at {default_model_dir()} (make model)")
    from generation_service.engine.calibrate import calibrated_model
    from generation_service.engine.model_thread import ModelThread

    model = str(default_model_dir())  # the prepared model, not one converted again into the new home
    home = tmp_path_factory.mktemp("calibrated-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAGSERVE_HOME", str(home))
    mt = ModelThread("test-calibration")
    try:
        _, choice = mt.call(calibrated_model, model, "cpu", "auto", 0, reps=1)
    finally:
        mt.stop(wait=True)
        mp.undo()
    return Path(home), choice


def pytest_collection_finish(session):
    # The AVX2 rerun of the fused-forward tests goes on beside the suite from here (tests/generation/avx2_rerun.py),
    # once the items left after -m/--deselect are known. An xdist worker starts it only when it runs the test.
    from tests.generation import avx2_rerun

    if "PYTEST_XDIST_WORKER" not in os.environ:
        avx2_rerun.start_if_collected([item.nodeid for item in session.items])


def pytest_sessionfinish(session, exitstatus):
    from tests.generation import avx2_rerun

    avx2_rerun.stop()
