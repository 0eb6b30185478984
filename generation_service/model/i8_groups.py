"""How many groups of 16 weight columns the int8 kernel's tiles of 1-4 rows take at once, timed on this machine.

A tile of few rows has few independent vpdpbusd chains (one per row and group), so taking 2 or 4 groups at once
hides the instruction's latency; but it also reads that many weight streams side by side, and on some cores (an AMD
Zen 4) that costs more than the latency it hides. Passes of 1-4 rows are most of serving (AR steps, small draft trees
on chat), so the choice is measured, not assumed: each choice runs the same linears over 1, 2, 3 and 4 rows,
interleaved over rounds so a shared machine's drift hits each alike, and the lowest median wins. Every choice gives
the same bits (a tile runs the same operations on each (column, row) whichever tile it is in), so the choice can
only change speed.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

CHOICES = (1, 2, 4)  # groups per tile of 1-4 rows at most (int8_linear.cpp: small_groups)
ROWS = (1, 2, 3, 4)  # the row counts the choice applies to
ROUNDS = 9


def fastest(ms: dict[int, Sequence[float]]) -> int:
    """Per choice, ms of each round -> the choice with the lowest median (a tie: the fewest groups)."""
    if not ms:
        raise ValueError("no timings")
    return min(ms, key=lambda n: (float(np.median(ms[n])), n))


def tune(k, layouts: Sequence[torch.Tensor], in_features: int, out_features: int,
         rounds: int = ROUNDS) -> tuple[int, dict[int, float]]:
    """Time each choice on `layouts` (i8_layout weights of one shape, e.g. every layer's gate-and-up linear) over
    ROWS rows and set the fastest on the kernel `k`. -> (the choice, median ms by choice). Only the AVX512-VNNI path
    has the choice; elsewhere nothing is timed."""
    if k.i8_path() != "avx512_vnni":
        return int(k.i8_groups()), {}
    x = [torch.randn(m, in_features, generator=torch.Generator().manual_seed(m)) for m in ROWS]
    ms: dict[int, list[float]] = {n: [] for n in CHOICES}
    try:
        for r in range(rounds + 1):  # round 0 warms the caches and is not kept
            for n in CHOICES[r % len(CHOICES):] + CHOICES[: r % len(CHOICES)]:
                k.set_i8_groups(n)
                t0 = time.perf_counter()
                for xm in x:
                    for layout in layouts:
                        k.i8_linear(xm, layout, out_features)
                if r:
                    ms[n].append((time.perf_counter() - t0) * 1e3)
    finally:
        best = fastest(ms) if all(ms.values()) else int(k.i8_groups())
        k.set_i8_groups(best)
    return best, {n: float(np.median(v)) for n, v in ms.items()}
