"""The knowledge base in PostgreSQL + pgvector: one table of passages, embeddings and a full-text column.

    kb = open_knowledge_base("postgresql://user@host:5432/db", RetrievalConfig(kb_pg_table="ragserve_kb"))
    load_kb("~/.cache/ragserve/kb/docs", "postgresql://user@host:5432/db")   # the build command's --to URL

Table (name from config kb_pg_table / build --table):
    id bigint PRIMARY KEY, emb vector(D) (stored inline), key text, title text, text text,
    tsv tsvector GENERATED ALWAYS AS (to_tsvector('english', title || ' ' || text)) STORED
plus `<table>_hnsw` (HNSW, vector_ip_ops) and `<table>_tsv` (GIN) indexes and a `<table>_meta` table holding the
manifest (fingerprint, encoder, dimension, which retrievers were built).

Retrievers: edr = exact inner product (`ORDER BY emb <#> q, id LIMIT k` with index scans off for the statement, so
PostgreSQL scans every row; a batch scans the table once per 8 queries and sorts only the rows under a bound taken
from the table's first rows, see exact_sql), adr = the HNSW index (`hnsw.ef_search` from the request or
kb_ef_search), sr = PostgreSQL full-text search: any of the query's lexemes matches, ranked by ts_rank_cd (cover
density) -- not Lucene's BM25 (serve the KB directory for that). A batch is one statement and one round trip
(adr and sr: a LATERAL join over `unnest` of the query vectors or texts). Scores are pgvector's float32 inner
products: equal to the in-process exact search up to float32 summation order, so ranks agree except between
near-ties.

Every call runs in one transaction on a pooled connection (psycopg_pool, kb_pg_pool connections) with
`statement_timeout` set to the caller's gRPC deadline (deadline.py), so a slow statement ends at the deadline
(DEADLINE_EXCEEDED) instead of running on. A database that cannot be reached, or a connection lost mid-call,
answers UNAVAILABLE; the pool checks a connection before lending it, so the next call gets a fresh one.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from ragcore.errors import DeadlineExceeded, Unavailable
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import deadline, dense, passages as P
from retrieval_service.knowledge.kb import DENSE_DIR, KB_INDEX, MANIFEST, KBLimits, KBOpenError, KnowledgeBase, _which

log = logging.getLogger(__name__)

URL_SCHEMES = ("postgresql://", "postgres://")
FORMAT_VERSION = 1
TS_CONFIG = "english"
DatabaseError = psycopg.Error
COPY_BATCH = 2000  # rows per COPY transaction: a resumed load repeats at most this many
_COPY_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)
_COPY_TRAILER = struct.pack("!h", -1)


def is_url(kb: str | Path) -> bool:
    return str(kb).startswith(URL_SCHEMES)


def masked(url: str) -> str:
    """The URL without its password (for logs and Info)."""
    try:
        parts = conninfo_to_dict(url)
    except Exception:
        return url.split("@")[-1]
    parts.pop("password", None)
    host, port, db = parts.get("host", ""), parts.get("port", ""), parts.get("dbname", "")
    user = parts.get("user", "")
    return f"postgresql://{user + '@' if user else ''}{host}{':' + str(port) if port else ''}/{db}" if host else \
        make_conninfo(**parts)


class PgKBError(RuntimeError):
    """The table is missing, belongs to another KB, or is not completely loaded."""


# ------------------------------------------------------------------------------------------------ SQL shapes

def vector_literal(v: np.ndarray) -> str:
    """float32 [D] -> pgvector's text form; repr of each float32 (as a double) parses back to the same float32."""
    return "[" + ",".join(map(repr, np.asarray(v, np.float32).tolist())) + "]"


def _names(table: str):
    return {"t": sql.Identifier(table), "meta": sql.Identifier(f"{table}_meta"),
            "hnsw": sql.Identifier(f"{table}_hnsw"), "gin": sql.Identifier(f"{table}_tsv")}


def _sql(template: str, table: str):
    return sql.SQL(template).format(**_names(table))


