"""Soak test: a bounded mixed load on loopback, then errors by code, memory drift, latency drift and whether
greedy outputs stayed identical.

    python -m loadtests.soak                     # 10 minutes, 6 clients (make soak)
    python -m loadtests.soak --minutes 3         # shorter
    python -m loadtests.soak --generation HOST:PORT --retrieval HOST:PORT --pids 123,456   # services already up

The services start as a user starts them (tools.launcher.up, default flags, 127.0.0.1 only) unless running ones
are given (loopback addresses only: this load goes nowhere else). Each client runs a fixed cycle of calls:
greedy Generate (ar and rest, the same prompts again and again), a seeded sampling stream, Draft and health
checks on the retrieval service, health on the worker, and three calls that must fail a known way (a bad field:
INVALID_ARGUMENT; a stream the client cancels: CANCELLED; a deadline too short to finish: DEADLINE_EXCEEDED or, on a
fast machine, OK). Any other failure is unexpected.

Reported: calls and errors by kind and code (expected / unexpected); the services' RSS every `--sample-s` seconds,
its drift = last sample against the first after the warm-up (the first fifth of the run), in %; latency drift =
median greedy-Generate latency of the last fifth against the first fifth after the warm-up; identical greedy
outputs = replies equal to the first reply of the same prompt (ar and rest alike: speculation is lossless).
Exit 1 when anything is unexpected, RSS grows more than --max-rss-drift-pct or a greedy output differed. JSON:
loadtests/reports/soak.json (atomic, at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

from bench.serving import humaneval_requests, machine, mtbench_requests
from generation_service.client import GenerationClient
from proto import draft_pb2, draft_pb2_grpc
from ragcore.model_files import ragserve_home
from ragcore.wire import pack_tokens
from tools import launcher

HERE = Path(__file__).resolve().parent
# One client's cycle of calls; every client runs it from its own offset.
CYCLE = ("ar", "rest", "draft", "health", "stream", "ar", "rest", "draft", "health", "bad", "cancel", "deadline")
EXPECTED = {"bad": {"INVALID_ARGUMENT"}, "cancel": {"CANCELLED"}, "deadline": {"DEADLINE_EXCEEDED", "OK"}}
LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
DRAFT_CONTEXT = [1, 476, 28, 2045, 314, 1, 28, 411]  # a few token ids; any context is a valid Draft


class Soak:
    """The shared state of one run: the clock, the prompts, the calls' records, the reference outputs."""

    def __init__(self, generation: str, retrieval: str, minutes: float, max_new: int, prompts: int):
        self.generation, self.retrieval = generation, retrieval
        self.t0 = time.monotonic()
        self.end = self.t0 + minutes * 60
        self.max_new = max_new
        self.prompts = [{"prompt": r["prompt"] + "    "} for r in humaneval_requests(prompts)] + mtbench_requests(
            prompts)
        self.lock = threading.Lock()
        self.calls: Counter[tuple[str, str]] = Counter()  # (kind, code) -> calls
        self.latency: list[tuple[float, float]] = []  # (seconds into the run, greedy Generate seconds)
        self.reference: dict[int, list[int]] = {}  # prompt index -> the first greedy reply's tokens
        self.greedy = Counter()  # identical / different

    def record(self, kind: str, code: str) -> None:
        with self.lock:
            self.calls[(kind, code)] += 1

    def greedy_reply(self, i: int, tokens: list[int], seconds: float) -> None:
        with self.lock:
            self.latency.append((time.monotonic() - self.t0, seconds))
            want = self.reference.setdefault(i, tokens)
            self.greedy["identical" if tokens == want else "different"] += 1

    def client(self, cid: int) -> None:
        gen_health = health_pb2_grpc.HealthStub
        with GenerationClient(self.generation) as gen, grpc.insecure_channel(self.retrieval) as rch:
            draft = draft_pb2_grpc.DraftServiceStub(rch)
            rhealth, ghealth = gen_health(rch), gen_health(gen.channel)
            step = cid
            while time.monotonic() < self.end:
                kind = CYCLE[step % len(CYCLE)]
                i = (step // len(CYCLE) + cid) % len(self.prompts)
                step += 1
                try:
                    self.one(kind, i, gen, draft, rhealth, ghealth)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                    if code not in EXPECTED.get(kind, ()):
                        time.sleep(0.2)  # a failing server is not hammered
                self.record(kind, code)

    def one(self, kind: str, i: int, gen: GenerationClient, draft, rhealth, ghealth) -> None:
        prompt = self.prompts[i]
        if kind in ("ar", "rest"):
            t = time.perf_counter()
            reply = gen.generate(**prompt, max_new_tokens=self.max_new, decoding=kind, ignore_eos=True, timeout=300)
            self.greedy_reply(i, list(reply.token_ids), time.perf_counter() - t)
        elif kind == "stream":
            for _ in gen.stream(**prompt, max_new_tokens=self.max_new, temperature=0.8, top_p=0.9, seed=i,
                                timeout=300):
                pass
        elif kind == "draft":
            draft.Draft(draft_pb2.DraftRequest(context=pack_tokens(DRAFT_CONTEXT)), timeout=30)
        elif kind == "health":
            for stub in (rhealth, ghealth):
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                if status != health_pb2.HealthCheckResponse.SERVING:
                    raise _Status(grpc.StatusCode.UNAVAILABLE)
        elif kind == "bad":
            gen.generate(**prompt, max_new_tokens=self.max_new, decoding="medusa", timeout=30)
        elif kind == "cancel":
            stream = gen.stream(**prompt, max_new_tokens=self.max_new, decoding="ar", timeout=300)
            next(stream)
            stream.cancel()
            for _ in stream:
                pass
        elif kind == "deadline":
            gen.generate(**prompt, max_new_tokens=512, decoding="ar", ignore_eos=True, timeout=0.3)


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def rss_mb(pids: list[int]) -> float:
    return sum(psutil.Process(p).memory_info().rss for p in pids) / 2**20


def drift_pct(first: float | None, last: float | None) -> float | None:
    return (last - first) / first * 100 if first and last is not None else None


def summarize(soak: Soak, rss: list[tuple[float, float]], seconds: float, max_rss_drift_pct: float) -> dict:
    """The run's figures and verdict (pure: from the records)."""
    warm = seconds / 5
    after = [mb for t, mb in rss if t >= warm]
    lat = sorted(soak.latency)
    first = [s for t, s in lat if warm <= t < 2 * warm]
    last = [s for t, s in lat if t >= seconds - warm]
    p50_first = float(np.median(first)) if first else None
    p50_last = float(np.median(last)) if last else None
    by_code: dict[str, dict[str, int]] = {}
    unexpected = 0
    for (kind, code), n in sorted(soak.calls.items()):
        by_code.setdefault(kind, {})[code] = n
        if code != "OK" and code not in EXPECTED.get(kind, ()):
            unexpected += n
    rss_drift = drift_pct(after[0] if after else None, after[-1] if after else None)
    result = {"seconds": round(seconds, 1), "calls": sum(soak.calls.values()), "by_kind": by_code,
              "unexpected_errors": unexpected, "rss_mb": [[round(t, 1), round(mb, 1)] for t, mb in rss],
              "rss_drift_pct": rss_drift, "greedy_latency_p50_s": {"first": p50_first, "last": p50_last},
              "latency_drift_pct": drift_pct(p50_first, p50_last), "greedy_outputs": dict(soak.greedy)}
    result["ok"] = bool(unexpected == 0 and soak.greedy.get("different", 0) == 0 and soak.greedy.get("identical")
                        and (rss_drift is None or rss_drift <= max_rss_drift_pct))  # growth fails; memory given back does not
    return result


def run(generation: str, retrieval: str, pids: list[int], args: argparse.Namespace) -> dict:
    soak = Soak(generation, retrieval, args.minutes, args.max_new_tokens, args.prompts)
    threads = [threading.Thread(target=soak.client, args=(c,), daemon=True) for c in range(args.clients)]
    for t in threads:
        t.start()
    rss: list[tuple[float, float]] = []
    total = args.minutes * 60
    with tqdm(total=int(total), unit="s", desc="soak") as bar:
        while time.monotonic() < soak.end:
            rss.append((time.monotonic() - soak.t0, rss_mb(pids)))
            time.sleep(min(args.sample_s, max(0.0, soak.end - time.monotonic())))
            bar.n = min(int(time.monotonic() - soak.t0), int(total))
            bar.set_postfix(calls=sum(soak.calls.values()), refresh=False)
            bar.refresh()
    for t in threads:
        t.join(timeout=330)
    rss.append((time.monotonic() - soak.t0, rss_mb(pids)))
    return summarize(soak, rss, time.monotonic() - soak.t0, args.max_rss_drift_pct)


def print_report(r: dict) -> None:
    print(f"\nsoak: {r['calls']} calls in {r['seconds']:.0f} s")
    for kind, codes in r["by_kind"].items():
        print(f"  {kind:<9} " + ", ".join(f"{code} {n}" for code, n in codes.items()))
    lat = r["greedy_latency_p50_s"]
    fmt = lambda x, unit="": "-" if x is None else f"{x:.3g}{unit}"  # noqa: E731
    print(f"unexpected errors: {r['unexpected_errors']}; RSS drift {fmt(r['rss_drift_pct'], ' %')} "
          f"({r['rss_mb'][0][1] if r['rss_mb'] else '-'} -> {r['rss_mb'][-1][1] if r['rss_mb'] else '-'} MB); "
          f"greedy Generate p50 {fmt(lat['first'], ' s')} -> {fmt(lat['last'], ' s')} "
          f"(drift {fmt(r['latency_drift_pct'], ' %')}); greedy outputs {r['greedy_outputs']}")
    print("PASS" if r["ok"] else "FAIL")


def loopback(target: str) -> bool:
    return target.rsplit(":", 1)[0] in LOOPBACK


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the run (default 10)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per generation (default 32)")
    ap.add_argument("--prompts", type=int, default=6, help="prompts of each kind (code, chat) cycled (default 6)")
    ap.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples (default 10)")
    ap.add_argument("--max-rss-drift-pct", type=float, default=5.0, help="RSS growth in %% that fails the run (default 5; a drop never fails it)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "stdlib"),
                    help="datastore the retrieval service serves (default: the stdlib datastore)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0,
                    help="how long the services may take to report SERVING (a first start calibrates; default 900)")
    ap.add_argument("--generation", default="", help="a running worker on loopback (host:port) instead of starting")
    ap.add_argument("--retrieval", default="", help="a running retrieval service on loopback (with --generation)")
    ap.add_argument("--pids", default="", help="with --generation: the services' process ids whose RSS is sampled "
                                               "(default: this process)")
    ap.add_argument("--json", default=str(HERE / "reports" / "soak.json"), help="where the JSON report goes")
    args = ap.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.minutes > 120:
        ap.error("--minutes must be in (0, 120] and --clients >= 1")
    if bool(args.generation) != bool(args.retrieval):
        ap.error("--generation and --retrieval go together")
    for t in (args.generation, args.retrieval):
        if t and not loopback(t):
            ap.error(f"{t}: the soak sends traffic to loopback addresses only")
    if not args.generation and not (Path(args.datastore) / "datastore.json").exists():
        ap.error(f"--datastore {args.datastore} is not built (make datastore)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = {"command": "python -m loadtests.soak " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": machine(), "loadavg_start": os.getloadavg(), "minutes": args.minutes,
               "clients": args.clients}
    if args.generation:
        pids = [int(p) for p in args.pids.split(",") if p.strip()] or [os.getpid()]
        result = run(args.generation, args.retrieval, pids, args)
    else:
        state = Path(tempfile.mkdtemp(prefix="soak-")) / "launcher.json"
        topo = launcher.up(datastore=args.datastore, state=state, timeout_s=args.start_timeout_s)
        try:
            pids = [p.pid for p in topo.procs]
            result = run(topo.get("generation").address, topo.get("retrieval").address, pids, args)
        finally:
            launcher.down(state=state)
    result = {**started, **result, "loadavg_end": os.getloadavg()}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out)
    print_report(result)
    print(f"wrote {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
