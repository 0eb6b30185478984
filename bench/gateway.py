"""Gateway overhead: the same requests straight to the worker's gRPC API and through the HTTP gateway, interleaved.

    flock /work/locks/bench.lock python -m bench.gateway              # worker + gateway started as processes
    python -m bench.gateway --worker 127.0.0.1:50052 --gateway http://127.0.0.1:8000 --requests 20

Every measurement is a series of triples (direct, gateway through the standard library's HTTP client, gateway
through httpx2) whose order turns around triple by triple, so machine noise hits all three alike:
    request   a 1-token completion of a prompt the worker's prefix cache holds (the worker's part is tiny):
              overhead = p50(gateway) - p50(direct) per request (target <= 1.5 ms)
    stream    a greedy stream of --stream-tokens tokens (EOS ignored) of a prompt no earlier call sent (the worker
              prefills it, as for a user's new conversation): overhead per token =
              (p50(gateway) - p50(direct)) / tokens (target <= 0.2 ms)
    ttft      time to the first content of --ttft-pairs streams of new prompts (2 tokens each, so there are enough
              of them for a steady median): p50(gateway) / p50(direct) (target <= 1.1x)
    ttft_cached  time to the first content of a stream whose prompt the prefix cache holds whole (the worker sends
              its first token at once): what the gateway adds, in ms (reported, no target: a ratio of two
              near-zero times says little)
The gateway is the real HTTP path (uvicorn + Starlette + SSE, JSON both ways). Two HTTP clients call it, each
over one keep-alive connection:
    http      the standard library's http.client: a client that adds as little as the direct side's gRPC client,
              so the difference is the gateway's own (the targets are judged on it)
    httpx2    the transport of the OpenAI Python SDK: what an SDK user sees (the SDK's own parsing aside), reported
              beside it under "httpx2"; the difference between the two is the client library's cost, not the
              gateway's
Writes bench/results/gateway-<cpu class>.json (machine, flags, load average, commit).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx2 as httpx
from tqdm import tqdm

from bench.serving import cpu_class, machine, write_json
from proto import generation_pb2, generation_pb2_grpc
from ragcore.grpc_shell import wait_until_serving

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n"


def fresh_prompt(i: int, side: str) -> str:
    """A prompt no earlier call sent (so no prefix cache holds it), of the same length on both sides of a pair."""
    return f"# task {i:05d}{side}\n{PROMPT}"
TARGETS = {"request_overhead_ms": 1.5, "stream_overhead_ms_per_token": 0.2, "ttft_ratio": 1.1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_processes(model: str = "") -> tuple[list[subprocess.Popen], str, str]:
    """A worker (AR decoding, no retrieval: what is measured is the path, not the decoding) and a gateway in front
    of it, as processes -> (processes, worker address, gateway URL)."""
    wport, gport = _free_port(), _free_port()
    py = sys.executable
    worker = subprocess.Popen([py, "-m", "generation_service.server", "--port", str(wport), "--retrieval", "",
                               "--kb-target", "", "--default-decoding", "ar", *(["--model", model] if model else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{wport}"
    gateway = subprocess.Popen([py, "-m", "gateway.server", "--port", str(gport), "--workers", address,
                                "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs = [worker, gateway]
    try:
        wait_until_serving(address, timeout_s=900)
        url = f"http://127.0.0.1:{gport}"
        wait_ready(url)
    except BaseException:
        stop_processes(procs)
        raise
    return procs, address, url


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"gateway {url} not ready after {timeout_s} s")


class Direct:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)

    def request(self) -> float:
        t = time.perf_counter()
        self.stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=1), timeout=60)
        return (time.perf_counter() - t) * 1e3

    def stream(self, tokens: int, prompt: str = PROMPT) -> tuple[float, float, int]:
        """-> (ms to the first text, ms in all, tokens)."""
        t = time.perf_counter()
        first, n = None, 0
        req = generation_pb2.GenerateRequest(prompt=prompt, max_new_tokens=tokens, ignore_eos=True)
        for msg in self.stub.GenerateStream(req, timeout=120):
            if first is None and msg.text_delta:
                first = time.perf_counter()
            n += len(msg.token_ids)
        end = time.perf_counter()
        return (first - t) * 1e3, (end - t) * 1e3, n


def _stream_body(model: str, prompt: str, tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ragserve": {"ignore_eos": True}}


class _SSE:
    """The first-content time and the token count of an SSE completion stream, fed its lines as they arrive."""

    def __init__(self):
        self.first: float | None = None
        self.tokens = 0

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if self.first is None and chunk["choices"] and chunk["choices"][0]["text"]:
            self.first = time.perf_counter()
        if chunk.get("usage"):
            self.tokens = chunk["usage"]["completion_tokens"]


class ThroughGateway:
    """The gateway through httpx2 (the OpenAI SDK's transport)."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, timeout=120)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def request(self) -> float:
        t = time.perf_counter()
        r = self.http.post("/v1/completions", json={"model": self.model, "prompt": PROMPT, "max_tokens": 1})
        r.raise_for_status()
        return (time.perf_counter() - t) * 1e3

    def stream(self, tokens: int, prompt: str = PROMPT) -> tuple[float, float, int]:
        t = time.perf_counter()
        sse = _SSE()
        with self.http.stream("POST", "/v1/completions", json=_stream_body(self.model, prompt, tokens)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                sse.line(line)
        end = time.perf_counter()
        return (sse.first - t) * 1e3, (end - t) * 1e3, sse.tokens

    def close(self) -> None:
        self.http.close()


class ThroughGatewayStdlib:
    """The gateway through the standard library's http.client (one keep-alive connection)."""

    def __init__(self, url: str, model: str):
        host, _, port = url.split("//", 1)[1].rstrip("/").rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=120)
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        self.unary = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 1}).encode()

    def _post(self, body: bytes) -> http.client.HTTPResponse:
        self.conn.request("POST", "/v1/completions", body, self.headers)
        r = self.conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"gateway answered {r.status}: {r.read()[:300]!r}")
        return r

    def request(self) -> float:
        t = time.perf_counter()
        json.loads(self._post(self.unary).read())
        return (time.perf_counter() - t) * 1e3

    def stream(self, tokens: int, prompt: str = PROMPT) -> tuple[float, float, int]:
        t = time.perf_counter()
        sse = _SSE()
        r = self._post(json.dumps(_stream_body(self.model, prompt, tokens)).encode())
        while line := r.readline():
            sse.line(line.decode().rstrip("\r\n"))
        r.read()
        end = time.perf_counter()
        return (sse.first - t) * 1e3, (end - t) * 1e3, sse.tokens

    def close(self) -> None:
        self.conn.close()


