"""Smoke tests run benches in the test process, and a bench's main sets torch's thread count for the whole process
(--threads, the calibrated choice): this gives the next test in the worker its count back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int = 0) -> Iterator[None]:
    """Run the block with n torch threads (0 = leave the count to the block), then restore the count before it.

    One thread is what a test asks for when it computes beside the suite's other worker on two cores: oversubscribed
    torch threads spin-wait for each other."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
