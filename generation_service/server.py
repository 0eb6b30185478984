"""Generation worker: Generate / GenerateStream over gRPC, speculative decoding with retrieval drafts.

    python -m generation_service.server --retrieval 127.0.0.1:50051 --port 50052

Running requests share every forward pass (continuous batching, engine/scheduler.py); more wait in a bounded
queue (full queue -> RESOURCE_EXHAUSTED). Drafting failures never fail a request: the step decodes
autoregressively and the stats say `degraded`. Health reports SERVING once the model is loaded and warm.

Start-up: the dtype and thread count are chosen by measuring this machine's decode-pass cost (engine/calibrate.py,
cached in RAGSERVE_HOME) unless --dtype / --threads fix them; GetInfo tells what was chosen and why. Loading,
calibration, warm-up and every decode step run on one thread, the model thread (engine/model_thread.py).
"""

from __future__ import annotations

from ragcore.process import worker_openmp_spin

if __name__ == "__main__":  # before torch loads libgomp, which reads its spin count once (ragcore.process)
    worker_openmp_spin()

import logging
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from generation_service import metrics
from generation_service.config import DECODING_MODES, GenerationConfig
from generation_service.drafting.budget import warmup_sizer
from generation_service.drafting.drafters import Drafter, DraftUnavailable, PromptLookupDrafter
from generation_service.drafting.retrieval_client import RemoteDrafter, RetrievalClient
from generation_service.engine.calibrate import (
    Choice,
    apply_prefill_precision,
    cache_dir,
    calibrated_model,
    format_table,
    model_identity,
    served_prefill_precision,
    shown_flags,
)
from generation_service.engine.model_thread import ModelThread
from generation_service.engine.scheduler import Engine
from generation_service.engine.speculative import StreamChunk
from generation_service.engine.threads import ThreadGovernor
from generation_service.knnlm import loop as knnlm
from generation_service.knnlm.options import KnnLmOptions
from generation_service.knnlm.search import KnnBackend
from generation_service.model.kernels.build import kernel
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import load_model, same_logits_at, set_threads, warmup
from generation_service.ralm import service as ralm_service
from generation_service.ralm.loop import RagParams
from proto import generation_pb2, generation_pb2_grpc
from ragcore import metrics as core_metrics, security
from ragcore.draft_tree import warmup_context_draft
from ragcore.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from ragcore.grpc_shell import STOP_JOIN_S, RunningServer, install_signal_handlers, start_server
from ragcore.machine import cpu_info
from ragcore.model_files import tokenizer_identity
from ragcore.process import offline_process
from ragcore.wire import clip

log = logging.getLogger("generation_service")

_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_ROLES = ("system", "user", "assistant")
_MAX_STOP_CHARS = 512
# gRPC ends a call whose deadline passed (and runs its callbacks) about when our copy of that deadline runs out,
# a little before or after: an end this close to the deadline is the deadline, not a cancel.
_DEADLINE_SLACK_S = 0.05
_LEARN_PROMPT_TAIL = 16  # prompt tokens sent with a learned output (the longest suffix drafting matches)






# eq=False: a job is itself. Field equality compared prompt arrays (ambiguous truth values) whenever a queue looked a
# job up; repr=False fields: the engine's state of a job holds tensors, and formatting one takes tens of ms.
@dataclass(eq=False)
class Job:
    prompt_ids: np.ndarray
    params: SamplingParams
    decoding: str
    budget: int
    deadline: float | None  # time.monotonic() by which the client gives up
    learn: bool = False  # feed the finished output to online learning
    chunks: "queue.Queue[StreamChunk | BaseException | None]" = field(default_factory=queue.Queue, repr=False)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)  # accepted into the queue (TTFT includes the wait)
    knnlm: KnnLmOptions | None = None  # kNN-LM requests
    rag: RagParams | None = None  # RAG requests
    # False (unary Generate): the worker hands over one merged chunk at the end instead of one per step, so the
    # gRPC thread does not wake (and take a core from the model's OpenMP team) on every token.
    stream: bool = True
    early: object = field(default=None, repr=False)  # the engine's state of a first token it sent at submit (engine/scheduler.py)

    def is_cancelled(self) -> bool:
        return self.cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)


