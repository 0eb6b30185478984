"""The official openai Python SDK, unchanged, against the gateway in front of a real worker."""

from __future__ import annotations

import asyncio

import grpc
import openai

from proto import generation_pb2, generation_pb2_grpc

SYSTEM = "You are a concise assistant. Answer in one short sentence."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def direct(worker, **fields) -> generation_pb2.GenerateResponse:
    with grpc.insecure_channel(worker.address) as ch:
        return generation_pb2_grpc.GenerationServiceStub(ch).Generate(generation_pb2.GenerateRequest(**fields),
                                                                     timeout=120)


def test_chat_greedy_equals_the_grpc_reply_token_for_token(client, model_id, worker):
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0, logprobs=True)
    want = direct(worker, messages=[generation_pb2.ChatMessage(**m) for m in CHAT], max_new_tokens=24,
                  temperature=0, logprobs=True)
    got = r.choices[0]
    assert got.message.content == want.text
    assert got.message.role == "assistant"
    assert [bytes(e.bytes) for e in got.logprobs.content] == [e.token_bytes for e in want.logprobs]
    assert len(got.logprobs.content) == len(want.token_ids) == r.usage.completion_tokens
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert got.finish_reason in ("stop", "length")


def test_completion_greedy_equals_grpc_and_stream_equals_unary(client, model_id, worker):
    r = client.completions.create(model=model_id, prompt=CODE, max_tokens=32, temperature=0)
    want = direct(worker, prompt=CODE, max_new_tokens=32, temperature=0)
    assert r.choices[0].text == want.text
    assert r.usage.completion_tokens == len(want.token_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=CODE, max_tokens=32, temperature=0, stream=True) if c.choices)
    assert streamed == want.text  # Not a prefix or a repeat of it


def test_stream_chat_with_usage_and_extension(client, model_id):
    chunks = list(client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1  # the usage chunk comes last
    text = "".join(c.choices[0].delta.content or "" for c in content)
    unary = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=16)
    assert text == unary.choices[0].message.content
    ext = last.model_extra["ragserve"]["choices"][0]
    assert ext["index"] == 0 and ext["forward_steps"] >= 1 and ext["mean_accepted_length"] >= 1.0


def test_n2_seed_and_sampling(client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed: same choices
    assert a.choices[0].text != a.choices[1].text  # Not the same draw twice: choice i samples with seed + i
    c = client.completions.create(**{**kw, "seed": 99})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]
    assert a.usage.completion_tokens >= 2
    assert len(a.model_extra["ragserve"]["choices"]) == 2


def test_stream_n2(client, model_id):
    texts = {0: "", 1: ""}
    finished = set()
    for c in client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, n=2, stream=True,
                                            temperature=0.9, seed=5):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1} and all(texts.values())


def test_logprobs_chat_and_completion(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0
        # Greedy: the emitted token is the most likely one.
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    assert "".join(e.token for e in content) == r.choices[0].message.content

    c = client.completions.create(model=model_id, prompt=CODE, max_tokens=6, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)

    streamed = [e for ch in client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, stream=True,
                                                            logprobs=True, top_logprobs=1)
                for choice in ch.choices if choice.logprobs for e in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_stop_sequence(client, model_id):
    r = client.completions.create(model=model_id, prompt=CODE, max_tokens=40, temperature=0)
    full = r.choices[0].text
    cut = full.strip()[:6].strip() or full[:3]
    stop_at = full.index(cut)
    s = client.completions.create(model=model_id, prompt=CODE, max_tokens=40, temperature=0, stop=[cut])
    assert s.choices[0].text == full[:stop_at]  # Not including the stop sequence
    assert s.choices[0].finish_reason == "stop"


def test_async_client(gateway, model_id):
    async def run():
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as ac:
            one = ac.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6)
            two = ac.completions.create(model=model_id, prompt=CODE, max_tokens=6)
            a, b = await asyncio.gather(one, two)
            stream = await ac.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return a, b, "".join(parts)

    a, b, streamed = asyncio.run(run())
    assert a.usage.completion_tokens >= 1 and b.usage.completion_tokens >= 1
    assert streamed == a.choices[0].message.content


def test_extension_knobs_pass_through(client, model_id):
    r = client.completions.create(model=model_id, prompt=CODE, max_tokens=8, temperature=0,
                                  extra_body={"ragserve": {"decoding": "ar"}})
    ext = r.model_extra["ragserve"]["choices"][0]
    assert ext["decoding"] == "ar" and ext["accepted_tokens"] == 0  # Not "pld": the knob reached the worker
    models = client.models.list()
    assert [m.id for m in models.data] == [model_id]
