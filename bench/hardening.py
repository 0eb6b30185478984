"""Hardening under load: health while a worker is flooded, and the largest Search the limits allow.

    flock -o /work/locks/bench.lock python -m bench.hardening                   # both, services started here
    python -m bench.hardening --only health --generates 100 --rounds 3
    python -m bench.hardening --only search --kb ~/.cache/ragserve/kb/docs-20k
    python -m bench.hardening --worker 127.0.0.1:50052 --worker-metrics http://127.0.0.1:9101/metrics   # running

The services start as a user starts them (tools.launcher.up: default flags, loopback, a Prometheus port each) and
everything goes over gRPC. Two sub-measurements, each over `--rounds` rounds:

    health    `--generates` streaming Generates sent at once to one worker (a HumanEval prompt each,
              `--new-tokens` greedy tokens, EOS ignored): the worker's queue refuses what does not fit with
              RESOURCE_EXHAUSTED. While the admitted ones decode, `--checks` grpc.health.v1 Checks, one every
              `--check-every-s`, each timed. The worker's /metrics is scraped before and after: the refusals it
              counts by code (grpc_server_handled_total) against the codes the clients got.
              Target (issue 79): 10/10 checks SERVING within 100 ms; refusals counted in metrics.
    search    on the retrieval service over a knowledge base, with the limits of its configuration
              (RetrievalConfig, `--retrieval-args` included): the largest Searches they allow (the most encoder
              work: texts at the character and encoder-token bounds, k at the results bound; the same with every
              passage's text; the most vector queries), one past the bounds, each timed alone; then the
              largest-work Search again while a 1-query text Search runs back to back beside it, against those
              1-query Searches alone. Target (issue 79): the largest Search finishes in <= 5 s or is refused up
              front; the concurrent 1-query Search stays under 100 ms p95.

Writes bench/results/hardening-<cpu class>.json (atomic, after every sub-measurement) with the machine, commit,
load average and the services' flags.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.serving import cpu_class, humaneval_requests, machine, write_json
from generation_service.client import GenerationClient
from proto import knowledge_pb2, knowledge_pb2_grpc
from ragcore.model_files import ragserve_home
from retrieval_service.config import RetrievalConfig
from tools import launcher

HEALTH_TARGET_MS = 100.0
HEALTH_CHECKS = 10
SEARCH_TARGET_S = 5.0
SMALL_SEARCH_P95_TARGET_MS = 100.0
# A refusal "up front" costs checks, not work: well under what one encoder step over a single text costs.
UP_FRONT_S = 0.5
# The encoder cuts every text at this many tokens (MiniLM's 256, including its two special tokens).
ENCODER_TOKENS = 256
STREAM_METHOD = ("ragserve.v1.GenerationService", "GenerateStream")
WORDS = ("parse json decoder heap queue bisect calendar fraction textwrap module function value string list object "
         "return index search socket thread lock buffer stream encode decode format number integer float iterator "
         "generator context manager exception raise import package class method attribute default keyword").split()


# ----------------------------------------------------------------------------------------------- metrics

def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def handled_by_code(samples: dict, service: str, method: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), v in samples.items():
        d = dict(labels)
        if name == "grpc_server_handled_total" and d.get("grpc_service") == service and d.get("grpc_method") == method:
            out[d["grpc_code"]] = out.get(d["grpc_code"], 0.0) + v
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {c: int(after.get(c, 0) - before.get(c, 0)) for c in sorted(set(after) | set(before))
            if after.get(c, 0) - before.get(c, 0)}


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# ------------------------------------------------------------------------------------------------ health

@dataclass
class Flood:
    """`n` streaming Generates released together; what each client got."""

    target: str
    n: int
    new_tokens: int
    timeout_s: float
    codes: list[str] = field(default_factory=list)
    refusals: dict[str, int] = field(default_factory=dict)  # RESOURCE_EXHAUSTED messages (their start) -> count
    tokens: int = 0
    running: int = 0  # streams started and not yet ended
    first_token: int = 0  # streams that got a token
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> list[threading.Thread]:
        prompts = [r["prompt"] for r in humaneval_requests(min(self.n, 164))]
        go = threading.Barrier(self.n + 1)
        threads = [threading.Thread(target=self._one, args=(prompts[i % len(prompts)], go), daemon=True)
                   for i in range(self.n)]
        for t in threads:
            t.start()
        go.wait()
        return threads

    def _one(self, prompt: str, go: threading.Barrier) -> None:
        with GenerationClient(self.target) as client:
            grpc.channel_ready_future(client.channel).result(timeout=30)  # connected before the release
            with self._lock:
                self.running += 1
            go.wait()
            got = False
            code, message = "OK", ""
            try:
                for msg in client.stream(prompt, max_new_tokens=self.new_tokens, ignore_eos=True,
                                         timeout=self.timeout_s):
                    with self._lock:
                        self.tokens += len(msg.token_ids)
                        if msg.token_ids and not got:
                            got = True
                            self.first_token += 1
            except grpc.RpcError as e:
                code, message = e.code().name, e.details() or ""
            with self._lock:
                self.running -= 1
                self.codes.append(code)
                if code == "RESOURCE_EXHAUSTED":
                    key = message.split(";")[0].split("(")[0].strip()[:80]
                    self.refusals[key] = self.refusals.get(key, 0) + 1

    def in_flight(self) -> int:
        with self._lock:
            return self.running


def health_round(target: str, metrics_url: str, args: argparse.Namespace) -> dict:
    """One flood of Generates with health checks beside it -> its figures."""
    before = handled_by_code(scrape(metrics_url), *STREAM_METHOD)
    flood = Flood(target, args.generates, args.new_tokens, args.timeout_s)
    checks: list[dict] = []
    with grpc.insecure_channel(target) as ch:  # an orchestrator's probe: its own connection
        checker = health_pb2_grpc.HealthStub(ch)
        checker.Check(health_pb2.HealthCheckRequest(), timeout=10)  # connected before the flood
        threads = flood.run()
        t0 = time.perf_counter()
        # The refusals come at once; the admitted streams are decoding once the first tokens arrive.
        while flood.first_token == 0 and time.perf_counter() - t0 < args.timeout_s:
            time.sleep(0.01)
        for i in range(args.checks):
            in_flight = flood.in_flight()
            t = time.perf_counter()
            try:
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(
                    checker.Check(health_pb2.HealthCheckRequest(), timeout=args.check_timeout_s).status)
            except grpc.RpcError as e:
                status = e.code().name
            checks.append({"ms": (time.perf_counter() - t) * 1e3, "status": status, "streams_in_flight": in_flight,
                           "at_s": t - t0})
            time.sleep(args.check_every_s)
        for th in threads:
            th.join(args.timeout_s + 30)
    # Handled counts are recorded as a call ends: the scrape after every client has its status sees them all.
    after = handled_by_code(scrape(metrics_url), *STREAM_METHOD)
    client_codes = {c: flood.codes.count(c) for c in sorted(set(flood.codes))}
    metric_codes = delta(after, before)
    ms = [c["ms"] for c in checks]
    serving_fast = sum(c["status"] == "SERVING" and c["ms"] <= HEALTH_TARGET_MS for c in checks)
    return {"generates": args.generates, "client_codes": client_codes, "metric_codes": metric_codes,
            "refusal_messages": flood.refusals, "tokens": flood.tokens, "checks": checks,
            "check_ms": {"p50": percentile(ms, 50), "max": max(ms) if ms else None},
            "checks_serving_within_target": serving_fast,
            "min_streams_in_flight_at_a_check": min((c["streams_in_flight"] for c in checks), default=0),
            "refusals_counted": metric_codes == client_codes and client_codes.get("RESOURCE_EXHAUSTED", 0) > 0}


def health_summary(rounds: list[dict]) -> dict:
    ms = [c["ms"] for r in rounds for c in r["checks"]]
    ok = all(r["checks_serving_within_target"] == len(r["checks"]) for r in rounds)
    return {"checks": len(ms), "check_ms_p50": percentile(ms, 50), "check_ms_p95": percentile(ms, 95),
            "check_ms_max": max(ms) if ms else None,
            "refused": sum(r["client_codes"].get("RESOURCE_EXHAUSTED", 0) for r in rounds),
            "targets": {"health_serving_within_100ms": ok,
                        "refusals_counted_in_metrics": all(r["refusals_counted"] for r in rounds)}}


# ------------------------------------------------------------------------------------------------ search

def texts(n: int, chars: int, seed: int) -> list[str]:
    """n distinct texts of exactly `chars` characters of words (no encoder cache has seen them)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = f"{seed}-{i} " + " ".join(rng.choice(WORDS, chars // 4))
        out.append(t[:chars])
    return out


def largest_searches(cfg: RetrievalConfig, dim: int, seed: int) -> dict[str, knowledge_pb2.SearchRequest]:
    """The largest Searches `cfg`'s limits allow, and one past them (by one text). Those
    asking for every hit's text or vector may need a reply over the message limit: refused before any work."""
    n = max(1, min(cfg.kb_limit_encode_tokens // ENCODER_TOKENS, cfg.limit_batch))
    chars = min(cfg.kb_limit_query_chars, cfg.kb_limit_search_chars // n)
    k = max(1, min(cfg.kb_limit_k, cfg.kb_limit_results // n))
    big = texts(n, chars, seed)
    nv = cfg.limit_batch
    kv = max(1, min(cfg.kb_limit_k, cfg.kb_limit_results // nv))
    vectors = np.random.default_rng(seed).standard_normal((nv, dim)).astype(np.float32)
    # One more text of the same length: past the character bound, and the token bound where texts reach the
    # encoder's length (how many tokens a text of `chars` has depends on its words, so it is not counted on).
    past = texts(n + 1, chars, seed + 1)
    return {
        "texts": knowledge_pb2.SearchRequest(retriever="edr", k=k, texts=big),
        "texts_with_text_and_vectors": knowledge_pb2.SearchRequest(retriever="edr", k=k, texts=big, with_text=True,
                                                                   with_vectors=True, with_query_vectors=True),
        "vectors": knowledge_pb2.SearchRequest(retriever="edr", k=kv, vectors=vectors.tobytes()),
        "vectors_with_text": knowledge_pb2.SearchRequest(retriever="edr", k=kv, vectors=vectors.tobytes(),
                                                         with_text=True),
        "one_text_past_the_bounds": knowledge_pb2.SearchRequest(retriever="edr", k=k, texts=past),
    }


def timed_search(stub, req: knowledge_pb2.SearchRequest, timeout_s: float) -> dict:
    t = time.perf_counter()
    try:
        reply = stub.Search(req, timeout=timeout_s)
        out = {"code": "OK", "encode_ms": reply.encode_ms, "search_ms": reply.search_ms,
               "reply_bytes": reply.ByteSize()}
    except grpc.RpcError as e:
        out = {"code": e.code().name, "details": (e.details() or "")[:200]}
    out["s"] = time.perf_counter() - t
    return out


def describe(req: knowledge_pb2.SearchRequest, dim: int) -> dict:
    queries = len(req.texts) or len(req.vectors) // 4 // dim
    return {"queries": queries, "k": req.k, "chars": sum(len(t) for t in req.texts), "with_text": req.with_text,
            "with_vectors": req.with_vectors, "text_queries": bool(req.texts)}


class SmallSearches:
    """1-query text Searches back to back on their own channel (each text new to the encoder cache)."""

    def __init__(self, target: str, seed: int, timeout_s: float):
        self.ms: list[float] = []
        self.codes: list[str] = []
        self._stop = threading.Event()
        self._target, self._seed, self._timeout = target, seed, timeout_s
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        rng = np.random.default_rng(self._seed)
        with grpc.insecure_channel(self._target) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
            i = 0
            while not self._stop.is_set():
                q = f"{self._seed}-{i} " + " ".join(rng.choice(WORDS, 8))
                t = time.perf_counter()
                try:
                    stub.Search(knowledge_pb2.SearchRequest(retriever="edr", k=5, texts=[q]), timeout=self._timeout)
                    self.codes.append("OK")
                except grpc.RpcError as e:
                    self.codes.append(e.code().name)
                self.ms.append((time.perf_counter() - t) * 1e3)
                i += 1

    def __enter__(self) -> "SmallSearches":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def search_round(target: str, cfg: RetrievalConfig, dim: int, args: argparse.Namespace, seed: int) -> dict:
    """Each largest Search alone, then the largest-work one beside 1-query Searches, then those alone."""
    out: dict = {"alone": {}}
    with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)
        for name, req in largest_searches(cfg, dim, seed).items():
            out["alone"][name] = {**describe(req, dim), **timed_search(stub, req, args.timeout_s)}
        with SmallSearches(target, seed + 100, args.timeout_s) as small:
            time.sleep(args.settle_s)
            n0 = len(small.ms)
            big = timed_search(stub, largest_searches(cfg, dim, seed + 1000)["texts"], args.timeout_s)
            n1 = len(small.ms)
    beside = small.ms[n0:n1 + 1]  # the ones answered while the large Search ran (and the one it ended inside)
    with SmallSearches(target, seed + 200, args.timeout_s) as solo:
        time.sleep(args.small_alone_s)
    out["beside"] = {"large": big, "small_ms": beside, "small_codes": small.codes[n0:n1 + 1],
                     "small_p50_ms": percentile(beside, 50), "small_p95_ms": percentile(beside, 95)}
    out["small_alone"] = {"n": len(solo.ms), "p50_ms": percentile(solo.ms, 50), "p95_ms": percentile(solo.ms, 95),
                          "codes": sorted(set(solo.codes))}
    return out


def search_ok(r: dict) -> bool:
    """Finished in time, or refused before doing the work."""
    return (r["code"] == "OK" and r["s"] <= SEARCH_TARGET_S) or (r["code"] != "OK" and r["s"] <= UP_FRONT_S)


def search_summary(rounds: list[dict]) -> dict:
    beside = [m for r in rounds for m in r["beside"]["small_ms"]]
    alone = {name: [r["alone"][name] for r in rounds] for name in rounds[0]["alone"]}
    largest = [r["beside"]["large"] for r in rounds] + alone["texts"]
    return {"alone": {name: {"codes": sorted({x["code"] for x in xs}), "s_median": statistics.median(x["s"] for x in xs),
                             "s_max": max(x["s"] for x in xs)} for name, xs in alone.items()},
            "largest_beside_small_s_max": max(x["s"] for x in largest),
            "small_beside_large": {"n": len(beside), "p50_ms": percentile(beside, 50),
                                   "p95_ms": percentile(beside, 95), "max_ms": max(beside) if beside else None},
            "small_alone_p95_ms_median": statistics.median(r["small_alone"]["p95_ms"] for r in rounds),
            "targets": {"largest_search_within_5s_or_refused_up_front":
                        all(search_ok(x) for xs in alone.values() for x in xs)
                        and all(search_ok(r["beside"]["large"]) for r in rounds),
                        "small_search_p95_under_100ms": bool(beside)
                        and percentile(beside, 95) < SMALL_SEARCH_P95_TARGET_MS}}


# -------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.hardening", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("health", "search"), default="", help="one sub-measurement (default both)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each sub-measurement (default 3)")
    ap.add_argument("--generates", type=int, default=100, help="streaming Generates sent at once (default 100)")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens per Generate (default 64)")
    ap.add_argument("--checks", type=int, default=HEALTH_CHECKS, help="health checks per round (default 10)")
    ap.add_argument("--check-every-s", type=float, default=0.2, help="seconds between health checks (default 0.2)")
    ap.add_argument("--check-timeout-s", type=float, default=5.0, help="deadline of a health check (default 5)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="deadline of every Generate / Search (default 300)")
    ap.add_argument("--settle-s", type=float, default=0.5,
                    help="the 1-query Searches run this long before the large one starts (default 0.5)")
    ap.add_argument("--small-alone-s", type=float, default=3.0,
                    help="seconds of 1-query Searches alone per round (default 3)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "stdlib"),
                    help="datastore of the retrieval service the worker drafts from (default: stdlib)")
    ap.add_argument("--kb", default=str(ragserve_home() / "kb" / "docs-8k"),
                    help="knowledge base the retrieval service serves for the search part (default: docs-8k)")
    ap.add_argument("--retrieval-args", default="", help="extra flags for the retrieval service (default: none)")
    ap.add_argument("--worker-args", default="", help="extra flags for the generation worker (default: none)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0,
                    help="how long the services may take to report SERVING (a worker's first start calibrates)")
    ap.add_argument("--worker", default="", help="measure a worker already running here (host:port)")
    ap.add_argument("--worker-metrics", default="", help="its /metrics URL (with --worker)")
    ap.add_argument("--retrieval", default="",
                    help="measure a retrieval service already running here (host:port; its limits are read from "
                         "--retrieval-args)")
    ap.add_argument("--json", default="", help="write here (atomic); default bench/results/hardening-<cpu class>.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.generates < 1 or args.checks < 1 or args.new_tokens < 1:
        ap.error("--rounds, --generates, --checks and --new-tokens must be >= 1")
    if bool(args.worker) != bool(args.worker_metrics):
        ap.error("--worker and --worker-metrics go together")
    if args.only != "search" and not args.worker and not (Path(args.datastore) / "datastore.json").exists():
        ap.error(f"--datastore {args.datastore} is not built (make datastore)")
    if args.only != "health" and not args.retrieval and not (Path(args.kb) / "kb.json").exists():
        ap.error(f"--kb {args.kb} is not built (make kb)")
    return args


@contextmanager
def launched(running: str, **up) -> Iterator[launcher.Topology | None]:
    """The services `up` describes (tools.launcher.up's arguments), started as a user starts them and stopped at
    the end; None when `running` names one already running to measure instead."""
    if running:
        yield None
        return
    state = Path(tempfile.mkdtemp(prefix="bench-hardening-")) / "launcher.json"
    topo = launcher.up(state=state, **up)
    try:
        yield topo
    finally:
        launcher.down(state=state)


def run_health(args: argparse.Namespace, result: dict, save) -> None:
    with launched(args.worker, datastore=args.datastore, metrics=True, timeout_s=args.start_timeout_s,
                  extra_generation=shlex.split(args.worker_args)) as topo:
        target = args.worker or topo.get("generation").address
        metrics_url = args.worker_metrics or f"http://127.0.0.1:{topo.get('generation').metrics_port}/metrics"
        with GenerationClient(target) as client:  # kernels loaded and pages touched before anything is timed
            list(client.stream(humaneval_requests(1)[0]["prompt"], max_new_tokens=8, timeout=args.timeout_s))
        result["health"] = {"worker_args": args.worker_args, "rounds": []}
        for _ in range(args.rounds):
            result["health"]["rounds"].append(health_round(target, metrics_url, args))
            result["health"]["summary"] = health_summary(result["health"]["rounds"])
            save()


def run_search(args: argparse.Namespace, result: dict, save) -> None:
    cfg = RetrievalConfig.from_args(shlex.split(args.retrieval_args))
    with launched(args.retrieval, kb=args.kb, generation=False, timeout_s=args.start_timeout_s,
                  extra_retrieval=shlex.split(args.retrieval_args)) as topo:
        target = args.retrieval or topo.get("retrieval").address
        with grpc.insecure_channel(target) as ch:
            info = knowledge_pb2_grpc.KnowledgeServiceStub(ch).Info(knowledge_pb2.KnowledgeInfoRequest(), timeout=30)
        dim = next(i.dim for i in info.indexes if i.name in ("", "kb"))
        limits = {k: getattr(cfg, k) for k in ("limit_batch", "kb_limit_k", "kb_limit_query_chars",
                                               "kb_limit_search_chars", "kb_limit_encode_tokens",
                                               "kb_limit_results", "max_message_bytes")}
        result["search"] = {"kb": args.kb if not args.retrieval else "", "passages": info.num_passages,
                            "retrieval_args": args.retrieval_args, "limits": limits, "rounds": []}
        for i in range(args.rounds):
            result["search"]["rounds"].append(search_round(target, cfg, dim, args, seed=1 + 10_000 * i))
            result["search"]["summary"] = search_summary(result["search"]["rounds"])
            save()


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path = Path(args.json) if args.json else Path(__file__).parent / "results" / f"hardening-{cpu_class()}.json"
    cmd = list(sys.argv[1:] if argv is None else argv)
    result: dict = {"command": " ".join(["python -m bench.hardening", *map(shlex.quote, cmd)]), "machine": machine(),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": os.getloadavg(),
                    "targets_of_the_issue": {"health_check_ms": HEALTH_TARGET_MS, "largest_search_s": SEARCH_TARGET_S,
                                             "small_search_p95_ms": SMALL_SEARCH_P95_TARGET_MS}}

    def save() -> None:
        result["loadavg_end"] = os.getloadavg()
        write_json(json_path, result)

    if args.only != "search":
        run_health(args, result, save)
        h = result["health"]["summary"]
        print(f"health: {args.generates} Generates at once, {h['checks']} checks: p50 {_f(h['check_ms_p50'])} ms, "
              f"max {_f(h['check_ms_max'])} ms; {h['refused']} refused; {h['targets']}")
        for r in result["health"]["rounds"]:
            print(f"  clients {r['client_codes']}  metrics {r['metric_codes']}  checks "
                  f"{[c['status'][:1] + _f(c['ms'], '.0f') for c in r['checks']]}")
    if args.only != "health":
        run_search(args, result, save)
        s = result["search"]["summary"]
        for name, a in s["alone"].items():
            print(f"search {name:<28} {a['codes']} median {a['s_median']:.2f} s, max {a['s_max']:.2f} s")
        b = s["small_beside_large"]
        print(f"1-query Search beside the largest: n {b['n']}, p50 {_f(b['p50_ms'])} ms, p95 {_f(b['p95_ms'])} ms "
              f"(alone p95 {_f(s['small_alone_p95_ms_median'])} ms); {s['targets']}")
    save()
    print(f"load average {result['loadavg_end'][0]:.2f}; wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
