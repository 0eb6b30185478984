"""The int8-activation linears (int8_linear.cpp, the q4_1_i8 format) against a numpy reference, on every path this
CPU runs (scalar, AVX2, AVX-VNNI, AVX512-VNNI: set_i8_path), and the contract that makes speculation lossless in that
format: a row's result is the same bits alone, in a 64-node draft tree and beside 15 other sequences.

The reference is brute force: activations quantized per row and block of 32 as the kernel documents, the integer
dot product of every block in int64 (exact), then the two fused multiply-adds per block in fp32, emulated exactly
(the product in fp64 is exact, the sum's rounding error by TwoSum decides the one case where rounding fp64 to fp32
twice would go wrong). So the comparison is bit for bit, not within a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from generation_service.model import i8_groups
from generation_service.model.kernels.build import kernel
from generation_service.model.lean_llama import Segment
from generation_service.model.tree_attention import tree_mask

k = kernel()
pytestmark = pytest.mark.skipif(k is None or not hasattr(k, "i8_linear"), reason="CPU kernels not built here")
PATHS = k.i8_paths() if k is not None and hasattr(k, "i8_paths") else []
f32, f64 = np.float32, np.float64


# -- the reference ---------------------------------------------------------------------------------------------------


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 [M, K] -> (int8 codes [M, K], scales [M, K/32], scale * code sums [M, K/32])."""
    m, kk = x.shape
    xb = x.reshape(m, kk // 32, 32)
    amax = np.abs(xb).max(-1)
    dx = amax / f32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, f32(127) / amax, f32(0)).astype(f32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    xs = dx * q.astype(np.int32).sum(-1).astype(f32)
    return q.reshape(m, kk), dx, xs


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Correctly rounded fp32 a * b + c (one rounding), elementwise."""
    a, b, c = np.broadcast_arrays(a.astype(f64), b.astype(f64), c.astype(f64))
    p = a * b  # exact: 24 + 24 significant bits
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)  # p + c == s + e exactly
    r = s.astype(f32)
    r64 = r.astype(f64)
    other = np.where(r64 < s, np.nextafter(r, f32(np.inf)), np.nextafter(r, f32(-np.inf))).astype(f32)
    mid = (r64 + other.astype(f64)) / 2
    fix = (r64 != s) & (s == mid) & (e != 0)  # s sits on a tie only because of the rounding of p + c
    up = np.maximum(r, other)
    down = np.minimum(r, other)
    return np.where(fix, np.where(e > 0, up, down), r).astype(f32)


def blocks_ref(kind: str, packed: np.ndarray, kk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF rows -> (unsigned codes int64 [N, nb, 32], d [N, nb], m [N, nb]) with weight = d * code + m."""
    n, nb = packed.shape[0], kk // 32
    b = packed.reshape(n, nb, -1)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(f32)
    if kind == "q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(f32)
        codes = np.concatenate([b[..., 4:] & 0x0F, b[..., 4:] >> 4], axis=-1).astype(np.int64)
    else:
        m = d * f32(-128)
        codes = b[..., 2:].view(np.int8).astype(np.int64) + 128
    return codes, d, m


def linear_ref(x: np.ndarray, kind: str, packed: np.ndarray) -> np.ndarray:
    kk = x.shape[1]
    q, dx, xs = quantize_ref(x)
    codes, d, m = blocks_ref(kind, packed, kk)
    isum = np.einsum("rbj,nbj->rnb", q.reshape(x.shape[0], kk // 32, 32).astype(np.int64), codes)  # exact
    acc = np.zeros((x.shape[0], packed.shape[0]), f32)
    for b in range(kk // 32):
        dd = d[None, :, b] * dx[:, None, b]
        acc = fma32(isum[:, :, b].astype(f32), dd, acc)
        acc = fma32(m[None, :, b], xs[:, None, b], acc)
    return acc


def random_blocks(kind: str, n: int, kk: int, rng) -> np.ndarray:
    nb = kk // 32
    d = (rng.uniform(0.002, 0.05, (n, nb)) * rng.choice([-1, 1], (n, nb))).astype(np.float16)
    if kind == "q4_1":
        m = rng.uniform(-0.3, 0.3, (n, nb)).astype(np.float16)
        qs = rng.integers(0, 256, (n, nb, 16), dtype=np.uint8)
        blk = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), m.view(np.uint8).reshape(n, nb, 2), qs], -1)
    else:
        qs = rng.integers(-128, 128, (n, nb, 32)).astype(np.int8).view(np.uint8)
        blk = np.concatenate([d.view(np.uint8).reshape(n, nb, 2), qs], -1)
    return np.ascontiguousarray(blk.reshape(n, -1))


def activations(m: int, kk: int, rng) -> np.ndarray:
    x = rng.normal(0, 1, (m, kk)).astype(f32)
    x[0, :32] = 0  # a block of zeros: scale 0, codes 0
    if kk >= 64:
        x[-1, 40] = 90.0  # an outlier: the rest of its block quantizes to few codes
    return x


@pytest.fixture(params=PATHS)
def path(request):
    k.set_i8_path(request.param)
    yield request.param
    k.set_i8_path("")


# -- the kernel ------------------------------------------------------------------------------------------------------


def test_quantization_matches_the_reference(path):
    x = activations(7, 192, np.random.default_rng(0))
    # ties: amax 127 makes the step 1, so x.5 must round to the even code on every path (nearbyint)
    x[1, 32:64] = np.array([127.0] + [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4 + [-3.5, 126.5, -126.5], f32)
    q, dx, xs = k.i8_quantize(torch.from_numpy(x))
    rq, rdx, rxs = quantize_ref(x)
    assert np.array_equal(q.numpy(), rq)
    assert np.array_equal(dx.numpy(), rdx) and np.array_equal(xs.numpy(), rxs)
    assert np.abs(q.numpy()).max() == 127 and (q.numpy()[0, :32] == 0).all()  # Not 128; the zero block stays 0
    assert q.numpy()[1, 32:40].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]  # Not [127, 1, 2, 3, -1, -2, -3, 4]
    # what the codes stand for: within half a step of x
    step = np.repeat(rdx, 32, axis=1)
    assert (np.abs(q.numpy() * step - x) <= step * 0.5 + 1e-6).all()


# (kind, rows, output columns, inputs): columns not a multiple of 16 (a padded group), 1 and 2+ tiles of rows.
SHAPES = [
    ("q4_1", 1, 16, 32),
    ("q4_1", 3, 40, 96),
    ("q4_1", 9, 17, 576),
    ("q4_1", 20, 50, 64),
    ("q8_0", 1, 33, 64),
    ("q8_0", 11, 48, 160),
]


@pytest.mark.parametrize("kind, m, n, kk", SHAPES)
def test_linear_matches_the_reference_bit_for_bit(path, kind, m, n, kk):
    rng = np.random.default_rng(m * 1000 + n)
    w = random_blocks(kind, n, kk, rng)
    x = activations(m, kk, rng)
    layout = k.i8_layout(torch.from_numpy(w), kk)
    assert layout.shape == ((n + 15) // 16, kk // 32 * (320 if kind == "q4_1" else 544))
    got = k.i8_linear(torch.from_numpy(x), layout, n).numpy()
    want = linear_ref(x, kind, w)
    assert got.shape == (m, n)
    assert np.array_equal(got, want), float(np.abs(got - want).max())  # Not merely close
    # and the reference computes x @ W^T up to the activations' quantization (the outlier row aside: its block's
    # other inputs are left with a few codes)
    codes, d, mm = blocks_ref(kind, w, kk)
    dense = (d[..., None] * codes + mm[..., None]).reshape(n, kk)
    exact = x.astype(f64) @ dense.T.astype(f64)
    plain = slice(0, m - 1 if kk >= 64 and m > 1 else m)
    assert np.abs(got - exact)[plain].max() <= 0.02 * np.abs(exact).max()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_bits_in_any_pass_on_every_path(kind):
    rng = np.random.default_rng(7)
    n, kk = 70, 256
    w = torch.from_numpy(random_blocks(kind, n, kk, rng))
    layout = k.i8_layout(w, kk)
    x = torch.from_numpy(activations(37, kk, rng))
    outs = {}
    for p in PATHS:
        k.set_i8_path(p)
        try:
            full = k.i8_linear(x, layout, n)
            for rows in ([0], [5, 6], list(range(3, 12)), list(range(17, 37))):  # alone, 2, one tile+1, 3 tiles
                part = k.i8_linear(x[rows].contiguous(), layout, n)
                assert torch.equal(part, full[rows]), (p, rows)
            outs[p] = full
        finally:
            k.set_i8_path("")
    first = outs[PATHS[0]]
    for p, o in outs.items():
        assert torch.equal(o, first), p  # every path: the same bits (Not merely the same within a path)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_column_groups_a_tile_takes_change_no_bit(kind):
    rng = np.random.default_rng(11)
    n, kk = 150, 128  # 10 groups: tiles of 4, 2 and 1 groups all run
    w = torch.from_numpy(random_blocks(kind, n, kk, rng))
    layout = k.i8_layout(w, kk)
    x = torch.from_numpy(activations(6, kk, rng))
    before = k.i8_groups()
    try:
        outs = {}
        for groups in (1, 2, 4):
            k.set_i8_groups(groups)
            outs[groups] = [k.i8_linear(x[:m].contiguous(), layout, n) for m in range(1, 7)]
        want = [torch.from_numpy(linear_ref(x[:m].numpy(), kind, w.numpy())) for m in range(1, 7)]
        for groups, got in outs.items():
            for m, (g, r) in enumerate(zip(got, want), start=1):
                assert torch.equal(g, r), (groups, m)  # Not merely close
        with pytest.raises(RuntimeError, match="1, 2 or 4"):
            k.set_i8_groups(3)
    finally:
        k.set_i8_groups(before)


def test_the_group_choice_is_timed_and_set():
    rng = np.random.default_rng(12)
    layouts = [k.i8_layout(torch.from_numpy(random_blocks("q4_1", 64, 128, rng)), 128) for _ in range(2)]
    before = k.i8_groups()
    try:
        groups, ms = i8_groups.tune(k, layouts, 128, 64, rounds=2)
        assert k.i8_groups() == groups
        if k.i8_path() == "avx512_vnni":
            assert groups in i8_groups.CHOICES and sorted(ms) == sorted(i8_groups.CHOICES)
            assert all(v > 0 for v in ms.values())
        else:
            assert ms == {} and groups == before  # Not timed: the choice is the 512-bit tiles' only
    finally:
        k.set_i8_groups(before)


# (ms per round by choice, the choice): the lowest median, not the lowest single round; a tie goes to fewer groups.
FASTEST = [
    ({1: [3.0, 3.1, 3.2], 2: [3.5, 3.6, 3.4], 4: [4.0, 4.1, 3.9]}, 1),
    ({1: [5.0, 5.1, 5.2], 2: [4.5, 4.4, 4.6], 4: [4.0, 4.1, 4.2]}, 4),
    ({1: [5.0, 1.0, 5.2], 2: [4.5, 4.4, 4.6], 4: [4.7, 4.8, 4.9]}, 2),  # Not 1: one lucky round
    ({1: [4.0, 4.0], 2: [4.0, 4.0], 4: [4.0, 4.0]}, 1),
]


@pytest.mark.parametrize("ms, want", FASTEST)
def test_fastest_choice(ms, want):
    assert i8_groups.fastest(ms) == want


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(1)
    w = torch.from_numpy(random_blocks("q4_1", 20, 64, rng))
    layout = k.i8_layout(w, 64)
    with pytest.raises(RuntimeError, match="layout"):
        k.i8_linear(torch.zeros(2, 96), layout, 20)  # K does not match the layout
    with pytest.raises(RuntimeError, match="neither Q4_1 nor Q8_0"):
        k.i8_layout(w, 96)
    with pytest.raises(RuntimeError, match="does not run here"):
        k.set_i8_path("amx_int8")
    assert k.i8_path() == PATHS[0]  # the refused choice changed nothing


def test_paths_this_cpu_runs():
    from ragcore.machine import cpu_info

    flags = set(cpu_info()[1])
    assert PATHS[-1] == "scalar"
    assert ("avx512_vnni" in PATHS) == {"avx512_vnni", "avx512bw", "avx512vl", "avx2"}.issubset(flags)
    assert ("avx2" in PATHS) == {"avx2", "fma"}.issubset(flags)


# -- the model -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lean(tmq4i8):
    if tmq4i8.lean is None or tmq4i8.lean.fused is None:
        pytest.skip("the fused forward is not built here")
    return tmq4i8.lean


def _tree(nodes: int, rng) -> np.ndarray:
    return np.array([-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(nodes - 1)], np.int32)


@pytest.mark.model
def test_a_row_is_the_same_alone_in_a_64_node_tree_and_beside_15_sequences(lean, path):
    """One pass: a 64-row tree (the root + 63 draft nodes) beside 15 other sequences (AR rows and small trees).
    Every row on the tree's deepest path == the AR step decoding that token after that path, alone; every other
    sequence's rows == that sequence alone in a pass of its own."""
    rng = np.random.default_rng(64)
    past = 24
    prefix = torch.from_numpy(rng.integers(0, 30000, past))
    parents = _tree(63, rng)
    tokens = [7] + rng.integers(0, 30000, 63).tolist()
    depth = np.zeros(64, np.int64)
    for i, p in enumerate(parents):
        depth[i + 1] = depth[p + 1] + 1

    def cache_after(ids):
        c = lean.new_cache(128)
        lean.forward(ids, torch.arange(len(ids)), c)
        return c

    others = []
    for j in range(15):
        ids = torch.from_numpy(rng.integers(0, 30000, 6 + j // 2))
        q = 1 if j % 3 else 4
        new = torch.from_numpy(rng.integers(0, 30000, q))
        mask = tree_mask(_tree(q - 1, rng), len(ids), torch.float32)[0, 0] if q > 1 else None
        others.append((ids, new, mask, cache_after(ids)))
    tree_cache = cache_after(prefix)
    segs = [Segment(torch.tensor(tokens), torch.from_numpy(past + depth), tree_cache,
                    tree_mask(parents, past, torch.float32)[0, 0])]
    for ids, new, mask, c in others:
        segs.append(Segment(new, torch.arange(len(ids), len(ids) + len(new)), c, mask))
    out = lean.forward_batch(segs)

    leaf = int(np.argmax(depth))
    rows = [leaf]
    while rows[-1] > 0:
        rows.append(int(parents[rows[-1] - 1]) + 1)
    tree_cache.crop(past)  # the prefix's rows stay; the AR steps overwrite the tree's
    for step, row in enumerate(rows[::-1]):
        alone = lean.forward(torch.tensor([tokens[row]]), torch.tensor([past + step]), tree_cache)[0]
        assert torch.equal(alone, out[0][row]), (path, step, float((alone - out[0][row]).abs().max()))
    for (ids, new, mask, c), batched in zip(others, out[1:]):
        c.crop(len(ids))
        alone = lean.forward(new, torch.arange(len(ids), len(ids) + len(new)), c, mask)
        assert torch.equal(alone, batched), path
    assert not torch.equal(out[1], out[2][:1])  # Not one row copied everywhere


@pytest.mark.model
def test_every_path_gives_the_model_the_same_logits(lean):
    rng = np.random.default_rng(3)
    ids = torch.from_numpy(rng.integers(0, 30000, 24))
    outs = []
    for p in PATHS:
        k.set_i8_path(p)
        try:
            outs.append(lean.forward(ids, torch.arange(24), lean.new_cache(64)))
        finally:
            k.set_i8_path("")
    for p, o in zip(PATHS, outs):
        assert torch.equal(o, outs[0]), p
    assert torch.isfinite(outs[0]).all() and outs[0].abs().max() > 1


@pytest.mark.model
def test_int8_activations_stay_close_to_fp32_activations(lean, tmq4):
    """The same weights with fp32 activations: logits close, the greedy pick mostly the same (the quality guard
    on a corpus is bench/perplexity's)."""
    rng = np.random.default_rng(11)
    ids = torch.from_numpy(rng.integers(0, 30000, 48))
    a = lean.forward(ids, torch.arange(48), lean.new_cache(64))
    b = tmq4.lean.forward(ids, torch.arange(48), tmq4.lean.new_cache(64))
    assert not torch.equal(a, b)  # Not secretly the fp32 path
    assert float((a - b).abs().max()) < 0.1 * float(b.abs().max())
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8
