"""The gRPC shell both services share (ragcore/grpc_shell.py), on the real servers over loopback:

- reflection v1 and v1alpha answer a client that knows nothing but reflection;
- a draining server keeps answering health with NOT_SERVING while in-flight calls finish, refuses new ones with
  UNAVAILABLE, and only then closes its port;
- failed calls are logged in one line at a level that fits the cause, never with a traceback.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb

from generation_service.client import GenerationClient
from proto import draft_pb2, draft_pb2_grpc
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server as build_retrieval
from tests.integration.conftest import PROMPTS, start_generation


@pytest.fixture(scope="module")
def retrieval(datastore):
    running = build_retrieval(RetrievalConfig(port=0, workers=4), datastore=datastore)
    yield running
    running.stop(0)


def _reflect(address: str, version: str, request: rpb.ServerReflectionRequest) -> rpb.ServerReflectionResponse:
    """One reflection exchange with raw (de)serializers: the v1 and v1alpha messages share one wire format."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                request_serializer=rpb.ServerReflectionRequest.SerializeToString,
                                response_deserializer=rpb.ServerReflectionResponse.FromString)
        return next(iter(call(iter([request]), timeout=10)))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection(retrieval, version):
    listed = _reflect(retrieval.address, version, rpb.ServerReflectionRequest(list_services=""))
    names = {s.name for s in listed.list_services_response.service}
    assert {"ragserve.v1.DraftService", "ragserve.v1.KnowledgeService", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    for symbol, want_file in [("ragserve.v1.DraftService", "proto/draft.proto"),
                              ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto")]:
        found = _reflect(retrieval.address, version, rpb.ServerReflectionRequest(file_containing_symbol=symbol))
        assert not found.HasField("error_response"), found.error_response  # Not NOT_FOUND
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in found.file_descriptor_response.file_descriptor_proto]
        assert want_file in [f.name for f in files]
    if version == "v1":
        v1 = next(f for f in files if f.name == "grpc/reflection/v1/reflection.proto")
        assert v1.package == "grpc.reflection.v1"
        assert v1.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def _health(channel: grpc.Channel) -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as e:
        return f"error {e.code().name}"


@pytest.mark.model
def test_health_answers_not_serving_while_draining(tm, retrieval):
    running, servicer = start_generation(tm, retrieval.address)
    try:
        with GenerationClient(running.address) as c, grpc.insecure_channel(running.address) as probe:
            assert _health(probe) == "SERVING"
            stream = c.stream(PROMPTS[0], max_new_tokens=40, decoding="ar", ignore_eos=True, timeout=300)
            first = next(stream)
            stopper = threading.Thread(target=running.stop, args=(120.0,))
            stopper.start()
            seen = []
            deadline = time.monotonic() + 60
            while not seen[-3:] == ["NOT_SERVING"] * 3 and time.monotonic() < deadline:
                seen.append(_health(probe))
                time.sleep(0.02)
            # A probe sees NOT_SERVING, not "connection refused", during the drain ...
            assert seen[-3:] == ["NOT_SERVING"] * 3, seen[-10:]
            assert all(s in ("SERVING", "NOT_SERVING") for s in seen), seen
            with GenerationClient(running.address) as fresh, pytest.raises(grpc.RpcError) as err:
                fresh.generate(PROMPTS[1], max_new_tokens=2, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # ... new calls go elsewhere ...
            assert _health(probe) == "NOT_SERVING"
            rest = list(stream)  # ... and the call in flight runs to its end.
            stopper.join(60)
            assert not stopper.is_alive()
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 40
            assert rest[-1].finish_reason == "length"
            assert _health(probe).startswith("error")  # stopped: now the port is closed
    finally:
        running.stop(0)
        servicer.worker.stop()


def test_stop_without_calls_in_flight_is_prompt(datastore):
    running = build_retrieval(RetrievalConfig(port=0, workers=2), datastore=datastore)
    t0 = time.monotonic()
    running.stop(30.0)
    assert time.monotonic() - t0 < 5  # Not the whole grace period


# (scenario, call, expected code, expected log level)
def _draft(stub, **params):
    return stub.Draft(draft_pb2.DraftRequest(context=pack_tokens([1, 2, 3]),
                                             params=draft_pb2.DraftParams(**params)), timeout=10)


LOG_CASES = [
    ("bad field", lambda s: _draft(s, max_nodes=10**6), grpc.StatusCode.INVALID_ARGUMENT, logging.INFO),
    ("source the server lacks", lambda s: _draft(s, source="crest"), grpc.StatusCode.FAILED_PRECONDITION,
     logging.INFO),
    ("undecodable request", lambda s: s.Draft(draft_pb2.DraftRequest(context=b"\x01"), timeout=10),
     grpc.StatusCode.INVALID_ARGUMENT, logging.INFO),
]


@pytest.mark.parametrize("scenario,call,code,level", LOG_CASES, ids=[c[0] for c in LOG_CASES])
def test_failed_calls_are_logged_in_one_line(retrieval, caplog, scenario, call, code, level):
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(retrieval.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            call(draft_pb2_grpc.DraftServiceStub(ch))
    assert err.value.code() == code
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any("DraftService/Draft" in r.getMessage() for r in caplog.records):
        time.sleep(0.01)
    lines = [r for r in caplog.records if "DraftService/Draft" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert lines[0].levelno == level and code.name in lines[0].getMessage()
    assert not any(r.levelno >= logging.ERROR for r in caplog.records)  # Not an ERROR for a client mistake
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def _status(channel: grpc.Channel, service: str) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def test_overall_health_follows_any_service_not_serving(datastore):
    """An orchestrator reads the overall status (service ""): one service that stops serving (a corrupted
    datastore) must show there too, and the others keep their own status."""
    running = build_retrieval(RetrievalConfig(port=0, workers=2), datastore=datastore)
    draft, knowledge = "ragserve.v1.DraftService", "ragserve.v1.KnowledgeService"
    try:
        with grpc.insecure_channel(running.address) as ch:
            assert [_status(ch, s) for s in ("", draft, knowledge)] == ["SERVING"] * 3
            running.set_serving(False, [draft])
            assert [_status(ch, s) for s in ("", draft, knowledge)] == \
                ["NOT_SERVING", "NOT_SERVING", "SERVING"]  # Not SERVING overall
            running.set_serving(True, [draft])
            assert _status(ch, "") == "SERVING"  # every service serves again
    finally:
        running.stop(0)
