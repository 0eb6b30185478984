"""The calibrated pass-cost curve, corrected in service by the passes the engine actually runs.

Why: the start-up calibration times each row count a few times on a machine that is doing other things, and its
shape varies from start to start more than the sizer can afford: on one 2-core machine rel(15) — what a 15-node tree
costs against an AR step — varied by a third across start-ups, and the trees the sizer chose (and the served
tokens/s) followed the noise. The engine times every pass anyway; this turns those
timings into a correction of the curve's shape, so the sizer decides on what passes cost now.

The fit: pass_ms is linear between calibration points, so a corrected curve m_j x ms_j (one multiplier per point)
predicts a pass of `rows` rows at sum_j w_j m_j times its calibrated cost, w_j being point j's share of that cost
(spread: the two points bracketing rows). Each pass gives one equation
    ratio = measured ms (less the per-sequence part outside the curve) / calibrated pass_ms(rows)  ~  w . m
and m solves the decayed least squares over the passes so far, ridged toward the overall ratio g:
    (A + PRIOR I) m = b + PRIOR g,     A = sum lambda^age w w^T,  b = sum lambda^age w ratio
A joint fit, not a per-point average: a pass of 24 rows says how 16 and 32 rows cost together, and passes of 20 and
28 rows then separate them. A point no pass has touched lately follows g (the machine's overall slowdown), so a
size the sizer stopped choosing is judged by the calibrated shape again. In a simulation of this machine's two
start-ups (tests/generation/test_pass_costs.py) the corrected sizer came close to the tokens per ms of sizing on
the true curve, clearly closer than the calibrated curve alone.

Only passes without prompt chunks, at the thread count the curve was calibrated for, are recorded: a chunk's rows
cost what prefill costs, not what decode rows do, and another thread count has another curve (engine/threads.py
corrects for contention by switching counts; this corrects the shape at the serving count).
"""
from __future__ import annotations

import numpy as np

from generation_service.model.step_cost import StepCost

FORGET = 0.995  # lambda per pass: the fit remembers the last ~200 passes (a few seconds of serving)
PRIOR = 1.0  # ridge weight toward the overall ratio, in passes
GLOBAL_ALPHA = 0.05  # EWMA weight of one pass in the overall ratio g
MAX_RATIO = 3.0  # a pass 3x off the curve is a stall (GC, a lost core), not its shape; multipliers stay within it
REBUILD_PASSES = 32  # a new fit and StepCost this often (not free per pass; sizes change little pass to pass)


def spread(points: np.ndarray, ms: np.ndarray, rows: float) -> np.ndarray:
    """float64 [P]: each calibration point's share of the calibrated cost of a pass over `rows` rows. The curve is
    linear in rows between points, so pass_ms = (1 - t) ms_j + t ms_j+1: point j's share is (1 - t) ms_j / pass_ms.
    Outside the calibrated range all of it is the end point's.
        spread([1, 2, 4, 8], [6, 6, 8, 12], 3) -> [0, 3/7, 4/7, 0]     (t = 1/2: 3 ms from 2 rows, 4 from 4 rows)
    """
    w = np.zeros(points.shape[0])
    j = int(np.searchsorted(points, rows, side="right")) - 1
    if j < 0:
        w[0] = 1.0
    elif j >= points.shape[0] - 1:
        w[-1] = 1.0
    else:
        t = (rows - points[j]) / (points[j + 1] - points[j])
        lo, hi = (1.0 - t) * ms[j], t * ms[j + 1]
        w[j], w[j + 1] = lo / (lo + hi), hi / (lo + hi)
    return w


class PassCosts:
    """The calibrated StepCost `base`, corrected by record()ed passes; `cost` is the curve to size trees with.

        live = PassCosts(tm.step_cost)
        live.record(rows, ms, fixed_ms=(sequences - 1) * segment_ms)   # after each decode pass
        batch_sizes(p, live.cost, ...)
    """

    def __init__(self, base: StepCost, rebuild_passes: int = REBUILD_PASSES):
        self.base = base
        self.rows, self._calibrated_ms = base.points  # calibration points
        n = self.rows.shape[0]
        self._a = np.zeros((n, n))  # decayed sum of w w^T
        self._b = np.zeros(n)  # decayed sum of w x ratio
        self.overall = 1.0  # g: measured / calibrated over all passes (EWMA)
        self.passes = 0
        self.rebuild_passes = max(1, rebuild_passes)
        self.cost = base
        # Passes recorded but not yet in the fit: (rows, ms outside the fixed part). The fit only shows in `cost`,
        # rebuilt every rebuild_passes, so the passes are folded in then, all at once. Why not per pass: right after
        # a forward pass the interpreter runs cold, and there the dozen small array operations of one pass cost a
        # few percent of an AR step, on every pass of every request.
        self._pending: list[tuple[int, float]] = []

    def record(self, rows: int, ms: float, fixed_ms: float = 0.0) -> None:
        """A pass over `rows` rows (no prompt chunk) took `ms`, of which `fixed_ms` is outside the curve (the other
        sequences' attention and bookkeeping)."""
        self._pending.append((rows, ms - fixed_ms))
        if len(self._pending) >= self.rebuild_passes:
            self._fold()

    def _fold(self) -> None:
        """The pending passes into the fit, in their order (the decays applied as pass-by-pass recording would), and
        the curve rebuilt from it."""
        pending, self._pending = self._pending, []
        rows = np.array([r for r, _ in pending], np.float64)
        own = np.array([o for _, o in pending], np.float64)
        calibrated = self.base.pass_ms(rows)
        ok = (rows >= 1) & np.isfinite(own) & (own > 0) & (calibrated > 0)
        if not ok.any():
            return
        rows, ratio = rows[ok], np.clip(own[ok] / calibrated[ok], 1.0 / MAX_RATIO, MAX_RATIO)
        n = ratio.shape[0]
        w = np.stack([spread(self.rows, self._calibrated_ms, r) for r in rows.tolist()])  # [n, P]
        age = FORGET ** np.arange(n - 1, -1, -1)  # pass k is n - 1 - k passes old at the end
        self._a = FORGET ** n * self._a + np.einsum("k,ki,kj->ij", age, w, w)
        self._b = FORGET ** n * self._b + (age * ratio) @ w
        if self.passes == 0:  # the first pass ever sets the overall ratio, the EWMA goes on from it
            self.overall, ratio = float(ratio[0]), ratio[1:]
        keep = 1 - GLOBAL_ALPHA
        m = ratio.shape[0]
        self.overall = keep ** m * self.overall + float(GLOBAL_ALPHA * (keep ** np.arange(m - 1, -1, -1)) @ ratio)
        self.passes += n
        self.cost = self.corrected()

    def multipliers(self) -> np.ndarray:
        """float64 [P]: m_j, each calibration point's measured / calibrated cost."""
        n = self.rows.shape[0]
        m = np.linalg.solve(self._a + PRIOR * np.eye(n), self._b + PRIOR * self.overall)
        return np.clip(m, 1.0 / MAX_RATIO, MAX_RATIO)

    def corrected(self) -> StepCost:
        return StepCost(self.rows, self._calibrated_ms * self.multipliers(), max_nodes=self.base.rel.shape[0] - 1,
                        tree_ms=self.base.tree_ms, measured=self.base.measured)

    def report(self) -> str:
        return " ".join(f"{int(r)}:{m:.1f}" for r, m in zip(self.rows, self.cost.points[1])) + \
            f" ms (calibrated x{self.overall:.2f} overall, {self.passes} passes)"