def _series(n: int, sides: list, desc: str) -> list[list]:
    """n rounds of one call per side, the order turned around every round -> one list of results per side."""
    out: list[list] = [[] for _ in sides]
    for i in tqdm(range(n), desc=desc, leave=False):
        order = range(len(sides)) if i % 2 == 0 else reversed(range(len(sides)))
        for k in order:
            out[k].append(sides[k](i))
    return out


def _figures(d_req, g_req, d_st, g_st, d_t, g_t, d_c, g_c) -> dict:
    """The overhead figures of one HTTP client against the direct calls made beside it."""
    med = statistics.median
    tokens = med([s[2] for s in d_st])
    out = {
        "request_ms": {"direct_p50": med(d_req), "gateway_p50": med(g_req),
                       "paired_diff_p50": med([g - d for d, g in zip(d_req, g_req)])},
        "stream_ms": {"direct_p50": med([s[1] for s in d_st]), "gateway_p50": med([s[1] for s in g_st]),
                      "tokens_direct": tokens, "tokens_gateway": med([s[2] for s in g_st])},
        "ttft_ms": {"direct_p50": med(d_t), "gateway_p50": med(g_t), "paired_diff_p50": med([g - d for d, g in zip(d_t, g_t)])},
        "ttft_cached_ms": {"direct_p50": med(d_c), "gateway_p50": med(g_c),
                           "paired_diff_p50": med([g - d for d, g in zip(d_c, g_c)])},
    }
    out["request_overhead_ms"] = out["request_ms"]["gateway_p50"] - out["request_ms"]["direct_p50"]
    out["stream_overhead_ms_per_token"] = (out["stream_ms"]["gateway_p50"] - out["stream_ms"]["direct_p50"]) / tokens
    out["ttft_ratio"] = out["ttft_ms"]["gateway_p50"] / out["ttft_ms"]["direct_p50"]
    out["ttft_cached_overhead_ms"] = out["ttft_cached_ms"]["gateway_p50"] - out["ttft_cached_ms"]["direct_p50"]
    out["targets"] = {k: {"target": v, "measured": round(out[k], 4), "met": out[k] <= v} for k, v in TARGETS.items()}
    return out


