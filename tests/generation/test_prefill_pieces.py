"""A prompt prefilled in pieces of any size gets the same bits as one prefilled in whole chunks, where the served
format's rows are pass-invariant (q4_1_i8, q4_1_bf16 on the fused forward): the worker may then cut a long prompt
by load (engine/prefill_share.py) without any output depending on what else it runs. Every row attends in the
per-row kernel (lean_forward.cpp), whatever its pass; the linears of these formats compute each row alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.model

PROMPT = 300
CHUNK = 256


def _whole(done: int) -> int:
    return CHUNK - done % CHUNK


def _ones_then_odd(done: int) -> int:
    return 1 if done < 24 else min(17, _whole(done))  # 1-row pieces, then pieces of 17 inside the chunk grid


def _sixty_four(done: int) -> int:
    return min(64, _whole(done))


CUTS = {"pieces of 1, then of 17": _ones_then_odd, "pieces of 64": _sixty_four}


def _prefill(tm, ids: torch.Tensor, piece) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every prompt row and the keys cached, prefilled in the pieces piece(rows done) gives."""
    cache = tm.lean.new_cache(PROMPT + 8)
    logits, done = [], 0
    while done < len(ids):
        n = min(piece(done), len(ids) - done)
        logits.append(tm.lean.forward(ids[done:done + n], torch.arange(done, done + n), cache))
        done += n
    return torch.cat(logits), cache.k[:, :, :done].clone()


@pytest.mark.parametrize("fixture, invariant", [
    ("tmq4i8", True),
    ("tmq4bf16", True),
    ("tmq4", False),   # q4_1 with fp32 activations: prompt chunks take the dense linears
    ("tm32", False),   # passes past fused_max_rows leave the fused forward
])
def test_which_formats_have_pass_invariant_rows(fixture, invariant, request):
    tm = request.getfixturevalue(fixture)
    if tm.lean.fused is None:
        pytest.skip("the CPU kernel extension is not built here")
    assert tm.rows_pass_invariant == invariant


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("fixture", ["tmq4i8", "tmq4bf16"])
def test_a_prompt_in_pieces_equals_the_prompt_in_whole_chunks(fixture, cut, request):
    tm = request.getfixturevalue(fixture)
    if not tm.rows_pass_invariant:
        pytest.skip("no per-row attention kernel in this build")
    ids = torch.from_numpy(np.random.default_rng(11).integers(100, 30000, PROMPT))
    want_logits, want_keys = _prefill(tm, ids, _whole)
    got_logits, got_keys = _prefill(tm, ids, CUTS[cut])
    assert torch.equal(got_keys, want_keys)
    assert torch.equal(got_logits, want_logits)  # every row, to the bit
    assert not torch.equal(want_logits[0], want_logits[-1])  # Not one row copied everywhere
