"""Knowledge-base retrieval latency vs batch size (RaLMSpec Appendix A.1), in-process and over gRPC.

    python -m bench.kb --kb ~/.cache/ragserve/kb/docs --retrievers edr,adr,sr --batch-sizes 1,2,4,8,16,32 \\
        --json bench/results/kb_retrieval.json
    python -m bench.kb --kb postgresql://postgres@127.0.0.1:5432/postgres --batch-sizes 1,8   # the KB in PostgreSQL

Queries are 32-word windows of random KB passages (RaLMSpec queries with the last 32 generated tokens).
Dense retrievers are timed on query vectors; query encoding is timed separately (encode_ms_per_query).
Over gRPC the servicer runs on a free loopback port in this process (or --target an external server).
Also: HNSW recall@1/@10 against the exact index for several efSearch, ScoreCandidates on 20 docs, and the
KB's build times and sizes (from kb.json). The machine load average is recorded: numbers from a contended
machine are provisional.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from bench import serving
from ragcore.process import offline_process
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import dense, pg, sparse
from retrieval_service.knowledge.backends import open_knowledge_base
from retrieval_service.knowledge.kb import KB_INDEX, KnowledgeBase

DEFAULT_KB = Path.home() / ".cache" / "ragserve" / "kb" / "docs"
TARGETS = {"edr": 3.0, "sr": 1.8}  # per-query speed-up at batch 8 vs batch 1
SCORE_CANDIDATES_TARGET_MS = 2.0


def make_queries(kb: KnowledgeBase, n: int, words: int = 32, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for doc in rng.choice(len(kb.passages), size=n, replace=len(kb.passages) < n):
        title, text = kb.passages.get([int(doc)])[0]
        toks = text.split()
        start = int(rng.integers(0, max(1, len(toks) - words)))
        out.append(" ".join(toks[start:start + words]) or title)
    return out


def time_batches(run: Callable[[int, int], None], n: int, batch: int, min_queries: int, budget_s: float) -> dict:
    """Call run(start, stop) over consecutive batches; ms per query = total time / queries answered."""
    run(0, batch)  # warm (JIT, caches) outside the measurement
    done, elapsed, calls = 0, 0.0, []
    start = 0
    while done < min_queries or (elapsed < budget_s and done < 4 * min_queries):
        if start + batch > n:
            start = 0
        t0 = time.perf_counter()
        run(start, start + batch)
        dt = time.perf_counter() - t0
        calls.append(dt * 1e3)
        elapsed += dt
        done += batch
        start += batch
        if elapsed > 4 * budget_s:
            break
    return {"ms_per_query": elapsed * 1e3 / done, "ms_per_call_median": statistics.median(calls),
            "queries": done, "calls": len(calls)}


def start_local_server(kb: KnowledgeBase, cfg: RetrievalConfig):
    """The knowledge servicer on a free loopback port in this process -> (target, stop)."""
    from ragcore.grpc_shell import start_server
    from retrieval_service.knowledge.service import KnowledgeServicer

    servicer = KnowledgeServicer(kb, cfg)
    running = start_server(servicer.add_to_server, host="127.0.0.1", port=0, workers=cfg.workers,
                           max_concurrent_rpcs=cfg.max_concurrent_rpcs, max_message_bytes=cfg.max_message_bytes)
    running.set_serving(True)
    return running.address, lambda: running.stop(0)


def run(args: argparse.Namespace) -> dict:
    retrievers = [r.strip() for r in args.retrievers.split(",") if r.strip()]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    load_before = os.getloadavg()
    cfg = RetrievalConfig(kb=str(args.kb), kb_retrievers=",".join(retrievers), kb_threads=args.threads,
                          kb_omp_threads=args.omp_threads, kb_query_cache=0,
                          kb_pg_table=getattr(args, "kb_pg_table", "ragserve_kb"))
    t0 = time.perf_counter()
    kb = open_knowledge_base(args.kb, cfg)
    open_s = time.perf_counter() - t0
    n_q = max(args.queries, max(batch_sizes))
    queries = make_queries(kb, n_q)
    out: dict = {"kb": pg.masked(args.kb) if pg.is_url(args.kb) else str(args.kb), "passages": len(kb.passages), "k": args.k, "queries": n_q,
                 "threads": args.threads, "omp_threads": args.omp_threads, "open_s": open_s,
                 "open_breakdown_s": kb.open_s,
                 "build": kb.manifest.get("build", {}), "build_peak_rss_mb": kb.manifest.get("peak_rss", {}),
                 "retrievers": {}, "encode": {}}

    # Query encoding, separately from search ---------------------------------------------------------------
    vectors = None
    if kb.encoder is not None:
        enc = kb.encoder
        vectors = enc.encode(queries)  # [n_q, D]
        for b in batch_sizes:
            out["encode"][str(b)] = time_batches(lambda s, e: enc.encode(queries[s:e], batch_size=b), n_q, b,
                                                 args.min_queries, args.budget_s)

    # In-process and gRPC search latency --------------------------------------------------------------------
    stop = None
    target = args.target
    if not args.no_grpc and not target:
        target, stop = start_local_server(kb, cfg)
    stub = None
    if target:
        import grpc

        from proto import knowledge_pb2 as pb, knowledge_pb2_grpc
        from ragcore.wire import pack_f32, pack_ids

        channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                         ("grpc.max_send_message_length", 64 << 20)])
        stub = knowledge_pb2_grpc.KnowledgeServiceStub(channel)
    for r in retrievers:
        res: dict = {}
        for b in batch_sizes:
            if r == "sr":
                local = lambda s, e: kb.search("sr", args.k, texts=queries[s:e])  # noqa: E731
            else:
                local = lambda s, e: kb.search(r, args.k, vectors=vectors[s:e])  # noqa: E731
            row = time_batches(local, n_q, b, args.min_queries, args.budget_s)
            if stub is not None:
                if r == "sr":
                    remote = lambda s, e: stub.Search(pb.SearchRequest(retriever="sr", k=args.k,  # noqa: E731
                                                                       texts=queries[s:e]))
                else:
                    remote = lambda s, e: stub.Search(pb.SearchRequest(retriever=r, k=args.k,  # noqa: E731
                                                                       vectors=pack_f32(vectors[s:e])))
                g = time_batches(remote, n_q, b, args.min_queries, args.budget_s)
                row["grpc_ms_per_query"] = g["ms_per_query"]
                row["grpc_ms_per_call_median"] = g["ms_per_call_median"]
            res[str(b)] = row
            print(f"  {r} batch {b:3d}: {row['ms_per_query']:.3f} ms/query in-process"
                  + (f", {row['grpc_ms_per_query']:.3f} over gRPC" if "grpc_ms_per_query" in row else ""), flush=True)
        out["retrievers"][r] = res

    # HNSW recall vs exact ---------------------------------------------------------------------------------
    vi = kb.vector_indexes.get(KB_INDEX)
    if vi is not None and "adr" in vi.retrievers and "edr" in vi.retrievers:
        exact = [h[0] for h in vi.search(vectors, 10)]
        exact_ids = np.stack([np.pad(e, (0, 10 - len(e)), constant_values=-1) for e in exact])
        rows = []
        for ef in sorted({*[int(e) for e in args.ef_search.split(",")], vi.default_ef_search}):
            approx = [h[0] for h in vi.search(vectors, 10, approx=True, ef_search=ef)]
            approx_ids = np.stack([np.pad(a, (0, 10 - len(a)), constant_values=-1) for a in approx])
            lat = time_batches(lambda s, e: vi.search(vectors[s:e], args.k, approx=True, ef_search=ef), n_q, 8,
                               args.min_queries, args.budget_s / 2)
            rows.append({"ef_search": ef, "recall_at_1": dense.recall_at(approx_ids, exact_ids, 1),
                         "recall_at_10": dense.recall_at(approx_ids, exact_ids, 10),
                         "ms_per_query_batch8": lat["ms_per_query"]})
        out["hnsw"] = rows
        default = next(r for r in rows if r["ef_search"] == vi.default_ef_search)
        out["hnsw_ef_search"] = vi.default_ef_search
        out["hnsw_recall_at_1"] = default["recall_at_1"]
        out["hnsw_recall_at_10"] = default["recall_at_10"]

    # ScoreCandidates on 20 docs ------------------------------------------------------------------------------
    if stub is not None:
        sc: dict = {}
        rng = np.random.default_rng(1)
        for r in retrievers:
            calls = {"text": [], "vector": []}
            for i in range(args.score_calls):
                q = queries[i % n_q]
                ids = pack_ids(rng.choice(len(kb.passages), size=20, replace=False))
                kinds = ["text"] if r == "sr" else ["vector", "text"]
                for kind in kinds:
                    req = pb.ScoreCandidatesRequest(retriever=r, ids=ids, text=q if kind == "text" else "",
                                                    vector=pack_f32(vectors[i % n_q]) if kind == "vector" else b"")
                    t0 = time.perf_counter()
                    stub.ScoreCandidates(req)
                    calls[kind].append((time.perf_counter() - t0) * 1e3)
            sc[r] = {f"{kind}_ms_median": statistics.median(v[5:]) for kind, v in calls.items() if v}
            sc[r].update({f"{kind}_ms_p90": float(np.percentile(v[5:], 90)) for kind, v in calls.items() if v})
        out["score_candidates"] = sc
        # The speculative cache's call: a query vector for dense (encoded once per step), text for BM25.
        key = next((r for r in ("edr", "adr") if r in sc), None)
        out["score_candidates_ms"] = sc[key]["vector_ms_median"] if key else sc["sr"]["text_ms_median"]
        out["score_candidates_note"] = (f"{key}, query vector, 20 docs, over gRPC (median)" if key else
                                        "sr, query text, 20 docs, over gRPC (median)")
    if stop is not None:
        stop()

    # Summary --------------------------------------------------------------------------------------------------
    speedups = {}
    for r, rows in out["retrievers"].items():
        if "1" in rows and "8" in rows:
            speedups[r] = {"in_process": rows["1"]["ms_per_query"] / rows["8"]["ms_per_query"]}
            if "grpc_ms_per_query" in rows["1"]:
                speedups[r]["grpc"] = rows["1"]["grpc_ms_per_query"] / rows["8"]["grpc_ms_per_query"]
    out["speedup_batch8"] = speedups
    out["targets"] = {
        **{f"{r}_speedup_batch8>={t}": speedups[r]["in_process"] >= t for r, t in TARGETS.items() if r in speedups},
        **({f"score_candidates_ms<={SCORE_CANDIDATES_TARGET_MS}":
            out["score_candidates_ms"] <= SCORE_CANDIDATES_TARGET_MS} if "score_candidates_ms" in out else {}),
    }
    out["machine"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                      "contended": max(load_before[0], os.getloadavg()[0]) > (os.cpu_count() or 1) * 0.75,
                      **serving.machine()}
    kb.close()
    return out


def print_table(out: dict) -> None:
    bs = sorted({int(b) for rows in out["retrievers"].values() for b in rows} | {int(b) for b in out["encode"]})
    print(f"\nKB {out['kb']}: {out['passages']} passages, k={out['k']}, {out['queries']} queries, "
          f"load avg {out['machine']['loadavg_before'][0]:.1f} -> {out['machine']['loadavg_after'][0]:.1f} "
          f"on {out['machine']['cpus']} CPUs{' (CONTENDED: provisional)' if out['machine']['contended'] else ''}")
    print("ms per query by batch size (in-process / over gRPC)")
    print(f"{'':14s}" + "".join(f"{b:>16d}" for b in bs))
    if out["encode"]:
        enc = [out["encode"].get(str(b), {}).get("ms_per_query", float("nan")) for b in bs]
        print(f"{'encode (text)':14s}" + "".join(f"{v:16.3f}" for v in enc))
    for r, rows in out["retrievers"].items():
        cells = []
        for b in bs:
            row = rows.get(str(b))
            grpc_ms = row.get("grpc_ms_per_query", float("nan")) if row else 0.0
            cells.append(f"{row['ms_per_query']:7.3f}/{grpc_ms:<7.3f}" if row else "")
        print(f"{r:14s}" + "".join(f"{c:>16s}" for c in cells))
    for r, s in out.get("speedup_batch8", {}).items():
        print(f"speed-up batch 8 vs 1, {r}: {s['in_process']:.2f}x in-process"
              + (f", {s['grpc']:.2f}x over gRPC" if "grpc" in s else ""))
    for row in out.get("hnsw", []):
        print(f"HNSW efSearch {row['ef_search']:4d}: recall@1 {row['recall_at_1']:.3f}  recall@10 "
              f"{row['recall_at_10']:.3f}  {row['ms_per_query_batch8']:.3f} ms/query (batch 8)")
    for r, s in out.get("score_candidates", {}).items():
        print(f"ScoreCandidates 20 docs over gRPC, {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(s.items())))
    for name, b in out.get("build", {}).items():
        print(f"build {name:8s} " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in sorted(b.items())))
    print("targets: " + ", ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in out["targets"].items()))


def main(argv: list[str] | None = None) -> None:
    offline_process()
    sparse.prepare_process()  # BM25's JVM settings: before anything starts threads
    ap = argparse.ArgumentParser(prog="python -m bench.kb", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", default=str(DEFAULT_KB),
                    help="knowledge base directory or postgresql:// URL (default ~/.cache/ragserve/kb/docs)")
    ap.add_argument("--kb-pg-table", default="ragserve_kb", help="the KB's table when --kb is a postgresql:// URL")
    ap.add_argument("--retrievers", default="edr,adr,sr", help="comma list of edr, adr, sr to time (default all)")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32",
                    help="comma list of queries per search call (default %(default)s)")
    ap.add_argument("--k", type=int, default=10, help="hits per query (default %(default)s)")
    ap.add_argument("--queries", type=int, default=256, help="distinct queries (32-word passage windows)")
    ap.add_argument("--min-queries", type=int, default=64, help="queries timed per configuration, at least")
    ap.add_argument("--budget-s", type=float, default=3.0, help="time per configuration, roughly")
    ap.add_argument("--ef-search", default="16,32,64,128,256",
                    help="comma list of HNSW efSearch values for recall and latency; the index's default is added "
                         "(default %(default)s)")
    ap.add_argument("--score-calls", type=int, default=200,
                    help="ScoreCandidates calls (20 random docs each) per retriever and query kind, over gRPC "
                         "(default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="Lucene batch-search threads")
    ap.add_argument("--omp-threads", type=int, default=1, help="faiss/torch threads")
    ap.add_argument("--target", default="", help="an external retrieval server (host:port) instead of in-process")
    ap.add_argument("--no-grpc", action="store_true",
                    help="start no local gRPC server: gRPC search and ScoreCandidates are timed only with --target")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    out = run(args)
    out["command"] = "python -m bench.kb " + " ".join(sys.argv[1:] if argv is None else argv)
    print_table(out)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(path)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