def run(worker: str, url: str, requests: int = 200, streams: int = 30, stream_tokens: int = 64, ttft_pairs: int = 300,
        warmup: int = 5) -> dict:
    """-> the figures of the standard-library client at the top level, httpx2's under "httpx2"."""
    direct, sdk = Direct(worker), ThroughGateway(url)
    lean = ThroughGatewayStdlib(url, sdk.model)
    clients = [direct, lean, sdk]
    for _ in range(warmup):  # connections, the prefix cache, the first-call paths
        for c in clients:
            c.request(), c.stream(4)
    req = _series(requests, [lambda i, c=c: c.request() for c in clients], "requests")
    st = _series(streams, [lambda i, c=c, k=k: c.stream(stream_tokens, fresh_prompt(i, k))
                           for c, k in zip(clients, "dhx")], "streams")
    ttft = _series(ttft_pairs, [lambda i, c=c, k=k: c.stream(2, fresh_prompt(streams + i, k))[0]
                                for c, k in zip(clients, "dhx")], "first tokens")
    cached = _series(requests, [lambda i, c=c: c.stream(2)[0] for c in clients], "cached first tokens")
    out = {"requests": requests, "streams": streams, "stream_tokens": stream_tokens, "ttft_pairs": ttft_pairs,
           "client": "http.client"}
    figures = [_figures(req[0], req[k], st[0], st[k], ttft[0], ttft[k], cached[0], cached[k]) for k in (1, 2)]
    out.update(figures[0])
    out["httpx2"] = figures[1]
    direct.channel.close()
    lean.close()
    sdk.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default="", help="a running worker HOST:PORT (\"\" = start one, and a gateway)")
    ap.add_argument("--gateway", default="", help="a running gateway URL in front of --worker")
    ap.add_argument("--model", default="", help="the started worker's --model (\"\" = the default model)")
    ap.add_argument("--requests", type=int, default=200, help="request triples (direct, http.client, httpx2)")
    ap.add_argument("--streams", type=int, default=30, help="stream triples")
    ap.add_argument("--ttft-pairs", type=int, default=300,
                    help="triples of 2-token streams of new prompts (TTFT; a ratio of medians wants many)")
    ap.add_argument("--stream-tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--json", default="", help="write the results here (default bench/results/gateway-<cpu>.json)")
    args = ap.parse_args(argv)
    if bool(args.worker) != bool(args.gateway):
        ap.error("--worker and --gateway go together (or neither: both are started)")
    load_start = os.getloadavg()
    procs: list[subprocess.Popen] = []
    worker, url = args.worker, args.gateway
    if not worker:
        procs, worker, url = start_processes(args.model)
    try:
        result = run(worker, url, args.requests, args.streams, args.stream_tokens, args.ttft_pairs)
    finally:
        stop_processes(procs)
    data = {"bench": "gateway", "command": " ".join(["python -m bench.gateway", *(argv if argv is not None else sys.argv[1:])]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(), "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(), "started": not args.worker, **result}
    path = Path(args.json) if args.json else Path(__file__).parent / "results" / f"gateway-{cpu_class()}.json"
    write_json(path, data)
    for label, r in (("http.client", result), ("httpx2", result["httpx2"])):
        print(f"{label}: request +{r['request_overhead_ms']:.2f} ms (direct {r['request_ms']['direct_p50']:.2f}, "
              f"paired {r['request_ms']['paired_diff_p50']:.2f}); stream +{r['stream_overhead_ms_per_token']:.3f} "
              f"ms/token; TTFT {r['ttft_ms']['direct_p50']:.1f} -> {r['ttft_ms']['gateway_p50']:.1f} ms = "
              f"{r['ttft_ratio']:.3f}x (paired +{r['ttft_ms']['paired_diff_p50']:.2f} ms); cached first token "
              f"+{r['ttft_cached_overhead_ms']:.2f} ms")
    print(f"load average {data['loadavg_start']} -> {data['loadavg_end']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
