"""Seeded malformed-message fuzz, per service: every generated request is invalid on purpose (a valid base with one
field broken: out of range, wrong type of payload, undecodable bytes, oversized), and every reply must be
INVALID_ARGUMENT, OUT_OF_RANGE or RESOURCE_EXHAUSTED with a bounded message (an INVALID_ARGUMENT naming the field);
afterwards the server still serves. 240+ messages per service, reproducible from the seed
(RAGSERVE_FUZZ_SEED=<n> to explore others)."""

from __future__ import annotations

import math
import os
import random
from typing import Callable

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import draft_pb2, generation_pb2, knowledge_pb2
from ragcore.grpc_shell import MAX_DETAILS_BYTES
from ragcore.wire import pack_tokens
from tests.fuzz.conftest import GEN_LIMITS
from tests.fuzz.wire import BAD_UTF8, FIELD, ldelim, varint

SEED = int(os.environ.get("RAGSERVE_FUZZ_SEED", "18"))
# FAILED_PRECONDITION: a well-formed kNN-LM or RAG request to a worker without that backend.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}
VOCAB = 49152
U32 = 2**32 - 1
D = "/ragserve.v1.DraftService/"
K = "/ragserve.v1.KnowledgeService/"
G = "/ragserve.v1.GenerationService/"

Case = tuple[str, str, bytes]  # (what was broken, full method name, raw request bytes)


def _huge(rng: random.Random) -> str:
    return rng.choice(["x", "é", "\U0001F600", "\x00"]) * rng.choice([300, 5_000, 100_000])


def _junk_string(rng: random.Random) -> str:
    return rng.choice(["oracle", "DATASTORE", "context\x00", "medusa", " ", _huge(rng)])  # never a valid value


def _tokens(rng: random.Random, n: int | None = None, hi: int = VOCAB - 1) -> list[int]:
    return [rng.randint(0, hi) for _ in range(n if n is not None else rng.randint(1, 40))]


def _undecodable(rng: random.Random, number: int) -> bytes:
    """Bytes that are not the message: invalid UTF-8 in string field `number`, or a cut length / varint."""
    kind = rng.randrange(3)
    if kind == 0:
        return ldelim(number, rng.choice(BAD_UTF8))
    if kind == 1:
        return varint(number << 3 | 2) + varint(rng.randint(5, 500)) + b"ab"  # length beyond the end
    return b"\x08" + b"\xff" * rng.randint(1, 12)  # a varint that never ends


# ------------------------------------------------------------------------------------------------- retrieval

def _draft_request(rng: random.Random) -> draft_pb2.DraftRequest:
    params = draft_pb2.DraftParams(max_suffix=rng.choice([0, 4, 16]), max_nodes=rng.choice([0, 8, 64]),
                                   source=rng.choice(["", "datastore", "merged", "context"]))
    return draft_pb2.DraftRequest(context=pack_tokens(_tokens(rng)), params=params)


def _broken_draft(rng: random.Random) -> tuple[str, draft_pb2.DraftRequest]:
    req = _draft_request(rng)
    p = req.params
    what = rng.choice(["empty context", "ragged context", "token id", "context too long", "max_suffix", "min_suffix",
                       "max_matches", "continuation", "max_nodes", "source"])
    if what == "empty context":
        req.context = b""
    elif what == "ragged context":
        req.context = req.context + bytes(rng.randint(1, 3))
    elif what == "token id":
        req.context = pack_tokens(_tokens(rng, 5) + [rng.randint(VOCAB, U32)])
    elif what == "context too long":  # the fuzz server allows 4096
        req.context = pack_tokens(_tokens(rng, rng.randint(4097, 6000)))
    elif what == "max_suffix":
        p.max_suffix = rng.choice([65, 1000, U32])
    elif what == "min_suffix":
        p.max_suffix, p.min_suffix = 4, rng.choice([5, 64, U32])
    elif what == "max_matches":
        p.max_matches = rng.choice([100_001, U32])
    elif what == "continuation":
        p.continuation = rng.choice([65, U32])
    elif what == "max_nodes":
        p.max_nodes = rng.choice([1025, U32])
    else:
        p.source = _junk_string(rng)
    return what, req


