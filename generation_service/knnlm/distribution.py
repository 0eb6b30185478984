"""The kNN-LM next-token distribution: neighbours' scores -> p_kNN, interpolated with the LM's (the module docstring of
knnlm/loop.py has a worked example).
"""

from __future__ import annotations

import numpy as np
import torch

from generation_service.knnlm.options import KnnLmOptions


def knn_distribution(scores: np.ndarray, values: np.ndarray, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """scores: float [k] (−squared distance, higher = closer), values: int [k] -> (tokens int64 [u] ascending,
    probs float64 [u]) = softmax(scores / T) summed per value.

    knn_distribution([0, -ln 3], [2, 4], 1.0) -> ([2, 4], [0.75, 0.25])   # not [0.5, 0.5]: closer weighs more
    """
    if len(scores) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    z = np.asarray(scores, dtype=np.float64) / temperature  # [k]
    w = np.exp(z - z.max())
    w /= w.sum()
    tokens, inverse = np.unique(np.asarray(values, dtype=np.int64), return_inverse=True)  # [u], [k]
    return tokens, np.bincount(inverse, weights=w, minlength=tokens.size)


def interpolate(lm_logits: torch.Tensor, tokens: np.ndarray, probs: np.ndarray, lam: float) -> np.ndarray:
    """lm_logits: [V], (tokens [u], probs [u]) from knn_distribution -> p float64 [V] = λ·p_kNN + (1 − λ)·p_LM.
    No neighbours (tokens empty): p = (1 − λ)·p_LM, whose argmax is the LM's.

    In numpy on the calling thread, not torch: torch splits ops over more than 32 K elements across its OpenMP
    team, whose threads then spin (GOMP_SPINCOUNT) on the cores that the next LM pass and Search need. Served on
    a small machine, both the baseline and OS³ were faster than with torch's softmax here (bench.knnlm --serve)."""
    lg = lm_logits.detach().cpu()
    if lg.dtype not in (torch.float32, torch.float64):
        lg = lg.float()
    p = lg.numpy().astype(np.float64)  # [V], a copy
    p -= p.max()
    np.exp(p, out=p)
    p /= p.sum()
    p *= 1.0 - lam
    if tokens.size:
        p[tokens] += probs * lam  # tokens are unique (knn_distribution)
    return p


def next_token(p: np.ndarray) -> int:
    """Greedy pick; ties go to the smallest token id (np.argmax returns the first maximum)."""
    return int(np.argmax(p))


def mixed_distribution(lm_logits: torch.Tensor, scores: np.ndarray, values: np.ndarray,
                       opts: KnnLmOptions) -> np.ndarray:
    """lm_logits [V] + one query's neighbours (scores [k], values [k]) -> p float64 [V]."""
    tokens, probs = knn_distribution(scores, values, opts.temperature)
    return interpolate(lm_logits, tokens, probs, opts.lam)


