"""The rows a retrieval-augmented request reserves for its passage: the engine admits a request by the KV rows it
may need before any passage is known, and the RaLM loops cut passages to the same budget.
"""

from __future__ import annotations

from typing import Protocol


class PassageLimits(Protocol):
    """The two limits of a request's retrieval parameters that bound its passage (ralm/loop.py's RagParams)."""

    max_passage_tokens: int
    max_prompt_tokens: int


def passage_budget(prompt_len: int, rag: PassageLimits) -> int:
    """Model tokens left for the passage (separator included): <= max_passage_tokens, passage + prompt fits."""
    return max(0, min(rag.max_passage_tokens, rag.max_prompt_tokens - prompt_len))
