"""A local Redis Cluster of redis-server processes on loopback (tests, the failover check), torn down afterwards.

    with LocalCluster(workdir, primaries=3, replicas=1) as cluster:   # 6 nodes, cluster-node-timeout 1000 ms
        cluster.url                      # redis+cluster://127.0.0.1:p1,...,127.0.0.1:p6
        port = cluster.primary_of_slot(slot)
        cluster.kill(port)               # SIGKILL; its replica is promoted after ~node timeout
        cluster.wait_until_ok()          # every slot served by a live primary, cluster_state:ok
        cluster.restart(port)            # comes back (same nodes.conf) as a replica of the promoted node
        cluster.reshard(from_port, to_port, 1000)   # move slots and their keys between primaries

No persistence (--save "", --appendonly no); each node has its own directory for its nodes.conf. Ports are free
loopback ports whose cluster bus port (+10000) is free too. Needs Debian's redis-server and redis-cli
(redis-tools), which `make system-packages` installs.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_BUS_OFFSET = 10000
SLOTS = 16384


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """count ports p in [20000, 30000) with p and its bus port p + 10000 both free on loopback."""
    rng = rng or random.Random()
    ports: list[int] = []
    for _ in range(10_000):
        p = rng.randrange(20000, 30000)
        if p not in ports and _bindable(p) and _bindable(p + _BUS_OFFSET):
            ports.append(p)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"found only {len(ports)} of {count} free port pairs for a local Redis Cluster")


def binaries() -> tuple[str, str] | None:
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    return (server, cli) if server and cli else None


class LocalCluster:
    def __init__(self, workdir: str | Path, *, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        if primaries < 3:
            raise ValueError(f"redis-cli --cluster create needs >= 3 primaries, got {primaries}")
        found = binaries()
        if found is None:
            raise FileNotFoundError("redis-server and redis-cli not found (Debian redis-server + redis-tools; "
                                    "`make system-packages`)")
        self.server_bin, self.cli_bin = found
        self.workdir = Path(workdir)
        self.primaries, self.replicas, self.node_timeout_ms = primaries, replicas, node_timeout_ms
        self.ports = free_cluster_ports(primaries * (1 + replicas))
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    # -- processes -------------------------------------------------------------------------------------------------

    def _start_node(self, port: int) -> None:
        d = self.workdir / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            [self.server_bin, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
             "--save", "", "--appendonly", "no", "--dir", str(d), "--protected-mode", "yes",
             "--logfile", str(d / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _client(self, port: int, timeout_s: float = 1.0):
        import redis

        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                           decode_responses=True)

    def _wait_ping(self, port: int, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self._client(port) as c:
                    if c.ping():
                        return
            except redis.RedisError:
                proc = self.procs.get(port)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode} (see "
                                       f"{self.workdir / str(port) / 'redis.log'})") from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def start(self, timeout_s: float = 60.0) -> "LocalCluster":
        try:
            for p in self.ports:
                self._start_node(p)
            for p in self.ports:
                self._wait_ping(p, timeout_s)
            subprocess.run([self.cli_bin, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
            self.wait_until_ok(timeout_s, replicas=self.replicas > 0)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, no handover: what a crashed host looks like)."""
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def restart(self, port: int, timeout_s: float = 60.0) -> None:
        """Start a killed node again on its port and nodes.conf: it rejoins (as a replica if it was failed over)."""
        self._start_node(port)
        self._wait_ping(port, timeout_s)

    def reshard(self, from_port: int, to_port: int, slots: int, timeout_s: float = 120.0) -> None:
        """Move `slots` hash slots (with their keys) from one primary to another, as an operator would
        (redis-cli --cluster reshard): clients see MOVED, ASK and TRYAGAIN while it runs."""
        ids = {}
        for port in (from_port, to_port):
            with self._client(port) as c:
                ids[port] = c.execute_command("CLUSTER", "MYID")
        done = subprocess.run([self.cli_bin, "--cluster", "reshard", f"127.0.0.1:{to_port}", "--cluster-from",
                        ids[from_port], "--cluster-to", ids[to_port], "--cluster-slots", str(slots),
                        "--cluster-yes"], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"redis-cli --cluster reshard failed: {(done.stdout + done.stderr)[-1500:]}")

    def stop(self) -> None:
        for port in list(self.procs):
            proc = self.procs.pop(port)
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- state -----------------------------------------------------------------------------------------------------

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen by a live node: [{port, role, master_port, flags, slots}]."""
        import redis

        for port in self.procs:
            try:
                with self._client(port) as c:
                    text = c.execute_command("CLUSTER", "NODES")
            except redis.RedisError:
                continue
            if isinstance(text, dict):  # some redis-py versions parse the reply into a dict keyed by address
                text = "\n".join(f"{v['node_id']} {k} {v['flags']} {v['master_id']} 0 0 0 "
                                 f"{'connected' if v['connected'] else 'disconnected'} "
                                 f"{' '.join('-'.join(s) for s in v['slots'])}" for k, v in text.items())
            rows, ids = [], {}
            for line in text.strip().splitlines():
                f = line.split()
                ids[f[0]] = int(f[1].split("@")[0].rsplit(":", 1)[1])
                rows.append(f)
            return [{"port": ids[f[0]], "flags": f[2].split(","),
                     "role": "primary" if "master" in f[2] else "replica",
                     "master_port": ids.get(f[3]), "slots": f[8:]} for f in rows]
        raise RuntimeError("no node of the local Redis Cluster answers")

    def primary_ports(self) -> list[int]:
        return [n["port"] for n in self.nodes() if n["role"] == "primary" and "fail" not in n["flags"]
                and n["slots"]]

    def primary_of_slot(self, slot: int) -> int:
        for n in self.nodes():
            if n["role"] != "primary" or "fail" in n["flags"]:
                continue
            for r in n["slots"]:
                lo, _, hi = r.partition("-")
                if r[0] != "[" and int(lo) <= slot <= int(hi or lo):
                    return n["port"]
        raise LookupError(f"no live primary serves slot {slot}")

    def _state(self, port: int) -> str:
        info = self._client(port).execute_command("CLUSTER", "INFO")
        if isinstance(info, dict):
            return str(info.get("cluster_state", ""))
        return next((line.split(":", 1)[1].strip() for line in info.splitlines()
                     if line.startswith("cluster_state:")), "")

    def wait_until_ok(self, timeout_s: float = 30.0, *, replicas: bool = False) -> float:
        """Until every live node says cluster_state:ok and its slot map's primaries are all alive (and, with
        replicas=True, every primary has a live replica whose replication link is up: one that can be promoted);
        returns the seconds waited."""
        import redis

        t0 = time.monotonic()
        while True:
            try:
                ok = all(self._state(p) == "ok" for p in self.procs)
                if ok:
                    nodes = self.nodes()
                    alive = set(self.procs)
                    prim = [n for n in nodes if n["role"] == "primary" and n["slots"]]
                    ok = len(prim) == self.primaries and all(n["port"] in alive for n in prim)
                    if ok and replicas:
                        backed = {n["master_port"] for n in nodes if n["role"] == "replica" and n["port"] in alive
                                  and "fail" not in n["flags"]}
                        ok = all(n["port"] in backed for n in prim) and all(
                            self._client(n["port"]).info("replication").get("master_link_status") == "up"
                            for n in nodes if n["role"] == "replica" and n["port"] in alive)
                if ok:
                    return time.monotonic() - t0
            except redis.RedisError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"local Redis Cluster not ok after {timeout_s:.0f} s: {self.nodes()}")
            time.sleep(0.1)
