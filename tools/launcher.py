"""Local launcher: the docker-compose topology as processes on loopback, with the same health gating.

    python -m tools.launcher up   [--datastore DIR] [--kb DIR] [--model DIR]   # start, wait for SERVING
                                    [--replicas N] [--redis] [--token T]         # like docker-compose.yml
                                    [--gateway-port 8000 | --no-gateway] [--api-key K]
    python -m tools.launcher down                                              # SIGTERM, wait, clean up
    python -m tools.launcher status

Each service is started only after the ones it depends on report healthy: redis (PING) -> retrieval
replicas (grpc.health.v1 SERVING) -> generation -> the OpenAI-compatible gateway (HTTP /ready: a worker
SERVING), exactly like `depends_on: condition: service_healthy`.
With several retrieval replicas the worker gets them comma-separated and round-robins (compose uses
dns:///retrieval:50051 instead). State (pids, ports, argv, log files) lives in
$RAGSERVE_HOME/run/launcher.json so `down` works from another shell and `restart()` can bring a killed
process back on its port.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from ragcore.grpc_shell import wait_until_serving


def _home() -> Path:
    return Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    pid: int
    port: int
    log: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    kind: str = "grpc"  # grpc (health-checked) | redis (PING) | http (GET /ready answers 200)
    metrics_port: int = 0  # Prometheus /metrics (0 = off)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Topology:
    procs: list[Proc] = field(default_factory=list)

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def retrieval(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("retrieval")]

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(p) for p in self.procs], indent=1))
        tmp.chmod(0o600)  # the services' environment may hold a bearer token
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path) -> "Topology":
        if not path.exists():
            return Topology()
        return Topology([Proc(**d) for d in json.loads(path.read_text())])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie child still "exists"; reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def start_process(name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None,
                  kind: str = "grpc") -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as fh:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             start_new_session=True)
    return Proc(name=name, pid=p.pid, port=port, log=str(log), argv=argv, env=dict(env or {}), kind=kind)


def _redis_ping(port: int) -> bool:
    import redis  # only with --redis

    try:
        return bool(redis.Redis(host="127.0.0.1", port=port, socket_timeout=1.0).ping())
    except redis.RedisError:
        return False


def _http_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 until a worker is SERVING
        return False


def wait_healthy(proc: Proc, timeout_s: float, credentials: grpc.ChannelCredentials | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(proc.pid):
            tail = Path(proc.log).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.name} exited during start-up; log {proc.log}:\n{tail}")
        if proc.kind in ("redis", "http"):
            if (_redis_ping if proc.kind == "redis" else _http_ready)(proc.port):
                return
            time.sleep(0.1)
        elif wait_until_serving(proc.address, timeout_s=1.0, credentials=credentials):
            return
    raise TimeoutError(f"{proc.name} did not report SERVING within {timeout_s:.0f} s (log {proc.log})")


def stop_process(proc: Proc, grace_s: float = 30.0) -> None:
    if not _alive(proc.pid):
        return
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(proc.pid):
        time.sleep(0.05)
    if _alive(proc.pid):
        os.kill(proc.pid, signal.SIGKILL)


def up(*, datastore: str = "", kb: str = "", model: str = "", dtype: str = "", retrieval_port: int = 0,
       generation_port: int = 0, state: Path | None = None, timeout_s: float = 300.0,
       extra_retrieval: list[str] | None = None, extra_generation: list[str] | None = None,
       replicas: int = 1, redis: bool = False, env: dict[str, str] | None = None,
       tls_ca: str = "", metrics: bool = False, generation: bool = True, gateway: bool = False,
       gateway_port: int = 0, extra_gateway: list[str] | None = None) -> Topology:
    """Start [redis,] the retrieval replicas, wait until healthy, then generation pointed at them, wait again,
    then (gateway=True) the HTTP gateway in front of the worker, gated on its /ready.

    dtype: the worker's --dtype ("" = its default: the fastest measured on this machine);
    env: extra environment of every service (e.g. RAGSERVE_*_AUTH_TOKEN); tls_ca: CA to verify the services'
    TLS certificates with during health gating (when they serve TLS); metrics: give every service a free
    Prometheus port (Proc.metrics_port); generation=False starts the retrieval side only; gateway_port 0 = a
    free port; extra_gateway: more gateway flags (e.g. --api-keys-file). The gateway serves /metrics itself.
    """
    if replicas < 1:
        raise ValueError(f"replicas: {replicas} must be >= 1")
    state = state or _home() / "run" / "launcher.json"
    existing = Topology.load(state)
    if any(_alive(p.pid) for p in existing.procs):
        raise RuntimeError(f"services already running (state {state}); run `python -m tools.launcher down` first")
    log_dir = state.parent / "logs"
    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    env = dict(env or {})
    topo = Topology()
    try:
        retrieval_env = dict(env)
        if redis:
            port = free_port()
            argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
            topo.procs.append(start_process("redis", argv, port, log_dir, kind="redis"))
            topo.save(state)
            wait_healthy(topo.get("redis"), timeout_s)
            retrieval_env.setdefault("RAGSERVE_RETRIEVAL_REDIS_URL", f"redis://127.0.0.1:{port}/0")
        targets = []
        for i in range(replicas):
            rport = (retrieval_port if i == 0 else 0) or free_port()
            argv = [sys.executable, "-m", "retrieval_service.server", "--port", str(rport)]
            if datastore:
                argv += ["--datastore", datastore]
            if kb:
                argv += ["--kb", kb]
            name = "retrieval" if i == 0 else f"retrieval-{i}"
            mport = free_port() if metrics else 0
            argv += ["--metrics-port", str(mport)] if mport else []
            topo.procs.append(start_process(name, argv + list(extra_retrieval or []), rport, log_dir, retrieval_env))
            topo.procs[-1].metrics_port = mport
            targets.append(f"127.0.0.1:{rport}")
        topo.save(state)
        for proc in topo.retrieval():  # started together, gated together (like replicas in compose)
            wait_healthy(proc, timeout_s, creds)
        if not generation:
            return topo
        gport = generation_port or free_port()
        gen_argv = [sys.executable, "-m", "generation_service.server", "--port", str(gport),
                    "--retrieval", ",".join(targets)] + (["--dtype", dtype] if dtype else [])
        if model:
            gen_argv += ["--model", model]
        mport = free_port() if metrics else 0
        gen_argv += ["--metrics-port", str(mport)] if mport else []
        topo.procs.append(start_process("generation", gen_argv + list(extra_generation or []), gport, log_dir, env))
        topo.procs[-1].metrics_port = mport
        topo.save(state)
        wait_healthy(topo.get("generation"), timeout_s, creds)
        if gateway:
            hport = gateway_port or free_port()
            gw_argv = [sys.executable, "-m", "gateway.server", "--host", "127.0.0.1", "--port", str(hport),
                       "--workers", f"127.0.0.1:{gport}"]
            if tls_ca:
                gw_argv += ["--worker-tls-ca", tls_ca]
            topo.procs.append(start_process("gateway", gw_argv + list(extra_gateway or []), hport, log_dir, env,
                                            kind="http"))
            topo.save(state)
            wait_healthy(topo.get("gateway"), timeout_s)
    except BaseException:
        down(state=state)
        raise
    return topo


def restart(name: str, *, state: Path | None = None, timeout_s: float = 300.0,
            tls_ca: str = "") -> Proc:
    """Start a stopped or killed service again with its argv, port and environment; wait until healthy."""
    state = state or _home() / "run" / "launcher.json"
    topo = Topology.load(state)
    old = topo.get(name)
    deadline = time.monotonic() + 5.0  # a process just killed may not have exited yet
    while _alive(old.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(old.pid):
        raise RuntimeError(f"{name} (pid {old.pid}) is still running")
    new = start_process(name, old.argv, old.port, Path(old.log).parent, old.env, old.kind)
    new.metrics_port = old.metrics_port
    topo.procs[topo.procs.index(old)] = new
    topo.save(state)
    creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
    wait_healthy(new, timeout_s, creds)
    return new


def down(*, state: Path | None = None, grace_s: float = 30.0) -> None:
    """Stop in reverse dependency order (the gateway first, then generation drains, then retrieval)."""
    state = state or _home() / "run" / "launcher.json"
    topo = Topology.load(state)
    for proc in reversed(topo.procs):
        stop_process(proc, grace_s)
    if state.exists():
        state.unlink()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.launcher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("--datastore", default="",
                   help="suffix-array datastore directory for REST drafting (\"\" = the service default)")
    u.add_argument("--kb", default="", help="knowledge base directory for RaLMSpec / Search (\"\" = none)")
    u.add_argument("--model", default="", help="local HF model directory (\"\" = the worker's default)")
    u.add_argument("--dtype", default="", help="worker dtype (default: the worker's own, measured on this machine)")
    u.add_argument("--retrieval-port", type=int, default=50051, help="retrieval service port on 127.0.0.1")
    u.add_argument("--generation-port", type=int, default=50052, help="generation service port on 127.0.0.1")
    u.add_argument("--replicas", type=int, default=1, help="retrieval replicas (the worker round-robins)")
    u.add_argument("--redis", action="store_true", help="also start a redis-server on loopback (CREST backend)")
    u.add_argument("--token", default="", help="bearer token both services require (and the worker sends)")
    u.add_argument("--metrics", action="store_true", help="Prometheus endpoint on a free port per service")
    u.add_argument("--gateway-port", type=int, default=8000,
                   help="port of the OpenAI-compatible HTTP gateway on 127.0.0.1 (0 = a free port)")
    u.add_argument("--no-gateway", action="store_true", help="start retrieval and the worker only")
    u.add_argument("--api-key", action="append", default=[],
                   help="an API key the gateway requires as 'Authorization: Bearer KEY' (repeatable; none = the "
                        "gateway's own default)")
    sub.add_parser("down")
    sub.add_parser("status")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        env = {}
        if args.token:
            env = {"RAGSERVE_RETRIEVAL_AUTH_TOKEN": args.token, "RAGSERVE_GENERATION_AUTH_TOKEN": args.token,
                   "RAGSERVE_GENERATION_RETRIEVAL_AUTH_TOKEN": args.token,
                   "RAGSERVE_GATEWAY_WORKER_AUTH_TOKEN": args.token}
        if args.api_key:
            env["RAGSERVE_GATEWAY_API_KEYS"] = ",".join(args.api_key)
        topo = up(datastore=args.datastore, kb=args.kb, model=args.model, dtype=args.dtype,
                  retrieval_port=args.retrieval_port, generation_port=args.generation_port,
                  replicas=args.replicas, redis=args.redis, env=env, metrics=args.metrics,
                  gateway=not args.no_gateway, gateway_port=args.gateway_port)
        for p in topo.procs:
            extra = f"  metrics http://127.0.0.1:{p.metrics_port}/metrics" if p.metrics_port else ""
            state = {"redis": "READY", "http": "READY"}.get(p.kind, "SERVING")
            where = f"http://{p.address}/v1" if p.kind == "http" else p.address
            print(f"{p.name:<12} {state} on {where}  pid {p.pid}  log {p.log}{extra}")
    elif args.cmd == "down":
        down()
        print("stopped")
    else:
        topo = Topology.load(_home() / "run" / "launcher.json")
        for p in topo.procs:
            print(f"{p.name:<12} {'up' if _alive(p.pid) else 'DOWN'}  {p.address}  pid {p.pid}")
        if not topo.procs:
            print("nothing running")


if __name__ == "__main__":
    main()
