"""The fused C++ forward (lean_forward.cpp) against the lean forward's ops-in-Python path on the same weights.

Both compute the same function in fp32; only the order of sums differs (30 layers of it: logits of magnitude ~25
differ by up to ~1.5e-4), so logits agree within ATOL and the greedy token of every row is the same; a wrong index
or mask shows up as differences of order 1. Scenarios cover each way a pass reaches attention: an AR step, a draft tree (4D
mask), a causal chunk after cached rows, a causal prefill from nothing, a segment long enough for the ATen matmul
branch, and a ragged batch of several sequences (own caches and slab slots) with logits of the last rows only.
Each runs with the caches in fp16 (the default where the fused forward runs) and in fp32. In fp16 both paths store
the same rounding of their own fp32 keys/values, which may fall on the two sides of a rounding boundary: the caches
then differ by one fp16 step, and such steps carried through 30 layers move the later layers' keys/values and the
logits by up to ~1.2e-2 (540 positions): both are compared within ATOL_FP16_KV then, still far from the order-1 differences of a
wrong index or mask.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from generation_service.model.kernels.build import kernel
from generation_service.model.lean_llama import KVSlab, Segment
from generation_service.model.tree_attention import tree_mask

pytestmark = pytest.mark.model

ATOL = 5e-4
ATOL_FP16_KV = 2.5e-2

@contextmanager
def ops_path(lean):
    """The same model with the fused kernel switched off."""
    fused, lean.fused = lean.fused, None
    try:
        yield
    finally:
        lean.fused = fused


@dataclass(frozen=True)
class Seq:
    past: int  # cached rows before the pass
    q: int  # new rows
    tree: bool = False  # a bushy draft tree (4D mask) instead of causal rows
    logits_rows: int = 0


SCENARIOS = {
    "ar step": [Seq(200, 1)],
    "draft tree": [Seq(120, 9, tree=True)],
    "causal chunk after cached rows": [Seq(64, 16)],
    "prefill from nothing": [Seq(0, 20)],
    "long segment (matmul branch)": [Seq(500, 40, tree=True)],
    "ragged batch": [Seq(30, 1), Seq(90, 7, tree=True), Seq(10, 12, logits_rows=1), Seq(0, 5)],
}


def _mask(past: int, q: int, rng) -> torch.Tensor:
    parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(q - 2)], np.int32)  # q - 1 draft nodes
    return tree_mask(parents, past, torch.float32)[0, 0]  # [q, past + q]: the root row, then the draft nodes


def _run(lean, seqs: list[Seq], slab: bool, seed: int = 0, garbage: float | None = None):
    rng = np.random.default_rng(seed)
    store = KVSlab(len(lean.layers), lean.kv_heads, lean.head_dim, len(seqs), 1024, lean.kv_dtype,
                   torch.device("cpu")) if slab else None
    if store is not None and garbage is not None:  # what uninitialized memory may hold
        if store.k.dtype == torch.float16 and np.isfinite(garbage):
            garbage = min(garbage, float(torch.finfo(torch.float16).max))  # its largest finite number
        store.k.fill_(garbage)
        store.v.fill_(garbage)
    caches, segments = [], []
    for j, s in enumerate(seqs):
        cache = store.cache(j) if slab else lean.new_cache(64)
        if s.past:
            with ops_path(lean):  # the same prefix in both runs
                lean.forward(torch.from_numpy(rng.integers(0, 30000, s.past)), torch.arange(s.past), cache)
        ids = torch.from_numpy(rng.integers(0, 30000, s.q))
        mask = _mask(s.past, s.q, rng) if s.tree else None
        caches.append(cache)
        segments.append(Segment(ids, torch.arange(s.past, s.past + s.q), cache, mask, s.logits_rows))
    return lean.forward_batch(segments), caches


def _atol(lean) -> float:
    return ATOL_FP16_KV if lean.kv_dtype == torch.float16 else ATOL


# Every kernel a variant runs (the fp32 and the Q4_1 linears, fp16 and fp32 KV attention) is covered by two of them,
# at two thirds of the time: the fast tier runs those two, the slow tier the third as well. test_portable_kernels
# reruns this file on a lower x86-64 level's build with the two.
VARIANTS = ["q4_1/fp16 kv", "fp32/fp32 kv", pytest.param("fp32/fp16 kv", marks=pytest.mark.slow)]
if os.environ.get("RAGSERVE_TEST_KERNEL_LEVEL"):
    VARIANTS = VARIANTS[:2]


@pytest.fixture(scope="module", params=VARIANTS)
def lean(request, tm32, tmq4):
    weights, kv = request.param.removesuffix(" kv").split("/")
    tm = tm32 if weights == "fp32" else tmq4
    if tm.lean.fused is None:
        pytest.skip("the CPU kernel extension is not built here")
    tm.lean.set_kv_dtype(kv)
    yield tm.lean
    tm.lean.set_kv_dtype("auto")


@pytest.mark.parametrize("slab", [False, True], ids=["own caches", "slab slots"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fused_equals_ops_path(lean, name, slab):
    seqs = SCENARIOS[name]
    fused, kv_fused = _run(lean, seqs, slab)
    with ops_path(lean):
        ops, kv_ops = _run(lean, seqs, slab)
    for s, a, b, ca, cb in zip(seqs, fused, ops, kv_fused, kv_ops):
        assert a.shape == b.shape == ((s.logits_rows or s.q), lean.lm_head.shape[0])
        assert torch.allclose(a, b, atol=_atol(lean), rtol=0), float((a - b).abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert ca.length == cb.length == s.past + s.q  # not more: the pass added exactly its rows
        n = s.past + s.q
        assert ca.k.dtype == cb.k.dtype == lean.kv_dtype
        assert torch.allclose(ca.k[:, :, :n].float(), cb.k[:, :, :n].float(), atol=_atol(lean), rtol=0)
        assert torch.allclose(ca.v[:, :, :n].float(), cb.v[:, :, :n].float(), atol=_atol(lean), rtol=0)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_slab_garbage_never_reaches_the_logits(lean, garbage):
    """A slab comes from torch.empty: rows no pass wrote yet may hold anything. The grouped attention reads slots
    up to the longest member and masks the rest, and a masked row's value still gets multiplied by 0."""
    seqs = SCENARIOS["ragged batch"]
    want, _ = _run(lean, seqs, slab=False)
    for path in (contextlib.nullcontext, lambda: ops_path(lean)):
        with path():
            got, _ = _run(lean, seqs, slab=True, garbage=garbage)
        for a, b in zip(want, got):
            assert torch.isfinite(b).all()  # Not NaN from 0 x NaN
            assert torch.allclose(a, b, atol=_atol(lean), rtol=0)


