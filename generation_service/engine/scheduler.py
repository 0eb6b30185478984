"""Continuous batching: every running request shares each forward pass.

One loop on the model thread (engine/model_thread.py). Between passes requests join (admission: at most
`max_batch` running, their KV caches within `kv_cache_mb`; the rest wait in a bounded queue, beyond it
RESOURCE_EXHAUSTED) and leave (finished, cancelled, past their deadline: the slot is free at the next pass).
Two kinds of request share the passes, both seen through one protocol (engine/scheduled.py's ScheduledRequest):

    draft-tree modes    ar, pld, rest-ds, rest, crest: a TreeRequest (engine/requests.py) per request (TreeRun)
    RAG and kNN-LM      RaLMSeq/RaLMSpec (ralm.RagRequest), kNN-LM (knnlm.KnnRequest): a decoding loop over
                        effects (engine/effects.py) stepped by an EffectRun (LoopRun). Its forward passes are Pass
                        effects that join the shared pass; its blocking retrieval calls are Call effects run on the
                        retrieval pool while everyone else decodes; it waits on in-flight searches (Wait) without
                        holding anybody up; the engine sleeps only when every request waits on retrieval.

One step:

    advance     every RAG / kNN-LM loop runs until it needs rows of the next pass or waits on retrieval
    drafts      every decoding tree request's drafter (its drafting facet) is asked at once (remote drafts: one
                DraftBatch call per retrieval client); engine/draft_gate.py decides from measured step rates,
                per batch size, whether to draft remotely, in process only, or not at all (a lone `rest` request:
                remotely or in process; its sizer already chooses AR steps where no node pays)
    sizes       draft_budget.batch_sizes: the nodes worth verifying across the whole batch, best first, from the
                calibrated pass cost of the batch's decoding rows — trees shrink as the batch grows
    one pass    forward_batch over [last + tree] of every decoding tree request, every loop's AR rows, and prefill
                pieces of the longest-waiting requests (at least one): a whole `prefill_chunk` when nothing decodes,
                else the rows that keep the step within `prefill_slowdown` x the decoding requests' own step
                or their recent inter-token p95 (engine/prefill_share.py), so a long prompt (or a RAG request's re-prefill with a new passage)
                never stalls the others for long
    commit      per request: accept, KV commit, text (TextOutput), stream chunks, finish

Each request's tokens are chosen from its own rows exactly as it would be alone (same sampler, same draws, the
same passes for a loop), so a batched request's output equals its solo output except where batched kernels round
differently at a near-tie (top-2 logit gap within a few units in the last place; tests/generation/test_engine.py,
tests/ralm/test_engine.py and tests/knnlm/test_engine.py check this).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from generation_service import metrics
from generation_service.drafting.budget import SharedCalibration, batch_sizes
from generation_service.engine.admission import FollowWait
from generation_service.engine.draft_gate import LOCAL, NONE, REMOTE, DraftGate
from generation_service.engine.effects import LoopRequest
from generation_service.engine.model_thread import ModelThread
from generation_service.engine.pass_costs import PassCosts
from generation_service.engine.passage_rows import passage_budget
from generation_service.engine.prefill_share import PrefillShare
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.requests import FirstPick, TreeRequest, pick_first
from generation_service.engine.scheduled import DraftStep, LoopRun, ScheduledRequest, Step, TreeRun
from generation_service.engine.speculative import StreamChunk, TextOutput
from generation_service.engine.steps import SpeculationStats, prefill, tree_segment
from generation_service.engine.threads import IdleMeter, ThreadGovernor
from generation_service.model.lean_llama import KVSlab, capacity_for
from generation_service.model.sampling import argmax_each, token_logprobs
from generation_service.model.step_cost import StepCost
from generation_service.model.target import TargetModel, forward_batch, forward_batch_hidden, new_cache
from ragcore.errors import ResourceExhausted, ServiceError, Unavailable
from ragcore.files import write_json_atomic

log = logging.getLogger(__name__)

SLAB_MAX_ROWS = 4096  # rows per slab slot; a request needing more gets its own cache (attended on its own)
GATE_LOG_PASSES = 2000  # how often the draft gate's arm shares and rates are logged (about a line a minute busy)
SAVE_PASSES = 2000  # how often the pooled acceptance evidence is written (and at stop)


def kv_bytes_per_row(tm: TargetModel) -> int:
    """Bytes of keys + values one cached token takes in every layer."""
    cfg = tm.model.config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = tm.lean.kv_dtype.itemsize if tm.lean is not None else 2 if tm.dtype_name in ("bf16", "fp16") else 4
    return int(cfg.num_hidden_layers) * 2 * kv_heads * head_dim * itemsize


def job_kv_rows(tm: TargetModel, job) -> int:
    """KV rows a job reserves while it runs: its cache's capacity. A RAG job's cache holds passage + prompt +
    output; it keeps the caches of up to rag.revisit_passages earlier passages (a later step may return to one),
    and RaLMSpec one more while it speculates with another passage (a rollback may go back to it). A kNN-LM job's
    holds prompt + output (+ a pad row)."""
    n_prompt, n_new = len(job.prompt_ids), job.params.max_new_tokens
    if job.rag is not None:
        rows = capacity_for(n_prompt + passage_budget(n_prompt, job.rag), n_new, 0)
        kept = job.rag.revisit_passages if job.rag.reuse_kv else 0
        return (1 + kept + job.rag.speculate) * rows
    if job.knnlm is not None:
        return capacity_for(n_prompt, n_new, 1)
    return capacity_for(n_prompt, n_new, max(job.budget, 0))


def measure_segment_ms(tm: TargetModel, reps: int = 5, slab: KVSlab | None = None) -> float:
    """ms one more sequence adds to a batched pass beyond its rows (its own attention, bookkeeping): four 1-row
    sequences against one sequence of four rows, min over reps (in slab slots when the engine has a slab)."""
    rng = np.random.default_rng(0)
    caches = [slab.cache(i) for i in range(4)] if slab is not None and slab.slots >= 4 else [
        new_cache(tm, 128) for _ in range(4)]
    for c in caches:
        prefill(tm, c, torch.from_numpy(rng.integers(0, min(tm.vocab_size, 1000), 32)).to(tm.device))
    chain = np.arange(-1, 2, dtype=np.int32)  # 3 nodes: a 4-row pass

    def timed(fn: Callable[[], None]) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
            for c in caches:
                c.crop(32)
        return best * 1e3

    many = timed(lambda: forward_batch(tm, [tree_segment(tm, c, 1, np.zeros(0, np.int32), np.zeros(0, np.int32))
                                            for c in caches]))
    one = timed(lambda: forward_batch(tm, [tree_segment(tm, caches[0], 1, np.full(3, 2, np.int32), chain)]))
    return max(0.0, (many - one) / 3)


def _draft_together(group: list[tuple[DraftStep, object]]) -> None:
    """One propose_batch call for requests whose sources share a batch_key; each request takes its own tree."""
    sources = [source for _, source in group]
    t = time.perf_counter()
    try:
        trees = type(sources[0]).propose_batch(sources, [req.draft_context() for req, _ in group],
                                               [req.budget for req, _ in group])
    except Exception as e:  # every item becomes an AR step
        trees = [e] * len(group)
    ms = (time.perf_counter() - t) * 1e3
    for (req, source), tree in zip(group, trees):
        req.take_draft(source, tree, ms)


@dataclass(eq=False)  # identity: a request is itself, whatever its fields hold
class _Running:
    job: object  # server.Job
    kv_rows: int
    observer: metrics.GenerationObserver
    t0: float = field(default_factory=time.perf_counter)
    request: ScheduledRequest | None = None  # None until it starts (a first token may go out before)
    out: TextOutput | None = None
    closed: bool = False
    held: list[StreamChunk] = field(default_factory=list)  # chunks not handed to the gRPC thread yet
    last_put: float | None = None  # perf_counter() when a chunk was last handed over (None: never)
    tokens: list[int] = field(default_factory=list)  # output tokens sent so far
    first: FirstPick | None = None  # its first step, taken at submit from a prompt cached whole
    first_sent: bool = False  # ... and already handed to its gRPC thread


class Engine:
    """The continuous-batching worker: submit() jobs from gRPC threads; everything else runs on the model thread."""

    def __init__(self, tm: TargetModel, *, max_batch: int, prefill_chunk: int, kv_cache_mb: int, queue_size: int,
                 drafter: Callable[[object], object], loop: Callable[[object], LoopRequest],
                 learn: Callable[[np.ndarray, list[int]], None] | None = None,
                 model_thread: ModelThread | None = None, threads: ThreadGovernor | None = None,
                 acceptance_path: Path | None = None, prefix_cache_mb: int = 0, stream_interval_ms: float = 0.0,
                 follow_wait_ms: float = 0.0, live_pass_costs: bool = True, prefill_slowdown: float = 0.0):
        """drafter(job): the job's Drafter (None = AR); loop(job): the request of a RAG / kNN-LM job (an object with
        effects(), final_chunk() and chunk: ralm.RagRequest, knnlm.KnnRequest); learn(prompt, completion): called
        (on a helper thread) for finished jobs that asked to learn; threads: picks torch's intra-op threads per
        pass from measured pass times (None = keep the model thread's count); acceptance_path: where the pooled
        acceptance evidence is kept across restarts (None = it starts empty and is not kept); prefix_cache_mb:
        memory for prompts' KV rows kept for later requests with the same prompt (engine/prefix_cache.py; 0 = off,
        and off without the lean forward, whose cache layout it copies); stream_interval_ms: a stream's chunks are
        handed to its gRPC thread at most this often (its first token and its final chunk at once; tokens decoded
        in between go out merged with the next), 0 = every step's tokens at once; follow_wait_ms: after a request
        finishes, how long the next pass may wait for its replacement while clients run closed loops
        (engine/admission.py; 0 = never); live_pass_costs: size trees on the calibrated pass-cost curve corrected
        by the measured decode passes (engine/pass_costs.py), not on the start-up curve alone; prefill_slowdown: a
        step carrying prompt rows beside decoding ones may take up to this many times the decoding requests' own step
        or their recent inter-token p95 (engine/prefill_share.py), where the model's rows are pass-invariant (TargetModel.rows_pass_invariant: then
        no output depends on how a prompt was cut); elsewhere prompts are prefilled a whole chunk per pass."""
        self.tm = tm
        self.threads = threads
        self.live_cost = PassCosts(tm.step_cost) if live_pass_costs and tm.step_cost.measured else None
        self._idle = IdleMeter() if threads is not None else None
        self.max_batch = max(1, max_batch)
        self.prefill_chunk = max(1, prefill_chunk)
        self.kv_budget_rows = max(1, int(kv_cache_mb) * (1 << 20) // kv_bytes_per_row(tm))
        self.jobs: "queue.Queue" = queue.Queue(maxsize=queue_size)
        self.stream_interval_s = max(0.0, stream_interval_ms) / 1e3
        self.follow = FollowWait(max(0.0, follow_wait_ms) / 1e3)
        self.prefix_cache = (PrefixCache(int(prefix_cache_mb) << 20, self.prefill_chunk)
                             if prefix_cache_mb > 0 and tm.lean is not None else None)
        self._drafter, self._loop_request, self._learn = drafter, loop, learn
        self.running: list[_Running] = []
        self._waiting = None  # the next job, held back until the KV budget has room for it
        self._kv_used = 0
        self._wake = threading.Event()  # a loop's retrieval finished, or a job arrived
        self._submitting = threading.Lock()  # one gRPC thread at a time checks the queue's room and fills it
        self._stop = threading.Event()
        self.segment_ms = 0.0
        self.gate = DraftGate()
        self.calibration = SharedCalibration()  # every request's acceptance evidence: the prior of the next ones
        self.acceptance_path = acceptance_path
        self._load_acceptance()
        self.passes = 0  # batched passes run (stats, tests)
        # Prompt rows a pass carries beside decoding ones (engine/prefill_share.py); the last few such passes' rows.
        self.prefill_share = PrefillShare(self.prefill_chunk, prefill_slowdown if tm.rows_pass_invariant else 0.0)
        self.mixed_prefill_rows: deque[int] = deque(maxlen=4096)
        # The last pass: (start, ms, tokens it gave each decoding request, no prompt rows in it).
        self._last_pass: tuple[float, float, list[int], bool] | None = None
        self.peak_batch = 0  # most sequences in one pass so far
        # The running requests' caches, in slots of one slab (the unfused forward attends neighbouring slots in one
        # chain of ops per layer). A request that needs more rows than a slot holds gets a cache of its own.
        self.slab: KVSlab | None = None
        if tm.lean is not None and self.max_batch > 1:
            cap = int(min(SLAB_MAX_ROWS, self.kv_budget_rows // self.max_batch) // 64 * 64)
            if cap >= 64:
                lean = tm.lean
                self.slab = KVSlab(len(lean.layers), lean.kv_heads, lean.head_dim, self.max_batch, cap, lean.kv_dtype,
                                   lean.device)
        # Which running request lives in each slot (None: free). A finished one leaves a hole the next one takes:
        # moving the last user into it copied its whole KV (slow under GIL contention with many clients, py-spy), and
        # the fused forward attends every cache wherever it lives (the unfused one masks holes).
        self._slot_users: list[_Running | None] = [None] * (self.slab.slots if self.slab is not None else 0)
        self.draft_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="draft")  # one call per retrieval client
        # RAG / kNN-LM Calls (blocking RPCs: searches, passages): at most one per request at a time.
        self.retrieval_pool = ThreadPoolExecutor(max_workers=self.max_batch, thread_name_prefix="retrieval")
        self.learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learn")
        self.model_thread = model_thread or ModelThread("generation-engine")
        # Before the first job can arrive (the server reports SERVING after this returns).
        self.segment_ms = self.model_thread.call(self._measure)
        metrics.track_running(lambda: len(self.running))
        if threads is not None:
            metrics.track_pass_threads(lambda: threads.current)
        self.done = self.model_thread.submit(self._loop)

    # --------------------------------------------------------------------------------------- gRPC threads

    def submit(self, job) -> None:
        """Queue a job (queue.Full when the queue is full; ResourceExhausted when it could never fit)."""
        rows = job_kv_rows(self.tm, job)
        if rows > self.kv_budget_rows:
            raise ResourceExhausted(f"the request needs {rows} KV cache rows, more than this worker's whole budget "
                                    f"of {self.kv_budget_rows} (kv_cache_mb); shorten the prompt or max_new_tokens")
        piece = self._first_at_once(job, rows)
        with self._submitting:
            if self._stop.is_set():  # nothing would take it off the queue
                raise Unavailable("the worker is stopping")
            if self.jobs.full():  # checked before the first token goes out: a refused request gets none
                raise queue.Full
            if piece is not None:
                self._send(job.early, piece)
            self.jobs.put_nowait(job)
        self._wake.set()

    def _first_at_once(self, job, rows: int) -> StreamChunk | None:
        """A stream whose prompt the prefix cache holds whole gets its first token at submit, from the cached
        logits, not after the pass in flight (with many clients that wait was most of the TTFT: up to a pass,
        several times the solo one). The token is the one the engine would pick; the request goes on from that pick
        (job.early) when it starts. -> the chunk to send now (None: nothing, or nothing yet: the engine sends it)."""
        if self.prefix_cache is None or not job.stream or job.rag is not None or job.knnlm is not None:
            return None
        try:
            first = pick_first(self.tm, job.prompt_ids, job.params, self.prefix_cache)
        except Exception:  # a bad prompt fails where every other failure is reported: at its start
            return None
        if first is None:
            return None
        run = _Running(job, rows, metrics.GenerationObserver(job.decoding, job.submitted), first=first)
        job.early = run
        tokens, finish = first.step
        if finish is not None:  # its only step: it goes out with the final chunk, from the engine
            return None
        out = TextOutput(self.tm.tokenizer, job.prompt_ids, job.params.stop)
        piece, done = out.feed(tokens, None)
        if done is not None:  # a stop sequence in the first token: likewise, from a fresh TextOutput
            return None
        run.out, run.first_sent = out, True  # piece None: its text waits for the next tokens (TextStream)
        return piece

    def withdraw(self, job) -> bool:
        """Take a job out of the queue (its caller left or its deadline passed) -> whether it was still queued.
        Its slot in the queue is free at once; a job the engine took already is stopped at its next step."""
        with self.jobs.mutex:  # queue.Queue's own lock: the engine's get() and every put() take it
            # By identity, and no deque.remove: its "not in deque" error formats the job, and every RPC's end asks.
            queued = self.jobs.queue
            for i, other in enumerate(queued):
                if other is job:
                    del queued[i]
                    self.jobs.not_full.notify()
                    return True
            return False

    def depth(self) -> int:
        return self.jobs.qsize() + (self._waiting is not None)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the pass in flight, then stop the loop and the model thread (running requests end there)."""
        self._stop.set()
        try:
            self.jobs.put_nowait(None)  # wakes an idle loop
        except queue.Full:
            pass
        self.model_thread.stop()
        if threading.current_thread().ident == self.model_thread.ident:
            for pool in (self.draft_pool, self.retrieval_pool, self.learner):
                pool.shutdown(wait=False, cancel_futures=True)
            return
        try:
            self.done.result(timeout=timeout_s)
        except Exception:
            log.warning("engine loop did not end cleanly", exc_info=True)
        # Joined, not abandoned: the process exits after this returns, and a thread still inside a forward
        # pass or a datastore insert while the interpreter finalizes aborts it (SIGABRT instead of exit 0).
        self.model_thread.stop(wait=True, timeout_s=timeout_s)
        self.save_acceptance()  # the model thread, the only writer of the evidence, has ended
        for pool in (self.draft_pool, self.retrieval_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        self.learner.shutdown(wait=True)  # finished requests' outputs still reach the datastore

    # -------------------------------------------------------------------------------------- model thread

    def _load_acceptance(self) -> None:
        """The evidence an earlier run of this worker kept: its first requests then size trees from what drafts
        of each kind were worth, not from raw shares (which a cold worker trusts until each cell has been tested;
        in process the demo's first code completion ran slower than `ar` cold and faster warm). A missing, unreadable
        or foreign file starts empty."""
        if self.acceptance_path is None:
            return
        try:
            self.calibration.restore(json.loads(self.acceptance_path.read_text()))
        except FileNotFoundError:
            return
        except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
            log.warning("acceptance evidence %s unusable (%s); starting without it", self.acceptance_path, e)
            return
        log.info("acceptance evidence from %s: %.0f predicted, %.0f accepted draft tokens (decayed)",
                 self.acceptance_path, self.calibration.predicted.sum(), self.calibration.accepted.sum())

    def save_acceptance(self) -> None:
        """Keep the pooled acceptance evidence (atomic; on the model thread, or after it ended)."""
        if self.acceptance_path is None or not self.calibration.predicted.any():
            return
        try:
            write_json_atomic(self.acceptance_path, self.calibration.to_json())
        except OSError as e:  # a read-only home must not stop the serving
            log.warning("cannot keep the acceptance evidence in %s: %s", self.acceptance_path, e)

    def _measure(self) -> float:
        try:
            return measure_segment_ms(self.tm, slab=self.slab)
        except Exception:  # an estimate only: batching still works with 0
            log.warning("could not measure the per-sequence cost of a batched pass", exc_info=True)
            return 0.0

    def _loop(self) -> None:
        log.info("engine: up to %d requests per pass, prefill chunks of %d tokens, KV budget %d rows, "
                 "+%.2f ms per sequence in a pass", self.max_batch, self.prefill_chunk, self.kv_budget_rows,
                 self.segment_ms)
        while not self._stop.is_set():
            if not self.running:  # an idle wait is no step's gap
                self._last_pass = None
            self._admit(block=not self.running)
            if self.running:
                self._step()
        self._end_remaining()

    def _end_remaining(self) -> None:
        """The loop stopped with requests running or queued: each gets UNAVAILABLE, so no gRPC handler waits for
        chunks that will never come (a process exiting would wait on those handler threads forever)."""
        stopped = Unavailable("the worker stopped before the request finished")
        for run in list(self.running):
            self._fail(run, stopped)
        with self._submitting:  # submit() refuses from here on: nothing joins the queue after it is drained
            queued = [self._waiting] if self._waiting is not None else []
            self._waiting = None
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    queued.append(job)
        for job in queued:
            job.chunks.put(stopped)
            job.chunks.put(None)

    def _admit(self, block: bool) -> None:
        while len(self.running) < self.max_batch and not self._stop.is_set():
            job = self._waiting
            if job is None:
                try:
                    if block and not self.running:
                        job = self.jobs.get(timeout=0.5)
                    elif (hold := self.follow.remaining(time.monotonic())) > 0:  # a closed-loop client's next call
                        t = time.perf_counter()
                        try:
                            job = self.jobs.get(timeout=hold)
                        finally:
                            self.follow.held_s += time.perf_counter() - t
                    else:
                        job = self.jobs.get_nowait()
                except queue.Empty:
                    return
                if job is None:
                    return
                self.follow.arrived(job.submitted)
            rows = job_kv_rows(self.tm, job)
            if self.running and self._kv_used + rows > self.kv_budget_rows:
                self._waiting = job  # first come, first served: later jobs wait behind it
                return
            self._waiting = None
            self._start(job, rows)

    def _start(self, job, rows: int) -> None:
        if job.is_cancelled():
            job.chunks.put(None)
            return
        run = getattr(job, "early", None) or _Running(job, rows, metrics.GenerationObserver(job.decoding,
                                                                                             job.submitted))
        try:
            run.request = self._new_request(run, rows)
            if run.out is None:
                run.out = TextOutput(self.tm.tokenizer, job.prompt_ids, job.params.stop, run.request.chunk)
        except Exception as e:
            self._fail(run, e, started=False)
            return
        self._kv_used += rows
        self.running.append(run)
        if run.request.first_step is not None and not run.first_sent:
            self._feed(run, run.request.first_step)  # the whole prompt was in the prefix cache

    def _new_request(self, run: _Running, rows: int) -> ScheduledRequest:
        """The job's request: a RAG / kNN-LM loop, or a draft-tree request (in a free slab slot if it fits one)."""
        job = run.job
        if job.rag is not None or job.knnlm is not None:
            return LoopRun(self._loop_request(job))
        cache = None
        free = self._slot_users.index(None) if None in self._slot_users else -1
        if self.slab is not None and rows <= self.slab.capacity and free >= 0:
            cache = self.slab.cache(free)
        req = TreeRequest(self.tm, job.prompt_ids, job.params, drafter=self._drafter(job), draft_budget=job.budget,
                          stats=SpeculationStats(decoding=job.decoding), prefill_chunk=self.prefill_chunk, cache=cache,
                          calibration=self.calibration, prefix_cache=self.prefix_cache, first=run.first)
        if cache is not None:
            self._slot_users[free] = run
        return TreeRun(req)

    def _step(self) -> None:
        self._wake.clear()  # a completion from here on makes the wait below return at once
        for run in self.running:  # tokens held back since a stream's last chunk, now due (_send)
            if run.held and run.job.stream and self._due(run):
                self._flush(run)
        for run in list(self.running):
            if run.job.is_cancelled():
                self._feed(run, run.request.cancel())
        for run in list(self.running):
            self._advance(run)
        ready = [r for r in self.running if r.request.in_pass]
        if not ready:  # every request waits on retrieval
            self._wake.wait(0.05)
            return
        try:
            self._pass(ready)
        except Exception as e:  # a failed pass fails the requests in it; the engine keeps serving
            for run in ready:
                self._fail(run, e)

    def _advance(self, run: _Running) -> None:
        """Let a request run on until it needs the next pass or waits on retrieval (never blocks): a RAG / kNN-LM
        loop's searches and the output it commits between passes."""
        try:
            steps = run.request.advance(self.retrieval_pool.submit)
        except Exception as e:
            self._fail(run, e)
            return
        for step in steps:
            if not run.closed:
                self._feed(run, step)
        if run.closed:
            return
        if run.request.ended:
            self._fail(run, RuntimeError("the decode loop ended without a final chunk"))
        else:
            run.request.wake_on(self._wake.set)

    def _pass(self, ready: list[_Running]) -> None:
        """One batched forward pass: every decoding request's rows (tree requests: the last token + the chosen
        draft nodes; RAG / kNN-LM loops: their AR step), and prefill pieces of the longest-waiting requests
        (_choose_prefills), so a long prompt never stalls the others for long."""
        t0 = time.perf_counter()
        decoding = [r for r in ready if not r.request.prefill_rows()]
        drafted = [r for r in decoding if r.request.drafting is not None]  # their trees are sized here
        fixed = [r for r in decoding if r.request.drafting is None]  # their loops chose their rows
        steps = [r.request.drafting for r in drafted]
        arm, gated = self._draft_arm(steps, prefilling=len(decoding) < len(ready))
        if arm == NONE:
            for s in steps:
                s.skip_draft()
        else:
            self._fetch_drafts(steps, arm == REMOTE)
        cost = self.step_cost
        fixed_segments = [r.request.decode_segment() for r in fixed]
        self._size_trees(steps, fixed_segments, len(decoding), cost)
        decode_segments = [r.request.decode_segment() for r in drafted] + fixed_segments
        decode_ms, prefills = self._choose_prefills(ready, decode_segments, cost)
        # The prompt chunks of requests that bring their own rows before the pieces sized here, the order passes
        # have always had: a row's place in the pass can change how batched kernels round it.
        prefills.sort(key=lambda p: p[0].request.drafting is not None)
        members = drafted + fixed + [r for r, _ in prefills]
        segments = decode_segments + [r.request.prefill_segment(n) for r, n in prefills]
        pass_rows = sum(int(s.ids.shape[0]) for s in segments)
        n_threads = self._set_threads(pass_rows)
        t_pass = time.perf_counter()
        if self._last_pass is not None:  # the step that ended here: the gap its decoding requests saw
            last_start, last_ms, last_tokens, last_decode_only = self._last_pass
            self.prefill_share.record_step((t_pass - last_start) * 1e3, last_ms, last_tokens, last_decode_only)
        if any(r.request.wants_hidden for r in members):
            logits, hidden = forward_batch_hidden(self.tm, segments)
        else:
            logits, hidden = forward_batch(self.tm, segments), [None] * len(segments)
        pass_ms = (time.perf_counter() - t_pass) * 1e3
        self._record_pass(segments, len(decode_segments), bool(prefills), decode_ms, n_threads, pass_ms)
        tokens = self._commit(members, logits, hidden, [s.sampler.greedy for s in steps], len(decode_segments))
        self._last_pass = (t_pass, pass_ms, tokens, not prefills)
        if gated and not prefills and not fixed:  # other rows in the pass would blur the rate
            self._record_gate(len(steps), arm, sum(tokens), (time.perf_counter() - t0) * 1e3)

    def _draft_arm(self, steps: list[DraftStep], prefilling: bool) -> tuple[str, bool]:
        """How this pass's drafting requests draft (REMOTE as asked, LOCAL in process only, NONE not at all) ->
        (the arm, whether the draft gate chose it and measures the pass)."""
        # In a batch the gate measures how drafting pays. A lone request's sizer shrinks its tree down to an AR
        # step where no node pays, but it judges a remote source by whether its nodes were accepted, not by what
        # the round trip cost: a source that adds a node now and then was asked on most steps at several times
        # the cost of the in-process draft. So alone, the gate weighs only that: remote or in-process drafts, for
        # a source that has both (`rest`; without an in-process part the alternative is an AR step, which the
        # sizer already weighs per request, e.g. against a datastore that has just learned this very output).
        remote = any(getattr(s.drafter, "remote", False) for s in steps)
        alone = len(steps) == 1 and remote and getattr(steps[0].drafter, "local", None) is not None
        gated = (len(steps) > 1 or alone) and any(s.drafter is not None for s in steps)
        if steps and prefilling and self.prefill_share.slowdown > 0:
            # A prompt is being prefilled beside them: plain steps. A mixed step may last slowdown x the decoding
            # requests' tail gap (prefill_share.py) whatever they put in it, so the rows and draft round trips of
            # their trees would come out of the prompt's share of the step; without them the prompt gets most of it
            # and its first token comes sooner, while their gaps stay within the same bound.
            return NONE, False
        if not gated:
            return REMOTE, False
        arms = (REMOTE, LOCAL) if alone else (REMOTE, LOCAL, NONE) if remote else (LOCAL, NONE)
        return self.gate.choose(len(steps), arms), True

    def _size_trees(self, steps: list[DraftStep], fixed_segments: list, n_decoding: int, cost: StepCost) -> None:
        """How many nodes of its fetched tree each drafting request verifies in this pass."""
        if len(steps) == 1 and not fixed_segments:
            steps[0].choose(cost=cost)  # alone: the solo decision
            return
        if not steps:
            return
        # Sized against the decoding rows only. A prefill chunk's rows emit no token, so counted in they make the
        # pass's tokens per ms tiny and any node look worth its row (trees of 64 nodes beside a 200-row chunk);
        # but the chunk's cost is spent either way, while a node's row costs what it costs in any pass: it must
        # pay against the decoding rows' own rate.
        sized = [s for s in steps if s.sizer is not None]
        base = len(steps) * self.tm.min_rows + sum(seg.ids.shape[0] for seg in fixed_segments)
        counts = batch_sizes([s.p for s in sized], cost, base, n_decoding, self.segment_ms, base_tokens=n_decoding)
        for s, n in zip(sized, counts):
            s.choose(n)
        for s in steps:
            if s.sizer is None:
                s.choose()

    def _record_pass(self, segments: list, n_decoding: int, prefilled: bool, decode_ms: float, n_threads: int,
                     pass_ms: float) -> None:
        """What the pass's time tells the prefill share, the thread governor and the live cost curve."""
        pass_rows = sum(int(s.ids.shape[0]) for s in segments)
        if decode_ms > 0:
            prefill_rows = pass_rows - sum(int(s.ids.shape[0]) for s in segments[:n_decoding])
            if prefilled:
                self.prefill_share.record_mixed(pass_ms, decode_ms, prefill_rows)
                self.mixed_prefill_rows.append(prefill_rows)
                if log.isEnabledFor(logging.DEBUG):
                    depth = max(int(s.positions[-1]) for s in segments[n_decoding:]) + 1
                    log.debug("mixed pass: %d decoding rows of %d requests (%.1f ms on the curve), %d prompt rows to "
                              "depth %d, %d threads: %.1f ms (tail gap %.1f ms)", pass_rows - prefill_rows,
                              n_decoding, decode_ms, prefill_rows, depth, n_threads, pass_ms,
                              self.prefill_share.tail_ms(n_decoding))
            else:
                self.prefill_share.record_decode(pass_ms, decode_ms)
        if self.threads is not None:
            self.threads.record(n_threads, pass_rows, pass_ms)
        if self.live_cost is not None and not prefilled and (self.threads is None or n_threads == self.threads.start):
            # The calibrated curve is one sequence's pass: the others' attention and bookkeeping is outside it.
            self.live_cost.record(pass_rows, pass_ms, (len(segments) - 1) * self.segment_ms)
        self.passes += 1
        self.peak_batch = max(self.peak_batch, len(segments))
        if self.passes % SAVE_PASSES == 0:
            self.save_acceptance()
        if self.passes % GATE_LOG_PASSES == 0:
            self._log_state()

    def _log_state(self) -> None:
        """A line per adaptive part (about a line a minute busy): what it measured and decided so far."""
        if self.gate.steps:
            log.info("engine: draft gate after %d passes: %s", self.passes, self.gate.report())
        if self.threads is not None:
            log.info("engine: threads after %d passes: %s", self.passes, self.threads.report())
        if self.live_cost is not None:
            log.info("engine: pass costs after %d passes: %s", self.passes, self.live_cost.report())
        if self.prefix_cache is not None:
            log.info("engine: prefix cache after %d passes: %s", self.passes, self.prefix_cache.stats())
        if self.prefill_share.mixed_steps:
            log.info("engine: prefill share after %d passes: %s", self.passes, self.prefill_share.report())
        if self.follow.gaps:
            log.info("engine: arrivals after %d passes: %s", self.passes, self.follow.report())

    def _commit(self, members: list[_Running], logits: list, hidden: list, greedy: list[bool],
                n_decoding: int) -> list[int]:
        """Every member's step from its rows of the pass, fed to its output (greedy: per drafting request, the
        first members) -> the tokens each decoding request got."""
        picks = iter(argmax_each([lg for g, lg in zip(greedy, logits) if g]))  # one call, the GIL kept
        tops = [next(picks) if g else None for g in greedy] + [None] * (len(members) - len(greedy))
        tokens = [0] * n_decoding
        for i, (r, lg, h, top) in enumerate(zip(members, logits, hidden, tops)):
            step = r.request.commit(lg, h, top)
            if step is not None:
                if i < n_decoding:
                    tokens[i] = len(step[0])
                self._feed(r, step)
        return tokens

    def _record_gate(self, n: int, arm: str, emitted: int, ms: float) -> None:
        """A gated step of n drafting requests: its tokens per ms, relative to an AR pass over them, to the gate."""
        cost = self.tm.step_cost  # a generic curve (no calibration) has no ms to compare with: raw rates
        ar_ms = 0.0
        if self.threads is not None:  # at the count and slowdown this pass ran with
            ar_ms = self.threads.expected_ms(n * self.tm.min_rows) + n * self.segment_ms
        elif cost.measured:
            ar_ms = float(cost.pass_ms(n * self.tm.min_rows)) + n * self.segment_ms
        self.gate.record(n, arm, emitted, ms, ar_ms)

    def _choose_prefills(self, runs: list[_Running], decode_segments: list, cost: StepCost
                         ) -> tuple[float, list[tuple[_Running, int]]]:
        """The prompt pieces this pass carries beside the decoding rows, the longest-waiting request first (at least
        one piece): a whole chunk when nothing decodes, else as many rows as the prefill share allows
        (engine/prefill_share.py). -> (calibrated ms of the decoding rows alone (0: none), [(request, rows)])."""
        waiting = sorted((r for r in runs if r.request.prefill_rows()), key=lambda r: r.t0)
        if not waiting:
            return 0.0, []
        decode_ms = 0.0
        row_guess = 0.0
        if decode_segments:
            rows = sum(int(s.ids.shape[0]) for s in decode_segments)
            decode_ms = float(cost.pass_ms(rows)) + (len(decode_segments) - 1) * self.segment_ms
            row_guess = float(cost.pass_ms(rows + self.prefill_chunk) - cost.pass_ms(rows)) / self.prefill_chunk
        budget = self.prefill_share.rows(decode_ms, row_guess, len(decode_segments))
        chosen: list[tuple[_Running, int]] = []
        for r in waiting:
            n = r.request.prefill_rows(budget)
            if chosen and n > budget:
                break
            chosen.append((r, budget))
            budget -= n
            if budget <= 0:
                break
        return decode_ms, chosen

    @property
    def step_cost(self) -> StepCost:
        """The pass-cost curve trees are sized on: the calibrated one, corrected by measured passes when live."""
        return self.live_cost.cost if self.live_cost is not None else self.tm.step_cost

    def _set_threads(self, rows: int) -> int:
        """torch's intra-op threads for the next pass (on the model thread: its OpenMP team)."""
        if self.threads is None:
            return torch.get_num_threads()
        n = self.threads.choose(rows, self._idle.sample())
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return n

    def _fetch_drafts(self, reqs: list[DraftStep], allow_remote: bool) -> None:
        """Every decoding request's draft for this pass. Remote sources that can be asked together (one retrieval
        client) get one call for all of them on a helper thread, while the in-process drafts run here: one RPC's
        overhead per pass instead of one per request."""
        batches: dict[object, list[tuple[DraftStep, object]]] = {}
        alone: list[tuple[DraftStep, object]] = []
        for req in reqs:
            source = req.draft_source(allow_remote) if req.drafter is not None else None
            if source is not None:
                key = getattr(source, "batch_key", None)
                (alone if key is None else batches.setdefault(key, [])).append((req, source))
        asked = [self.draft_pool.submit(_draft_together, group) for group in batches.values()]
        for req, source in alone:
            t = time.perf_counter()
            try:
                tree = source.propose(req.draft_context(), req.budget)
            except Exception as e:  # take_draft makes it an AR step
                tree = e
            req.take_draft(source, tree, (time.perf_counter() - t) * 1e3)
        wait(asked)
        for f in asked:
            f.result()  # drafting failures are AR steps already; anything else is a bug

    # ---------------------------------------------------------------------------------------------- output

    def _feed(self, run: _Running, step: Step) -> None:
        """A request's output step (tokens, finish) -> chunks; the final one from the request's stats."""
        tokens, finish = step
        piece, done = run.out.feed(tokens, finish)
        if piece is not None:
            self._send(run, piece)
        if done is not None:
            finish, ids, delta, n = run.out.final(done)
            self._send(run, run.request.final_chunk(finish, ids, delta, n, (time.perf_counter() - run.t0) * 1e3))
            self._close(run, finish)

    def _send(self, run: _Running, chunk: StreamChunk) -> None:
        """Hand a chunk to the job's gRPC thread, or hold it: unary jobs get one merged chunk at the end, streams
        at most one every stream_interval (the first and the final one at once). Why: every chunk wakes a gRPC
        thread that sends one message, and on a few cores those wake-ups take the model's cores: with many streams,
        one message per step cost a marked share of the throughput unary calls got (bench.concurrency)."""
        run.observer.chunk(chunk)
        if run.job.params.logprobs is not None and chunk.token_ids:
            chunk.logprobs = self._logprobs(run, len(run.tokens), len(chunk.token_ids))
        run.tokens += chunk.token_ids
        run.held.append(chunk)
        if chunk.finish_reason is not None or (run.job.stream and self._due(run)):
            self._flush(run)

    def _logprobs(self, run: _Running, start: int, n: int) -> list:
        """The log-probabilities of output tokens start..start+n (the request's; a first token sent at submit,
        before its request exists: from the cached logits it was picked from)."""
        if run.request is not None:
            return run.request.logprobs(start, n)
        first = run.first
        return token_logprobs(first.hit.logits.view(1, -1), [first.token], run.job.params.logprobs)[start:start + n]

    def _due(self, run: _Running) -> bool:
        return run.last_put is None or time.perf_counter() - run.last_put >= self.stream_interval_s

    def _flush(self, run: _Running) -> None:
        held, run.held = run.held, []
        last = held[-1]
        run.job.chunks.put(last if len(held) == 1 else replace(
            last, token_ids=[t for c in held for t in c.token_ids], text="".join(c.text for c in held),
            logprobs=[e for c in held for e in (c.logprobs or ())] if any(c.logprobs for c in held) else None))
        run.last_put = time.perf_counter()

    def _close(self, run: _Running, finish: str) -> None:
        run.job.chunks.put(None)
        self._remove(run)
        if self._learn is not None and run.job.learn and finish in ("stop", "length") and run.tokens:
            # After the reply is out: learning must not add latency to the request.
            self.learner.submit(self._learn, run.job.prompt_ids, run.tokens)

    def _fail(self, run: _Running, e: BaseException, started: bool = True) -> None:
        if run.closed:  # it finished before the failure (in the same pass): its reply is out
            return
        if isinstance(e, ServiceError):  # a dependency failed or refused: the RPC's status line says it
            log.debug("generation stopped: %s: %s", type(e).__name__, e)
        else:
            log.error("generation failed", exc_info=e)
        run.job.chunks.put(e)
        run.job.chunks.put(None)
        if started:
            self._remove(run)

    def _remove(self, run: _Running) -> None:
        run.closed = True
        if run in self.running:
            self.running.remove(run)
            self._kv_used -= run.kv_rows
            self.follow.finished(time.monotonic())
        for slot, user in enumerate(self._slot_users):
            if user is run:
                self._slot_users[slot] = None
        run.request.close()  # a stop sequence ended it, or it failed: what it has in flight stops

