"""Retrieval service configuration: one dataclass, built at the edge from CLI flags or environment.

Every field can be set by an environment variable RAGSERVE_RETRIEVAL_<FIELD> (upper case), which is how
docker-compose configures the service; CLI flags override the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving import config_util

_ENV_PREFIX = "RAGSERVE_RETRIEVAL_"


@dataclass
class RetrievalConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # Suffix-array datastore directory (single shard or a directory of shards); "" = no datastore.
    datastore: str = ""
    # Knowledge base directory (passages + dense/sparse indexes); "" = no knowledge base.
    kb: str = ""
    # CREST n-gram store (Draft source "crest"): a store file (embedded, memory-mapped) or a redis:// URL, then
    # crest_namespace names the store inside Redis. crest_fallback: an embedded copy of the same store that
    # answers while Redis is unavailable ("" = such drafts answer UNAVAILABLE and the worker decodes that step
    # autoregressively). crest_timeout_ms bounds every Redis call. "" = no CREST store.
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
    # (measured on the shared 2-core box: exact search of 1 query 0.7 ms with 1 thread, 50 ms with 2).
    # Concurrent requests still run in parallel on the gRPC worker threads.
    kb_omp_threads: int = 1
    # HNSW efSearch when a request leaves it 0; exact re-scoring of k + margin candidates per query.
    kb_ef_search: int = 128
    kb_rescore_margin: int = 16
    kb_query_cache: int = 4096
    # Max heap of the in-process JVM (Lucene); "" = the JVM default (1/4 of RAM).
    kb_jvm_heap: str = ""
    kb_limit_k: int = 1024  # kNN-LM asks for up to 1024 neighbours (Khandelwal et al.'s k)
    kb_limit_ids: int = 10_000
    kb_limit_query_chars: int = 10_000
    # Seconds of JIT warm-up for the Lucene search/scoring paths before SERVING (cold calls are ~5x slower).
    kb_warmup_s: float = 10.0
    # Re-hash passages.jsonl at open and compare with the manifest (catches a swapped or edited file).
    kb_verify: bool = True
    # kNN-LM datastores (retrieval_service/knowledge/knn_build.py), comma-separated directories: each is served
    # as a named vector index (its knn.json name, default "knnlm"; edr = exact L2, adr = its HNSW), with or
    # without a knowledge base.
    kb_knn_datastores: str = ""
    # Operations (serving/metrics.py, serving/security.py). Prometheus /metrics port on `host`; 0 = off.
    metrics_port: int = 0
    # Bearer token every RPC must carry (`authorization: Bearer <token>`; health is exempt); "" = off.
    # auth_token_file (e.g. /run/secrets/ragserve_token) wins over auth_token.
    auth_token: str = ""
    auth_token_file: str = ""
    # TLS: PEM certificate + key; tls_client_ca also requires client certificates signed by it. "" = plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RetrievalConfig":
        return config_util.from_env(cls, _ENV_PREFIX, env)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "RetrievalConfig":
        return config_util.from_args(cls, _ENV_PREFIX, argv, "python -m retrieval_service.server",
                                     "Retrieval gRPC service: draft trees and knowledge-base search")
