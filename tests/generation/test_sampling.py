"""Temperature / top-k / top-p processing against a plain reference, the inverse-CDF draw, parameter checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from generation_service.model.kernels.build import kernel
from generation_service.model.sampling import (
    Sampler,
    SamplingParams,
    argmax_each,
    argmax_rows,
    process_logits,
    sample_from,
)


def ref_process(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Token -> probability, written the slow obvious way (HF order: temperature, top-k, top-p)."""
    z = logits.astype(np.float64) / temperature
    order = sorted(range(len(z)), key=lambda i: (-np.float32(z[i]), i))  # ties by token id
    if top_k:
        order = order[:top_k]
    w = np.exp(np.array([z[i] for i in order]) - max(z[i] for i in order))
    p = w / w.sum()
    kept, mass = [], 0.0
    for i, pi in zip(order, p):
        if mass >= top_p:
            break
        kept.append((i, pi))
        mass += pi
    total = sum(pi for _, pi in kept)
    return {i: pi / total for i, pi in kept}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-8, 8, width=32), min_size=1, max_size=30),
       st.sampled_from([0.5, 1.0, 1.7]), st.integers(0, 8), st.sampled_from([1.0, 0.95, 0.6, 0.2, 0.01]))
def test_process_logits_matches_reference(values, temperature, top_k, top_p):
    logits = np.array(values, np.float32)
    ids, probs = process_logits(torch.from_numpy(logits), temperature, top_k, top_p)
    got = dict(zip(ids.tolist(), probs.tolist()))
    want = ref_process(logits, temperature, top_k, top_p)
    # Set boundaries can differ only when the cumulative mass sits within rounding of top_p.
    if set(got) != set(want):
        assert abs(sum(sorted(ref_process(logits, temperature, top_k, 1.0).values(), reverse=True)[:len(got)])
                   - top_p) < 1e-6
        return
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("logits, top_k, top_p, u, want", [
    ([2.0, 0.0, 1.0], 2, 1.0, 0.5, 0),   # sorted [0, 2], probs [.73, .27]
    ([2.0, 0.0, 1.0], 2, 1.0, 0.9, 2),   # Not 1: top-k removed token 1
    ([2.0, 0.0, 1.0], 0, 0.5, 0.99, 0),  # top-p 0.5 keeps token 0 alone  # Not 1
    ([1.0, 1.0, 1.0], 0, 1.0, 0.0, 0),   # ties keep token-id order
    ([1.0, 1.0, 1.0], 0, 1.0, 0.999, 2),
])
def test_draw_scenarios(logits, top_k, top_p, u, want):
    ids, probs = process_logits(torch.tensor(logits), 1.0, top_k, top_p)
    assert sample_from(ids, probs, u) == want


def test_sampler_one_draw_per_token_and_seeded():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    row = torch.randn(50, generator=torch.Generator().manual_seed(0))
    a, b = Sampler(params), Sampler(params)
    picks_a = [a.pick(row) for _ in range(20)]
    assert a.draws == 20
    assert picks_a == [b.pick(row) for _ in range(20)]
    greedy = Sampler(SamplingParams())
    assert greedy.pick(row) == int(row.argmax()) and greedy.draws == 0  # greedy spends no draws


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(seed=-3), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(stop=("ok", "")), "stop"),
])
def test_params_reject_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_unseeded_sampling_picks_a_seed():
    p = SamplingParams(temperature=1.0)
    assert p.seed is None and 0 <= p.seed_used < 2**64
    assert SamplingParams(stop="END").stop == ("END",)


def ref_argmax(row: list[float]) -> int:
    """The first index of the maximum, NaN counting as the largest (torch's and the AR loop's rule)."""
    nan = [i for i, v in enumerate(row) if v != v]
    top = max(row)
    return nan[0] if nan else min(i for i, v in enumerate(row) if v == top)


# (rows, expected picks, a pick the rule must not give)
ARGMAX_SCENARIOS = {
    "tie goes to the first": ([[1.0, 3.0, 3.0, 2.0]], [1], [2]),
    "negative and positive zero are a tie": ([[0.0, -0.0, 0.0]], [0], [1]),
    "NaN wins, the first one": ([[1.0, float("nan"), 5.0, float("nan")]], [1], [2]),
    "several rows at once": ([[0.0, 1.0], [2.0, -1.0], [5.0, 5.0]], [1, 0, 0], [0, 1, 1]),
}


