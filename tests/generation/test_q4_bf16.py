"""The q4_1_bf16 format (q4_kernel.cpp's AMX and AVX512-BF16 paths): the GGUF's Q4_1 / Q8_0 blocks with bf16
activations. The kernel against a brute-force matmul of the bf16-rounded operands, bit-identical rows whatever else is
in the pass (what makes speculation and batching lossless), the real model against q4_1, and the refusal where the CPU
has neither. Skipped on CPUs without either (the format is not offered there)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from generation_service.engine.speculative import prefill, verify_tree
from generation_service.engine.steps import tree_segment
from generation_service.model import q4_weights
from generation_service.model.kernels.build import kernel
from generation_service.model.q4_weights import BlockWeight, dequantize
from generation_service.model.target import forward_batch, load_model, new_cache
from tests.generation.test_q4 import random_blocks

needs_bf16 = pytest.mark.skipif(kernel() is None or not kernel().bf16(), reason="no AMX tiles or AVX512-BF16 here")


def bf16(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a, np.float32)).bfloat16().double().numpy()


@needs_bf16
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["q4_1", "q8_0"]), m=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 13, 15, 16, 17, 33, 96, 97, 130]),
       n=st.integers(1, 70), blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_kernel_matches_bf16_rounded_matmul(kind, m, n, blocks, seed):
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    packed = random_blocks(rng, kind, n, k)
    w = BlockWeight(kind, torch.from_numpy(packed), k, bf16=True)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = w(torch.from_numpy(x)).numpy()
    xr, wr = bf16(x), bf16(dequantize(kind, packed, k))
    ref = xr @ wr.T  # products of bf16 values are exact; only the fp32 sums round
    bound = 1e-6 * (np.abs(xr) @ np.abs(wr).T) * k ** 0.5 + 1e-30
    assert got.shape == (m, n) and np.all(np.abs(got - ref) <= bound)
    # Not the fp32-activation kernel's result: the activations really are rounded (for all but trivial inputs).
    exact = x.astype(np.float64) @ dequantize(kind, packed, k).astype(np.float64).T
    assert np.abs(got - exact).max() > 0 or np.abs(exact).max() == 0
    # Row-invariant, bit for bit: a row alone, and the same row among others in another pass size.
    for r in {0, m - 1, m // 2}:
        assert np.array_equal(w(torch.from_numpy(x[r:r + 1])).numpy()[0], got[r])
    mixed = np.concatenate([rng.standard_normal((5, k)).astype(np.float32), x[-1:]])
    assert np.array_equal(w(torch.from_numpy(mixed)).numpy()[-1], got[-1])


needs_wide = pytest.mark.skipif(kernel() is None or not kernel().bf16() or not kernel().wide_bf16(),
                                reason="the bf16 path here does not take decoded weights (AMX, or no AVX512-BF16)")


@needs_wide
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["q4_1", "q8_0"]), m=st.integers(1, 40), n=st.integers(1, 70), blocks=st.integers(1, 12),
       wide_from=st.integers(1, 42), seed=st.integers(0, 2**32 - 1))
def test_decoded_copy_gives_the_same_bits(kind, m, n, blocks, wide_from, seed):
    """decode_bf16 = the bf16 rounding of the exact values, and a pass through it (block_linear's wide, taken past 10
    rows unless wide_from says from how many) = the pass over the blocks, bit for bit; a wide of the wrong shape is
    refused."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    packed = torch.from_numpy(random_blocks(rng, kind, n, k))
    wide = kernel().decode_bf16(packed, k)
    assert wide.dtype == torch.bfloat16 and torch.equal(wide, torch.from_numpy(dequantize(kind, packed.numpy(), k))
                                                        .bfloat16())
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    blocks_only = kernel().block_linear(x, packed, True)
    assert torch.equal(kernel().block_linear(x, packed, True, wide), blocks_only)
    assert torch.equal(kernel().block_linear(x, packed, True, wide, wide_from), blocks_only)
    for rows in (1, 11):  # one tile on the fly, or the decoded copy's tiles: refused either way
        with pytest.raises(RuntimeError, match="wide must be"):
            kernel().block_linear(torch.zeros(rows, k), packed, True, wide[:, 1:].contiguous())


