"""The worker as a user starts it: no --dtype/--threads, so it serves with what its calibration measured, and
GetInfo says what that is; user flags are respected; a model passed in (tests) is served as is."""

from __future__ import annotations

import pytest

from generation_service.client import GenerationClient
from generation_service.config import GenerationConfig
from generation_service.engine import calibrate
from ragcore.model_files import default_model_dir

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.mark.parametrize("case, flags, expect", [
    ("defaults: the measured best", {}, None),
    ("a user-fixed dtype", {"dtype": "fp32"}, ("fp32", None)),
    ("user-fixed dtype and threads", {"dtype": "fp32", "threads": 1}, ("fp32", 1)),
])
def test_the_worker_serves_with_its_calibration_or_the_user_s_flags(calibrated_home, retrieval, monkeypatch, case,
                                                                     flags, expect):
    from generation_service.server import build_server

    home, choice = calibrated_home  # the session's calibration (tests/conftest.py)
    model = str(default_model_dir())  # before the home moves: the model the calibration measured
    monkeypatch.setenv("RAGSERVE_HOME", str(home))
    # The load as it was at the measurement (minutes ago in a full run): a much quieter machine would measure again
    # (calibrate.noisy_then_quiet, tested in test_calibrate).
    monkeypatch.setattr(calibrate, "_load", lambda: choice.calibration.load)
    cfg = GenerationConfig(port=0, retrieval=retrieval.address, model=model, device="cpu",
                           acceptance_state="off", **flags)
    running, servicer = build_server(cfg)
    try:
        with GenerationClient(running.address) as c:
            info = c.info()
            reply = c.generate(prompt="def add(a, b):", max_new_tokens=8, decoding="rest", timeout=120)
        assert info.calibration == "cache", case  # Not measured again: the cached curves are reused
        best = choice.curve
        want_dtype, want_threads = expect or (best.dtype, best.threads)
        assert info.dtype == want_dtype, case
        assert want_threads is None or info.threads == want_threads, case
        assert len(info.candidates) == len(choice.calibration.curves)
        assert info.cpu and info.max_draft_nodes > 0 and info.tokenizer_id.startswith("vocab")
        assert reply.usage.completion_tokens == 8
        # Every forward pass ran on the model thread (load, warm-up and decoding).
        assert servicer.worker.model_thread.ident is not None
    finally:
        running.stop(0)
        servicer.worker.stop()


def test_a_model_passed_in_is_served_as_is(client, tm):
    info = client.info()
    assert info.calibration == "off" and info.dtype == "fp32"  # Not recalibrated: tests pin the dtype
    assert not info.candidates
