"""One request decoded alone (the lossless speculative loop, and with no drafter our autoregressive loop), and the
text level every loop shares: incremental detokenization, stop sequences, stream chunks.

One step: draft -> verify -> accept -> gather_kv (engine/steps.py; the request's state machine is
engine/requests.py's TreeRequest, which the continuous-batching engine runs the same way, several per pass).
The verifier picks every emitted token exactly as the AR loop would (same row distribution, same draw order), so
greedy output equals AR output and seeded sampling equals seeded AR sampling, up to floating point ties.

Server API:
    for chunk in generate_stream(tm, prompt_ids, SamplingParams(...), drafter=d, draft_budget=32,
                                 is_cancelled=lambda: not context.is_active()):
        ...  # chunk.token_ids, chunk.text; the last chunk has finish_reason, stats, usage
    result = generate(...)  # the same, collected
Here one request owns the model for its whole run; the server batches requests (engine/scheduler.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from generation_service.drafting.drafters import Drafter
from generation_service.engine.requests import TreeRequest
from generation_service.engine.steps import (  # noqa: F401  (re-exported: the loops' shared names)
    DEFAULT_DRAFT_BUDGET,
    FINISH_CANCELLED,
    FINISH_LENGTH,
    FINISH_STOP,
    PREFILL_CHUNK,
    SpeculationStats,
    accept,
    cut_emitted,
    prefill,
    verify_tree,
)
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import TargetModel, cache_length, forward_batch, new_cache
from generation_service.model.tree_attention import gather_kv

log = logging.getLogger(__name__)

@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    # Set on the final chunk only.
    finish_reason: str | None = None
    stats: SpeculationStats | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list | None = None  # sampling.TokenLogprob per token_ids entry (when the request asked)


@dataclass
class GenerationResult:
    token_ids: list[int]  # completion tokens (no EOS, nothing after a stop sequence)
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    stats: SpeculationStats


# ---------------------------------------------------------------------------------------------------------------
# The loop: pure token level.


def decode(tm: TargetModel, prompt_ids, params: SamplingParams, *, drafter: Drafter | None = None,
           draft_budget: int = DEFAULT_DRAFT_BUDGET, stats: SpeculationStats | None = None,
           is_cancelled: Callable[[], bool] | None = None, adaptive_budget: bool = True,
           prefill_chunk: int = PREFILL_CHUNK) -> Iterator[tuple[list[int], str | None]]:
    """Token-level generation of one request alone: yields (new output tokens, finish reason) once per forward
    pass; the last item carries the finish reason (stop = EOS, length, cancelled). EOS is not part of the output.

    adaptive_budget: verify only the cost-effective part of each draft tree and skip useless remote drafts
    (drafting/budget.py); False = always verify up to draft_budget nodes. Either way the output is the same.
    The request is the engine's TreeRequest, driven pass by pass: a batched request runs the very same steps."""
    req = TreeRequest(tm, prompt_ids, params, drafter=drafter, draft_budget=draft_budget, stats=stats,
                      adaptive_budget=adaptive_budget, prefill_chunk=prefill_chunk)
    cancelled = is_cancelled or (lambda: False)
    step = None
    while step is None:
        if cancelled():
            yield req.cancel()
            return
        step = req.prefilled(forward_batch(tm, [req.prefill_segment()])[0])
    yield step
    while req.finish is None:
        if cancelled():
            yield req.cancel()
            return
        req.fetch_draft()
        req.choose()
        yield req.commit(forward_batch(tm, [req.decode_segment()])[0])


# ---------------------------------------------------------------------------------------------------------------
# Checking losslessness (tests and the benchmark).


@dataclass
class Divergence:
    index: int  # first output position where the two runs differ
    ar_token: int
    other_token: int
    gap: float  # AR-path logit of ar_token minus that of other_token at that position
    near_tie: bool


