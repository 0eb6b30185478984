"""Calibration: the choice on injected cost tables (no timing), user flags, the cache (bad files are measured
again, never a crash), the model thread; one real measurement on the real model."""

import json
import shutil
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from generation_service.engine import calibrate
from generation_service.engine.calibrate import (
    FORMAT_VERSION,
    Calibration,
    CostCurve,
    auto_formats,
    cache_path,
    calibrated_model,
    candidate_threads,
    choose,
    choose_wide_from,
    dominated,
    load_cache,
    robust_curve,
    save_cache,
)
from generation_service.engine.model_thread import ModelThread
from generation_service.model.kernels.build import kernel

ROWS = (1, 2, 4, 8, 16, 32, 64)
# Measured tables (ms per pass by rows, 2 threads, prefill of 200 tokens; docs/ARCHITECTURE.md and engine/calibrate.py's
# docstring). As calibration measures them: a bf16 AR step carries a pad row, so its q=1 is the q=2 pass.
AVX2 = [CostCurve("fp32", 2, ROWS, (68, 100, 120, 136, 167, 176, 230), 555),
        CostCurve("bf16", 2, ROWS, (100, 100, 120, 157, 336, 621, 1029), 3088)]
AMX = [CostCurve("fp32", 2, ROWS, (44, 70, 80, 90, 100, 114, 167), 300),
       CostCurve("bf16", 2, ROWS, (51, 52, 54, 57, 62, 71, 85), 250)]
ZEN5 = [CostCurve("fp32", 2, ROWS, (37.2, 59.5, 59.5, 59.5, 71.8, 101.2, 152.3), 295),
        CostCurve("fp32", 1, ROWS, (39.6, 65.9, 65.9, 73.6, 94.6, 148.4, 250.1), 497),
        CostCurve("bf16", 2, ROWS, (24.5, 26.0, 29.4, 29.4, 29.4, 36.2, 49.4), 94),
        CostCurve("bf16", 1, ROWS, (28.4, 28.4, 29.5, 32.2, 38.7, 50.7, 71.4), 177)]


@pytest.mark.parametrize("case, curves, dtype, threads, expected, not_expected", [
    ("AVX2: bf16 q=16 costs 3.4x q=1 and its prefill 5.6x fp32's -> fp32", AVX2, "auto", 0, ("fp32", 2),
     ("bf16", 2)),
    ("AMX: fp32 has the faster AR step, bf16 the flat curve -> bf16", AMX, "auto", 0, ("bf16", 2), ("fp32", 2)),
    ("Zen 5 avx512_bf16: bf16 on both cores", ZEN5, "auto", 0, ("bf16", 2), ("fp32", 2)),
    ("a user-fixed dtype is respected", AVX2, "bf16", 0, ("bf16", 2), ("fp32", 2)),
    ("user-fixed threads are respected", ZEN5, "auto", 1, ("bf16", 1), ("bf16", 2)),
    ("both fixed", ZEN5, "fp32", 1, ("fp32", 1), ("bf16", 2)),
])
def test_choose(case, curves, dtype, threads, expected, not_expected):
    chosen, _ = choose(curves, dtype, threads)
    assert (chosen.dtype, chosen.threads) == expected, case
    assert (chosen.dtype, chosen.threads) != not_expected, case


# The Zen 5 box of this session (ms): bf16 wins alone (flat tree passes), fp32's fused pass wins 8 requests at once.
ZEN5_FUSED = [CostCurve("fp32", 2, ROWS, (14.7, 17.0, 19.7, 23.0, 29.0, 50.0, 93.8), 300, batch_ms=23.5),
              CostCurve("bf16", 2, ROWS, (20.9, 21.0, 21.0, 23.0, 26.1, 32.0, 48.5), 250, batch_ms=31.8)]


@pytest.mark.parametrize("case, curves, expected, not_expected", [
    ("batched passes measured: fp32 serves 8 requests 1.35x cheaper", ZEN5_FUSED, "fp32", "bf16"),
    ("not measured (an old file): alone decides", [replace(c, batch_ms=0.0) for c in ZEN5_FUSED], "bf16", "fp32"),
])
def test_choice_weighs_batched_passes(case, curves, expected, not_expected):
    chosen, _ = choose(curves, "auto", 0)
    assert chosen.dtype == expected and chosen.dtype != not_expected, case
    fp32 = curves[0]
    if fp32.batch_ms:  # the geometric mean of alone and batched ms/token
        assert fp32.objective() == pytest.approx((fp32.expected_ms_per_token() * 23.5 / 8) ** 0.5)
    else:
        assert fp32.objective() == fp32.expected_ms_per_token()


