"""CREST on a real 6-node Redis Cluster (3 primaries, 3 replicas): the same drafts as the embedded store and as a
brute-force reference, one slot per lookup with keys on every primary, pushes idempotent and resumable (also
across a failover), and a primary killed mid-load: no errors to callers, empty drafts while failing over (never
a wrong one), correct drafts again after the replica is promoted."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from proto import draft_pb2
from ragcore.draft_tree import DraftTree
from ragcore.wire import pack_tokens
from retrieval_service import metrics
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.crest_build import build_store, main as crest_build_main
from retrieval_service.datastore.ngram_backends import open_ngram_store
from retrieval_service.datastore.ngram_cluster import (
    ClusterNgramStore,
    parse_cluster_url,
    push_to_cluster,
    tag_prefix,
)
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    NgramStoreError,
    StoreUnavailable,
    TokenizerMismatch,
    build_id,
)

from .conftest import VOCAB, free_port
from .test_redis import contexts
from .test_service import Service, draft
from .test_store import same_tree

TIMEOUT_MS = 1000.0  # per Redis call; a killed node on loopback refuses at once, so this only bounds a stall
FAILOVER_S = 30.0  # bound on "drafts are back" after a SIGKILL (cluster-node-timeout is 1 s)


@pytest.fixture(scope="module")
def stores(small_ds, tmp_path_factory):
    d = tmp_path_factory.mktemp("crest-cluster")
    a = build_store(small_ds, d / "a.crest", max_n=3, t=25, progress=False)["path"]
    b = build_store(small_ds, d / "b.crest", max_n=3, t=5, progress=False)["path"]
    return EmbeddedNgramStore.open(a), EmbeddedNgramStore.open(b)


def brute_force(store: EmbeddedNgramStore, ctx, max_nodes: int) -> DraftTree:
    """Longest suffix of ctx among all stored n-grams, by a dictionary over every record (no hash table)."""
    table = {tuple(k.tolist()): p for k, p in store.items()}
    ctx = list(ctx)
    for n in range(min(store.max_n, len(ctx)), 0, -1):
        payload = table.get(tuple(ctx[len(ctx) - n:]))
        if payload is not None:
            return store._decoder.tree(payload, n, max_nodes)
    return DraftTree.empty()


def key_slot(key: bytes) -> int:
    from redis.crc import key_slot as slot

    return slot(key)


def cluster_keys(url: str, pattern: str) -> list[bytes]:
    from redis.cluster import ClusterNode, RedisCluster

    nodes = [ClusterNode(h, p) for h, p in parse_cluster_url(url).nodes]
    with RedisCluster(startup_nodes=nodes) as c:
        return list(c.scan_iter(match=pattern, count=1000, target_nodes="primaries"))


def restore(cluster, port: int) -> None:
    """Bring a killed node back (as a replica) so the next test gets 3 primaries with replicas again."""
    cluster.restart(port)
    cluster.wait_until_ok(60, replicas=True)


# ----------------------------------------------------------------------------------------------------------------
# URLs


@pytest.mark.parametrize("url, nodes, password", [
    ("redis+cluster://127.0.0.1:7000", ((("127.0.0.1", 7000),)), None),
    ("redis+cluster://a:7000,b.example:7001/", (("a", 7000), ("b.example", 7001)), None),  # trailing slash
    ("redis+cluster://:s%40cret@[::1]:7000,h:1", (("::1", 7000), ("h", 1)), "s@cret"),  # IPv6, quoted password
])
def test_cluster_urls_parse(url, nodes, password):
    u = parse_cluster_url(url)
    assert u.nodes == nodes and u.password == password
    assert "cret" not in str(u)  # Not the password in logs and errors


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:7000", "starts with redis\\+cluster://"),  # a single-node URL
    ("redis+cluster://127.0.0.1", "is not host:port"),  # no port
    ("redis+cluster://127.0.0.1:7000,:7001", "':7001' is not host:port"),
    ("redis+cluster://h:70000", "port 1-65535"),
])
def test_bad_cluster_urls_name_the_part(url, message):
    with pytest.raises(ValueError, match=message):
        parse_cluster_url(url)


# ----------------------------------------------------------------------------------------------------------------
# Same answers


def test_cluster_gives_the_embedded_and_brute_force_answers(redis_cluster, stores):
    embedded, _ = stores
    report = push_to_cluster(embedded, redis_cluster.url, "crest:same", batch=7, progress=False)
    assert report["ngrams"] == embedded.num_records == report["written"] and report["resumed_from"] == 0
    remote = open_ngram_store(redis_cluster.url, namespace="crest:same", timeout_ms=TIMEOUT_MS,
                              expected_tokenizer_id=embedded.tokenizer_id)
    assert isinstance(remote, ClusterNgramStore) and remote.num_records == 0  # Not connected before warmup
    remote.warmup()  # what the server does before SERVING: reads meta, checks the tokenizer
    assert remote.num_records == embedded.num_records and remote.backend == "redis-cluster"
    ctxs = contexts() + [[], [VOCAB - 1], [0, VOCAB - 1, VOCAB - 1]]  # empty, tokens that end no stored n-gram
    for max_nodes in (64, 3, 0):
        for ctx in ctxs:
            got = remote.lookup(ctx, max_nodes)
            assert same_tree(got, embedded.lookup(ctx, max_nodes)), ctx
            assert same_tree(got, brute_force(embedded, ctx, max_nodes)), ctx
        batch = remote.lookup_batch(ctxs, max_nodes)  # one pipeline: one round trip per primary
        assert all(same_tree(r, embedded.lookup(c, max_nodes)) for r, c in zip(batch, ctxs))
    assert sum(remote.lookup(c).matched_suffix > 0 for c in ctxs) > 50  # real hits, Not empty agreement
    assert remote.degraded == {"unavailable": 0, "missing": 0}


def test_one_lookup_one_slot_and_keys_on_every_primary(redis_cluster, stores):
    embedded, _ = stores
    push_to_cluster(embedded, redis_cluster.url, "crest:layout", progress=False)
    build = build_id(embedded.header)
    keys = cluster_keys(redis_cluster.url, f"crest:layout:{{{build}.*")
    tags = {k[:k.index(b"}") + 1] for k in keys}
    # Every probe of a lookup ends with the context's last token, so all its keys share that token's slot.
    for key, _ in embedded.items():
        v = int(key[-1])
        probes = [tag_prefix("crest:layout", build, v) + b"g:" + key[len(key) - n:].astype("<u2").tobytes()
                  for n in range(1, len(key) + 1)] + [tag_prefix("crest:layout", build, v) + b"ok"]
        assert len({key_slot(p) for p in probes}) == 1  # Not one slot per n-gram
    primaries = {redis_cluster.primary_of_slot(key_slot(t + b"x")) for t in tags}
    assert len(primaries) == 3  # spread over every primary, Not one hash tag per store on one primary
    assert len(keys) == embedded.num_records + len(tags)  # payloads + one sentinel per last token


def test_open_checks_the_store_and_an_unreachable_cluster_degrades(redis_cluster, stores):
    embedded, _ = stores
    push_to_cluster(embedded, redis_cluster.url, "crest:open", progress=False)
    with pytest.raises(NgramStoreError, match="holds no CREST store 'crest:nothing'"):
        ClusterNgramStore(redis_cluster.url, "crest:nothing", timeout_ms=TIMEOUT_MS).warmup()
    with pytest.raises(TokenizerMismatch, match="was built with tokenizer 'test-tokenizer'"):
        ClusterNgramStore(redis_cluster.url, "crest:open", expected_tokenizer_id="other",
                          timeout_ms=TIMEOUT_MS).warmup()
    # Nothing listens: lookups answer empty drafts (counted), Not an exception; warmup reports the outage.
    dead = f"redis+cluster://127.0.0.1:{free_port()}"
    store = ClusterNgramStore(dead, "crest:open", timeout_ms=200)
    ctx = contexts(1)[0]
    assert len(store.lookup(ctx)) == 0 and store.degraded["unavailable"] == 1
    assert [len(t) for t in store.lookup_batch([ctx, ctx])] == [0, 0] and store.degraded["unavailable"] == 3
    with pytest.raises(StoreUnavailable, match="Redis Cluster unavailable"):
        store.warmup()
    with pytest.raises(ValueError, match="max_nodes must be an integer"):  # bad input still raises
        store.lookup(ctx, -1)
    # With an embedded copy the same outage is answered from the copy.
    backed = open_ngram_store(dead, namespace="crest:open", fallback=str(embedded.path), timeout_ms=200)
    assert same_tree(backed.lookup(ctx), embedded.lookup(ctx)) and backed.fallbacks == 1


# ----------------------------------------------------------------------------------------------------------------
# Push


def test_push_is_idempotent_resumes_after_a_failover_and_replaces_old_builds(redis_cluster, stores):
    big, small = stores
    ns = "crest:push"
    killed: list[int] = []

    def kill_after_three_batches(done: int) -> None:
        if done == 21 and not killed:  # batch=7: a primary dies with 21 of the n-grams acknowledged
            killed.append(redis_cluster.primary_ports()[0])
            redis_cluster.kill(killed[0])

    with pytest.raises(StoreUnavailable, match="run it again: it resumes"):
        push_to_cluster(big, redis_cluster.url, ns, batch=7, timeout_ms=TIMEOUT_MS, progress=False,
                        on_batch=kill_after_three_batches)
    try:
        redis_cluster.wait_until_ok(FAILOVER_S)  # the killed primary's replica took over
        # Not meta before every n-gram is in: a reader finds no store yet.
        with pytest.raises(NgramStoreError, match="holds no CREST store"):
            ClusterNgramStore(redis_cluster.url, ns, timeout_ms=TIMEOUT_MS).connect()
        again = push_to_cluster(big, redis_cluster.url, ns, batch=7, timeout_ms=TIMEOUT_MS, progress=False)
        assert again["resumed_from"] == 21 and again["written"] == big.num_records - 21  # Not from 0
        ctxs = contexts(80)
        # A lookup that meets the cluster still settling after the failover answers an empty draft, counted as
        # degraded (by design, never an error): such a round proves nothing and is asked again, within a bound.
        deadline = time.monotonic() + FAILOVER_S
        while True:
            remote = ClusterNgramStore(redis_cluster.url, ns, timeout_ms=TIMEOUT_MS)
            same = [same_tree(remote.lookup(c), big.lookup(c)) for c in ctxs]
            if not any(remote.degraded.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not any(remote.degraded.values()), remote.degraded
        assert all(same), same.count(False)  # nothing lost across the failover
    finally:
        restore(redis_cluster, killed[0])
    keys_before = sorted(cluster_keys(redis_cluster.url, f"{ns}:*"))
    # The same store again: nothing rewritten, the same keys; --no-resume rewrites, still the same keys.
    assert push_to_cluster(big, redis_cluster.url, ns, progress=False)["written"] == 0
    assert push_to_cluster(big, redis_cluster.url, ns, resume=False, progress=False)["written"] == big.num_records
    assert sorted(cluster_keys(redis_cluster.url, f"{ns}:*")) == keys_before
    # Another store under the namespace: a running reader switches, the old build's keys are dropped.
    report = push_to_cluster(small, redis_cluster.url, ns, progress=False)
    assert report["dropped_keys"] == len(keys_before) - 1  # all but the shared meta key
    assert all(same_tree(remote.lookup(c), small.lookup(c)) for c in ctxs)  # Not the old build's trees
    assert remote.degraded == {"unavailable": 0, "missing": 0}


def test_crest_build_push_accepts_a_cluster_url(redis_cluster, stores, capsys):
    embedded, _ = stores
    argv = ["push", "--store", str(embedded.path), "--redis", redis_cluster.url, "--namespace", "crest:cli",
            "--no-progress"]
    assert crest_build_main(argv) == 0
    assert f"pushed {embedded.num_records:,} n-grams ({embedded.num_records:,} written)" in capsys.readouterr().out
    assert crest_build_main(argv) == 0
    assert f"(0 written, resumed after {embedded.num_records:,})" in capsys.readouterr().out


def test_a_slot_that_lost_its_keys_degrades_instead_of_a_shorter_draft(redis_cluster, stores):
    from redis.cluster import ClusterNode, RedisCluster

    embedded, _ = stores
    ns = "crest:lost"
    push_to_cluster(embedded, redis_cluster.url, ns, progress=False)
    remote = ClusterNgramStore(redis_cluster.url, ns, timeout_ms=TIMEOUT_MS)
    ctxs = [c for c in contexts(200) if embedded.lookup(c).matched_suffix > 0]
    v = int(ctxs[0][-1])
    tag = tag_prefix(ns, build_id(embedded.header), v)
    # What a primary that came back empty without a replica looks like for one tag: its keys are gone.
    nodes = [ClusterNode(h, p) for h, p in parse_cluster_url(redis_cluster.url).nodes]
    with RedisCluster(startup_nodes=nodes) as c:
        for k in c.scan_iter(match=tag.decode() + "*", target_nodes="primaries"):
            c.delete(k)
    for ctx in ctxs:
        tree = remote.lookup(ctx)
        if ctx[-1] == v:
            assert len(tree) == 0  # Not a tree of whatever shorter suffix survived
        else:
            assert same_tree(tree, embedded.lookup(ctx))
    assert remote.degraded["missing"] == sum(c[-1] == v for c in ctxs) > 0


# ----------------------------------------------------------------------------------------------------------------
# Failover under load, through the Draft RPC


def test_primary_killed_mid_load_degrades_to_empty_drafts_and_recovers(redis_cluster, stores):
    embedded, _ = stores
    ns = "crest:failover"
    push_to_cluster(embedded, redis_cluster.url, ns, progress=False)
    svc = Service(RetrievalConfig(port=0, crest=redis_cluster.url, crest_namespace=ns, crest_timeout_ms=TIMEOUT_MS))
    ctxs = [c for c in contexts(200) if embedded.lookup(c).matched_suffix > 0][:40]
    expected = [embedded.lookup(c) for c in ctxs]
    build = build_id(embedded.header)
    victim = redis_cluster.primary_of_slot(key_slot(tag_prefix(ns, build, int(ctxs[0][-1])) + b"ok"))
    on_victim = [i for i, c in enumerate(ctxs)
                 if redis_cluster.primary_of_slot(key_slot(tag_prefix(ns, build, int(c[-1])) + b"ok")) == victim]
    degraded0 = metrics.get().crest_degraded.labels("unavailable")._value.get()
    log: list[tuple[float, int, bool]] = []  # (time, context, answered with the full draft)
    errors, wrong = [], []
    stop = threading.Event()

    def client(offset: int) -> None:
        i = offset
        while not stop.is_set():
            k = i % len(ctxs)
            i += 1
            try:
                if i % 3:
                    got = draft(svc.stub, ctxs[k])
                else:
                    reply = svc.stub.DraftBatch(draft_pb2.DraftBatchRequest(requests=[
                        draft_pb2.DraftRequest(context=pack_tokens(ctxs[k]),
                                               params=draft_pb2.DraftParams(source="crest"))]), timeout=30)
                    got = DraftTree.from_bytes(reply.responses[0].tokens, reply.responses[0].parents,
                                               reply.responses[0].scores, reply.responses[0].source_p,
                                               matched_suffix=reply.responses[0].matched_suffix,
                                               num_matches=reply.responses[0].num_matches)
            except grpc.RpcError as e:
                errors.append(e.code())
                continue
            full = same_tree(got, expected[k])
            if len(got) and not full:
                wrong.append((k, got))
            log.append((time.monotonic(), k, full))

    threads = [threading.Thread(target=client, args=(j * 7,)) for j in range(3)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        killed_at = time.monotonic()
        redis_cluster.kill(victim)
        redis_cluster.wait_until_ok(FAILOVER_S)
        promoted_at = time.monotonic()
        # Keep the load on until every context on the victim's slots has been answered in full again.
        deadline = promoted_at + FAILOVER_S
        while time.monotonic() < deadline:
            back = {k for t, k, full in log if t > promoted_at and full}
            if set(on_victim) <= back:
                break
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
    finally:
        stop.set()
        svc.close()
        restore(redis_cluster, victim)
    assert errors == []  # Not UNAVAILABLE (or anything else) to the Draft caller
    assert wrong == []  # Not a draft other than the store's
    during = [(k, full) for t, k, full in log if killed_at < t < promoted_at]
    assert any(k in on_victim and not full for k, full in during)  # the victim's slots went empty for a while
    assert set(on_victim) <= {k for t, k, full in log if t > promoted_at and full}  # ...and came back
    assert metrics.get().crest_degraded.labels("unavailable")._value.get() > degraded0  # counted in the metrics


def test_a_service_started_while_the_cluster_is_down_serves_once_it_is_up(stores, tmp_path):
    from tools.redis_cluster import LocalCluster, binaries

    if binaries() is None:
        pytest.skip("redis-server / redis-cli not found")
    embedded, _ = stores
    cluster = LocalCluster(tmp_path / "late", primaries=3, replicas=0)  # ports chosen, nothing started yet
    svc = Service(RetrievalConfig(port=0, crest=cluster.url, crest_namespace="crest:late", crest_timeout_ms=200))
    try:
        ctxs = [c for c in contexts(100) if embedded.lookup(c).matched_suffix > 0][:10]
        assert all(len(draft(svc.stub, c)) == 0 for c in ctxs)  # SERVING, empty drafts, Not UNAVAILABLE
        cluster.start()
        push_to_cluster(embedded, cluster.url, "crest:late", progress=False)
        assert all(same_tree(draft(svc.stub, c), embedded.lookup(c)) for c in ctxs)  # back without a restart
    finally:
        svc.close()
        cluster.stop()


def test_slots_resharded_under_load_keep_answers_right(redis_cluster, stores):
    embedded, _ = stores
    ns = "crest:reshard"
    push_to_cluster(embedded, redis_cluster.url, ns, progress=False)
    remote = ClusterNgramStore(redis_cluster.url, ns, timeout_ms=TIMEOUT_MS)
    ctxs = [c for c in contexts(200) if embedded.lookup(c).matched_suffix > 0][:40]
    expected = [embedded.lookup(c) for c in ctxs]
    build = build_id(embedded.header)
    ranges = {}  # slot -> (first slot of its primary's range, last)
    for node in redis_cluster.nodes():
        for r in node["slots"] if node["role"] == "primary" else []:
            lo, _, hi = r.partition("-")
            for s_ in range(int(lo), int(hi or lo) + 1):
                ranges[s_] = (int(lo), int(hi or lo))
    # A slot of ours that is not the last of its range: moving [first .. it] leaves its primary some slots
    # (an emptied primary would turn into a replica).
    slot = next(s_ for c in ctxs if (s_ := key_slot(tag_prefix(ns, build, int(c[-1])) + b"ok")) < ranges[s_][1])
    source = redis_cluster.primary_of_slot(slot)
    target = next(p for p in redis_cluster.primary_ports() if p != source)
    moved = slot - ranges[slot][0] + 1
    wrong, errors, rounds, stop = [], [], [0], threading.Event()

    def reader() -> None:
        while not stop.is_set():
            rounds[0] += 1
            try:
                for got, want in zip(remote.lookup_batch(ctxs), expected):
                    if len(got) and not same_tree(got, want):
                        wrong.append(got)
            except Exception as e:  # noqa: BLE001 - any exception is a failure of the test
                errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    try:
        redis_cluster.reshard(source, target, moved)  # our slot among them: MOVED, ASK, TRYAGAIN meanwhile
    finally:
        stop.set()
        th.join(30)
    assert errors == [] and wrong == [] and rounds[0] > 1  # Not an exception, Not a wrong draft while slots move
    assert redis_cluster.primary_of_slot(slot) == target
    assert all(same_tree(remote.lookup(c), e) for c, e in zip(ctxs, expected))  # all answers full afterwards