SCAN_GROUP = 8  # queries whose distances one scan of the table computes (exact search)
# Rows read first (in storage order) to bound each query's k-th best distance before the full scan; the full scan
# then keeps only rows under some query's bound, so the per-query top-k sorts read a few hundred rows, not the table.
BOUND_SAMPLE = 2000


def exact_sql(batch: int, group: int = SCAN_GROUP, bounded: bool = False) -> str:
    """Exact top-k of `batch` queries (%(q0)s ...) in one statement: per group of queries one scan of the table
    materializes every row's distance to each of them, then a top-k sort per query reads that. Ties: smaller id
    first, as the in-process search ranks them.

    Why not a LATERAL join of one `ORDER BY emb <#> q LIMIT k` per query: each query then scans the table again,
    and reading the rows (not the 384-d dot products) is most of a scan's cost.

    bounded: first the k-th best distance of each query among the table's first %(sample)s rows (>= k of them),
    then the scan keeps only rows at or under some query's bound. Exact: the k-th best distance over any subset
    of the rows is >= the k-th best over the table, so every row of a query's true top k passes its bound
    (PostgreSQL orders float8 NaN above everything in `<=` as in ORDER BY, so that holds for NaN too; a sample
    that is the whole table bounds every row). Why: 8 top-k sorts over every row of the table cost more than the
    scan's 8 dot products per row.
    """
    ctes, parts = [], []
    for g, lo in enumerate(range(0, batch, group)):
        cols = range(lo, min(batch, lo + group))
        dists = ", ".join(f"emb <#> %(q{i})s::vector AS x{i}" for i in cols)
        if bounded:
            ctes.append(f"s{g} AS MATERIALIZED (SELECT {dists} FROM (SELECT emb FROM {{t}} LIMIT %(sample)s) r)")
            under = " OR ".join(f"x{i} <= (SELECT max(x{i}) FROM (SELECT x{i} FROM s{g} ORDER BY x{i} "
                                f"LIMIT %(k)s) b)" for i in cols)
            # OFFSET 0 keeps the filter out of the scan: there it would compute each distance a second time.
            ctes.append(f"d{g} AS MATERIALIZED (SELECT * FROM (SELECT id, {dists} FROM {{t}} OFFSET 0) a "
                        f"WHERE {under})")
        else:
            ctes.append(f"d{g} AS MATERIALIZED (SELECT id, {dists} FROM {{t}})")
        parts += [f"(SELECT {i + 1} AS ord, id, -x{i} AS score FROM d{g} ORDER BY x{i}, id LIMIT %(k)s)" for i in cols]
    return "WITH " + ", ".join(ctes) + " " + " UNION ALL ".join(parts)


_EXACT_ONE = "SELECT 1 AS ord, id, -(emb <#> %(q0)s::vector) AS score FROM {t} ORDER BY emb <#> %(q0)s::vector, id " \
    "LIMIT %(k)s"
# The HNSW index serves ORDER BY <distance> alone; its candidates are re-ordered (score, then id) in Python.
_APPROX = """SELECT q.ord, h.id, h.score FROM unnest(%(q)s::vector[]) WITH ORDINALITY AS q(v, ord)
CROSS JOIN LATERAL (SELECT id, -(emb <#> q.v) AS score FROM {t} ORDER BY emb <#> q.v LIMIT %(k)s) h"""
# OR of the query's lexemes (already stemmed, so to_tsquery('simple') keeps them): a 32-token RaLM query joined
# with AND (websearch_to_tsquery's reading) would match almost nothing.
_OR_QUERY = """(SELECT coalesce(to_tsquery('simple', string_agg('''' || replace(l, '''', '''''') || '''', ' | ')),
                 ''::tsquery) FROM unnest(tsvector_to_array(to_tsvector('{cfg}', %s))) AS l)"""
_TEXT = """SELECT q.ord, h.id, h.score FROM unnest(%(q)s::text[]) WITH ORDINALITY AS q(txt, ord)
CROSS JOIN LATERAL (SELECT coalesce(to_tsquery('simple', string_agg('''' || replace(l, '''', '''''') || '''',
                           ' | ')), ''::tsquery) AS tq
                    FROM unnest(tsvector_to_array(to_tsvector('{cfg}', q.txt))) AS l) w
CROSS JOIN LATERAL (SELECT id, ts_rank_cd(tsv, w.tq) AS score FROM {{t}} WHERE tsv @@ w.tq
                    ORDER BY score DESC, id LIMIT %(k)s) h""".format(cfg=TS_CONFIG)


