"""The knowledge base inside the real retrieval server: same port as the draft service, health-gated."""

from __future__ import annotations

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import knowledge_pb2, knowledge_pb2_grpc
from retrieval_service.knowledge.service import SERVICE_NAME
from retrieval_service.server import build_server
from tests.knowledge.conftest import KNOWN


def test_search_is_served_next_to_drafts(kb, kb_config):
    running = build_server(kb_config.__class__(**{**kb_config.__dict__, "port": 0}), kb=kb)
    try:
        with grpc.insecure_channel(running.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                          timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            queries = [q for _, _, q in KNOWN]
            for retriever in ("edr", "adr", "sr"):
                reply = stub.Search(knowledge_pb2.SearchRequest(retriever=retriever, k=3, texts=queries,
                                                                with_text=True), timeout=30)
                assert len(reply.results) == len(queries)  # one batched call, one result per query
                top = [r.documents[0].title for r in reply.results]
                assert top == [t for t, _, _ in KNOWN], retriever  # Not another passage
                assert all(1 <= np.frombuffer(r.ids, "<i8").size <= 3 for r in reply.results)  # k bounds hits
    finally:
        running.stop(0)
