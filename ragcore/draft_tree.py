"""Draft trees: the value every drafter returns and the wire carries.

A tree of n draft tokens in BFS order. `parents[i]` is the index of node i's parent, or -1 when node i
is a child of the context's last token. BFS order means parents[i] < i, and depth never decreases.

Worked example: continuations "a b", "a c", "d" give
    tokens  = [a, d, b, c]
    parents = [-1, -1, 0, 0]

context_draft() is prompt lookup inside the request's own tokens: a pure function over the context (its numba
kernel lives in draft_kernels.py), used by the generation worker's local `pld` drafter and by the "context" source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ragcore.draft_kernels import N_SOURCES, SRC_CONTEXT, SRC_DATASTORE, SRC_LEARNED, context_tree
from ragcore.wire import pack_array, read_array

# Columns of DraftTree.source_p: where a node's continuation evidence came from.
SOURCES = ("datastore", "context", "learned")
assert len(SOURCES) == N_SOURCES and (SRC_DATASTORE, SRC_CONTEXT, SRC_LEARNED) == (0, 1, 2)


@dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n], -1 = child of the context's last token
    scores: np.ndarray = field(default=None)  # float32 [n], the weight used to select the node
    matched_suffix: int = 0  # datastore suffix length that matched (0 = none)
    num_matches: int = 0  # datastore occurrences used
    context_matched_suffix: int = 0  # suffix length matched inside the request's own context
    # float32 [n, len(SOURCES)]: per source, the share of that source's continuations that start with the node's
    # path (its own estimate that the node will be accepted); None when the drafter does not say (CREST trees).
    source_p: np.ndarray | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", np.ascontiguousarray(self.tokens, dtype=np.int32))
        object.__setattr__(self, "parents", np.ascontiguousarray(self.parents, dtype=np.int32))
        scores = np.ones(len(self.tokens), np.float32) if self.scores is None else self.scores
        object.__setattr__(self, "scores", np.ascontiguousarray(scores, dtype=np.float32))
        if self.source_p is not None:
            p = np.ascontiguousarray(self.source_p, dtype=np.float32).reshape(len(self.tokens), N_SOURCES)
            object.__setattr__(self, "source_p", p)

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32),
                         source_p=np.zeros((0, N_SOURCES), np.float32))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def follow(self, tokens) -> list[int]:
        """The nodes along the longest path from the root whose tokens are a prefix of `tokens` (their indices,
        shallowest first): how far this tree foresaw a continuation."""
        path: list[int] = []
        parent = -1
        for t in np.asarray(tokens).tolist():
            hit = np.flatnonzero((self.parents == parent) & (self.tokens == t))
            if hit.shape[0] == 0:
                break
            parent = int(hit[0])
            path.append(parent)
        return path

    def depths(self) -> np.ndarray:
        """1-based depth of every node (a root child has depth 1)."""
        d = np.zeros(len(self), np.int32)
        for i, p in enumerate(self.parents):
            d[i] = 1 if p < 0 else d[p] + 1
        return d

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError if the tree breaks the BFS / parent invariants."""
        n = len(self)
        if self.parents.shape != (n,) or self.scores.shape != (n,):
            raise ValueError(f"tokens/parents/scores lengths differ: {n}, {self.parents.shape}, {self.scores.shape}")
        idx = np.arange(n)
        if np.any(self.parents >= idx) or np.any(self.parents < -1):
            raise ValueError(f"parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}")
        d = self.depths()
        if n > 1 and np.any(np.diff(d) < 0):
            raise ValueError(f"nodes are not in BFS order (depths {d.tolist()})")
        if vocab_size is not None and n and (self.tokens.min() < 0 or self.tokens.max() >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size}), got {self.tokens.min()}..{self.tokens.max()}")
        # Siblings must differ, otherwise the verifier would waste nodes on duplicates.
        pairs = set()
        for p, t in zip(self.parents.tolist(), self.tokens.tolist()):
            if (p, t) in pairs:
                raise ValueError(f"duplicate child token {t} under parent {p}")
            pairs.add((p, t))

    def paths(self) -> list[list[int]]:
        """Token path from the root to every node (for tests and debugging)."""
        out: list[list[int]] = []
        for i, p in enumerate(self.parents.tolist()):
            out.append((out[p] if p >= 0 else []) + [int(self.tokens[i])])
        return out

    # Wire format: packed little-endian bytes (see proto/draft.proto).
    def to_bytes(self) -> tuple[bytes, bytes, bytes, bytes]:
        """-> (tokens, parents, scores, source_p); source_p is b"" when the tree carries none."""
        return (pack_array(self.tokens, "<u4"), pack_array(self.parents, "<i4"), pack_array(self.scores, "<f4"),
                pack_array(self.source_p, "<f4") if self.source_p is not None else b"")

    @staticmethod
    def from_bytes(tokens: bytes, parents: bytes, scores: bytes = b"", source_p: bytes = b"",
                   **meta: int) -> "DraftTree":
        """Raises ValueError when the byte lengths do not describe one tree."""
        t = read_array(tokens, "<u4").astype(np.int32)
        p = read_array(parents, "<i4")
        s = read_array(scores, "<f4") if scores else None
        sp = None
        if source_p:
            sp = read_array(source_p, "<f4")
            if sp.shape[0] != t.shape[0] * N_SOURCES:
                raise ValueError(f"source_p holds {sp.shape[0]} values, expected {t.shape[0]} x {N_SOURCES}")
        return DraftTree(t, p, s, source_p=sp, **meta)


