"""kNN-LM serving benchmark: baseline (one Search per token) vs RaLMSpec (cache speculation + batched
verification, fixed strides and OS³), per retriever (edr = faiss exact, adr = HNSW) and k; plus perplexity on
held-out text with λ > 0 vs λ = 0 (is it a real kNN-LM?).

    python -m bench.knnlm --retrievers edr,adr --k 1,16,256,1024 --configs base,s2,s4,s8,os3 --limit 6 \\
        --max-new-tokens 32 --json bench/results/knnlm.json

Setup: the retrieval service runs as its own process (python -m retrieval_service.server) with only the
retriever under test loaded (the exact index of 1 M × 576 float32 keys is 2.3 GB, HNSW as much again); the
worker side (model, datastore values/keys memory-mapped, the NeighbourCache) runs in this process and calls
Search over gRPC on loopback, exactly as generation_service does. Prompts are the starts of held-out documents
(never in the datastore). For every prompt, all configs run back to back for each k (interleaved, so load
changes from other work on the machine hit every config alike); latency is the wall time of the whole request
(prefill included). `identical` counts requests whose tokens equal the baseline's.

--serve measures the product path instead: both services started as a user starts them (tools.launcher, default
flags, the retrieval service serving the datastore's keys, the worker its values) and every request a `Generate`
call with `GenerateRequest.knnlm`; R/G/S come from the reply's KnnLmStats. Then the worker's own choices apply
(model format and threads, per-pass thread adaptation beside the Search, its OS³ settings), which an in-process
run does not have: there, passes beside an async verification run a 2-thread team against the Search's core.

G/R split (from KnnLmStats): R = Search calls (wire included) and the true distributions, G = single-token LM
passes, S = speculation (cache look-ups and fills). Speculation pays when R dominates and a batched Search of s
queries costs much less than s single ones.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from bench.serving import closed_loop, machine
from generation_service.config import DTYPE_CHOICES
from generation_service.knnlm.loop import generate_tokens
from generation_service.knnlm.options import KNN_OS3, KnnLmOptions
from generation_service.knnlm.passes import _output_layer_input
from generation_service.knnlm.search import KnnBackend
from generation_service.model.sampling import SamplingParams
from ragcore.knn_store import DEFAULT_DIR, load_held_out, open_datastore

SPECULATIVE = ("s1", "s2", "s4", "s8", "s16", "os3")
CONFIGS = ("base",) + SPECULATIVE + tuple(f"{c}-sync" for c in SPECULATIVE)


def config_options(name: str, retriever: str, k: int, lam: float, temperature: float) -> KnnLmOptions:
    """base | s<stride> | os3, "-sync" = without async verification -> KnnLmOptions."""
    if name == "base":
        return KnnLmOptions(retriever=retriever, k=k, lam=lam, temperature=temperature, speculate=False)
    spec, _, sync = name.partition("-")
    stride = 0 if spec == "os3" else int(spec[1:])
    return KnnLmOptions(retriever=retriever, k=k, lam=lam, temperature=temperature, speculate=True, stride=stride,
                        async_verify=sync != "sync")


# ------------------------------------------------------------------------------------- retrieval process

class RetrievalProcess:
    """python -m retrieval_service.server serving the datastore with one retriever, on a free loopback port."""

    def __init__(self, datastore: Path, retriever: str, omp_threads: int, log_dir: Path):
        from tools.launcher import free_port

        self.port = free_port()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"knnlm-retrieval-{retriever}.log"
        argv = [sys.executable, "-m", "retrieval_service.server", "--port", str(self.port),
                "--kb-knn-datastores", str(datastore), "--kb-retrievers", retriever,
                "--kb-omp-threads", str(omp_threads), "--workers", "4"]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 1200.0) -> None:
        from ragcore.grpc_shell import wait_until_serving

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"retrieval service exited; log {self.log}:\n{self.log.read_text()[-3000:]}")
            if wait_until_serving(self.address, timeout_s=2.0):
                return
        raise TimeoutError(f"retrieval service not SERVING after {timeout_s:.0f} s (log {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -------------------------------------------------------------------------------------------- latency

# One request: (prompt, max new tokens, options) -> (tokens, the KnnLmStats fields this benchmark keeps).
Runner = Callable[[np.ndarray, int, KnnLmOptions], tuple[list[int], dict]]
STAT_FIELDS = ("retrieval_ms", "generation_ms", "speculation_ms", "prefill_ms", "kb_calls", "kb_queries",
               "speculated", "correct", "rollbacks", "wasted_passes")


def in_process_runner(tm, backend: KnnBackend, os3_gamma_max: float) -> Runner:
    os3 = replace(KNN_OS3, gamma_max=os3_gamma_max)

    def run(prompt: np.ndarray, max_new: int, opts: KnnLmOptions) -> tuple[list[int], dict]:
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
        tokens, st = generate_tokens(tm, prompt, params, opts, backend, os3=os3 if opts.stride == 0 else None)
        return tokens, {**{f: getattr(st, f) for f in STAT_FIELDS}, "overlapped": st.overlapped,
                        "strides": list(st.strides)}
    return run


class ServedKnn:
    """Both services started as a user starts them (tools.launcher, default flags), requests over gRPC."""

    def __init__(self, datastore: Path, dtype: str):
        import tempfile

        from generation_service.client import GenerationClient
        from tools import launcher

        self.launcher = launcher
        self.state = Path(tempfile.mkdtemp(prefix="bench-knnlm-")) / "launcher.json"
        topo = launcher.up(dtype=dtype, state=self.state, timeout_s=1800,
                           extra_retrieval=["--kb-knn-datastores", str(datastore)],
                           extra_generation=["--knnlm-datastore", str(datastore)])
        self.client = GenerationClient(topo.get("generation").address)
        info = self.client.info()
        self.setup = {"dtype": info.dtype, "threads": info.threads, "calibration": info.calibration,
                      "worker_cpu": info.cpu, "logs": str(self.state.parent / "logs")}

    def run(self, prompt: np.ndarray, max_new: int, opts: KnnLmOptions) -> tuple[list[int], dict]:
        from proto import generation_pb2

        req = generation_pb2.KnnLmOptions(retriever=opts.retriever, k=opts.k, knn_weight=opts.lam,
                                          temperature=opts.temperature, speculate=opts.speculate,
                                          stride=opts.stride, async_verify=opts.async_verify)
        reply = self.client.generate(prompt_tokens=[int(t) for t in prompt], max_new_tokens=max_new,
                                     ignore_eos=True, knnlm=req, timeout=900)
        st = reply.stats.knnlm
        return list(reply.token_ids), {**{f: getattr(st, f) for f in STAT_FIELDS}, "overlapped": st.overlapped,
                                       "strides": list(st.strides)}

    def close(self) -> None:
        self.client.close()
        self.launcher.down(state=self.state)


def run_latency(run: Runner, prompts: list[np.ndarray], ks: list[int], configs: list[str], retriever: str,
                args, base_tokens: dict | None = None) -> dict:
    """-> {"<k>": {"<config>": {...}}} for one retriever; configs interleaved per prompt and k. base_tokens, if
    given, gets the baseline's tokens per (prompt index, k)."""
    from tqdm import tqdm

    rows: dict[str, dict[str, list[dict]]] = {str(k): {c: [] for c in configs} for k in ks}
    # Warm-up: the first requests pay for page faults of the keys and the model's first passes.
    for c in ("base", "s4"):
        run(prompts[0], 4, config_options(c, retriever, ks[-1], args.lam, args.temperature))
    bar = tqdm(total=len(prompts) * len(ks) * len(configs), desc=f"latency {retriever}", unit="req")
    for i, prompt in enumerate(prompts):
        for k in ks:
            base = None
            for c in configs:  # "base" first (validated in main), so every config is compared with its run
                opts = config_options(c, retriever, k, args.lam, args.temperature)
                t0 = time.perf_counter()
                tokens, st = run(prompt, args.max_new_tokens, opts)
                latency = time.perf_counter() - t0
                if c == "base":
                    base = tokens
                    if base_tokens is not None:
                        base_tokens[(i, k)] = tokens
                strides = st.pop("strides")
                rows[str(k)][c].append({"latency_s": latency, "identical": tokens == base,
                                        "tokens": len(tokens), **st,
                                        "mean_stride": float(np.mean(strides)) if strides else 0.0})
                bar.update(1)
    bar.close()
    out: dict = {}
    for k, per_config in rows.items():
        base_lat = float(np.mean([r["latency_s"] for r in per_config["base"]]))
        out[k] = {}
        for c, rs in per_config.items():
            mean = lambda key: float(np.mean([r[key] for r in rs]))  # noqa: E731
            lat = mean("latency_s")
            spec = sum(r["speculated"] for r in rs)
            out[k][c] = {
                "latency_s": lat, "identical": int(sum(r["identical"] for r in rs)), "n": len(rs),
                "speedup": base_lat / lat, "retrieval_s": mean("retrieval_ms") / 1e3,
                "generation_s": mean("generation_ms") / 1e3, "speculation_s": mean("speculation_ms") / 1e3,
                "prefill_s": mean("prefill_ms") / 1e3, "kb_calls": mean("kb_calls"),
                "kb_queries": mean("kb_queries"), "mean_stride": mean("mean_stride"),
                "speculation_accuracy": (sum(r["correct"] for r in rs) / spec) if spec else None,
                "wasted_passes": mean("wasted_passes"), "overlapped": mean("overlapped"), "tokens": mean("tokens"),
                "per_request_s": [r["latency_s"] for r in rs]}
    return out