def retrieval_cases(rng: random.Random, n: int) -> list[Case]:
    cases: list[Case] = []
    while len(cases) < n:
        kind = rng.randrange(10)
        if kind < 5:
            what, req = _broken_draft(rng)
            cases.append((f"Draft {what}", D + "Draft", req.SerializeToString()))
        elif kind < 7:
            good = [_draft_request(rng) for _ in range(rng.randint(0, 5))]
            if not good:
                what, reqs = "empty batch", []
            elif rng.random() < 0.2:
                what, reqs = "oversized batch", [_draft_request(rng) for _ in range(17)]  # the fuzz server allows 16
            else:
                what, bad = _broken_draft(rng)
                reqs = good[:]
                reqs.insert(rng.randint(0, len(good)), bad)
            cases.append((f"DraftBatch {what}", D + "DraftBatch",
                          draft_pb2.DraftBatchRequest(requests=reqs).SerializeToString()))
        elif kind == 7:
            tokens = rng.choice([b"", b"\x01\x02\x03", pack_tokens([rng.randint(VOCAB, U32)]),
                                 pack_tokens(_tokens(rng, 5000))])
            cases.append(("Learn bad tokens", D + "Learn", draft_pb2.LearnRequest(tokens=tokens).SerializeToString()))
        else:
            method = rng.choice(["Draft", "DraftBatch"])
            data = (_undecodable(rng, 1) if method == "DraftBatch" and rng.random() < 0.3 else
                    ldelim(1, pack_tokens([1, 2])) + ldelim(2, ldelim(6, rng.choice(BAD_UTF8))))
            if method == "DraftBatch":
                data = ldelim(1, data) if rng.random() < 0.5 else data
            cases.append((f"{method} undecodable", D + method, data))
    return cases


def _search(rng: random.Random) -> knowledge_pb2.SearchRequest:
    return knowledge_pb2.SearchRequest(retriever=rng.choice(["edr", "sr"]), k=rng.randint(1, 10),
                                       texts=[f"query {i}" for i in range(rng.randint(1, 4))])


def knowledge_cases(rng: random.Random, n: int) -> list[Case]:
    """Against the fuzz KB: 12 passages, edr + sr (no adr), limit_batch 8, k <= 50, <= 32 ids, 2000 chars."""
    cases: list[Case] = []
    while len(cases) < n:
        kind = rng.randrange(3)
        if kind == 0:
            req = _search(rng)
            what = rng.choice(["retriever", "k zero", "k over", "no query", "batch", "empty text", "long text",
                               "vectors dim", "vectors nan", "vectors ragged", "texts and vectors", "sr vectors",
                               "index", "sr index kb", "ef_search", "with_text index", "results"])
            if what == "retriever":
                req.retriever = rng.choice(["", "EDR", "bm25", "dpr", _huge(rng)])
            elif what == "k zero":
                req.k = 0
            elif what == "k over":
                req.k = rng.choice([51, 1000, U32])
            elif what == "no query":
                del req.texts[:]
            elif what == "batch":
                req.texts.extend(f"q{i}" for i in range(9))
            elif what == "empty text":
                req.texts.append(rng.choice(["", "   "]))
            elif what == "long text":
                req.texts.append("w " * rng.randint(1001, 5000))
            elif what.startswith("vectors") or what in ("texts and vectors", "sr vectors"):
                if what != "texts and vectors":
                    del req.texts[:]
                req.retriever = "sr" if what == "sr vectors" else "edr"
                dim = {"vectors dim": rng.choice([1, 100, 383, 385])}.get(what, 384)
                v = np.random.default_rng(rng.randint(0, 99)).normal(size=(rng.randint(1, 3), dim)).astype("<f4")
                if what == "vectors nan":
                    v.flat[rng.randrange(v.size)] = rng.choice([math.nan, math.inf])
                req.vectors = v.tobytes() + (bytes(rng.randint(1, 3)) if what == "vectors ragged" else b"")
            elif what == "index":
                req.index = rng.choice(["knnlm", "KB", _huge(rng)])
            elif what == "sr index kb":
                req.retriever, req.index = "sr", "kb"
            elif what == "ef_search":
                req.ef_search = rng.choice([65537, U32])
            elif what == "with_text index":
                req.retriever, req.index, req.with_text = "edr", "other", True
            else:  # queries x k over the fuzz server's kb_limit_results (200)
                req.k = 50
                del req.texts[:]
                req.texts.extend(f"q{i}" for i in range(5))
            cases.append((f"Search {what}", K + "Search", req.SerializeToString()))
        elif kind == 1:
            ids = np.asarray([rng.randint(0, 11) for _ in range(rng.randint(1, 5))], "<i8").tobytes()
            req = knowledge_pb2.ScoreCandidatesRequest(retriever=rng.choice(["edr", "sr"]), text="json", ids=ids)
            what = rng.choice(["no ids", "ragged ids", "unknown id", "too many ids", "no query", "text and vector",
                               "vector dim", "long text", "retriever"])
            if what == "no ids":
                req.ids = b""
            elif what == "ragged ids":
                req.ids += bytes(rng.randint(1, 7))
            elif what == "unknown id":
                req.ids += np.asarray([rng.choice([-1, 12, 2**62])], "<i8").tobytes()
            elif what == "too many ids":
                req.ids = np.arange(33, dtype="<i8").tobytes()
            elif what == "no query":
                req.text = ""
            elif what == "text and vector":
                req.retriever, req.vector = "edr", np.zeros(384, "<f4").tobytes()
            elif what == "vector dim":
                req.retriever, req.text = "edr", ""
                req.vector = np.zeros(rng.choice([1, 383, 768]), "<f4").tobytes()
            elif what == "long text":
                req.text = "w" * rng.randint(2001, 9000)
            else:
                req.retriever = _junk_string(rng) or "x"
            cases.append((f"ScoreCandidates {what}", K + "ScoreCandidates", req.SerializeToString()))
        else:
            what = rng.choice(["no ids", "ragged ids", "unknown id", "too many ids", "undecodable"])
            ids = {"no ids": b"", "ragged ids": b"\x01" * rng.choice([1, 9, 15]),
                   "unknown id": np.asarray([0, rng.choice([-5, 12, 2**40])], "<i8").tobytes(),
                   "too many ids": np.zeros(33, "<i8").tobytes()}.get(what)
            data = (knowledge_pb2.GetDocumentsRequest(ids=ids).SerializeToString() if ids is not None
                    else _undecodable(rng, 1) if rng.random() < 0.5 else b"\x0a\x05ab")
            cases.append((f"GetDocuments {what}", K + "GetDocuments", data))
    return cases


