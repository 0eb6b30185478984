"""Prompt chunks with bf16 linears (lean_llama.set_prefill_bf16), decode rows in fp32.

What must hold: a wide prefill chunk (>= BF16_PREFILL_MIN_ROWS rows) takes the bf16 path (its logits move, a little);
a short chunk and every decode row do not (bit for bit the same as with the feature off, and as a pass without the
chunk); the hidden sink and the logits come back in the segments' order; speculation stays lossless and a batched
request still equals its solo run. And the choice: calibration's measured gain, the user's flag.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from generation_service.config import GenerationConfig
from generation_service.drafting.drafters import PromptLookupDrafter
from generation_service.engine.calibrate import (
    BF16_PREFILL_GAIN,
    CostCurve,
    apply_prefill_precision,
    served_prefill_precision,
)
from generation_service.engine.model_thread import ModelThread
from generation_service.engine.speculative import decode, first_divergence
from generation_service.model.lean_llama import BF16_PREFILL_MIN_ROWS, Segment
from generation_service.model.sampling import SamplingParams
from generation_service.model.tree_attention import tree_mask
from tests.generation.test_engine import _collect, _engine, _job
from tests.generation.test_lossless import encode, humaneval_prompts

ROWS = (1, 2, 4, 8, 16, 32, 64)
WIDE = BF16_PREFILL_MIN_ROWS + 16


@pytest.fixture(params=["fp32", "q4_1"])
def tmx(request, tm32, tmq4):
    tm = tm32 if request.param == "fp32" else tmq4
    if not tm.lean.can_prefill_bf16():
        pytest.skip("no oneDNN bf16 linears here (a torch build without oneDNN, or a CPU without AVX512-BW/VL/DQ)")
    yield tm
    tm.lean.set_prefill_bf16(False)


@pytest.mark.model
@pytest.mark.parametrize("fmt", ["fp32", "q4_1"])
def test_bf16_prefill_is_offered_only_where_onednn_runs_bf16(fmt, tm32, tmq4):
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: asking for the bf16 prefill there must say no, not crash
    (calibration asks on every machine)."""
    lean = (tm32 if fmt == "fp32" else tmq4).lean
    supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    try:
        assert lean.can_prefill_bf16() is supported
        assert lean.set_prefill_bf16(True) is supported
        assert bool(any(ly.packed_bf16 for ly in lean.layers)) is supported
    finally:
        lean.set_prefill_bf16(False)
    assert not lean.prefill_bf16 and not any(ly.packed_bf16 for ly in lean.layers)


@dataclass(frozen=True)
class Seq:
    past: int
    q: int
    tree: bool = False
    logits_rows: int = 0  # > 0: a prefill chunk (its last rows' logits only)


def _pass(lean, seqs: list[Seq], seed: int = 0):
    """One forward_batch over fresh caches holding the same prefixes every time -> (logits, caches)."""
    rng = np.random.default_rng(seed)
    caches, segments = [], []
    for s in seqs:
        cache = lean.new_cache(256)
        if s.past:
            bf16, lean.prefill_bf16 = lean.prefill_bf16, False  # identical prefixes whatever the setting
            lean.forward(torch.from_numpy(rng.integers(0, 30000, s.past)), torch.arange(s.past), cache)
            lean.prefill_bf16 = bf16
        ids = torch.from_numpy(rng.integers(0, 30000, s.q))
        mask = None
        if s.tree:
            parents = np.array([-1] + [int(rng.integers(-1, i)) for i in range(s.q - 2)], np.int32)
            mask = tree_mask(parents, s.past, torch.float32)[0, 0]
        caches.append(cache)
        segments.append(Segment(ids, torch.arange(s.past, s.past + s.q), cache, mask, s.logits_rows))
    return lean.forward_batch(segments), caches


AR, TREE = Seq(60, 1), Seq(40, 6, tree=True)
WIDE_CHUNK, SHORT_CHUNK = Seq(0, WIDE, logits_rows=1), Seq(0, BF16_PREFILL_MIN_ROWS - 1, logits_rows=1)
WIDE_AFTER_CACHED = Seq(50, WIDE, logits_rows=1)