def run_concurrent(run: Runner, prompts: list[np.ndarray], k: int, configs: list[str], retriever: str, args,
                   base_tokens: dict) -> dict:
    """--clients N closed-loop clients per config (2 N requests, prompts in turn) -> {"<config>": {aggregate
    tokens/s, mean latency, identical to the solo baseline}}. Concurrent requests share the worker's batched
    passes and the retrieval service's scans (concurrent exact Searches run as one: knowledge/coalesce.py)."""
    from tqdm import tqdm

    n_req = 2 * args.clients
    bar = tqdm(total=n_req * len(configs), desc=f"{args.clients} clients {retriever}", unit="req")
    out = {}
    for c in configs:
        opts = config_options(c, retriever, k, args.lam, args.temperature)

        def one(i: int) -> tuple[float, int, bool]:
            p = i % len(prompts)
            t0 = time.perf_counter()
            tokens, _ = run(prompts[p], args.max_new_tokens, opts)
            bar.update(1)
            return time.perf_counter() - t0, len(tokens), tokens == base_tokens.get((p, k))

        rows, wall = closed_loop(n_req, args.clients, one)
        out[c] = {"clients": args.clients, "requests": len(rows), "wall_s": wall,
                  "tokens_per_s": sum(n for _, n, _ in rows) / wall,
                  "latency_s": float(np.mean([lat for lat, _, _ in rows])),
                  "identical": int(sum(same for _, _, same in rows))}
    bar.close()
    base_tps = out["base"]["tokens_per_s"]
    for r in out.values():
        r["throughput_x"] = r["tokens_per_s"] / base_tps
    return out


