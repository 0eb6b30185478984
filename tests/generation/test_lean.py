"""The lean forward (model/lean_llama.py) against transformers' forward on the same weights, and its KV cache."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from generation_service.engine.speculative import generate, prefill, verify_tree
from generation_service.model.lean_llama import KVCache, LeanLlama, capacity_for
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import new_cache
from tests.conftest import real_model


@pytest.fixture(scope="module")
def hf32():
    return real_model("fp32", forward="hf")


@contextmanager
def kv_stored_as(tm, kind: str):
    before = tm.lean.kv_dtype
    tm.lean.set_kv_dtype(kind)
    try:
        yield
    finally:
        tm.lean.kv_dtype = before


# fp32 caches: the same function as transformers up to the order of sums. fp16 caches (the default where the fused
# forward runs): keys/values rounded to 11 significant bits, carried through 30 layers (tests/generation/
# test_lean_fused.py); the same greedy token on every row either way.
@pytest.mark.model
@pytest.mark.parametrize("kv, atol", [("fp32", 1e-4), ("auto", 2.5e-2)])
def test_logits_match_transformers_in_fp32(tm32, hf32, kv, atol):
    assert tm32.forward_name == "lean" and hf32.forward_name == "hf"
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(0, 30000, 300))
    with kv_stored_as(tm32, kv):
        lean_kv, hf_kv = new_cache(tm32), new_cache(hf32)
    # Chunked prefill (a causal chunk after cached rows), then a tree pass, then an AR step.
    a = prefill(tm32, lean_kv, prompt, chunk=128)
    b = prefill(hf32, hf_kv, prompt, chunk=128)
    assert torch.allclose(a, b, atol=atol, rtol=0)
    parents = np.array([-1, 0, 0, 1, -1, 4, 2, 6], np.int32)  # a bushy tree
    tokens = rng.integers(0, 30000, len(parents)).astype(np.int32)
    a = verify_tree(tm32, lean_kv, 7, tokens, parents)
    b = verify_tree(hf32, hf_kv, 7, tokens, parents)
    assert a.shape == b.shape == (9, tm32.vocab_size)
    assert torch.allclose(a, b, atol=atol, rtol=0)  # Not just the same argmax: the same logits
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert lean_kv.get_seq_length() == hf_kv.get_seq_length() == 309


@pytest.mark.model
@pytest.mark.parametrize("text", ["def fib(n):", pytest.param("import json\n\n\ndef load(path):\n", marks=pytest.mark.slow),
                                  pytest.param("The capital of France", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_transformers(tm32, hf32, text):
    ids = tm32.tokenizer(text)["input_ids"]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    assert generate(tm32, ids, params, tokenizer=None).token_ids == generate(hf32, ids, params,
                                                                            tokenizer=None).token_ids


def _filled(length: int, capacity: int = 4) -> KVCache:
    kv = KVCache(layers=2, kv_heads=3, head_dim=4, capacity=capacity, dtype=torch.float32, device=torch.device("cpu"))
    kv.reserve(length)
    kv.k[:, :, :length] = torch.arange(length, dtype=torch.float32)[None, None, :, None]
    kv.v[:, :, :length] = -torch.arange(length, dtype=torch.float32)[None, None, :, None]
    kv.length = length
    return kv


@pytest.mark.parametrize("path", [[], [0, 1, 2], [1, 3, 6], [2]])
def test_gather_keeps_past_root_and_path_rows(path):
    past, q = 5, 8
    kv = _filled(past + q)
    kv.gather(past, path)
    keep = list(range(past + 1)) + [past + 1 + p for p in path]
    assert kv.get_seq_length() == len(keep)
    assert kv.k[0, 0, : len(keep), 0].tolist() == keep  # Not the rejected rows
    assert kv.v[1, 2, : len(keep), 0].tolist() == [-r for r in keep]


def test_reserve_grows_and_keeps_rows_crop_has_transformers_semantics():
    kv = _filled(3, capacity=3)
    kv.reserve(10)
    assert kv.capacity >= 13 and kv.k[0, 0, :3, 0].tolist() == [0, 1, 2]  # Not lost when growing
    kv.crop(-1)
    assert kv.get_seq_length() == 2  # negative: drop that many rows
    kv.crop(5)
    assert kv.get_seq_length() == 2  # positive: keep at most that many


def test_capacity_covers_a_request():
    assert capacity_for(100, 128, 64) >= 100 + 128 + 64 and capacity_for(100, 128, 64) % 64 == 0


def test_unsupported_architectures_say_why():
    class Cfg:
        model_type = "gpt2"

    class M:
        config = Cfg()

    assert "gpt2" in LeanLlama.supports(M())
    with pytest.raises(ValueError, match="lean forward does not support"):
        from generation_service.model.target import TargetModel, with_forward

        with_forward(TargetModel(M(), None, torch.device("cpu"), torch.float32, 1, frozenset(), 1, ""), "lean")


# (setting, fused forward built?) -> the dtype caches get, or the error's words
KV_DTYPE_SCENARIOS = [
    ("auto", True, torch.float16),
    ("fp16", True, torch.float16),
    ("fp32", True, torch.float32),
    ("auto", False, torch.float32),  # the ops path alone: the activations' dtype
    ("fp16", False, "needs the fused forward"),
    ("bf16", True, "not one of"),
]


@pytest.mark.model
@pytest.mark.parametrize("kind, fused, want", KV_DTYPE_SCENARIOS)
def test_kv_cache_dtype(tm32, kind, fused, want):
    lean = tm32.lean
    if lean.fused is None:
        pytest.skip("the CPU kernel extension is not built here")
    before, kernel_pass = lean.kv_dtype, lean.fused
    try:
        if not fused:
            lean.fused = None
        if isinstance(want, str):
            with pytest.raises(ValueError, match=want):
                lean.set_kv_dtype(kind)
            assert lean.kv_dtype == before  # Not half-applied
        else:
            assert lean.set_kv_dtype(kind) == want
            assert lean.new_cache(8).k.dtype == lean.new_cache(8).v.dtype == want
    finally:
        lean.fused, lean.kv_dtype = kernel_pass, before


@pytest.mark.parametrize("value, want", [(1.5, 1.5), (1e6, 65504.0), (-1e6, -65504.0), (float("inf"), 65504.0)])
def test_fp16_cache_saturates_instead_of_inf(value, want):
    from generation_service.model.lean_llama import _stored

    got = _stored(torch.tensor([value]), torch.float16)
    assert got.dtype == torch.float16 and float(got[0]) == want  # Not inf: inf - inf in a softmax is NaN


@pytest.mark.parametrize("value, ok", [("auto", True), ("fp16", True), ("fp32", True), ("int8", False), ("", False)])
def test_kv_cache_dtype_setting(value, ok):
    from generation_service.config import GenerationConfig

    if ok:
        assert GenerationConfig(kv_cache_dtype=value).kv_cache_dtype == value
    else:  # the error names the setting
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            GenerationConfig(kv_cache_dtype=value)
