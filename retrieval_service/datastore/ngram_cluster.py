"""CREST store on Redis Cluster: the records of an embedded store spread over the cluster's primaries, one lookup
one slot (one MGET, one round trip); during a failover lookups degrade to no draft instead of failing.

    push_to_cluster(EmbeddedNgramStore.open(path), "redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "crest:code")
    store = ClusterNgramStore("redis+cluster://127.0.0.1:7000,127.0.0.1:7001", "crest:code")
    tree = store.lookup(context_ids, max_nodes=64)   # same answer as the embedded store, or empty while failing over

Keys (ns = the namespace, b = the build: the store's content id, as on a single node):
    ns:meta                 JSON: the embedded header plus "build" and "layout"; written last (present = pushed)
    ns:b:zdict              the zstd dictionary of the payloads
    ns:b:last               bitmap over the vocabulary: bit v set = some stored n-gram ends with token v
    ns:b:pushed             records written so far (where an interrupted push resumes)
    ns:{b.v}:ok             sentinel of token v (one per set bit of `last`), fetched with every lookup
    ns:{b.v}:g:<key>        a payload (ngram_codec); <key> = the n token ids, little-endian, ending with v

Why the hash tag is the n-gram's last token. A lookup probes the context's suffixes (n = max_n..1), and every one
of them ends with the context's last token v: tagged with {b.v}, all probes and the sentinel hash to one slot, so a
lookup is one MGET to one primary (one round trip, as on a single node) and a DraftBatch is one pipeline, one
round trip per primary it touches, sent in parallel. The vocabulary hashes over all 16384 slots, so keys and
lookups spread over every primary. The trade-off is skew: a lookup's primary is chosen by its last token, and
last tokens follow the corpus's Zipf curve (newline, indentation, ")" ...), so the slot of a very frequent token
is hot and its primary serves a larger share of lookups than the others. The alternatives are worse on one side:
one tag per store ({ns}) puts every key and lookup on one primary (no spreading at all); no tag (each n-gram
hashed on its own) spreads perfectly but turns one lookup into up to max_n keys on up to every primary (a round
trip per primary, per-slot sentinels, and a tree assembled from answers that can fail independently). A
context whose last token ends no stored n-gram (its bit in `last` is clear) is answered without a round trip.

Failover. Replies never decide a draft unless they are whole: a lookup's probes and its sentinel travel in one
MGET, so either every probe is answered by the slot's current primary or the lookup fails. Connection errors,
timeouts, CLUSTERDOWN and an uncovered slot make that context's draft empty (counted per reason, reported through
on_degraded; with `fallback`, an embedded copy answers instead); MOVED/ASK are followed by the client within the
call (the slot's new owner answers). Socket timeouts are short and nothing is retried, so a dead primary costs a
lookup one fast failure, and the client re-reads the slot map after it, so lookups find the promoted replica as
soon as the cluster has one. A missing sentinel (the build was replaced by a newer push, or a primary came back
empty without a replica) first re-reads meta; if the build is unchanged the draft is empty ("missing"): a
partial store never answers with a shorter suffix's tree than the full store would.

Push. Content-addressed keys make a push idempotent; `ns:b:pushed` (advanced only after every primary's replica
acknowledged the batch, WAIT) makes an interrupted push resume where it stopped, so a failover during a push
loses nothing it has counted. Meta is written last, after the sentinels, the dictionary and the bitmap.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import unquote

import numpy as np
from tqdm import tqdm

from ragcore.draft_tree import DraftTree
from retrieval_service.datastore.ngram_redis import StoreHeaderFields, check_namespace
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    NgramStoreError,
    StoreUnavailable,
    TokenizerMismatch,
    _TreeDecoder,
    build_id,
    check_lookup_args,
)
from retrieval_service.datastore.shards import DatastoreError

log = logging.getLogger(__name__)

SCHEME = "redis+cluster://"
LAYOUT = "cluster-lasttoken-v1"
DEGRADE_REASONS = ("unavailable", "missing")
_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):([0-9]{1,5})$")
_LOG_EVERY_S = 10.0


def is_cluster_url(spec: str) -> bool:
    return spec.startswith(SCHEME)


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None

    def __str__(self) -> str:  # without credentials: it goes into logs and errors
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.nodes)


def parse_cluster_url(url: str) -> ClusterURL:
    """redis+cluster://[user:password@]host:port[,host:port...][/] -> startup nodes and credentials."""
    if not isinstance(url, str) or not is_cluster_url(url):
        raise ValueError(f"a Redis Cluster URL starts with {SCHEME}, got {url!r}")
    rest = url[len(SCHEME):].rstrip("/")
    username = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) or None)
    nodes = []
    for part in rest.split(","):
        m = _HOSTPORT.match(part.strip())
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"Redis Cluster URL {SCHEME}{rest}: {part!r} is not host:port (port 1-65535)")
        nodes.append((m.group(1).strip("[]"), int(m.group(2))))
    return ClusterURL(tuple(nodes), username, password)