Q4_FAST = CostCurve("q4_1", 2, ROWS, (9.0, 10.0, 13.0, 25.0, 48.0, 80.0, 150.0), 300)
Q4_SLOW = CostCurve("q4_1", 2, ROWS, (60.0, 70.0, 90.0, 120.0, 200.0, 300.0, 500.0), 900)  # no kernels, say


@pytest.mark.parametrize("case, curves, auto_formats, expected, not_expected", [
    # A model without its Q4_1 GGUF (or a machine without the kernels): auto never serves q4_1, measured or not.
    ("not the model's own weights", ZEN5 + [Q4_FAST], (), "bf16", "q4_1"),
    # The model ships as Q4_1 (the default model): its own weights compete, and win where they are fastest.
    ("the model's own weights, fastest", ZEN5 + [Q4_FAST], ("q4_1",), "q4_1", "bf16"),
    ("the model's own weights, slower here", ZEN5 + [Q4_SLOW], ("q4_1",), "bf16", "q4_1"),
])
def test_auto_considers_q4_1_only_for_the_models_own_weights(case, curves, auto_formats, expected, not_expected):
    chosen, warnings = choose(curves, "auto", 0, auto_formats)
    assert chosen.dtype == expected and chosen.dtype != not_expected, case
    assert warnings == [], case  # Not nagging about a format auto may not pick


def test_q4_1_is_chosen_when_asked_for():
    chosen, warnings = choose(ZEN5 + [Q4_FAST], "q4_1", 0)
    assert (chosen.dtype, chosen.threads) == ("q4_1", 2) and warnings == []
    with pytest.raises(ValueError, match="no measured candidate"):
        choose(ZEN5, "q4_1", 0)


def test_auto_formats_need_the_gguf_and_the_cpu(tmp_path):
    from ragcore.model_files import default_model_dir

    assert auto_formats(tmp_path, torch.device("cpu")) == ()  # no GGUF in a plain HF directory: Not q4_1
    assert auto_formats(default_model_dir(), torch.device("cuda")) == ()  # a CPU kernel
    want = () if kernel() is None else (("q4_1", "q4_1_bf16") if kernel().bf16() else ("q4_1",)) + ("q4_1_i8",)
    assert auto_formats(default_model_dir(), torch.device("cpu")) == want  # the default model ships as Q4_1


def test_a_measurably_bad_user_choice_is_warned_about():
    _, warnings = choose(AVX2, "bf16", 0)
    assert len(warnings) == 1 and "fp32/2t" in warnings[0]  # names the faster candidate
    assert choose(AVX2, "fp32", 0)[1] == []  # Not a warning when the user picked the best one
    with pytest.raises(ValueError, match="no measured candidate"):
        choose(AVX2, "fp32", 3)


def test_objective_includes_the_ar_step():
    # A curve on which no tree pays is judged by its AR step alone.
    steep = CostCurve("fp32", 1, (1, 2, 64), (10.0, 40.0, 1000.0))
    assert steep.expected_ms_per_token() == pytest.approx(10.0)
    assert CostCurve("fp32", 1, (1, 2, 64), (10.0, 40.0, 1000.0), 128.0).expected_ms_per_token() == \
        pytest.approx(11.0)  # + the prefill spread over 128 tokens
    flat = CostCurve("bf16", 1, (1, 2, 64), (10.0, 10.5, 12.0))
    assert flat.expected_ms_per_token() < 10.0 / 1.5  # Not 10: trees pay on a flat curve


def test_robust_curve_ignores_interference_spikes():
    samples = [[0.030, 0.024], [0.026, 0.027], [0.138, 0.140], [0.029, 0.031]]  # seconds; q=4 hit by a spike
    assert robust_curve(samples) == pytest.approx((24.0, 26.0, 29.0, 29.0))  # Not 138 at q=4


# First-round samples (ms by pass) as measured on the AVX2-only EPYC of 2026-12-01 and variations of them.
EPYC_AVX2_ROUND = {("q4_1", 2): [20.7, 25.1, 52.9, 109.1, 53.0], ("fp32", 2): [30.4, 32.2, 51.5, 96.7, 52.0],
                   ("q4_1", 1): [39.0, 46.6, 99.0, 197.8, 100.0], ("bf16", 2): [87.2, 87.2, 282.7, 554.9, 585.0],
                   ("bf16", 1): [144.0, 144.0, 500.6, 976.3, 1030.0]}


