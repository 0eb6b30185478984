"""The one request shape the continuous-batching scheduler (engine/scheduler.py) sees, and its two kinds.

    TreeRun   a draft-tree request (ar, pld, rest-ds, rest, crest: engine/requests.py's TreeRequest). The scheduler
              decides its rows: how much of its prompt a pass carries, and, through its drafting facet, how much of
              its draft tree is verified (batch-wide, beside every other request's tree).
    LoopRun   a RAG or kNN-LM request (a LoopRequest: ralm.RagRequest, knnlm.KnnRequest), its decoding loop stepped
              by an EffectRun (engine/effects.py). The loop decides its own rows: its pending Pass, a prefill chunk
              or an AR step. Its retrieval runs between passes (advance), on the pool the scheduler hands it.

One pass of the scheduler, per request:

    advance(submit)        run on until it needs rows of the next pass or waits (-> the output steps it made)
    in_pass                it has rows for the next pass
    prefill_rows(allowed)  rows of its next prefill piece (0: it decodes)
    prefill_segment(n) | decode_segment()
    commit(logits, hidden, top)  after the pass: (output tokens, finish) or None (nothing to send yet)
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import torch

from generation_service.drafting.budget import DraftSizer
from generation_service.drafting.drafters import Drafter
from generation_service.engine.effects import EffectRun, Emit, LoopRequest, Pass, on_done
from generation_service.engine.requests import TreeRequest
from generation_service.engine.speculative import FINISH_CANCELLED, StreamChunk
from generation_service.engine.steps import is_prefill
from generation_service.model.lean_llama import Segment
from generation_service.model.sampling import Sampler
from generation_service.model.step_cost import StepCost
from ragcore.draft_tree import DraftTree

Step = tuple[list[int], str | None]  # (output tokens, finish reason or None)


class DraftStep(Protocol):
    """The drafting facet: what the scheduler's batch-wide draft decisions need of a request whose tree it sizes
    (engine/requests.py's TreeRequest is one)."""

    drafter: Drafter | None
    sizer: DraftSizer | None
    budget: int
    p: np.ndarray  # acceptance estimates of the fetched tree's nodes
    sampler: Sampler

    def draft_source(self, allow_remote: bool = True) -> Drafter | None: ...

    def draft_context(self) -> np.ndarray: ...

    def take_draft(self, source: Drafter, tree: DraftTree | BaseException, ms: float) -> None: ...

    def skip_draft(self) -> None: ...

    def choose(self, n: int | None = None, cost: StepCost | None = None) -> None: ...


class ScheduledRequest(Protocol):
    """A running request as the scheduler sees it, whatever its kind."""

    chunk: type  # its text chunks (StreamChunk or a subclass)
    drafting: DraftStep | None  # None: it brings its own rows, the scheduler sizes no tree for it
    first_step: Step | None  # its first output step, known at start (a prompt the prefix cache held whole)

    def advance(self, submit: Callable[..., Any]) -> list[Step]:
        """Run on until it needs rows of the next pass or waits (never blocks); submit(fn, *args, **kwargs) -> a
        future runs its blocking calls. -> the output steps it made meanwhile."""

    @property
    def ended(self) -> bool:
        """Its loop returned (once its output is out, a running request that ended without a finish is a bug)."""

    def wake_on(self, wake: Callable[[], None]) -> None:
        """Call wake() once what it waits on is done (nothing: it does not wait)."""

    @property
    def in_pass(self) -> bool:
        """It has rows for the next pass (a prefill piece or a decode step)."""

    def prefill_rows(self, allowed: int | None = None) -> int:
        """Rows of its next prefill piece when a pass may carry about `allowed` (None: a whole chunk); 0 while it
        decodes."""

    def prefill_segment(self, allowed: int) -> Segment: ...

    def decode_segment(self) -> Segment: ...

    @property
    def wants_hidden(self) -> bool:
        """Its rows need the final hidden rows beside the logits (kNN-LM queries)."""

    def commit(self, logits: torch.Tensor, hidden: torch.Tensor | None, top: list[int] | None) -> Step | None:
        """The pass ran: its rows' logits [q', V] (and hidden rows, if it asked); top: the greedy picks of the rows,
        taken for the whole pass at once (drafting requests with a greedy sampler). -> its output step, or None."""

    def cancel(self) -> Step: ...

    def close(self) -> None:
        """It leaves the engine (finished, failed): stop what it has in flight."""

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> StreamChunk: ...

    def logprobs(self, start: int, n: int) -> list | None:
        """The log-probabilities of output tokens start..start+n (None: it keeps none)."""


class TreeRun:
    """A TreeRequest as the scheduler sees it: the scheduler sizes its prefill pieces and its draft tree."""

    chunk = StreamChunk
    ended = False  # it ends by its output's finish
    in_pass = True  # prefilling or decoding, it always has rows
    wants_hidden = False

    def __init__(self, req: TreeRequest):
        self.req = req

    @property
    def drafting(self) -> DraftStep:
        return self.req

    @property
    def first_step(self) -> Step | None:
        return self.req.first_step

    def advance(self, submit: Callable[..., Any]) -> list[Step]:
        return []

    def wake_on(self, wake: Callable[[], None]) -> None:
        pass

    def prefill_rows(self, allowed: int | None = None) -> int:
        return self.req.next_prefill_rows if allowed is None else self.req.prefill_rows(allowed)

    def prefill_segment(self, allowed: int) -> Segment:
        return self.req.prefill_segment(allowed)

    def decode_segment(self) -> Segment:
        return self.req.decode_segment()

    def commit(self, logits: torch.Tensor, hidden: torch.Tensor | None, top: list[int] | None) -> Step | None:
        if self.req.prefilling:  # the pass carried a piece of its prompt: None until the last one
            return self.req.prefilled(logits)
        return self.req.commit(logits, top)

    def cancel(self) -> Step:
        return self.req.cancel()

    def close(self) -> None:
        pass

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> StreamChunk:
        stats = self.req.stats
        stats.total_ms = total_ms
        return StreamChunk(ids, text, finish_reason=finish, stats=stats, prompt_tokens=len(self.req.prompt),
                           completion_tokens=n_tokens)

    def logprobs(self, start: int, n: int) -> list | None:
        return self.req.logprobs[start:start + n]


class LoopRun:
    """A RAG / kNN-LM request as the scheduler sees it: its rows are its loop's pending Pass; its output comes from
    the loop's Emits at advance()."""

    drafting = None
    first_step = None

    def __init__(self, request: LoopRequest):
        self.request = request
        self.run = EffectRun(request.effects())
        self._waking: Any = None  # the future wake_on registered on

    @property
    def chunk(self) -> type:
        return self.request.chunk

    def advance(self, submit: Callable[..., Any]) -> list[Step]:
        emitted: list[Emit] = []
        self.run.advance(submit, emitted.append)  # its exceptions propagate: the request fails
        return [(e.tokens, e.finish) for e in emitted]

    @property
    def ended(self) -> bool:
        return self.run.finished

    def wake_on(self, wake: Callable[[], None]) -> None:
        future = self.run.future
        if future is not None and future is not self._waking:
            self._waking = future
            on_done(future, wake)

    @property
    def in_pass(self) -> bool:
        return isinstance(self.run.pending, Pass)

    def prefill_rows(self, allowed: int | None = None) -> int:
        p = self.run.pending  # a loop's prefill chunk is whole: `allowed` does not cut it
        return p.segment.ids.shape[0] if isinstance(p, Pass) and is_prefill(p.segment) else 0

    def prefill_segment(self, allowed: int) -> Segment:
        return self.run.pending.segment

    def decode_segment(self) -> Segment:
        return self.run.pending.segment

    @property
    def wants_hidden(self) -> bool:
        return self.run.pending.hidden

    def commit(self, logits: torch.Tensor, hidden: torch.Tensor | None, top: list[int] | None) -> Step | None:
        self.run.passed(logits, hidden)  # the loop takes them at its next advance()
        return None

    def cancel(self) -> Step:
        self.run.close()  # its finally blocks cancel what it has in flight
        return [], FINISH_CANCELLED

    def close(self) -> None:
        if not self.run.finished:
            self.run.close()  # a stop sequence ended it, or it failed: cancel what it has in flight

    def final_chunk(self, finish: str, ids: list[int], text: str, n_tokens: int, total_ms: float) -> StreamChunk:
        return self.request.final_chunk(finish, ids, text, n_tokens, total_ms)

    def logprobs(self, start: int, n: int) -> list | None:
        return None  # the server refuses logprobs for RAG and kNN-LM requests
