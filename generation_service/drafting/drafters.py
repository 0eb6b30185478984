"""Drafters: anything that proposes a draft tree for the current context.

The verify loop only sees this interface; REST, CREST and prompt lookup are interchangeable.
A drafter that cannot answer (retrieval down, deadline missed) raises DraftUnavailable; the loop then
decodes that step autoregressively and marks the request degraded.

Besides propose(), a drafter says whether it is remote (an RPC per step: the loop may skip it while it is
useless, drafting/budget.py), what to draft with in process meanwhile (`local`, None = nothing), and which source
column its trees' estimates belong to when a tree carries no per-source estimates (`default_source`). A remote
drafter may also offer `propose_async(context_ids, max_nodes) -> Future`: the loop then asks its probes after a
skipped stretch in the background instead of waiting for them (engine/requests.py).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ragcore import draft_tree
from ragcore.draft_tree import SOURCES, DraftTree
from ragcore.errors import Unavailable

_DATASTORE, _CONTEXT = SOURCES.index("datastore"), SOURCES.index("context")


class DraftUnavailable(Unavailable):
    """The drafter could not produce a draft this step (the reason is the message)."""


class Drafter(Protocol):
    name: str
    remote: bool  # propose() is a call to another service
    local: "Drafter | None"  # drafts in process while a remote drafter is skipped (None: decode AR)
    default_source: int  # SOURCES column of trees without per-source estimates

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        """context_ids: int32 [T] prompt + generated tokens so far -> tree of at most max_nodes nodes."""
        ...


class PromptLookupDrafter:
    """Prompt lookup (`pld`) as a tree drafter: the continuations of every earlier occurrence of the context's
    longest repeated suffix inside the request's own tokens, merged into one trie. Pure CPU work, in process."""

    name = "pld"
    remote = False
    trusted = True  # its trees come from the project's own kernel over the request's own tokens
    default_source = _CONTEXT

    @property
    def local(self) -> "PromptLookupDrafter":
        return self

    def __init__(self, max_suffix: int = 16, min_suffix: int | None = None, max_matches: int | None = None,
                 continuation: int = 10):
        self._draft = draft_tree.context_draft
        self.kwargs = dict(max_suffix=max_suffix, continuation=continuation,
                           min_suffix=draft_tree.CONTEXT_MIN_SUFFIX if min_suffix is None else min_suffix,
                           max_matches=draft_tree.CONTEXT_MAX_MATCHES if max_matches is None else max_matches)
        draft_tree.check_draft_args(max_nodes=0, **self.kwargs)

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        # The engine's context (prompt + output, int32) is valid by construction, and every step pays the checks
        # after a forward pass has pushed the interpreter out of the caches: skip them for it.
        own = isinstance(context_ids, np.ndarray) and context_ids.dtype == np.int32 and context_ids.flags.c_contiguous
        if own and isinstance(max_nodes, int) and max_nodes >= 0:
            return self._draft(context_ids, max_nodes=max_nodes, checked=False, **self.kwargs)
        return self._draft(context_ids, max_nodes=max_nodes, **self.kwargs)


class DatastoreDrafter:
    """REST over an in-process suffix-array datastore: source "datastore" (`rest-ds`) or "merged" (`rest`: the
    datastore's and the request's own continuations in one trie). The server's gRPC drafter does the same remotely."""

    _NAMES = {"datastore": "rest-ds", "merged": "rest"}
    remote = False
    default_source = _DATASTORE

    @property
    def local(self) -> "DatastoreDrafter":
        return self

    def __init__(self, datastore, source: str = "merged", max_suffix: int = 16, **draft_kwargs):
        if source not in self._NAMES:
            raise ValueError(f"source must be one of {sorted(self._NAMES)}, got {source!r}")
        self.datastore = datastore
        self.source = source
        self.name = self._NAMES[source]
        self.kwargs = dict(max_suffix=max_suffix, **draft_kwargs)

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        return self.datastore.draft(context_ids, max_nodes=max_nodes, source=self.source, **self.kwargs)


class CrestDrafter:
    """CREST (`crest`) in process: the precomputed tree of the context's longest stored n-gram, from an opened
    n-gram store (EmbeddedNgramStore, RedisNgramStore or FallbackNgramStore; see retrieval_service ngram_store).

    Only the datastore's answer: no merge with the request's own tokens, so a benchmark compares the store alone.
    A store that cannot answer (Redis down) raises DraftUnavailable: the verify loop decodes that step AR.
    """

    name = "crest"
    remote = False  # in process; a Redis-backed store answers over the network, but in well under a millisecond
    default_source = _DATASTORE

    @property
    def local(self) -> "CrestDrafter":
        return self

    def __init__(self, store):
        self.store = store

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        try:
            return self.store.lookup(context_ids, max_nodes=max_nodes)
        except Unavailable as e:  # the store's backend (Redis) is down
            raise DraftUnavailable(str(e)) from None
