"""A generation worker in the test process, for the smoke tests that point a bench at a running worker."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from generation_service.config import GenerationConfig
from tests.conftest import real_model


@contextlib.contextmanager
def in_process_worker(**config) -> Iterator[str]:
    """The address of a worker on a free loopback port serving the real model in fp32, without a retrieval service
    or acceptance state (config overrides GenerationConfig fields); stopped when the block ends."""
    from generation_service.server import build_server

    cfg = GenerationConfig(**{"port": 0, "retrieval": "", "kb_target": "", "dtype": "fp32",
                              "acceptance_state": "off", **config})
    running, servicer = build_server(cfg, tm=real_model("fp32"))
    try:
        yield running.address
    finally:
        running.stop(0)
        servicer.worker.stop()
