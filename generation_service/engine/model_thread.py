"""The model thread: one long-lived thread that runs every forward pass of the process.

libgomp keeps one worker pool per thread that ever ran a parallel region, and once two such pools exist on a
2-core machine it stops spinning between regions (its "throttled" mode), so every pass pays thread wake-ups. Loading,
calibration (engine/calibrate.py), warm-up and decoding (engine/scheduler.py) therefore all run on this one thread.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class ModelThread:
    """One long-lived thread that runs every forward pass of the process: loading, calibration, warm-up, decoding.

    Why one thread: see the module docstring (libgomp's throttled mode once two threads own worker pools).
        mt = ModelThread()
        tm, choice = mt.call(calibrated_model, "", "auto", "auto", 0)   # runs on the model thread, waits
        mt.submit(loop)                                                  # long-running work on the same thread
    """

    def __init__(self, name: str = "model"):
        self._tasks: "queue.Queue[tuple[Callable, tuple, dict, Future] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., T], *args, **kwargs) -> "Future[T]":
        fut: Future = Future()
        self._tasks.put((fn, args, kwargs, fut))
        return fut

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        return self.submit(fn, *args, **kwargs).result()

    def stop(self, wait: bool = False, timeout_s: float | None = None) -> None:
        """No more tasks; the thread ends after the ones queued. wait: join it, for up to timeout_s (not from
        the thread itself)."""
        self._tasks.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, args, kwargs, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)