@pytest.mark.parametrize("case, samples, expected, not_expected", [
    ("bf16 without native kernels drops out", EPYC_AVX2_ROUND, {("bf16", 2), ("bf16", 1)}, {("q4_1", 2)}),
    ("twice as slow at one pass only stays", {"a": [10.0, 50.0], "b": [20.0, 60.0]}, set(), {"b"}),
    ("exactly the factor everywhere drops out", {"a": [10.0, 50.0], "b": [20.0, 100.0]}, {"b"}, {"a"}),
    ("one candidate is never dominated", {"a": [10.0]}, set(), {"a"}),
    ("equal candidates both stay", {"a": [10.0, 20.0], "b": [10.0, 20.0]}, set(), {"a", "b"}),
])
def test_dominated_candidates(case, samples, expected, not_expected):
    got = dominated(samples)
    assert got == expected, case
    assert not (got & not_expected), case
    brute = {a for a in samples for b in samples  # the definition, pass by pass
             if a != b and min(x / y for x, y in zip(samples[a], samples[b])) >= 2.0}
    assert got == brute


@pytest.mark.model
def test_dominated_candidates_are_measured_once_and_kept(tmq4, tm16, monkeypatch):
    """measure_curves on the real models (short past, two passes per round): a candidate it drops after the first
    round ran that round only, keeps a curve, and that curve is >= 2x another's at every pass (its one sample against
    the other's minimum). On a CPU without native bf16 kernels bf16 is dropped; elsewhere nothing may be."""
    calls: dict[str, int] = {"q4_1": 0, "bf16": 0}
    real = calibrate.verify_tree

    def counting(tm, *args, **kwargs):
        calls["q4_1" if tm is tmq4 else "bf16"] += 1
        return real(tm, *args, **kwargs)

    monkeypatch.setattr(calibrate, "verify_tree", counting)
    notes: list[str] = []
    threads = torch.get_num_threads()
    try:
        curves = calibrate.measure_curves({"q4_1": tmq4, "bf16": tm16}, [1], rows=(1, 4), reps=2, past=16,
                                          progress=notes.append)
    finally:
        torch.set_num_threads(threads)
    by = {c.dtype: c for c in curves}
    assert set(by) == {"q4_1", "bf16"}
    dropped = {d for d in by if any(f"{d}/1t" in n and "measured once" in n for n in notes)}
    for d, c in by.items():
        assert calls[d] == (2 if d in dropped else 3) * 3, d  # rounds x (the warming pass + q = 1, 4)
        if d in dropped:
            assert any(all(x >= 2.0 * y for x, y in zip(c.step_ms + (c.batch_ms,), o.step_ms + (o.batch_ms,)))
                       for e, o in by.items() if e != d)
    assert "q4_1" not in dropped or "bf16" not in dropped


# (ms per pass by rows on the blocks, the same on the decoded copies) -> the fewest rows that read the copies.
WIDE_FROM = {
    "copies faster from 9 rows (the 2-core Zen 4 of 2026-12-04)": (
        {4: ([10.4], [12.6]), 6: ([11.1], [12.3]), 8: ([13.4], [13.6]), 9: ([16.9], [13.1]), 10: ([17.5], [14.2])},
        9, 11),
    "faster from 6 rows (one thread there)": (
        {4: ([16.0], [18.0]), 6: ([19.0], [17.5]), 8: ([24.0], [20.0]), 9: ([27.0], [21.0]), 10: ([28.0], [22.0])},
        6, 8),
    "never faster up to 10 rows: from 11, as before": (
        {8: ([6.0], [9.0]), 9: ([6.5], [9.5]), 10: ([7.0], [10.0])}, 11, 8),
    "a faster 8 beneath a slower 9 does not count: the copies must win at every larger count": (
        {8: ([14.0], [12.0]), 9: ([15.0], [15.5]), 10: ([17.0], [14.0])}, 10, 8),
    "medians, not one fast sample": (
        {9: ([16.0, 16.2, 16.1], [12.0, 16.5, 16.6]), 10: ([17.0, 17.1, 17.2], [14.0, 14.1, 14.2])}, 10, 9),
    "a tie is not a win, nor 3 % faster": ({8: ([13.0], [12.6]), 9: ([13.0], [13.0]), 10: ([14.0], [12.0])}, 10, 8),
}


