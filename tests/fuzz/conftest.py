"""Servers under fuzz: retrieval over the small stdlib datastore (online learning on, small batch limit), the
generation worker with tight limits (every request that passes validation is cheap: <= 4 new tokens, <= 256
prompt tokens), and a tiny knowledge base (exact dense + BM25) behind the KnowledgeService."""

from __future__ import annotations

import grpc
import pytest

from generation_service.config import GenerationConfig
from retrieval_service.config import RetrievalConfig
from tests.integration.conftest import datastore, tm, tokenizer  # noqa: F401  (pytest fixtures)

GEN_LIMITS = dict(limit_prompt_tokens=256, limit_prompt_chars=4096, limit_max_new_tokens=4, default_max_new_tokens=2,
                  limit_stop_sequences=4, max_draft_budget=64, draft_budget=16, queue_size=64, workers=8,
                  max_message_bytes=1 << 20, limit_messages=16)


class Raw:
    """Generic calls with raw request bytes (no client-side serialization)."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address)

    def unary(self, method: str, data: bytes, timeout: float = 60.0) -> tuple[grpc.StatusCode, str, bytes]:
        call = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", call(data, timeout=timeout)
        except grpc.RpcError as e:
            return e.code(), e.details() or "", b""

    def stream(self, method: str, data: bytes, timeout: float = 60.0) -> tuple[grpc.StatusCode, str, list[bytes]]:
        call = self.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        try:
            return grpc.StatusCode.OK, "", list(call(data, timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), e.details() or "", []


@pytest.fixture(scope="session")
def fuzz_retrieval(datastore):
    from retrieval_service.server import build_server

    cfg = RetrievalConfig(port=0, workers=4, learn=True, limit_batch=16, limit_context_tokens=4096,
                          max_message_bytes=1 << 20)
    running = build_server(cfg, datastore=datastore)
    raw = Raw(running.address)
    yield raw
    raw.channel.close()
    running.stop(0)


@pytest.fixture(scope="session")
def fuzz_generation(tm, fuzz_retrieval):
    from generation_service.server import build_server

    cfg = GenerationConfig(port=0, retrieval=fuzz_retrieval.address, dtype="fp32", acceptance_state="off",
                           **GEN_LIMITS)
    running, servicer = build_server(cfg, tm=tm)
    raw = Raw(running.address)
    yield raw
    raw.channel.close()
    running.stop(0)
    servicer.worker.stop()


@pytest.fixture(scope="session")
def fuzz_knowledge(tmp_path_factory):
    from ragcore.encoder import Encoder
    from ragcore.grpc_shell import start_server
    from retrieval_service.knowledge.build import build_kb
    from retrieval_service.knowledge.kb import KnowledgeBase
    from retrieval_service.knowledge.service import KnowledgeServicer
    from tests.knowledge.conftest import tiny_corpus

    encoder = Encoder(threads=1, cache_size=64)
    out = tmp_path_factory.mktemp("fuzz_kb")
    build_kb(out, tiny_corpus()[:12], retrievers=("edr", "sr"), corpus={"source": "fuzz"}, encoder=encoder,
             progress=False)
    cfg = RetrievalConfig(limit_batch=8, kb_limit_k=50, kb_limit_ids=32, kb_limit_query_chars=2000, kb_warmup_s=0.5,
                          kb_limit_results=200)
    kb = KnowledgeBase.open(out, cfg, encoder=encoder)
    servicer = KnowledgeServicer(kb, cfg)
    running = start_server(servicer.add_to_server, host="127.0.0.1", port=0, workers=4, max_concurrent_rpcs=None,
                           max_message_bytes=1 << 20)
    running.set_serving(True)
    raw = Raw(running.address)
    yield raw
    raw.channel.close()
    running.stop(0)
    kb.close()
