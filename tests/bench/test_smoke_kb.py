"""bench.kb through its entry point on a knowledge base built here (passages of the tiny corpus of
tests/knowledge): the dense retrievers at batch 1 and 2, in-process and over the in-process gRPC server, query
encoding, HNSW recall against the exact index and ScoreCandidates, written as the JSON the docs read.

BM25 (sr) is left out: starting its JVM costs more than this whole run. Its bench path runs on PostgreSQL in
tests/knowledge/test_pg.py and its Lucene backend in tests/knowledge/test_sparse.py."""

from __future__ import annotations

import json

from bench import kb as bench_kb
from ragcore.encoder import Encoder
from retrieval_service.knowledge.build import build_kb
from tests.knowledge.conftest import tiny_corpus

PASSAGES = 24  # ScoreCandidates draws 20 distinct passages


def test_kb_main_writes_a_record(tmp_path):
    kb_dir = tmp_path / "kb"
    # An encoder in this process: the build's default encoding workers would each load the model again.
    build_kb(kb_dir, tiny_corpus()[:PASSAGES], retrievers=("edr", "adr"), corpus={"source": "tests-bench"},
             hnsw_m=8, hnsw_ef_construction=64, chunk=48, encoder=Encoder(cache_size=0), progress=False)
    out = tmp_path / "kb.json"
    bench_kb.main(["--kb", str(kb_dir), "--retrievers", "edr,adr", "--batch-sizes", "1,2", "--k", "3",
                   "--queries", "4", "--min-queries", "2", "--budget-s", "0.02", "--ef-search", "16",
                   "--score-calls", "6", "--threads", "1", "--json", str(out)])
    rec = json.loads(out.read_text())
    assert rec["kb"] == str(kb_dir) and rec["passages"] == PASSAGES and rec["queries"] == 4
    assert set(rec["retrievers"]) == {"edr", "adr"}
    for rows in rec["retrievers"].values():
        assert set(rows) == {"1", "2"}  # Not a batch size left out
        assert all(row["ms_per_query"] > 0 and row["grpc_ms_per_query"] > 0 for row in rows.values())
    assert set(rec["encode"]) == {"1", "2"}
    assert rec["speedup_batch8"] == {}  # no batch 8 was timed: Not a ratio of cells that do not exist
    # 24 passages, k = 10 against the exact index: HNSW of 8 links finds every one.
    assert rec["hnsw_recall_at_10"] == 1.0 and {r["ef_search"] for r in rec["hnsw"]} >= {16}
    assert set(rec["score_candidates"]) == {"edr", "adr"} and rec["score_candidates_ms"] > 0
    assert {"edr", "adr", "passages"} <= set(rec["build"]) and "sr" not in rec["build"]
    assert rec["command"].startswith("python -m bench.kb --kb ") and rec["machine"]["cpu_flags"]
