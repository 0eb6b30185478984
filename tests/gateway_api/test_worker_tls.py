"""The gateway speaks TLS and a bearer token to its workers, as the worker does to retrieval: gateways started as
processes with their command-line flags (--worker-tls-ca, --worker-auth-token-file) in front of a worker that
requires both. With them a chat completion comes back; without the token the client gets OpenAI's error JSON at
once (not a hang) and the gateway is not ready, its log saying why: health needs no token, so before, the worker
looked SERVING while every request failed; without the CA the worker is never ready (its TLS port does not speak
plaintext)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.gateway_api.conftest import start_worker
from tests.tls import certs, needs_openssl  # noqa: F401  (pytest fixture)
from tools.launcher import free_port

pytestmark = [pytest.mark.model, needs_openssl]

TOKEN = "gateway-to-worker-token"
MSG = [{"role": "user", "content": "Say hello."}]
START_S = 60.0


@pytest.fixture(scope="module")
def tls_worker(tm, certs):
    running, servicer = start_worker(tm, auth_token=TOKEN, tls_cert=str(certs["cert"]), tls_key=str(certs["key"]))
    yield running
    running.stop(0)
    servicer.worker.stop()


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("token") / "token"
    p.write_text(TOKEN + "\n")  # a trailing newline as `echo` writes it
    return str(p)


@contextlib.contextmanager
def gateway_process(worker: str, *flags: str, log: Path) -> Iterator[str]:
    """`python -m gateway.server` in front of `worker` -> its URL once it answers /health; stopped after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.server", "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", worker, "--log-level", "warning", *flags],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"gateway not up in {START_S} s: {log.read_text()}"
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving_workers(url: str, timeout_s: float) -> int:
    """Workers the gateway's /ready reports SERVING once one is (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = httpx.get(url + "/ready", timeout=5).json()["workers_serving"]
        if n or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def chat(url: str) -> httpx.Response:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": model, "messages": MSG, "max_tokens": 4, "temperature": 0})


def test_gateway_reaches_a_tls_token_worker(tls_worker, certs, token_file, tmp_path):
    with gateway_process(tls_worker.address, "--worker-tls-ca", str(certs["ca"]), "--worker-auth-token-file",
                         token_file, log=tmp_path / "gateway.log") as url:
        assert serving_workers(url, START_S) == 1  # the health watch came over TLS
        r = chat(url)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 4


# (scenario, flags beyond the worker's address, what the gateway's log must name)
WITHOUT = [
    # Health needs no token, so the watch says SERVING; GetInfo does (Not routable, then every request refused).
    ("TLS but no token", ("--worker-tls-ca", "{ca}"), "GetInfo UNAUTHENTICATED"),
    ("neither TLS nor token", (), "UNAVAILABLE"),  # plaintext against a TLS port: no handshake, no health
]


@pytest.mark.parametrize("scenario,flags,logged", WITHOUT, ids=[w[0] for w in WITHOUT])
def test_gateway_without_the_workers_credentials_answers_an_error(tls_worker, certs, tmp_path, scenario, flags,
                                                                  logged):
    log = tmp_path / "gateway.log"
    flags = tuple(f.format(ca=certs["ca"]) for f in flags)
    with gateway_process(tls_worker.address, *flags, log=log) as url:
        deadline = time.monotonic() + START_S
        while logged not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = httpx.get(url + "/ready", timeout=5)
        t = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "any", "messages": MSG, "max_tokens": 4})
        took = time.monotonic() - t
    assert logged in log.read_text(), log.read_text()  # the operator reads why
    assert ready.status_code == 503 and ready.json()["workers_serving"] == 0, ready.text  # Not ready
    assert r.status_code == 503, r.text  # Not 200, and not a hang until the client's timeout
    assert r.json()["error"]["message"], r.text
    assert took < 30, took  # answered well before the client's 60 s timeout
