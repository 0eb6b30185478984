"""How many prompt rows a pass may carry while other requests decode: a time budget per step.

Every pass gives each decoding request its next token (or a tree's few), so every prompt row added to a pass
delays all of them. With a fixed chunk a long prompt made every pass of its prefill a full chunk deep into the
prompt (attention over thousands of rows), and the streams beside it slowed to that chunk's pace. vLLM's chunked
prefill bounds the rows a step may add by a token budget that decode rows spend first. A prompt row's cost here
grows with its depth (its attention reads every row before it), so the budget is kept in ms instead, over the
decoding requests' whole step (the pass, and the drafting, committing and streaming between passes, which they
pay once per pass whatever the pass carries):

    a step with decoding rows may take up to `slowdown` x the longer of their own step and their tail gap;
    the prompt rows fill the rest:  rows = (slowdown x max(own, tail) - own) / row_ms,  within [min_rows, chunk]
    own = decode_ms + between_ms

decode_ms is the decoding rows' pass on the calibrated curve, scaled by how decode-only passes measured against
it; between_ms is what a step spent outside its pass; row_ms is what a prompt row added to measured mixed passes
(running means, so row_ms follows the prompt's depth). Without decoding rows a pass carries a whole chunk.

tail is the 95th percentile of the inter-token gaps the decoding requests saw in recent decode-only steps with as
many of them (a step's gap split over the tokens it gave a request, each token one gap; 0 until TAIL_MIN were
measured): the bound is on the streams' slow gaps, not their typical ones. Why: a stream's tail gaps are its
longest steps (big draft trees, a drafting round trip, a tree that gave one token), several times its typical gap;
every mixed step bounded by slowdown x that tail keeps the streams' p95 gap within about slowdown x their solo
p95, while the prompt gets most of each step. A bound proportional to each pass's decode rows alone left the prompt
(slowdown - 1) / slowdown of each pass and less of each step (the work between passes is the streams'). Only steps with as many decoding requests count, so the tail of a
bigger batch that has since finished does not let a mixed step grow beside a smaller one.

Rows are cut inside the chunk grid (piece_rows): a prompt's chunk boundaries stay at multiples of `chunk`, where
the prefix cache takes prompts' rows (engine/prefix_cache.py). Where the budget allows MIN_ROWS or more, no piece
is smaller than MIN_ROWS unless the grid chunk's rest is: pieces from 32 rows run the prefill linears' precision
(model/lean_llama.py), smaller ones the decode rows'. Deep in a long prompt on a slow machine one prompt row can
cost more than a whole decode pass, and a floor of 32 rows would make every mixed pass many times the decode pass,
so the budget may go down to one row. A prompt prefilled in such pieces is not given to the prefix cache (its
rows are not what a fresh prefill computes; engine/requests.py).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

MIN_ROWS = 32  # the smallest piece of a prompt chunk (the prefill linears' precision starts there)
ALPHA = 0.25  # weight of the newest measurement in the running means
TAIL_GAPS = 1024  # inter-token gaps of decode-only steps kept for their tail (a few seconds of decoding)
TAIL_MIN = 20  # fewest gaps of the pass's sequence count to read a 95th percentile from
TAIL_Q = 0.95


@dataclass
class PrefillShare:
    chunk: int  # the most prompt rows a pass carries (prefill_chunk), and the prefix cache's grid
    slowdown: float  # a mixed step may take this many times the decoding requests' own one (0: off, whole chunks)
    min_rows: int = 1  # the fewest prompt rows a pass carries while a prompt waits
    decode_factor: float = 1.0  # measured / calibrated ms of decode-only passes (running mean)
    row_ms: float | None = None  # ms a prompt row adds to a pass with decoding rows (running mean; None: unknown)
    between_ms: float = 0.0  # ms a step with decoding rows spends outside its pass (running mean)
    # Recent decode-only steps' gaps, one entry per (step, decoding request): (requests, ms per token, tokens).
    gaps: deque[tuple[int, float, int]] = field(default_factory=lambda: deque(maxlen=TAIL_GAPS))
    _tails: dict[int, float] = field(default_factory=dict)  # tail_ms by request count, until the next gap
    # Steps that carried prompt rows beside decoding ones, for the log (report): their count and running means.
    mixed_steps: int = 0
    mixed_step_ms: float = 0.0  # from the pass's start to the next one's
    mixed_pass_ms: float = 0.0
    mixed_decode_ms: float = 0.0  # the decoding rows' part of the pass (calibrated, corrected by decode_factor)
    mixed_rows: float = 0.0  # prompt rows per pass

    def rows(self, decode_ms: float, row_ms_guess: float, sequences: int = 0) -> int:
        """Prompt rows the next pass may carry. decode_ms: the calibrated ms of its decoding rows alone (0 = none
        decode: a whole chunk); row_ms_guess: a prompt row's ms on the calibrated curve, until one was measured;
        sequences: how many requests decode in it (0: unknown, no tail)."""
        if decode_ms <= 0 or self.slowdown <= 0:  # nothing decoding, or sharing off: a whole chunk
            return self.chunk
        row = self.row_ms if self.row_ms is not None else row_ms_guess * self.decode_factor
        own = decode_ms * self.decode_factor + self.between_ms
        spare = self.slowdown * max(own, self.tail_ms(sequences)) - own
        n = int(spare / row) if row > 0 and spare > 0 else 0
        return max(min(self.min_rows, self.chunk), min(self.chunk, n))

    def tail_ms(self, sequences: int) -> float:
        """The 95th percentile of the recent decode-only steps' inter-token gaps (each token one gap) with
        `sequences` decoding requests (0: too few measured)."""
        if sequences <= 0:
            return 0.0
        if sequences not in self._tails:
            mine = sorted((ms, k) for n, ms, k in self.gaps if n == sequences)
            total = sum(k for _, k in mine)
            tail, seen = 0.0, 0
            if len(mine) >= TAIL_MIN:
                for ms, k in mine:
                    seen += k
                    if seen >= TAIL_Q * total:
                        tail = ms
                        break
            self._tails[sequences] = tail
        return self._tails[sequences]

    def record_decode(self, measured_ms: float, calibrated_ms: float) -> None:
        """A pass of decoding rows only took measured_ms; the calibrated curve said calibrated_ms."""
        if measured_ms > 0 and calibrated_ms > 0:
            self.decode_factor += ALPHA * (measured_ms / calibrated_ms - self.decode_factor)

    def record_step(self, step_ms: float, pass_ms: float, tokens: list[int], decode_only: bool) -> None:
        """A step took step_ms from its pass's start to the next one's, its pass pass_ms, and gave its decoding
        requests `tokens` tokens each; decode_only: no prompt rows in it."""
        if not tokens or step_ms <= 0:
            return
        self.between_ms += ALPHA * (max(step_ms - pass_ms, 0.0) - self.between_ms)
        if decode_only:
            self.gaps.extend((len(tokens), step_ms / k, k) for k in tokens if k > 0)
            self._tails.clear()
        else:
            self.mixed_step_ms += ALPHA * (step_ms - self.mixed_step_ms)

    def record_mixed(self, measured_ms: float, decode_ms: float, rows: int) -> None:
        """A pass of decoding rows (calibrated decode_ms) and `rows` prompt rows took measured_ms."""
        if rows <= 0 or decode_ms <= 0:
            return
        per_row = max(measured_ms - decode_ms * self.decode_factor, 0.0) / rows
        self.row_ms = per_row if self.row_ms is None else self.row_ms + ALPHA * (per_row - self.row_ms)
        self.mixed_steps += 1
        for name, value in (("mixed_pass_ms", measured_ms), ("mixed_decode_ms", decode_ms * self.decode_factor),
                            ("mixed_rows", float(rows))):
            setattr(self, name, getattr(self, name) + ALPHA * (value - getattr(self, name)))

    def report(self) -> str:
        """One line for the log: where the recent mixed steps' time went (running means)."""
        tails = ", ".join(f"{n} decoding {self.tail_ms(n):.1f} ms" for n in sorted({n for n, _, _ in self.gaps}))
        row = f"{self.row_ms:.2f}" if self.row_ms is not None else "?"
        return (f"{self.mixed_steps} mixed steps: step {self.mixed_step_ms:.1f} ms = pass {self.mixed_pass_ms:.1f} "
                f"(decoding rows {self.mixed_decode_ms:.1f}, {self.mixed_rows:.0f} prompt rows at {row} ms) + "
                f"{self.between_ms:.1f} between passes; decode passes x{self.decode_factor:.2f} the curve; "
                f"tail gaps: {tails or 'none yet'}")


def piece_rows(done: int, remaining: int, chunk: int, allowed: int, min_rows: int = MIN_ROWS) -> int:
    """Rows of a prompt's next prefill piece: `done` rows of it prefilled, `remaining` to go, about `allowed` in
    this pass. The piece ends inside the current grid chunk [k*chunk, (k+1)*chunk), and that chunk's rest is cut
    into equal pieces (no ragged last one: 256 rows at 100 a pass go as 86, 85, 85, Not 100, 100, 56) of at least
    min_rows each where the rest has that many (40 rows at 32 a pass go as one piece, Not 20 + 20)."""
    left = min(remaining, chunk - done % chunk)
    pieces = max(1, min(math.ceil(left / max(1, allowed)), left // max(1, min_rows)))
    return math.ceil(left / pieces)
