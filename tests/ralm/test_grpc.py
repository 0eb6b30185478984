"""RAG over gRPC: Generate with `rag` options runs RaLMSpec in the worker against the real retrieval server and
returns RaLMSeq's output with RAG stats; bad options are INVALID_ARGUMENT naming the field; no KB -> UNAVAILABLE."""

from __future__ import annotations

import logging

import grpc
import pytest

from generation_service.config import GenerationConfig
from proto import generation_pb2, generation_pb2_grpc
from tools.launcher import free_port

pytestmark = pytest.mark.model
STRIDE = 2


def _start(tm, kb_target: str):
    from generation_service.server import build_server

    cfg = GenerationConfig(port=0, retrieval="", kb_target=kb_target, kb_timeout_ms=2000, retry_after_s=0.2,
                           acceptance_state="off")
    return build_server(cfg, tm=tm)


@pytest.fixture(scope="module")
def gen(tm, kb_server):
    running, servicer = _start(tm, kb_server.address)
    channel = grpc.insecure_channel(running.address)
    yield generation_pb2_grpc.GenerationServiceStub(channel)
    channel.close()
    running.stop(0)
    servicer.worker.stop()


def _request(prompt, n: int, **rag) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_tokens=[int(t) for t in prompt], max_new_tokens=n, ignore_eos=True,
                                          rag=generation_pb2.RagOptions(**rag))


def test_generate_with_rag_equals_ralmseq(gen, prompts, reference):
    want = reference("edr", 0, STRIDE)
    reply = gen.Generate(_request(prompts[0], len(want), retriever="edr", stride=STRIDE), timeout=300)
    assert list(reply.token_ids) == want  # RaLMSpec (P, S, A on by default) == RaLMSeq; Not a drafted output
    rag = reply.stats.rag
    assert rag.mode == "ralmspec" and rag.retriever == "edr" and reply.stats.decoding == "ralmspec"
    assert rag.kb_calls > 0 and rag.retrieval_ms > 0 and rag.generation_ms > 0
    assert len(rag.strides) > 0 and rag.strides[0] == 0  # the first step is sequential (empty cache)
    assert 0.0 <= rag.speculation_accuracy <= 1.0 and rag.retrievals == len(want) // STRIDE

    seq = gen.Generate(_request(prompts[0], len(want), retriever="edr", stride=STRIDE, speculate=False), timeout=300)
    assert list(seq.token_ids) == want and seq.stats.rag.mode == "ralmseq" and not seq.stats.rag.strides


@pytest.mark.parametrize("fields,decoding,bad", [
    (dict(retriever="bm42"), "", "rag.retriever"),
    (dict(prefetch=999), "", "rag.prefetch"),
    (dict(encoder="gpu"), "", "rag.encoder"),
    (dict(stride=1000), "", "rag.stride"),
    (dict(spec_stride=65, os3=False), "", "rag.spec_stride"),
    (dict(retriever="edr"), "rest", "decoding"),  # Not silently REST decoding without retrieval
    (dict(max_prompt_tokens=4), "", "rag.max_prompt_tokens"),
])
def test_bad_options_are_invalid_argument(gen, prompts, fields, decoding, bad):
    req = _request(prompts[0], 8, **fields)
    req.decoding = decoding
    with pytest.raises(grpc.RpcError) as e:
        gen.Generate(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(bad), e.value.details()


def test_kb_down_is_unavailable(tm, prompts, caplog):
    caplog.set_level(logging.DEBUG)
    running, servicer = _start(tm, f"127.0.0.1:{free_port()}")  # nothing listens there
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            for speculate in (False, True):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Generate(_request(prompts[0], 8, retriever="edr", speculate=speculate), timeout=60)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # Not INTERNAL, Not an answer without passages
                assert "knowledge service unavailable" in e.value.details()
    finally:
        running.stop(0)
        servicer.worker.stop()
    # A dependency that is down is a WARNING line per call, not an ERROR with a traceback.
    failed = [r for r in caplog.records if "GenerationService/Generate" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING] * 2, [r.getMessage() for r in caplog.records]
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
