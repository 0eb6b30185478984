"""OpenAI-compatible HTTP gateway in front of ragserve generation workers.

    python -m gateway.server --host 127.0.0.1 --port 8000 --workers 127.0.0.1:50052[,HOST:PORT...]
    python -m gateway.server --workers-dns generation-headless:50052        # every A record, re-resolved

API keys: --api-keys-file FILE and/or RAGSERVE_GATEWAY_API_KEYS=key1,key2 (none = open, and the log says so).
Workers with TLS and a token: --worker-tls-ca ca.pem --worker-auth-token-file token (as the worker calls retrieval).
docs/gateway.md has the endpoints, parameters, routing and errors.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import threading
from dataclasses import dataclass

import uvicorn
import uvloop

from gateway.app import create_app
from gateway.config import GatewayConfig

log = logging.getLogger("gateway")


def _uvicorn_config(cfg: GatewayConfig, app) -> uvicorn.Config:
    # uvloop and httptools: the event loop and HTTP parser in C (the per-request overhead budget is ~1 ms).
    # proxy_headers off: nothing here reads the client's address or scheme, so uvicorn's X-Forwarded-* middleware
    # would only be one more layer on every request.
    return uvicorn.Config(app, host=cfg.host, port=cfg.port, loop="uvloop", http="httptools", lifespan="on",
                          access_log=False, proxy_headers=False, log_level=cfg.log_level,
                          timeout_graceful_shutdown=30)


@dataclass
class RunningGateway:
    """A gateway serving on its own thread and event loop (tests, benchmarks)."""
    server: uvicorn.Server
    thread: threading.Thread
    port: int
    app: object

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_in_thread(cfg: GatewayConfig, ready_timeout_s: float = 30.0) -> RunningGateway:
    """Serve on a background thread; cfg.port 0 = a free loopback port (bound here, handed to uvicorn)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    port = sock.getsockname()[1]
    app = create_app(cfg)
    server = uvicorn.Server(_uvicorn_config(cfg, app))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  (not the main thread)

    def run() -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(server.serve(sockets=[sock]))

    thread = threading.Thread(target=run, name="gateway", daemon=True)
    thread.start()
    waited = 0.0
    while not server.started:
        if not thread.is_alive() or waited > ready_timeout_s:
            raise RuntimeError("the gateway did not start (see the log)")
        threading.Event().wait(0.02)
        waited += 0.02
    return RunningGateway(server, thread, port, app)


def main(argv: list[str] | None = None) -> None:
    cfg = GatewayConfig.from_args(argv)
    cfg.configure_logging()
    if not cfg.worker_list() and not cfg.workers_dns:
        log.error("no workers: give --workers HOST:PORT[,...] or --workers-dns NAME:PORT")
        sys.exit(2)
    try:
        cfg.keys()
    except OSError as e:
        log.error("api_keys_file: %s", e)
        sys.exit(2)
    log.info("gateway on http://%s:%d, workers %s", cfg.host, cfg.port,
             ",".join(cfg.worker_list() + ([f"dns:{cfg.workers_dns}"] if cfg.workers_dns else [])))
    uvicorn.Server(_uvicorn_config(cfg, create_app(cfg))).run()


if __name__ == "__main__":
    main()
