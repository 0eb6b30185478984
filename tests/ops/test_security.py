"""Bearer token and TLS on both services; the worker's retrieval client sends the token and speaks TLS when
configured; health stays open for probes."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from generation_service.client import GenerationClient
from generation_service.drafting.retrieval_client import RetrievalClient
from proto import draft_pb2, draft_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.grpc_shell import wait_until_serving
from ragcore.security import channel_credentials
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server as build_retrieval
from tests.integration.conftest import PROMPTS, start_generation
from tests.tls import certs, needs_openssl  # noqa: F401  (pytest fixture)

TOKEN = "s3cret-token"


class TinyDatastore:
    vocab_size = 100

    def draft(self, ctx, **kwargs) -> DraftTree:
        return DraftTree(np.array([7], np.int32), np.array([-1], np.int32))


def _draft(stub, **kw):
    return stub.Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2])), timeout=10, **kw)


@pytest.fixture()
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_text(TOKEN + "\n")  # a trailing newline as `echo` writes it
    return str(p)


CASES = [
    # (scenario, metadata, expected code)
    ("no authorization metadata", None, grpc.StatusCode.UNAUTHENTICATED),
    ("wrong token", (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED),
    ("token without the Bearer scheme", (("authorization", TOKEN),), grpc.StatusCode.UNAUTHENTICATED),
    ("right token", (("authorization", f"Bearer {TOKEN}"),), grpc.StatusCode.OK),
]


def test_bearer_token_on_retrieval(token_file):
    running = build_retrieval(RetrievalConfig(port=0, auth_token_file=token_file), datastore=TinyDatastore())
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            for scenario, metadata, want in CASES:
                try:
                    _draft(stub, metadata=metadata)
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                    assert e.details().startswith("authorization"), e.details()
                assert code == want, scenario
            # Probes need no token.
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop(0)


@needs_openssl
def test_tls_and_token_with_the_retrieval_client(certs):
    cfg = RetrievalConfig(port=0, auth_token=TOKEN, tls_cert=str(certs["cert"]), tls_key=str(certs["key"]))
    running = build_retrieval(cfg, datastore=TinyDatastore())
    creds = channel_credentials(str(certs["ca"]))
    try:
        assert wait_until_serving(running.address, timeout_s=10, credentials=creds)
        client = RetrievalClient(running.address, timeout_ms=5000, token=TOKEN, credentials=creds)
        tree = client.draft(np.array([1, 2]), draft_pb2.DraftParams())
        assert tree.tokens.tolist() == [7]
        client.close()
        with grpc.insecure_channel(running.address) as ch:  # plaintext against a TLS port
            with pytest.raises(grpc.RpcError) as err:
                _draft(draft_pb2_grpc.DraftServiceStub(ch), metadata=(("authorization", f"Bearer {TOKEN}"),))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop(0)


@needs_openssl
def test_mutual_tls_requires_a_client_certificate(certs):
    cfg = RetrievalConfig(port=0, tls_cert=str(certs["cert"]), tls_key=str(certs["key"]),
                          tls_client_ca=str(certs["ca"]))
    running = build_retrieval(cfg, datastore=TinyDatastore())
    try:
        without = channel_credentials(str(certs["ca"]))
        with grpc.secure_channel(running.address, without) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _draft(draft_pb2_grpc.DraftServiceStub(ch))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with_cert = channel_credentials(str(certs["ca"]), str(certs["client_cert"]), str(certs["client_key"]))
        with grpc.secure_channel(running.address, with_cert) as ch:
            assert _draft(draft_pb2_grpc.DraftServiceStub(ch)).tokens
    finally:
        running.stop(0)


def test_half_configured_tls_is_refused_at_start():
    with pytest.raises(ValueError, match="tls_cert/tls_key"):
        build_retrieval(RetrievalConfig(port=0, tls_cert="/nonexistent.pem"), datastore=TinyDatastore())


@pytest.mark.model
@needs_openssl
def test_worker_reaches_a_tls_token_retrieval_and_guards_itself(tm, datastore, certs, token_file):
    retrieval = build_retrieval(RetrievalConfig(port=0, auth_token=TOKEN, tls_cert=str(certs["cert"]),
                                                tls_key=str(certs["key"])), datastore=datastore)
    running, servicer = start_generation(tm, retrieval.address, auth_token=TOKEN, retrieval_auth_token_file=token_file,
                                         retrieval_tls_ca=str(certs["ca"]), draft_timeout_ms=2000)
    bad, bad_servicer = start_generation(tm, retrieval.address, retrieval_tls_ca=str(certs["ca"]),
                                         draft_timeout_ms=2000, retry_after_s=60)
    try:
        auth = [("authorization", f"Bearer {TOKEN}")]
        with GenerationClient(running.address, metadata=auth) as c:
            reply = c.generate(PROMPTS[0], max_new_tokens=16, decoding="rest", ignore_eos=True, timeout=120)
            ar = c.generate(PROMPTS[0], max_new_tokens=16, decoding="ar", ignore_eos=True, timeout=120)
        assert not reply.stats.degraded, reply.stats.degraded_reason  # drafts came over TLS with the token
        assert reply.stats.draft_tokens_accepted > 0
        assert list(reply.token_ids) == list(ar.token_ids)
        with GenerationClient(running.address) as c:
            for call in (c.generate, lambda *a, **k: list(c.stream(*a, **k))):
                with pytest.raises(grpc.RpcError) as err:
                    call(PROMPTS[0], max_new_tokens=2, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # A worker without the token still answers (correctly), degraded, and says why.
        with GenerationClient(bad.address) as c:
            degraded = c.generate(PROMPTS[0], max_new_tokens=16, decoding="rest", ignore_eos=True, timeout=120)
        assert list(degraded.token_ids) == list(ar.token_ids)
        assert degraded.stats.degraded and "UNAUTHENTICATED" in degraded.stats.degraded_reason
    finally:
        for r, s in ((running, servicer), (bad, bad_servicer)):
            r.stop(0)
            s.worker.stop()
        retrieval.stop(0)