def test_fused_feeds_the_hidden_sink(lean):
    lean.hidden_sink = []
    try:
        _run(lean, [Seq(40, 3, logits_rows=2)], slab=False)
        fused = lean.hidden_sink[-1]  # the prefix's prefill appended before it
        with ops_path(lean):
            _run(lean, [Seq(40, 3, logits_rows=2)], slab=False)
        ops = lean.hidden_sink[-1]
    finally:
        lean.hidden_sink = None
    assert fused.shape == ops.shape == (1, 2, lean.embed.shape[1])  # the logits rows' hidden states, not all 3
    assert torch.allclose(fused, ops, atol=_atol(lean), rtol=0)


def test_a_row_gets_the_same_bits_in_a_step_and_in_a_small_tree(lean):
    """Lossless speculation in a weight format needs a row's logits not to depend on what else is in the pass:
    the root row of a tree pass (which sees only the cached rows) equals the AR step over the same token."""
    rng = np.random.default_rng(3)
    prefix = torch.from_numpy(rng.integers(0, 30000, 50))
    outs = []
    for q in (1, 5):
        cache = lean.new_cache(64)
        lean.forward(prefix, torch.arange(50), cache)
        ids = torch.tensor([7] + [int(t) for t in rng.integers(0, 30000, q - 1)])
        mask = _mask(50, q, rng) if q > 1 else None
        outs.append(lean.forward(ids, torch.arange(50, 50 + q), cache, mask)[0])
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))


@pytest.mark.parametrize("pasts", [
    # the long ones last: contiguous thread ranges would split them unevenly (the slow tier)
    pytest.param([40, 40, 40, 40, 300, 300, 300, 300], marks=pytest.mark.slow),
    [300, 5, 220, 17, 90, 260, 1, 130],    # ragged, as a running batch is
])
def test_an_ar_row_gets_the_same_bits_alone_and_in_a_ragged_batch(lean, pasts):
    """Each pass spreads its (row, kv head) attention jobs over the threads by their lengths; which thread runs a
    job must not change a bit of any row: every row of a batch of AR steps equals that sequence's step alone."""
    rng = np.random.default_rng(5)
    prefixes = [torch.from_numpy(rng.integers(0, 30000, p)) for p in pasts]
    ids = [torch.tensor([int(t)]) for t in rng.integers(0, 30000, len(pasts))]

    caches = []
    for prefix in prefixes:
        c = lean.new_cache(max(64, len(prefix) + 8))
        lean.forward(prefix, torch.arange(len(prefix)), c)
        caches.append(c)

    def step_alone(i, p, c):
        out = lean.forward(i, torch.tensor([len(p)]), c)[0]
        c.crop(len(p))  # the step's row goes: the batch below appends it again
        return out

    alone = [step_alone(i, p, c) for i, p, c in zip(ids, prefixes, caches)]
    batch = lean.forward_batch([Segment(i, torch.tensor([len(p)]), c) for i, p, c in zip(ids, prefixes, caches)])
    for a, b in zip(alone, batch):
        assert torch.equal(a, b.reshape(a.shape))
    assert not torch.equal(batch[0], batch[1])  # Not one row copied into every place


