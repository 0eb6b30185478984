"""The q4_1 weight format (model/q4_weights.py, q4_kernel.cpp): the kernel against a brute-force dequantize-then-matmul,
the GGUF blocks against our fp32 safetensors, and the real model's logits and greedy tokens against fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from generation_service.engine.speculative import generate, prefill, verify_tree
from generation_service.model.kernels.build import kernel
from generation_service.model.q4_weights import BLOCK_BYTES, DENSE_MIN_ROWS, BlockWeight, _llama_row_order, dequantize
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import load_model, new_cache

needs_kernel = pytest.mark.skipif(kernel() is None, reason="block kernel not buildable here (no compiler)")


def random_blocks(rng: np.random.Generator, kind: str, n: int, k: int) -> np.ndarray:
    """uint8 [n, k / 32 * bytes]: random codes, fp16 scales/minimums of realistic and awkward magnitudes."""
    b = rng.integers(0, 256, (n, k // 32, BLOCK_BYTES[kind]), dtype=np.uint8)
    scale = (rng.standard_normal((n, k // 32, 1)) * 10.0 ** rng.integers(-6, 1, (n, k // 32, 1))).astype(np.float16)
    b[..., 0:2] = scale.view(np.uint8)
    if kind == "q4_1":
        b[..., 2:4] = (rng.standard_normal((n, k // 32, 1)) * 0.1).astype(np.float16).view(np.uint8)
    return b.reshape(n, -1)


def test_reference_dequantize_worked_example():
    # One Q4_1 block: d = 0.5, m = -1, codes 0..15 in the low nibbles and 15..0 in the high ones.
    qs = np.array([(15 - j) << 4 | j for j in range(16)], np.uint8)
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), np.float16(-1).reshape(1).view(np.uint8), qs])
    w = dequantize("q4_1", block[None], 32)[0]
    assert w[:16].tolist() == [0.5 * j - 1 for j in range(16)]
    assert w[16:].tolist() == [0.5 * (15 - j) - 1 for j in range(16)]  # Not interleaved: high nibbles come second
    q8 = np.concatenate([np.float16(0.25).reshape(1).view(np.uint8), np.arange(-16, 16, dtype=np.int8).view(np.uint8)])
    assert dequantize("q8_0", q8[None], 32)[0].tolist() == [0.25 * j for j in range(-16, 16)]


@needs_kernel
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["q4_1", "q8_0"]), m=st.sampled_from([1, 2, 3, 7, 8, 9, 10, 11, 13, 16, 17, 21, 64]),
       n=st.integers(1, 70), blocks=st.integers(1, 12), seed=st.integers(0, 2**32 - 1))
def test_kernel_matches_dequantized_matmul(kind, m, n, blocks, seed):
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    packed = random_blocks(rng, kind, n, k)
    w = BlockWeight(kind, torch.from_numpy(packed), k)
    ref_w = dequantize(kind, packed, k)
    assert torch.equal(w.dequantize(), torch.from_numpy(ref_w))  # the weights themselves: bit for bit
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = w(torch.from_numpy(x)).numpy()
    ref = (x.astype(np.float64) @ ref_w.astype(np.float64).T)
    bound = 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(ref_w).astype(np.float64).T) * k ** 0.5 + 1e-30
    assert got.shape == (m, n) and np.all(np.abs(got - ref) <= bound)
    # Row-consistent: a row's result does not depend on the other rows in the pass (lossless speculation).
    assert np.array_equal(w(torch.from_numpy(x[-1:])).numpy()[0], got[-1])


@needs_kernel
@pytest.mark.parametrize("path", ["fp32", "bf16 blocks", "bf16 decoded copy"])
def test_every_row_of_every_pass_size_has_its_solo_bits(path):
    """Pass sizes 1..40 cover every tiling (one tile up to 10 rows; past it balanced tiles of up to 10 rows (fp32 on
    AVX-512), 8 (AVX2) or 6 (the bf16 decoded copy): 13 = 7 + 6 or 5 + 4 + 4, ...): each row of each pass equals that
    row computed alone, bit for bit, and is not all zeros (a tiling that mixed rows into one sum, or skipped one,
    would show)."""
    bf16 = path != "fp32"
    if bf16 and not kernel().bf16():
        pytest.skip("no AMX tiles or AVX512-BF16 here")
    if path == "bf16 decoded copy" and not kernel().wide_bf16():
        pytest.skip("the bf16 path here does not take decoded weights")
    rng = np.random.default_rng(7)
    k, n = 32 * 5, 37  # n: quads, pairs and a single weight row at the end of a chunk
    packed = torch.from_numpy(random_blocks(rng, "q4_1", n, k))
    dec = kernel().decode_bf16(packed, k) if path == "bf16 decoded copy" else None
    x = torch.from_numpy(rng.standard_normal((40, k)).astype(np.float32))
    solo = torch.cat([kernel().block_linear(x[r:r + 1], packed, bf16, dec) for r in range(40)])
    for m in range(1, 41):
        got = kernel().block_linear(x[:m].contiguous(), packed, bf16, dec)
        assert torch.equal(got, solo[:m]), f"rows of a {m}-row pass differ from their solo bits"
        assert bool((got != 0).any(dim=1).all())


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        BlockWeight("q4_1", torch.zeros(4, 21, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="block format"):
        BlockWeight("q5_k", torch.zeros(4, 20, dtype=torch.uint8), 32)


def test_llama_row_order_inverts_the_gguf_permutation():
    rows, heads = 24, 3
    w = np.arange(rows)
    # convert_hf_to_gguf's permute (what llama.cpp's converter does to q/k rows)
    gguf = w.reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)
    assert np.array_equal(gguf[_llama_row_order(rows, heads)], w)


@pytest.mark.model
def test_gguf_blocks_are_our_fp32_weights(tmq4, tm32):
    """Our safetensors are the dequantized GGUF: every q4_1 weight equals the fp32 model's, bit for bit."""
    for ly, ref in zip(tmq4.lean.layers, tm32.lean.layers):
        for name, w in ly.quant.items():
            assert torch.equal(w.dequantize(), getattr(ref, name)), name
    assert torch.equal(tmq4.lean.embed_blocks.dequantize(), tm32.lean.embed)
    assert tmq4.lean.differs_from_checkpoint == 0


