"""bench.hardening at a tiny size: the health part against an in-process worker whose batch and queue hold 2 of 6
Generates (the rest refused, counted by the worker's /metrics), the search part against an in-process retrieval
service over a knowledge base built here with small limits; the JSON holds the figures the issue's targets are
read from.

The bench runs as `python -m bench.hardening` in a child process from the repository root: inside tests/bench the
name `bench` is this test package, so an in-process import could find another checkout's bench."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ragcore.encoder import Encoder
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge.build import build_kb
from tests.bench.workers import in_process_worker
from tests.knowledge.conftest import tiny_corpus
from tools.launcher import free_port

# Two texts at the encoder's 256 tokens fill the token bound; k fills the results bound; vectors: 8 x 4.
LIMITS = ["--limit-batch", "8", "--kb-limit-k", "8", "--kb-limit-results", "32", "--kb-limit-encode-tokens", "512",
          "--kb-limit-search-chars", "2048", "--kb-limit-query-chars", "1024"]
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--rounds", "1", "--checks", "2", "--check-every-s", "0.01", "--settle-s", "0.05", "--small-alone-s", "0.2"]


def run_bench(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "bench.hardening", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.model
def test_health_part(tmp_path):
    out = tmp_path / "h.json"
    port = free_port()
    with in_process_worker(metrics_port=port, max_batch=1, queue_size=1, default_decoding="ar") as address:
        run_bench("--only", "health", "--worker", address, "--worker-metrics", f"http://127.0.0.1:{port}/metrics",
                  "--generates", "6", "--new-tokens", "8", *TINY, "--json", str(out))
    r = json.loads(out.read_text())["health"]["rounds"][0]
    assert sum(r["client_codes"].values()) == 6 and r["client_codes"].get("RESOURCE_EXHAUSTED", 0) >= 1
    assert r["metric_codes"] == r["client_codes"]  # Not refusals the worker's metrics never saw
    assert [c["status"] for c in r["checks"]] == ["SERVING"] * 2
    assert "generation queue is full" in r["refusal_messages"]


def test_search_part(tmp_path):
    from retrieval_service.server import build_server

    kb_dir = tmp_path / "kb"
    build_kb(kb_dir, tiny_corpus()[:24], retrievers=("edr",), corpus={"source": "tests-bench"},
             encoder=Encoder(cache_size=0), progress=False)
    cfg = RetrievalConfig.from_args(["--port", "0", "--kb", str(kb_dir), *LIMITS])
    running = build_server(cfg)
    out = tmp_path / "s.json"
    try:
        run_bench("--only", "search", "--retrieval", running.address, "--retrieval-args", shlex.join(LIMITS), *TINY,
                  "--json", str(out))
    finally:
        running.stop(0)
    result = json.loads(out.read_text())
    s = result["search"]
    assert s["passages"] == 24 and s["limits"]["kb_limit_encode_tokens"] == 512
    alone = s["rounds"][0]["alone"]
    assert (alone["texts"]["queries"], alone["texts"]["k"], alone["texts"]["chars"]) == (2, 8, 2048)
    assert alone["texts"]["code"] == "OK" and alone["vectors"]["code"] == "OK"
    past = alone["one_text_past_the_bounds"]
    assert past["code"] == "INVALID_ARGUMENT" and "kb_limit_search_chars" in past["details"]  # Not served
    assert s["rounds"][0]["beside"]["small_ms"] and s["rounds"][0]["small_alone"]["n"] > 0
    assert set(s["summary"]["targets"]) == {"largest_search_within_5s_or_refused_up_front",
                                            "small_search_p95_under_100ms"}
    assert {"cpu", "cpu_flags", "code"} <= set(result["machine"]) and len(result["loadavg_end"]) == 3