# ------------------------------------------------------------------------------------------------ generation

def _generate(rng: random.Random) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=rng.randint(0, 4), decoding=rng.choice(["", "ar", "pld"]))
    which = rng.randrange(3)
    if which == 0:
        req.prompt = "def f(x):"
    elif which == 1:
        req.messages.add(role="user", content="hi")
    else:
        req.prompt_tokens.extend(_tokens(rng, 5))
    return req


def generation_cases(rng: random.Random, n: int) -> list[Case]:
    """Against the fuzz worker: <= 256 prompt tokens, 4096 characters, 4 new tokens, 4 stops, budget 64."""
    cases: list[Case] = []
    while len(cases) < n:
        req = _generate(rng)
        what = rng.choice(["no prompt", "two prompts", "role", "many messages", "long prompt", "many tokens",
                           "token id", "max_new_tokens", "temperature", "top_p", "top_k", "stops", "empty stop",
                           "long stop", "decoding", "draft_budget", "knnlm", "rag with decoding", "undecodable",
                           "oversized"])
        data = None
        if what == "no prompt":
            req.ClearField("prompt"), req.ClearField("messages"), req.ClearField("prompt_tokens")
        elif what == "two prompts":
            req.prompt, req.prompt_tokens[:] = "a", [1, 2]
            req.ClearField("messages")
        elif what == "role":
            req.ClearField("prompt"), req.ClearField("prompt_tokens")
            req.messages.add(role=rng.choice(["", "robot", "USER", _huge(rng)[:3000]]), content="x")
        elif what == "many messages":  # more than limit_messages (16 here)
            req.ClearField("prompt"), req.ClearField("prompt_tokens"), req.ClearField("messages")
            for _ in range(rng.randint(17, 400)):
                req.messages.add(role="user", content="")
        elif what == "long prompt":
            req.ClearField("messages"), req.ClearField("prompt_tokens")
            req.prompt = "y" * rng.randint(4097, 200_000)
        elif what == "many tokens":
            req.ClearField("messages"), req.ClearField("prompt")
            req.prompt_tokens[:] = _tokens(rng, rng.randint(257, 3000))
        elif what == "token id":
            req.ClearField("messages"), req.ClearField("prompt")
            req.prompt_tokens[:] = [1, rng.randint(VOCAB, U32)]
        elif what == "max_new_tokens":
            req.max_new_tokens = rng.choice([5, 10_000, U32])
        elif what == "temperature":
            req.temperature = rng.choice([math.nan, math.inf, -math.inf, -1.0, -1e-3])
        elif what == "top_p":
            req.top_p = rng.choice([0.0, -0.5, 1.5, math.nan])
        elif what == "top_k":
            req.top_k = rng.choice([VOCAB + 1, U32])
        elif what == "stops":
            req.stop.extend(["s"] * rng.randint(5, 50))
        elif what == "empty stop":
            req.stop.append("")
        elif what == "long stop":
            req.stop.append("z" * rng.randint(513, 5000))
        elif what == "decoding":
            req.decoding = rng.choice(["medusa", "AR", "rest\x00", _huge(rng)])
        elif what == "draft_budget":
            req.draft_budget = rng.choice([65, U32])
        elif what == "knnlm":  # no kNN-LM datastore on this worker
            req.knnlm.k = rng.randint(0, 2000)
        elif what == "rag with decoding":
            req.decoding = "ar"
            req.rag.retriever = rng.choice(["edr", "sr"])
        elif what == "undecodable":
            number = rng.choice([1, 9, 11])  # prompt, stop, decoding
            data = req.SerializeToString() + ldelim(number, rng.choice(BAD_UTF8))
        else:  # beyond the 1 MiB message limit: gRPC itself answers RESOURCE_EXHAUSTED
            data = generation_pb2.GenerateRequest(prompt="o" * ((1 << 20) + rng.randint(1, 5000))).SerializeToString()
        cases.append((f"Generate {what}", G + rng.choice(["Generate", "GenerateStream"]),
                      data if data is not None else req.SerializeToString()))
    return cases