def near_tie_threshold(top_logit: float, dtype: torch.dtype) -> float:
    """Two units in the last place of the top logit in `dtype`: below that, rounding alone can flip the order."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    return float(2.0 * 2.0 ** (np.floor(np.log2(max(abs(top_logit), 1e-30))) - mantissa))


def first_divergence(tm: TargetModel, prompt_ids, ar_tokens: list[int], other: list[int]) -> Divergence | None:
    """None if `other` equals `ar_tokens` (up to the shorter length); else where and how narrowly they differ.

    The gap is measured on the AR loop's own logits (prefill + single steps, the same kernels), so it says how
    close the AR decision was at the position where the other run decided differently.
    """
    n = min(len(ar_tokens), len(other))
    i = next((k for k in range(n) if ar_tokens[k] != other[k]), None)
    if i is None:
        return None
    cache = new_cache(tm)
    empty = np.zeros(0, np.int32)
    logits = prefill(tm, cache, torch.as_tensor(np.asarray(prompt_ids, np.int64), device=tm.device))
    for k in range(i):
        past = cache_length(cache)
        logits = verify_tree(tm, cache, ar_tokens[k], empty, empty)[0]
        gather_kv(cache, past, [])
    row = logits.float()
    gap = float(row[ar_tokens[i]] - row[other[i]])
    return Divergence(i, ar_tokens[i], other[i], gap, bool(abs(gap) <= near_tie_threshold(float(row.max()), tm.dtype)))


# ---------------------------------------------------------------------------------------------------------------
# Text level: incremental detokenization, stop sequences, streaming.


class TextStream:
    """Detokenizes output tokens incrementally, finds stop sequences, and holds back text that could still turn
    into a stop sequence (a stop string may span chunk boundaries), together with the tokens that produced it."""

    # Decode a few prompt tokens before the output so tokenizers that strip a leading space decode the first
    # output token the way the full text would (vLLM's prefix/read offsets).
    _PROMPT_TAIL = 6

    def __init__(self, tokenizer, prompt: np.ndarray, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self._ids: list[int] = [int(t) for t in prompt[-self._PROMPT_TAIL:]] if tokenizer is not None else []
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text = ""
        self.tokens: list[int] = []
        self.ends: list[int] = []  # [i] = len(text) once token i was decoded
        self._searched = 0  # text before this index holds no stop sequence start
        self._sent_tokens = 0
        self._sent_chars = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, tokens: list[int]) -> bool:
        """Append output tokens; return True if a stop sequence appeared (the text is then cut before it)."""
        if self.stopped:
            return True
        for t in tokens:
            self.tokens.append(t)
            if self.tokenizer is not None:
                self._ids.append(t)
                new = self._decode(self._ids[self._prefix:])
                # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the token that completes it.
                if len(new) > len(self._prefix_text) and not new.endswith("\ufffd"):
                    self.text += new[len(self._prefix_text):]
                    self._prefix, self._read = self._read, len(self._ids)
                    self._prefix_text = self._decode(self._ids[self._prefix:self._read])
            self.ends.append(len(self.text))
        return self._find_stop()

    def flush(self) -> bool:
        """At the end: emit bytes still waiting for completion (as the tokenizer renders them)."""
        if self.tokenizer is not None and not self.stopped and self._read < len(self._ids):
            new = self._decode(self._ids[self._prefix:])
            self.text += new[len(self._prefix_text):]
            if self.ends:
                self.ends[-1] = len(self.text)
            self._prefix = self._read = len(self._ids)
            self._prefix_text = ""
            return self._find_stop()
        return self.stopped

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._searched - self.max_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        cut = min(hits)
        self.text = self.text[:cut]
        # Keep the tokens whose text starts before the cut (the one straddling it included).
        keep = 0
        while keep < len(self.tokens) and (self.ends[keep - 1] if keep else 0) < cut:
            keep += 1
        del self.tokens[keep:], self.ends[keep:]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop sequence."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, final: bool) -> tuple[list[int], str]:
        """-> (tokens, text) not yet sent; unless final, keep back a possible stop-sequence prefix."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        n = len(self.tokens) if final or self.stopped else self._sent_tokens
        while not (final or self.stopped) and n < len(self.tokens) and self.ends[n] <= end:
            n += 1
        tokens, text = self.tokens[self._sent_tokens:n], self.text[self._sent_chars:end]
        self._sent_tokens, self._sent_chars = n, max(end, self._sent_chars)
        return tokens, text


