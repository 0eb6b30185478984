"""find_bad_field: which string field of an undecodable request holds invalid UTF-8 (pure, no server)."""

from __future__ import annotations

import pytest

from proto import draft_pb2, generation_pb2
from ragcore.security import find_bad_field
from tests.fuzz.wire import ldelim, varint

GEN = generation_pb2.GenerateRequest.DESCRIPTOR
BATCH = draft_pb2.DraftBatchRequest.DESCRIPTOR

CASES = [
    # (scenario, descriptor, bytes, answer)
    ("valid request", GEN, generation_pb2.GenerateRequest(prompt="hé", stop=["a"]).SerializeToString(), None),
    ("bad prompt", GEN, ldelim(1, b"\xff"), "prompt: invalid UTF-8 in a string field"),
    ("third stop string", GEN, ldelim(9, b"a") + ldelim(9, b"b") + ldelim(9, b"\xc3"),
     "stop[2]: invalid UTF-8 in a string field"),
    ("after scalar fields", GEN, varint(4 << 3) + varint(300) + varint(5 << 3 | 5) + b"\0\0\0\0" + ldelim(11, b"\x80"),
     "decoding: invalid UTF-8 in a string field"),
    ("nested two levels", BATCH, ldelim(1, b"") + ldelim(1, ldelim(2, ldelim(6, b"\xff"))),
     "requests[1].params.source: invalid UTF-8 in a string field"),
    ("bytes fields may hold anything", BATCH, ldelim(1, ldelim(1, b"\xff\xfe")), None),  # Not a string field
    ("unknown field ignored", GEN, ldelim(99, b"\xff"), None),
    ("truncated length", GEN, varint(1 << 3 | 2) + varint(50) + b"abc", None),  # not protobuf: caller says so
    ("truncated varint", GEN, b"\x80", None),
    ("group wire type", GEN, varint(1 << 3 | 3), None),
]


@pytest.mark.parametrize("scenario,descriptor,data,want", CASES, ids=[c[0] for c in CASES])
def test_find_bad_field(scenario, descriptor, data, want):
    assert find_bad_field(descriptor, data) == want