class _NoDrafts:
    """Stands in for a retrieval drafter when no retrieval service is usable; every step decodes AR."""

    remote = True
    local = None
    default_source = 0

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def propose(self, context_ids, max_nodes):
        raise DraftUnavailable(self.reason)


class RetrievalLink:
    """The retrieval service as the worker sees it: a client plus a one-time tokenizer compatibility check."""

    def __init__(self, cfg: GenerationConfig, tokenizer_id: str):
        self.client = (RetrievalClient(
            cfg.retrieval, timeout_ms=cfg.draft_timeout_ms, retry_after_s=cfg.retry_after_s,
            token=security.read_token(cfg.retrieval_auth_token, cfg.retrieval_auth_token_file),
            credentials=security.channel_credentials(cfg.retrieval_tls_ca, cfg.retrieval_tls_cert,
                                                     cfg.retrieval_tls_key)) if cfg.retrieval else None)
        self.tokenizer_id = tokenizer_id
        self._mismatch: str | None = None
        self._checked = False
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        """None if drafting can be tried, else why not (checked once the service first answers)."""
        if self.client is None:
            return "no retrieval service configured"
        with self._lock:
            if not self._checked:
                try:
                    info = self.client.info(timeout_s=2.0)
                except DraftUnavailable:
                    return None  # down for now; the drafter will fail fast and we re-check later
                self._checked = True
                if info.tokenizer_id and info.tokenizer_id != self.tokenizer_id:
                    self._mismatch = (f"retrieval datastore tokenizer {info.tokenizer_id} != model tokenizer "
                                      f"{self.tokenizer_id}")
                    log.error("%s: datastore drafts disabled", self._mismatch)
        return self._mismatch

    def learn(self, prompt_ids: np.ndarray, completion: list[int]) -> None:
        """Send a finished output for online learning, with the prompt's tail so its first tokens can match."""
        if self.client is None or not completion or self.problem() is not None:
            return
        tokens = np.concatenate([np.asarray(prompt_ids[-_LEARN_PROMPT_TAIL:], np.int64), np.asarray(completion)])
        try:
            self.client.learn(tokens)
        except DraftUnavailable as e:
            log.debug("learn_from_output skipped: %s", e)

    def drafter(self, decoding: str, deadline: float | None) -> Drafter:
        problem = self.problem()
        if problem is not None:
            return _NoDrafts(decoding, problem)
        source = {"rest": "merged", "rest-ds": "datastore", "crest": "crest"}[decoding]
        return RemoteDrafter(self.client, source, deadline=deadline)


def acceptance_path(cfg: GenerationConfig, tm) -> Path | None:
    """Where the worker keeps its pooled draft-acceptance evidence (cfg.acceptance_state): auto = per model in
    the calibration cache directory, off = nowhere, else the given file."""
    if cfg.acceptance_state == "off":
        return None
    if cfg.acceptance_state == "auto":
        return cache_dir() / f"acceptance-{model_identity(Path(tm.model_dir))}.json"
    return Path(cfg.acceptance_state)


