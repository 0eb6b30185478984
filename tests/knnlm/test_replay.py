"""bench.knnlm_replay: sync rounds replayed over baseline steps, and the cost model that prices them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.knnlm_replay import modelled, replay
from generation_service.knnlm.distribution import mixed_distribution, next_token
from generation_service.knnlm.options import KnnLmOptions

OPTS = KnnLmOptions(k=8, lam=0.9, temperature=10.0, speculate=False)


def baseline_steps(ds, start: int, n: int, vocab: int) -> dict:
    """n steps whose queries are consecutive datastore keys, with brute-force exact neighbours and tokens."""
    keys = np.asarray(ds.keys, np.float64)
    q = np.asarray(ds.keys[start:start + n], np.float32)
    d = ((q[:, None, :].astype(np.float64) - keys[None]) ** 2).sum(-1)  # [n, N]
    ids = np.argsort(d, axis=1, kind="stable")[:, :OPTS.k]
    scores = -np.take_along_axis(d, ids, 1).astype(np.float32)
    logits = np.zeros((n, vocab), np.float32)
    tokens = np.array([next_token(mixed_distribution(torch.from_numpy(logits[i]), scores[i],
                                                     np.asarray(ds.values[ids[i]]), OPTS)) for i in range(n)])
    return {"q": q, "ids": ids, "logits": logits, "tokens": tokens}


@pytest.mark.parametrize("stride", [1, 3, 8])
def test_replay_emits_every_step_once(ds, stride):
    vocab = int(np.asarray(ds.values).max()) + 1
    traj = [baseline_steps(ds, 10, 12, vocab), baseline_steps(ds, 200, 9, vocab)]
    r = replay(ds, traj, OPTS, stride, next_n=4, capacity=256)
    assert r["tokens"] == (12 - 1) + (9 - 1)  # every step but each first (a baseline step) is emitted once
    assert r["guesses"] == r["tokens"]  # a sync round emits one token per guess, the wrong one's correction too
    assert r["rounds"] >= -(-r["tokens"] // stride) and (stride > 1 or r["rounds"] == r["tokens"])
    assert 0.0 <= r["guess_accuracy"] <= 1.0


# (replay figures, costs, expected (modelled_x, ceiling_x))
MODEL = [
    # Every guess right at s = 4: 4 steps (pass 10 ms + look-up 0) + one 40 ms Search of 4 + no fill per 4 tokens
    # = 20 ms per token against the base's 10 + 40 = 50: 2.5x, the ceiling too.
    ({"stride": 4, "guesses": 8, "rounds": 2, "tokens": 8, "lookup_s": 0.0, "fill_s": 0.0},
     {"pass_s": 0.010, "search_1_s": 0.040, "search_4_s": 0.040}, (2.5, 2.5)),
    # Half the rounds end after one token: 4 rounds for 8 tokens, 8 guesses -> (80 + 160) / 8 = 30 ms: 1.67x.
    ({"stride": 4, "guesses": 8, "rounds": 4, "tokens": 8, "lookup_s": 0.0, "fill_s": 0.0},
     {"pass_s": 0.010, "search_1_s": 0.040, "search_4_s": 0.040}, (50 / 30, 2.5)),
]


@pytest.mark.parametrize("r, costs, expected", MODEL)
def test_modelled_speedups(r, costs, expected):
    got = modelled(r, costs)
    assert (got["modelled_x"], got["ceiling_x"]) == pytest.approx(expected)
