"""A pytest plugin that ends a finished run whose process does not exit.

A thread or child left behind by a test (a pool worker blocked in a call, a server's atexit handler waiting on a
database) can keep the interpreter from exiting after the summary is printed; CI would then wait for it until its
own time limit and report nothing useful. Once the session is over, a daemon thread gives the exit a grace period,
then prints every thread's stack and the children still alive, and ends the process with the session's status.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

# Seconds; RAGSERVE_TEST_EXIT_GRACE_S overrides it (its own test uses a short one).
DEFAULT_GRACE_S = 90.0

_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _status
    _status = int(exitstatus)


def pytest_unconfigure(config):
    grace_s = float(os.environ.get("RAGSERVE_TEST_EXIT_GRACE_S", DEFAULT_GRACE_S))
    threading.Thread(target=_end_a_stuck_exit, args=(grace_s,), name="exit-watchdog", daemon=True).start()


def _end_a_stuck_exit(grace_s: float) -> None:
    time.sleep(grace_s)
    print(f"\nexit-watchdog: the process has not exited {grace_s:.0f} s after the session ended; "
          "its threads and live children:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for child in children(os.getpid()):
        print(f"exit-watchdog: child {child}", file=sys.stderr, flush=True)
    os._exit(_status)


def children(pid: int) -> list[str]:
    """'pid command line' of each live child of pid (Linux /proc; empty elsewhere)."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = f.read().split()
        except OSError:
            continue
        for kid in kids:
            try:
                with open(f"/proc/{kid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            out.append(f"{kid} {cmdline}")
    return out
