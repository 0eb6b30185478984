"""p = λ·p_kNN + (1 − λ)·p_LM against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from generation_service.augment import round_gate as ralm_gate
from generation_service.knnlm.distribution import interpolate, knn_distribution, mixed_distribution, next_token
from generation_service.knnlm.options import KnnLmOptions


@pytest.mark.parametrize("scores, values, temperature, tokens, probs", [
    ([0.0, -math.log(3)], [2, 4], 1.0, [2, 4], [0.75, 0.25]),       # Not [0.5, 0.5]: the closer one weighs more
    ([0.0, -math.log(3)], [4, 2], 1.0, [2, 4], [0.25, 0.75]),       # tokens come out sorted, weights follow them
    ([-1.0, -1.0, -1.0 - math.log(2)], [7, 7, 3], 1.0, [3, 7], [0.2, 0.8]),  # equal tokens add up: 2/5 + 2/5
    ([0.0, -2 * math.log(3)], [2, 4], 2.0, [2, 4], [0.75, 0.25]),   # T = 2 halves the scores first
    ([-1e4, -1e4 - 10.0], [1, 2], 10.0, [1, 2], [1 / (1 + math.exp(-1)), 1 - 1 / (1 + math.exp(-1))]),  # no underflow
])
def test_knn_distribution(scores, values, temperature, tokens, probs):
    t, p = knn_distribution(np.array(scores), np.array(values), temperature)
    assert t.tolist() == tokens
    np.testing.assert_allclose(p, probs, rtol=1e-12)


def test_interpolation_hand_example():
    # p_kNN = {2: 0.75, 4: 0.25}, p_LM uniform over 5 tokens, λ = 0.4:
    # p = 0.6·0.2 + 0.4·p_kNN = [0.12, 0.12, 0.12 + 0.3, 0.12, 0.12 + 0.1]
    lm = torch.zeros(5)
    p = mixed_distribution(lm, np.array([0.0, -math.log(3)]), np.array([2, 4]), KnnLmOptions(lam=0.4, temperature=1.0))
    np.testing.assert_allclose(p, [0.12, 0.12, 0.42, 0.12, 0.22], rtol=1e-12)
    assert next_token(p) == 2  # Not 0 (the LM's first-index argmax of a flat distribution)
    assert math.isclose(float(p.sum()), 1.0, rel_tol=1e-12)


@pytest.mark.parametrize("lam, expected_token", [
    (0.0, 1),   # λ = 0 is the LM: its argmax 1, not the neighbours' 3
    (0.2, 1),   # 0.8·0.5 = 0.40 > 0.8·0.1 + 0.2 = 0.28
    (0.6, 3),   # 0.4·0.5 = 0.20 < 0.4·0.1 + 0.6 = 0.64
    (1.0, 3),   # λ = 1 is the kNN distribution alone
])
def test_lambda_moves_the_argmax(lam, expected_token):
    p_lm = torch.tensor([0.1, 0.5, 0.2, 0.1, 0.1], dtype=torch.float64)
    p = interpolate(p_lm.log(), np.array([3]), np.array([1.0]), lam)
    assert next_token(p) == expected_token
    np.testing.assert_allclose(p, (1 - lam) * p_lm.numpy() + lam * np.eye(5)[3], rtol=1e-12)


def test_no_neighbours_keeps_the_lm_argmax():
    lm = torch.tensor([0.0, 3.0, 1.0])
    p = interpolate(lm, np.zeros(0, np.int64), np.zeros(0), 0.9)
    assert next_token(p) == 1
    np.testing.assert_allclose(p, 0.1 * torch.softmax(lm.double(), -1).numpy(), rtol=1e-12)


def torch_reference(lm: torch.Tensor, tokens: np.ndarray, probs: np.ndarray, lam: float) -> np.ndarray:
    """The definition in torch, in float64: softmax, scaled, the neighbours' mass added per token."""
    p = torch.softmax(lm.double(), -1) * (1.0 - lam)
    p.index_add_(0, torch.from_numpy(tokens), torch.from_numpy(probs * lam))
    return p.numpy()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.sampled_from([5, 97, 49152]), k=st.integers(0, 64),
       lam=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_interpolate_matches_the_torch_definition(seed, vocab, k, lam, dtype):
    rng = np.random.default_rng(seed)
    lm = torch.from_numpy(rng.normal(0, 8, vocab)).to(dtype)
    tokens, probs = knn_distribution(-rng.exponential(50, k), rng.integers(0, vocab, k), 10.0)
    p = interpolate(lm, tokens, probs, lam)
    assert p.dtype == np.float64 and p.shape == (vocab,)
    np.testing.assert_allclose(p, torch_reference(lm, tokens, probs, lam), rtol=1e-10, atol=1e-300)
    # No neighbours leaves only the LM's share (1 - λ), not 1
    assert math.isclose(float(p.sum()), 1.0 if k else 1.0 - lam, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("p, token", [
    ([0.2, 0.4, 0.4], 1),   # a tie goes to the smaller id, not 2
    ([0.5, 0.1, 0.4], 0),
    ([0.1, 0.1, 0.8], 2),   # not the first id when it is not a maximum
])
def test_next_token_takes_the_first_maximum(p, token):
    assert next_token(np.array(p)) == token


@pytest.mark.parametrize("field, kwargs", [
    ("k", {"k": 0}), ("k", {"k": 1025}), ("lambda", {"lam": 1.5}), ("temperature", {"temperature": 0.0}),
    ("stride", {"stride": -1}), ("retriever", {"retriever": "sr"}), ("cache_next", {"cache_next": 0}),
])
def test_options_name_the_bad_field(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field}: "):
        KnnLmOptions(**kwargs)


# (usable cores, async rounds by default): on 2 cores an async round's passes share them with the Search
ASYNC_DEFAULT = [(1, False), (2, False), (3, False), (4, True), (16, True)]


@pytest.mark.parametrize("cores, expected", ASYNC_DEFAULT)
def test_async_rounds_by_default_only_with_spare_cores(cores, expected, monkeypatch):
    assert ralm_gate.async_by_default(cores) is expected
    monkeypatch.setattr(ralm_gate, "usable_cores", lambda: cores)
    opts = KnnLmOptions()
    assert opts.async_verify is expected and opts.mode == ("os3" if expected else "os3-sync")
    assert KnnLmOptions(async_verify=not expected).async_verify is (not expected)  # Not overridden: asked for
