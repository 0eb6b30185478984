"""Fixtures for CREST: tiny corpora, stores built from them, a real redis-server of our own on loopback (own free
port, no persistence) and a real 6-node Redis Cluster; tests that need Redis skip, saying why, only when the
binaries are absent."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from retrieval_service.datastore.shards import Shard
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

TID = "test-tokenizer"
# Socket timeout of the Redis clients in tests that are not about timeouts: the production default (50 ms) is
# exceeded by an ordinary reply on a loaded shared machine, which would read as an outage.
REDIS_TIMEOUT_MS = 5000.0
VOCAB = 40


def datastore_of(shard_docs: list[list[list[int]]], vocab_size: int = VOCAB) -> SuffixArrayDatastore:
    shards = [Shard.from_documents([np.array(d, np.int64) for d in docs], vocab_size=vocab_size, tokenizer_id=TID)
              for docs in shard_docs]
    return SuffixArrayDatastore(shards)


def corpus(seed: int = 0, docs: int = 60, vocab: int = VOCAB) -> list[list[int]]:
    """Documents with repeated phrases (so n-grams recur and trees branch), deterministic."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, vocab, rng.integers(2, 7)).tolist() for _ in range(12)]
    out = []
    for _ in range(docs):
        d: list[int] = []
        for _ in range(rng.integers(1, 12)):
            d += phrases[rng.integers(0, len(phrases))] if rng.random() < 0.7 else [int(rng.integers(0, vocab))]
        out.append(d)
    return out


@pytest.fixture(scope="session")
def small_ds() -> SuffixArrayDatastore:
    docs = corpus()
    return datastore_of([docs[:30], docs[30:]])  # two shards: counting merges them


# ----------------------------------------------------------------------------------------------------------------
# Redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process of our own: loopback, free port, no RDB/AOF persistence."""

    def __init__(self, binary: str, workdir: Path):
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(200):  # up to ~10 s on a loaded machine
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                time.sleep(0.05)
        else:
            raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (Debian package redis-server; `make system-packages`)")
    server = RedisServer(binary, tmp_path).start()
    yield server
    server.stop()


# ----------------------------------------------------------------------------------------------------------------
# Redis Cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """6 redis-server nodes on loopback (3 primaries, 3 replicas, cluster-node-timeout 1000 ms), shared by the
    session; a test that kills a node restarts it and waits until every primary has a synced replica again."""
    from tools.redis_cluster import LocalCluster, binaries

    if binaries() is None:
        pytest.skip("redis-server / redis-cli not found (Debian redis-server + redis-tools; `make system-packages`)")
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"), primaries=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    yield cluster
    cluster.stop()