@pytest.mark.parametrize("name", list(WIDE_FROM))
def test_choose_wide_from(name):
    samples, expected, not_expected = WIDE_FROM[name]
    got = choose_wide_from(samples, 11)
    assert got == expected and got != not_expected, name


@pytest.mark.parametrize("cores, expected", [(1, [1]), (2, [2, 1]), (4, [4, 2, 1]), (16, [16, 8])])
def test_candidate_threads(cores, expected):
    assert candidate_threads(cores) == expected


KEY = {"model": "/m", "model_id": "abc", "device": "cpu", "cpu": "Some CPU", "cpu_flags": "f", "cores": 2,
       "torch": "2.13.0", "rows": list(ROWS), "prefix": 200}


@pytest.mark.parametrize("case, content", [
    ("truncated", lambda good: good[: len(good) // 2]),
    ("not JSON", lambda good: "\x00\x01garbage"),
    ("another CPU", lambda good: good.replace("Some CPU", "Other CPU")),
    ("another format", lambda good: good.replace(f'"format": {FORMAT_VERSION}', '"format": 99')),
    ("a curve without step_ms", lambda good: good.replace('"step_ms"', '"nope"')),
    ("negative times", lambda good: good.replace("68", "-68")),
])
def test_a_bad_cache_is_ignored_not_fatal(tmp_path, case, content):
    path = tmp_path / "cal.json"
    save_cache(path, Calibration(KEY, AVX2))
    good = path.read_text()
    assert load_cache(path, KEY) is not None
    path.write_text(content(good))
    assert load_cache(path, KEY) is None, case  # Not an exception: the caller measures again


def test_cache_round_trip_and_key_separation(tmp_path):
    path = tmp_path / "cal.json"
    save_cache(path, Calibration(KEY, ZEN5, load=0.5))
    cal = load_cache(path, KEY)
    assert cal.source == "cache" and cal.curves == ZEN5 and cal.load == 0.5
    assert cache_path(KEY) != cache_path(KEY | {"cpu": "Other CPU"})  # Not one file for two machines


def test_model_thread_runs_everything_on_one_thread():
    mt = ModelThread("test-model")
    idents = [mt.call(threading.get_ident) for _ in range(3)]
    assert len(set(idents)) == 1 and idents[0] != threading.get_ident()  # Not the caller's thread
    with pytest.raises(ZeroDivisionError):
        mt.call(lambda: 1 / 0)
    assert mt.call(lambda: 7) == 7  # an exception does not kill the thread
    mt.stop(wait=True)


# (load at the measurement, load now, measured again?): only a measurement on an overloaded machine (load above
# its 2 cores) that has since become much quieter (below half that load) is taken again.
NOISY_THEN_QUIET = {
    "quiet then and now": (1.5, 0.2, False),
    "overloaded then, as loaded now": (3.0, 2.9, False),
    "overloaded then, a little quieter now": (3.0, 1.6, False),
    "overloaded then, much quieter now": (3.0, 1.4, True),
    "at the cores' count then, idle now": (2.0, 0.0, False),
}


@pytest.mark.parametrize("name", list(NOISY_THEN_QUIET))
def test_a_noisy_measurement_is_taken_again_once_the_machine_is_quiet(name, monkeypatch):
    then, now, again = NOISY_THEN_QUIET[name]
    monkeypatch.setattr(calibrate, "_load", lambda: now)
    cal = Calibration({"cores": 2}, [], "", 1.0, then)
    assert cal.noisy_then_quiet() is again, name


@pytest.mark.model
@pytest.mark.slow
def test_real_calibration_measures_then_reuses_and_survives_a_corrupt_cache(calibrated_home, monkeypatch, tmp_path):
    from ragcore.model_files import default_model_dir

    measured_home, first = calibrated_home  # the session's measurement, as a worker with default flags makes it
    cal = first.calibration
    assert cal.source == "measured" and len(cal.curves) >= 2
    assert all(c.step_ms == tuple(sorted(c.step_ms)) for c in cal.curves)  # non-decreasing in q
    assert all(c.batch_ms > 0 for c in cal.curves)  # the batched pass was measured for every candidate
    copies = kernel() is not None and kernel().wide_bf16()  # q4_1_bf16 holds decoded bf16 copies only there
    assert all((c.wide_from > 0) is (copies and c.dtype == "q4_1_bf16") for c in cal.curves)
    assert all(c.wide_from in (0, 11) + calibrate.WIDE_FROM_ROWS for c in cal.curves)
    best = min(cal.curves, key=lambda c: c.objective())
    assert (first.curve.dtype, first.curve.threads) == (best.dtype, best.threads)
    home = tmp_path / "home"  # a copy: the session's cache stays whole for the other tests
    shutil.copytree(measured_home, home)
    model = str(default_model_dir())  # before the home moves: the path the calibration's key names
    monkeypatch.setenv("RAGSERVE_HOME", str(home))
    # The load as it was at the measurement: a machine much quieter now would measure again (noisy_then_quiet).
    monkeypatch.setattr(calibrate, "_load", lambda: cal.load)
    path = home / "calibration" / (cal.path.rsplit("/", 1)[-1])
    mt = ModelThread("test-calibration")
    try:
        tm, again = mt.call(calibrated_model, model, "cpu", "auto", 0, reps=1)
        assert again.calibration.source == "cache"  # not measured again
        assert (tm.dtype_name, again.threads) == (best.dtype, best.threads)
        if tm.lean is not None and tm.lean.has_decoded_copies():  # served from the rows the calibration chose
            assert tm.lean.wide_from == again.curve.wide_from > 0
        assert tm.step_cost.rel[0] == 1.0 and np.all(np.diff(tm.step_cost.rel) >= 0)
        if tm.lean is not None and tm.lean.can_prefill_bf16():  # bf16 prompt linears measured where they can run
            assert all((c.prefill_bf16_ms > 0) is (c.dtype != "bf16") for c in cal.curves)
        del tm
        _, fixed = mt.call(calibrated_model, model, "cpu", "fp32", 0, reps=1)
        assert fixed.calibration.source == "cache" and fixed.dtype == "fp32"  # user flag, no new measurement
        path.write_text(path.read_text()[:100])  # truncated
        # What is tested is the recovery, not the candidate set: one real candidate is measured again (all of
        # fp32 and bf16 at 1 and 2 threads took ~100 s of an AVX2-only Zen 1's make test, bf16 without kernels).
        monkeypatch.setattr(calibrate, "candidate_dtypes", lambda device: ["fp32"])
        monkeypatch.setattr(calibrate, "candidate_threads", lambda cores: [1])
        _, third = mt.call(calibrated_model, model, "cpu", "fp32", 1, reps=1)
        assert third.calibration.source == "measured"  # measured again, not a crash
        assert [(c.dtype, c.threads) for c in third.calibration.curves] == [("fp32", 1)]
        assert json.loads(path.read_text())["format"] == FORMAT_VERSION  # and the cache is whole again
    finally:
        mt.stop(wait=True)


@pytest.mark.slow  # a real measurement (~9 s): the slow tier, like the other calibration runs
def test_processes_that_calibrate_at_once_measure_once(tmp_path, monkeypatch):
    """Workers started together on a fresh machine with --dtype fp32 --threads 1: the first measures that one
    candidate (the only one that can serve), the other waits for it and takes its cache. Not: each measuring, under
    the other's load, every weight format at every thread count. (The lock is a file lock: threads with their own
    descriptors contend for it as processes do.)"""
    import time

    from ragcore.model_files import default_model_dir, is_model_dir

    if not is_model_dir(default_model_dir()):
        pytest.skip("default model not prepared (make model)")
    model = str(default_model_dir())  # before the home moves
    kernel()  # loaded from the user's home too (a new home would build the CPU kernels again)
    monkeypatch.setenv("RAGSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "_load", lambda: 1.0)
    measuring, calls = threading.Event(), []
    real = calibrate.measure_curves

    def counting(*args, **kwargs):
        calls.append(1)
        measuring.set()
        time.sleep(0.3)  # the other one arrives while this one measures
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate, "measure_curves", counting)
    choices = {}

    def start(name: str) -> None:
        mt = ModelThread(f"test-{name}")
        try:
            choices[name] = mt.call(calibrated_model, model, "cpu", "fp32", 1, reps=1)[1]
        finally:
            mt.stop(wait=True)

    first = threading.Thread(target=start, args=("first",))
    first.start()
    assert measuring.wait(120)
    start("second")
    first.join()
    assert len(calls) == 1  # Not measured twice
    assert choices["first"].calibration.source == "measured"
    assert choices["second"].calibration.source == "cache"
    assert [(c.dtype, c.threads) for c in choices["second"].calibration.curves] == [("fp32", 1)]

