"""End to end over gRPC: every decoding mode gives the autoregressive output, greedy and seeded sampling."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.conftest import PROMPTS

pytestmark = pytest.mark.model
MODES = ["ar", "pld", "rest-ds", "rest"]
N_TOKENS = 32


@pytest.mark.parametrize("server", ["retrieval", "generation"])
def test_health_reports_serving_once_loaded(server, request):
    running = request.getfixturevalue(server)
    with grpc.insecure_channel(running.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING  # Not NOT_SERVING / UNKNOWN


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_identical_in_every_mode(client, prompt):
    replies = {m: client.generate(prompt, max_new_tokens=N_TOKENS, decoding=m, ignore_eos=True, timeout=300)
               for m in MODES}
    ar = list(replies["ar"].token_ids)
    assert len(ar) == N_TOKENS
    for mode in MODES:
        r = replies[mode]
        assert list(r.token_ids) == ar, mode  # Not a different continuation
        assert r.text == replies["ar"].text, mode
        assert r.stats.decoding == mode
        assert not r.stats.degraded, r.stats.degraded_reason
        # The first token comes from the prefill pass; every later one from a decode step.
        assert sum(i * c for i, c in enumerate(r.stats.accepted_length_histogram)) == N_TOKENS - 1
    # AR takes one forward pass per token; the merged drafter must actually speculate on code.
    assert replies["ar"].stats.forward_steps == N_TOKENS - 1
    assert replies["rest"].stats.forward_steps < N_TOKENS - 1  # Not one step per token
    assert replies["rest"].stats.draft_tokens_accepted > 0


def test_seeded_sampling_identical_across_modes(client):
    params = dict(max_new_tokens=N_TOKENS, temperature=0.8, top_p=0.95, top_k=50, ignore_eos=True, timeout=300)
    ar = client.generate(PROMPTS[0], decoding="ar", seed=1234, **params)
    for mode in ["pld", "rest"]:
        spec = client.generate(PROMPTS[0], decoding=mode, seed=1234, **params)
        assert list(spec.token_ids) == list(ar.token_ids), mode  # Not a fresh draw
    other = client.generate(PROMPTS[0], decoding="ar", seed=99, **params)
    assert list(other.token_ids) != list(ar.token_ids)  # Not ignoring the seed


def test_stream_deltas_add_up_to_the_unary_reply(client):
    unary = client.generate(PROMPTS[1], max_new_tokens=N_TOKENS, decoding="rest", timeout=300)
    deltas = list(client.stream(PROMPTS[1], max_new_tokens=N_TOKENS, decoding="rest", timeout=300))
    assert "".join(d.text_delta for d in deltas) == unary.text
    assert [t for d in deltas for t in d.token_ids] == list(unary.token_ids)
    assert [d.finish_reason for d in deltas[:-1]] == [""] * (len(deltas) - 1)  # Not finished early
    final = deltas[-1]
    assert final.finish_reason == unary.finish_reason
    assert final.usage.completion_tokens == unary.usage.completion_tokens
    # The stream's own stats (tree sizes, hence forward_steps, follow the worker's calibration pooled over requests,
    # which the unary request moved, so they are not compared with its reply's).
    assert final.stats.forward_steps > 0
    decoded = final.stats.mean_accepted_length * final.stats.forward_steps
    assert decoded == pytest.approx(final.usage.completion_tokens - 1)  # Not another request's figures


def test_stop_sequence_ends_the_text_before_it(client):
    full = client.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="ar", ignore_eos=True, timeout=300)
    stop = full.text[10:14]
    assert stop.strip(), "test needs a visible stop string"
    cut = client.generate(PROMPTS[0], max_new_tokens=N_TOKENS, decoding="rest", stop=[stop], timeout=300)
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]  # Not including the stop string


def test_chat_messages_use_the_chat_template(client, tokenizer):
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    reply = client.generate(messages=msgs, max_new_tokens=8, decoding="rest", timeout=300)
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert reply.usage.prompt_tokens == len(ids)  # Not the raw text's token count