class Worker:
    """The model side of the servicer: the continuous-batching engine (engine/scheduler.py) and what it needs to
    run every mode — drafters on the retrieval link, the RAG and kNN-LM backends."""

    def __init__(self, tm, cfg: GenerationConfig, link: RetrievalLink, knn=None, rag=None,
                 model_thread: ModelThread | None = None, threads: ThreadGovernor | None = None):
        self.tm, self.cfg, self.link = tm, cfg, link
        self.knn = knn  # knnlm.KnnBackend when a kNN-LM datastore is configured
        self.rag = rag  # ralm_service.RagBackend when a KB target is configured
        self.engine = Engine(tm, max_batch=cfg.max_batch, prefill_chunk=cfg.prefill_chunk,
                             kv_cache_mb=cfg.kv_cache_mb, queue_size=cfg.queue_size, drafter=self._drafter,
                             loop=self._loop_request, learn=link.learn, model_thread=model_thread, threads=threads,
                             acceptance_path=acceptance_path(cfg, tm), prefix_cache_mb=cfg.prefix_cache_mb,
                             stream_interval_ms=cfg.stream_interval_ms, follow_wait_ms=cfg.follow_wait_ms,
                             live_pass_costs=cfg.live_pass_costs, prefill_slowdown=cfg.prefill_slowdown)

    @property
    def model_thread(self) -> ModelThread:
        return self.engine.model_thread

    def submit(self, job: Job) -> None:
        self.engine.submit(job)  # raises queue.Full, or ResourceExhausted for a job that can never fit

    def depth(self) -> int:
        return self.engine.depth()

    def withdraw(self, job: Job) -> bool:
        return self.engine.withdraw(job)

    def stop(self) -> None:
        self.engine.stop()

    def _drafter(self, job: Job) -> Drafter | None:
        if job.decoding == "ar":
            return None
        if job.decoding == "pld":
            return PromptLookupDrafter()
        return self.link.drafter(job.decoding, job.deadline)

    def _loop_request(self, job: Job):
        """A RAG or kNN-LM job as the request the engine steps (ralm.RagRequest, knnlm.KnnRequest)."""
        if job.rag is not None:
            return self.rag.request(self.tm, job.prompt_ids, job.params, job.rag, deadline=job.deadline,
                                    is_cancelled=job.is_cancelled)
        return knnlm.KnnRequest(self.tm, job.prompt_ids, job.params, job.knnlm, self.knn,
                                is_cancelled=job.is_cancelled)


def _opt(request, name: str):
    return getattr(request, name) if request.HasField(name) else None


def parse_request(request: generation_pb2.GenerateRequest, tm, cfg: GenerationConfig) -> tuple[np.ndarray, SamplingParams, str, int]:
    """Validate every field (InvalidArgument names it) and turn the request into (prompt ids, params, mode, budget)."""
    prompt_ids = _prompt_ids(request, tm, cfg)
    params = _sampling(request, tm, cfg, int(prompt_ids.size))
    decoding = request.decoding or cfg.default_decoding
    if decoding not in DECODING_MODES:
        raise InvalidArgument("decoding", f"{clip(decoding)} is not one of {', '.join(DECODING_MODES)}")
    budget = request.draft_budget or cfg.draft_budget
    if budget > cfg.max_draft_budget:
        raise InvalidArgument("draft_budget", f"{budget} exceeds the limit of {cfg.max_draft_budget}")
    return prompt_ids, params, decoding, budget


def _prompt_ids(request: generation_pb2.GenerateRequest, tm, cfg: GenerationConfig) -> np.ndarray:
    """The prompt as token ids, from exactly one of prompt, messages (the chat template) or prompt_tokens."""
    given = [name for name, present in (("prompt", bool(request.prompt)), ("messages", len(request.messages) > 0),
                                        ("prompt_tokens", len(request.prompt_tokens) > 0)) if present]
    if len(given) != 1:
        raise InvalidArgument("prompt", f"give exactly one of prompt, messages, prompt_tokens (got {given or 'none'})")
    where = given[0]
    # Counts and sizes first: tokenizing or rendering a template costs time per character or message, so a
    # request is sized before any of that work (a huge message list or prompt is refused before any is read).
    if len(request.messages) > cfg.limit_messages:
        raise InvalidArgument("messages", f"{len(request.messages)} messages exceeds the limit of {cfg.limit_messages}")
    if len(request.prompt_tokens) > cfg.limit_prompt_tokens:
        raise InvalidArgument("prompt_tokens", f"{len(request.prompt_tokens)} tokens exceeds the limit of "
                         f"{cfg.limit_prompt_tokens}")
    chars = len(request.prompt) + sum(len(m.content) + len(m.role) for m in request.messages)
    max_chars = cfg.limit_prompt_chars or 16 * cfg.limit_prompt_tokens
    if chars > max_chars:
        raise InvalidArgument(f"{where}", f"{chars} characters exceeds the limit of {max_chars}")
    tok = tm.tokenizer
    if request.prompt:
        ids = tok(request.prompt, add_special_tokens=True)["input_ids"]
    elif request.messages:
        msgs = []
        for i, m in enumerate(request.messages):
            if m.role not in _ROLES:
                raise InvalidArgument(f"messages[{i}].role", f"{clip(m.role)} is not one of {', '.join(_ROLES)}")
            msgs.append({"role": m.role, "content": m.content})
        if getattr(tok, "chat_template", None) is None:
            raise InvalidArgument("messages", "this model has no chat template; send a prompt instead")
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = list(request.prompt_tokens)
        bad = [t for t in ids if t >= tm.vocab_size]
        if bad:
            raise InvalidArgument("prompt_tokens", f"token id {bad[0]} is out of vocabulary [0, {tm.vocab_size})")
    prompt_ids = np.asarray(ids, dtype=np.int64)
    if prompt_ids.size == 0:
        raise InvalidArgument(f"{where}", "encodes to zero tokens")
    if prompt_ids.size > cfg.limit_prompt_tokens:
        raise InvalidArgument(f"{where}", f"{prompt_ids.size} tokens exceeds the limit of {cfg.limit_prompt_tokens}")
    return prompt_ids


