"""Prometheus endpoints: gRPC counters by method and code, retrieval latency per retriever, generation token
timing and speculation counters. Metrics are per process, so tests compare before/after values."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from generation_service import metrics as generation_metrics
from generation_service.client import GenerationClient
from proto import draft_pb2, draft_pb2_grpc
from ragcore import metrics
from ragcore.draft_tree import DraftTree
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server as build_retrieval
from tests.integration.conftest import PROMPTS, start_generation
from tools.launcher import free_port

DRAFT = {"grpc_service": "ragserve.v1.DraftService", "grpc_method": "Draft", "grpc_type": "unary"}


def scrape(url: str | None = None, service: str = "generation") -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode() if url else metrics.exposition(service)
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class TinyDatastore:
    vocab_size = 100
    num_tokens, num_documents, num_shards, bytes_on_disk = 1234, 5, 1, 4096

    def draft(self, ctx, **kwargs) -> DraftTree:
        return DraftTree(np.array([7], np.int32), np.array([-1], np.int32))

    def draft_batch(self, ctxs, **kwargs):
        return [self.draft(c) for c in ctxs]


def test_retrieval_metrics_endpoint():
    port = free_port()
    running = build_retrieval(RetrievalConfig(port=0, metrics_port=port), datastore=TinyDatastore())
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = scrape(url)
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            for _ in range(3):
                stub.Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2])), timeout=10)
            stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[draft_pb2.DraftRequest(
                context=pack_tokens([1]), params=draft_pb2.DraftParams(source="merged"))] * 4), timeout=10)
            with pytest.raises(grpc.RpcError):
                stub.Draft(draft_pb2.DraftRequest(context=b""), timeout=10)
        after = scrape(url)
    finally:
        running.stop(0)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("grpc_server_started_total", **DRAFT) == 4
    assert delta("grpc_server_handled_total", grpc_code="OK", **DRAFT) == 3
    assert delta("grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **DRAFT) == 1  # Not UNKNOWN
    assert delta("grpc_server_handling_seconds_count", **DRAFT) == 4
    assert delta("ragserve_retrieval_request_seconds_count", method="Draft", retriever="datastore") == 3
    assert delta("ragserve_retrieval_request_seconds_count", method="DraftBatch", retriever="merged") == 1
    assert delta("ragserve_retrieval_batch_size_sum", method="DraftBatch") == 4
    assert value(after, "ragserve_retrieval_datastore_tokens") == 1234
    with pytest.raises(urllib.error.URLError):  # the endpoint stops with the server
        urllib.request.urlopen(url, timeout=2)


def test_metrics_port_zero_means_off():
    assert metrics.serve_http(0, "retrieval")() is None


@pytest.mark.model
def test_generation_metrics(tm, datastore):
    retrieval = build_retrieval(RetrievalConfig(port=0), datastore=datastore)
    running, servicer = start_generation(tm, retrieval.address, draft_timeout_ms=2000)
    try:
        before = scrape()
        with GenerationClient(running.address) as c:
            unary = c.generate(PROMPTS[0], max_new_tokens=20, decoding="rest", ignore_eos=True, timeout=120)
            streamed = list(c.stream(PROMPTS[1], max_new_tokens=12, decoding="rest", ignore_eos=True, timeout=120))
        after = scrape()
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    gen = {"grpc_service": "ragserve.v1.GenerationService"}
    assert delta("grpc_server_handled_total", grpc_method="Generate", grpc_type="unary", grpc_code="OK", **gen) == 1
    assert delta("grpc_server_handled_total", grpc_method="GenerateStream", grpc_type="server_stream",
                 grpc_code="OK", **gen) == 1
    assert delta("ragserve_generation_time_to_first_token_seconds_count", decoding="rest") == 2
    assert delta("ragserve_generation_tokens_total", decoding="rest") == 32
    assert delta("ragserve_generation_requests_total", decoding="rest", finish_reason="length") == 2
    final = streamed[-1].stats
    steps = unary.stats.forward_steps + final.forward_steps
    assert delta("ragserve_generation_forward_steps_total", decoding="rest") == steps
    assert delta("ragserve_generation_accepted_length_count", decoding="rest") == steps
    assert delta("ragserve_generation_accepted_length_sum", decoding="rest") == 32 - 2  # the first tokens: prefill
    assert delta("ragserve_generation_draft_tokens_accepted_total", decoding="rest") == (
        unary.stats.draft_tokens_accepted + final.draft_tokens_accepted)
    assert delta("ragserve_generation_inter_token_seconds_count", decoding="rest") == 32 - 2
    assert ("ragserve_generation_requests_waiting", frozenset()) in after
    assert ("ragserve_generation_requests_running", frozenset()) in after
    assert delta("ragserve_generation_prompt_tokens_total", decoding="rest") == (
        unary.usage.prompt_tokens + streamed[-1].usage.prompt_tokens)
    assert delta("ragserve_generation_e2e_request_seconds_count", decoding="rest") == 2
    assert delta("ragserve_generation_draft_tokens_proposed_total", decoding="rest") == (
        unary.stats.draft_tokens_proposed + final.draft_tokens_proposed)
    # The worker's own draft calls (one DraftBatch per pass), timed on its side of the wire (at most one per step).
    drafts = delta("ragserve_generation_retrieval_rpc_seconds_count", method="DraftBatch", grpc_code="OK")
    assert 1 <= drafts <= steps, drafts


def _families(text: str) -> set[str]:
    return {fam.name for fam in text_string_to_metric_families(text)}


def test_each_service_exports_only_its_own_families(datastore):
    port = free_port()
    running = build_retrieval(RetrievalConfig(port=0, metrics_port=port), datastore=datastore)
    try:
        with grpc.insecure_channel(running.address) as ch:
            draft_pb2_grpc.DraftServiceStub(ch).Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2])), timeout=10)
        generation_metrics.GenerationObserver("ar", 0.0)  # the generation families exist in this (test) process too ...
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        running.stop(0)
    names = _families(text)
    assert "ragserve_retrieval_request_seconds" in names and "grpc_server_handled" in names
    assert not [n for n in names if n.startswith("ragserve_generation")]  # ... but not on retrieval's endpoint
    assert "_created" not in text  # Not a start timestamp per series
    gen = _families(metrics.exposition("generation"))
    assert "ragserve_generation_tokens" in gen and not [n for n in gen if n.startswith("ragserve_retrieval")]


@pytest.mark.model
def test_deadline_exceeded_is_counted_as_such(tm, datastore):
    retrieval = build_retrieval(RetrievalConfig(port=0), datastore=datastore)
    running, servicer = start_generation(tm, retrieval.address)
    labels = {"grpc_service": "ragserve.v1.GenerationService"}
    try:
        before = scrape()
        with GenerationClient(running.address) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.generate(PROMPTS[0], max_new_tokens=2000, decoding="ar", ignore_eos=True, timeout=1.0)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            with pytest.raises(grpc.RpcError) as err:
                list(c.stream(PROMPTS[0], max_new_tokens=2000, decoding="ar", ignore_eos=True, timeout=1.0))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            c.generate(PROMPTS[1], max_new_tokens=2, decoding="ar", timeout=120)  # the worker stopped both
        deadline = time.monotonic() + 30  # the server notices when its handler ends
        while time.monotonic() < deadline:
            after = scrape()
            got = {(m, code): value(after, "grpc_server_handled_total", grpc_method=m, grpc_type=t, grpc_code=code,
                                    **labels) - value(before, "grpc_server_handled_total", grpc_method=m,
                                                      grpc_type=t, grpc_code=code, **labels)
                   for m, t in (("Generate", "unary"), ("GenerateStream", "server_stream"))
                   for code in ("OK", "DEADLINE_EXCEEDED")}
            if got[("GenerateStream", "DEADLINE_EXCEEDED")] and got[("Generate", "DEADLINE_EXCEEDED")]:
                break
            time.sleep(0.1)
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)
    # Not grpc_code="OK": the client got DEADLINE_EXCEEDED.
    all_codes = {k: v - value(before, k[0], **dict(k[1])) for k, v in after.items()
                 if k[0] == "grpc_server_handled_total" and dict(k[1]).get("grpc_service") == labels["grpc_service"]}
    assert got == {("Generate", "OK"): 1, ("Generate", "DEADLINE_EXCEEDED"): 1,
                   ("GenerateStream", "OK"): 0, ("GenerateStream", "DEADLINE_EXCEEDED"): 1}, all_codes


def test_reply_over_the_size_limit_is_counted_resource_exhausted(datastore):
    # A server whose message limit is below its Info reply: the send fails, the client gets RESOURCE_EXHAUSTED.
    running = build_retrieval(RetrievalConfig(port=0, max_message_bytes=64), datastore=datastore)
    info = {"grpc_service": "ragserve.v1.DraftService", "grpc_method": "Info", "grpc_type": "unary"}
    try:
        before = scrape(service="retrieval")
        with grpc.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                draft_pb2_grpc.DraftServiceStub(ch).Info(draft_pb2.DatastoreInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        after = scrape(service="retrieval")
    finally:
        running.stop(0)
    assert value(after, "grpc_server_handled_total", grpc_code="RESOURCE_EXHAUSTED", **info) - value(
        before, "grpc_server_handled_total", grpc_code="RESOURCE_EXHAUSTED", **info) == 1
    assert value(after, "grpc_server_handled_total", grpc_code="OK", **info) == value(
        before, "grpc_server_handled_total", grpc_code="OK", **info)  # Not OK


def _listening_addresses(port: int) -> set[str]:
    import psutil

    return {c.laddr.ip for c in psutil.net_connections("inet") if c.status == "LISTEN" and c.laddr.port == port}


def test_metrics_endpoint_binds_loopback_by_default():
    assert RetrievalConfig().metrics_host == "127.0.0.1"
    from generation_service.config import GenerationConfig

    assert GenerationConfig().metrics_host == "127.0.0.1"
    port = free_port()
    close = metrics.serve_config(RetrievalConfig(host="0.0.0.0", metrics_port=port), "retrieval")
    try:
        assert _listening_addresses(port) == {"127.0.0.1"}  # Not 0.0.0.0 although gRPC listens there
    finally:
        close()


def test_metrics_basic_auth_and_tls(tmp_path):
    import base64
    import ssl

    from ragcore.security import make_certs

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"])
    secret = tmp_path / "metrics.auth"
    secret.write_text("prom:s3cret\n")
    port = free_port()
    close = metrics.serve_http(port, "retrieval", tls_cert=str(certs["cert"]), tls_key=str(certs["key"]),
                               auth_file=str(secret))
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    url = f"https://127.0.0.1:{port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, context=ctx, timeout=10)
        assert err.value.code == 401
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(url, headers={
                "Authorization": "Basic " + base64.b64encode(b"prom:wrong").decode()}), context=ctx, timeout=10)
        assert err.value.code == 401
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={
            "Authorization": "Basic " + base64.b64encode(b"prom:s3cret").decode()}), context=ctx, timeout=10)
        assert "grpc_server_handled_total" in ok.read().decode()
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)  # Not plain HTTP
    finally:
        close()


def test_an_idle_client_does_not_block_https_metrics_and_only_metrics_is_served(tmp_path):
    """A TCP client that connects and sends nothing (no TLS handshake) holds its own connection only: scrapes go
    on. Any path but /metrics is 404 (Not the metrics under every URL). A client CA makes client certs required."""
    import socket
    import ssl

    from ragcore.security import make_certs

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"])
    port = free_port()
    close = metrics.serve_http(port, "retrieval", tls_cert=str(certs["cert"]), tls_key=str(certs["key"]),
                               tls_client_ca=str(certs["ca"]))
    ctx = ssl.create_default_context(cafile=str(certs["ca"]))
    ctx.load_cert_chain(str(certs["client_cert"]), str(certs["client_key"]))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
    try:
        time.sleep(0.2)  # the server accepted them and waits for their handshakes
        body = urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=5).read().decode()
        assert "grpc_server_handled_total" in body  # Not a timeout behind the idle clients
        for path in ("/", "/other", "/metrics/x"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(f"https://127.0.0.1:{port}{path}", context=ctx, timeout=5)
            assert err.value.code == 404, path
        no_cert = ssl.create_default_context(cafile=str(certs["ca"]))
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=no_cert, timeout=5).read()
    finally:
        for s in idle:
            s.close()
        close()
