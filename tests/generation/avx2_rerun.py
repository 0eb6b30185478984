"""The fused-forward tests on the AVX2 build (test_portable_kernels), run beside the rest of the suite.

Why: on 2 cores that rerun is the suite's longest item (150-200 s on Sapphire Rapids, most of it model passes),
while pytest keeps ~1.1-1.4 cores busy on average (service start-ups, RPC waits, sleeps). Started when the test is
collected, at nice 19, it takes the idle time and yields the cores to every other test whenever they want them
(engine/threads.py's IdleMeter counts niced time as spare, so the adaptive-threads tests see it as idle); the test
then only waits for what is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from generation_service.model.kernels import build as q4_kernel
from ragcore.model_files import default_model_dir, is_model_dir

ROOT = Path(__file__).resolve().parents[2]
LEVEL = "x86-64-v3"
TEST_NODE = "tests/generation/test_portable_kernels.py::test_fused_forward_tests_pass_on_the_avx2_build"
NICE = 19
TIMEOUT_S = 900.0


def skip_reason() -> str | None:
    """Why the rerun does not apply here (None: it does)."""
    if q4_kernel.cpu_level() in ("", LEVEL):
        return f"this CPU's best level is {q4_kernel.cpu_level() or 'none'}: the other tests run that build"
    if not is_model_dir(default_model_dir()):
        return "default model not prepared (make model)"
    return None


def _lower_priority() -> None:
    os.nice(NICE)


class Rerun:
    """One pytest process over test_lean_fused.py with RAGSERVE_TEST_KERNEL_LEVEL=x86-64-v3 (it builds that
    level's kernels first when they are missing: tests/conftest.py)."""

    def __init__(self) -> None:
        self._log = tempfile.TemporaryFile(mode="w+", prefix="avx2-rerun-")
        env = dict(os.environ, RAGSERVE_TEST_KERNEL_LEVEL=LEVEL)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/generation/test_lean_fused.py"],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True, preexec_fn=_lower_priority)

    def result(self, timeout_s: float = TIMEOUT_S) -> tuple[int, str]:
        """(exit code, output): waits for the run, killing it past timeout_s (then exit code -9)."""
        try:
            code = self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            code = self._proc.wait()
        self._log.seek(0)
        return code, self._log.read()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


_run: Rerun | None = None


def start_if_collected(nodeids: list[str]) -> None:
    """At collection: start the rerun when its test is among the items and applies on this machine."""
    global _run
    if _run is None and TEST_NODE in nodeids and skip_reason() is None:
        _run = Rerun()


def take() -> Rerun:
    """The rerun started at collection, or one started now (the test run alone, or collected another way)."""
    global _run
    run, _run = _run or Rerun(), None
    return run


def stop() -> None:
    """At the end of the session: a rerun nobody waited for (its test deselected or failed early) is killed."""
    global _run
    if _run is not None:
        _run.stop()
        _run = None