@pytest.mark.model
def test_logits_match_fp32_lean(tmq4, tm32):
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 30000, DENSE_MIN_ROWS + 8))
    kq, k32 = new_cache(tmq4), new_cache(tm32)
    # Prefill in one pass runs q4_1's dense path, a 64-row chunk and the tree pass the block kernel.
    a, b = prefill(tmq4, kq, prompt, chunk=1024), prefill(tm32, k32, prompt, chunk=1024)
    assert torch.allclose(a, b, atol=5e-4, rtol=0)
    a, b = prefill(tmq4, kq, prompt[:64], chunk=64), prefill(tm32, k32, prompt[:64], chunk=64)
    assert torch.allclose(a, b, atol=5e-4, rtol=0)  # same weights; only the order of fp32 sums differs
    parents = np.array([-1, 0, 0, 1, -1, 4], np.int32)
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)
    a, b = verify_tree(tmq4, kq, 7, tokens, parents), verify_tree(tm32, k32, 7, tokens, parents)
    assert torch.allclose(a, b, atol=5e-4, rtol=0)


@pytest.mark.model
@pytest.mark.parametrize("text", ["def fib(n):", "import json\n\n\ndef load(path):\n"])
def test_greedy_tokens_equal_fp32(tmq4, tm32, text):
    ids = tm32.tokenizer(text)["input_ids"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert generate(tmq4, ids, params, tokenizer=None).token_ids == generate(tm32, ids, params,
                                                                            tokenizer=None).token_ids


@pytest.mark.model
def test_q4_1_needs_the_lean_forward():
    with pytest.raises(ValueError, match="lean forward only"):
        load_model("", dtype="q4_1", device="cpu", forward="hf")
