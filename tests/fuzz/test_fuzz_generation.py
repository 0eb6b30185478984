"""Fuzz Generate / GenerateStream: every request gets OK or INVALID_ARGUMENT naming the field, promptly."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import event, given, strategies as st

from proto import generation_pb2 as pb
from tests.fuzz.conftest import GEN_LIMITS
from tests.fuzz.wire import BAD_UTF8, FUZZ, check, ldelim

pytestmark = pytest.mark.model
GENERATE = "/ragserve.v1.GenerationService/Generate"
STREAM = "/ragserve.v1.GenerationService/GenerateStream"
OK_OR_INVALID = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
U32 = 2**32 - 1

text = st.text(max_size=40)
wild_text = text | st.sampled_from(["", "x" * 5000, "\u0000\ufffd\U0001F600", "</s><|im_end|>"])
messages = st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]), text), min_size=1, max_size=3)
wild_messages = st.lists(st.tuples(st.sampled_from(["user", "", "robot", "USER"]), wild_text), max_size=3)
tokens = st.lists(st.integers(0, 49151), min_size=1, max_size=40)
wild_tokens = st.lists(st.integers(0, U32), max_size=300)
wild_float = st.floats(width=32) | st.sampled_from([0.0, -0.0, 1.0, 1e-30, 1e30, -1.0])


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A plausible request with 0-3 fields replaced by wild values (so every validation step gets reached)."""
    req = pb.GenerateRequest(max_new_tokens=draw(st.integers(0, 4)), ignore_eos=draw(st.booleans()),
                             decoding=draw(st.sampled_from(["", "ar", "pld", "rest", "rest-ds"])))
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_tokens"]))
    if kind == "prompt":
        req.prompt = draw(text.filter(bool))
    elif kind == "messages":
        for role, content in draw(messages):
            req.messages.add(role=role, content=content)
    else:
        req.prompt_tokens.extend(draw(tokens))
    if draw(st.booleans()):
        req.temperature = draw(st.floats(0.25, 2.0, width=32))
        req.seed = draw(st.integers(0, 2**64 - 1))
    req.stop.extend(draw(st.lists(text.filter(bool), max_size=2)))
    for name in draw(st.sets(st.sampled_from(sorted(WILD)), max_size=3)):
        WILD[name](req, draw)
    return req


def _add_messages(req, draw):
    for role, content in draw(wild_messages):
        req.messages.add(role=role, content=content)


WILD = {
    "prompt": lambda req, draw: setattr(req, "prompt", draw(wild_text)),
    "messages": _add_messages,
    "prompt_tokens": lambda req, draw: req.prompt_tokens.extend(draw(wild_tokens)),
    "max_new_tokens": lambda req, draw: setattr(req, "max_new_tokens", draw(st.sampled_from([5, 10**9, U32]))),
    "temperature": lambda req, draw: setattr(req, "temperature", draw(wild_float)),
    "top_p": lambda req, draw: setattr(req, "top_p", draw(wild_float)),
    "top_k": lambda req, draw: setattr(req, "top_k", draw(st.sampled_from([0, 1, 49152, 49153, 10**9, U32]))),
    "seed": lambda req, draw: setattr(req, "seed", draw(st.sampled_from([0, 2**64 - 1]))),
    "stop": lambda req, draw: req.stop.extend(draw(st.lists(wild_text, min_size=1, max_size=6))),
    "decoding": lambda req, draw: setattr(req, "decoding", draw(st.sampled_from(["crest", "medusa", "AR", "rest\x00"]))),
    "draft_budget": lambda req, draw: setattr(req, "draft_budget", draw(st.sampled_from([1, 64, 65, U32]))),
    "learn_from_output": lambda req, draw: setattr(req, "learn_from_output", draw(st.booleans())),
}


def _call(raw, data: bytes, stream: bool):
    if stream:
        code, details, msgs = raw.stream(STREAM, data)
        if code == grpc.StatusCode.OK:
            final = pb.GenerateStreamResponse.FromString(msgs[-1])
            assert final.finish_reason in ("stop", "length")
            assert final.usage.completion_tokens <= GEN_LIMITS["limit_max_new_tokens"]
        return code, details
    code, details, reply = raw.unary(GENERATE, data)
    if code == grpc.StatusCode.OK:
        r = pb.GenerateResponse.FromString(reply)
        assert r.finish_reason in ("stop", "length") and len(r.token_ids) <= GEN_LIMITS["limit_max_new_tokens"]
    return code, details


@FUZZ
@given(req=generate_requests(), stream=st.booleans())
def test_typed_requests(fuzz_generation, req, stream):
    code, details = _call(fuzz_generation, req.SerializeToString(), stream)
    event(f"{code.name} {details.split(':')[0]}")
    check(code, details, OK_OR_INVALID)


@FUZZ
@given(data=st.binary(max_size=300), stream=st.booleans())
def test_random_bytes(fuzz_generation, data, stream):
    code, details = _call(fuzz_generation, data, stream)
    check(code, details, OK_OR_INVALID)


# (scenario, field path the error must name, raw request bytes)
BAD_STRINGS = [
    ("prompt", "prompt", lambda b: ldelim(1, b)),
    ("second stop string", "stop[1]", lambda b: ldelim(1, b"x") + ldelim(9, b"ok") + ldelim(9, b)),
    ("chat message content", "messages[0].content", lambda b: ldelim(2, ldelim(1, b"user") + ldelim(2, b))),
    ("role of the second message", "messages[1].role",
     lambda b: ldelim(2, ldelim(1, b"user") + ldelim(2, b"hi")) + ldelim(2, ldelim(1, b))),
    ("decoding mode", "decoding", lambda b: ldelim(1, b"x") + ldelim(11, b)),
]


@pytest.mark.parametrize("scenario,field,build", BAD_STRINGS, ids=[c[0] for c in BAD_STRINGS])
@pytest.mark.parametrize("method", [GENERATE, STREAM])
def test_invalid_utf8_is_invalid_argument_naming_the_field(fuzz_generation, scenario, field, build, method):
    for bad in BAD_UTF8:
        call = fuzz_generation.stream if method == STREAM else fuzz_generation.unary
        code, details, _ = call(method, build(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (scenario, code, details)  # Not INTERNAL
        assert details == f"{field}: invalid UTF-8 in a string field", details


def test_oversized_message_is_refused_by_the_size_limit(fuzz_generation):
    big = pb.GenerateRequest(prompt="x" * (GEN_LIMITS["max_message_bytes"] + 1000)).SerializeToString()
    code, details, _ = fuzz_generation.unary(GENERATE, big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)


def test_still_serving_after_the_fuzz(fuzz_generation):
    code, details, reply = fuzz_generation.unary(GENERATE, pb.GenerateRequest(
        prompt="def add(a, b):", max_new_tokens=3, ignore_eos=True).SerializeToString())
    assert code == grpc.StatusCode.OK, details
    assert len(pb.GenerateResponse.FromString(reply).token_ids) == 3