# ----------------------------------------------------------------------------------------- perplexity

def held_out_windows(docs: list[np.ndarray], n_tokens: int, window: int) -> list[np.ndarray]:
    """Windows of up to `window` tokens from the held-out documents, in order, until n_tokens targets."""
    out, total = [], 0
    for doc in docs:
        for s in range(0, len(doc) - 1, window):
            w = doc[s:s + window + 1]  # window + 1 tokens: `window` (context, target) pairs
            if len(w) < 2:
                continue
            take = min(len(w) - 1, n_tokens - total)
            out.append(w[: take + 1])
            total += take
            if total >= n_tokens:
                return out
    return out


def perplexity(tm, backend: KnnBackend, docs: list[np.ndarray], args) -> dict:
    """Perplexity of held-out text under the LM (λ = 0) and the kNN-LM (exact neighbours, k = args.ppl_k).

    The neighbours of every position are fetched once (batched Search); λ and T are then chosen on the first
    half of the positions (dev) from a small grid and the second half (test) is reported, next to the
    benchmark's own (λ, T).
    """
    import torch
    from tqdm import tqdm

    windows = held_out_windows(docs, args.ppl_tokens, args.ppl_window)
    lm_logp, knn_scores, knn_hit = [], [], []
    values = backend.datastore.values
    bar = tqdm(total=sum(len(w) - 1 for w in windows), desc="perplexity", unit="tok")
    for w in windows:
        with torch.inference_mode(), _output_layer_input(tm) as box:
            logits = tm.model(input_ids=torch.from_numpy(w[:-1].astype(np.int64))[None], use_cache=False).logits[0]
        hidden = box[-1][0].float().numpy()  # [L, D]
        targets = w[1:].astype(np.int64)  # [L]
        lm_logp.append(torch.log_softmax(logits.double(), -1)[torch.arange(len(targets)), targets].numpy())
        for s in range(0, len(targets), args.ppl_batch):
            hits = backend.client.search(hidden[s:s + args.ppl_batch], args.ppl_k, "edr")
            for j, (ids, scores) in enumerate(hits):
                knn_scores.append(np.asarray(scores, np.float64))
                knn_hit.append(np.asarray(values[ids]) == targets[s + j])
            bar.update(min(args.ppl_batch, len(targets) - s))
    bar.close()
    lm_lp = np.concatenate(lm_logp)  # [T]

    def knn_logp(lam: float, temperature: float, idx: np.ndarray) -> np.ndarray:
        out = np.empty(len(idx))
        for o, i in enumerate(idx):
            z = knn_scores[i] / temperature
            w = np.exp(z - z.max())
            p_knn = float(w[knn_hit[i]].sum() / w.sum())
            out[o] = np.log(lam * p_knn + (1 - lam) * np.exp(lm_lp[i]))
        return out

    n = len(lm_lp)
    dev, test = np.arange(n // 2), np.arange(n // 2, n)
    ppl = lambda lp: float(np.exp(-lp.mean()))  # noqa: E731
    grid = {}
    for lam in (0.1, 0.25, 0.5):
        for t in (1.0, 3.0, 10.0, 30.0, 100.0):
            grid[f"lam={lam},T={t}"] = ppl(knn_logp(lam, t, dev))
    best = min(grid, key=grid.get)
    b_lam, b_t = (float(x.split("=")[1]) for x in best.split(","))
    lam = b_lam if args.lam == "auto" else float(args.lam)
    temperature = b_t if args.temperature == "auto" else float(args.temperature)
    # Headline numbers on the test half only: λ and T may have been chosen on the dev half.
    return {
        "lm": ppl(lm_lp[test]), "knnlm": ppl(knn_logp(lam, temperature, test)),
        "lambda": lam, "temperature": temperature, "k": args.ppl_k, "retriever": "edr",
        "tokens": len(test), "tokens_dev": len(dev), "window": args.ppl_window,
        "neighbour_has_target": float(np.mean([h.any() for h in knn_hit])),
        "dev_choice": {"lambda": b_lam, "temperature": b_t, "grid": grid},
        "all_positions": {"lm": ppl(lm_lp), "knnlm": ppl(knn_logp(lam, temperature, np.arange(n)))},
    }


# ----------------------------------------------------------------------------------------------- main

def print_table(results: dict) -> None:
    for retriever, per_k in results.items():
        print(f"\n{retriever}: mean latency per request (s), speedup vs base, identical/n, "
              "R/G/S seconds per request, speculation accuracy, mean stride")
        for k, per_config in per_k.items():
            for c, r in per_config.items():
                acc = f"{r['speculation_accuracy']:.2f}" if r["speculation_accuracy"] is not None else "-"
                print(f"  k={k:>5} {c:>5}  {r['latency_s']:7.3f}  x{r['speedup']:5.2f}  {r['identical']}/{r['n']}  "
                      f"R {r['retrieval_s']:6.3f} G {r['generation_s']:6.3f} S {r['speculation_s']:6.3f}  "
                      f"acc {acc}  s̄ {r['mean_stride']:.1f}")


def _atomic_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _checkpoint(result: dict, args, t_start: float) -> None:
    """After every retriever: a partial run is still a result."""
    result["loadavg_end"], result["wall_s"] = list(os.getloadavg()), time.time() - t_start
    if args.json:
        _atomic_json(Path(args.json), result)


def measure_served(served: ServedKnn, result: dict, prompts, ks, configs, retrievers, args, t_start: float) -> None:
    result["setup"].update(served=served.setup, faiss_threads="the service default", os3="the worker's")
    result["knnlm_over"] = "grpc: Generate -> generation service -> retrieval service (tools.launcher, defaults)"
    for retriever in retrievers:
        base_tokens: dict = {}
        result["retrievers"][retriever] = run_latency(served.run, prompts, ks, configs, retriever, args, base_tokens)
        _checkpoint(result, args, t_start)
        if args.clients > 1:
            result.setdefault("concurrent", {})[retriever] = run_concurrent(served.run, prompts, ks[-1], configs,
                                                                            retriever, args, base_tokens)
            _checkpoint(result, args, t_start)


def measure_in_process(tm, held, result: dict, prompts, ks, configs, retrievers, args, t_start: float) -> None:
    # Perplexity first (exact neighbours): it picks λ and T on its dev half when they are "auto", so the latency
    # runs serve the kNN-LM that actually predicts held-out text best.
    for retriever in sorted(retrievers, key=lambda r: r != "edr"):
        proc = RetrievalProcess(Path(args.datastore), retriever, args.omp_threads, Path("var"))
        try:
            t0 = time.perf_counter()
            proc.wait()
            result.setdefault("retrieval_start_s", {})[retriever] = time.perf_counter() - t0
            backend = KnnBackend.open(args.datastore, proc.address, timeout_ms=120_000)
            try:
                if retriever == "edr" and args.ppl_tokens:
                    ppl = perplexity(tm, backend, held[args.limit:] + held[: args.limit], args)
                    result["perplexity"] = ppl
                    args.lam, args.temperature = ppl["lambda"], ppl["temperature"]
                    result["setup"]["lambda"], result["setup"]["temperature"] = args.lam, args.temperature
                    _atomic_json(Path(args.json), result) if args.json else None
                run = in_process_runner(tm, backend, args.os3_gamma_max)
                result["retrievers"][retriever] = run_latency(run, prompts, ks, configs, retriever, args)
            finally:
                backend.close()
        finally:
            proc.stop()
        _checkpoint(result, args, t_start)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.knnlm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--datastore", default=str(DEFAULT_DIR),
                    help="kNN-LM datastore directory (tools.knn_build; default %(default)s)")
    ap.add_argument("--retrievers", default="edr,adr",
                    help="comma list of edr (exact) and adr (HNSW) (default %(default)s)")
    ap.add_argument("--k", default="1,16,256,1024", help="comma list of neighbours per Search (default %(default)s)")
    ap.add_argument("--configs", default="base,s2,s4,s8,os3",
                    help=f"comma list of {', '.join(CONFIGS)}; must include base (default %(default)s)")
    ap.add_argument("--limit", type=int, default=6, help="prompts (held-out document starts)")
    ap.add_argument("--prompt-tokens", type=int, default=64,
                    help="tokens of each prompt; shorter held-out documents are skipped (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default %(default)s)")
    ap.add_argument("--lam", default="auto", help="λ, or auto = the perplexity run's dev-set choice")
    ap.add_argument("--temperature", default="auto", help="T, or auto = the perplexity run's dev-set choice")
    ap.add_argument("--os3-gamma-max", type=float, default=KNN_OS3.gamma_max,
                    help="OS³'s cap on the estimated speculation accuracy, in [0, 1] (default %(default)s)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="auto = the worker's calibrated choice on this machine (the serving default)")
    ap.add_argument("--threads", type=int, default=0, help="model threads of the worker side; 0 = calibrated")
    ap.add_argument("--omp-threads", type=int, default=1, help="faiss threads of the retrieval service")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="held-out tokens for perplexity (0 = skip)")
    ap.add_argument("--ppl-window", type=int, default=256,
                    help="tokens per LM pass of the perplexity run (default %(default)s)")
    ap.add_argument("--ppl-k", type=int, default=1024,
                    help="exact (edr) neighbours per position of the perplexity run (default %(default)s)")
    ap.add_argument("--ppl-batch", type=int, default=32,
                    help="positions per Search call of the perplexity run (default %(default)s)")
    ap.add_argument("--serve", action="store_true",
                    help="the product path: start both services with default flags (tools.launcher) and send every "
                         "request as Generate with GenerateRequest.knnlm (no perplexity, --threads, --omp-threads or "
                         "--os3-gamma-max: the services' defaults)")
    ap.add_argument("--clients", type=int, default=1,
                    help="--serve: after the latency runs, each config again from this many concurrent clients "
                         "(2 x clients requests, the largest k): aggregate tokens/s (1 = skip)")
    ap.add_argument("--json", default="",
                    help="write the results here, updated after each retriever (atomic; '' = none)")
    args = ap.parse_args(argv)
    if args.clients > 1 and not args.serve:
        raise SystemExit("--clients needs --serve (concurrent requests go through the services)")
    if args.serve and (args.ppl_tokens or args.threads or args.omp_threads != 1
                       or args.os3_gamma_max != KNN_OS3.gamma_max or args.dtype not in ("auto", "")):
        raise SystemExit("--serve starts its own services with default flags: no --ppl-tokens (use 0), --threads, "
                         "--omp-threads, --os3-gamma-max or --dtype")
    args.lam = args.lam if args.lam == "auto" else float(args.lam)
    args.temperature = args.temperature if args.temperature == "auto" else float(args.temperature)
    retrievers = [r.strip() for r in args.retrievers.split(",") if r.strip()]
    ks = [int(k) for k in args.k.split(",") if k.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "base" not in configs:
        raise SystemExit(f"--configs: need base and some of {CONFIGS}, got {configs}")
    configs = ["base"] + [c for c in configs if c != "base"]

    from threadpoolctl import threadpool_info

    from generation_service.engine.calibrate import calibrated_model

    t_start = time.time()
    ds = open_datastore(args.datastore)
    held = load_held_out(args.datastore)
    prompts = [d[: args.prompt_tokens].astype(np.int64) for d in held if len(d) >= args.prompt_tokens][: args.limit]
    served = ServedKnn(Path(args.datastore), "") if args.serve else None
    if served is None:
        tm, choice = calibrated_model("", "cpu", args.dtype, args.threads)  # what the server would serve
        args.dtype, args.threads = choice.curve.dtype, choice.curve.threads
    else:
        args.dtype, args.threads = served.setup["dtype"], served.setup["threads"]
    result: dict = {
        "command": "python -m bench.knnlm " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),  # CPU model and flags, kernel ISA, cores, commit: the README table names the CPU
        "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "loadavg_start": list(os.getloadavg()),
        "threadpools": [{k: i[k] for k in ("internal_api", "num_threads")} for i in threadpool_info()],
        "datastore": {k: ds.meta.get(k) for k in ("n", "dim", "dtype", "key", "documents", "tokens", "hnsw",
                                                  "model_dtype", "window", "overlap", "build_s", "keys_s", "bytes")},
        "setup": {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
                  "max_new_tokens": args.max_new_tokens, "lambda": args.lam, "temperature": args.temperature,
                  "model_dtype": args.dtype, "worker_threads": args.threads, "faiss_threads": args.omp_threads,
                  "os3": vars(replace(KNN_OS3, gamma_max=args.os3_gamma_max)), "cache_next": KnnLmOptions().cache_next,
                  "cache_capacity": KnnLmOptions().cache_capacity, "interleaved": "per prompt and k"},
        "retrievers": {},
    }
    auto = args.lam == "auto" or args.temperature == "auto"
    if auto and (not args.ppl_tokens or "edr" not in retrievers):
        raise SystemExit("--lam/--temperature auto need the perplexity run (--ppl-tokens > 0, edr retriever)")
    if served is not None:
        try:
            measure_served(served, result, prompts, ks, configs, retrievers, args, t_start)
        finally:
            served.close()
    else:
        measure_in_process(tm, held, result, prompts, ks, configs, retrievers, args, t_start)
    print_table(result["retrievers"])
    for retriever, per_config in result.get("concurrent", {}).items():
        print(f"\n{retriever}, {args.clients} concurrent clients: aggregate tokens/s (x base), mean latency s, "
              "identical/requests")
        for c, r in per_config.items():
            print(f"  {c:>8}  {r['tokens_per_s']:7.1f}  x{r['throughput_x']:5.2f}  {r['latency_s']:6.2f}  "
                  f"{r['identical']}/{r['requests']}")
    if "perplexity" in result:
        p = result["perplexity"]
        print(f"\nperplexity on {p['tokens']} held-out tokens (test half; λ, T chosen on {p['tokens_dev']} dev "
              f"tokens): LM {p['lm']:.3f} -> kNN-LM (λ={p['lambda']}, T={p['temperature']}, k={p['k']}) "
              f"{p['knnlm']:.3f}")
    print(f"\nloadavg start {result['loadavg_start']}, end {result['loadavg_end']}; wall {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
