"""Failover check: CREST drafts from a local 6-node Redis Cluster (3 primaries, 3 replicas) under a closed loop of
Generate calls through the real services, with one primary SIGKILLed mid-run.

    python -m loadtests.cluster_failover                         # 60 s, kill at 20 s, 2 Generate clients
    python -m loadtests.cluster_failover --no-generation --store S.crest --duration 8 --kill-at 1.5   # smoke size

What runs: the cluster (tools/redis_cluster.py, no persistence, cluster-node-timeout --node-timeout-ms), the CREST
store pushed to it (--store, or built once from --datastore into $RAGSERVE_HOME/crest/), the retrieval service
with --crest redis+cluster://... and the generation worker (tools/launcher.py, on loopback), --clients threads
sending Generate(decoding=crest) back to back (with --no-generation: Draft(source=crest) instead, no worker), and a
probe sending Draft(source=crest) every --probe-every s for stored n-grams whose slots live on the primary that
will be killed and on the others, compared with the embedded store's answer (full, empty, or wrong).

Targets (exit 1 when missed): 0 errors to the callers (Generate or Draft), 0 wrong drafts, and the killed
primary's drafts back (every probe of its slots answered in full again) within --target-back-s of the kill.
Writes bench/results/cluster-failover-<cpuclass>.json (machine, CPU flags, load average, commit, timeline).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from proto import draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc
from ragcore.draft_tree import DraftTree
from ragcore.wire import pack_tokens
from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.ngram_cluster import push_to_cluster, tag_prefix
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore, build_id
from tools import launcher
from tools.redis_cluster import LocalCluster

NAMESPACE = "crest:failover"
PROBES_PER_SIDE = 16
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m loadtests.cluster_failover", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    home = Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve")).expanduser()
    ap.add_argument("--store", default="", help="CREST store file to push ('' = build one from --datastore, cached)")
    ap.add_argument("--datastore", default=str(home / "datastores" / "stdlib"),
                    help="suffix-array datastore the store is built from when --store is not given "
                         "(default %(default)s)")
    ap.add_argument("--t", type=int, default=5000, help="n-grams per n of the built store (default %(default)s)")
    ap.add_argument("--max-n", type=int, default=4, help="longest n-gram of the built store (default %(default)s)")
    ap.add_argument("--model", default="", help="local HF model directory for the worker ('' = the default model)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load (default %(default)s)")
    ap.add_argument("--kill-at", type=float, default=20.0,
                    help="second of the run at which a primary is SIGKILLed (default %(default)s)")
    ap.add_argument("--clients", type=int, default=2, help="closed-loop clients (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per Generate (default %(default)s)")
    ap.add_argument("--no-generation", action="store_true",
                    help="no worker: the clients send Draft(source=crest) instead of Generate (smoke test)")
    ap.add_argument("--probe-every", type=float, default=0.1, help="seconds between probe rounds (default "
                                                                   "%(default)s)")
    ap.add_argument("--timeout-ms", type=float, default=50.0,
                    help="the retrieval service's --crest-timeout-ms (default %(default)s)")
    ap.add_argument("--node-timeout-ms", type=int, default=1000,
                    help="cluster-node-timeout of the local cluster (default %(default)s)")
    ap.add_argument("--target-back-s", type=float, default=10.0,
                    help="drafts of the killed primary must be back within this many seconds (default %(default)s)")
    ap.add_argument("--json", default="", help="output (default bench/results/cluster-failover-<cpuclass>.json)")
    args = ap.parse_args(argv)
    if not 0 < args.kill_at < args.duration <= 3600:
        ap.error(f"need 0 < --kill-at ({args.kill_at}) < --duration ({args.duration}) <= 3600")
    if not 1 <= args.clients <= 64:
        ap.error(f"--clients {args.clients} is outside [1, 64]")
    if args.probe_every <= 0:
        ap.error("--probe-every must be > 0")
    return args


def crest_store(args: argparse.Namespace) -> EmbeddedNgramStore:
    if args.store:
        return EmbeddedNgramStore.open(args.store)
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

    home = Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve")).expanduser()
    path = home / "crest" / f"{Path(args.datastore).name}-failover-m{args.max_n}-t{args.t}.crest"
    if not path.exists():  # written atomically: a finished file is a finished build
        build_store(SuffixArrayDatastore.open(args.datastore), path, max_n=args.max_n, t=args.t)
    return EmbeddedNgramStore.open(path)


def probe_contexts(store: EmbeddedNgramStore, cluster: LocalCluster) -> tuple[int, list, list]:
    """(victim primary port, probes on its slots, probes elsewhere): stored n-grams of the longest n, whose own
    lookup is their own tree; the victim is the primary holding most of them."""
    from redis.crc import key_slot

    build = build_id(store.header)
    by_port: dict[int, list[np.ndarray]] = {}
    slots: dict[int, int] = {}
    for key, _ in store.items():
        if len(key) != store.max_n:
            continue
        v = int(key[-1])
        if v not in slots:
            slots[v] = cluster.primary_of_slot(key_slot(tag_prefix(NAMESPACE, build, v) + b"ok"))
        by_port.setdefault(slots[v], []).append(key)
    victim = max(by_port, key=lambda p: len(by_port[p]))
    others = [k for p, keys in by_port.items() if p != victim for k in keys]
    rng = np.random.default_rng(0)
    pick = lambda keys: [keys[i] for i in rng.permutation(len(keys))[:PROBES_PER_SIDE]]  # noqa: E731
    return victim, pick(by_port[victim]), pick(others)


def draft_call(stub, ctx, timeout: float = 10.0) -> DraftTree:
    r = stub.Draft(draft_pb2.DraftRequest(context=pack_tokens(ctx), params=draft_pb2.DraftParams(source="crest")),
                   timeout=timeout)
    return DraftTree.from_bytes(r.tokens, r.parents, r.scores, r.source_p, matched_suffix=r.matched_suffix,
                                num_matches=r.num_matches)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)
            and a.matched_suffix == b.matched_suffix)


def scrape_degraded(port: int) -> dict[str, float]:
    """ragserve_retrieval_crest_degraded_total by reason from the retrieval service's /metrics."""
    out: dict[str, float] = {}
    if not port:
        return out
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("ragserve_retrieval_crest_degraded_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def back_after(rounds: list[tuple[float, int, int, int]], killed_at: float) -> tuple[float | None, float | None]:
    """Seconds from the kill to the first probe round with every victim probe full, and to the start of the last
    run of such rounds (the drafts stayed back); None if never."""
    first = stable = None
    for t, full, _, total in rounds:
        if t <= killed_at:
            continue
        if full == total:
            first = t - killed_at if first is None else first
            stable = t - killed_at if stable is None else stable
        else:
            stable = None
    return first, stable


def run(args: argparse.Namespace) -> dict:
    from bench.serving import cpu_class, machine

    store = crest_store(args)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ragserve-failover-") as tmp:
        cluster = LocalCluster(Path(tmp) / "cluster", primaries=3, replicas=1, node_timeout_ms=args.node_timeout_ms)
        cluster.start()
        topo = None
        try:
            pushed = push_to_cluster(store, cluster.url, NAMESPACE, progress=False)
            victim, on_victim, elsewhere = probe_contexts(store, cluster)
            expected = [store.lookup(c) for c in on_victim + elsewhere]
            topo = launcher.up(state=Path(tmp) / "launcher.json", model=args.model, metrics=True,
                               generation=not args.no_generation, timeout_s=900,
                               extra_retrieval=["--crest", cluster.url, "--crest-namespace", NAMESPACE,
                                                "--crest-timeout-ms", str(args.timeout_ms)])
            result = _load(args, topo, cluster, victim, on_victim, elsewhere, expected)
            result["degraded_metric"] = scrape_degraded(topo.get("retrieval").metrics_port)
        finally:
            if topo is not None:
                launcher.down(state=Path(tmp) / "launcher.json", grace_s=10)
            cluster.stop()
    result.update({
        "benchmark": "cluster-failover", "machine": machine(), "cpu_class": cpu_class(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "store": {"path": str(store.path), "ngrams": store.num_records, "max_n": store.max_n,
                  "tokenizer_id": store.tokenizer_id, "push": pushed},
        "config": {k: getattr(args, k) for k in ("duration", "kill_at", "clients", "max_new_tokens", "no_generation",
                                                 "probe_every", "timeout_ms", "node_timeout_ms", "target_back_s")},
    })
    r = result
    r["targets"] = {"caller_errors": 0, "wrong_drafts": 0, "back_within_s": args.target_back_s}
    r["passed"] = bool(r["callers"]["errors"] == 0 and r["probe"]["errors"] == 0 and r["probe"]["wrong"] == 0
                       and r["probe"]["back_stable_s"] is not None
                       and r["probe"]["back_stable_s"] <= args.target_back_s)
    return r


def _load(args, topo, cluster: LocalCluster, victim: int, on_victim: list, elsewhere: list,
          expected: list[DraftTree]) -> dict:
    retrieval = grpc.insecure_channel(topo.get("retrieval").address)
    rstub = draft_pb2_grpc.DraftServiceStub(retrieval)
    gen_channel = None if args.no_generation else grpc.insecure_channel(topo.get("generation").address)
    gstub = None if gen_channel is None else generation_pb2_grpc.GenerationServiceStub(gen_channel)
    if gstub is not None:
        from tools.demo import humaneval_prompts

        prompts = [p["prompt"] for p in humaneval_prompts()]
    probes = on_victim + elsewhere
    lock = threading.Lock()
    calls: list[dict] = []  # one per client call
    rounds: list[tuple[float, int, int, int]] = []  # (t, victim probes full, victim probes empty, victim probes)
    probe_errors, wrong = [], []
    stop = threading.Event()
    t0 = time.monotonic()

    def client(j: int) -> None:
        i = j
        while not stop.is_set():
            start = time.monotonic() - t0
            rec = {"client": j, "start_s": start}
            try:
                if gstub is None:
                    tree = draft_call(rstub, probes[i % len(probes)])
                    rec.update(draft_nodes=len(tree))
                else:
                    reply = gstub.Generate(generation_pb2.GenerateRequest(
                        prompt=prompts[i % len(prompts)], max_new_tokens=args.max_new_tokens, decoding="crest"),
                        timeout=600)
                    s = reply.stats
                    rec.update(tokens=reply.usage.completion_tokens, forward_steps=s.forward_steps,
                               draft_proposed=s.draft_tokens_proposed, draft_accepted=s.draft_tokens_accepted,
                               degraded_steps=s.degraded_steps, skipped_drafts=s.skipped_drafts)
            except grpc.RpcError as e:
                rec["error"] = f"{e.code().name}: {e.details()}"
            rec["end_s"] = time.monotonic() - t0
            i += args.clients
            with lock:
                calls.append(rec)

    def probe() -> None:
        while not stop.is_set():
            t = time.monotonic() - t0
            full = empty = 0
            for k, ctx in enumerate(probes):
                try:
                    got = draft_call(rstub, ctx)
                except grpc.RpcError as e:
                    probe_errors.append((t, f"{e.code().name}: {e.details()}"))
                    continue
                ok = same_tree(got, expected[k])
                if len(got) and not ok:
                    wrong.append((t, k))
                if k < len(on_victim):
                    full += ok
                    empty += len(got) == 0
            with lock:
                rounds.append((t, full, empty, len(on_victim)))
            stop.wait(args.probe_every)

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in range(args.clients)]
    threads.append(threading.Thread(target=probe, daemon=True))
    for th in threads:
        th.start()
    stop.wait(args.kill_at)
    killed_at = time.monotonic() - t0
    cluster.kill(victim)
    promoted_s = None
    try:
        promoted_s = cluster.wait_until_ok(max(1.0, args.duration - killed_at))
    except TimeoutError:
        pass
    stop.wait(max(0.0, args.duration - (time.monotonic() - t0)))
    stop.set()
    for th in threads:
        th.join(660)
    retrieval.close()
    if gen_channel is not None:
        gen_channel.close()

    first, stable = back_after(rounds, killed_at)
    errors = [c for c in calls if "error" in c]
    timeline = []
    for second in range(int(args.duration) + 1):
        done = [c for c in calls if second <= c["end_s"] < second + 1 and "error" not in c]
        row = {"second": second, "calls": len(done),
               "errors": sum(second <= c["end_s"] < second + 1 for c in errors)}
        if gstub is not None:
            row.update({k: sum(c[k] for c in done) for k in ("tokens", "forward_steps", "draft_proposed",
                                                             "draft_accepted", "degraded_steps")})
        victim_rounds = [r for r in rounds if second <= r[0] < second + 1]
        row["victim_probes_full"] = sum(r[1] for r in victim_rounds)
        row["victim_probes_empty"] = sum(r[2] for r in victim_rounds)
        row["victim_probes"] = sum(r[3] for r in victim_rounds)
        timeline.append(row)

    def phase(lo: float, hi: float) -> dict:
        done = [c for c in calls if lo <= c["start_s"] and c["end_s"] < hi and "error" not in c]
        out = {"calls": len(done), "seconds": hi - lo}
        if gstub is not None and done:
            steps = sum(c["forward_steps"] for c in done)
            out.update(tokens_per_s=sum(c["tokens"] for c in done) / max(hi - lo, 1e-9),
                       accepted_per_step=sum(c["draft_accepted"] for c in done) / max(steps, 1),
                       proposed_per_step=sum(c["draft_proposed"] for c in done) / max(steps, 1))
        return out

    back_at = killed_at + (stable if stable is not None else args.duration)
    return {
        "killed_at_s": killed_at, "victim_port": victim, "promoted_after_s": promoted_s,
        "callers": {"kind": "Draft" if gstub is None else "Generate", "calls": len(calls), "errors": len(errors),
                    "error_samples": [c["error"] for c in errors[:5]]},
        "probe": {"rounds": len(rounds), "victim_probes": len(on_victim), "other_probes": len(elsewhere),
                  "errors": len(probe_errors), "error_samples": [e[1] for e in probe_errors[:5]],
                  "wrong": len(wrong), "back_first_s": first, "back_stable_s": stable,
                  "empty_rounds_after_kill": sum(1 for r in rounds if r[0] > killed_at and r[2] > 0)},
        "phases": {"before_kill": phase(0.0, killed_at), "failing_over": phase(killed_at, back_at),
                   "after_back": phase(back_at, args.duration)},
        "timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.serving import cpu_class, write_json

    out = Path(args.json) if args.json else ROOT / "bench" / "results" / f"cluster-failover-{cpu_class()}.json"
    r = run(args)
    write_json(out, r)
    p, c = r["probe"], r["callers"]
    print(f"{c['kind']} calls {c['calls']}, errors {c['errors']} (target 0); probe errors {p['errors']}, wrong drafts "
          f"{p['wrong']} (target 0)")
    print(f"primary :{r['victim_port']} killed at {r['killed_at_s']:.1f} s; cluster ok again after "
          f"{r['promoted_after_s'] if r['promoted_after_s'] is None else round(r['promoted_after_s'], 2)} s; its "
          f"drafts back after {p['back_first_s']} s (stable {p['back_stable_s']} s; target <= {args.target_back_s} s)")
    for name, ph in r["phases"].items():
        print(f"  {name:<13} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in ph.items()))
    print(f"degraded lookups (retrieval metric): {r['degraded_metric']}; {'PASS' if r['passed'] else 'FAIL'}; "
          f"wrote {out}")
    return 0 if r["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
