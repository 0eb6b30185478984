"""Drafters: anything that proposes a draft tree for the current context.

The verify loop only sees this interface; REST, CREST and prompt lookup are interchangeable.
A drafter that cannot answer (retrieval down, deadline missed) raises DraftUnavailable; the loop then
decodes that step autoregressively and marks the request degraded.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from retrieval_service.datastore.draft_tree import DraftTree


class DraftUnavailable(RuntimeError):
    """The drafter could not produce a draft this step (the reason is the message)."""


class Drafter(Protocol):
    name: str

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        """context_ids: int32 [T] prompt + generated tokens so far -> tree of at most max_nodes nodes."""
        ...
