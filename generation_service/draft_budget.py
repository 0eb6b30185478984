"""Cost-aware draft-tree size: verify only as many nodes as are expected to pay for themselves.

A fixed budget (REST verifies 64 nodes, we default to 32) costs the same on every step, but the tree's worth
varies: a long confident match is worth a deep tree; two thousand scattered matches of a 2-token suffix are
worth little more than an AR step. On this CPU a decode pass grows ~1.3 % per extra node in bf16 (more under load
or with one thread), so a 32-node tree that yields M = 1.5 loses to plain decoding.

Per step, from the drafter's node scores (REST: match counts; merged: per-source normalized counts):
    p(node) = score(node) / Σ score(root children)   the share of matched continuations that start with the
                                                      node's path, i.e. an estimate of its acceptance probability
    E(n)    = α · Σ p over the n best nodes          expected accepted draft tokens (linearity of expectation)
    n*      = argmax_n (1 + E(n)) / (1 + c · n)       tokens per unit of pass cost; n* = 0 (an AR step) if none wins
c is the measured relative cost of one more node (warmup times a pass with and without a tree); α corrects the
datastore's optimism per request: observed accepted / predicted, shrunk toward 1 by a prior. The best n nodes
by score form a connected subtree because a node's score never exceeds its parent's (counts of a longer path);
ancestors are added anyway so any drafter's tree stays valid. Output never changes: only the tree shrinks.
"""

from __future__ import annotations

import numpy as np

DEFAULT_NODE_COST = 0.0125  # bf16, 2 threads: a 32-node pass ~1.4x an AR step (ARCHITECTURE.md table)
PRIOR_WEIGHT = 4.0  # pseudo-tokens behind the initial α = 1


def acceptance_estimates(parents: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """float64 [n] in [0, 1]: each node's score relative to the total score of the root's children."""
    scores = np.maximum(np.asarray(scores, np.float64), 0.0)
    root = float(scores[np.asarray(parents) < 0].sum())
    if root <= 0.0:
        return np.zeros(scores.shape[0])
    return np.minimum(scores / root, 1.0)


def best_size(p_desc: np.ndarray, node_cost: float, alpha: float) -> int:
    """p_desc: acceptance estimates sorted descending -> the node count maximizing tokens per pass cost (0 = AR)."""
    n = p_desc.shape[0]
    if n == 0:
        return 0
    sizes = np.arange(1, n + 1)
    rate = (1.0 + alpha * np.cumsum(p_desc)) / (1.0 + node_cost * sizes)
    k = int(np.argmax(rate))
    return int(sizes[k]) if rate[k] > 1.0 else 0


def keep_best(parents: np.ndarray, scores: np.ndarray, n: int) -> np.ndarray:
    """Indices (ascending) of the n best-scored nodes plus any ancestors they need; parents[i] < i assumed."""
    if n >= parents.shape[0]:
        return np.arange(parents.shape[0])
    chosen = np.zeros(parents.shape[0], bool)
    for i in np.argsort(-np.asarray(scores, np.float64), kind="stable")[:n].tolist():
        while i >= 0 and not chosen[i]:
            chosen[i] = True
            i = int(parents[i])
    return np.flatnonzero(chosen)


def subtree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray,
            keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kept nodes (ancestor-closed, ascending) with parents re-indexed."""
    new_index = np.full(parents.shape[0], -1, np.int64)
    new_index[keep] = np.arange(keep.shape[0])
    kept_parents = parents[keep]
    remapped = np.where(kept_parents < 0, -1, new_index[np.maximum(kept_parents, 0)]).astype(np.int32)
    return tokens[keep], remapped, scores[keep]


class DraftSizer:
    """Chooses each step's tree size for one request and learns α from what the verifier accepted."""

    def __init__(self, node_cost: float = DEFAULT_NODE_COST, prior_weight: float = PRIOR_WEIGHT):
        if not node_cost > 0:
            raise ValueError(f"node_cost must be > 0, got {node_cost}")
        self.node_cost = node_cost
        self.prior_weight = prior_weight
        self.predicted = 0.0
        self.accepted = 0.0
        self._last_prediction = 0.0

    @property
    def alpha(self) -> float:
        return (self.accepted + self.prior_weight) / (self.predicted + self.prior_weight)

    def shrink(self, tokens: np.ndarray, parents: np.ndarray,
               scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The tree cut to its cost-effective size (possibly empty)."""
        p = acceptance_estimates(parents, scores)
        order = np.argsort(-p, kind="stable")
        n = best_size(p[order], self.node_cost, self.alpha)
        keep = keep_best(parents, scores, n)
        self._last_prediction = float(p[keep].sum())
        return subtree(tokens, parents, scores, keep)

    def observe(self, accepted: int) -> None:
        """After verification: how many of the last tree's nodes were accepted."""
        self.predicted += self._last_prediction
        self.accepted += accepted
        self._last_prediction = 0.0
