"""openai_api.parse fans prompts and choices out into separate worker requests: each prompt keeps its own text,
each choice its own seed, and no two calls share one message object (the common one-prompt, one-choice request
reuses the template instead of copying it)."""

from __future__ import annotations

import pytest

from gateway import openai_api

CASES = [
    # scenario, body fields, expected (prompt, seed) per call in order
    ("one prompt, one choice", {"prompt": "a"}, [[("a", 0)]]),
    ("one prompt, seeded", {"prompt": "a", "seed": 7}, [[("a", 7)]]),
    ("one prompt, two choices", {"prompt": "a", "n": 2, "seed": 7}, [[("a", 7), ("a", 8)]]),
    ("two prompts, one choice", {"prompt": ["a", "b"]}, [[("a", 0)], [("b", 0)]]),
    ("two prompts, two choices", {"prompt": ["a", "b"], "n": 2, "seed": 2**64 - 1},
     [[("a", 2**64 - 1), ("a", 0)], [("b", 2**64 - 1), ("b", 0)]]),
]


@pytest.mark.parametrize("name,fields,want", CASES, ids=[c[0] for c in CASES])
def test_fan_out(name, fields, want):
    p = openai_api.parse({"model": "m", "max_tokens": 3, "stop": ["\n"], **fields}, False, 4, 64)
    got = [[(r.prompt, r.seed) for r in choices] for choices in p.requests]
    assert got == want  # Not the first prompt repeated, not one seed for every choice
    calls = [r for choices in p.requests for r in choices]
    assert len({id(r) for r in calls}) == len(calls)  # Not one message sent twice
    assert all(r.max_new_tokens == 3 and list(r.stop) == ["\n"] for r in calls)  # the shared fields in every call
    assert p.key == [prompts[0][0] for prompts in want]


def test_chat_one_request():
    p = openai_api.parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 1,
                          "temperature": 0.5}, True, 4, 64)
    calls = [r for choices in p.requests for r in choices]
    assert [(r.seed, r.temperature, [(m.role, m.content) for m in r.messages]) for r in calls] == \
        [(1, 0.5, [("user", "hi")]), (2, 0.5, [("user", "hi")])]
    assert calls[0] is not calls[1]
