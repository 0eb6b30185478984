"""Bad requests get INVALID_ARGUMENT with a message naming the field; nothing reaches the model."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from generation_service.client import build_request
from proto import draft_pb2, generation_pb2_grpc
from serving.wire import pack_tokens

pytestmark = pytest.mark.model

GENERATE_CASES = [
    # (scenario, request kwargs, field the message must name)
    ("no prompt at all", dict(), "prompt"),
    ("prompt and messages both", dict(prompt="x", messages=[{"role": "user", "content": "y"}]), "prompt"),
    ("unknown chat role", dict(messages=[{"role": "robot", "content": "y"}]), "messages[0].role"),
    ("token id out of vocabulary", dict(prompt_tokens=[1, 2, 10**6]), "prompt_tokens"),
    ("max_new_tokens too large", dict(prompt="x", max_new_tokens=10**6), "max_new_tokens"),
    ("NaN temperature", dict(prompt="x", temperature=math.nan), "temperature"),
    ("negative temperature", dict(prompt="x", temperature=-1.0), "temperature"),
    ("top_p zero", dict(prompt="x", top_p=0.0), "top_p"),
    ("top_k beyond vocabulary", dict(prompt="x", top_k=10**9), "top_k"),
    ("empty stop string", dict(prompt="x", stop=[""]), "stop[0]"),
    ("too many stop strings", dict(prompt="x", stop=["a"] * 100), "stop"),
    ("unknown decoding mode", dict(prompt="x", decoding="medusa"), "decoding"),
    ("draft budget too large", dict(prompt="x", draft_budget=10**6), "draft_budget"),
]


@pytest.mark.parametrize("scenario,kwargs,field", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_rejects_bad_fields(generation, scenario, kwargs, field):
    with grpc.insecure_channel(generation.address) as ch:
        stub = generation_pb2_grpc.GenerationServiceStub(ch)
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(build_request(**kwargs), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, scenario  # Not INTERNAL / UNKNOWN
            assert err.value.details().startswith(field), err.value.details()


DRAFT_CASES = [
    ("empty context", draft_pb2.DraftRequest(context=b""), "context"),
    ("bytes not whole uint32s", draft_pb2.DraftRequest(context=b"\x01\x02\x03"), "context"),
    ("token id out of vocabulary", draft_pb2.DraftRequest(context=pack_tokens([5, 60000])), "context"),
    ("max_nodes too large", draft_pb2.DraftRequest(context=pack_tokens([5]),
                                                   params=draft_pb2.DraftParams(max_nodes=10**6)), "params.max_nodes"),
    ("min_suffix above max_suffix", draft_pb2.DraftRequest(context=pack_tokens([5]), params=draft_pb2.DraftParams(
        max_suffix=4, min_suffix=8)), "params.min_suffix"),
    ("unknown source", draft_pb2.DraftRequest(context=pack_tokens([5]),
                                              params=draft_pb2.DraftParams(source="oracle")), "params.source"),
]


@pytest.mark.parametrize("scenario,request_,field", DRAFT_CASES, ids=[c[0] for c in DRAFT_CASES])
def test_draft_rejects_bad_fields(draft_stub, scenario, request_, field):
    with pytest.raises(grpc.RpcError) as err:
        draft_stub.Draft(request_, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, scenario
    assert err.value.details().startswith(field), err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        draft_stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[draft_pb2.DraftRequest(context=pack_tokens([1, 2])),
                                                                    request_]), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests[1]." + field), err.value.details()


def test_empty_draft_batch_is_rejected(draft_stub):
    with pytest.raises(grpc.RpcError) as err:
        draft_stub.DraftBatch(draft_pb2.DraftBatchRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("requests")


def test_draft_rpc_returns_the_in_process_tree(draft_stub, datastore, tokenizer):
    ctx = np.asarray(tokenizer("import json\n\n\ndef load(path):\n    with open(path")["input_ids"], np.int32)
    want = datastore.draft(ctx, max_nodes=32, source="datastore")
    reply = draft_stub.Draft(draft_pb2.DraftRequest(context=pack_tokens(ctx), params=draft_pb2.DraftParams(
        max_nodes=32)), timeout=10)
    assert len(want) > 0, "scenario needs a context the datastore knows"
    assert np.frombuffer(reply.tokens, "<u4").tolist() == want.tokens.tolist()
    assert np.frombuffer(reply.parents, "<i4").tolist() == want.parents.tolist()
    assert reply.matched_suffix == want.matched_suffix > 0
    batch = draft_stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[
        draft_pb2.DraftRequest(context=pack_tokens(ctx), params=draft_pb2.DraftParams(max_nodes=32))] * 3), timeout=10)
    assert [r.tokens for r in batch.responses] == [reply.tokens] * 3