# (past, draft nodes, other sequences in the pass): big trees used to take ATen's matmul attention, whose rows
# differ from an AR step's in the last bits.
PATH_SCENARIOS = {
    "small tree alone": (50, 6, 0),
    "deep tree past the matmul threshold": (300, 40, 0),
    "tree beside an AR row and another tree": (120, 24, 2),
}


@pytest.mark.parametrize("name", list(PATH_SCENARIOS))
def test_every_tree_row_equals_the_ar_steps_of_its_path(lean, name):
    """In the fused pass a decode row's logits depend only on its token, its position and the keys it sees (the
    per-row attention kernel, AVX-512 or AVX2, or the scalar loops): each node of a tree pass == the AR step that
    decodes the same token after the same accepted path, bit for bit, whatever else is in the pass."""
    if lean.fused is None:
        pytest.skip("the fused forward is not built here")
    past, nodes, others = PATH_SCENARIOS[name]
    rng = np.random.default_rng(past + nodes)
    prefix = torch.from_numpy(rng.integers(0, 30000, past))
    parents = np.array([-1] + [int(rng.integers(max(-1, i - 3), i)) for i in range(nodes - 1)], np.int32)
    tokens = rng.integers(0, 30000, nodes)
    cache = lean.new_cache(64)
    lean.forward(prefix, torch.arange(past), cache)
    depth = np.zeros(nodes + 1, np.int64)
    for i, p in enumerate(parents):
        depth[i + 1] = depth[p + 1] + 1
    seg = Segment(torch.tensor([7] + tokens.tolist()), torch.from_numpy(past + depth), cache,
                  tree_mask(parents, past, torch.float32)[0, 0])
    extra = []
    for j in range(others):
        c = lean.new_cache(64)
        lean.forward(torch.from_numpy(rng.integers(0, 30000, 40 + j)), torch.arange(40 + j), c)
        q = 1 if j == 0 else 9
        extra.append(Segment(torch.from_numpy(rng.integers(0, 30000, q)), torch.arange(40 + j, 40 + j + q), c,
                             _mask(40 + j, q, rng) if q > 1 else None))
    tree = lean.forward_batch([seg] + extra)[0]  # [1 + nodes, V]
    leaf = int(np.argmax(depth))  # the deepest row: its path is every ancestor
    path = [leaf]
    while path[-1] > 0:
        path.append(int(parents[path[-1] - 1]) + 1)
    path = path[::-1]  # rows from the root
    ids = [7] + tokens.tolist()
    ar = lean.new_cache(64)
    lean.forward(prefix, torch.arange(past), ar)
    for k, row in enumerate(path):
        step = lean.forward(torch.tensor([ids[row]]), torch.tensor([past + k]), ar)[0]
        assert torch.equal(step, tree[row]), (k, row, float((step - tree[row]).abs().max()))  # Not merely close


# isa() -> the per-row attention kernel that build has: not a scalar fallback where the vector units exist.
ROW_KERNELS = {"avx512+amx": "avx512", "avx512+bf16": "avx512", "avx512": "avx512", "avx2": "avx2", "scalar": ""}


def test_row_attention_kernel_matches_the_build():
    ext = kernel()
    if ext is None:
        pytest.skip("the CPU kernel extension is not built here")
    assert ext.row_attention() == ROW_KERNELS[ext.isa()], ext.isa()


@pytest.mark.parametrize("m,n,k", [(1, 96, 64), (3, 40, 128), (9, 17, 576), (20, 5, 32)])
def test_f32_linear_matches_matmul(m, n, k):
    ext = kernel()
    if ext is None:
        pytest.skip("the CPU kernel extension is not built here")
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    out = ext.f32_linear(x, w)
    assert torch.allclose(out, x @ w.T, atol=1e-4, rtol=1e-5)
    # Each row alone gets the same bits as inside the pass.
    assert torch.equal(torch.cat([ext.f32_linear(x[i:i + 1], w) for i in range(m)]), out)
    with pytest.raises(RuntimeError, match="inputs"):
        ext.f32_linear(x, torch.randn(n, k + 32))