# ------------------------------------------------------------------------------------------------ connections

class PgBackend:
    """A connection pool to the KB table's database and the one way every call reaches it (`call`)."""

    def __init__(self, url: str, table: str, *, pool_size: int = 4, connect_timeout_s: float = 5.0,
                 statement_timeout_ms: float = 30_000.0, open_wait: bool = True):
        self.url = url
        self.table = table
        self.connect_timeout_s = connect_timeout_s
        self.statement_timeout_ms = statement_timeout_ms
        self.pool = ConnectionPool(
            url, min_size=1, max_size=max(1, pool_size), open=False, timeout=connect_timeout_s,
            # A connection is checked (one round trip) before it is lent: one broken by a database restart is
            # replaced there, not handed to a call that would fail on it.
            check=ConnectionPool.check_connection,
            kwargs={"connect_timeout": max(1, int(round(connect_timeout_s))), "application_name": "ragserve-kb",
                    # A database that vanishes without closing the socket is noticed by the kernel, not never.
                    "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3},
            reconnect_timeout=float("inf"), name=f"kb:{table}")
        self.pool.open(wait=False)
        if open_wait:
            try:
                self.pool.wait(timeout=connect_timeout_s)
            except Exception as e:
                self.pool.close()
                raise PgKBError(f"{masked(url)}: cannot connect within {connect_timeout_s:.0f} s ({e})") from None

    def close(self) -> None:
        self.pool.close(timeout=1.0)

    @contextmanager
    def transaction(self, settings: dict[str, str] | None = None) -> Iterator:
        """A connection in a transaction whose statement_timeout is the caller's deadline (or the configured
        one), plus `settings` (SET LOCAL). Errors: DeadlineExceeded, Unavailable."""
        left = deadline.remaining_s()
        if left is not None and left <= 0:
            raise DeadlineExceeded("deadline passed before the database call")
        timeout_ms = self.statement_timeout_ms if left is None else max(1.0, min(self.statement_timeout_ms,
                                                                                 left * 1e3))
        wait_s = self.connect_timeout_s if left is None else min(self.connect_timeout_s, left)
        try:
            with self.pool.connection(timeout=wait_s) as conn:
                with conn.transaction():
                    local = {"statement_timeout": f"{int(timeout_ms)}ms", **(settings or {})}
                    conn.execute("SELECT " + ", ".join(["set_config(%s, %s, true)"] * len(local)),
                                 [x for kv in local.items() for x in kv])  # SET LOCAL, one round trip
                    yield conn
        except PoolTimeout as e:
            left = deadline.remaining_s()
            if left is not None and left <= 0:
                raise DeadlineExceeded(f"deadline passed waiting for a database connection ({e})") from None
            raise Unavailable(f"knowledge base database {masked(self.url)} unreachable: {e}") from None
        except psycopg.errors.QueryCanceled as e:
            raise DeadlineExceeded(f"database statement stopped at the deadline ({int(timeout_ms)} ms): "
                                   f"{str(e).strip()}") from None
        except psycopg.OperationalError as e:
            raise Unavailable(f"knowledge base database {masked(self.url)}: {str(e).strip()}") from None

    def ping(self, timeout_s: float = 2.0) -> bool:
        """Can a query reach the database now (health)?"""
        try:
            with psycopg.connect(self.url, connect_timeout=max(1, int(timeout_s)), autocommit=True) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.Error:
            return False


def _group(rows, batch: int, k: int, rerank: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ord 1-based, id, score) rows -> per query (ids int64 [n], scores float32 [n]) best first."""
    out = [(np.zeros(0, np.int64), np.zeros(0, np.float32)) for _ in range(batch)]
    if not rows:
        return out
    arr = np.array(rows, dtype=np.float64)  # ids < 2**53
    ords = arr[:, 0].astype(np.int64) - 1
    ids = arr[:, 1].astype(np.int64)
    scores = arr[:, 2].astype(np.float32)
    order = np.lexsort((ids, -scores.astype(np.float64), ords)) if rerank else np.argsort(ords, kind="stable")
    ords, ids, scores = ords[order], ids[order], scores[order]
    cuts = np.searchsorted(ords, np.arange(batch + 1))
    for b in range(batch):
        lo, hi = cuts[b], cuts[b + 1]
        out[b] = (ids[lo:hi][:k], scores[lo:hi][:k])
    return out


# ------------------------------------------------------------------------------------------------ KB parts

@dataclass
class PgVectorIndex:
    """The KB embeddings in the table: the duck type of dense.VectorIndex that KnowledgeBase uses."""

    backend: PgBackend
    dim: int
    size: int
    has_hnsw: bool
    default_ef_search: int = 128
    bound_sample: int = BOUND_SAMPLE  # 0: batched exact searches sort every row per query (see exact_sql)
    name: str = "kb"
    metric: str = "ip"
    info: dict = field(default_factory=dict)

    @property
    def retrievers(self) -> list[str]:
        return ["edr", "adr"] if self.has_hnsw else ["edr"]

    @property
    def exact_kind(self) -> str:
        return "postgresql"

    def search(self, queries: np.ndarray, k: int, *, approx: bool = False,
               ef_search: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
        """queries: [B, D] float32 -> per query (ids int64 [n], scores float32 [n]), n <= k, best first; one
        statement for the batch."""
        if approx and not self.has_hnsw:
            raise LookupError(f"{self.name}: no HNSW index in the table")
        q = [vector_literal(v) for v in np.asarray(queries, np.float32)]
        if approx:
            # pgvector's HNSW returns at most ef_search rows per query.
            settings = {"hnsw.ef_search": str(max(ef_search or self.default_ef_search, k))}
            sql_text, params = _APPROX, {"q": q, "k": k}
        else:
            # Exact: scan every row; the materialized distances (8 + 8 x group bytes a row) stay in memory.
            need_mb = 1 + self.size * (8 + 8 * min(len(q), SCAN_GROUP)) * 2 // (1 << 20)
            settings = {"enable_indexscan": "off", "enable_bitmapscan": "off", "work_mem": f"{max(4, need_mb)}MB"}
            sample = max(self.bound_sample, k)
            # A table not much larger than the sample: bounding would read most of it twice.
            bounded = self.bound_sample > 0 and self.size > 2 * sample
            sql_text = _EXACT_ONE if len(q) == 1 else exact_sql(len(q), bounded=bounded)
            params = {"k": k, **({"sample": sample} if bounded and len(q) > 1 else {}),
                      **{f"q{i}": v for i, v in enumerate(q)}}
        with self.backend.transaction(settings) as conn:
            rows = conn.execute(_sql(sql_text, self.backend.table), params).fetchall()
        return _group(rows, len(q), k, rerank=approx)

    def score(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """query: [D], ids: [n] -> [n] float32, the scores search() gives those docs."""
        ids = np.asarray(ids, np.int64)
        with self.backend.transaction() as conn:
            rows = conn.execute(_sql("SELECT id, -(emb <#> %s::vector) FROM {t} WHERE id = ANY(%s)",
                                     self.backend.table), (vector_literal(query), ids.tolist())).fetchall()
        got = {int(i): s for i, s in rows}
        missing = [int(i) for i in ids if int(i) not in got]
        if missing:
            raise LookupError(f"{self.name}: ids {missing[:5]} are not in the table")
        return np.array([got[int(i)] for i in ids], np.float32)

    def get_vectors(self, ids: np.ndarray) -> np.ndarray:
        """ids: [n] -> [n, D] float32 (pgvector's binary form: int16 dim, int16 unused, float4 big-endian)."""
        ids = np.asarray(ids, np.int64)
        out = np.zeros((len(ids), self.dim), np.float32)
        if not len(ids):
            return out
        with self.backend.transaction() as conn:
            rows = conn.execute(_sql("SELECT id, vector_send(emb) FROM {t} WHERE id = ANY(%s)", self.backend.table),
                                (ids.tolist(),)).fetchall()
        got = {int(i): bytes(b) for i, b in rows}
        for j, i in enumerate(ids):
            out[j] = np.frombuffer(got[int(i)], ">f4", offset=4)
        return out

    def warmup(self, rounds: int = 2) -> None:
        rng = np.random.default_rng(0)
        q = rng.standard_normal((8, self.dim)).astype(np.float32)
        for _ in range(rounds):
            for b in (1, 8):
                self.search(q[:b], 10)
                if self.has_hnsw:
                    self.search(q[:b], 10, approx=True)


@dataclass
class PgTextIndex:
    """Full-text search on the table's tsvector column: the duck type of sparse.BM25Index (not BM25)."""

    backend: PgBackend
    n: int

    def search(self, texts: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        with self.backend.transaction() as conn:
            rows = conn.execute(_sql(_TEXT, self.backend.table), {"q": list(texts), "k": k}).fetchall()
        return _group(rows, len(texts), k, rerank=True)

    def score(self, text: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """text, ids: [n] -> (scores float32 [n], rank int64 [n]) as search would score and order them; a doc
        without any query lexeme gets score 0 and rank n."""
        ids = np.asarray(ids, np.int64)
        query = "SELECT id, ts_rank_cd(tsv, w.tq), tsv @@ w.tq FROM {t}, " + _OR_QUERY.format(cfg=TS_CONFIG) + \
            " AS w(tq) WHERE id = ANY(%s)"
        with self.backend.transaction() as conn:
            rows = conn.execute(_sql(query, self.backend.table), (text, ids.tolist())).fetchall()
        got = {int(i): (float(s), bool(m)) for i, s, m in rows}
        unique = np.unique(ids)
        vals = np.array([got.get(int(i), (0.0, False))[0] for i in unique], np.float32)
        matched = np.array([got.get(int(i), (0.0, False))[1] for i in unique], bool)
        vals[~matched] = 0.0
        order = np.lexsort((unique, -vals.astype(np.float64), ~matched))
        rank = np.full(len(unique), len(ids), np.int64)
        hit = order[matched[order]]
        rank[hit] = np.arange(len(hit))
        pos = np.searchsorted(unique, ids)
        return vals[pos], rank[pos]

    def warmup(self, rounds: int = 20, seconds: float = 2.0) -> None:
        stop = time.monotonic() + seconds
        for _ in range(rounds):
            self.search(["python json decoder", "read a file line by line"], 10)
            if time.monotonic() > stop:
                break

    def close(self) -> None:
        pass


@dataclass
class PgPassages:
    """The passages in the table: the duck type of passages.PassageStore that KnowledgeBase uses."""

    backend: PgBackend
    n: int
    max_record_bytes: int

    def __len__(self) -> int:
        return self.n

    def _rows(self, ids: Sequence[int]) -> dict[int, tuple[str, str, str]]:
        with self.backend.transaction() as conn:
            rows = conn.execute(_sql("SELECT id, key, title, text FROM {t} WHERE id = ANY(%s)", self.backend.table),
                                (list(map(int, ids)),)).fetchall()
        return {int(i): (k, t, x) for i, k, t, x in rows}

    def get(self, ids: Sequence[int]) -> list[tuple[str, str]]:
        got = self._rows(ids)
        return [(got[int(i)][1], got[int(i)][2]) for i in ids]

    def record(self, i: int) -> dict:
        got = self._rows([i])
        if i not in got:
            return {}
        key, title, text = got[i]
        return {"id": i, "key": key, "title": title, "text": text}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ open

@dataclass
class PgKnowledgeBase(KnowledgeBase):
    """A KnowledgeBase whose passages and indexes live in PostgreSQL (built by open_kb)."""

    backend: PgBackend | None = None
    url: str = ""  # without its password

    def close(self) -> None:
        super().close()
        if self.backend is not None:
            self.backend.close()

    def info(self) -> dict:
        return {**super().info(), "path": self.url}

    def watch_health(self, on_change: Callable[[bool], None], every_s: float) -> Callable[[], None]:
        """Poll the database every `every_s` seconds; on_change(reachable) when that changes. Returns a closer."""
        return HealthWatch(self.backend, on_change, every_s).close


def read_manifest(conn, table: str) -> dict | None:
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{table}_meta"',)).fetchone()[0]
    if not exists:
        return None
    row = conn.execute(_sql("SELECT value FROM {meta} WHERE name = 'manifest'", table)).fetchone()
    return row[0] if row else None


def open_kb(url: str, cfg: RetrievalConfig, *, warmup: bool = True, encoder=None):
    """A KnowledgeBase whose passages and indexes are the PostgreSQL table (KBOpenError if it is missing or not
    completely loaded)."""
    wanted = _which(cfg.kb_retrievers)
    try:
        backend = PgBackend(url, cfg.kb_pg_table, pool_size=cfg.kb_pg_pool,
                            connect_timeout_s=cfg.kb_pg_connect_timeout_s,
                            statement_timeout_ms=cfg.kb_pg_statement_timeout_ms)
    except PgKBError as e:
        raise KBOpenError(f"knowledge base {e}") from None
    try:
        with backend.transaction() as conn:
            manifest = read_manifest(conn, cfg.kb_pg_table)
            top = None
            if manifest is not None:
                top = conn.execute(_sql("SELECT max(id) FROM {t}", cfg.kb_pg_table)).fetchone()[0]
    except Exception as e:
        backend.close()
        raise KBOpenError(f"knowledge base {masked(url)}: {e}") from None
    where = f"{masked(url)} table {cfg.kb_pg_table}"
    if manifest is None:
        backend.close()
        raise KBOpenError(f"knowledge base {where}: not loaded (build it with `python -m "
                          f"retrieval_service.knowledge.build --out DIR --to URL --table {cfg.kb_pg_table}`)")
    n = int(manifest["passages"])
    if top is None or int(top) + 1 != n:
        backend.close()
        raise KBOpenError(f"knowledge base {where}: manifest says {n} passages, the table holds ids up to {top}; "
                          "finish the load (rerun the build command)")
    built = set(manifest.get("retrievers", []))
    kb = PgKnowledgeBase(path=Path(""), passages=PgPassages(backend, n, int(manifest.get("max_record_bytes", 4096))),
                         manifest=manifest, limits=KBLimits.from_config(cfg), warmup_s=min(cfg.kb_warmup_s, 2.0),
                         backend=backend, url=masked(url))
    try:
        if wanted & built & {"edr", "adr"}:
            vi = PgVectorIndex(backend, int(manifest["dim"]), n, has_hnsw="adr" in wanted & built,
                               default_ef_search=cfg.kb_ef_search,
                               info={"encoder": manifest.get("encoder"),
                                     "encoder_dtype": manifest.get("encoder_dtype", "float32")})
            kb.vector_indexes[KB_INDEX] = vi
            kb.encoder = encoder or dense.Encoder(threads=cfg.kb_omp_threads, cache_size=cfg.kb_query_cache,
                                                  dtype=vi.info["encoder_dtype"])
            if kb.encoder.dim != vi.dim:
                raise ValueError(f"encoder dimension {kb.encoder.dim} != the table's {vi.dim}")
            if kb.encoder.dtype != vi.info["encoder_dtype"]:
                raise ValueError(f"encoder dtype {kb.encoder.dtype} != {vi.info['encoder_dtype']} used for the "
                                 "passages (queries must be encoded the same way)")
        if "sr" in wanted & built:
            kb.bm25 = PgTextIndex(backend, n)
        kb.check()
        if warmup:
            kb.warmup()
    except (ValueError, Unavailable, DeadlineExceeded) as e:
        kb.close()
        raise KBOpenError(f"knowledge base {where}: {e}") from None
    return kb


# ------------------------------------------------------------------------------------------------ load (build)

def _copy_rows(ids: np.ndarray, recs: Sequence[dict], emb: np.ndarray) -> bytes:
    """COPY ... (FORMAT BINARY) rows of (id, emb, key, title, text); emb [n, D] float32."""
    n, dim = emb.shape
    be = np.ascontiguousarray(emb, dtype=">f4")
    vec_head = struct.pack("!ihh", 4 + 4 * dim, dim, 0)
    parts = [_COPY_HEADER]
    for j in range(n):
        r = recs[j]
        texts = [str(r[name]).replace("\x00", "").encode("utf-8") for name in ("key", "title", "text")]
        parts.append(struct.pack("!hiq", 5, 8, int(ids[j])))
        parts.append(vec_head)
        parts.append(be[j].tobytes())
        for t in texts:
            parts.append(struct.pack("!i", len(t)))
            parts.append(t)
    parts.append(_COPY_TRAILER)
    return b"".join(parts)


_MEMORY_SETTING = re.compile(r"[1-9][0-9]{0,9}(kB|MB|GB|TB)")  # a PostgreSQL memory size; it goes into a SET


def load_kb(kb_dir: str | Path, url: str, *, table: str = "ragserve_kb", retrievers: Sequence[str] = ("edr",),
            hnsw_m: int = 16, hnsw_ef_construction: int = 64, batch: int = COPY_BATCH, force: bool = False,
            progress: Callable[[int], None] | None = None, maintenance_work_mem: str = "512MB") -> dict:
    """Copy a built KB directory (passages + embeddings) into the table and build its indexes; returns the
    manifest written to `<table>_meta`.

    Resumable: rows go in by id in COPY transactions of `batch` rows, and a rerun starts after the table's
    max(id); indexes already built are kept. A table holding another KB (another passages fingerprint) is an
    error unless force (then it is dropped and reloaded). maintenance_work_mem: the index builds' memory; an HNSW
    graph that does not fit in it is built far more slowly (2-3 KB a passage at 384 dimensions and m = 32).
    """
    if not _MEMORY_SETTING.fullmatch(maintenance_work_mem):
        raise ValueError(f"maintenance_work_mem: {maintenance_work_mem!r} is not a size such as 512MB or 4GB")
    kb_dir = Path(kb_dir).expanduser()
    local = json.loads((kb_dir / MANIFEST).read_text())
    meta = json.loads((kb_dir / DENSE_DIR / dense.META_FILE).read_text())
    n, fp = int(local["passages"]), local["fingerprint"]
    if meta.get("fingerprint") != fp or meta.get("n") != n:
        raise ValueError(f"{kb_dir}: embeddings were built for other passages; finish the KB build first")
    emb = np.load(kb_dir / DENSE_DIR / dense.EMBEDDINGS_FILE, mmap_mode="r")  # [n, D] float32|float16
    dim = int(emb.shape[1])
    store = P.PassageStore(kb_dir)
    want = {"format": FORMAT_VERSION, "fingerprint": fp, "passages": n, "dim": dim,
            "encoder": meta.get("encoder"), "encoder_dtype": meta.get("encoder_dtype", "float32")}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            if force:
                conn.execute(_sql("DROP TABLE IF EXISTS {t}, {meta}", table))
            conn.execute(_sql("CREATE TABLE IF NOT EXISTS {meta} (name text PRIMARY KEY, value jsonb NOT NULL)",
                              table))
            loading = conn.execute(_sql("SELECT value FROM {meta} WHERE name = 'loading'", table)).fetchone()
            if loading is not None and {k: loading[0].get(k) for k in want} != want:
                raise ValueError(f"table {table} holds another knowledge base (passages {loading[0].get('passages')},"
                                 f" fingerprint {str(loading[0].get('fingerprint'))[:12]}); use --force to replace it")
            if loading is None:
                if conn.execute(_sql("SELECT to_regclass(%s) IS NOT NULL", table), (f'"{table}"',)).fetchone()[0]:
                    raise ValueError(f"table {table} exists but was not loaded by this command; use --force to "
                                     "replace it or pick another --table")
                conn.execute(_sql("INSERT INTO {meta} VALUES ('loading', %s)", table), (Jsonb(want),))
            # emb right after id and stored inline (PLAIN): an exact scan reads it without walking the text
            # columns, and never from the TOAST table, where a row over ~2 KB would otherwise move it.
            conn.execute(_sql(
                "CREATE TABLE IF NOT EXISTS {t} (id bigint PRIMARY KEY, emb vector(" + str(dim) + ") NOT NULL, "
                "key text NOT NULL, title text NOT NULL, text text NOT NULL, tsv tsvector GENERATED ALWAYS AS "
                "(to_tsvector('" + TS_CONFIG + "', title || ' ' || text)) STORED)", table))
            conn.execute(_sql("ALTER TABLE {t} ALTER COLUMN emb SET STORAGE PLAIN", table))
            top = conn.execute(_sql("SELECT max(id) FROM {t}", table)).fetchone()[0]
            start = 0 if top is None else int(top) + 1
            if progress is not None and start:
                progress(start)
            t0 = time.perf_counter()
            copy_sql = _sql("COPY {t} (id, emb, key, title, text) FROM STDIN (FORMAT BINARY)", table)
            for lo in range(start, n, batch):
                hi = min(n, lo + batch)
                recs = list(store.iter_range(lo, hi))
                data = _copy_rows(np.arange(lo, hi), recs, np.asarray(emb[lo:hi], np.float32))
                with conn.cursor().copy(copy_sql) as cp:  # autocommit: each COPY commits on its own
                    cp.write(data)
                if progress is not None:
                    progress(hi - lo)
            copy_s = time.perf_counter() - t0
            built = ["edr"]
            index_s = {}
            conn.execute(f"SET maintenance_work_mem = '{maintenance_work_mem}'")
            if "adr" in retrievers:
                t0 = time.perf_counter()
                conn.execute(_sql("CREATE INDEX IF NOT EXISTS {hnsw} ON {t} USING hnsw (emb vector_ip_ops) "
                                  f"WITH (m = {int(hnsw_m)}, ef_construction = {int(hnsw_ef_construction)})", table))
                index_s["adr"] = time.perf_counter() - t0
                built.append("adr")
            if "sr" in retrievers:
                t0 = time.perf_counter()
                conn.execute(_sql("CREATE INDEX IF NOT EXISTS {gin} ON {t} USING gin (tsv)", table))
                index_s["sr"] = time.perf_counter() - t0
                built.append("sr")
            # Indexes from an earlier load stay usable.
            for name, ix in (("adr", f"{table}_hnsw"), ("sr", f"{table}_tsv")):
                if name not in built and conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                                      (f'"{ix}"',)).fetchone()[0]:
                    built.append(name)
            conn.execute(_sql("ANALYZE {t}", table))
            longest = conn.execute(_sql("SELECT coalesce(max(octet_length(title) + octet_length(text)), 0) FROM {t}",
                                        table)).fetchone()[0]
            manifest = {**want, "retrievers": built, "max_record_bytes": int(longest) + 64, "table": table,
                        "hnsw": {"m": hnsw_m, "ef_construction": hnsw_ef_construction} if "adr" in built else {},
                        # The in-process manifest's shape: a stage -> its figures.
                        "build": {"copy": {"seconds": copy_s, "rows": n - start},
                                  **{name: {"seconds": sec} for name, sec in index_s.items()}}}
            conn.execute(_sql("INSERT INTO {meta} VALUES ('manifest', %s) ON CONFLICT (name) DO UPDATE SET value = "
                              "EXCLUDED.value", table), (Jsonb(manifest),))
    finally:
        store.close()
    return manifest


class HealthWatch:
    """Polls the database while the server runs; on_change(ok) when reachability changes (health)."""

    def __init__(self, backend: PgBackend, on_change: Callable[[bool], None], every_s: float = 2.0):
        self._backend = backend
        self._on_change = on_change
        self._every = every_s
        self._stop = threading.Event()
        self._ok = True
        self._thread = threading.Thread(target=self._run, name="kb-pg-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            ok = self._backend.ping(timeout_s=min(2.0, self._every))
            if ok != self._ok:
                self._ok = ok
                log.warning("knowledge base database %s %s", masked(self._backend.url),
                            "reachable again" if ok else "unreachable (KnowledgeService NOT_SERVING)")
                self._on_change(ok)

    def close(self) -> None:
        self._stop.set()