needs_amx = pytest.mark.skipif(kernel() is None or kernel().bf16() != "amx", reason="no AMX tiles here")


@needs_amx
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["q4_1", "q8_0"]), m=st.sampled_from([1, 2, 3, 7, 15, 16, 17, 31, 48, 49, 97]),
       n=st.integers(1, 70), blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_amx_group_layout_gives_the_same_bits(kind, m, n, blocks, seed):
    """A pass over a weight's AMX group layout (block_linear's wide on AMX) = the pass over its GGUF rows, bit for
    bit, at every pass size (fewer tile columns below 16 rows, 1-3 groups of 16, several passes over the weights past
    48) and weight rows not a multiple of 16 (a padded group); both match the brute-force bf16 matmul."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    packed = torch.from_numpy(random_blocks(rng, kind, n, k))
    groups = kernel().amx_layout(packed, k)
    assert groups.dtype == torch.uint8 and tuple(groups.shape) == ((n + 15) // 16 * blocks, 16 * packed.shape[1] // blocks)
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = kernel().block_linear(torch.from_numpy(x), packed, True, groups)
    assert torch.equal(got, kernel().block_linear(torch.from_numpy(x), packed, True))
    xr, wr = bf16(x), bf16(dequantize(kind, packed.numpy(), k))
    bound = 1e-6 * (np.abs(xr) @ np.abs(wr).T) * k ** 0.5 + 1e-30
    assert np.all(np.abs(got.numpy() - xr @ wr.T) <= bound)
    assert torch.equal(kernel().block_linear(torch.from_numpy(x[-1:]), packed, True, groups)[0], got[-1])


@needs_amx
@pytest.mark.parametrize("case, why", [
    ("rows", "another weight's layout (one group fewer)"),
    ("kind", "a Q4_1 weight's layout for a Q8_0 weight of the same shape"),
])
def test_amx_group_layout_refuses_a_mismatch(case, why):
    rng = np.random.default_rng(0)
    packed = torch.from_numpy(random_blocks(rng, "q4_1", 40, 64))
    groups = kernel().amx_layout(packed, 64)
    w = packed if case == "rows" else torch.from_numpy(random_blocks(rng, "q8_0", 40, 64))
    wrong = groups[2:].contiguous() if case == "rows" else groups
    with pytest.raises(RuntimeError, match="AMX group layout"):
        kernel().block_linear(torch.zeros(1, 64), w, True, wrong)
    assert torch.equal(kernel().block_linear(torch.ones(1, 64), packed, True, groups),
                       kernel().block_linear(torch.ones(1, 64), packed, True))  # the right one is taken


@needs_amx
def test_amx_layout_refuses_what_is_not_blocks():
    with pytest.raises(RuntimeError, match="neither Q4_1 nor Q8_0"):
        kernel().amx_layout(torch.zeros(4, 21, dtype=torch.uint8), 32)


def test_q4_1_bf16_is_refused_without_a_bf16_kernel(monkeypatch):
    real = kernel()
    if real is None:
        pytest.skip("no CPU kernels here")
    monkeypatch.setattr(q4_weights, "kernel", lambda: types.SimpleNamespace(bf16=lambda: ""))
    with pytest.raises(ValueError, match="AVX512-BF16"):
        q4_weights.LeanLlamaQ4(None, [], None, bf16=True)


@needs_bf16
@pytest.mark.model
def test_logits_near_q4_1_and_rows_invariant(tmq4bf16, tmq4):
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 30000, 150))
    kb, kq = new_cache(tmq4bf16), new_cache(tmq4)
    a, b = prefill(tmq4bf16, kb, prompt, chunk=1024), prefill(tmq4, kq, prompt, chunk=1024)
    # Same weights, activations rounded to bf16 before every linear: close, not equal.
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.5 and torch.equal(a.argmax(-1), b.argmax(-1))
    parents = np.array([-1, 0, 0, 1, -1, 4], np.int32)
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)
    tree = verify_tree(tmq4bf16, kb, 7, tokens, parents)
    # The tree's root row == that token decoded alone after the same prefix, bit for bit.
    solo = new_cache(tmq4bf16)
    prefill(tmq4bf16, solo, prompt, chunk=1024)
    one = verify_tree(tmq4bf16, solo, 7, tokens[:0], parents[:0])
    assert torch.equal(tree[0], one[0])


@needs_bf16
@pytest.mark.model
def test_q4_1_bf16_loads_only_on_the_lean_forward():
    with pytest.raises(ValueError, match="lean forward only"):
        load_model("", dtype="q4_1_bf16", device="cpu", forward="hf")


@needs_wide
@pytest.mark.model
def test_wide_passes_give_a_row_the_bits_of_its_solo_step(tmq4bf16):
    """Passes of more than 10 rows read the decoded copy, smaller ones the blocks: a 12-node tree's root row (wide)
    equals that token decoded alone (blocks), bit for bit."""
    assert tmq4bf16.lean.wide_bytes > 0
    rng = np.random.default_rng(1)
    prompt = torch.from_numpy(rng.integers(0, 30000, 60))
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, -1, 7, 7, 8, 9], np.int32)
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)
    cache, solo = new_cache(tmq4bf16), new_cache(tmq4bf16)
    prefill(tmq4bf16, cache, prompt, chunk=1024)
    prefill(tmq4bf16, solo, prompt, chunk=1024)
    tree = verify_tree(tmq4bf16, cache, 7, tokens, parents)
    one = verify_tree(tmq4bf16, solo, 7, tokens[:0], parents[:0])
    assert len(tree) == len(parents) + 1 and torch.equal(tree[0], one[0])


@needs_wide
@pytest.mark.model
def test_where_passes_read_the_decoded_copy_changes_no_bit(tmq4bf16):
    """set_wide_from moves the row count from which the fused pass reads the decoded copies (the calibration's
    choice): a 9-row tree and a batch of a 4-row tree with two AR rows give the same logits from 1, 6, 9, 11 or 40
    rows on; a count below 1 is refused."""
    lean = tmq4bf16.lean
    assert lean.has_decoded_copies()
    rng = np.random.default_rng(3)
    prompts = [torch.from_numpy(rng.integers(0, 30000, n)) for n in (50, 20, 35)]
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, -1], np.int32)
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)

    def prefilled():
        caches = [new_cache(tmq4bf16) for _ in prompts]
        for c, p in zip(caches, prompts):
            prefill(tmq4bf16, c, p, chunk=1024)
        return caches

    def run():
        tree = verify_tree(tmq4bf16, prefilled()[0], 7, tokens, parents)
        caches, empty = prefilled(), np.zeros(0, np.int32)
        segs = [tree_segment(tmq4bf16, caches[0], 7, tokens[:3], parents[:3]),
                tree_segment(tmq4bf16, caches[1], 9, empty, empty), tree_segment(tmq4bf16, caches[2], 11, empty, empty)]
        return tree, forward_batch(tmq4bf16, segs)

    before = lean.wide_from
    try:
        default = run()
        for rows in (1, 6, 9, 40):
            lean.set_wide_from(rows)
            got = run()
            assert all(torch.equal(a, b) for a, b in zip(got[0], default[0])), rows
            assert all(torch.equal(a, b) for a, b in zip(got[1], default[1])), rows
        with pytest.raises(RuntimeError, match="at least 1 row"):
            lean.set_wide_from(0)
    finally:
        lean.set_wide_from(before)


@needs_amx
@pytest.mark.model
def test_served_model_decodes_the_group_layout_to_the_same_bits(tmq4bf16):
    """On AMX the fused pass reads the Q4_1 weights from their group layout: a prefill and a 6-node tree give the
    logits of the same passes over the GGUF rows (the layout dropped), bit for bit."""
    lean = tmq4bf16.lean
    assert lean.wide_bytes > 0
    rng = np.random.default_rng(2)
    prompt = torch.from_numpy(rng.integers(0, 30000, 40))
    parents = np.array([-1, 0, 0, 1, -1, 4], np.int32)
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)

    def run():
        cache = new_cache(tmq4bf16)
        return prefill(tmq4bf16, cache, prompt, chunk=1024), verify_tree(tmq4bf16, cache, 7, tokens, parents)

    with_layout = run()
    lean.fused.set_wide([], [], [], [], torch.Tensor())
    try:
        without = run()
    finally:
        lean._prepare_weights(kernel())
    assert torch.equal(with_layout[0], without[0])
    assert all(torch.equal(a, b) for a, b in zip(with_layout[1], without[1]))
