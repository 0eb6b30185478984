"""Gateway configuration: one dataclass, built at the edge from CLI flags or environment (RAGSERVE_GATEWAY_<FIELD>),
passed explicitly."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Mapping

from ragcore import config_util

_ENV_PREFIX = "RAGSERVE_GATEWAY_"

FLAG_HELP = {
    "host": "address the HTTP server binds to (0.0.0.0 = every interface)",
    "port": "HTTP port (0 = a free port)",
    "workers": "generation workers, HOST:PORT[,HOST:PORT...]",
    "workers_dns": "NAME:PORT resolved to every A/AAAA record (a Kubernetes headless Service), re-resolved every "
                   "--dns-refresh-s; adds to --workers",
    "dns_refresh_s": "seconds between resolutions of --workers-dns",
    "api_keys": "comma-separated API keys clients must send as 'Authorization: Bearer KEY' (\"\" and no file = open)",
    "api_keys_file": "file holding API keys, one per line or comma-separated (# comments); adds to --api-keys",
    "model_name": "the model id /v1/models lists and requests must name (\"\" = the worker's model directory name)",
    "worker_auth_token": "bearer token sent to the workers (their --auth-token)",
    "worker_auth_token_file": "file holding the workers' token (wins over --worker-auth-token)",
    "worker_tls_ca": "PEM CA to trust for the workers' TLS (\"\" = plaintext unless a cert is set)",
    "worker_tls_cert": "PEM client certificate for mutual TLS with the workers",
    "worker_tls_key": "PEM private key of --worker-tls-cert",
    "worker_tls_server_name": "TLS name to check the workers' certificates against (\"\" = the host of each address)",
    "affinity_chars": "characters of a prompt's stable prefix hashed to pick its worker (prefix affinity)",
    "busy_inflight": "requests in flight on a worker above which a new request goes to the least-loaded one instead",
    "request_timeout_s": "deadline of one generation on the worker, seconds (a slower one answers 504)",
    "max_body_bytes": "largest request body, bytes (larger: 413)",
    "max_n": "largest n (choices per request)",
    "sse_ping_s": "seconds between keep-alive comment lines on a stream (proxies close silent connections; 0 = none)",
    "log_level": "log verbosity: debug | info | warning | error",
}


@dataclass
class GatewayConfig:
    ENV_PREFIX: ClassVar[str] = _ENV_PREFIX
    PROG: ClassVar[str] = "python -m gateway.server"
    DESCRIPTION: ClassVar[str] = "OpenAI-compatible HTTP gateway in front of ragserve generation workers"
    FLAG_HELP: ClassVar[Mapping[str, str]] = FLAG_HELP

    host: str = "127.0.0.1"
    port: int = 8000
    workers: str = ""
    workers_dns: str = ""
    dns_refresh_s: float = 10.0
    api_keys: str = ""
    api_keys_file: str = ""
    model_name: str = ""
    # How the gateway calls the workers, mirroring how a worker calls the retrieval service.
    worker_auth_token: str = ""
    worker_auth_token_file: str = ""
    worker_tls_ca: str = ""
    worker_tls_cert: str = ""
    worker_tls_key: str = ""
    worker_tls_server_name: str = ""
    # ~4 characters a token: 1024 characters are about the first 256-token prefill chunk a worker's prefix cache keys.
    affinity_chars: int = 1024
    # A worker batches up to max_batch (16) requests per pass; past half of that a request waits less elsewhere.
    busy_inflight: int = 8
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    sse_ping_s: float = 15.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("affinity_chars", "busy_inflight", "max_body_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("dns_refresh_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.sse_ping_s < 0:
            raise ValueError(f"sse_ping_s: must be >= 0, got {self.sse_ping_s}")
        if self.workers_dns and ":" not in self.workers_dns:
            raise ValueError(f"workers_dns: {self.workers_dns!r} is not NAME:PORT")
        for target in self.worker_list():
            if target.rpartition(":")[0] == "" or not target.rpartition(":")[2].isdigit():
                raise ValueError(f"workers: {target!r} is not HOST:PORT")

    def configure_logging(self) -> None:
        """The process's log format and level; called once by the entry point."""
        if self.log_level not in config_util.LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {', '.join(config_util.LOG_LEVELS)}")
        logging.basicConfig(level=self.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")

    def worker_list(self) -> list[str]:
        return [w.strip() for w in self.workers.split(",") if w.strip()]

    def keys(self) -> frozenset[str]:
        """The configured API keys (empty = the gateway is open)."""
        text = self.api_keys
        if self.api_keys_file:
            lines = Path(self.api_keys_file).read_text().splitlines()
            text += "," + ",".join(line for line in lines if not line.lstrip().startswith("#"))
        return frozenset(k.strip() for k in text.split(",") if k.strip())

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "GatewayConfig":
        return config_util.from_env(cls, cls.ENV_PREFIX, env)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "GatewayConfig":
        return config_util.from_args(cls, cls.ENV_PREFIX, argv, cls.PROG, cls.DESCRIPTION, cls.FLAG_HELP)
