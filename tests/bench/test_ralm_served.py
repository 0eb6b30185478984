"""bench.ralm --serve: each config becomes the GenerateRequest.rag the in-process loop's RagParams describe, and
the reply's RagStats land in the JSON in seconds, like the in-process rows."""

from __future__ import annotations

import pytest

from bench.ralm import rag_options, rag_params, stats_seconds


@pytest.mark.parametrize("config, speculate, prefetch, os3, async_verify", [
    ("B", False, 20, True, True),  # RaLMSeq: speculation off (the other knobs are RagParams' defaults, unused)
    ("P", True, 20, False, False),
    ("S", True, 0, True, False),  # Not the server default prefetch of 20: 0 is sent explicitly
    ("A", True, 0, False, True),
    ("PSA", True, 20, True, True),
])
def test_rag_options_match_the_in_process_params(config, speculate, prefetch, os3, async_verify):
    opt = rag_options(config, "sr", "local")
    assert (opt.speculate, opt.prefetch, opt.os3, opt.async_verify) == (speculate, prefetch, os3, async_verify)
    assert opt.HasField("prefetch") and opt.HasField("os3") and opt.HasField("async_verify")  # Not left to defaults
    rp = rag_params(config, "sr", "local")
    assert (opt.retriever, opt.encoder, opt.stride, opt.spec_stride) == (rp.retriever, rp.encoder, rp.stride,
                                                                          rp.spec_stride)


def test_b0_is_not_a_request_option():
    with pytest.raises(SystemExit, match="B0"):
        rag_options("B0", "edr", "server")


def test_stats_seconds():
    got = stats_seconds({"retrieval_ms": 1500.0, "rollbacks": 2, "strides": [0, 3], "prefill_tokens": 900})
    assert got == {"retrieval_s": 1.5, "rollbacks": 2, "strides": [0, 3], "prefill_tokens": 900}
    assert "retrieval_ms" not in got


class _Backend:
    """Answers each request with its config's tokens (a config named "X" answers wrongly) after `delay_s`, and
    records the order the configs' cells ran in."""

    def __init__(self, delay_s: dict[str, float]):
        self.delay_s, self.order = delay_s, []

    def run(self, prompt, max_new_tokens, config, retriever):
        import time

        if not self.order or self.order[-1] != config:
            self.order.append(config)
        time.sleep(self.delay_s[config])
        toks = [9] * max_new_tokens if config == "X" else [int(prompt[0])] * max_new_tokens
        stats = {"retrieval_s": 0.0, "generation_s": 0.0, "strides": [0, 3], "prefill_tokens": 10, "prefill_s": 0.0,
                 "kb_calls": 2, "prefetches": 0, "rollbacks": 1 if config == "S" else 0, "wasted_generation_s": 0.0,
                 "verification_wait_s": 0.0}
        return toks, self.delay_s[config], stats


@pytest.mark.parametrize("rounds, order", [
    (1, ["B", "S", "X"]),
    # B S X | X S B | B S X: reversed every other round, B before and after each (adjacent runs of one config merge)
    (3, ["B", "S", "X", "S", "B", "S", "X"]),
])
def test_concurrent_cells_pool_rounds(rounds, order):
    import argparse

    import numpy as np

    from bench.ralm import run_concurrent

    backend = _Backend({"B": 0.01, "S": 0.02, "X": 0.01})
    prompts = [np.array([5]), np.array([7])]
    solo = {(0, "edr"): [5] * 4, (1, "edr"): [7] * 4}
    args = argparse.Namespace(requests_per_client=2, clients=2, rounds=rounds, max_new_tokens=4)
    out = run_concurrent(backend, prompts, ["B", "S", "X"], "edr", args, solo)
    assert backend.order == order
    for c, v in out.items():
        assert v["requests"] == 4 * rounds and len(v["round_tokens_per_s"]) == rounds
        # pooled: all tokens over all the cells' seconds, Not the mean of the rounds' rates
        assert v["tokens_per_s"] == pytest.approx(16 * rounds / v["wall_s"])
        assert v["round_throughput_x"] == [round(t / b, 3) for t, b in zip(v["round_tokens_per_s"],
                                                                          out["B"]["round_tokens_per_s"])]
    # pooled ratio to B: the pooled rates' quotient (arithmetic, not the sleeps' wall-clock ratio, which a loaded
    # machine moves)
    assert out["S"]["throughput_x"] == pytest.approx(out["S"]["tokens_per_s"] / out["B"]["tokens_per_s"])
    assert out["B"]["throughput_x"] == 1.0
    assert out["X"]["identical"] == 0 and out["B"]["identical"] == 4 * rounds
    assert out["S"]["rollbacks"] == 1.0 and out["B"]["rollbacks"] == 0.0  # the cells' mean RaLM stats
