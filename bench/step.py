"""Decode-step benchmark: ms of one forward pass over q new rows after a 200-token cached prefix, per weight format
and forward implementation, with llama.cpp's decode step on the same machine as the anchor when it is installed.

    python -m bench.step                          # q = 1, 4, 16, 64; fp32, bf16, q4_1; lean and hf forward
    python -m bench.step --reps 5 --formats q4_1,fp32 --forwards lean

Each pass is what the decode loop runs (speculative.verify_tree over a chain of q - 1 draft nodes after the last
token; q = 1 is an AR step), cropped back to the prefix afterwards. Variants are measured interleaved, the order
rotating every round, so load drifts hit all alike; round 0 only warms kernels. Reported: min and median ms per q.
Batch: the forward runs one sequence per pass (batched ragged steps come with the continuous-batching engine), so
batch 8 is recorded as "n/a" with that reason. q4_1 runs on the lean forward only (the hf forward would compute in
fp32). The llama.cpp anchor (llama-cpp-python, optional: `pip install -e '.[anchor]'`, a source build) decodes the
shipped Q4_1 GGUF: ms per token of single-token decode steps after the same 200-token prefix, same thread count.
Results: bench/results/step-<cpuclass>.json (cpu class as bench/serving.py names it) and a printed table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.serving import cpu_class, machine, write_json
from generation_service.calibrate import ModelThread
from generation_service.model import TargetModel, cache_length, load_model, new_cache, set_threads
from generation_service.speculative import prefill, verify_tree

ROWS = (1, 4, 16, 64)
PREFIX = 200
FORMATS = ("fp32", "bf16", "q4_1")
FORWARDS = ("lean", "hf")
BATCH_NOTE = ("n/a: the forward (lean and the hf path through model.forward) runs one sequence per pass; batched "
              "ragged steps come with the continuous-batching engine")


def _load() -> float:
    return os.getloadavg()[0]


def load_variants(formats: list[str], forwards: list[str], threads: int) -> tuple[dict[str, TargetModel], dict]:
    variants, skipped = {}, {}
    for fmt in formats:
        for fwd in forwards:
            name = f"{fwd}/{fmt}"
            try:
                variants[name] = load_model("", dtype=fmt, device="cpu", forward=fwd)
            except ValueError as e:  # q4_1 with the hf forward
                skipped[name] = f"n/a: {e}"
    return variants, skipped


def time_passes(variants: dict[str, TargetModel], rows: tuple[int, ...], reps: int) -> dict[str, dict[int, list]]:
    """ms samples per variant and q, measured interleaved (module docstring)."""
    rng = np.random.default_rng(0)
    prefix = torch.from_numpy(rng.integers(0, 30000, PREFIX))
    caches = {}
    for name, tm in variants.items():
        caches[name] = new_cache(tm, PREFIX + max(rows) + 8)
        prefill(tm, caches[name], prefix)
    samples: dict[str, dict[int, list]] = {n: {q: [] for q in rows} for n in variants}
    names = list(variants)
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            tm, cache = variants[name], caches[name]
            for q in rows:
                tokens = rng.integers(0, 30000, q - 1).astype(np.int32)
                parents = np.arange(-1, q - 2, dtype=np.int32)  # a chain: the cost depends on q, not the shape
                t0 = time.perf_counter()
                verify_tree(tm, cache, int(rng.integers(0, 1000)), tokens, parents)
                elapsed = (time.perf_counter() - t0) * 1e3
                cache.crop(PREFIX - cache_length(cache))  # negative: drop the pass's rows (both cache types)
                if rep:
                    samples[name][q].append(elapsed)
    return samples


def llama_cpp_anchor(threads: int, tokens: int = 32, runs: int = 5) -> dict:
    """ms per decode token of llama.cpp on the shipped Q4_1 GGUF after a PREFIX-token prompt, or why not. Runs in
    a child process: torch's OpenMP workers keep spinning after our passes and would take llama.cpp's cores."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {"status": "not installed: llama-cpp-python is not in this environment (optional extra 'anchor': "
                          "pip install -e '.[anchor]', a source build of llama.cpp; never a runtime dependency)"}
    code = f"import json, bench.step as s; print(json.dumps(s.llama_cpp_decode({threads}, {tokens}, {runs})))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, check=True)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        return {"status": f"failed: {type(e).__name__}: {(getattr(e, 'stderr', '') or '').strip()[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_cpp_decode(threads: int, tokens: int, runs: int) -> dict:
    import llama_cpp

    from ragcore.model_files import bundled_gguf_path

    path = bundled_gguf_path()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                          n_batch=PREFIX, verbose=False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, 30000, PREFIX)]
    per_run = []
    for _ in range(runs + 1):  # the first run warms up and is not recorded
        llm.reset()
        llm.eval(prompt)
        t0 = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(rng.integers(0, 30000))])  # one token per call: a decode step
        per_run.append((time.perf_counter() - t0) * 1e3 / tokens)
    per_run = per_run[1:]
    return {"status": "measured", "version": llama_cpp.__version__, "gguf": path.name, "threads": threads,
            "decode_ms_per_token": {"min": min(per_run), "median": statistics.median(per_run), "runs": per_run},
            "note": "llama.cpp quantizes activations to Q8_1 for its Q4_1 dot products (not exact w.r.t. fp32); "
                    "min/median over runs of 32 single-token steps after a 200-token prompt, in a child process"}


