"""The prefill share: how many prompt rows a pass may carry beside decoding rows, and how a chunk is cut."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from generation_service.engine.prefill_share import MIN_ROWS, PrefillShare, piece_rows


@pytest.mark.parametrize("decode_ms, row_ms, slowdown, expected", [
    (0.0, 1.0, 2.5, 256),    # nothing decodes: a whole chunk; Not a share of nothing
    (10.0, 0.1, 2.5, 150),   # 15 spare ms at 0.1 ms a row; Not 256 (the chunk a pass used to carry)
    (10.0, 0.01, 2.5, 256),  # cheap rows: capped at the chunk; Not 1500
    (10.0, 1.0, 2.5, 15),    # dear rows (deep in a long prompt): few; Not MIN_ROWS (32 ms beside a 10 ms pass)
    (10.0, 0.1, 1.0, 1),     # no slowdown allowed: one row; Not 0 (the prompt would never start)
])
def test_rows_beside_decoding(decode_ms, row_ms, slowdown, expected):
    share = PrefillShare(256, slowdown, row_ms=row_ms)
    assert share.rows(decode_ms, row_ms_guess=99.0) == expected  # a measured row cost wins over the guess


def test_the_guess_serves_until_a_mixed_pass_was_measured():
    share = PrefillShare(256, 3.0)
    assert share.rows(10.0, row_ms_guess=0.2) == 100  # 20 spare ms / 0.2
    share.record_decode(20.0, 10.0)  # decode passes run 2x the curve here: so do the guessed rows
    factor = share.decode_factor
    assert factor == pytest.approx(1.25)  # a running mean, Not the last ratio alone
    assert share.rows(10.0, row_ms_guess=0.2) == 100  # both scale: the share of the pass is the same
    share.record_mixed(12.5 + 50 * 0.5, 10.0, 50)  # decode part 12.5 ms (10 x 1.25), 50 rows at 0.5 ms
    assert share.row_ms == pytest.approx(0.5)
    assert share.rows(10.0, row_ms_guess=0.2) == 50  # 25 spare ms / 0.5; Not 100 from the guess


def test_row_cost_follows_a_deepening_prompt():
    share = PrefillShare(256, 3.0, row_ms=0.2)
    for _ in range(20):  # rows cost 0.4 ms now (attention over a longer prompt)
        share.record_mixed(10.0 + 40 * 0.4, 10.0, 40)
    assert share.row_ms == pytest.approx(0.4, rel=0.01)
    assert share.rows(10.0, 0.2) == 50  # Not 100


@pytest.mark.parametrize("done, remaining, allowed, expected", [
    (0, 1000, 256, 256),   # a whole grid chunk
    (0, 1000, 100, 86),    # 256 in three equal pieces; Not 100, 100, 56
    (86, 914, 100, 85),
    (171, 829, 100, 85),   # ends on the grid at 256; Not 100 (it would cross into the next chunk)
    (0, 40, 32, 40),       # a 40-row rest stays one piece; Not 20 + 20 (below the precision threshold)
    (0, 10, 32, 10),       # a short prompt: all of it
    (512, 44, 8, 44),      # the prompt's tail is smaller than MIN_ROWS: one piece
])
def test_piece_rows(done, remaining, allowed, expected):
    assert piece_rows(done, remaining, 256, allowed) == expected


@given(st.integers(1, 3000), st.integers(1, 512), st.sampled_from([64, 256, 1024]))
def test_pieces_cover_the_prompt_on_the_grid(n, allowed, chunk):
    """Brute force: cutting a prompt piece by piece covers it exactly, never crosses a multiple of the chunk, and
    no piece is smaller than MIN_ROWS unless its grid chunk's rest was."""
    done = 0
    while done < n:
        left = min(n - done, chunk - done % chunk)
        k = piece_rows(done, n - done, chunk, allowed)
        assert 1 <= k <= left
        assert k >= min(MIN_ROWS, left) or k == left
        assert (done // chunk) == ((done + k - 1) // chunk)  # inside one grid chunk
        done += k
    assert done == n


def test_sharing_off_is_always_a_whole_chunk():
    share = PrefillShare(256, 0.0, row_ms=0.2)
    assert [share.rows(d, 0.2) for d in (0.0, 5.0, 50.0)] == [256, 256, 256]  # Not pieces sized by load



def _steps(share: PrefillShare, tokens: list[int], times: list[float], pass_ms: float | None = None) -> None:
    for ms in times:
        share.record_step(ms, ms if pass_ms is None else pass_ms, tokens, decode_only=True)


def test_a_mixed_step_is_bounded_by_the_decode_steps_tail():
    share = PrefillShare(256, 3.0, row_ms=1.0)
    _steps(share, [1, 1, 1, 1], [10.0] * 90 + [30.0] * 10)  # typical steps 10 ms; the slowest tenth 30 ms
    assert share.tail_ms(4) == 30.0  # the 95th percentile; Not the mean 12
    assert share.rows(10.0, 99.0, sequences=4) == 80  # 3 x 30 - 10 ms at 1 ms a row; Not 20 (3 x 10 - 10)
    assert share.rows(40.0, 99.0, sequences=4) == 80  # a pass dearer than the tail: its own bound, 3 x 40 - 40


def test_the_work_between_passes_counts_as_the_decoding_requests_own():
    share = PrefillShare(256, 3.0, row_ms=1.0)
    _steps(share, [1], [10.0] * 10, pass_ms=6.0)  # 4 ms of every step are drafting, committing, streaming
    assert share.between_ms == pytest.approx(4.0, rel=0.1)
    assert share.rows(6.0, 99.0, sequences=1) == 19  # (3 - 1) x (6 + ~4); Not 12 (the pass alone: the streams
    # would get a third of each pass but far more of each step)


def test_a_gap_is_a_step_split_over_its_tokens_each_token_counted():
    share = PrefillShare(256, 3.0, row_ms=1.0)
    _steps(share, [4, 1], [40.0] * 90)  # one request got 4 tokens a step (10 ms gaps), the other 1 (40 ms)
    assert share.tail_ms(2) == 40.0  # a fifth of the tokens had 40 ms gaps
    share = PrefillShare(256, 3.0, row_ms=1.0)
    _steps(share, [19, 1], [40.0] * 90)  # 19 tokens of 2.1 ms gaps for each 40 ms one
    assert share.tail_ms(2) == pytest.approx(40.0 / 19)  # 1 token in 20 is slow: the 95th percentile; Not 40


def test_mixed_steps_do_not_enter_the_tail():
    share = PrefillShare(256, 3.0, row_ms=1.0)
    for _ in range(100):
        share.record_step(90.0, 90.0, [1, 1, 1, 1], decode_only=False)  # steps carrying prompt rows: their own bound
    assert share.tail_ms(4) == 0.0  # Not 90 (the bound would feed on itself)


@pytest.mark.parametrize("sequences, steps, expected", [
    (4, 4, 20),  # too few gaps measured (16): the bound of the pass's own decode rows; Not the tail of 19
    (1, 100, 20),  # steps of 4 sequences say nothing of a lone one's tail; Not 80
    (0, 100, 20),  # sequences unknown: no tail
])
def test_the_tail_needs_enough_steps_of_as_many_sequences(sequences, steps, expected):
    share = PrefillShare(256, 3.0, row_ms=1.0)
    _steps(share, [1, 1, 1, 1], [30.0] * steps)
    assert share.rows(10.0, 99.0, sequences=sequences) == expected


def test_the_report_says_where_mixed_steps_went():
    share = PrefillShare(256, 2.5, row_ms=1.0)
    assert "0 mixed steps" in share.report() and "none yet" in share.report()
    _steps(share, [1, 1], [10.0] * 30)
    for _ in range(40):
        share.record_mixed(30.0, 6.0, 24)  # 6 ms of decoding rows, 24 prompt rows at 1 ms
        share.record_step(34.0, 30.0, [1, 1], decode_only=False)
    line = share.report()
    assert "40 mixed steps" in line and "step 34.0 ms" in line and "pass 30.0" in line, line
    assert "decoding rows 6.0" in line and "24 prompt rows at 1.00 ms" in line, line
    assert "2 decoding 10.0 ms" in line, line  # the decode-only tail; Not the mixed steps' 34 ms