# (scenario, the pass, which segments take the bf16 path)
SCENARIOS = [
    ("wide prompt alone", [WIDE_CHUNK], [True]),
    ("wide chunk after cached rows", [WIDE_AFTER_CACHED], [True]),
    ("short prompt alone", [SHORT_CHUNK], [False]),
    ("decode rows beside a wide chunk", [AR, WIDE_CHUNK, TREE], [False, True, False]),
    ("decode rows beside a short chunk", [AR, SHORT_CHUNK, TREE], [False, False, False]),
    ("decode rows only", [AR, TREE], [False, False]),
]


@pytest.mark.model
@pytest.mark.parametrize("name,seqs,moves", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_only_wide_prefill_chunks_change(tmx, name, seqs, moves):
    lean = tmx.lean
    lean.set_prefill_bf16(False)
    off, _ = _pass(lean, seqs)
    assert lean.set_prefill_bf16(True)
    on, caches = _pass(lean, seqs)
    for s, a, b, moved, cache in zip(seqs, off, on, moves, caches):
        assert a.shape == b.shape == (s.logits_rows or s.q, lean.lm_head.shape[0])
        assert cache.length == s.past + s.q
        if moved:  # bf16 rounding of the linears' inputs: visible, small, the same greedy token
            diff = float((a - b).abs().max())
            assert 0 < diff < 1.0, diff
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        else:
            assert torch.equal(a, b), name


@pytest.mark.model
def test_decode_rows_do_not_depend_on_a_prefill_chunk_in_the_pass(tmx):
    """The split pass: decode rows beside a wide chunk get the bits of the same pass without the chunk."""
    lean = tmx.lean
    lean.set_prefill_bf16(True)
    alone, _ = _pass(lean, [AR, TREE])
    mixed, _ = _pass(lean, [AR, TREE, WIDE_CHUNK])  # same seed: same prefixes and tokens for AR and TREE
    assert torch.equal(alone[0], mixed[0]) and torch.equal(alone[1], mixed[1])


@pytest.mark.model
def test_hidden_sink_and_logits_keep_the_segment_order(tmx):
    lean = tmx.lean
    lean.set_prefill_bf16(True)
    seqs = [WIDE_CHUNK, AR, Seq(30, 3, logits_rows=2)]
    lean.hidden_sink = []
    try:
        logits, _ = _pass(lean, seqs)
        hidden = lean.hidden_sink[-1]
    finally:
        lean.hidden_sink = None
    assert [lg.shape[0] for lg in logits] == [1, 1, 2]
    assert hidden.shape == (1, 4, lean.embed.shape[1])
    # each kept row's logits are its hidden row through the output layer
    for lg, h in zip(logits, torch.split(hidden[0], [1, 1, 2])):
        assert torch.allclose(lean._logits(h), lg, atol=1e-3, rtol=0)


@pytest.mark.model
def test_speculation_and_batching_stay_lossless_with_bf16_prompts(tm32):
    lean = tm32.lean
    if not lean.can_prefill_bf16():
        pytest.skip("no oneDNN linears in this torch build")
    chunk, n_new = 48, 20
    greedy = SamplingParams(max_new_tokens=n_new, ignore_eos=True)
    prompts = [encode(tm32, t) for t in humaneval_prompts(3)]
    assert all(len(p) > chunk for p in prompts)  # every prompt has a bf16 chunk
    mt = ModelThread("test-bf16-solo")

    def solo(prompt, drafter):
        return [t for out, _ in decode(tm32, prompt, greedy, drafter=drafter, prefill_chunk=chunk) for t in out]

    lean.set_prefill_bf16(True)
    try:
        ar = [mt.call(solo, p, None) for p in prompts]
        pld = [mt.call(solo, p, PromptLookupDrafter()) for p in prompts]
        mt.stop(wait=True)
        assert pld == ar  # speculative == autoregressive, bit for bit (same passes' decode rows)
        drafters: dict[int, object] = {}
        engine = _engine(tm32, drafters, prefill_chunk=chunk)
        try:
            jobs = []
            for k, p in enumerate(prompts):
                job = _job(p, greedy, "pld" if k % 2 else "ar")
                drafters[id(job)] = PromptLookupDrafter() if k % 2 else None
                engine.submit(job)
                jobs.append(job)
                time.sleep(0.2)  # later requests prefill beside running ones
            got = [_collect(j)[0] for j in jobs]
        finally:
            engine.stop()
    finally:
        lean.set_prefill_bf16(False)
    near_ties = 0
    for p, want, g in zip(prompts, ar, got):
        if g != want:
            div = first_divergence(tm32, p, want, g)
            assert div is not None and div.near_tie, div
            near_ties += 1
    assert near_ties <= 1


# ------------------------------------------------------------------------------------------------- the choice

def _curve(prefill_ms: float, bf16_ms: float) -> CostCurve:
    return CostCurve("q4_1", 2, ROWS, (7.0, 8.0, 11.0, 18.0, 34.0, 66.0, 128.0), prefill_ms,
                     batch_ms=20.0, prefill_bf16_ms=bf16_ms)


@pytest.mark.parametrize("prefill_ms,bf16_ms,pays", [
    (274.0, 170.0, True),  # the Zen 4 figures: clearly faster
    (274.0, 274.0 / BF16_PREFILL_GAIN, True),  # exactly the required gain
    (274.0, 260.0, False),  # within noise: keep fp32
    (555.0, 3088.0, False),  # AVX2 without native bf16: far slower
    (274.0, 0.0, False),  # not measured (cannot run there)
])
def test_bf16_prefill_pays_only_when_clearly_faster(prefill_ms, bf16_ms, pays):
    c = _curve(prefill_ms, bf16_ms)
    assert c.bf16_prefill_pays is pays
    assert c.serving_prefill_ms == (bf16_ms if pays else prefill_ms)
    fp32_only = _curve(prefill_ms, 0.0)
    assert (c.expected_ms_per_token() < fp32_only.expected_ms_per_token()) is pays


@pytest.mark.model
@pytest.mark.parametrize("precision,measured_faster,served", [
    ("auto", True, "bf16"),
    ("auto", False, "fp32"),
    ("fp32", True, "fp32"),
    ("bf16", False, "bf16"),
])
def test_prefill_precision_flag(tmx, precision, measured_faster, served):
    assert apply_prefill_precision(tmx, precision, measured_faster) == served
    assert served_prefill_precision(tmx) == served
    assert tmx.lean.prefill_bf16 is (served == "bf16")
    assert all(bool(ly.packed_bf16) is (served == "bf16") for ly in tmx.lean.layers)  # no weights kept when off


@pytest.mark.model
def test_a_bf16_model_prefills_in_bf16_anyway(tm16):
    assert apply_prefill_precision(tm16, "fp32") == "bf16"  # nothing to switch: its activations are bf16
    assert not tm16.lean.prefill_bf16


def test_bad_prefill_precision_is_refused():
    with pytest.raises(ValueError, match="prefill_precision"):
        GenerationConfig(prefill_precision="fp16")


@pytest.mark.model
def test_calibration_measures_bf16_prompts_only_where_they_can_run(tm32):
    """The lean fp32 forward gets a bf16 prefill figure; transformers' forward (no lean forward) gets none and is
    measured without error. Neither keeps bf16 weights afterwards."""
    from generation_service.engine.calibrate import measure_curves
    from tests.conftest import real_model

    hf = real_model("fp32", forward="hf")
    mt = ModelThread("test-bf16-calibration")
    threads = torch.get_num_threads()  # measure_curves sets its candidates' thread counts
    try:
        curves = mt.call(measure_curves, {"fp32": tm32, "hf": hf}, [threads], rows=(1, 2), reps=1, past=40)
    finally:
        mt.stop(wait=True)
        torch.set_num_threads(threads)
    by_name = {c.dtype: c for c in curves}
    assert by_name["hf"].prefill_bf16_ms == 0.0 and by_name["hf"].prefill_ms > 0
    assert (by_name["fp32"].prefill_bf16_ms > 0) is tm32.lean.can_prefill_bf16()
    assert not tm32.lean.prefill_bf16 and not any(ly.packed_bf16 for ly in tm32.lean.layers)
