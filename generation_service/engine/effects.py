"""Effects: what a RAG or kNN-LM decoding loop asks of whoever runs it, so one loop serves alone and in a batch.

A loop is a generator. Where it used to run a forward pass or block on the knowledge service, it yields an
effect and is resumed with the answer:

    logits, hidden = yield Pass(segment, hidden=True)   # its rows of the next forward pass -> logits [q', V] and,
                                                        # if asked, the final hidden rows [q', D]
    reply = yield Call(retr.search, [q], 1)             # a blocking call (an RPC): resumed with its return value,
                                                        # or its exception raised at the yield
    yield Wait(future)                                  # until an in-flight future is done
    yield Emit(tokens, finish)                          # committed output tokens (finish reason or None)

Alone (run_solo, the loops' reference path and benchmarks) every Pass is a forward pass of its own and every
Call runs inline: exactly the passes and calls the loop made before effects. In the engine (engine/scheduler.py)
a Pass joins the batched pass every running request shares, a Call runs on a helper thread while the others
decode, and a loop waiting on either holds nobody up. The loop's control flow, and so its output, is the same.

An EffectRun steps one loop: advance() runs it until it needs a pass or waits on a future that is not done.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator, Protocol

import numpy as np
import torch

from generation_service.engine.steps import PREFILL_CHUNK, prefill_segments, tree_segment
from generation_service.model.lean_llama import Segment
from generation_service.model.target import TargetModel, cache_length, forward_batch, forward_batch_hidden
from generation_service.model.tree_attention import gather_kv

_EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class Pass:
    segment: Segment
    hidden: bool = False  # also return the final (normed) hidden rows the output layer reads


@dataclass(frozen=True)
class Call:
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    future: Any  # done() and add_done_callback(fn) (called with one argument, or none: see on_done)


@dataclass(frozen=True)
class Emit:
    tokens: list[int]
    finish: str | None


class LoopRequest(Protocol):
    """What the engine needs of a RAG or kNN-LM request (ralm.RagRequest, knnlm.KnnRequest): its loop, the type of
    its text chunks and its final chunk."""

    chunk: type

    def effects(self) -> "Effects": ...

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> Any: ...


def call(fn: Callable[..., Any], *args, **kwargs) -> Call:
    return Call(fn, args, kwargs)


Effects = Generator[Any, Any, Any]


def on_done(future: Any, fn: Callable[[], None]) -> None:
    """Call fn() once `future` is done (at once if it is); futures without callbacks are polled by the caller."""
    add = getattr(future, "add_done_callback", None)
    if add is None:
        return
    add(lambda *_: fn())


def wait_done(future: Any, timeout_s: float | None = None) -> bool:
    """Block until `future` is done (True) or timeout_s passes (False)."""
    if future.done():
        return True
    event = threading.Event()
    on_done(future, event.set)
    if getattr(future, "add_done_callback", None) is None:  # poll: no way to be told
        while not future.done():
            if event.wait(0.001):
                break
        return True
    return event.wait(timeout_s) or future.done()


def inline(fn: Callable[..., Any], *args, **kwargs) -> Future:
    """fn run here and now, as a finished future (what a Call is alone)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as e:  # delivered at the loop's yield
        fut.set_exception(e)
    return fut


