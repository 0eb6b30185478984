"""Gateway overhead: the same requests straight to the worker's gRPC API and through the HTTP gateway, interleaved.

    flock /work/locks/bench.lock python -m bench.gateway              # worker + gateway started as processes
    python -m bench.gateway --worker 127.0.0.1:50052 --gateway http://127.0.0.1:8000 --requests 20

Four measurements, each a series of pairs (direct, gateway) whose order alternates pair by pair, so machine
noise hits both alike:
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
The gateway is the real HTTP path (uvicorn + Starlette + SSE, JSON both ways); the client is a plain keep-alive
HTTP client, as an SDK is. Writes bench/results/gateway-<cpu class>.json (machine, flags, load average, commit).
"""

from __future__ import annotations

import argparse
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


class ThroughGateway:
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
        first, n = None, 0
        body = {"model": self.model, "prompt": prompt, "max_tokens": tokens, "stream": True,
                "stream_options": {"include_usage": True}, "ragserve": {"ignore_eos": True}}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                    first = time.perf_counter()
                if chunk.get("usage"):
                    n = chunk["usage"]["completion_tokens"]
        end = time.perf_counter()
        return (first - t) * 1e3, (end - t) * 1e3, n


def _pairs(n: int, direct, gateway, desc: str) -> tuple[list, list]:
    d, g = [], []
    for i in tqdm(range(n), desc=desc, leave=False):
        if i % 2:
            g.append(gateway(i))
            d.append(direct(i))
        else:
            d.append(direct(i))
            g.append(gateway(i))
    return d, g


def run(worker: str, url: str, requests: int = 200, streams: int = 30, stream_tokens: int = 64, ttft_pairs: int = 100,
        warmup: int = 5) -> dict:
    direct, gw = Direct(worker), ThroughGateway(url)
    for _ in range(warmup):  # connections, the prefix cache, the first-call paths
        direct.request(), gw.request(), direct.stream(4), gw.stream(4)
    d_req, g_req = _pairs(requests, lambda i: direct.request(), lambda i: gw.request(), "requests")
    d_st, g_st = _pairs(streams, lambda i: direct.stream(stream_tokens, fresh_prompt(i, "d")),
                        lambda i: gw.stream(stream_tokens, fresh_prompt(i, "g")), "streams")
    d_t, g_t = _pairs(ttft_pairs, lambda i: direct.stream(2, fresh_prompt(streams + i, "d"))[0],
                      lambda i: gw.stream(2, fresh_prompt(streams + i, "g"))[0], "first tokens")
    d_c, g_c = _pairs(requests, lambda i: direct.stream(2)[0], lambda i: gw.stream(2)[0], "cached first tokens")
    med = statistics.median
    tokens = med([s[2] for s in d_st])
    out = {
        "requests": requests, "streams": streams, "stream_tokens": stream_tokens, "ttft_pairs": ttft_pairs,
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
    direct.channel.close()
    gw.http.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", default="", help="a running worker HOST:PORT (\"\" = start one, and a gateway)")
    ap.add_argument("--gateway", default="", help="a running gateway URL in front of --worker")
    ap.add_argument("--model", default="", help="the started worker's --model (\"\" = the default model)")
    ap.add_argument("--requests", type=int, default=200, help="request pairs (direct, gateway)")
    ap.add_argument("--streams", type=int, default=30, help="stream pairs")
    ap.add_argument("--ttft-pairs", type=int, default=100, help="pairs of 2-token streams of new prompts (TTFT)")
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
    r = result
    print(f"request: direct {r['request_ms']['direct_p50']:.2f} ms, gateway {r['request_ms']['gateway_p50']:.2f} ms "
          f"-> +{r['request_overhead_ms']:.2f} ms (paired {r['request_ms']['paired_diff_p50']:.2f})")
    print(f"stream of {r['stream_ms']['tokens_direct']:.0f} tokens: direct {r['stream_ms']['direct_p50']:.1f} ms, "
          f"gateway {r['stream_ms']['gateway_p50']:.1f} ms -> +{r['stream_overhead_ms_per_token']:.3f} ms/token")
    print(f"TTFT: direct {r['ttft_ms']['direct_p50']:.1f} ms, gateway {r['ttft_ms']['gateway_p50']:.1f} ms "
          f"-> {r['ttft_ratio']:.3f}x")
    print(f"first token of a cached prompt: direct {r['ttft_cached_ms']['direct_p50']:.1f} ms, gateway "
          f"{r['ttft_cached_ms']['gateway_p50']:.1f} ms -> +{r['ttft_cached_overhead_ms']:.2f} ms")
    print(f"load average {data['loadavg_start']} -> {data['loadavg_end']}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
