"""Headless load test: start the services (launcher), run Locust with bounded users / spawn rate / duration,
write CSV + HTML reports, check the thresholds, write a JSON summary, stop the services.

    python -m loadtests.run --datastore ~/.cache/ragserve/datastores/stdlib                 # CI scale (make loadtest)
    python -m loadtests.run --datastore DS --users 16 --generation-users 2 --duration 300 --long \\
        --summary bench/results/load.json                                                  # README table
    python -m loadtests.run --retrieval HOST:PORT --generation HOST:PORT                   # services already up

Fails (exit 1) when the failure ratio exceeds max_failure_ratio or a p95 exceeds its bound
(loadtests/thresholds.toml). Reports: loadtests/reports/<name>_{stats,stats_history,failures,exceptions}.csv,
<name>.html, <name>.json (git-ignored).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

from tools import launcher

HERE = Path(__file__).resolve().parent
MAX_CI_SECONDS = 60


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    svc = ap.add_argument_group("services (started by the launcher unless --retrieval/--generation are given)")
    svc.add_argument("--datastore", default="", help="suffix-array datastore directory")
    svc.add_argument("--kb", default="", help="knowledge base directory (enables the Search task)")
    svc.add_argument("--model", default="",
                     help="local HF model directory for the worker and the prompts' tokenizer ('' = the default "
                          "model)")
    svc.add_argument("--dtype", default="", choices=["", "bf16", "fp32"],
                     help="worker dtype (default: its own choice, measured on this machine)")
    svc.add_argument("--replicas", type=int, default=1, help="retrieval replicas")
    svc.add_argument("--retrieval", default="", help="use this running retrieval service")
    svc.add_argument("--generation", default="", help="use this running generation worker")
    load = ap.add_argument_group("load")
    load.add_argument("--users", type=int, default=6, help="concurrent Locust users (1..256)")
    load.add_argument("--spawn-rate", type=float, default=3.0, help="users started per second")
    load.add_argument("--duration", type=int, default=30, help=f"seconds (<= {MAX_CI_SECONDS} unless --long)")
    load.add_argument("--long", action="store_true", help="allow durations above 60 s (local runs)")
    load.add_argument("--generation-users", type=int, default=1, help="of --users, how many call the worker")
    load.add_argument("--max-new-tokens", type=int, default=32,
                      help="tokens per Generate/GenerateStream request (default %(default)s)")
    load.add_argument("--decoding", default="rest",
                      help="decoding mode of the generation requests: ar | pld | rest-ds | rest | knnlm | crest "
                           "(default %(default)s)")
    load.add_argument("--search", choices=["auto", "on", "off"], default="auto",
                      help="Search task: auto = only if the retrieval service has a knowledge base; on = always "
                           "(its calls fail without one)")
    load.add_argument("--search-retriever", default="", help="edr | adr | sr ('' = adr, else sr, else edr)")
    load.add_argument("--think-time", type=float, default=0.1,
                      help="most seconds a user waits between tasks (uniform from 0; default %(default)s)")
    out = ap.add_argument_group("output")
    out.add_argument("--thresholds", default=str(HERE / "thresholds.toml"),
                     help="TOML of the pass bounds: max_failure_ratio, p95_ms, min_requests "
                          "(default loadtests/thresholds.toml)")
    out.add_argument("--reports", default=str(HERE / "reports"),
                     help="directory for the CSV, HTML and JSON reports (default loadtests/reports)")
    out.add_argument("--name", default="load", help="report file prefix")
    out.add_argument("--summary", default="", help="also write the JSON summary here (e.g. bench/results/load.json)")
    args = ap.parse_args(argv)
    if not 1 <= args.users <= 256:
        ap.error(f"--users {args.users} is outside [1, 256]")
    if not 0 <= args.generation_users <= args.users:
        ap.error(f"--generation-users {args.generation_users} is outside [0, --users]")
    if args.spawn_rate <= 0:
        ap.error("--spawn-rate must be > 0")
    if not 1 <= args.duration <= (3600 if args.long else MAX_CI_SECONDS):
        ap.error(f"--duration {args.duration} s is outside [1, {MAX_CI_SECONDS}] (pass --long for local runs)")
    if bool(args.retrieval) != bool(args.generation):
        ap.error("give both --retrieval and --generation, or neither")
    return args


def read_stats(path: Path) -> list[dict]:
    """Locust's <prefix>_stats.csv -> one dict per entry (the Aggregated row last)."""
    rows = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            n = int(r["Request Count"])
            pct = {k: float(r[f"{k}%"]) if r[f"{k}%"] not in ("N/A", "") else None for k in ("50", "95", "99")}
            rows.append({"name": r["Name"] if r["Type"] else "Aggregated", "requests": n,
                         "failures": int(r["Failure Count"]), "rps": round(float(r["Requests/s"]), 3),
                         "avg_ms": round(float(r["Average Response Time"]), 1),
                         "p50_ms": pct["50"], "p95_ms": pct["95"], "p99_ms": pct["99"],
                         "max_ms": round(float(r["Max Response Time"]), 1)})
    return rows