@pytest.mark.parametrize("name", list(ARGMAX_SCENARIOS))
def test_argmax_rows_scenarios(name):
    rows, want, not_want = ARGMAX_SCENARIOS[name]
    got = argmax_rows(torch.tensor(rows))
    assert got == want and got != not_want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-2.0, -0.0, 0.0, 0.5, 1.0, 7.0, float("inf"), float("-inf")]),
                         min_size=1, max_size=12).map(tuple), min_size=1, max_size=4).filter(
                             lambda rows: len({len(r) for r in rows}) == 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_argmax_rows_matches_reference_and_torch(rows, dtype):
    """Batched rows, a 1-D row and the sampler's greedy pick all give the reference's first maximum."""
    x = torch.tensor(rows, dtype=dtype)
    want = [ref_argmax(x[i].float().tolist()) for i in range(len(rows))]
    assert argmax_rows(x) == want == x.float().argmax(dim=-1).tolist()
    assert argmax_rows(x[0]) == want[:1] and Sampler(SamplingParams()).pick(x[0]) == want[0]


@pytest.fixture(scope="module")
def cpu_kernel():
    k = kernel()
    if k is None:
        pytest.skip("the CPU kernels cannot be built here")
    return k


# Rows long enough for the kernel's vector loop (32+), with the maximum placed at lane and tail boundaries.
def _row(n: int, at: dict[int, float]) -> list[float]:
    row = [float(i % 7) - 3.0 for i in range(n)]
    for i, v in at.items():
        row[i] = v
    return row


KERNEL_ARGMAX_SCENARIOS = {  # (rows, expected picks, a pick the rule must not give)
    "max in the tail": ([_row(49, {47: 9.0})], [47], [0]),
    "max in the first lane block": ([_row(64, {3: 9.0})], [3], [47]),
    "tie across lanes goes to the first": ([_row(64, {40: 9.0, 17: 9.0, 63: 9.0})], [17], [40]),
    "tie between vector part and tail goes to the first": ([_row(50, {5: 9.0, 49: 9.0})], [5], [49]),
    "NaN in the vector part wins over a larger max": ([_row(64, {20: float("nan"), 3: 99.0})], [20], [3]),
    "NaN in the tail wins": ([_row(50, {48: float("nan"), 3: 99.0})], [48], [3]),
    "all -inf: the first": ([[float("-inf")] * 40], [0], [39]),
    "a vocabulary-wide row": ([_row(49152, {49151: 9.0, 30000: 9.0})], [30000], [49151]),
    "rows differ": ([_row(40, {1: 9.0}), _row(40, {38: 9.0})], [1, 38], [38, 1]),
}


@pytest.mark.parametrize("name", list(KERNEL_ARGMAX_SCENARIOS))
def test_kernel_argmax_rows_scenarios(name, cpu_kernel):
    rows, want, not_want = KERNEL_ARGMAX_SCENARIOS[name]
    got = cpu_kernel.argmax_rows(torch.tensor(rows)).tolist()
    assert got == want and got != not_want and got == [ref_argmax(r) for r in rows]
    assert argmax_rows(torch.tensor(rows)) == want  # the sampler's path takes the kernel once it is loaded


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 90), st.data())
def test_kernel_argmax_rows_matches_reference(cpu_kernel, m, n, data):
    """Brute force: any rows of few distinct values (ties everywhere), zeros of both signs, infinities, NaNs."""
    values = st.sampled_from([-2.0, -0.0, 0.0, 0.5, 7.0, float("inf"), float("-inf"), float("nan")])
    rows = [data.draw(st.lists(values, min_size=n, max_size=n)) for _ in range(m)]
    got = cpu_kernel.argmax_rows(torch.tensor(rows, dtype=torch.float32)).tolist()
    assert got == [ref_argmax(r) for r in rows] == np.asarray(rows, np.float32).argmax(axis=-1).tolist()


# (logits of a pass's requests, expected picks per request, picks the rule must not give)
EACH_SCENARIOS = {
    "no requests": ([], [], [[0]]),
    "requests of different row counts": ([[_row(40, {1: 9.0}), _row(40, {2: 9.0})], [_row(40, {38: 9.0})]],
                                         [[1, 2], [38]], [[38], [1, 2]]),
    "a 1-D row counts as one": ([[0.0, 4.0, 4.0]], [[1]], [[2]]),
    "a NaN wins within its own request only": ([[_row(40, {7: float("nan")})], [_row(40, {9: 9.0})]],
                                               [[7], [9]], [[7], [7]]),
}


@pytest.mark.parametrize("name", list(EACH_SCENARIOS))
def test_argmax_each_scenarios(name, cpu_kernel):
    tensors, want, not_want = EACH_SCENARIOS[name]
    got = argmax_each([torch.tensor(t) for t in tensors])
    assert got == want and got != not_want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5), st.integers(1, 70)), max_size=6), st.data())
def test_argmax_each_equals_argmax_rows_per_request(cpu_kernel, shapes, data):
    """One call over a pass's requests == each request's own argmax_rows, for views split from one tensor (as the
    forward hands them over) and for a non-contiguous one (which takes the per-request path)."""
    values = st.sampled_from([-2.0, -0.0, 0.0, 0.5, 7.0, float("inf"), float("-inf"), float("nan")])
    tensors = [torch.tensor([data.draw(st.lists(values, min_size=n, max_size=n)) for _ in range(m)])
               for m, n in shapes]
    want = [[ref_argmax(r) for r in t.tolist()] for t in tensors]
    assert argmax_each(tensors) == want == [argmax_rows(t) for t in tensors]
    if tensors:
        strided = [t.t().contiguous().t() if t.shape[0] > 1 else t for t in tensors]
        assert argmax_each(strided) == want
