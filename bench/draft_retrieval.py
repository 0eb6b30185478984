"""Draft retrieval latency: numba REST drafter vs a straightforward NumPy implementation, by datastore size.

    python -m bench.draft_retrieval --sizes 1e6,1e7,1e8 --contexts 2000 --json bench/results/draft_retrieval.json
    python -m bench.draft_retrieval --sizes 1e8 --contexts 500 --grpc          # + Draft RPC via an in-process server
    python -m bench.draft_retrieval --sizes 1e8 --grpc-target 127.0.0.1:50051  # + a running retrieval server

Datastores of each size are prefixes (whole documents, the last one cut) of the big code datastore built by
`python -m retrieval_service.datastore.build --stdlib --site-packages ...`, cached under ~/.cache/ragserve/.
Contexts are the positions of the simulator's greedy HumanEval outputs (prompt + output[:pos]); REST defaults
(suffix 16..2, 5000 matches, 10 tokens, 64 nodes). Methods are interleaved per context, in rotating order, so
machine noise hits them alike. Times are in-process wall times per draft call (perf_counter_ns).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from ragcore.draft_tree import DraftTree

REST = dict(max_suffix=16, min_suffix=2, max_matches=5000, continuation=10, max_nodes=64)


# ----------------------------------------------------------------------------------------------------------------
# The straightforward NumPy baseline (one shard; REST as published: first-k matches, top-k by count)


def _compare(tokens: np.ndarray, pos: int, pattern: np.ndarray) -> int:
    seg = tokens[pos : pos + len(pattern)]
    diff = np.flatnonzero(seg != pattern[: len(seg)])
    if diff.size == 0:
        return 0 if len(seg) == len(pattern) else -1
    return -1 if seg[diff[0]] < pattern[diff[0]] else 1


def numpy_draft(tokens: np.ndarray, sa: np.ndarray, ctx: np.ndarray, max_suffix=16, min_suffix=2, max_matches=5000,
                continuation=10, max_nodes=64) -> DraftTree:
    sep = np.iinfo(tokens.dtype).max
    lo = hi = 0
    length = 0
    for length in range(min(max_suffix, len(ctx)), min_suffix - 1, -1):
        pattern = ctx[len(ctx) - length :].astype(np.int64)
        a, b = 0, len(sa)
        while a < b:  # lower bound
            mid = (a + b) // 2
            if _compare(tokens, int(sa[mid]), pattern) < 0:
                a = mid + 1
            else:
                b = mid
        lo, b = a, len(sa)
        while a < b:  # upper bound
            mid = (a + b) // 2
            if _compare(tokens, int(sa[mid]), pattern) <= 0:
                a = mid + 1
            else:
                b = mid
        hi = a
        if hi > lo:
            break
    if hi <= lo:
        return DraftTree.empty()
    starts = sa[lo : min(hi, lo + max_matches)].astype(np.int64) + length
    conts = tokens[np.minimum(starts[:, None] + np.arange(continuation), len(tokens) - 1)].astype(np.int64)
    valid = np.cumprod(conts != sep, axis=1).astype(bool)
    paths, counts, depths = [], [], []
    for d in range(1, continuation + 1):
        rows = conts[valid[:, d - 1], :d]
        if rows.shape[0] == 0:
            break
        uniq, cnt = np.unique(rows, axis=0, return_counts=True)
        paths += [tuple(r) for r in uniq.tolist()]
        counts.append(cnt)
        depths.append(np.full(len(cnt), d))
    if not counts:  # every match sits at a document end
        return DraftTree.empty()
    counts, depths = np.concatenate(counts), np.concatenate(depths)
    keep = np.lexsort((depths, -counts))[:max_nodes]  # count desc, then shallower first
    chosen = sorted((paths[i] for i in keep), key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(chosen)}
    return DraftTree(np.array([p[-1] for p in chosen]), np.array([index[p[:-1]] if len(p) > 1 else -1 for p in chosen]))


# ----------------------------------------------------------------------------------------------------------------
# Datastores and contexts


def prefix_datastore(big, n_tokens: int, root: Path):
    """A datastore of the first n_tokens of `big` (whole documents, the last one cut), built once."""
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

    if n_tokens >= big.num_tokens:
        return big
    path = root / f"{big.path.name}-prefix-{n_tokens}"
    key = f"prefix:{big.tokenizer_id}:{big.num_tokens}:{n_tokens}"

    def docs():
        for shard in big.shards:
            for i in range(shard.num_documents):
                yield np.asarray(shard.document(i))

    return SuffixArrayDatastore.build(docs(), path, vocab_size=big.vocab_size, tokenizer_id=big.tokenizer_id,
                                      limit_tokens=n_tokens, resume_key=key, progress=False)


def bench_contexts(n: int, prompts: int, seed: int = 0) -> list[np.ndarray]:
    from bench.draft_simulation import greedy_outputs
    from ragcore.model_files import default_model_dir, resolve_model_dir

    items = greedy_outputs(resolve_model_dir(default_model_dir()), prompts)
    all_ctx = []
    for item in items:
        full = np.asarray(item["prompt_ids"] + item["output_ids"], np.int32)
        all_ctx += [full[: len(item["prompt_ids"]) + pos] for pos in range(len(item["output_ids"]))]
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(all_ctx), size=min(n, len(all_ctx)), replace=False)
    return [all_ctx[i] for i in pick]


def datastore_contexts(ds, n: int, seed: int = 0, max_len: int = 256) -> list[np.ndarray]:
    """n contexts cut from the datastore's own documents (a random document, a random prefix of it): no model needed,
    and every context has matches, as a generated output over a datastore of its domain mostly does."""
    rng = np.random.default_rng(seed)
    docs = [(shard, i) for shard in ds.shards for i in range(shard.num_documents)]
    out = []
    for k in rng.choice(len(docs), size=n, replace=True):
        shard, i = docs[int(k)]
        doc = np.asarray(shard.document(i), np.int32)
        if doc.shape[0] >= 2:
            end = int(rng.integers(2, doc.shape[0] + 1))
            out.append(doc[max(0, end - max_len):end])
    return out


# ----------------------------------------------------------------------------------------------------------------
# Measurement


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"p50_ms": float(np.percentile(a, 50)), "mean_ms": float(a.mean()), "p90_ms": float(np.percentile(a, 90)),
            "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max()), "n": int(a.size)}


def _timed(fn) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def measure(ds, contexts: list[np.ndarray], numpy_contexts: int) -> dict:
    from ragcore import draft_kernels as kernels

    _, toks, sas, buckets, n_shards, _, _sep = ds._state
    shard = ds.shards[0]
    methods = {
        "numba": lambda c: ds.draft(c, **REST),
        "search": lambda c: kernels.search(toks, sas, buckets, n_shards, c, REST["max_suffix"], REST["min_suffix"]),
        "merged": lambda c: ds.draft(c, source="merged", **REST),
        "numpy": lambda c: numpy_draft(shard.tokens, shard.sa, c, **REST),
    }
    for c in contexts[:50]:  # warm: kernels loaded, hot pages of the index touched
        for name, fn in methods.items():
            fn(c)
    times: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    for i, c in enumerate(contexts):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            if name == "numpy" and i >= numpy_contexts:
                continue
            times[name].append(_timed(lambda: methods[name](c)))
    out = stats(times["numba"])
    s, m, npy = stats(times["search"]), stats(times["merged"]), stats(times["numpy"])
    out |= {"search_mean_ms": s["mean_ms"], "search_p50_ms": s["p50_ms"],
            "tree_mean_ms": out["mean_ms"] - s["mean_ms"], "merged_mean_ms": m["mean_ms"],
            "merged_p50_ms": m["p50_ms"], "merged_p99_ms": m["p99_ms"],
            "numpy_p50_ms": npy["p50_ms"], "numpy_mean_ms": npy["mean_ms"], "numpy_p99_ms": npy["p99_ms"],
            "numpy_contexts": npy["n"]}
    out["speedup_mean"] = out["numpy_mean_ms"] / out["mean_ms"]
    trees = [ds.draft(c, **REST) for c in contexts]
    out["matched_suffix_mean"] = float(np.mean([t.matched_suffix for t in trees]))
    out["num_matches_mean"] = float(np.mean([t.num_matches for t in trees]))
    return out


def measure_batch(ds, contexts: list[np.ndarray]) -> dict:
    """Throughput of draft_batch on both cores vs one thread (same contexts)."""
    out = {}
    for threads in (1, 2):
        ds.draft_batch(contexts[:64], threads=threads, **REST)
        t0 = time.perf_counter()
        ds.draft_batch(contexts, threads=threads, **REST)
        out[f"batch_threads{threads}_ms_per_draft"] = (time.perf_counter() - t0) * 1e3 / len(contexts)
    return out


def measure_grpc(ds, contexts: list[np.ndarray], target: str | None) -> dict:
    """Draft RPC latency (client wall time) against `target`, or an in-process server on a free port."""
    import grpc

    from proto import draft_pb2, draft_pb2_grpc

    running = None
    if target is None:
        from retrieval_service.config import RetrievalConfig
        from retrieval_service.server import build_server

        running = build_server(RetrievalConfig(port=0), datastore=ds)
        target = f"127.0.0.1:{running.port}"
    try:
        with grpc.insecure_channel(target) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            params = draft_pb2.DraftParams(**REST, source="datastore")
            requests = [draft_pb2.DraftRequest(context=c.astype("<u4").tobytes(), params=params) for c in contexts]
            for r in requests[:50]:
                stub.Draft(r, timeout=10)
            ms, server_ms = [], []
            for r in requests:
                t0 = time.perf_counter_ns()
                resp = stub.Draft(r, timeout=10)
                ms.append((time.perf_counter_ns() - t0) / 1e6)
                server_ms.append(resp.server_ms)
    finally:
        if running is not None:
            running.stop(0)
    s = stats(ms)
    return {"grpc_p50_ms": s["p50_ms"], "grpc_mean_ms": s["mean_ms"], "grpc_p99_ms": s["p99_ms"],
            "grpc_server_p50_ms": float(np.percentile(server_ms, 50)), "grpc_target": target}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    from bench.serving import machine
    from ragcore.model_files import ragserve_home
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="datastore sizes in tokens (prefixes of --datastore)")
    ap.add_argument("--contexts", type=int, default=2000, help="contexts timed per size")
    ap.add_argument("--numpy-contexts", type=int, default=300, help="contexts also timed with the NumPy baseline")
    ap.add_argument("--prompts", type=int, default=12, help="HumanEval outputs the contexts come from")
    ap.add_argument("--contexts-from", choices=("humaneval", "datastore"), default="humaneval",
                    help="humaneval = the model's greedy HumanEval outputs (default); datastore = prefixes of the "
                         "datastore's own documents (no model: a quick run on any datastore)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "code"), help="the big datastore")
    ap.add_argument("--grpc", action="store_true", help="also time the Draft RPC on an in-process server")
    ap.add_argument("--grpc-target", default=None, help="also time the Draft RPC against HOST:PORT")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        sizes = [int(float(s)) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be comma-separated numbers, got {args.sizes!r}")
    if any(s < 1 for s in sizes) or args.contexts < 1:
        ap.error(f"--sizes and --contexts must be positive, got {sizes} / {args.contexts}")

    t0 = time.perf_counter()
    big = SuffixArrayDatastore.open(args.datastore)
    if args.contexts_from == "humaneval":
        contexts = bench_contexts(args.contexts, args.prompts)
    else:
        contexts = datastore_contexts(big, args.contexts)
    command = " ".join(["python -m bench.draft_retrieval"] + (sys.argv[1:] if argv is None else argv))
    results: dict = {"sizes": {}, "merged_mean_ms": None, "grpc_p50_ms": None, "contexts": len(contexts),
                     "command": command,
                     "machine": {**machine(), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                                 "python": platform.python_version()}}
    source = f"{args.prompts} greedy HumanEval outputs" if args.contexts_from == "humaneval" else "its documents"
    print(f"{len(contexts)} contexts from {source}; big datastore {big}")
    for size in sizes:
        path = prefix_datastore(big, size, Path(args.datastore).parent).path if size < big.num_tokens else big.path
        rss0 = rss_mb()
        t1 = time.perf_counter()
        opened = SuffixArrayDatastore.open(path)
        t2 = time.perf_counter()
        opened.warmup()
        startup = {"open_s": t2 - t1, "warmup_s": time.perf_counter() - t2,
                   "rss_growth_open_warmup_mb": rss_mb() - rss0, "bytes_on_disk": opened.bytes_on_disk}
        r = measure(opened, contexts, args.numpy_contexts) | measure_batch(opened, contexts) | startup
        r["rss_growth_after_bench_mb"] = rss_mb() - rss0
        r["num_tokens"] = opened.num_tokens
        results["sizes"][str(opened.num_tokens)] = r
        results["merged_mean_ms"] = r["merged_mean_ms"]
        if size == sizes[-1] and (args.grpc or args.grpc_target):
            try:
                results |= measure_grpc(opened, contexts[:1000], args.grpc_target)
            except ImportError as e:
                print(f"gRPC not measured: {e}")
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - t0

    print(f"\n{'tokens':>12} {'p50':>7} {'mean':>7} {'p90':>7} {'p99':>7} {'search':>7} {'tree':>7} {'merged':>7}"
          f" {'np p50':>8} {'np mean':>8} {'x mean':>7} {'L':>5} {'matches':>8}   (ms)")
    for n, r in results["sizes"].items():
        print(f"{int(n):>12,} {r['p50_ms']:>7.3f} {r['mean_ms']:>7.3f} {r['p90_ms']:>7.3f} {r['p99_ms']:>7.3f} "
              f"{r['search_mean_ms']:>7.3f} {r['tree_mean_ms']:>7.3f} {r['merged_mean_ms']:>7.3f} "
              f"{r['numpy_p50_ms']:>8.2f} {r['numpy_mean_ms']:>8.2f} {r['speedup_mean']:>7.0f} "
              f"{r['matched_suffix_mean']:>5.1f} {r['num_matches_mean']:>8.0f}")
    if results["grpc_p50_ms"] is not None:
        print(f"Draft RPC p50 {results['grpc_p50_ms']:.3f} ms (server-side p50 {results['grpc_server_p50_ms']:.3f} ms)")
    load = results["machine"]
    print(f"load average start {load['loadavg_start'][0]:.2f}, end {load['loadavg_end'][0]:.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
