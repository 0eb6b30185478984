"""Prometheus endpoints: gRPC counters by method and code, retrieval latency per retriever, generation token
timing and speculation counters. Metrics are per process, so tests compare before/after values."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from generation_service.client import GenerationClient
from proto import draft_pb2, draft_pb2_grpc
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.draft_tree import DraftTree
from retrieval_service.server import build_server as build_retrieval
from serving import metrics
from serving.launcher import free_port
from serving.wire import pack_tokens
from tests.integration.conftest import PROMPTS, start_generation

DRAFT = {"grpc_service": "ragserve.v1.DraftService", "grpc_method": "Draft", "grpc_type": "unary"}


def scrape(url: str | None = None) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode() if url else metrics.exposition()
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
    assert metrics.serve_http(0)() is None


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
    assert ("ragserve_generation_queue_depth", frozenset()) in after
