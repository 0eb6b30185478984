"""FollowWait: the next pass waits for a closed-loop client's next request, and only for that.

Scenarios are timelines of finishes ("f", t) and arrivals ("a", submitted t) in ms, then a query time: the hold
the engine would apply then, with what it must not be.
"""

from __future__ import annotations

import pytest

from generation_service.engine.admission import MIN_EVIDENCE, FollowWait


def closed_loop(n: int, gap_ms: float = 1.5, period_ms: float = 30.0) -> list[tuple[str, float]]:
    """n finishes, each followed by its replacement gap_ms later."""
    events = []
    for i in range(n):
        events += [("f", i * period_ms), ("a", i * period_ms + gap_ms)]
    return events


def run(events: list[tuple[str, float]], wait_ms: float = 4.0) -> FollowWait:
    fw = FollowWait(wait_ms / 1e3)
    for kind, t in events:
        (fw.finished if kind == "f" else fw.arrived)(t / 1e3)
    return fw


T = 10 * 30.0  # after the closed-loop history below


@pytest.mark.parametrize("events, now_ms, expected_ms, not_expected", [
    # Closed loop: a finish right now, its replacement not yet in -> hold for the rest of the window.
    (closed_loop(10) + [("f", T)], T + 1.0, 3.0, "no hold: the replacement would wait a whole pass"),
    # The replacement already arrived -> no hold.
    (closed_loop(10) + [("f", T), ("a", T + 0.5)], T + 1.0, 0.0, "a hold for nobody"),
    # Two finished together, one replacement in -> still hold for the second.
    (closed_loop(10) + [("f", T), ("f", T), ("a", T + 0.5)], T + 1.0, 3.0, "the second client left waiting"),
    # The window passed -> never hold longer than wait_ms after a finish.
    (closed_loop(10) + [("f", T)], T + 5.0, 0.0, "a hold past wait_ms"),
    # Slow replies to finishes (8 ms: the clients' CPU is busy with the pass) still count as a closed loop.
    (closed_loop(10, gap_ms=8.0) + [("f", T)], T + 1.0, 3.0, "no hold where holding frees the clients' CPU"),
    # Open loop: arrivals unrelated to finishes (gaps of ~15 ms) -> no hold.
    (closed_loop(10, gap_ms=15.0) + [("f", T)], T + 1.0, 0.0, "holding passes for traffic that is not coming"),
    # Too little evidence yet -> no hold.
    (closed_loop(MIN_EVIDENCE - 1) + [("f", T)], T + 1.0, 0.0, "holding on a hunch"),
    # No finish at all -> no hold.
    (closed_loop(10)[:-1] + [("a", T)], T + 1.0, 0.0, "a hold without a finish"),
])
def test_follow_wait_scenarios(events, now_ms, expected_ms, not_expected):
    fw = run(events)
    assert fw.remaining(now_ms / 1e3) * 1e3 == pytest.approx(expected_ms, abs=1e-6), not_expected


@pytest.mark.parametrize("wait_ms", [0.0, 4.0])
def test_follow_wait_off_never_holds(wait_ms):
    fw = run(closed_loop(10) + [("f", T)], wait_ms=wait_ms)
    held = fw.remaining((T + 1.0) / 1e3) > 0
    assert held == (wait_ms > 0)  # 0 = never, whatever the traffic


def test_follow_wait_median_over_window():
    """A few slow arrivals do not switch holding off, a majority does; old gaps leave the window."""
    fw = run(closed_loop(10) + closed_loop(3, gap_ms=20.0))
    assert fw.closed_loop()
    fw = run(closed_loop(10) + closed_loop(fw.window, gap_ms=20.0))
    assert not fw.closed_loop() and len(fw.gaps) == fw.window


# ------------------------------------------------------------------------------------------ in the engine

@pytest.mark.model
@pytest.mark.parametrize("wait_ms", [0.0, 500.0])
def test_engine_holds_a_pass_for_a_closed_loop_client(tm32, wait_ms):
    """A client sends its next request (a cached prompt) as each reply ends, beside a long request that keeps the
    engine passing. Held: once the loop is evident, every next request gets its first token before another pass
    starts. Off: no pass is ever held. Outputs are the same either way."""
    from generation_service.model.sampling import SamplingParams
    from tests.generation.test_engine import _chunks, _engine, _job
    from tests.generation.test_lossless import encode

    engine = _engine(tm32, {}, prefix_cache_mb=64, follow_wait_ms=wait_ms)
    try:
        background = _job(encode(tm32, "def fib(n):"), SamplingParams(max_new_tokens=2000, ignore_eos=True),
                          stream=True)
        engine.submit(background)
        first = background.chunks.get(timeout=600)
        assert not isinstance(first, BaseException)
        prompt = encode(tm32, "def add(a, b):")
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        outputs, passes_before_first = [], []
        for _ in range(MIN_EVIDENCE + 6):
            job = _job(prompt, params, stream=True)
            at_submit = engine.passes
            engine.submit(job)
            chunks = [job.chunks.get(timeout=600)]
            passes_before_first.append(engine.passes - at_submit)
            chunks += _chunks(job)
            outputs.append([t for c in chunks for t in c.token_ids])
        background.cancelled.set()
        _chunks(background)
    finally:
        engine.stop()
    assert all(out == outputs[0] for out in outputs) and len(outputs[0]) == 4
    if wait_ms > 0:
        # The first request prefills its prompt (a pass); from the evidence on, no pass runs before the first token.
        assert passes_before_first[MIN_EVIDENCE + 1:] == [0] * 5, passes_before_first
        assert engine.follow.held_s > 0
    else:
        assert engine.follow.held_s == 0  # Not held, whatever the arrivals look like
