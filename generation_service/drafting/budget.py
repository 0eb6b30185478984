"""How much of each draft tree to verify: measured pass costs against live, per-source acceptance estimates.

A fixed budget costs the same on every step, but a tree's worth varies: a long confident match is worth a deep
tree, two thousand scattered matches of a 2-token suffix are worth little more than an AR step, and what a pass
with n more rows costs depends on the machine (engine/calibrate.py: 16 nodes add a fraction of an AR step on one CPU,
several AR steps on another).

Per step, from the drafter's per-source estimates (DraftTree.source_p; SOURCES = datastore, context, learned):
    p_s(node) = the share of source s's continuations that start with the node's path (its acceptance estimate)
    p(node)   = min(1, max_s alpha_s * p_s(node))      the most confident calibrated source decides
    E(n)      = sum of p over the n best nodes          expected accepted draft tokens (linearity of expectation)
    n*        = argmax_n (1 + E(n)) / rel(n)            tokens per unit of pass cost, rel(n) = cost(1 + n) / cost(1)
                                                        from the calibrated curve; n* = 0 is a plain AR step
alpha_s calibrates source s on the nodes it decided (the owner of a node is its argmax source): decayed accepted
over decayed predicted, shrunk toward a prior, kept separately per length of the suffix the source matched
(1, 2-3, 4-7, 8+ tokens): a one-token coincidence and a real repetition of the output are different evidence, so
a request whose short matches kept missing still verifies a deep tree the moment its output starts repeating
itself. A source that keeps hitting keeps a deep tree whatever the other sources do. Evidence fades by DECAY per
step in which the estimate was tested and by IDLE_DECAY otherwise, so after a bad stretch alpha drifts back
toward the prior and the source is tried again — rarely, so a source that stays wrong costs little.

The pooled calibration. A request lives ~100 steps, too few to learn alpha from scratch, and the raw shares are
far from calibrated: on HumanEval and MT-Bench requests over the code datastore (bench.speculative), datastore
nodes of 2-3-token matches and context nodes of 1-token matches were accepted a small fraction as often as their
share predicted. Alone that costs little (a pass of a few rows costs little more than an AR step), but in a batch
every extra row costs about what an AR token costs. So a worker pools the evidence of all its requests per (source,
suffix bucket, depth bucket) (SharedCalibration), and a node's estimate is
    p(node) = min(1, max_s raw_s(node) * pooled_s(bucket, depth) * alpha_s(bucket))
where alpha_s, this request's own correction, starts at 1 and measures accepted tokens against the pooled
estimates. Without a pooled calibration (a request decoded alone in process) pooled = 1.

Skipping the draft RPC. A remote source (the retrieval service's datastore, its learned shards, CREST) whose
drafts on two steps in a row gave no accepted token of its own (no node it decided was accepted: nodes the
request's own tokens also predict do not count) is not asked for the next 1, 2, 4 ... 16 steps (one useless probe
after a skipped stretch doubles it; reset by an accepted node). An RPC costs a small fraction of a step, so a
source that never helps costs at most a few percent, and one that does is asked every step. The request's own
tokens are drafted in process meanwhile when the mode has them (`rest`). Such a mode does not wait for the probe
after a skipped stretch either: the probe is asked in the background, the step runs on the in-process draft, and
the answer is judged against the tokens that step emitted (engine/requests.py): on a 2-core host an RPC waited
for costs about a third of a 1-row step, and in chat nearly every probe finds nothing. A curve on which no tree can ever pay
(rel(n) >= 1 + n for every n) never drafts.

The best n nodes by p form a connected subtree: every source's p of a child is at most its parent's (the child's
continuations are a subset), so the max is too; ancestors are added anyway so any drafter's tree stays valid.
Output never changes: only the tree shrinks.
"""

from __future__ import annotations

from typing import Sequence

import numba as nb
import numpy as np

from generation_service.model.step_cost import StepCost
from ragcore.draft_tree import SOURCES

