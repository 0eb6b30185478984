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
    # Backpressure: gRPC rejects calls beyond this many in flight with RESOURCE_EXHAUSTED.
    max_concurrent_rpcs: int = 64
    workers: int = 8
    # Seconds in-flight calls get to finish after SIGTERM.
    grace_s: float = 5.0
    max_message_bytes: int = 64 << 20

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RetrievalConfig":
        return config_util.from_env(cls, _ENV_PREFIX, env)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "RetrievalConfig":
        return config_util.from_args(cls, _ENV_PREFIX, argv, "python -m retrieval_service.server",
                                     "Retrieval gRPC service: draft trees and knowledge-base search")