def _sampling(request: generation_pb2.GenerateRequest, tm, cfg: GenerationConfig, n_prompt: int) -> SamplingParams:
    """Length, sampling, stop sequences and logprobs, checked against the limits and this prompt's length."""
    max_new = request.max_new_tokens or cfg.default_max_new_tokens
    if max_new > cfg.limit_max_new_tokens:
        raise InvalidArgument("max_new_tokens", f"{max_new} exceeds the limit of {cfg.limit_max_new_tokens}")
    if n_prompt + max_new > tm.max_positions:
        raise InvalidArgument("max_new_tokens", f"prompt ({n_prompt}) + max_new_tokens ({max_new}) exceeds the "
                         f"model's {tm.max_positions} positions")
    temperature = _opt(request, "temperature")
    if temperature is not None and not math.isfinite(temperature):
        raise InvalidArgument("temperature", f"must be finite, got {temperature}")
    top_p = _opt(request, "top_p")
    if top_p is not None and not math.isfinite(top_p):
        raise InvalidArgument("top_p", f"must be finite, got {top_p}")
    top_k = _opt(request, "top_k")
    if top_k is not None and top_k > tm.vocab_size:
        raise InvalidArgument("top_k", f"{top_k} exceeds the vocabulary size {tm.vocab_size}")
    if len(request.stop) > cfg.limit_stop_sequences:
        raise InvalidArgument("stop", f"{len(request.stop)} sequences exceeds the limit of {cfg.limit_stop_sequences}")
    for i, s in enumerate(request.stop):
        if not s or len(s) > _MAX_STOP_CHARS:
            raise InvalidArgument(f"stop[{i}]", f"must be 1..{_MAX_STOP_CHARS} characters, got {len(s)}")
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs set")
    if request.logprobs and (request.HasField("rag") or request.HasField("knnlm") or request.decoding == "knnlm"):
        raise InvalidArgument("logprobs", "not available with rag or knnlm decoding")
    return SamplingParams(
        logprobs=request.top_logprobs if request.logprobs else None,
        max_new_tokens=max_new,
        temperature=temperature if temperature is not None else 0.0,
        top_p=top_p if top_p is not None else 1.0,
        top_k=top_k or 0,
        seed=_opt(request, "seed"),
        stop=tuple(request.stop),
        ignore_eos=request.ignore_eos,
    )


def parse_knnlm(request: generation_pb2.GenerateRequest, params: SamplingParams, decoding: str, backend):
    """kNN-LM options when the request sets `knnlm` or decoding "knnlm" (else None); InvalidArgument names the field."""
    if not request.HasField("knnlm") and decoding != "knnlm":
        return None
    if request.decoding not in ("", "knnlm"):
        raise InvalidArgument("decoding", f"{clip(request.decoding)} cannot be combined with knnlm options (use \"knnlm\" or "
                         "leave it empty)")
    return knnlm.request_options(request.knnlm, params, backend)


