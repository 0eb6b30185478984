"""Hand-made protobuf bytes for fuzzing what a typed client cannot send (invalid UTF-8 in string fields)."""

from __future__ import annotations

import os
import re

import grpc
from hypothesis import HealthCheck, settings

# CI runs a few dozen examples per test; RAGSERVE_FUZZ_EXAMPLES=2000 for a longer local hunt.
FUZZ = settings(max_examples=int(os.environ.get("RAGSERVE_FUZZ_EXAMPLES", "50")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# An INVALID_ARGUMENT message starts with the field it is about: "stop[0]: ...", "requests[3].params.source: ...".
FIELD = re.compile(r"^[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*: \S")
BAD_UTF8 = [b"\xff", b"\xc3", b"ok\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80abc"]  # lone/truncated/surrogate/too big


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def ldelim(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, sub-message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def check(code: grpc.StatusCode, details: str, allowed: set[grpc.StatusCode]) -> None:
    """Never INTERNAL / UNKNOWN / DEADLINE_EXCEEDED (a hang); a refusal names the field."""
    assert code in allowed, (code, details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert FIELD.match(details), details
