"""Fuzz the DraftService (Draft, DraftBatch, Info, Learn): OK, INVALID_ARGUMENT naming the field, or
FAILED_PRECONDITION (a source this server cannot draft from); never INTERNAL, UNKNOWN or a hang."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from hypothesis import event, given, strategies as st

from proto import draft_pb2 as pb
from ragcore.wire import pack_tokens
from tests.fuzz.wire import BAD_UTF8, FUZZ, check, ldelim

S = "/ragserve.v1.DraftService/"
U32 = 2**32 - 1
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}

good_context = st.lists(st.integers(0, 49151), min_size=1, max_size=64).map(pack_tokens)
wild_context = (st.lists(st.integers(0, U32), max_size=8).map(pack_tokens) | st.binary(max_size=40)
                | st.just(pack_tokens(np.arange(5000) % 49152)))  # beyond the fuzz server's 4096-token limit
contexts = good_context | wild_context
good_limit = st.sampled_from([0, 1, 2, 4, 8, 16])
wild_limit = st.sampled_from([0, 1, 64, 65, 1024, 1025, 100_000, 100_001, U32]) | st.integers(0, 200)
good_source = st.sampled_from(["", "datastore", "merged", "context"])
wild_source = st.sampled_from(["crest", "oracle", "DATASTORE", "context\x00", "\U0001F600"])
PARAMS = ["max_suffix", "min_suffix", "max_matches", "continuation", "max_nodes"]


@st.composite
def draft_requests(draw) -> pb.DraftRequest:
    """A plausible request with 0-2 fields replaced by wild values (so every check gets reached)."""
    wild = draw(st.sets(st.sampled_from(["context", "source", *PARAMS]), max_size=2))
    params = pb.DraftParams(source=draw(wild_source if "source" in wild else good_source),
                            **{f: draw(wild_limit if f in wild else good_limit) for f in PARAMS})
    return pb.DraftRequest(context=draw(wild_context if "context" in wild else good_context), params=params)


@FUZZ
@given(req=draft_requests())
def test_draft(fuzz_retrieval, req):
    code, details, reply = fuzz_retrieval.unary(S + "Draft", req.SerializeToString())
    event(f"{code.name} {details.split(':')[0]}")
    check(code, details, ALLOWED)
    if code == grpc.StatusCode.OK:
        r = pb.DraftResponse.FromString(reply)
        n = len(r.tokens) // 4
        assert len(r.parents) == 4 * n and n <= (req.params.max_nodes or 64)
        parents = np.frombuffer(r.parents, "<i4")
        assert all(-1 <= p < i for i, p in enumerate(parents))  # a tree in BFS order


@FUZZ
@given(reqs=st.lists(draft_requests(), max_size=20))
def test_draft_batch(fuzz_retrieval, reqs):
    code, details, reply = fuzz_retrieval.unary(S + "DraftBatch", pb.DraftBatchRequest(requests=reqs).SerializeToString())
    check(code, details, ALLOWED)
    if code == grpc.StatusCode.OK:
        assert len(pb.DraftBatchResponse.FromString(reply).responses) == len(reqs)


@FUZZ
@given(tokens=contexts)
def test_learn(fuzz_retrieval, tokens):
    code, details, _ = fuzz_retrieval.unary(S + "Learn", pb.LearnRequest(tokens=tokens).SerializeToString())
    check(code, details, {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT})


@FUZZ
@given(method=st.sampled_from(["Draft", "DraftBatch", "Info", "Learn"]), data=st.binary(max_size=200))
def test_random_bytes(fuzz_retrieval, method, data):
    code, details, _ = fuzz_retrieval.unary(S + method, data)
    check(code, details, ALLOWED)


@pytest.mark.parametrize("bad", BAD_UTF8)
def test_invalid_utf8_source_is_invalid_argument(fuzz_retrieval, bad):
    one = ldelim(1, pack_tokens([1, 2])) + ldelim(2, ldelim(6, bad))
    code, details, _ = fuzz_retrieval.unary(S + "Draft", one)
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, "params.source: invalid UTF-8 in a string field")
    ok = pb.DraftRequest(context=pack_tokens([1, 2])).SerializeToString()
    code, details, _ = fuzz_retrieval.unary(S + "DraftBatch", ldelim(1, ok) + ldelim(1, one))
    assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                               "requests[1].params.source: invalid UTF-8 in a string field")


def test_still_serving_after_the_fuzz(fuzz_retrieval):
    code, details, _ = fuzz_retrieval.unary(S + "Info", b"")
    assert code == grpc.StatusCode.OK, details
