"""The generation worker's metric families (Prometheus), what vLLM users look for: requests running/waiting, prompt
and generation token counters, time to first token, inter-token latency, end-to-end latency, finished requests by
finish reason; speculation per decoding mode: forward steps, draft tokens proposed/accepted, accepted length per
step (M = _sum / _count), degraded steps; latency of the worker's own retrieval/KB RPCs by method and code; the
serving configuration calibration chose. Plumbing (registry, /metrics endpoint, gRPC server families) is
ragcore/metrics.py.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcore import metrics as core
from ragcore.metrics import LATENCY_BUCKETS, ServerMetrics

SERVICE = "generation"
_TOKEN_GAP = (.005, .01, .02, .03, .05, .075, .1, .15, .2, .3, .5, 1, 2.5)
_ACCEPTED = tuple(range(1, 17)) + (24, 32, 64)


class GenerationMetrics(ServerMetrics):
    def __init__(self, r: CollectorRegistry):
        super().__init__(r)
        d = ("decoding",)
        self.running = Gauge("ragserve_generation_requests_running", "Requests on the model now.", registry=r)
        self.waiting = Gauge("ragserve_generation_requests_waiting", "Requests queued for the model.", registry=r)
        self.prompt_tokens = Counter("ragserve_generation_prompt_tokens_total", "Prompt tokens of finished "
                                     "requests.", d, registry=r)
        self.tokens = Counter("ragserve_generation_tokens_total", "Completion tokens generated.", d, registry=r)
        self.requests = Counter("ragserve_generation_requests_total", "Finished generations.",
                                d + ("finish_reason",), registry=r)
        self.ttft = Histogram("ragserve_generation_time_to_first_token_seconds",
                              "From request accepted (queued) to its first token.", d, buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("ragserve_generation_inter_token_seconds",
                                     "Time per output token after the first.", d, buckets=_TOKEN_GAP, registry=r)
        self.e2e = Histogram("ragserve_generation_e2e_request_seconds",
                             "From request accepted (queued) to its last token.", d, buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("ragserve_generation_forward_steps_total", "Decode forward passes (after prefill).",
                             d, registry=r)
        self.accepted_length = Histogram("ragserve_generation_accepted_length",
                                         "Tokens emitted per decode forward pass; mean = M.", d, buckets=_ACCEPTED,
                                         registry=r)
        self.proposed = Counter("ragserve_generation_draft_tokens_proposed_total", "Draft tokens proposed.", d,
                                registry=r)
        self.accepted = Counter("ragserve_generation_draft_tokens_accepted_total", "Draft tokens accepted.", d,
                                registry=r)
        self.degraded = Counter("ragserve_generation_degraded_steps_total",
                                "Steps decoded without a draft because retrieval failed.", d, registry=r)
        self.retrieval_rpc = Histogram("ragserve_generation_retrieval_rpc_seconds",
                                       "The worker's calls to the retrieval/knowledge service, by method and code.",
                                       ("method", "grpc_code"), buckets=LATENCY_BUCKETS, registry=r)
        self.serving_config = Gauge("ragserve_generation_serving_config_info",
                                    "1 for the dtype / torch threads / device the worker serves with.",
                                    ("dtype", "threads", "device"), registry=r)
        self.pass_threads = Gauge("ragserve_generation_pass_threads",
                                  "torch threads of the current forward passes (fewer while the cores are "
                                  "contended; --adaptive-threads).", registry=r)
        self.step_ms = Gauge("ragserve_generation_calibrated_step_milliseconds",
                             "Calibrated ms of one decode pass with `rows` rows (last token + draft nodes).",
                             ("rows",), registry=r)


class GenerationObserver:
    """Per-request token timing: feed it every stream chunk of one generation, in order.

        obs = GenerationObserver(job.decoding, job.submitted)
        for chunk in generate_stream(...):
            obs.chunk(chunk)

    submitted: time.monotonic() when the request was accepted, so TTFT and end-to-end latency include the queue
    wait. Everything is read from the chunks and the final chunk's SpeculationStats the decode loop produces.
    """

    def __init__(self, decoding: str, submitted: float):
        self._m = get()
        self.decoding = decoding
        self.submitted = submitted
        self._last: float | None = None

    def chunk(self, chunk) -> None:
        m, d = self._m, self.decoding
        now = time.monotonic()
        n = len(chunk.token_ids)
        if n:
            if self._last is None:
                m.ttft.labels(d).observe(now - self.submitted)
            else:
                gap = (now - self._last) / n
                h = m.inter_token.labels(d)
                for _ in range(n):
                    h.observe(gap)
            m.tokens.labels(d).inc(n)
            self._last = now
        if chunk.finish_reason is not None:
            m.requests.labels(d, chunk.finish_reason).inc()
            m.e2e.labels(d).observe(now - self.submitted)
            m.prompt_tokens.labels(d).inc(getattr(chunk, "prompt_tokens", 0) or 0)
            s = chunk.stats
            if s is not None:
                m.steps.labels(d).inc(s.forward_steps)
                m.proposed.labels(d).inc(s.draft_tokens_proposed)
                m.accepted.labels(d).inc(s.draft_tokens_accepted)
                m.degraded.labels(d).inc(s.degraded_steps)
                h = m.accepted_length.labels(d)
                for length, count in enumerate(s.accepted_length_histogram):
                    for _ in range(count if length else 0):
                        h.observe(length)


def set_serving_config(dtype: str, threads: int, device: str, rows: Iterable[int] = (),
                       step_ms: Iterable[float] = ()) -> None:
    """What the worker serves with (engine/calibrate.py): an info gauge and the chosen cost curve."""
    m = get()
    m.serving_config.labels(dtype, str(threads), device).set(1)
    for q, ms in zip(rows, step_ms):
        m.step_ms.labels(str(q)).set(ms)


def track_queue_depth(depth: Callable[[], int]) -> None:
    get().waiting.set_function(depth)


def track_running(running: Callable[[], int]) -> None:
    get().running.set_function(running)


def track_pass_threads(threads: Callable[[], int]) -> None:
    get().pass_threads.set_function(threads)


def instrument_channel(channel: grpc.Channel) -> grpc.Channel:
    """The worker's channel to a retrieval/knowledge service, observed in
    ragserve_generation_retrieval_rpc_seconds{method, grpc_code}."""
    return core.instrument_channel(channel, get().retrieval_rpc)


def get() -> GenerationMetrics:
    return core.get(SERVICE)


core.declare(SERVICE, GenerationMetrics)
