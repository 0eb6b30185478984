"""kNN-LM through both real services on loopback: Generate with `knnlm` options returns the same tokens as the
in-process baseline, bad options are INVALID_ARGUMENT naming the field, and a retrieval service that is down
makes the request fail with UNAVAILABLE (never p_LM's tokens passed off as the kNN-LM's)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from generation_service.augment.round_gate import async_by_default
from generation_service.config import GenerationConfig
from generation_service.knnlm.loop import generate_tokens
from generation_service.knnlm.options import KnnLmOptions
from generation_service.model.sampling import SamplingParams
from proto import generation_pb2, generation_pb2_grpc

NEW = 8


def _server(tm, ds_path, retrieval_address: str):
    from generation_service.server import build_server

    cfg = GenerationConfig(port=0, retrieval=retrieval_address, dtype="bf16", knnlm_datastore=str(ds_path),
                           knnlm_timeout_ms=3000, default_decoding="ar", acceptance_state="off")
    running, _ = build_server(cfg, tm=tm)
    return running


@pytest.fixture(scope="module")
def stub(tm, ds_path, retrieval):
    running = _server(tm, ds_path, retrieval.address)
    with grpc.insecure_channel(running.address) as ch:
        yield generation_pb2_grpc.GenerationServiceStub(ch)
    running.stop(0)


def _request(prompt: np.ndarray, **knn) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_tokens=prompt.tolist(), max_new_tokens=NEW, ignore_eos=True,
                                          knnlm=generation_pb2.KnnLmOptions(**knn))


def test_generate_with_knnlm_options(tm, backend, doc_tokens, stub):
    prompt = doc_tokens[0][:24].astype(np.int64)
    want, _ = generate_tokens(tm, prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True),
                              KnnLmOptions(k=16, lam=0.9, speculate=False), backend)
    auto = "" if async_by_default() else "-sync"  # async rounds by default only with ASYNC_MIN_CORES cores
    for knn, mode in (({"speculate": False}, "base"), ({}, "os3" + auto),  # Not "base": speculation is the default
                      ({"speculate": True, "stride": 4}, "s4" + auto),
                      ({"speculate": True, "stride": 0}, "os3" + auto),
                      ({"speculate": True, "stride": 4, "async_verify": True}, "s4"),
                      ({"speculate": True, "stride": 4, "async_verify": False}, "s4-sync")):
        reply = stub.Generate(_request(prompt, k=16, knn_weight=0.9, **knn), timeout=120)
        assert list(reply.token_ids) == want, knn  # Not the plain LM's or the cache's tokens
        s = reply.stats.knnlm
        assert (s.mode, s.k, s.tokens) == (mode, 16, NEW)
        assert reply.stats.decoding == "knnlm" and reply.finish_reason == "length"
        # A baseline step the round gate chose (stride 0) is one Search too.
        assert s.kb_calls == (NEW if mode == "base" else s.verifications + list(s.strides).count(0))


@pytest.mark.parametrize("knn, field", [
    ({"k": 10**6}, "knnlm.k"),                        # larger than the datastore (and than 1024)
    ({"knn_weight": 1.5}, "knnlm.lambda"),
    ({"retriever": "bm25"}, "knnlm.retriever"),
    ({"temperature": -1.0}, "knnlm.temperature"),
])
def test_bad_options_are_invalid_argument(doc_tokens, stub, knn, field):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(_request(doc_tokens[0][:8].astype(np.int64), **knn), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()


def test_k_just_above_the_datastore_is_invalid_argument(ds, doc_tokens, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(_request(doc_tokens[0][:8].astype(np.int64), k=ds.size + 1), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"knnlm.k: {ds.size + 1} exceeds the datastore size ({ds.size} entries)"


def test_retrieval_down_is_unavailable(tm, ds_path, doc_tokens):
    running = _server(tm, ds_path, "127.0.0.1:1")  # nothing listens there
    try:
        with grpc.insecure_channel(running.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                generation_pb2_grpc.GenerationServiceStub(ch).Generate(
                    _request(doc_tokens[0][:8].astype(np.int64), k=4, speculate=True), timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # Not OK with the LM's tokens
        assert "kNN-LM retrieval failed" in e.value.details() and "127.0.0.1:1" in e.value.details()
    finally:
        running.stop(0)
