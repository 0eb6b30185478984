"""tests/exit_watchdog.py: a finished run ends even when a test left a blocked non-daemon thread behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LEAVES_A_THREAD = '''
import threading

def blocked_forever():
    threading.Event().wait()

def test_leaves_a_thread():
    threading.Thread(target=blocked_forever).start()
    assert {ok}
'''

CLEAN = '''
def test_clean():
    assert {ok}
'''


@pytest.mark.parametrize("name, body, passes, stuck", [
    ("stuck after a pass: ends with 0, names the thread", LEAVES_A_THREAD, True, True),
    ("stuck after a failure: ends with 1", LEAVES_A_THREAD, False, True),
    ("clean: exits at once, says nothing", CLEAN, True, False),
])
def test_a_finished_run_ends(tmp_path, name, body, passes, stuck):
    (tmp_path / "test_case.py").write_text(body.format(ok=passes))
    env = dict(os.environ, RAGSERVE_TEST_EXIT_GRACE_S="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.exit_watchdog",
         "--rootdir", str(tmp_path), str(tmp_path / "test_case.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == (0 if passes else 1), proc.stdout + proc.stderr
    if stuck:
        assert "exit-watchdog" in proc.stderr and "blocked_forever" in proc.stderr, proc.stderr
    else:  # exited within the grace period: the watchdog never spoke
        assert "exit-watchdog" not in proc.stderr