PRIOR_WEIGHT = 2.0  # pseudo-tokens behind the initial alpha = 1
DECAY = 0.9  # per step in which an estimate was tested: it remembers about ten tests
IDLE_DECAY = 0.97  # per step without a test: evidence fades slowly, so a bad source is retried now and then
SHARED_DECAY = 0.998  # per test of a pooled cell: it remembers the last ~500 trees that tested it
# Per tree, for the pooled cells it did not test: a cell whose nodes stopped being chosen (its estimate fell) drifts
# back toward 1 and is tried again, after ~1400 trees.
SHARED_IDLE_DECAY = 0.9995
SUFFIX_BUCKETS = np.array([2, 4, 8])  # matched-suffix lengths 1 | 2-3 | 4-7 | 8+ (0 = no match counts as 1)
DEPTH_BUCKETS = np.array([2, 3, 5])  # a node's depth in its tree: 1 | 2 | 3-4 | 5+
MAX_BACKOFF = 16  # steps a useless remote source is skipped, at most
USELESS_BEFORE_BACKOFF = 2
N_SOURCES = len(SOURCES)
STATE_VERSION = 1  # SharedCalibration.to_json's layout
LOCAL_CONTEXT = SOURCES.index("context")
LOCAL_SOURCES = frozenset({LOCAL_CONTEXT})  # drafted in process, never an RPC


