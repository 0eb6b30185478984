"""Headless HTTP load test of the OpenAI-compatible gateway: start retrieval + a worker + the gateway (launcher),
run loadtests/http_locustfile.py with bounded users / spawn rate / duration, check the thresholds, write a JSON
summary with TTFT and inter-token latency, stop the services.

    python -m loadtests.run_http --datastore ~/.cache/ragserve/datastores/stdlib          # make loadtest-http
    python -m loadtests.run_http --gateway http://127.0.0.1:8000 [--api-key K]            # a gateway already up

Fails (exit 1) when any request failed, an entry's p95 exceeds its bound or an entry never ran
(loadtests/thresholds_http.toml). Reports: loadtests/reports/<name>_stats.csv, <name>.html, <name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from bench.serving import cpu_class, machine
from loadtests.run import check, read_stats, scrape, server_side, table
from tools import launcher

HERE = Path(__file__).resolve().parent
MAX_SECONDS = 600


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.run_http", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    svc = ap.add_argument_group("services (started by the launcher unless --gateway is given)")
    svc.add_argument("--datastore", default="", help="suffix-array datastore directory")
    svc.add_argument("--model", default="", help="local HF model directory for the worker ('' = the default model)")
    svc.add_argument("--dtype", default="", help="worker dtype ('' = its own choice, measured on this machine)")
    svc.add_argument("--gateway", default="", help="use this running gateway (http://HOST:PORT) instead")
    svc.add_argument("--api-key", default="",
                     help="API key for --gateway; with services started here a fresh key is made and required")
    load = ap.add_argument_group("load")
    load.add_argument("--users", type=int, default=8, help="concurrent Locust users (1..64)")
    load.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second")
    load.add_argument("--duration", type=int, default=60, help=f"seconds of load (1..{MAX_SECONDS})")
    load.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default %(default)s)")
    load.add_argument("--stream-weight", type=int, default=3, help="streamed requests per plain one")
    load.add_argument("--think-time", type=float, default=0.1, help="max seconds a user waits between requests")
    out = ap.add_argument_group("output")
    out.add_argument("--thresholds", default=str(HERE / "thresholds_http.toml"),
                     help="TOML of the pass bounds (default loadtests/thresholds_http.toml)")
    out.add_argument("--reports", default=str(HERE / "reports"), help="directory of the reports")
    out.add_argument("--name", default="load-http", help="report file prefix")
    out.add_argument("--summary", default="",
                     help="also write the JSON summary here ('auto' = bench/results/loadtest-http-<cpuclass>.json)")
    args = ap.parse_args(argv)
    if not 1 <= args.users <= 64:
        ap.error(f"--users {args.users} is outside [1, 64]")
    if args.spawn_rate <= 0:
        ap.error("--spawn-rate must be > 0")
    if not 1 <= args.duration <= MAX_SECONDS:
        ap.error(f"--duration {args.duration} s is outside [1, {MAX_SECONDS}]")
    if args.gateway and not args.gateway.startswith(("http://127.", "http://localhost")):
        ap.error("--gateway must be on this machine's loopback (http://127.0.0.1:PORT)")
    return args


def latency_figures(rows: list[dict]) -> dict:
    """TTFT and inter-token latency percentiles from the stats rows (ms)."""
    by_name = {r["name"]: r for r in rows}
    out = {}
    for key, name in (("ttft", "chat stream TTFT"), ("itl", "chat stream ITL"), ("stream", "chat stream"),
                      ("chat", "chat")):
        r = by_name.get(name)
        if r and r["requests"]:
            out[key] = {"n": r["requests"], "p50_ms": r["p50_ms"], "p95_ms": r["p95_ms"], "p99_ms": r["p99_ms"],
                        "avg_ms": r["avg_ms"]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    thresholds = tomllib.loads(Path(args.thresholds).read_text())
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    prefix = reports / args.name
    state = reports / "launcher-http.json"
    topo = None
    api_key = args.api_key
    load_before = os.getloadavg()
    if not args.gateway:
        api_key = "sk-load-" + secrets.token_hex(12)  # the gateway runs with keys required, as it would deployed
        print(f"starting retrieval + worker + gateway (datastore {args.datastore or 'none'}) ...", flush=True)
        topo = launcher.up(datastore=args.datastore, model=args.model, dtype=args.dtype, state=state, metrics=True,
                           gateway=True, env={"RAGSERVE_GATEWAY_API_KEYS": api_key})
        gateway = f"http://{topo.get('gateway').address}"
    else:
        gateway = args.gateway
    run = None
    try:
        gen_metrics = topo.get("generation").metrics_port if topo else 0
        before = scrape(gen_metrics) if gen_metrics else {}
        cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "http_locustfile.py"), "--headless",
               "-u", str(args.users), "-r", str(args.spawn_rate), "-t", f"{args.duration}s", "--stop-timeout", "120",
               "--csv", str(prefix), "--html", f"{prefix}.html", "--only-summary", "--loglevel", "WARNING",
               "--host", gateway, "--max-tokens", str(args.max_tokens), "--stream-weight", str(args.stream_weight),
               "--think-time", str(args.think_time)]
        env = dict(os.environ)
        if api_key:
            cmd += ["--api-key", api_key]
        print(f"locust: {args.users} users against {gateway}, spawn {args.spawn_rate}/s, {args.duration} s",
              flush=True)
        t0 = time.monotonic()
        run = subprocess.run(cmd, cwd=HERE.parent, timeout=args.duration + 600, env=env)
        elapsed = time.monotonic() - t0
        after = scrape(gen_metrics) if gen_metrics else {}
    finally:
        if topo is not None:
            print("stopping services ...", flush=True)
            launcher.down(state=state)
    rows = read_stats(Path(f"{prefix}_stats.csv"))
    problems = check(rows, thresholds)
    if run.returncode not in (0, 1):  # 1 = Locust saw failures (checked above)
        problems.append(f"locust exited with code {run.returncode}")
    shown_argv = argv if argv is not None else sys.argv[1:]
    summary = {
        "command": "python -m loadtests.run_http " + " ".join(a if a != api_key else "<key>" for a in shown_argv),
        "users": args.users, "spawn_rate": args.spawn_rate, "duration_s": args.duration,
        "max_tokens": args.max_tokens, "stream_weight": args.stream_weight, "think_time_s": args.think_time,
        "dtype": args.dtype or "auto", "datastore": args.datastore,
        "machine": {**machine(), "cpu_class": cpu_class(), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "latency": latency_figures(rows), "entries": rows,
        "server": server_side(before, after, elapsed) if after else {},
        "thresholds": thresholds, "passed": not problems, "violations": problems,
    }
    text = json.dumps(summary, indent=1)
    Path(f"{prefix}.json").write_text(text)
    if args.summary:
        path = Path(args.summary if args.summary != "auto"
                    else HERE.parent / "bench" / "results" / f"loadtest-http-{cpu_class()}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"summary: {path}")
    print(table(rows))
    lat = summary["latency"]
    if "ttft" in lat:
        print(f"TTFT p50 {lat['ttft']['p50_ms']} ms, p95 {lat['ttft']['p95_ms']} ms; inter-token p50 "
              f"{lat.get('itl', {}).get('p50_ms')} ms, p95 {lat.get('itl', {}).get('p95_ms')} ms")
    print(f"reports: {prefix}_stats.csv, {prefix}.html, {prefix}.json")
    if problems:
        print("LOAD TEST FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("load test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