def q4_kernel_isa() -> str:
    from generation_service.q4_kernel import kernel

    k = kernel()
    return k.isa() if k is not None else "unavailable (fp32 fallback)"


def run(args: argparse.Namespace) -> dict:
    threads = args.threads or len(os.sched_getaffinity(0))
    set_threads(threads)
    load_before = _load()
    variants, skipped = load_variants(args.formats, args.forwards, threads)
    samples = time_passes(variants, tuple(args.rows), args.reps)
    results: dict = {}
    for name in [f"{fwd}/{fmt}" for fmt in args.formats for fwd in args.forwards]:
        if name in skipped:
            results[name] = {"batch1": skipped[name], "batch8": skipped[name]}
            continue
        results[name] = {"batch1": {str(q): {"min_ms": min(s), "median_ms": statistics.median(s), "samples": s}
                                    for q, s in samples[name].items()},
                         "batch8": BATCH_NOTE}
    variants.clear()
    anchor = llama_cpp_anchor(threads) if not args.no_anchor else {"status": "skipped (--no-anchor)"}
    return {"bench": "step", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "cpu_class": cpu_class(), "torch": torch.__version__, "threads": threads, "prefix_tokens": PREFIX,
            "rows": list(args.rows), "reps": args.reps, "load_before": load_before, "load_after": _load(),
            "q4_kernel_isa": q4_kernel_isa(), "results": results, "llama_cpp": anchor}


def print_table(res: dict) -> None:
    m = res["machine"]
    print(f"\nCPU {m['cpu']} ({' '.join(m['cpu_flags'])}), {res['threads']} threads, torch {res['torch']}, "
          f"q4 kernel {res['q4_kernel_isa']}, load {res['load_before']:.2f} -> {res['load_after']:.2f}")
    print(f"ms per forward pass over q rows after {res['prefix_tokens']} cached tokens, batch 1 (min / median of "
          f"{res['reps']})")
    print(f"{'variant':<11} " + " ".join(f"{'q=' + str(q):>13}" for q in res["rows"]))
    for name, r in res["results"].items():
        b1 = r["batch1"]
        if isinstance(b1, str):
            print(f"{name:<11} {b1}")
            continue
        print(f"{name:<11} " + " ".join(f"{b1[str(q)]['min_ms']:>6.1f}/{b1[str(q)]['median_ms']:<6.1f}"
                                        for q in res["rows"]))
    print(f"batch 8: {BATCH_NOTE}")
    a = res["llama_cpp"]
    if a["status"] == "measured":
        d = a["decode_ms_per_token"]
        print(f"llama.cpp {a['version']} ({a['gguf']}, {a['threads']} threads): decode {d['min']:.1f} / "
              f"{d['median']:.1f} ms per token")
    else:
        print(f"llama.cpp: {a['status']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--forwards", default=",".join(FORWARDS), help=f"comma list of {', '.join(FORWARDS)}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of q (rows per pass)")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core this process may use)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the llama.cpp anchor")
    ap.add_argument("--json", default="", help="output file (default bench/results/step-<cpuclass>.json)")
    args = ap.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.forwards = [f for f in args.forwards.split(",") if f]
    args.rows = sorted({int(q) for q in args.rows.split(",") if q})
    bad = [f for f in args.formats if f not in FORMATS] + [f for f in args.forwards if f not in FORWARDS]
    if bad or not args.rows or args.rows[0] < 1 or args.reps < 1:
        ap.error(f"bad --formats/--forwards/--rows/--reps: {bad or args.rows or args.reps}")
    mt = ModelThread("bench-step")  # every pass on one thread, as in the server (calibrate.ModelThread)
    try:
        res = mt.call(run, args)
    finally:
        mt.stop(wait=True)
    out = Path(args.json or Path(__file__).parent / "results" / f"step-{res['cpu_class']}.json")
    write_json(out, res)
    print_table(res)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
