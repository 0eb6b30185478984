"""Acceptance rules on hand-built logits: greedy and seeded sampling, plus EOS / budget cuts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from generation_service.engine.speculative import FINISH_LENGTH, FINISH_STOP, accept, cut_emitted
from generation_service.model.sampling import Sampler, SamplingParams
from generation_service.model.tree_attention import tree_children

V = 10


def onehot_rows(argmaxes: list[int]) -> torch.Tensor:
    """logits [q, V] whose row r peaks at argmaxes[r]."""
    logits = torch.zeros(len(argmaxes), V)
    for r, t in enumerate(argmaxes):
        logits[r, t] = 5.0
    return logits


# Tree: tokens [3, 4, 5, 6], parents [-1, -1, 0, 1]: root -> 3 -> 5, root -> 4 -> 6. Rows: root, 3, 4, 5, 6.
TOKENS = np.array([3, 4, 5, 6], np.int32)
PARENTS = np.array([-1, -1, 0, 1], np.int32)


@pytest.mark.parametrize("row_argmax, limit, path, emitted", [
    ([3, 5, 0, 7, 0], 9, [0, 2], [3, 5, 7]),  # full left branch + bonus from node 5's row
    ([4, 0, 6, 0, 8], 9, [1, 3], [4, 6, 8]),  # right branch  # Not [4, 0]: node 4's row is row 2, not row 1
    ([3, 9, 6, 0, 0], 9, [0], [3, 9]),        # 9 is no child of 3: bonus 9 stops the walk
    ([3, 6, 6, 0, 0], 9, [0], [3, 6]),        # 6 is a child of 4, not of 3  # Not [3, 6, ...]
    ([8, 5, 6, 7, 8], 9, [], [8]),            # root pick matches no draft: plain AR step
    ([3, 5, 0, 7, 0], 2, [0], [3, 5]),        # budget of 2 tokens: stop picking  # Not [3, 5, 7]
    ([3, 5, 0, 7, 0], 1, [], [3]),
])
def test_greedy_acceptance(row_argmax, limit, path, emitted):
    got = accept(onehot_rows(row_argmax), tree_children(TOKENS, PARENTS), Sampler(SamplingParams()), limit)
    assert got == (path, emitted)


def ar_reference(rows_by_context: dict[tuple[int, ...], torch.Tensor], params: SamplingParams, n: int) -> list[int]:
    """What an AR loop emits: one pick per token from the row of the context so far."""
    s, out = Sampler(params), []
    for _ in range(n):
        out.append(s.pick(rows_by_context[tuple(out)]))
    return out


def test_sampling_acceptance_equals_ar_draws():
    # Two-token vocabulary-wide distributions per context; the tree holds every 2-token continuation of {1, 2}.
    g = torch.Generator().manual_seed(3)
    ctxs = [(), (1,), (2,), (1, 1), (1, 2), (2, 1), (2, 2)]
    rows = {c: torch.full((V,), -20.0) for c in ctxs}
    for c in ctxs:  # mass only on tokens 1 and 2, random split
        rows[c][1], rows[c][2] = torch.randn(2, generator=g)
    tokens = np.array([1, 2, 1, 2, 1, 2], np.int32)
    parents = np.array([-1, -1, 0, 0, 1, 1], np.int32)
    order = [(), (1,), (2,), (1, 1), (1, 2), (2, 1), (2, 2)]  # verifier rows: root, then nodes in BFS order
    logits = torch.stack([rows[c] for c in order])
    for seed in range(20):
        params = SamplingParams(temperature=1.0, seed=seed)
        sampler = Sampler(params)
        path, emitted = accept(logits, tree_children(tokens, parents), sampler, limit=3)
        assert emitted == ar_reference(rows, params, 3)  # same draws, same tokens
        assert len(path) == 2 and sampler.draws == 3  # both levels always match here; one draw per token


def test_sampling_rejects_child_that_differs_from_draw():
    # Root row puts all mass on token 7; the tree only offers 3 -> the draw (7) is emitted, nothing accepted.
    logits = torch.full((2, V), -30.0)
    logits[0, 7] = 0.0
    logits[1, 3] = 0.0
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    assert accept(logits, {(-1, 3): 0}, sampler, limit=5) == ([], [7])  # Not ([0], [3, ...])
    assert sampler.draws == 1


@pytest.mark.parametrize("tokens, remaining, eos, want", [
    ([5, 6, 7], 10, {2}, ([5, 6, 7], None)),
    ([5, 2, 7], 10, {2}, ([5], FINISH_STOP)),          # EOS ends the output and is not part of it
    ([5, 6, 7], 2, {2}, ([5, 6], FINISH_LENGTH)),      # budget reached inside an accepted chunk
    ([5, 6, 2], 3, {2}, ([5, 6], FINISH_STOP)),        # EOS at the last allowed slot is a stop  # Not length
    ([5, 6, 2], 2, {2}, ([5, 6], FINISH_LENGTH)),      # EOS beyond the budget is never seen
    ([2, 6], 5, set(), ([2, 6], None)),                # ignore_eos: no EOS ids
])
def test_cut(tokens, remaining, eos, want):
    assert cut_emitted(tokens, remaining, frozenset(eos)) == want
