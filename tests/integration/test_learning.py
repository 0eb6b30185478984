"""learn_from_output: a finished output feeds the retrieval service's online-learning shard."""

from __future__ import annotations

import time

import grpc
import pytest

from generation_service.client import GenerationClient
from proto import draft_pb2, draft_pb2_grpc
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
from retrieval_service.server import build_server as build_retrieval
from tests.integration.conftest import start_generation

pytestmark = pytest.mark.model
PROMPT = "# A tiny inventory system for a fictional zorblax warehouse\nclass ZorblaxInventory:\n"


def test_second_pass_drafts_from_the_learned_output(tm, datastore):
    own = SuffixArrayDatastore.open(datastore.path)  # its own shard set: learning must not leak into others
    retrieval = build_retrieval(RetrievalConfig(port=0, learn=True), datastore=own)
    # A generous draft deadline: on a loaded machine a 50 ms draft can miss it, and the second pass must draft.
    running, servicer = start_generation(tm, retrieval.address, draft_timeout_ms=5000)
    try:
        with GenerationClient(running.address) as c, grpc.insecure_channel(retrieval.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            params = dict(max_new_tokens=32, decoding="rest-ds", ignore_eos=True, timeout=300)
            first = c.generate(PROMPT, learn_from_output=True, **params)
            learned = 16 + len(first.token_ids)  # prompt tail + output
            # Learning happens after the reply, in the background, and the output becomes searchable at the
            # learning shard's next rebuild: waited for, not slept on (a loaded machine can take longer).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                info = stub.Info(draft_pb2.DatastoreInfoRequest(), timeout=5)
                if info.searchable_learned_tokens == learned:
                    break
                time.sleep(0.05)
            assert info.learning and info.learned_tokens == learned
            assert info.searchable_learned_tokens == learned
            second = c.generate(PROMPT, **params)
            assert list(second.token_ids) == list(first.token_ids)  # lossless either way
            # The repeat is drafted from its own earlier output: far fewer forward passes.
            assert second.stats.forward_steps < first.stats.forward_steps / 2, (first.stats, second.stats)
    finally:
        running.stop(0)
        servicer.worker.stop()
        retrieval.stop(0)


def test_learn_is_refused_when_off_and_checked_when_on(retrieval, datastore):
    with grpc.insecure_channel(retrieval.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            draft_pb2_grpc.DraftServiceStub(ch).Learn(draft_pb2.LearnRequest(tokens=pack_tokens([1, 2])), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # Not silently dropped
    own = SuffixArrayDatastore.open(datastore.path)
    on = build_retrieval(RetrievalConfig(port=0, learn=True), datastore=own)
    try:
        with grpc.insecure_channel(on.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                draft_pb2_grpc.DraftServiceStub(ch).Learn(draft_pb2.LearnRequest(tokens=pack_tokens([10**6])),
                                                          timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("tokens")
    finally:
        on.stop(0)
