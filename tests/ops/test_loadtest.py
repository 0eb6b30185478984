"""The load-test harness: Locust (gevent + the gRPC interceptor) against a real retrieval server for a few
seconds, and the runner's threshold checks on a stats table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from loadtests.run import check, read_stats, table
from ragcore.draft_tree import DraftTree
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server

ROOT = Path(__file__).resolve().parents[2]
THRESHOLDS = {"max_failure_ratio": 0.0, "p95_ms": {"Draft": 100, "Generate": 1000}, "min_requests": {"Draft": 5}}


class TinyDatastore:
    vocab_size = 49152

    def draft(self, ctx, **kwargs) -> DraftTree:
        return DraftTree(np.array([7, 8], np.int32), np.array([-1, 0], np.int32))

    def draft_batch(self, ctxs, **kwargs):
        return [self.draft(c) for c in ctxs]


def test_locust_drives_the_retrieval_service(tmp_path):
    running = build_server(RetrievalConfig(port=0, auth_token="tok"), datastore=TinyDatastore())
    prefix = tmp_path / "smoke"
    try:
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtests" / "locustfile.py"), "--headless",
             "-u", "3", "-r", "3", "-t", "4s", "--csv", str(prefix), "--only-summary", "--loglevel", "WARNING",
             "--retrieval", running.address, "--generation", "", "--token", "tok", "--think-time", "0.01"],
            cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        running.stop(0)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["name"]: r for r in read_stats(Path(f"{prefix}_stats.csv"))}
    assert rows["Draft"]["requests"] > 5 and rows["DraftBatch"]["requests"] > 0
    assert rows["Aggregated"]["failures"] == 0
    assert "Search" not in rows and "Generate" not in rows  # no KB on this server; no worker given
    assert "Search task disabled" in run.stdout + run.stderr


def _rows(**draft):
    base = {"name": "Draft", "requests": 100, "failures": 0, "rps": 10.0, "avg_ms": 5, "p50_ms": 4, "p95_ms": 50,
            "p99_ms": 80, "max_ms": 90}
    agg = {**base, "name": "Aggregated"}
    return [{**base, **draft}, {**agg, **{k: v for k, v in draft.items() if k in ("requests", "failures")}}]


def test_thresholds():
    assert check(_rows(), THRESHOLDS) == []
    assert check(_rows(failures=1), THRESHOLDS) == ["failure ratio 0.0100 > 0.0 (1 of 100)"]
    assert check(_rows(p95_ms=101), THRESHOLDS) == ["Draft: p95 101 ms > 100 ms"]
    assert check(_rows(requests=3), THRESHOLDS) == ["Draft: 3 requests < 5 (task did not run)"]
    assert "| Draft | 100 | 0 | 10.00 | 4 | 50 | 80 |" in table(_rows())