class EffectRun:
    """One loop being stepped. `pending` is what it waits for: a Pass (rows for the next pass), a Call (its future
    in `future`) or a Wait; None while it can run on. `finished` once the generator returned."""

    def __init__(self, loop: Effects):
        self.loop = loop
        self.pending: Pass | Call | Wait | None = None
        self.future: Any = None  # a Call's future / a Wait's future
        self.finished = False
        self._send: Any = None
        self._throw: BaseException | None = None

    def advance(self, submit: Callable[..., Any], emit: Callable[[Emit], None]) -> None:
        """Run the loop until it needs a pass, waits on a future that is not done, or ends. submit(fn, *args,
        **kwargs) -> a future runs a Call; emit(e) takes each Emit. The loop's own exceptions propagate."""
        while not self.finished:
            if self.pending is not None:
                if isinstance(self.pending, Pass) or not self.future.done():
                    return
                if isinstance(self.pending, Call):
                    try:
                        self._send = self.future.result()
                    except BaseException as e:  # raised inside the loop, where the call was made
                        self._throw = e
                self.pending = self.future = None
            try:
                if self._throw is not None:
                    effect, self._throw = self.loop.throw(self._throw), None
                else:
                    effect = self.loop.send(self._send)
            except StopIteration:
                self.finished = True
                return
            self._send = None
            if isinstance(effect, Emit):
                emit(effect)
            elif isinstance(effect, Call):
                self.pending, self.future = effect, submit(effect.fn, *effect.args, **effect.kwargs)
            elif isinstance(effect, (Pass, Wait)):
                self.pending = effect
                self.future = effect.future if isinstance(effect, Wait) else None
            else:
                raise TypeError(f"a decoding loop yielded {type(effect).__name__}, not an effect")

    def passed(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The pending Pass ran: the loop resumes with (logits, hidden) at its next advance()."""
        assert isinstance(self.pending, Pass)
        self.pending, self._send = None, (logits, hidden)

    def close(self) -> None:
        """End the loop where it stands (its finally blocks run: in-flight searches are cancelled)."""
        self.finished = True
        self.loop.close()


def prefill_passes(tm: TargetModel, cache, prompt: torch.Tensor, chunk: int = PREFILL_CHUNK,
                   hidden: bool = False) -> Effects:
    """steps.prefill as effects: prompt [P] into `cache` in chunks -> (logits [V], hidden [D] or None) of the
    last position."""
    for seg in prefill_segments(prompt, cache, chunk):
        logits, h = yield Pass(seg, hidden)  # [1, V], [1, D]: the last row of the chunk
    return logits[-1], (h[-1] if hidden else None)


def ar_pass(tm: TargetModel, cache, token: int, hidden: bool = False) -> Effects:
    """The AR step every decoding mode uses (steps.tree_segment with no tree, pad rows in low precision), as an
    effect: `token` (not yet in the cache) -> (logits [V], hidden [D] or None) of the next position; the cache
    grows by one row."""
    past = cache_length(cache)
    logits, h = yield Pass(tree_segment(tm, cache, token, _EMPTY, _EMPTY), hidden)  # [q, V], row 0 = the token
    gather_kv(cache, past, [])  # drop the pad rows
    return logits[0], (h[0] if hidden else None)


def run_pass(tm: TargetModel, p: Pass) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One Pass as a forward pass of its own."""
    if p.hidden:
        logits, hidden = forward_batch_hidden(tm, [p.segment])
        return logits[0], hidden[0]
    return forward_batch(tm, [p.segment])[0], None


def run_solo(tm: TargetModel, loop: Effects) -> Iterator[tuple[list[int], str | None]]:
    """A loop alone: every Pass its own forward pass, every Call inline, Waits blocking -> its Emits as
    (tokens, finish). Closing this iterator closes the loop."""
    run = EffectRun(loop)
    out: list[Emit] = []
    try:
        while True:
            run.advance(inline, out.append)
            for e in out:
                yield e.tokens, e.finish
            out.clear()
            if run.finished:
                return
            if isinstance(run.pending, Pass):
                run.passed(*run_pass(tm, run.pending))
            else:
                wait_done(run.future)
    finally:
        run.close()


def run_inline(tm: TargetModel, loop: Effects) -> Any:
    """A loop that emits nothing (a sub-step: one prefill, one RAG step) run alone -> its return value."""
    result: list[Any] = []

    def body() -> Effects:
        result.append((yield from loop))

    for _ in run_solo(tm, body()):
        raise AssertionError("run_inline: the loop emitted output")
    return result[0]
