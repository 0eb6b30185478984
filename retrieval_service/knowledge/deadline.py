"""The deadline of the KB call running on this thread, for backends that can hand it on (PostgreSQL's
statement_timeout). The servicer sets it around the work of one call; code outside a call sees None.

    with call_deadline(context.time_remaining()):    # seconds left, None = no deadline
        kb.search(...)                                # PgBackend reads remaining_s()
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

_deadline: ContextVar[float | None] = ContextVar("kb_call_deadline", default=None)  # time.monotonic() value


@contextmanager
def call_deadline(remaining_s: float | None) -> Iterator[None]:
    token = _deadline.set(None if remaining_s is None else time.monotonic() + remaining_s)
    try:
        yield
    finally:
        _deadline.reset(token)


def remaining_s() -> float | None:
    """Seconds until the current call's deadline (<= 0: passed), None without one."""
    d = _deadline.get()
    return None if d is None else d - time.monotonic()
