"""The Locust HTTP user (loadtests/http_locustfile.py) for a few seconds against the gateway in front of a real
worker: streamed and plain chat, TTFT and inter-token latency as their own entries, no failure; and what the
runner (loadtests/run_http.py) makes of a stats table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.run import check, read_stats
from loadtests.run_http import latency_figures, parse_args
from tests.gateway_api.conftest import start_gateway

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.model
@pytest.mark.slow
def test_locust_http_user_drives_the_gateway(gateway, tmp_path):
    prefix = tmp_path / "smoke"
    run = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "http_locustfile.py"), "--headless",
         "-u", "2", "-r", "2", "-t", "10s", "--stop-timeout", "60", "--csv", str(prefix), "--only-summary",
         "--loglevel", "WARNING", "--host", gateway.url, "--max-tokens", "6",
         "--stream-weight", "1", "--think-time", "0.01"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = read_stats(Path(f"{prefix}_stats.csv"))
    by_name = {r["name"]: r for r in rows}
    assert by_name["Aggregated"]["failures"] == 0
    assert by_name["chat stream"]["requests"] >= 1 and by_name["chat stream TTFT"]["requests"] >= 1
    assert 1 <= by_name["chat stream ITL"]["requests"] <= by_name["chat stream"]["requests"]  # one per stream
    assert by_name["chat"]["requests"] >= 1  # the plain (unstreamed) task ran too
    assert by_name["chat stream TTFT"]["p50_ms"] <= by_name["chat stream"]["p50_ms"]  # first token before the end
    lat = latency_figures(rows)
    assert {"ttft", "itl", "stream"} <= set(lat) and lat["ttft"]["p95_ms"] > 0


@pytest.mark.model
def test_a_wrong_key_fails_the_run(worker, tmp_path):
    """Not a silent pass: every request refused (401) shows up as failures."""
    prefix = tmp_path / "refused"
    keyed = start_gateway(worker.address, api_keys="sk-right")
    try:
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "http_locustfile.py"), "--headless",
             "-u", "1", "-r", "1", "-t", "4s", "--csv", str(prefix), "--only-summary", "--loglevel", "ERROR",
             "--host", keyed.url, "--api-key", "sk-wrong", "--model", "any", "--think-time", "0.01"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        keyed.stop()
    rows = read_stats(Path(f"{prefix}_stats.csv"))
    total = next(r for r in rows if r["name"] == "Aggregated")
    assert run.returncode == 1 and total["requests"] > 0 and total["failures"] == total["requests"]
    assert check(rows, {"max_failure_ratio": 0.0})  # the runner would fail it


def _row(name: str, n: int, p50: float, p95: float) -> dict:
    return {"name": name, "requests": n, "failures": 0, "rps": 1.0, "avg_ms": p50, "p50_ms": p50, "p95_ms": p95,
            "p99_ms": p95, "max_ms": p95}


def test_latency_figures_and_bounds():
    rows = [_row("chat stream TTFT", 10, 200, 900), _row("chat stream ITL", 300, 40, 120),
            _row("chat stream", 10, 1500, 3000), _row("Aggregated", 320, 40, 1500)]
    lat = latency_figures(rows)
    assert lat["ttft"] == {"n": 10, "p50_ms": 200, "p95_ms": 900, "p99_ms": 900, "avg_ms": 200}
    assert lat["itl"]["p95_ms"] == 120 and "chat" not in lat  # no plain chat ran: not reported as zero
    bounds = {"max_failure_ratio": 0.0, "p95_ms": {"chat stream TTFT": 800}, "min_requests": {"chat": 1}}
    assert check(rows, bounds) == ["chat stream TTFT: p95 900 ms > 800 ms", "chat: 0 requests < 1 (task did not run)"]
    with pytest.raises(SystemExit):
        parse_args(["--gateway", "http://10.0.0.5:8000"])  # load goes to loopback only
    with pytest.raises(SystemExit):
        parse_args(["--duration", "0"])
    assert parse_args([]).users == 8 and parse_args([]).duration == 60  # make loadtest-http's defaults
