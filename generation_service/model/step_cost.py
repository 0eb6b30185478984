"""What a forward pass costs by its rows, from the calibrated curve (engine/calibrate.py): the unit in which the
draft budget (drafting/budget.py), the engine's batching and the thread governor weigh a pass.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DEFAULT_NODE_COST = 0.0125  # a linear curve for models that were never calibrated (tests, tools)
TREE_MS = 0.25  # per verified tree, outside the forward pass (nearly the same for small and large trees)


class StepCost:
    """rel(n): cost of a decode step verifying n draft nodes relative to an AR step, from a measured curve.

    rows / ms: the calibrated pass curve (rows = 1 + nodes, ascending from 1). Between points the curve is linear;
    past the last point it continues with the last segment's slope; it is made non-decreasing (a pass with more
    rows never costs less). A tree also costs tree_ms outside the pass (acceptance walk, KV gather, layout), which
    matters where a 1-node pass costs the same as the AR step (bf16 AR steps carry a pad row).
    """

    def __init__(self, rows: Sequence[int], ms: Sequence[float], max_nodes: int = 256, tree_ms: float = TREE_MS,
                 measured: bool = True):
        rows = np.asarray(rows, np.float64)
        ms = np.asarray(ms, np.float64)
        if rows.ndim != 1 or rows.shape != ms.shape or rows.shape[0] < 1 or rows[0] != 1 or np.any(ms <= 0):
            raise ValueError(f"a step-cost curve needs positive ms for rows starting at 1, got {rows}, {ms}")
        q = np.arange(1, max_nodes + 2, dtype=np.float64)
        cost = np.interp(q, rows, ms)
        if rows.shape[0] >= 2:
            slope = max((ms[-1] - ms[-2]) / (rows[-1] - rows[-2]), 0.0)
            cost = np.where(q > rows[-1], ms[-1] + slope * (q - rows[-1]), cost)
        cost = np.minimum.accumulate(cost[::-1])[::-1]
        # Absolute pass cost by rows (no tree overhead), for batches of several sequences (batch_sizes).
        self._rows, self._ms = rows, np.minimum.accumulate(np.asarray(ms)[::-1])[::-1]
        self._slope = max((ms[-1] - ms[-2]) / (rows[-1] - rows[-2]), 0.0) if rows.shape[0] >= 2 else 0.0
        cost[1:] += tree_ms
        self.tree_ms = tree_ms
        self.measured = measured  # ms of this machine (False: a generic curve in units of an AR step)
        self.rel = cost / cost[0]  # [max_nodes + 1], rel[n] for n draft nodes (rel[0] = 1)
        # A tree of n nodes emits at most n + 1 tokens: past this size no tree can pay for its pass.
        pays = np.flatnonzero(self.rel < 1.0 + np.arange(self.rel.shape[0]))
        self.max_nodes = int(pays.max()) if pays.shape[0] else 0

    @property
    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """The calibrated curve: rows and ms per pass (made non-decreasing), as measured."""
        return self._rows, self._ms

    @classmethod
    def linear(cls, node_cost: float = DEFAULT_NODE_COST) -> "StepCost":
        if not node_cost > 0:
            raise ValueError(f"node_cost must be > 0, got {node_cost}")
        return cls([1, 65], [1.0, 1.0 + 64 * node_cost], tree_ms=0.0, measured=False)

    def relative(self, nodes: np.ndarray | int) -> np.ndarray:
        return self.rel[np.minimum(np.asarray(nodes), self.rel.shape[0] - 1)]

    def pass_ms(self, rows: np.ndarray | int) -> np.ndarray:
        """ms of one pass with `rows` rows in total (linear between measured points, the last slope beyond)."""
        r = np.asarray(rows, np.float64)
        inside = np.interp(r, self._rows, self._ms)
        return np.where(r > self._rows[-1], self._ms[-1] + self._slope * (r - self._rows[-1]), inside)
