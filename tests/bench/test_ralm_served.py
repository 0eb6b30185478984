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