def acceptance_estimates(parents: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """float64 [n] in [0, 1]: each node's score relative to the total score of the root's children (for trees
    without per-source estimates, e.g. CREST's precomputed trees)."""
    scores = np.maximum(np.asarray(scores, np.float64), 0.0)
    root = float(scores[np.asarray(parents) < 0].sum())
    if root <= 0.0:
        return np.zeros(scores.shape[0])
    return np.minimum(scores / root, 1.0)


def best_size(p_desc: np.ndarray, cost: StepCost) -> int:
    """p_desc: acceptance estimates sorted descending -> the node count maximizing tokens per pass cost (0 = AR)."""
    n = min(p_desc.shape[0], cost.rel.shape[0] - 1)
    if n == 0:
        return 0
    sizes = np.arange(1, n + 1)
    rate = (1.0 + np.cumsum(p_desc[:n])) / cost.relative(sizes)
    k = int(np.argmax(rate))
    return int(sizes[k]) if rate[k] > 1.0 else 0


def batch_sizes(p: Sequence[np.ndarray], cost: StepCost, base_rows: int, segments: int,
                segment_ms: float = 0.0, base_tokens: int | None = None) -> list[int]:
    """Draft nodes to verify per sequence of a batched pass, for the most tokens per ms over the whole batch.

    p[i]: sequence i's node acceptance estimates; base_rows: rows the pass carries anyway (each decoding sequence's
    last token and pad rows, other requests' AR rows); segments: sequences in the pass, each adding segment_ms (its
    own attention and bookkeeping); base_tokens: tokens the pass emits without any node (default: one per p[i]).
    Expected tokens = base_tokens + the sum of p over the chosen nodes; the
    nodes are taken best first across all sequences, so a confident tree of one request outbids a weak one of
    another, and the more rows the batch already has the fewer extra nodes pay. One sequence alone gives
    best_size's answer (up to tree_ms).
        batch_sizes([np.array([.9, .5]), np.array([.1])], cost, base_rows=2, segments=2) -> e.g. [2, 0]
    """
    owner = np.concatenate([np.full(len(pi), i) for i, pi in enumerate(p)]) if p else np.zeros(0, np.int64)
    allp = np.concatenate([np.asarray(pi, np.float64) for pi in p]) if p else np.zeros(0)
    counts = [0] * len(p)
    if allp.shape[0] == 0:
        return counts
    order = np.argsort(-allp, kind="stable")
    k = np.arange(allp.shape[0] + 1)
    fixed = segments * segment_ms + cost.tree_ms * len(p)
    base = len(p) if base_tokens is None else base_tokens
    rate = (base + np.concatenate(([0.0], np.cumsum(allp[order])))) / (cost.pass_ms(base_rows + k) + fixed)
    best = int(np.argmax(rate))
    for i in owner[order[:best]].tolist():
        counts[i] += 1
    return counts


def keep_best(parents: np.ndarray, p: np.ndarray, n: int) -> np.ndarray:
    """Indices (ascending) of the n nodes with the highest p plus any ancestors they need; parents[i] < i."""
    if n >= parents.shape[0]:
        return np.arange(parents.shape[0])
    chosen = np.zeros(parents.shape[0], bool)
    for i in np.argsort(-np.asarray(p, np.float64), kind="stable")[:n].tolist():
        while i >= 0 and not chosen[i]:
            chosen[i] = True
            i = int(parents[i])
    return np.flatnonzero(chosen)


def subtree(keep: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Parents of the kept nodes (ancestor-closed, ascending), re-indexed into the kept set."""
    new_index = np.full(parents.shape[0], -1, np.int64)
    new_index[keep] = np.arange(keep.shape[0])
    kept_parents = parents[keep]
    return np.where(kept_parents < 0, -1, new_index[np.maximum(kept_parents, 0)]).astype(np.int32)


def source_estimates(parents: np.ndarray, scores: np.ndarray, source_p: np.ndarray | None,
                     default_source: int) -> np.ndarray:
    """float64 [n, N_SOURCES]: the tree's own per-source estimates, or score shares in `default_source`'s column."""
    if source_p is not None:
        return np.asarray(source_p, np.float64)
    p = np.zeros((parents.shape[0], N_SOURCES))
    p[:, default_source] = acceptance_estimates(parents, scores)
    return p


def node_depths(parents: np.ndarray) -> np.ndarray:
    """int64 [n]: each node's depth (1 = a child of the root); parents[i] < i."""
    depth = np.zeros(parents.shape[0], np.int64)
    for i, parent in enumerate(parents.tolist()):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    return depth


def suffix_bucket(matched: int) -> int:
    """Matched-suffix length -> calibration bucket (SUFFIX_BUCKETS)."""
    return int(np.searchsorted(SUFFIX_BUCKETS, max(int(matched), 1), side="right"))


def tree_buckets(matched_suffix: int, context_matched_suffix: int) -> np.ndarray:
    """int [N_SOURCES]: each source's bucket for one draft (the learned shards are searched with the datastore's
    suffix)."""
    out = np.empty(N_SOURCES, np.int64)
    out[:] = suffix_bucket(matched_suffix)
    out[LOCAL_CONTEXT] = suffix_bucket(context_matched_suffix)
    return out


# The per-node arithmetic of DraftSizer.estimate and .observe, one compiled call each. Why: a request's step ran ~25
# numpy calls on arrays of a few nodes here, each paid again in cache misses after the forward pass had pushed the
# interpreter out of the caches (tens of us per request a step at 8 clients). The values are
# those of the numpy expressions they replace (the same float64 operations in the same order). The GIL is kept:
# released for a few microseconds, it may go to a gRPC thread and the model thread waits for it back.
_KERNEL = dict(cache=True)


@nb.njit(**_KERNEL)
def _node_estimates(parents, raw, buckets, req_predicted, req_accepted, req_prior, shared_predicted,
                    shared_accepted, shared_prior, use_shared, depth_edges):
    """parents int32 [n], raw float64 [n, S], buckets int64 [S]; the request's evidence [S * nb] and the pooled one
    [S * nb * nd] (flat) -> (p, request cell, pooled cell, raw share, pooled estimate) of each node's owner source
    (the first of the largest calibrated estimates; p capped at 1)."""
    n, n_sources = raw.shape
    nb_ = req_predicted.shape[0] // n_sources
    nd = shared_predicted.shape[0] // (n_sources * nb_)
    p = np.empty(n)
    cell = np.empty(n, np.int64)
    pooled_cell = np.zeros(n, np.int64)
    raw_out = np.empty(n)
    pooled_out = np.empty(n)
    depth = np.empty(n, np.int64)
    for i in range(n):
        d = 1 if parents[i] < 0 else depth[parents[i]] + 1
        depth[i] = d
        db = 0
        while db < depth_edges.shape[0] and depth_edges[db] <= d:
            db += 1
        for s in range(n_sources):
            c = s * nb_ + buckets[s]
            if use_shared:
                pc = c * nd + db
                pooled = raw[i, s] * ((shared_accepted[pc] + shared_prior) / (shared_predicted[pc] + shared_prior))
            else:
                pc = 0
                pooled = raw[i, s]
            scaled = pooled * ((req_accepted[c] + req_prior) / (req_predicted[c] + req_prior))
            if s == 0 or scaled > p[i]:
                p[i], cell[i], pooled_cell[i], raw_out[i], pooled_out[i] = scaled, c, pc, raw[i, s], pooled
        p[i] = min(p[i], 1.0)
    return p, cell, pooled_cell, raw_out, pooled_out


@nb.njit(**_KERNEL)
def _fade_and_add(predicted, accepted, tested, decay, idle_decay, added_cells, added, hit_cells):
    """In place, flat: every cell fades by idle_decay, the tested ones by decay instead; then predicted[added_cells]
    += added and accepted[hit_cells] += 1 (np.add.at's order: repeated cells add up)."""
    factor = np.full(predicted.shape[0], idle_decay)
    for c in tested:
        factor[c] = decay
    for j in range(predicted.shape[0]):
        predicted[j] *= factor[j]
        accepted[j] *= factor[j]
    for j in range(added_cells.shape[0]):
        predicted[added_cells[j]] += added[j]
    for j in range(hit_cells.shape[0]):
        accepted[hit_cells[j]] += 1.0


_NO_CELLS = np.zeros(0, np.int64)


def warmup_sizer() -> None:
    """Load the sizer's compiled kernels (from numba's disk cache, or compile them once): call at start-up."""
    sizer = DraftSizer(StepCost.linear(), shared=SharedCalibration())
    parents = np.array([-1, 0], np.int32)
    sizer.estimate(parents, np.ones(2, np.float32), np.full((2, N_SOURCES), 0.5, np.float32), 0)
    sizer.keep(np.arange(2))
    sizer.expect(np.arange(2))
    sizer.observe([0])


class SharedCalibration:
    """Acceptance evidence pooled over every request of one worker, per (source, suffix bucket, depth bucket).

    Depth too, because a source's share says little about it: one earlier occurrence gives share 1 at every depth
    of its continuation, while the model accepts depth d only after 1..d-1. Tested cells fade by SHARED_DECAY per
    tree, the others by SHARED_IDLE_DECAY: a cell whose estimate fell so low that its nodes are no longer chosen
    still comes back to be tested. Updated on the engine's thread after each pass; requests read it when they
    size a tree. to_json / restore carry it across a worker's restarts (the engine keeps it in a file).
    """

    shape = (N_SOURCES, len(SUFFIX_BUCKETS) + 1, len(DEPTH_BUCKETS) + 1)

    def __init__(self, prior_weight: float = PRIOR_WEIGHT, decay: float = SHARED_DECAY,
                 idle_decay: float = SHARED_IDLE_DECAY):
        if not (0.0 < decay <= 1.0 and 0.0 < idle_decay <= 1.0):
            raise ValueError(f"decays must lie in (0, 1], got {decay}, {idle_decay}")
        self.prior_weight, self.decay, self.idle_decay = prior_weight, decay, idle_decay
        self.predicted = np.zeros(self.shape)
        self.accepted = np.zeros(self.shape)

    @property
    def alpha(self) -> np.ndarray:
        """float64 [N_SOURCES, suffix buckets, depth buckets]: pooled accepted / raw predicted, shrunk toward 1."""
        return (self.accepted + self.prior_weight) / (self.predicted + self.prior_weight)

    def cells(self, source_buckets: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """int64 [n, N_SOURCES]: each node's flat cell per source (source_buckets: tree_buckets' answer)."""
        depth = np.searchsorted(DEPTH_BUCKETS, node_depths(parents), side="right")  # [n]
        _, nb, nd = self.shape
        return (np.arange(N_SOURCES) * nb + source_buckets)[None, :] * nd + depth[:, None]

    def to_json(self) -> dict:
        """The evidence as plain data (a worker keeps it across restarts: engine/scheduler.py)."""
        return {"version": STATE_VERSION, "sources": list(SOURCES), "suffix_buckets": SUFFIX_BUCKETS.tolist(),
                "depth_buckets": DEPTH_BUCKETS.tolist(), "predicted": self.predicted.tolist(),
                "accepted": self.accepted.tolist()}

    def restore(self, data: dict) -> None:
        """Take the evidence of to_json() (ValueError when it is not such data, or of another layout)."""
        layout = (data.get("version"), data.get("sources"), data.get("suffix_buckets"), data.get("depth_buckets"))
        if layout != (STATE_VERSION, list(SOURCES), SUFFIX_BUCKETS.tolist(), DEPTH_BUCKETS.tolist()):
            raise ValueError(f"acceptance evidence of another layout: {layout}")
        arrays = []
        for name in ("predicted", "accepted"):
            a = np.asarray(data.get(name), np.float64)
            if a.shape != self.shape or not np.all(np.isfinite(a)) or np.any(a < 0):
                raise ValueError(f"{name} must be finite, >= 0 and of shape {self.shape}")
            arrays.append(a)
        self.predicted, self.accepted = arrays

    def add(self, cells: np.ndarray, raw: np.ndarray, accepted_cells: np.ndarray) -> None:
        """One verified tree: the flat cell and raw share of each node, the cells of the accepted ones."""
        if cells.shape[0] == 0:
            return
        _fade_and_add(self.predicted.reshape(-1), self.accepted.reshape(-1), cells, self.decay, self.idle_decay,
                      cells, raw, np.asarray(accepted_cells, np.int64))


_NO_SHARED = SharedCalibration()  # a request sized alone: its shape for the kernel, never read (use_shared False)


class DraftSizer:
    """Per request: each step's tree size, per-source calibration, and when to skip a remote source."""

    def __init__(self, cost: StepCost, prior_weight: float = PRIOR_WEIGHT, decay: float = DECAY,
                 idle_decay: float = IDLE_DECAY, shared: SharedCalibration | None = None):
        """shared: the worker's pooled calibration: estimates start from it, this request's alpha corrects what is
        left, and this request's evidence joins it. None = raw shares corrected by this request alone."""
        if not (0.0 < decay <= 1.0 and 0.0 < idle_decay <= 1.0):
            raise ValueError(f"decays must lie in (0, 1], got {decay}, {idle_decay}")
        self.cost = cost
        self.prior_weight = prior_weight
        self.decay, self.idle_decay = decay, idle_decay
        self.shared = shared
        shape = (N_SOURCES, len(SUFFIX_BUCKETS) + 1)
        self.predicted = np.zeros(shape)
        self.accepted = np.zeros(shape)
        # Of the last tree, per node: (request cell, pooled cell, raw share, pooled estimate) of the source that
        # decided it, and whether the in-process context draft had it too; of the kept nodes; of the verified nodes
        # in verifier order.
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, bool))
        self._estimated: tuple[np.ndarray, ...] = empty
        self._pending: tuple[np.ndarray, ...] = empty
        self._expect: tuple[np.ndarray, ...] | None = None
        self._remote_asked = False  # the last shrink() was of a remote draft: observe() judges its usefulness
        self._useless = 0
        self._backoff = 1
        self._skip = 0

    @property
    def alpha(self) -> np.ndarray:
        """float64 [N_SOURCES, buckets]: this request's observed / predicted accepted tokens per source and suffix
        bucket, shrunk toward 1 (predicted = the pooled calibration's estimates when there is one)."""
        return (self.accepted + self.prior_weight) / (self.predicted + self.prior_weight)

    @property
    def drafting_pays(self) -> bool:
        """False when the measured curve says no tree can ever pay: draft nothing, ask nobody."""
        return self.cost.max_nodes > 0

    def query_remote(self) -> bool:
        """Before drafting: False while a useless remote source is being skipped (counts the skipped step)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    @property
    def probing(self) -> bool:
        """The next ask of the remote source (query_remote() True) ends a skipped stretch: a probe, whose answer
        may be judged after the step (probe_result) instead of drafting it."""
        return self._backoff > 1

    def probe_result(self, useful: bool) -> None:
        """A probe answered in the background: whether its tree held an accepted token the step's draft missed."""
        self._remote_result(useful)

    def shrink(self, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, source_p: np.ndarray | None,
               default_source: int, remote: bool = True, matched_suffix: int = 0,
               context_matched_suffix: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The tree cut to its cost-effective size (possibly empty) -> (tokens, parents, p, kept indices).

        remote: the tree came from an RPC (its usefulness drives the skipping); *_matched_suffix: the suffix
        lengths the sources matched (DraftTree fields). p is each kept node's combined estimate (the selection
        weight); call expect() with the final node order before verifying.
        """
        p = self.estimate(parents, scores, source_p, default_source, matched_suffix, context_matched_suffix)
        keep = keep_best(parents, p, best_size(np.sort(p)[::-1], self.cost))
        self.keep(keep, remote)
        return tokens[keep], subtree(keep, parents), p[keep], keep

    def estimate(self, parents: np.ndarray, scores: np.ndarray, source_p: np.ndarray | None, default_source: int,
                 matched_suffix: int = 0, context_matched_suffix: int = 0) -> np.ndarray:
        """float64 [n]: each node's calibrated acceptance estimate (call keep() with the nodes chosen)."""
        # Per node and source s (flat cells: (s, bucket) of this request, (s, bucket, depth bucket) pooled):
        #   pooled = raw * pooled alpha,  scaled = pooled * this request's alpha;  the owner = argmax_s scaled
        raw = source_estimates(parents, scores, source_p, default_source)  # [n, S]
        buckets = tree_buckets(matched_suffix, context_matched_suffix)  # [S]
        shared = self.shared if self.shared is not None else _NO_SHARED
        p, *estimated = _node_estimates(
            np.asarray(parents, np.int32), raw, buckets, self.predicted.reshape(-1), self.accepted.reshape(-1),
            float(self.prior_weight), shared.predicted.reshape(-1), shared.accepted.reshape(-1),
            float(shared.prior_weight), self.shared is not None, DEPTH_BUCKETS)
        self._estimated = (*estimated, (raw[:, sorted(LOCAL_SOURCES)] > 0).any(axis=1))
        return p  # [n]

    def keep(self, keep: np.ndarray, remote: bool = True) -> None:
        """The nodes of the last estimate() that will be verified (ascending indices)."""
        self._pending = tuple(a[keep] for a in self._estimated)
        self._remote_asked = remote

    def keep_none(self, remote: bool = True) -> None:
        """keep() and expect() of no node: the tree of the last estimate() is not verified."""
        self._pending = self._expect = (_NO_CELLS, _NO_CELLS, np.zeros(0), np.zeros(0), np.zeros(0, bool))
        self._remote_asked = remote

    def expect(self, order: np.ndarray) -> None:
        """The kept nodes as the verifier will see them (order: kept index of each verifier node)."""
        self._expect = tuple(a[order] for a in self._pending)

    def observe(self, accepted_nodes: Sequence[int]) -> None:
        """After verification: the accepted nodes (verifier indices) of the tree passed to expect()."""
        expect, self._expect = self._expect, None
        hit = np.asarray(accepted_nodes, np.int64)
        if self._remote_asked:  # was the RPC worth it: did the model accept a node only a remote source had?
            # Not "a node a remote source decided": a node the context draft had too (however the estimates
            # ranked the two) would have come without the RPC.
            local = expect[4] if expect is not None else np.zeros(0, bool)
            self._remote_result(bool(hit.shape[0]) and not bool(local[hit].all()))
            self._remote_asked = False
        predicted, accepted = self.predicted.reshape(-1), self.accepted.reshape(-1)  # views
        if expect is None:  # every cell fades idle
            _fade_and_add(predicted, accepted, _NO_CELLS, self.decay, self.idle_decay, _NO_CELLS, np.zeros(0),
                          _NO_CELLS)
            return
        cells, pooled_cells, raw, pooled, _ = expect
        _fade_and_add(predicted, accepted, cells, self.decay, self.idle_decay, cells, pooled, cells[hit])
        if self.shared is not None:
            self.shared.add(pooled_cells, raw, pooled_cells[hit])

    def _remote_result(self, useful: bool) -> None:
        if useful:
            self._useless, self._backoff = 0, 1
            return
        self._useless += 1
        # A fresh source gets two chances; a probe after a skipped stretch that is useless again skips at once.
        if self._useless >= USELESS_BEFORE_BACKOFF or self._backoff > 1:
            self._skip, self._useless = self._backoff, 0
            self._backoff = min(2 * self._backoff, MAX_BACKOFF)
