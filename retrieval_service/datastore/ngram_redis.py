"""CREST store in Redis: the records of an embedded store, one key per n-gram; all suffix probes in one MGET.

    push_to_redis(EmbeddedNgramStore.open(path), "redis://127.0.0.1:6379/0", "crest:code")   # bulk, pipelined
    store = RedisNgramStore("redis://127.0.0.1:6379/0", "crest:code")
    tree = store.lookup(context_ids, max_nodes=64)   # same answer as the embedded store, bit for bit

Keys (ns = the namespace, one per store):
    {ns}:meta                 JSON: the embedded header plus "build"; written last (present = push finished)
    {ns}:{build}:zdict        the zstd dictionary of the payloads
    {ns}:{build}:ok           sentinel "1", fetched with every lookup
    {ns}:{build}:g:<key>      a payload (ngram_codec); <key> = the n token ids as little-endian token bytes
build = the store's content id (its checksums): re-pushing the same store rewrites the same keys; a new store
never mixes with an older one. Readers use the build named by meta; when the sentinel of their build is gone
(a new push dropped it, or Redis restarted empty) they re-read meta once and either switch or report the store
unavailable - never silently empty drafts.

Failures: any Redis error (refused, timeout, LOADING, auth) becomes StoreUnavailable, which the retrieval server
turns into UNAVAILABLE (and the generation worker into one autoregressive step). No retries and short socket
timeouts: a dead Redis costs one fast failure per lookup, not seconds of backoff.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Sequence

import numpy as np
from tqdm import tqdm

from ragcore.draft_tree import DraftTree
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    NgramStoreError,
    StoreUnavailable,
    TokenizerMismatch,
    _TreeDecoder,
    build_id,
    check_lookup_args,
)

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.:\-]{1,200}$")


def _client(url: str, timeout_ms: float):
    import redis  # optional backend: only a redis:// store needs the client
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    if not timeout_ms > 0:
        raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
    t = timeout_ms / 1e3
    return redis.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t, retry=Retry(NoBackoff(), 0),
                                health_check_interval=0, decode_responses=False)


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
        raise ValueError(f"namespace must be 1-200 characters of [A-Za-z0-9_.:-], got {namespace!r}")
    return namespace


class StoreHeaderFields:
    """What a server-held n-gram store reports from its build header (None until connected): the fields the
    retrieval service shows, shared by the single-server and the cluster store."""

    header: dict | None
    url: str
    namespace: str

    @property
    def tokenizer_id(self) -> str:
        return self.header["tokenizer_id"] if self.header else ""

    @property
    def vocab_size(self) -> int:
        return int(self.header["vocab_size"]) if self.header else 0

    @property
    def num_records(self) -> int:
        return int(self.header["num_records"]) if self.header else 0

    @property
    def bytes_on_disk(self) -> int:
        return int(self.header.get("file_bytes", 0)) if self.header else 0

    @property
    def path(self) -> str:
        return f"{self.url} {self.namespace}"


class RedisNgramStore(StoreHeaderFields):
    """Lookups against a store pushed with push_to_redis. Thread-safe (redis-py's connection pool)."""

    backend = "redis"

    def __init__(self, url: str, namespace: str, *, expected_tokenizer_id: str | None = None,
                 timeout_ms: float = 50.0):
        import redis  # optional backend: only a redis:// store needs the client

        self.url = url
        self.namespace = check_namespace(namespace)
        self.expected_tokenizer_id = expected_tokenizer_id
        self._redis_error = redis.RedisError
        self._client = _client(url, timeout_ms)
        self._lock = threading.Lock()
        self.header: dict | None = None
        self._decoder: _TreeDecoder | None = None
        self._prefix = b""
        self._ok = b""

    # -- connection ------------------------------------------------------------------------------------------------

    def _unavailable(self, e: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"CREST store {self.namespace!r} at {self.url}: Redis unavailable "
                                f"({type(e).__name__}: {e})")

    def connect(self) -> None:
        """Read meta and the dictionary (StoreUnavailable if Redis is down, NgramStoreError if no store is there)."""
        try:
            meta = self._client.get(f"{self.namespace}:meta")
            if meta is None:
                raise NgramStoreError(f"Redis at {self.url} holds no CREST store {self.namespace!r}; push one with "
                                      f"python -m retrieval_service.datastore.crest_build push")
            header = json.loads(meta)
            zdict = self._client.get(f"{self.namespace}:{header['build']}:zdict")
        except self._redis_error as e:
            raise self._unavailable(e) from None
        if zdict is None:
            raise NgramStoreError(f"CREST store {self.namespace!r} at {self.url} is incomplete (no dictionary)")
        self._use(header, zdict)

    def assume_header(self, header: dict, zdict: bytes) -> None:
        """Serve with a known store's header (its embedded copy) before Redis has answered once."""
        self._use({**header, "build": build_id(header)}, zdict)

    def _use(self, header: dict, zdict: bytes) -> None:
        if self.expected_tokenizer_id is not None and header["tokenizer_id"] != self.expected_tokenizer_id:
            raise TokenizerMismatch(f"CREST store {self.namespace!r} at {self.url} was built with tokenizer "
                                    f"{header['tokenizer_id']!r}, the caller uses {self.expected_tokenizer_id!r}")
        decoder = _TreeDecoder(header, zdict)
        with self._lock:
            self.header, self._decoder = header, decoder
            self._prefix = f"{self.namespace}:{header['build']}:g:".encode()
            self._ok = f"{self.namespace}:{header['build']}:ok".encode()

    def _ready(self) -> _TreeDecoder:
        if self._decoder is None:
            self.connect()
        return self._decoder

    # -- properties ------------------------------------------------------------------------------------------------

    @property
    def max_n(self) -> int:
        return self._ready().max_n

    def __repr__(self) -> str:
        return f"RedisNgramStore(url={self.url!r}, namespace={self.namespace!r}, ngrams={self.num_records:,})"

    # -- lookup ----------------------------------------------------------------------------------------------------

    def _keys(self, decoder: _TreeDecoder, ctx: np.ndarray) -> tuple[list[bytes], list[int]]:
        t = ctx.shape[0]
        ns = [n for n in range(min(decoder.max_n, t), 0, -1) if decoder.present[n]]
        le = decoder.tok.newbyteorder("<")
        return [self._prefix + ctx[t - n:].astype(le).tobytes() for n in ns], ns

    def lookup(self, context_ids, max_nodes: int = 64) -> DraftTree:
        """Tree of the longest stored suffix (one MGET for every suffix length), trimmed to max_nodes."""
        return self.lookup_batch([context_ids], max_nodes)[0]

    def lookup_batch(self, contexts: Sequence, max_nodes: int = 64) -> list[DraftTree]:
        """One round trip for the whole batch (a pipeline of MGETs)."""
        for attempt in range(2):
            decoder = self._ready()
            ctxs = [check_lookup_args(c, max_nodes, decoder.max_n) for c in contexts]
            plans = [self._keys(decoder, c) for c in ctxs]
            try:
                if len(plans) == 1:
                    replies = [self._client.mget([self._ok, *plans[0][0]])]
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for keys, _ in plans:
                        pipe.mget([self._ok, *keys])
                    replies = pipe.execute()
            except self._redis_error as e:
                raise self._unavailable(e) from None
            if all(r[0] is not None for r in replies):
                return [self._pick(decoder, r[1:], ns, max_nodes) for r, (_, ns) in zip(replies, plans)]
            # Our build's sentinel is gone: a newer push replaced it, or Redis restarted empty.
            old = self.header["build"]
            try:
                self.connect()
            except NgramStoreError as e:
                raise StoreUnavailable(str(e)) from None
            if self.header["build"] == old:
                break
        raise StoreUnavailable(f"CREST store {self.namespace!r} at {self.url}: build {self.header['build']} is "
                               f"missing its keys (Redis restarted empty?); push the store again")

    @staticmethod
    def _pick(decoder: _TreeDecoder, values: list, ns: list[int], max_nodes: int) -> DraftTree:
        for n, v in zip(ns, values):
            if v is not None:
                return decoder.tree(v, n, max_nodes)
        return DraftTree.empty()

    def warmup(self) -> None:
        decoder = self._ready()
        self.lookup(np.zeros(max(decoder.max_n, 1), np.int32), 64)

    def ping(self) -> bool:
        try:
            return bool(self._client.ping())
        except self._redis_error:
            return False

    def close(self) -> None:
        self._client.close()


def push_to_redis(store: EmbeddedNgramStore, url: str, namespace: str, *, batch: int = 2000,
                  drop_old: bool = True, timeout_ms: float = 10_000.0, progress: bool = True) -> dict:
    """Bulk-load an embedded store into Redis with pipelined writes; meta goes last (the switch-over).

    drop_old: afterwards delete the keys of other builds under the same namespace (readers of an old build
    switch to the new one on their next lookup).
    """
    import redis  # optional backend: only a redis:// store needs the client
    check_namespace(namespace)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    client = _client(url, timeout_ms)
    build = build_id(store.header)
    prefix = f"{namespace}:{build}:".encode()
    written = 0
    try:
        pipe = client.pipeline(transaction=False)
        with tqdm(total=store.num_records, unit="ngram", desc="push to redis", disable=not progress) as bar:
            tok = np.dtype(store.header["token_dtype"]).newbyteorder("<")
            for key, payload in store.items():
                pipe.set(prefix + b"g:" + key.astype(tok).tobytes(), payload)
                written += 1
                if written % batch == 0:
                    pipe.execute()
                    bar.update(batch)
            pipe.set(prefix + b"zdict", store.zdict())
            pipe.set(prefix + b"ok", b"1")
            pipe.execute()
            bar.update(written % batch)
        meta = {**store.header, "build": build, "file_bytes": store.bytes_on_disk}
        client.set(f"{namespace}:meta", json.dumps(meta, sort_keys=True))
        dropped = 0
        if drop_old:
            # Only keys of this namespace's builds: "{ns}:<32 hex>:..." (another namespace that merely starts
            # with "{ns}:" has no 32-hex segment there).
            own = re.compile(re.escape(namespace).encode() + rb":([0-9a-f]{32}):")
            doomed = [k for k in client.scan_iter(match=f"{namespace}:{'?' * 32}:*", count=10_000)
                      if (m := own.match(k)) and m.group(1) != build.encode()]
            for i in range(0, len(doomed), 10_000):
                dropped += client.unlink(*doomed[i:i + 10_000])
    except redis.RedisError as e:
        raise StoreUnavailable(f"push to {url} failed: {type(e).__name__}: {e}") from None
    finally:
        client.close()
    return {"namespace": namespace, "build": build, "ngrams": written, "dropped_keys": dropped}
