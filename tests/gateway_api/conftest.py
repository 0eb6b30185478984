"""A real worker (the real model, fp32: greedy output is exact) in-process on a free loopback port and gateways in
front of it on their own threads. Session-scoped: the model loads once for every gateway test."""

from __future__ import annotations

import time

import httpx2 as httpx
import openai
import pytest

from gateway.config import GatewayConfig
from gateway.server import RunningGateway, start_in_thread
from generation_service.config import GenerationConfig
from tests.conftest import real_model


@pytest.fixture(scope="session")
def tm():
    return real_model("fp32")


def start_worker(tm, **overrides):
    """A worker without retrieval (drafts from the prompt: pld; rest degrades to AR) -> (RunningServer, servicer)."""
    from generation_service.server import build_server

    cfg = GenerationConfig(port=0, retrieval="", kb_target="", dtype="fp32",
                           **{"acceptance_state": "off", "default_decoding": "pld", **overrides})
    return build_server(cfg, tm=tm)


def wait_ready(url: str, serving: int = 1, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(url + "/ready")
        if r.status_code == 200 and r.json()["workers_serving"] >= serving:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{url}: fewer than {serving} workers SERVING after {timeout_s} s")


def start_gateway(workers: str, wait: int | None = 1, **overrides) -> RunningGateway:
    gw = start_in_thread(GatewayConfig(port=0, workers=workers, **overrides))
    if wait:
        wait_ready(gw.url, wait)
    return gw


@pytest.fixture(scope="session")
def _worker(tm):
    running, servicer = start_worker(tm)
    yield running, servicer
    running.stop(0)
    servicer.worker.stop()


@pytest.fixture(scope="session")
def worker(_worker):
    return _worker[0]


@pytest.fixture(scope="session")
def worker_servicer(_worker):
    return _worker[1]


@pytest.fixture(scope="session")
def gateway(worker):
    gw = start_gateway(worker.address)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def model_id(gateway) -> str:
    return httpx.get(gateway.url + "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient(gateway):
    return openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