def check(rows: list[dict], thresholds: dict) -> list[str]:
    """Violations of the thresholds (empty = pass)."""
    problems = []
    total = next(r for r in rows if r["name"] == "Aggregated")
    ratio = total["failures"] / max(total["requests"], 1)
    if total["requests"] == 0:
        problems.append("no requests were made")
    if ratio > thresholds.get("max_failure_ratio", 0.0):
        problems.append(f"failure ratio {ratio:.4f} > {thresholds.get('max_failure_ratio', 0.0)} "
                        f"({total['failures']} of {total['requests']})")
    by_name = {r["name"]: r for r in rows}
    for name, bound in thresholds.get("p95_ms", {}).items():
        r = by_name.get(name)
        if r and r["requests"] and r["p95_ms"] is not None and r["p95_ms"] > bound:
            problems.append(f"{name}: p95 {r['p95_ms']:.0f} ms > {bound} ms")
    for name, least in thresholds.get("min_requests", {}).items():
        got = by_name.get(name, {}).get("requests", 0)
        if got < least:
            problems.append(f"{name}: {got} requests < {least} (task did not run)")
    return problems


def scrape(port: int) -> dict[str, float]:
    """Sum of each sample name (labels dropped) from a /metrics endpoint; {} if unreachable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def server_side(before: dict, after: dict, seconds: float) -> dict:
    """Generation figures over the run from the worker's metrics (mean accepted length, tokens/s, TTFT mean)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("ragserve_generation_accepted_length_count", 0.0)
    ttft_n = d.get("ragserve_generation_time_to_first_token_seconds_count", 0.0)
    return {
        "tokens_per_s": round(d.get("ragserve_generation_tokens_total", 0.0) / max(seconds, 1e-9), 2),
        "mean_accepted_length": round(d.get("ragserve_generation_accepted_length_sum", 0.0) / steps, 3) if steps else None,
        "draft_tokens_accepted": d.get("ragserve_generation_draft_tokens_accepted_total", 0.0),
        "draft_tokens_proposed": d.get("ragserve_generation_draft_tokens_proposed_total", 0.0),
        "degraded_steps": d.get("ragserve_generation_degraded_steps_total", 0.0),
        "ttft_mean_ms": round(1e3 * d.get("ragserve_generation_time_to_first_token_seconds_sum", 0.0) / ttft_n, 1)
        if ttft_n else None,
    }


def table(rows: list[dict]) -> str:
    lines = ["| RPC | requests | failures | RPS | p50 ms | p95 ms | p99 ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        lines.append(f"| {r['name']} | {r['requests']} | {r['failures']} | {r['rps']:.2f} | {f(r['p50_ms'])} | "
                     f"{f(r['p95_ms'])} | {f(r['p99_ms'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    thresholds = tomllib.loads(Path(args.thresholds).read_text())
    reports = Path(args.reports)
    reports.mkdir(parents=True, exist_ok=True)
    prefix = reports / args.name
    state = reports / "launcher.json"
    topo = None
    load_before = os.getloadavg()
    if not args.retrieval:
        print(f"starting services (datastore {args.datastore or 'none'}, {args.replicas} retrieval replica(s)) ...",
              flush=True)
        topo = launcher.up(datastore=args.datastore, kb=args.kb, model=args.model, dtype=args.dtype, state=state,
                           replicas=args.replicas, metrics=True)
        retrieval = ",".join(p.address for p in topo.retrieval())  # each Locust user picks one replica
        generation = topo.get("generation").address
    else:
        retrieval, generation = args.retrieval, args.generation
    try:
        gen_metrics = topo.get("generation").metrics_port if topo else 0
        before = scrape(gen_metrics) if gen_metrics else {}
        cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
               "-u", str(args.users), "-r", str(args.spawn_rate), "-t", f"{args.duration}s", "--stop-timeout", "120",
               "--csv", str(prefix), "--html", f"{prefix}.html", "--only-summary", "--loglevel", "WARNING",
               "--retrieval", retrieval, "--generation", generation, "--generation-users", str(args.generation_users),
               "--max-new-tokens", str(args.max_new_tokens), "--decoding", args.decoding, "--search", args.search,
               "--think-time", str(args.think_time), "--search-retriever", args.search_retriever]
        if args.model:
            cmd += ["--model-dir", args.model]
        print(f"locust: {args.users} users ({args.generation_users} generation), spawn {args.spawn_rate}/s, "
              f"{args.duration} s", flush=True)
        t0 = time.monotonic()
        run = subprocess.run(cmd, cwd=HERE.parent, timeout=args.duration + 600)
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
    summary = {
        "command": "python -m loadtests.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "users": args.users, "generation_users": args.generation_users, "spawn_rate": args.spawn_rate,
        "duration_s": args.duration, "max_new_tokens": args.max_new_tokens, "decoding": args.decoding,
        "dtype": args.dtype, "replicas": args.replicas, "datastore": args.datastore, "kb": args.kb,
        "think_time_s": args.think_time, "search_retriever": args.search_retriever or "auto",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "entries": rows, "server": server_side(before, after, elapsed) if after else {},
        "thresholds": thresholds, "passed": not problems, "violations": problems,
    }
    text = json.dumps(summary, indent=1)
    Path(f"{prefix}.json").write_text(text)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(text)
    print(table(rows))
    if summary["server"]:
        print("server:", json.dumps(summary["server"]))
    print(f"reports: {prefix}_stats.csv, {prefix}.html, {prefix}.json")
    if problems:
        print("LOAD TEST FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("load test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
