"""The scheduler sees every running request through one protocol: each kind answers all of it."""

from __future__ import annotations

import pytest

from generation_service.engine.scheduled import LoopRun, ScheduledRequest, TreeRun


def _protocol_members() -> set[str]:
    own = {name for name in vars(ScheduledRequest) if not name.startswith("_")}
    return own | set(ScheduledRequest.__annotations__)


def test_the_protocol_is_what_the_scheduler_uses():
    assert {"advance", "in_pass", "prefill_rows", "prefill_segment", "decode_segment", "commit", "cancel",
            "close", "final_chunk", "logprobs", "drafting", "first_step", "chunk"} <= _protocol_members()


@pytest.mark.parametrize("kind", [TreeRun, LoopRun])
def test_every_kind_answers_the_whole_protocol(kind):
    missing = sorted(m for m in _protocol_members() if not hasattr(kind, m))
    assert missing == []  # Not a member the scheduler would call and find missing on one kind
