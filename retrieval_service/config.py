"""Retrieval service configuration: one dataclass, built at the edge from CLI flags or environment.

Every field can be set by an environment variable RAGSERVE_RETRIEVAL_<FIELD> (upper case), which is how
docker-compose configures the service; CLI flags override the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

from ragcore import config_util

_ENV_PREFIX = "RAGSERVE_RETRIEVAL_"


# One line per flag for `--help` (ragcore/config_util.py adds the default and the environment variable).
FLAG_HELP = {
    "host": "address the gRPC port binds to (0.0.0.0 = every interface)",
    "port": "gRPC port (0 = a free port)",
    "datastore": "suffix-array datastore directory or shard file for REST drafts (\"\" = none)",
    "datastore_verify": "verify the datastore's content (checksums, value ranges) before SERVING",
    "verify_cache": "JSON file remembering verified store files by identity (\"\" = $RAGSERVE_HOME/cache/verified-stores.json, off = none)",
    "kb": "knowledge-base directory, or a postgresql:// URL (docs/postgres.md), for Search/ScoreCandidates/"
          "GetDocuments (\"\" = none)",
    "crest": "CREST n-gram store for Draft source 'crest': a store file, a redis:// URL or a "
             "redis+cluster://host:port,host:port,... URL (\"\" = none)",
    "crest_namespace": "name of the CREST store inside Redis",
    "crest_fallback": "embedded CREST store file that answers while Redis is down (\"\" = UNAVAILABLE instead)",
    "crest_timeout_ms": "deadline of every Redis call of the CREST store, ms",
    "max_suffix": "Draft default: longest context suffix tried",
    "min_suffix": "Draft default: shortest context suffix tried",
    "max_matches": "Draft default: datastore occurrences read per draft",
    "continuation": "Draft default: tokens read after each occurrence",
    "max_nodes": "Draft default: draft-tree nodes returned",
    "limit_max_suffix": "largest max_suffix a request may ask for",
    "limit_max_matches": "largest max_matches a request may ask for",
    "limit_continuation": "largest continuation a request may ask for",
    "limit_max_nodes": "largest max_nodes a request may ask for",
    "limit_context_tokens": "most context tokens one Draft (or Learn) request may carry",
    "limit_batch": "most requests in one DraftBatch and most queries in one Search",
    "learn": "enable online learning (Learn RPC): finished outputs become draftable (needs a datastore)",
    "learn_dir": "directory keeping compacted learned shards across restarts (\"\" = memory only)",
    "learn_max_tokens": "tokens the learned shards may hold; the oldest are evicted first",
    "learn_compact_tokens": "learned tokens buffered in memory before they are compacted into a shard",
    "max_concurrent_rpcs": "RPCs in flight (health checks aside) before the server answers RESOURCE_EXHAUSTED "
                           "(0 = unlimited)",
    "workers": "gRPC handler threads (at least max_concurrent_rpcs, plus 4 kept for health checks)",
    "grace_s": "seconds in-flight calls get to finish after SIGTERM (health answers NOT_SERVING meanwhile)",
    "max_message_bytes": "largest request and reply message, bytes",
    "kb_retrievers": "KB retrievers to load: comma list of edr,adr,sr (\"\" = every one the KB was built with)",
    "kb_threads": "Java threads of one batched Lucene (BM25) search",
    "kb_omp_threads": "intra-op threads of faiss and of the query encoder per handler thread",
    "kb_ef_search": "HNSW efSearch when a request leaves it 0",
    "kb_rescore_margin": "extra HNSW candidates re-scored exactly per query",
    "kb_fp16_scan": "exact search of float16 vectors: kernel (one float16 pass per batch; faiss if unbuildable), "
                    "faiss (its float16 copy for <= 4 queries), off (float32)",
    "kb_scan_threads": "threads of one exact float16 scan (0 = one per usable core)",
    "kb_scan_bounds": "columns of the bounds an exact float16 scan skips rows with (0 = score every row)",
    "kb_query_cache": "encoded text queries kept in an LRU cache",
    "kb_jvm_heap": "max heap of the in-process JVM, e.g. 2g (\"\" = the JVM default, 1/4 of RAM)",
    "kb_limit_k": "largest k (hits per query) a Search may ask for",
    "kb_limit_ids": "most doc ids one ScoreCandidates/GetDocuments request may carry",
    "kb_limit_query_chars": "longest text query, characters",
    "kb_limit_search_chars": "most characters of all text queries of one Search (tokenizing costs per character)",
    "kb_limit_encode_tokens": "most tokens the encoder may run for one Search (its texts, each truncated at the "
                              "encoder's length); more is refused before any encoding",
    "kb_limit_results": "most queries x k in one Search (checked before any work, like the reply size)",
    "kb_workers": "threads of the knowledge-base executor (Search/ScoreCandidates/GetDocuments run there)",
    "kb_queue": "KB calls that may wait for the executor (capped at workers - 2); more get RESOURCE_EXHAUSTED",
    "kb_coalesce": "exact (edr) Searches waiting for the KB executor together run as one batched search",
    "kb_nice": "nice increment of the KB executor threads, so Draft calls win the CPU (0 = same priority)",
    "kb_warmup_s": "seconds of Lucene JIT warm-up before SERVING",
    "kb_verify": "verify every KB file against the checksums in its manifest (and finite embeddings) before SERVING",
    "kb_knn_datastores": "comma-separated kNN-LM datastore directories served as named vector indexes",
    "kb_pg_table": "table of the knowledge base when --kb is a postgresql:// URL",
    "kb_pg_pool": "connections of the PostgreSQL knowledge base's pool (keep >= kb_workers)",
    "kb_pg_connect_timeout_s": "seconds to wait for a PostgreSQL connection before UNAVAILABLE",
    "kb_pg_statement_timeout_ms": "statement_timeout of a PostgreSQL KB call without a gRPC deadline, ms",
    "kb_pg_health_s": "seconds between checks that the PostgreSQL KB answers (KnowledgeService NOT_SERVING if not)",
    **config_util.SHELL_FLAG_HELP,
}


@dataclass
class RetrievalConfig(config_util.ShellConfig):
    ENV_PREFIX: ClassVar[str] = _ENV_PREFIX
    PROG: ClassVar[str] = "python -m retrieval_service.server"
    DESCRIPTION: ClassVar[str] = "Retrieval gRPC service: draft trees and knowledge-base search"
    FLAG_HELP: ClassVar[Mapping[str, str]] = FLAG_HELP

    host: str = "127.0.0.1"
    port: int = 50051
    # Suffix-array datastore directory (single shard or a directory of shards); "" = no datastore.
    datastore: str = ""
    # Read every byte of the datastore before SERVING: section checksums, suffix-array entries and tokens in range
    # (cheap with a warm page cache, one sequential read). Files that passed are remembered
    # by identity (path, size, mtime, ctime, inode, header checksum) in verify_cache: "" = $RAGSERVE_HOME/cache/
    # verified-stores.json, "off" = verify at every start.
    datastore_verify: bool = True
    verify_cache: str = ""
    # Knowledge base directory (passages + dense/sparse indexes); "" = no knowledge base.
    kb: str = ""
    # CREST n-gram store (Draft source "crest"): a store file (embedded, memory-mapped), a redis:// URL or a
    # redis+cluster://host:port,host:port,... URL, then crest_namespace names the store inside Redis.
    # crest_fallback: an embedded copy of the same store that answers while Redis is unavailable ("" = a single
    # Redis's drafts answer UNAVAILABLE and the worker decodes that step autoregressively; a cluster's drafts are
    # empty until its failover ends). crest_timeout_ms bounds every Redis call. "" = no CREST store.
    crest: str = ""
    crest_namespace: str = "crest"
    crest_fallback: str = ""
    crest_timeout_ms: float = 50.0
    # Draft defaults (REST): longest suffix 16 down to 2, 5000 matches, 10-token continuations, 64 nodes.
    max_suffix: int = 16
    min_suffix: int = 2
    max_matches: int = 5000
    continuation: int = 10
    max_nodes: int = 64
    # Upper bounds a request may ask for (anything above is INVALID_ARGUMENT).
    limit_max_suffix: int = 64
    limit_max_matches: int = 100_000
    limit_continuation: int = 64
    limit_max_nodes: int = 1024
    limit_context_tokens: int = 1 << 20
    limit_batch: int = 1024
    # Online learning (Learn RPC): finished outputs become draftable. learn_dir keeps compacted learned shards
    # across restarts ("" = memory only); the learned total is bounded, oldest evicted first.
    learn: bool = False
    learn_dir: str = ""
    learn_max_tokens: int = 4_000_000
    learn_compact_tokens: int = 500_000
    # Backpressure: gRPC rejects calls beyond this many in flight with RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 64
    workers: int = 8
    # Seconds in-flight calls get to finish after SIGTERM.
    grace_s: float = 5.0
    max_message_bytes: int = 64 << 20
    # Knowledge base (retrieval_service/knowledge). Retrievers to load: comma list of edr,adr,sr; "" = every
    # one the KB was built with. Batches are bounded by limit_batch.
    kb_retrievers: str = ""
    # Java threads of one batched Lucene search.
    kb_threads: int = 2
    # Intra-op threads of faiss (OpenMP + its OpenBLAS) and of the query encoder (torch). Keep 1 unless the
    # cores are idle: an OpenMP barrier stalls for a scheduler slice when another process holds a core
    # (on a shared small machine an exact search of 1 query took far longer with 2 threads than with 1).
    # Concurrent requests still run in parallel on the gRPC worker threads.
    kb_omp_threads: int = 1
    # HNSW efSearch when a request leaves it 0; exact re-scoring of k + margin candidates per query.
    kb_ef_search: int = 128
    kb_rescore_margin: int = 16
    # Exact search of float16-stored vectors (KB embeddings built with --float16, kNN-LM keys), dense.FP16_SCANS:
    # "kernel" scans them in memory as float16 with fp16_scan.cpp, one pass for a whole batch (no float32 copy);
    # "faiss" keeps a float32 IndexFlat plus faiss's float16 copy for batches of up to 4; "off" the IndexFlat alone.
    # Measurements in dense.py.
    kb_fp16_scan: str = "kernel"
    # Threads of one such scan; 0 = one per usable core. Rows are shared out in chunks, so a thread whose core is
    # busy scans less instead of holding the search up (fp16_scan.Fp16Scan has the measurements).
    kb_scan_threads: int = 0
    # Exact float16 scans of at least 64 K rows first pass over a projection of this many columns (principal
    # directions + the residual's norm) that bounds every row's score, then score only the rows whose bound
    # reaches the k-th best: the same answer, bit for bit, in a fraction of a full scan's time on the kNN-LM keys
    # (fp16_scan.ScanBounds). Built at start (one pass over the rows; int8: 160 MB); 0 = score every row.
    kb_scan_bounds: int = 160
    kb_query_cache: int = 4096
    # Max heap of the in-process JVM (Lucene); "" = the JVM default (1/4 of RAM).
    kb_jvm_heap: str = ""
    kb_limit_k: int = 1024  # kNN-LM asks for up to 1024 neighbours (Khandelwal et al.'s k)
    kb_limit_ids: int = 10_000
    kb_limit_query_chars: int = 10_000
    # The work of one Search's text queries, refused before it starts (INVALID_ARGUMENT naming the limit): all
    # their characters (the tokenizer reads every one, even past the encoder's length), then the tokens the
    # encoder would run (each text truncated at its 256). Sized so the largest Search allowed encodes within a few
    # seconds on one core; raise them on faster machines.
    kb_limit_search_chars: int = 262_144
    kb_limit_encode_tokens: int = 8_192
    # Queries x k of one Search (kNN-LM verifies up to ~16 queries x k 1024 at once); the reply must also fit
    # max_message_bytes. Both are checked before any work.
    kb_limit_results: int = 65_536
    # KB executor (retrieval_service/knowledge/service.py): encode/search/score/pack run on kb_workers threads at
    # kb_nice lower CPU priority, so heavy Searches queue there and the Draft path keeps a core. At most
    # kb_workers + kb_queue KB calls are admitted (and never more than workers - 2, since each waiting call holds a
    # gRPC handler thread); more get RESOURCE_EXHAUSTED at once.
    kb_workers: int = 1
    kb_queue: int = 4
    # Exact Searches queued for the executor at the same time run as one batched search (knowledge/coalesce.py):
    # a scan costs about the same for 1 and 4 queries, and the executor runs one call at a time.
    kb_coalesce: bool = True
    kb_nice: int = 10
    # Seconds of JIT warm-up for the Lucene search/scoring paths before SERVING (cold calls are much slower).
    kb_warmup_s: float = 10.0
    # Verify every KB file against kb.json's checksums before SERVING (remembered by identity in verify_cache).
    kb_verify: bool = True
    # kNN-LM datastores (tools/knn_build.py), comma-separated directories: each is served
    # as a named vector index (its knn.json name, default "knnlm"; edr = exact L2, adr = its HNSW), with or
    # without a knowledge base.
    kb_knn_datastores: str = ""
    # Knowledge base in PostgreSQL + pgvector (kb = postgresql://...; knowledge/pg.py, docs/postgres.md): the table,
    # the connection pool (one connection per concurrent KB call; the executor runs kb_workers at a time), how long
    # a call waits for a connection, and the statement_timeout of calls that carry no gRPC deadline.
    kb_pg_table: str = "ragserve_kb"
    kb_pg_pool: int = 4
    kb_pg_connect_timeout_s: float = 5.0
    kb_pg_statement_timeout_ms: float = 30_000.0
    kb_pg_health_s: float = 2.0