# --------------------------------------------------------------------------------------------------- running

def _run(address: str, cases: list[Case], healthy: Callable[[grpc.Channel], None]) -> dict[str, int]:
    seen: dict[str, int] = {}
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        for what, method, data in cases:
            stream = method.endswith("Stream")
            call = (ch.unary_stream if stream else ch.unary_unary)(method)
            try:
                reply = call(data, timeout=60)
                if stream:
                    list(reply)
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
            assert code in ALLOWED, (what, code, details[:300])  # Not OK, INTERNAL, UNKNOWN, a hang
            assert len(details.encode()) <= MAX_DETAILS_BYTES, (what, len(details))
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                assert FIELD.match(details), (what, details[:300])  # starts with the field it is about
            seen[f"{code.name} {details.split(':')[0][:40]}"] = seen.get(f"{code.name} {details.split(':')[0][:40]}",
                                                                          0) + 1
        healthy(ch)
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    return seen


def test_malformed_draft_requests(fuzz_retrieval):
    cases = retrieval_cases(random.Random(SEED), 240)

    def healthy(ch):
        reply = ch.unary_unary(D + "Draft")(draft_pb2.DraftRequest(context=pack_tokens([1, 2, 3])).SerializeToString(),
                                            timeout=10)
        assert draft_pb2.DraftResponse.FromString(reply).server_ms >= 0

    seen = _run(fuzz_retrieval.address, cases, healthy)
    assert len(seen) >= 10, seen  # the generator reached many different checks


def test_malformed_knowledge_requests(fuzz_knowledge):
    cases = knowledge_cases(random.Random(SEED + 1), 240)

    def healthy(ch):
        reply = ch.unary_unary(K + "Search")(knowledge_pb2.SearchRequest(retriever="sr", k=3, texts=["json"])
                                             .SerializeToString(), timeout=30)
        assert len(knowledge_pb2.SearchResponse.FromString(reply).results) == 1

    seen = _run(fuzz_knowledge.address, cases, healthy)
    assert len(seen) >= 10, seen


@pytest.mark.model
def test_malformed_generate_requests(fuzz_generation):
    cases = generation_cases(random.Random(SEED + 2), 300)

    def healthy(ch):
        reply = ch.unary_unary(G + "Generate")(generation_pb2.GenerateRequest(
            prompt="def add(a, b):", max_new_tokens=2, ignore_eos=True).SerializeToString(), timeout=120)
        assert len(generation_pb2.GenerateResponse.FromString(reply).token_ids) == 2

    seen = _run(fuzz_generation.address, cases, healthy)
    assert len(seen) >= 12, seen
    assert GEN_LIMITS["limit_messages"] == 16