# Prompt-lookup defaults, tuned with bench/draft_simulation.py (greedy HumanEval outputs of SmolLM2-135M, first
# 26 prompts, merged drafter, 32 nodes): min suffix 1 -> M 3.37 (2 -> 3.21, 3 -> 2.99); 64 matches = 512
# (8 -> 3.35); in the merged trie 24-token context continuations beat 10/16/32 (3.37 vs 3.25/3.33/3.33).
# context_draft keeps REST's 10-token continuation by default (24 gives M 2.62 vs 2.50 context-only).
CONTEXT_MIN_SUFFIX = 1
CONTEXT_MAX_MATCHES = 64
CONTEXT_CONTINUATION = 24


def as_context(context_ids, name: str = "context_ids") -> np.ndarray:
    """Boundary check: any 1-D integer sequence of non-negative token ids -> contiguous int32 [T]."""
    ctx = np.asarray(context_ids)
    if ctx.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {ctx.shape}")
    if ctx.size == 0:
        return np.zeros(0, np.int32)
    if not np.issubdtype(ctx.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {ctx.dtype}")
    lo, hi = int(ctx.min()), int(ctx.max())
    if lo < 0 or hi > np.iinfo(np.int32).max:
        raise ValueError(f"{name} token ids must lie in [0, 2**31), got {lo}..{hi}")
    return np.ascontiguousarray(ctx, dtype=np.int32)


def check_draft_args(max_suffix: int, min_suffix: int, max_matches: int, continuation: int, max_nodes: int,
                     prefix: str = "") -> None:
    """Raise ValueError naming the first bad drafting knob."""
    for name, value, low in (("max_suffix", max_suffix, 1), (prefix + "min_suffix", min_suffix, 1),
                             (prefix + "max_matches", max_matches, 1), (prefix + "continuation", continuation, 1),
                             ("max_nodes", max_nodes, 0)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if min_suffix > max_suffix:
        raise ValueError(f"{prefix}min_suffix {min_suffix} exceeds max_suffix {max_suffix}")


def context_draft(context_ids, max_suffix: int = 16, min_suffix: int = CONTEXT_MIN_SUFFIX,
                  max_matches: int = CONTEXT_MAX_MATCHES, continuation: int = 10, max_nodes: int = 64,
                  checked: bool = True) -> DraftTree:
    """Prompt-lookup draft from the request's own tokens (pure function; no datastore).

    The longest suffix of the context (max_suffix down to min_suffix) that occurred earlier in it; the tokens
    that followed its most recent `max_matches` occurrences form a counted trie; the `max_nodes` most frequent
    nodes come back in BFS order. context_matched_suffix is that suffix length (0 = no repeat).
    checked=False: the caller vouches for the context (a contiguous int32 array of valid ids) and the limits (its
    own, checked once), as the generation worker does for a request's tokens on every step.

        >>> context_draft([3, 4, 5, 3, 4, 6, 3, 4], min_suffix=2, continuation=1).paths()
        [[5], [6]]
    """
    if checked:
        ctx = as_context(context_ids)
        check_draft_args(max_suffix, min_suffix, max_matches, continuation, max_nodes)
    else:
        ctx = context_ids
    tok, par, score, src_p, matched, _ = context_tree(ctx, max_suffix, min_suffix, max_matches, continuation,
                                                      max_nodes)
    return DraftTree(tok, par, score, context_matched_suffix=int(matched), source_p=src_p)


def warmup_context_draft() -> None:
    """Load context_draft's compiled kernel (from numba's disk cache, or compile it once): call at start-up."""
    context_draft(np.zeros(4, np.int32))