def generate_stream(tm: TargetModel, prompt_ids, params: SamplingParams, *, drafter: Drafter | None = None,
                    draft_budget: int = DEFAULT_DRAFT_BUDGET, is_cancelled: Callable[[], bool] | None = None,
                    tokenizer="model", decoding: str | None = None, adaptive_budget: bool = True,
                    prefill_chunk: int = PREFILL_CHUNK) -> Iterator[StreamChunk]:
    """Stream output chunks (about one per forward pass); the final chunk has finish_reason, stats and usage.

    tokenizer: "model" = tm.tokenizer; None = token ids only (no text, stop sequences not allowed).
    decoding: the name reported in stats (default: the drafter's name, or "ar").
    """
    t0 = time.perf_counter()
    tok = stream_tokenizer(tm, tokenizer, params)
    stats = SpeculationStats(decoding=decoding or (drafter.name if drafter is not None else "ar"))
    steps = decode(tm, prompt_ids, params, drafter=drafter, draft_budget=draft_budget, stats=stats,
                   is_cancelled=is_cancelled, adaptive_budget=adaptive_budget, prefill_chunk=prefill_chunk)
    finish, ids, delta, n_tokens = yield from text_chunks(steps, tok, prompt_ids, params.stop, StreamChunk)
    stats.total_ms = (time.perf_counter() - t0) * 1e3
    yield StreamChunk(ids, delta, finish_reason=finish, stats=stats, prompt_tokens=len(prompt_ids),
                      completion_tokens=n_tokens)


def stream_tokenizer(tm: TargetModel, tokenizer, params: SamplingParams):
    """tokenizer: "model" = tm.tokenizer, None = token ids only (then stop sequences cannot be matched)."""
    tok = tm.tokenizer if isinstance(tokenizer, str) and tokenizer == "model" else tokenizer
    if tok is None and params.stop:
        raise ValueError("stop: stop sequences need a tokenizer to match text")
    return tok


class TextOutput:
    """One request's output as text chunks, fed one step of tokens at a time (the engine feeds it between passes;
    text_chunks drives it from a token-step generator).

        out = TextOutput(tok, prompt_ids, stop, StreamChunk)
        chunk, done = out.feed(tokens, finish)   # a chunk to send (or None); done = the finish reason once over
        finish, ids, text, n_tokens = out.final(done)
    """

    def __init__(self, tok, prompt_ids, stop, chunk: type[StreamChunk] = StreamChunk):
        self.text = TextStream(tok, np.asarray(prompt_ids), tuple(stop))
        self.chunk = chunk

    def feed(self, tokens: list[int], finish: str | None) -> tuple[StreamChunk | None, str | None]:
        if self.text.add(tokens):
            return None, FINISH_STOP  # a stop sequence: the output ends here whatever the model does next
        if finish:
            return None, finish  # this step's text goes out with the final chunk
        ids, delta = self.text.release(final=False)
        return (self.chunk(ids, delta) if ids or delta else None), None

    def final(self, finish: str) -> tuple[str, list[int], str, int]:
        """-> (finish reason, last ids, last text, completion tokens) for the final chunk."""
        if (finish != FINISH_STOP or not self.text.stopped) and self.text.flush():
            finish = FINISH_STOP
        ids, delta = self.text.release(final=True)
        return finish, ids, delta, len(self.text.tokens)


def text_chunks(steps: Iterator[tuple[list[int], str | None]], tok, prompt_ids, stop: list[str],
                chunk: type[StreamChunk]) -> Generator[StreamChunk, None, tuple[str, list[int], str, int]]:
    """Token steps (tokens, finish reason or None) -> text chunks, shared by every decoding loop; returns what the
    final chunk needs: (finish reason, last ids, last text, completion tokens). Closes `steps` on a stop."""
    out = TextOutput(tok, prompt_ids, stop, chunk)
    finish = FINISH_LENGTH
    try:
        for tokens, finish_step in steps:
            piece, done = out.feed(tokens, finish_step)
            if piece is not None:
                yield piece
            if done:
                finish = done
                break
    finally:
        steps.close()
    return out.final(finish)


def generate(tm: TargetModel, prompt_ids, params: SamplingParams, **kwargs) -> GenerationResult:
    """generate_stream, collected. Same keyword arguments."""
    tokens: list[int] = []
    parts: list[str] = []
    for chunk in generate_stream(tm, prompt_ids, params, **kwargs):
        tokens += chunk.token_ids
        parts.append(chunk.text)
        if chunk.finish_reason is not None:
            return GenerationResult(tokens, "".join(parts), chunk.finish_reason, chunk.prompt_tokens, chunk.stats)
    raise AssertionError("generate_stream ended without a final chunk")