def parse_rag(request: generation_pb2.GenerateRequest, prompt_ids: np.ndarray, params: SamplingParams, tm,
              backend):
    """RAG options when the request sets `rag` (else None); InvalidArgument names the field."""
    if not request.HasField("rag"):
        return None
    if backend is None:
        raise FailedPrecondition("this server has no knowledge service for RAG (start it with --kb-target "
                                 "HOST:PORT)")
    return ralm_service.request_params(request, len(prompt_ids), params, tm.max_positions)


def stats_proto(chunk: StreamChunk) -> tuple[generation_pb2.Usage, generation_pb2.SpeculationStats]:
    usage = generation_pb2.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens)
    stats = generation_pb2.SpeculationStats(**chunk.stats.as_dict())
    knn = getattr(chunk, "knnlm", None)  # knnlm.KnnStreamChunk
    if knn is not None:
        stats.knnlm.CopyFrom(generation_pb2.KnnLmStats(**knn.as_dict()))
    rag = getattr(chunk, "rag_stats", None)  # ralm.RagChunk
    if rag is not None:
        stats.rag.CopyFrom(ralm_service.stats_proto(rag))
    return usage, stats


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the other 68 are
    shifted to code points from 256 on, in byte order (so ' ' is 'Ġ', '\\n' is 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            out[chr(256 + shifted)] = b
            shifted += 1
    return out


class TokenText:
    """Token id -> (text, bytes) for logprobs replies, cached. Bytes are exact for byte-level BPE vocabularies (the
    token's characters mapped back through GPT-2's byte alphabet); otherwise the UTF-8 of the token decoded alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_of = _byte_level_alphabet()

    def __call__(self, token: int) -> tuple[str, bytes]:
        got = self._cache.get(token)
        if got is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token) or ""
            if piece and all(c in self._byte_of for c in piece):
                raw = bytes(self._byte_of[c] for c in piece)
            else:
                raw = text.encode("utf-8")
            got = self._cache[token] = (text, raw)
        return got

    def entries(self, logprobs) -> list[generation_pb2.TokenLogprob]:
        out = []
        for e in logprobs:
            text, raw = self(e.token)
            entry = generation_pb2.TokenLogprob(token_id=e.token, logprob=e.logprob, token=text, token_bytes=raw)
            for t, lp in zip(e.top_ids, e.top_logprobs):
                ttext, traw = self(t)
                entry.top.add(token_id=t, logprob=lp, token=ttext, token_bytes=traw)
            out.append(entry)
        return out


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(self, cfg: GenerationConfig):
        self.cfg = cfg
        self.tm = None
        self.worker: Worker | None = None
        self.info: generation_pb2.WorkerInfo | None = None
        self.token_text: TokenText | None = None

    def attach(self, tm, worker: Worker, info: generation_pb2.WorkerInfo) -> None:
        self.tm, self.worker, self.info = tm, worker, info
        self.token_text = TokenText(tm.tokenizer)

    def GetInfo(self, request, context):
        if self.info is None:
            raise Unavailable("model is still loading")
        return self.info

    def _start(self, request, context, stream: bool = True) -> Job:
        if self.worker is None:
            raise Unavailable("model is still loading")
        prompt_ids, params, decoding, budget = parse_request(request, self.tm, self.cfg)
        knn = parse_knnlm(request, params, decoding, self.worker.knn)
        rag = parse_rag(request, prompt_ids, params, self.tm, self.worker.rag)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        learn = request.learn_from_output if request.HasField("learn_from_output") else self.cfg.learn_from_outputs
        job = Job(prompt_ids, params, "knnlm" if knn else decoding, budget, deadline, learn=learn, knnlm=knn,
                  stream=stream)
        if rag is not None:
            job.decoding, job.rag = rag.mode, rag
        try:
            self.worker.submit(job)
        except queue.Full:
            raise ResourceExhausted(f"generation queue is full ({self.cfg.queue_size} requests waiting); "
                                    "retry later") from None
        # Client cancellation or disconnect stops the decode loop at its next step, and a job still queued leaves
        # the queue at once.
        context.add_callback(lambda: self._left(job))
        return job

    def _left(self, job: Job) -> None:
        job.cancelled.set()
        if self.worker.withdraw(job):
            job.chunks.put(None)  # wakes its handler, which answers CANCELLED

    def _next(self, job: Job):
        """The job's next chunk (None: no more). A queued job whose deadline passes is taken out of the queue and
        its handler returns at once (a running one is stopped by the engine at its next step)."""
        while True:
            if job.deadline is None:
                return job.chunks.get()
            try:
                return job.chunks.get(timeout=max(0.0, job.deadline - time.monotonic()) + 0.01)
            except queue.Empty:
                if self.worker.withdraw(job):
                    raise DeadlineExceeded("the request deadline passed while it waited for a batch slot") from None
                return job.chunks.get()  # running: the engine ends it at its next step

    def _chunks(self, job: Job, context):
        while True:
            item = self._next(job)
            if item is None:
                if job.deadline is not None and time.monotonic() > job.deadline - _DEADLINE_SLACK_S:
                    raise DeadlineExceeded("the request deadline passed before it started")
                return
            if isinstance(item, BaseException):  # the shell answers with its status (ragcore/errors.py)
                raise item
            if item.finish_reason == "cancelled" and job.deadline is not None and time.monotonic() > job.deadline:
                # The loop stopped at the deadline: the caller gets DEADLINE_EXCEEDED, never an OK reply that races
                # its own timer.
                raise DeadlineExceeded("the request deadline passed during generation")
            yield item

    def Generate(self, request, context):
        job = self._start(request, context, stream=False)
        tokens: list[int] = []
        text: list[str] = []
        logprobs: list = []
        for chunk in self._chunks(job, context):
            tokens += chunk.token_ids
            text.append(chunk.text)
            logprobs += chunk.logprobs or ()
            if chunk.finish_reason is not None:
                usage, stats = stats_proto(chunk)
                return generation_pb2.GenerateResponse(text="".join(text), token_ids=tokens,
                                                       finish_reason=chunk.finish_reason, usage=usage, stats=stats,
                                                       logprobs=self.token_text.entries(logprobs))
        raise Cancelled("request was cancelled before it started")

    def GenerateStream(self, request, context):
        job = self._start(request, context)
        # Accepted: headers now, before the prompt is prefilled. A caller that answers its own client (the HTTP
        # gateway) can start its response on them and send the first token the moment it comes; a refusal above
        # is a status without them.
        context.send_initial_metadata(())
        finished = False
        for chunk in self._chunks(job, context):
            finished = chunk.finish_reason is not None
            msg = generation_pb2.GenerateStreamResponse(text_delta=chunk.text, token_ids=chunk.token_ids)
            if chunk.logprobs:
                msg.logprobs.extend(self.token_text.entries(chunk.logprobs))
            if chunk.finish_reason is not None:
                usage, stats = stats_proto(chunk)
                msg.finish_reason = chunk.finish_reason
                msg.usage.CopyFrom(usage)
                msg.stats.CopyFrom(stats)
            yield msg
        if not finished:  # never started: Not an OK stream without a final message
            raise Cancelled("request was cancelled before it started")


def _open_knnlm(cfg: GenerationConfig, tm):
    """The kNN-LM backend (datastore memory-mapped here, Search on cfg.retrieval) or None when not configured."""
    if not cfg.knnlm_datastore:
        return None
    backend = KnnBackend.open(
        cfg.knnlm_datastore, cfg.retrieval, cfg.knnlm_index, timeout_ms=cfg.knnlm_timeout_ms,
        token=security.read_token(cfg.retrieval_auth_token, cfg.retrieval_auth_token_file),
        credentials=security.channel_credentials(cfg.retrieval_tls_ca, cfg.retrieval_tls_cert, cfg.retrieval_tls_key))
    backend.check_model(tm)
    problem = backend.verify_served()
    if problem:  # the retrieval service may come up later; kNN-LM requests fail with UNAVAILABLE meanwhile
        log.warning("kNN-LM: %s", problem)
    return backend


def apply_kv_cache_dtype(tm, kind: str) -> str:
    """Set how the model's KV caches store keys/values (--kv-cache-dtype) -> the dtype's name, for the log."""
    if tm.lean is not None:
        return str(tm.lean.set_kv_dtype(kind)).removeprefix("torch.")
    if kind == "fp16":
        raise ValueError("kv_cache_dtype: fp16 needs the lean forward's fused pass (this model runs transformers')")
    return f"{tm.dtype_name} (transformers')"


def load_serving_model(cfg: GenerationConfig):
    """-> (TargetModel, Choice or None), loaded, calibrated and warmed. Run it on the model thread."""
    t0 = time.perf_counter()
    if cfg.calibration == "off":
        dtype = "fp32" if cfg.dtype == "auto" else cfg.dtype
        set_threads(cfg.threads)
        tm = load_model(cfg.model, dtype=dtype, device=cfg.device, forward=cfg.forward)
        apply_prefill_precision(tm, cfg.prefill_precision)  # auto: nothing measured, so fp32
        choice = None
    else:
        tm, choice = calibrated_model(cfg.model, cfg.device, cfg.dtype, cfg.threads, forward=cfg.forward,
                                      prefill_precision=cfg.prefill_precision, force=cfg.calibration == "force")
        cal = choice.calibration
        log.info("calibration (%s, %s; %s, %s):\n%s", cal.source, cal.path or "not cached", cal.key["cpu"],
                 " ".join(shown_flags()) or "no avx flags", format_table(choice))
    kv = apply_kv_cache_dtype(tm, cfg.kv_cache_dtype)
    log.info("model %s loaded in %s with %d threads, %s forward, %s prompt linears, %s KV cache; warm-up took %.1f s "
             "(start-up %.1f s)", tm.model_dir, tm.dtype_name, torch_threads(), tm.forward_name,
             served_prefill_precision(tm), kv, warmup(tm), time.perf_counter() - t0)
    return tm, choice


def thread_governor(cfg: GenerationConfig, choice: Choice | None, bf16_prefill: bool = False) -> ThreadGovernor | None:
    """Per-pass thread choice among the calibrated counts up to the chosen one (same dtype): only when the count
    was chosen by measurement (--threads 0) and adaptive_threads is on."""
    if choice is None or cfg.threads or not cfg.adaptive_threads:
        return None
    costs = {c.threads: c.pass_cost(bf16_prefill) for c in choice.calibration.curves
             if c.dtype == choice.dtype and c.threads <= choice.threads}
    return ThreadGovernor(costs, start=choice.threads) if len(costs) > 1 else None


def torch_threads() -> int:
    return torch.get_num_threads()


def worker_info(cfg: GenerationConfig, tm, choice: Choice | None, threads: int) -> generation_pb2.WorkerInfo:
    info = generation_pb2.WorkerInfo(
        model=tm.model_dir, device=str(tm.device), dtype=tm.dtype_name, threads=threads, cpu=cpu_info()[0],
        cpu_flags=shown_flags(), torch_version=torch_version(), calibration="off" if choice is None else
        choice.calibration.source, max_draft_nodes=tm.step_cost.max_nodes, default_decoding=cfg.default_decoding,
        max_positions=min(tm.max_positions, 2**32 - 1), tokenizer_id=tokenizer_identity(tm.tokenizer),
        forward=tm.forward_name, kernels=kernels_loaded(), fused=tm.lean is not None and tm.lean.fused is not None,
        prefill_precision=served_prefill_precision(tm))
    if choice is not None:
        info.calibration_file = choice.calibration.path
        info.warnings.extend(choice.warnings)
        for c in choice.calibration.curves:
            info.candidates.add(dtype=c.dtype, threads=c.threads, rows=c.rows, step_ms=c.step_ms,
                                prefill_ms=c.prefill_ms, expected_ms_per_token=c.expected_ms_per_token(),
                                batch_ms=c.batch_ms, objective=c.objective(), prefill_bf16_ms=c.prefill_bf16_ms)
    return info


def kernels_loaded() -> str:
    k = kernel()
    return f"{k.isa()} {k.__file__}" if k is not None else ""


def torch_version() -> str:
    return torch.__version__


def build_server(cfg: GenerationConfig, *, tm=None) -> tuple[RunningServer, GenerationServicer]:
    """Bind (health NOT_SERVING), load, calibrate and warm the model, connect retrieval, then report SERVING.

    tm: an already loaded model (tests); it is used as is, without calibration or warm-up.
    """
    servicer = GenerationServicer(cfg)

    def add(server: grpc.Server) -> list[str]:
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        return [_SERVICE]

    auth, credentials = security.server_setup(cfg)
    running = start_server(add, host=cfg.host, port=cfg.port, workers=cfg.workers,
                           max_concurrent_rpcs=cfg.max_concurrent_rpcs, max_message_bytes=cfg.max_message_bytes,
                           interceptors=auth, observers=[core_metrics.GrpcMetrics(metrics.SERVICE)], credentials=credentials)
    try:
        running.closers.append(core_metrics.serve_config(cfg, metrics.SERVICE))
        model_thread = ModelThread("generation-worker")
        choice = None
        if tm is None:
            tm, choice = model_thread.call(load_serving_model, cfg)
        threads = model_thread.call(torch_threads)
        warmup_context_draft()  # compile/load the prompt-lookup kernel before the first pld request
        warmup_sizer()  # and the draft sizer's
        link = RetrievalLink(cfg, tokenizer_identity(tm.tokenizer))
        knn = _open_knnlm(cfg, tm)
        rag = ralm_service.RagBackend.open(cfg)
        if rag is not None:
            running.closers.append(rag.close)
        governor = None  # on a GPU the CPU threads do not run the passes
        if tm.device.type == "cpu":
            governor = thread_governor(cfg, choice, served_prefill_precision(tm) == "bf16")
        if governor is not None and not model_thread.call(same_logits_at, tm, sorted(governor.arms)):
            log.warning("logits differ between %s threads here: the thread count stays at %d (changing it between "
                        "passes would break speculative == autoregressive)", sorted(governor.arms), threads)
            governor = None
        servicer.attach(tm, Worker(tm, cfg, link, knn=knn, rag=rag, model_thread=model_thread, threads=governor),
                        worker_info(cfg, tm, choice, threads))
        metrics.track_queue_depth(servicer.worker.depth)
        metrics.set_serving_config(tm.dtype_name, threads, str(tm.device),
                                   choice.curve.rows if choice else (), choice.curve.step_ms if choice else ())
    except Exception:
        running.stop(0)
        raise
    running.set_serving(True)
    return running, servicer


def serve(cfg: GenerationConfig) -> None:
    try:
        running, servicer = build_server(cfg)
    except Exception as e:
        # Model missing or unloadable: exit non-zero with the loader's message (see retrieval_service.server).
        log.error("generation service cannot serve: %s", e, exc_info=not isinstance(e, (ValueError, OSError)))
        sys.exit(2)
    stopped = install_signal_handlers(running, cfg.grace_s, on_stop=servicer.worker.stop)
    log.info("generation service SERVING on %s:%d (retrieval %s)", cfg.host, running.port, cfg.retrieval or "none")
    running.wait()
    stopped.wait(cfg.grace_s + STOP_JOIN_S)  # the drain's last steps (see install_signal_handlers)


def main(argv: list[str] | None = None) -> None:
    cfg = GenerationConfig.from_args(argv)
    cfg.configure_logging()
    # Process-wide, once: no model hub; no tokenizer thread pool next to torch's (the worker tokenizes one
    # request at a time, and on a small machine every extra runnable thread stalls torch's OpenMP team).
    offline_process()
    serve(cfg)


if __name__ == "__main__":
    main()
