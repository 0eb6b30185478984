"""Local launcher: the docker-compose topology as processes on loopback, with the same health gating.

    python -m serving.launcher up   [--datastore DIR] [--kb DIR] [--model DIR]   # start, wait for SERVING
    python -m serving.launcher down                                              # SIGTERM, wait, clean up
    python -m serving.launcher status

Each service is started only after the ones it depends on report SERVING through grpc.health.v1
(retrieval -> generation), exactly like `depends_on: condition: service_healthy`. State (pids, ports, log
files) lives in $RAGSERVE_HOME/run/launcher.json so `down` works from another shell.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serving.grpc_shell import wait_until_serving


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

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Topology:
    procs: list[Proc] = field(default_factory=list)

    def get(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([asdict(p) for p in self.procs], indent=1))
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


def start_process(name: str, argv: list[str], port: int, log_dir: Path, env: dict[str, str] | None = None) -> Proc:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as fh:
        p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             start_new_session=True)
    return Proc(name=name, pid=p.pid, port=port, log=str(log), argv=argv)


def wait_healthy(proc: Proc, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(proc.pid):
            tail = Path(proc.log).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{proc.name} exited during start-up; log {proc.log}:\n{tail}")
        if wait_until_serving(proc.address, timeout_s=1.0):
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


def up(*, datastore: str = "", kb: str = "", model: str = "", dtype: str = "bf16", retrieval_port: int = 0,
       generation_port: int = 0, state: Path | None = None, timeout_s: float = 300.0,
       extra_retrieval: list[str] | None = None, extra_generation: list[str] | None = None) -> Topology:
    """Start retrieval, wait for SERVING, then start generation pointed at it and wait again."""
    state = state or _home() / "run" / "launcher.json"
    existing = Topology.load(state)
    if any(_alive(p.pid) for p in existing.procs):
        raise RuntimeError(f"services already running (state {state}); run `python -m serving.launcher down` first")
    log_dir = state.parent / "logs"
    rport = retrieval_port or free_port()
    retrieval_argv = [sys.executable, "-m", "retrieval_service.server", "--port", str(rport)]
    if datastore:
        retrieval_argv += ["--datastore", datastore]
    if kb:
        retrieval_argv += ["--kb", kb]
    topo = Topology()
    try:
        topo.procs.append(start_process("retrieval", retrieval_argv + list(extra_retrieval or []), rport, log_dir))
        topo.save(state)
        wait_healthy(topo.get("retrieval"), timeout_s)
        gport = generation_port or free_port()
        gen_argv = [sys.executable, "-m", "generation_service.server", "--port", str(gport),
                    "--retrieval", f"127.0.0.1:{rport}", "--dtype", dtype]
        if model:
            gen_argv += ["--model", model]
        topo.procs.append(start_process("generation", gen_argv + list(extra_generation or []), gport, log_dir))
        topo.save(state)
        wait_healthy(topo.get("generation"), timeout_s)
    except BaseException:
        down(state=state)
        raise
    return topo


def down(*, state: Path | None = None, grace_s: float = 30.0) -> None:
    """Stop in reverse dependency order (generation drains first, then retrieval)."""
    state = state or _home() / "run" / "launcher.json"
    topo = Topology.load(state)
    for proc in reversed(topo.procs):
        stop_process(proc, grace_s)
    if state.exists():
        state.unlink()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m serving.launcher", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("--datastore", default="")
    u.add_argument("--kb", default="")
    u.add_argument("--model", default="")
    u.add_argument("--dtype", default="bf16")
    u.add_argument("--retrieval-port", type=int, default=50051)
    u.add_argument("--generation-port", type=int, default=50052)
    sub.add_parser("down")
    sub.add_parser("status")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        topo = up(datastore=args.datastore, kb=args.kb, model=args.model, dtype=args.dtype,
                  retrieval_port=args.retrieval_port, generation_port=args.generation_port)
        for p in topo.procs:
            print(f"{p.name:<11} SERVING on {p.address}  pid {p.pid}  log {p.log}")
    elif args.cmd == "down":
        down()
        print("stopped")
    else:
        topo = Topology.load(_home() / "run" / "launcher.json")
        for p in topo.procs:
            print(f"{p.name:<11} {'up' if _alive(p.pid) else 'DOWN'}  {p.address}  pid {p.pid}")
        if not topo.procs:
            print("nothing running")


if __name__ == "__main__":
    main()