def _errors() -> tuple[type[Exception], ...]:
    import redis
    from redis.exceptions import RedisClusterException

    return redis.RedisError, RedisClusterException


def _cluster_client(url: ClusterURL, timeout_ms: float):
    """A RedisCluster client that fails fast: short socket timeouts, no retries, partial slot maps accepted."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    if not timeout_ms > 0:
        raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
    t = timeout_ms / 1e3
    return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes], username=url.username,
                        password=url.password, socket_timeout=t, socket_connect_timeout=t,
                        retry=Retry(NoBackoff(), 0), require_full_coverage=False, decode_responses=False)


def tag_prefix(namespace: str, build: str, last_token: int) -> bytes:
    """Key prefix of every n-gram ending with last_token (the braces are the hash tag)."""
    return f"{namespace}:{{{build}.{int(last_token)}}}:".encode()


@dataclass(frozen=True)
class _Build:
    """Everything a lookup needs about the store being served, swapped atomically on a re-push."""

    header: dict
    decoder: _TreeDecoder
    last: np.ndarray  # bool [vocab_size]: some stored n-gram ends with this token
    prefix: str  # "ns:{build." (+ last token + "}:")

    def tag(self, last_token: int) -> bytes:
        return f"{self.prefix}{last_token}}}:".encode()


class ClusterNgramStore(StoreHeaderFields):
    """Lookups against a store pushed with push_to_cluster. Thread-safe; lookups never raise StoreUnavailable
    (failed contexts degrade to empty drafts, or to `fallback`'s answer), only bad arguments raise."""

    backend = "redis-cluster"

    def __init__(self, url: str, namespace: str, *, expected_tokenizer_id: str | None = None,
                 timeout_ms: float = 50.0, fallback: EmbeddedNgramStore | None = None,
                 on_degraded: Callable[[str, int], None] | None = None):
        self.cluster_url = parse_cluster_url(url)
        self.url = str(self.cluster_url)
        self.namespace = check_namespace(namespace)
        self.expected_tokenizer_id = expected_tokenizer_id
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
        self.timeout_ms = timeout_ms
        self.fallback = fallback
        self.on_degraded = on_degraded
        self._errors = _errors()
        self._client = None  # created on first use: the cluster may be down when the server starts
        self._lock = threading.Lock()
        self._build: _Build | None = None
        self.degraded = dict.fromkeys(DEGRADE_REASONS, 0)  # contexts answered without the cluster, by reason
        self.fallbacks = 0  # of those, answered by the fallback copy
        self._last_log = 0.0
        if fallback is not None:
            self.assume_header(fallback.header, fallback.zdict())

    # -- connection ------------------------------------------------------------------------------------------------

    def _unavailable(self, e: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"CREST store {self.namespace!r} at {self.url}: Redis Cluster unavailable "
                                f"({type(e).__name__}: {e})")

    def _cluster(self):
        client = self._client
        if client is None:
            try:
                client = _cluster_client(self.cluster_url, self.timeout_ms)
            except self._errors as e:
                raise self._unavailable(e) from None
            with self._lock:
                if self._client is None:
                    self._client = client
                else:
                    client.close()
                    client = self._client
        return client

    def connect(self) -> None:
        """Read meta, dictionary and last-token bitmap (StoreUnavailable if the cluster is down, NgramStoreError if
        no complete store is there, TokenizerMismatch if it was built for another tokenizer)."""
        client = self._cluster()
        try:
            meta = client.get(f"{self.namespace}:meta")
            if meta is None:
                raise NgramStoreError(f"Redis Cluster at {self.url} holds no CREST store {self.namespace!r}; push "
                                      f"one with python -m retrieval_service.datastore.crest_build push")
            header = json.loads(meta)
            if header.get("layout") != LAYOUT:
                raise NgramStoreError(f"CREST store {self.namespace!r} at {self.url} has key layout "
                                      f"{header.get('layout')!r}, this reader needs {LAYOUT!r}; push it again")
            zdict = client.get(f"{self.namespace}:{header['build']}:zdict")
            last = client.get(f"{self.namespace}:{header['build']}:last")
        except self._errors as e:
            raise self._unavailable(e) from None
        if zdict is None or last is None:
            raise NgramStoreError(f"CREST store {self.namespace!r} at {self.url} is incomplete (no dictionary or "
                                  f"last-token bitmap)")
        self._use(header, zdict, np.unpackbits(np.frombuffer(last, np.uint8), bitorder="little").astype(bool))

    def assume_header(self, header: dict, zdict: bytes) -> None:
        """Serve with a known store's header (its embedded copy) before the cluster has answered once: the
        fallback answers everything until connect() succeeds."""
        self._use({**header, "build": build_id(header), "layout": LAYOUT}, zdict, None)

    def _use(self, header: dict, zdict: bytes, last: np.ndarray | None) -> None:
        if self.expected_tokenizer_id is not None and header["tokenizer_id"] != self.expected_tokenizer_id:
            raise TokenizerMismatch(f"CREST store {self.namespace!r} at {self.url} was built with tokenizer "
                                    f"{header['tokenizer_id']!r}, the caller uses {self.expected_tokenizer_id!r}")
        if last is None:  # not read from the cluster yet: every lookup goes to the fallback until it is
            last = np.zeros(0, bool)
        build = _Build(header, _TreeDecoder(header, zdict), last, f"{self.namespace}:{{{header['build']}.")
        with self._lock:
            self._build = build

    def _ready(self) -> _Build:
        b = self._build
        if b is None or (b.last.shape[0] == 0 and int(b.header["vocab_size"]) > 0):
            self.connect()
            b = self._build
        return b

    # -- properties ------------------------------------------------------------------------------------------------

    @property
    def header(self) -> dict | None:
        return self._build.header if self._build else None

    @property
    def max_n(self) -> int:
        return self._ready().decoder.max_n

    def __repr__(self) -> str:
        return f"ClusterNgramStore(url={self.url!r}, namespace={self.namespace!r}, ngrams={self.num_records:,})"

    # -- lookup ----------------------------------------------------------------------------------------------------

    def lookup(self, context_ids, max_nodes: int = 64) -> DraftTree:
        """Tree of the longest stored suffix (one MGET to the slot of the last token), trimmed to max_nodes;
        empty (counted) while the slot's primary cannot answer."""
        return self.lookup_batch([context_ids], max_nodes)[0]

    def lookup_batch(self, contexts: Sequence, max_nodes: int = 64) -> list[DraftTree]:
        """One pipeline for the whole batch: one round trip per primary involved, in parallel."""
        try:
            b = self._ready()
        except (StoreUnavailable, DatastoreError) as e:  # a re-push for another tokenizer too
            b = self._build
            reason = "unavailable" if isinstance(e, StoreUnavailable) else "missing"
            if b is None:  # never connected and no fallback to take the header from
                for c in contexts:
                    check_lookup_args(c, max_nodes, 0)
                return self._degrade(contexts, max_nodes, reason, e)
            ctxs = [check_lookup_args(c, max_nodes, b.decoder.max_n) for c in contexts]
            return self._degrade(ctxs, max_nodes, reason, e)
        ctxs = [check_lookup_args(c, max_nodes, b.decoder.max_n) for c in contexts]
        out: list[DraftTree | None] = [None] * len(ctxs)
        for attempt in range(2):
            plans = {}
            for i, ctx in enumerate(ctxs):
                if out[i] is not None:
                    continue
                plan = self._keys(b, ctx)
                if plan is None:
                    out[i] = DraftTree.empty()  # no stored n-gram ends with this token: no round trip
                else:
                    plans[i] = plan
            if not plans:
                break
            replies = self._mget([keys for keys, _ in plans.values()])
            failed, lost = [], []
            for (i, (_, ns)), reply in zip(plans.items(), replies):
                if isinstance(reply, Exception):
                    failed.append(i)
                elif reply[0] is None:
                    lost.append(i)
                else:
                    out[i] = self._pick(b.decoder, reply[1:], ns, max_nodes)
            if failed:
                err = next(r for r in replies if isinstance(r, Exception))
                for i, tree in zip(failed, self._degrade([ctxs[i] for i in failed], max_nodes, "unavailable", err)):
                    out[i] = tree
            if not lost:
                break
            # A sentinel is gone: a newer push replaced our build (switch and look again), or its slot lost data.
            old = b.header["build"]
            try:
                self.connect()
                b = self._build
            except (StoreUnavailable, DatastoreError) as e:  # a re-push for another tokenizer too
                for i, tree in zip(lost, self._degrade([ctxs[i] for i in lost], max_nodes, "missing", e)):
                    out[i] = tree
                break
            if b.header["build"] == old or attempt == 1:
                why = NgramStoreError(f"build {old} is missing keys in {len(lost)} slot(s) (a primary restarted "
                                      f"empty without a replica?); push the store again")
                for i, tree in zip(lost, self._degrade([ctxs[i] for i in lost], max_nodes, "missing", why)):
                    out[i] = tree
                break
            ctxs = [check_lookup_args(c, max_nodes, b.decoder.max_n) for c in ctxs]
        return out

    @staticmethod
    def _keys(b: _Build, ctx: np.ndarray) -> tuple[list[bytes], list[int]] | None:
        t = ctx.shape[0]
        if t == 0:
            return None
        v = int(ctx[-1])
        if v >= b.last.shape[0] or not b.last[v]:
            return None
        tag = b.tag(v)
        ns = [n for n in range(min(b.decoder.max_n, t), 0, -1) if b.decoder.present[n]]
        le = b.decoder.tok.newbyteorder("<")
        return [tag + b"ok"] + [tag + b"g:" + ctx[t - n:].astype(le).tobytes() for n in ns], ns

    def _mget(self, key_lists: list[list[bytes]]) -> list:
        """One MGET per key list (each within one slot) -> replies, or the exception of each failed one."""
        try:
            client = self._cluster()
        except StoreUnavailable as e:
            return [e] * len(key_lists)
        try:
            # A pipeline even for one lookup: its errors come back per command, and unlike a plain call it does
            # not sleep 250 ms on CLUSTERDOWN before giving up.
            pipe = client.pipeline()
            for keys in key_lists:
                pipe.execute_command("MGET", *keys)  # pipe.mget is blocked: one slot per MGET here
            return pipe.execute(raise_on_error=False)
        except self._errors as e:
            return [e] * len(key_lists)

    @staticmethod
    def _pick(decoder: _TreeDecoder, values: list, ns: list[int], max_nodes: int) -> DraftTree:
        for n, v in zip(ns, values):
            if v is not None:
                return decoder.tree(v, n, max_nodes)
        return DraftTree.empty()

    def _degrade(self, ctxs: Sequence, max_nodes: int, reason: str, error: Exception) -> list[DraftTree]:
        """Answer contexts the cluster could not: from the fallback copy, else with empty drafts; count them."""
        with self._lock:
            self.degraded[reason] += len(ctxs)
            if self.fallback is not None:
                self.fallbacks += len(ctxs)
            now = time.monotonic()
            say = now - self._last_log >= _LOG_EVERY_S  # one line per outage, not one per lookup
            if say:
                self._last_log = now
        if say:
            log.warning("CREST store %r at %s: %d lookup(s) answered without the cluster (%s): %s", self.namespace,
                        self.url, len(ctxs), reason, error)
        if self.on_degraded is not None:
            self.on_degraded(reason, len(ctxs))
        if self.fallback is not None:
            return self.fallback.lookup_batch(ctxs, max_nodes)
        return [DraftTree.empty() for _ in ctxs]

    def warmup(self) -> None:
        """Connect (StoreUnavailable if the cluster is down; NgramStoreError/TokenizerMismatch if the store is not
        there or does not fit) and run one lookup; the fallback copy warms up too."""
        if self.fallback is not None:
            self.fallback.warmup()
        self.connect()
        self.lookup(np.zeros(max(self.max_n, 1), np.int32), 64)

    def ping(self) -> bool:
        try:
            return bool(self._cluster().ping(target_nodes="primaries"))
        except (StoreUnavailable, *self._errors):
            return False

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


# ----------------------------------------------------------------------------------------------------------------
# Push


def _wait_for_replicas(client, timeout_ms: float, key: bytes | str | None = None) -> None:
    """Block until every primary that has replicas (only `key`'s, if given) has one acknowledging all writes so far
    (WAIT)."""
    replicas: dict[str, int] = {}
    for nodes in client.nodes_manager.slots_cache.values():
        replicas[nodes[0].name] = max(replicas.get(nodes[0].name, 0), len(nodes) - 1)
    for node in client.get_primaries() if key is None else [client.get_node_from_key(key)]:
        if replicas.get(node.name, 0) > 0:
            acked = client.execute_command("WAIT", 1, int(timeout_ms), target_nodes=node)
            if int(acked) < 1:
                raise StoreUnavailable(f"no replica of primary {node.name} acknowledged the writes within "
                                       f"{timeout_ms:.0f} ms; run the push again (it resumes)")


def push_to_cluster(store: EmbeddedNgramStore, url: str, namespace: str, *, batch: int = 2000,
                    drop_old: bool = True, resume: bool = True, timeout_ms: float = 10_000.0,
                    progress: bool = True, on_batch: Callable[[int], None] | None = None) -> dict:
    """Bulk-load an embedded store into a Redis Cluster (one pipeline per batch, spread over the primaries by the
    client); meta goes last. resume: continue an interrupted push of the same build from its last acknowledged
    batch (False: rewrite every record). drop_old: afterwards delete the keys of other builds of the namespace.
    on_batch(n): called with the records acknowledged so far after each batch."""
    errors = _errors()
    check_namespace(namespace)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    curl = parse_cluster_url(url)
    build = build_id(store.header)
    tok = np.dtype(store.header["token_dtype"]).newbyteorder("<")
    pushed_key = f"{namespace}:{build}:pushed"
    vocab = int(store.header["vocab_size"])
    last = np.zeros(vocab, bool)
    written = start = dropped = 0
    try:
        client = _cluster_client(curl, timeout_ms)
    except errors as e:
        raise StoreUnavailable(f"push to {curl} failed: {type(e).__name__}: {e}") from None
    try:
        start = int(client.get(pushed_key) or 0) if resume else 0
        pipe = client.pipeline()
        with tqdm(total=store.num_records, initial=min(start, store.num_records), unit="ngram",
                  desc="push to redis cluster", disable=not progress) as bar:
            pending = 0
            for i, (key, payload) in enumerate(store.items()):
                v = int(key[-1])
                last[v] = True
                if i < start:
                    continue
                pipe.set(tag_prefix(namespace, build, v) + b"g:" + key.astype(tok).tobytes(), payload)
                pending += 1
                if pending == batch or i + 1 == store.num_records:
                    pipe.execute()
                    _wait_for_replicas(client, timeout_ms)
                    client.set(pushed_key, i + 1)  # counted only once a replica holds the batch
                    # and the count itself held by a replica: else a failover right after could lose it, and a
                    # push run again would start from an older count (safe, but it rewrites what was in)
                    _wait_for_replicas(client, timeout_ms, pushed_key)
                    written += pending
                    bar.update(pending)
                    pending = 0
                    if on_batch is not None:
                        on_batch(i + 1)
        for v in np.flatnonzero(last).tolist():
            pipe.set(tag_prefix(namespace, build, v) + b"ok", b"1")
        pipe.set(f"{namespace}:{build}:zdict".encode(), store.zdict())
        pipe.set(f"{namespace}:{build}:last".encode(), np.packbits(last, bitorder="little").tobytes())
        pipe.execute()
        _wait_for_replicas(client, timeout_ms)
        meta = {**store.header, "build": build, "layout": LAYOUT, "file_bytes": store.bytes_on_disk}
        client.set(f"{namespace}:meta", json.dumps(meta, sort_keys=True))
        _wait_for_replicas(client, timeout_ms)
        if drop_old:
            # Only keys of this namespace's other builds: "ns:<32 hex>:..." and "ns:{<32 hex>.<token>}:...".
            own = re.compile(re.escape(namespace).encode() + rb":\{?([0-9a-f]{32})[:.]")
            doomed = [k for k in client.scan_iter(match=f"{namespace}:*", count=10_000, target_nodes="primaries")
                      if (m := own.match(k)) and m.group(1) != build.encode()]
            for lo in range(0, len(doomed), batch):
                for k in doomed[lo:lo + batch]:
                    pipe.unlink(k)
                dropped += sum(int(r) for r in pipe.execute())
    except errors as e:
        raise StoreUnavailable(f"push to {curl} failed after {start + written:,} n-grams (run it again: it "
                               f"resumes): {type(e).__name__}: {e}") from None
    finally:
        client.close()
    return {"namespace": namespace, "build": build, "ngrams": store.num_records, "written": written,
            "resumed_from": start, "dropped_keys": dropped}
