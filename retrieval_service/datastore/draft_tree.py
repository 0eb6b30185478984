"""Draft trees: the value every drafter returns and the wire carries.

A tree of n draft tokens in BFS order. `parents[i]` is the index of node i's parent, or -1 when node i
is a child of the context's last token. BFS order means parents[i] < i, and depth never decreases.

Worked example: continuations "a b", "a c", "d" give
    tokens  = [a, d, b, c]
    parents = [-1, -1, 0, 0]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class DraftTree:
    tokens: np.ndarray  # int32 [n]
    parents: np.ndarray  # int32 [n], -1 = child of the context's last token
    scores: np.ndarray = field(default=None)  # float32 [n], the weight used to select the node
    matched_suffix: int = 0  # datastore suffix length that matched (0 = none)
    num_matches: int = 0  # datastore occurrences used
    context_matched_suffix: int = 0  # suffix length matched inside the request's own context

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", np.ascontiguousarray(self.tokens, dtype=np.int32))
        object.__setattr__(self, "parents", np.ascontiguousarray(self.parents, dtype=np.int32))
        scores = np.ones(len(self.tokens), np.float32) if self.scores is None else self.scores
        object.__setattr__(self, "scores", np.ascontiguousarray(scores, dtype=np.float32))

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

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
    def to_bytes(self) -> tuple[bytes, bytes, bytes]:
        return (
            self.tokens.astype("<u4").tobytes(),
            self.parents.astype("<i4").tobytes(),
            self.scores.astype("<f4").tobytes(),
        )

    @staticmethod
    def from_bytes(tokens: bytes, parents: bytes, scores: bytes = b"", **meta: int) -> "DraftTree":
        t = np.frombuffer(tokens, dtype="<u4").astype(np.int32)
        p = np.frombuffer(parents, dtype="<i4").astype(np.int32)
        s = np.frombuffer(scores, dtype="<f4").astype(np.float32) if scores else None
        return DraftTree(t, p, s, **meta)
