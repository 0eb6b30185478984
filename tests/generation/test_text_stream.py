"""Incremental detokenization and text-level stop sequences, with a byte-level toy tokenizer."""

from __future__ import annotations

import numpy as np

from generation_service.engine.speculative import TextStream


class ByteTokenizer:
    """id -> bytes; decoding joins the bytes (incomplete UTF-8 shows as U+FFFD, like byte-level BPE)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


PIECES = [b"<p>", b"Hel", b"lo ", b"EN", b"D more", b"X", b"abSTOPcd", b"\xc3", b"\xa9", b"!"]
PROMPT = np.array([0], np.int32)


def run(chunks: list[list[int]], stop: tuple[str, ...]) -> tuple[list[tuple[list[int], str]], bool, tuple[list[int], str]]:
    ts = TextStream(ByteTokenizer(PIECES), PROMPT, stop)
    out, stopped = [], False
    for c in chunks:
        if ts.add(c):
            stopped = True
            break
        out.append(ts.release(final=False))
    if not stopped:
        stopped = ts.flush()
    return out, stopped, ts.release(final=True)


def test_stop_spanning_chunks_is_held_back_and_cut():
    out, stopped, final = run([[1, 2], [3], [4]], ("END",))
    assert out == [([1, 2], "Hello "), ([], "")]  # "EN" held back with its token  # Not ([3], "EN")
    assert stopped and final == ([], "")  # the stop and everything after it never leave


def test_held_back_prefix_released_when_it_does_not_complete():
    out, stopped, final = run([[1, 2], [3], [5]], ("END",))
    assert out == [([1, 2], "Hello "), ([], ""), ([3, 5], "ENX")]
    assert not stopped and final == ([], "")


def test_stop_inside_one_token_keeps_the_token_and_text_before():
    out, stopped, final = run([[1], [6, 9]], ("STOP",))
    assert out == [([1], "Hel")]
    assert stopped and final == ([6], "ab")  # Not ([6, 9], "abSTOPcd!")


def test_earliest_of_several_stops_wins():
    _, stopped, final = run([[2, 3, 4]], ("more", "ND"))
    assert stopped and final == ([2, 3], "lo E")


def test_split_utf8_waits_for_completion():
    out, stopped, final = run([[7], [8, 9]], ())
    assert out == [([7], ""), ([8, 9], "é!")]  # Not "\ufffd"
    assert not stopped


def test_incomplete_utf8_at_the_end_is_flushed():
    out, _, final = run([[1, 7]], ())
    assert out == [([1, 7], "Hel")]
    assert final == ([], "\ufffd")


def test_no_tokenizer_streams_ids_only():
    ts = TextStream(None, PROMPT, ())
    assert not ts.add([4, 5])
    assert ts.release(final=False) == ([4, 5], "")
