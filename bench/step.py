"""Decode-step benchmark: ms of one forward pass over q new rows after a 200-token cached prefix, per weight format
and forward implementation, with llama.cpp's decode step on the same machine as the anchor when it is installed.

    python -m bench.step                          # q = 1, 4, 16, 64; fp32, bf16, q4_1; lean, lean-ops, hf forward
    python -m bench.step --reps 5 --formats q4_1,fp32 --forwards lean

Each pass is what the decode loop runs (engine.steps.tree_segment + forward_batch over a chain of q - 1 draft nodes after the last
token; q = 1 is an AR step), cropped back to the prefix afterwards. Batch 8: eight sequences (200 cached tokens
each, in the slots of one KV slab as the engine keeps them) with q rows each in one forward_batch pass, as the
continuous-batching engine runs them. Variants are measured interleaved, the order rotating every round, so load
drifts hit all alike; round 0 only warms kernels. Reported: min and median ms per pass.
Forwards: lean = the lean forward as served (the fused C++ pass, lean_forward.cpp, where it runs: fp32 activations,
passes under 128 rows); lean-ops = the same weights through the per-op Python path (what the fused pass replaces);
hf = transformers. q4_1 runs on the lean forward only (the hf forward would compute in fp32).
The llama.cpp anchors (llama-cpp-python, optional: `pip install -e '.[anchor]'`, a source build) decode the shipped
Q4_1 GGUF and an F32 GGUF written from it (its blocks dequantized: the values of our fp32 safetensors, with the same
metadata): ms per token of single-token decode steps after the same 200-token prefix, same thread count.
Results: bench/results/step-<cpuclass>[-<kernel level>].json (cpu class as bench/serving.py names it) and a printed
table. --kernel-level x86-64-v3 runs the AVX2 build of the kernels (what an AVX2-only CPU loads) on this one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.serving import cpu_class, machine, write_json
from generation_service.engine.model_thread import ModelThread
from generation_service.engine.speculative import prefill
from generation_service.engine.steps import tree_segment
from generation_service.model.kernels.build import LEVELS, load_level
from generation_service.model.lean_llama import KVSlab
from generation_service.model.target import TargetModel, cache_length, forward_batch, load_model, new_cache, set_threads

ROWS = (1, 4, 16, 64)
PREFIX = 200
FORMATS = ("fp32", "bf16", "q4_1", "q4_1_bf16", "q4_1_i8")
FORWARDS = ("lean", "lean-ops", "hf")
BATCH = 8


def _load() -> float:
    return os.getloadavg()[0]


def load_variants(formats: list[str], forwards: list[str], threads: int) -> tuple[dict[str, TargetModel], dict]:
    variants, skipped = {}, {}
    for fmt in formats:
        for fwd in forwards:
            name = f"{fwd}/{fmt}"
            try:
                tm = load_model("", dtype=fmt, device="cpu", forward="lean" if fwd == "lean-ops" else fwd)
            except ValueError as e:  # q4_1 with the hf forward
                skipped[name] = f"n/a: {e}"
                continue
            if fwd == "lean-ops":
                if tm.lean.fused is None:
                    skipped[name] = "n/a: the same as lean here (the fused pass runs fp32 activations only)"
                    continue
                tm.lean.fused = None
            variants[name] = tm
    return variants, skipped


def time_passes(variants: dict[str, TargetModel], rows: tuple[int, ...], reps: int
                ) -> dict[str, dict[str, dict[int, list]]]:
    """ms samples per variant, batch (1, BATCH) and q, measured interleaved (module docstring)."""
    rng = np.random.default_rng(0)
    caches = {}
    for name, tm in variants.items():
        slab = KVSlab(len(tm.lean.layers), tm.lean.kv_heads, tm.lean.head_dim, BATCH, PREFIX + max(rows) + 64,
                      tm.lean.kv_dtype, tm.lean.device) if tm.lean is not None else None
        caches[name] = [new_cache(tm, PREFIX + max(rows) + 8)] + [
            slab.cache(i) if slab is not None else new_cache(tm, PREFIX + max(rows) + 8) for i in range(BATCH)]
        for c in caches[name]:
            prefill(tm, c, torch.from_numpy(rng.integers(0, 30000, PREFIX)))
    samples = {n: {"1": {q: [] for q in rows}, str(BATCH): {q: [] for q in rows}} for n in variants}
    names = list(variants)
    for rep in range(reps + 1):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            tm, solo, batch = variants[name], caches[name][0], caches[name][1:]
            for q in rows:
                parents = np.arange(-1, q - 2, dtype=np.int32)  # a chain: the cost depends on q, not the shape
                for b, cs in (("1", [solo]), (str(BATCH), batch)):
                    drafts = [(int(rng.integers(0, 1000)), rng.integers(0, 30000, q - 1).astype(np.int32))
                              for _ in cs]
                    t0 = time.perf_counter()  # the step's segments (masks, positions) and its one pass
                    forward_batch(tm, [tree_segment(tm, c, last, tokens, parents)
                                       for c, (last, tokens) in zip(cs, drafts)])
                    elapsed = (time.perf_counter() - t0) * 1e3
                    for c in cs:
                        c.crop(PREFIX - cache_length(c))  # negative: drop the pass's rows (both cache types)
                    if rep:
                        samples[name][b][q].append(elapsed)
    return samples


def llama_cpp_anchor(threads: int, tokens: int = 32, runs: int = 5) -> dict:
    """Per GGUF (q4_1: the shipped file; fp32: f32_gguf()) ms per decode token of llama.cpp after a PREFIX-token
    prompt, or why not. Each runs in a child process: torch's OpenMP workers keep spinning after our passes and
    would take llama.cpp's cores."""
    if importlib.util.find_spec("llama_cpp") is None:
        why = ("not installed: llama-cpp-python is not in this environment (optional extra 'anchor': "
               "pip install -e '.[anchor]', a source build of llama.cpp; never a runtime dependency)")
        return {"q4_1": {"status": why}, "fp32": {"status": why}}
    out = {}
    for fmt in ("q4_1", "fp32"):
        code = (f"import json, bench.step as s; print(json.dumps(s.llama_cpp_decode({fmt!r}, {threads}, {tokens}, "
                f"{runs})))")
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                                  check=True)
            out[fmt] = json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            out[fmt] = {"status": f"failed: {type(e).__name__}: {(getattr(e, 'stderr', '') or '').strip()[-300:]}"}
    return out


def f32_gguf(src: Path) -> Path:
    """An F32 copy of a GGUF (every tensor dequantized, metadata kept) next to our cached models; written once,
    atomically. Its values are our fp32 safetensors' (q4_weights: the checkpoint is the GGUF's dequantization)."""
    import gguf
    from gguf.quants import dequantize

    from ragcore.model_files import ragserve_home

    out = ragserve_home() / "models" / (src.stem.rsplit(".", 1)[0] + ".F32.gguf")
    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    os.replace(tmp, out)
    return out


def llama_cpp_decode(fmt: str, threads: int, tokens: int, runs: int) -> dict:
    import llama_cpp

    from ragcore.model_files import bundled_gguf_path

    path = bundled_gguf_path() if fmt == "q4_1" else f32_gguf(bundled_gguf_path())
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
    note = ("llama.cpp quantizes activations to Q8_1 for its Q4_1 dot products (not exact w.r.t. fp32); "
            if fmt == "q4_1" else "")
    return {"status": "measured", "version": llama_cpp.__version__, "gguf": path.name, "threads": threads,
            "decode_ms_per_token": {"min": min(per_run), "median": statistics.median(per_run), "runs": per_run},
            "note": note + f"min/median over runs of {tokens} single-token steps after a {PREFIX}-token prompt, in a "
                           "child process"}


def q4_kernel_isa() -> str:
    from generation_service.model.kernels.build import kernel

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
            results[name] = {"batch1": skipped[name], f"batch{BATCH}": skipped[name]}
            continue
        results[name] = {f"batch{b}": {str(q): {"min_ms": min(s), "median_ms": statistics.median(s), "samples": s}
                                       for q, s in per_q.items()}
                         for b, per_q in samples[name].items()}
        one = results[name]["batch1"][str(args.rows[0])]["median_ms"]
        results[name]["median_vs_first_row_count"] = {  # a pass of q rows against one of the fewest rows
            str(q): results[name]["batch1"][str(q)]["median_ms"] / one for q in args.rows}
    variants.clear()
    anchor = llama_cpp_anchor(threads) if not args.no_anchor else {
        f: {"status": "skipped (--no-anchor)"} for f in ("q4_1", "fp32")}
    return {"bench": "step", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "cpu_class": cpu_class(), "torch": torch.__version__, "threads": threads, "prefix_tokens": PREFIX,
            "rows": list(args.rows), "reps": args.reps, "load_before": load_before, "load_after": _load(),
            "q4_kernel_isa": q4_kernel_isa(), "int8_path": int8_path(), "results": results, "llama_cpp": anchor}


def int8_path() -> str:
    """The path of q4_1_i8's int8-activation linears here (every path gives the same bits), or ''."""
    from generation_service.model.kernels.build import kernel

    k = kernel()
    return k.i8_path() if k is not None and hasattr(k, "i8_path") else ""


def print_table(res: dict) -> None:
    m = res["machine"]
    print(f"\nCPU {m['cpu']} ({' '.join(m['cpu_flags'])}), {res['threads']} threads, torch {res['torch']}, "
          f"q4 kernel {res['q4_kernel_isa']}, load {res['load_before']:.2f} -> {res['load_after']:.2f}")
    print(f"ms per forward pass over q rows per sequence after {res['prefix_tokens']} cached tokens (min / median of "
          f"{res['reps']})")
    print(f"{'variant':<20} " + " ".join(f"{'q=' + str(q):>13}" for q in res["rows"]))
    for name, r in res["results"].items():
        for b in ("1", str(BATCH)):
            per_q = r[f"batch{b}"]
            label = f"{name} x{b}"
            if isinstance(per_q, str):
                print(f"{label:<20} {per_q}")
                continue
            print(f"{label:<20} " + " ".join(f"{per_q[str(q)]['min_ms']:>6.1f}/{per_q[str(q)]['median_ms']:<6.1f}"
                                             for q in res["rows"]))
    for fmt, a in res["llama_cpp"].items():
        if a["status"] == "measured":
            d = a["decode_ms_per_token"]
            print(f"llama.cpp {a['version']} {fmt} ({a['gguf']}, {a['threads']} threads): decode {d['min']:.1f} / "
                  f"{d['median']:.1f} ms per token")
        else:
            print(f"llama.cpp {fmt}: {a['status']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    ap.add_argument("--forwards", default=",".join(FORWARDS), help=f"comma list of {', '.join(FORWARDS)}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of q (rows per pass)")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core this process may use)")
    ap.add_argument("--no-anchor", action="store_true", help="skip the llama.cpp anchor")
    ap.add_argument("--kernel-level", default="", help=f"run the CPU kernels built for this x86-64 level instead of "
                    f"this CPU's best ({', '.join(LEVELS)}; e.g. x86-64-v3: an AVX2 machine's kernels)")
    ap.add_argument("--json", default="", help="output file (default bench/results/step-<cpuclass>[-<level>].json)")
    args = ap.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    args.forwards = [f for f in args.forwards.split(",") if f]
    args.rows = sorted({int(q) for q in args.rows.split(",") if q})
    bad = [f for f in args.formats if f not in FORMATS] + [f for f in args.forwards if f not in FORWARDS]
    if bad or not args.rows or args.rows[0] < 1 or args.reps < 1:
        ap.error(f"bad --formats/--forwards/--rows/--reps: {bad or args.rows or args.reps}")
    if args.kernel_level:
        if args.kernel_level not in LEVELS:
            ap.error(f"--kernel-level: one of {', '.join(LEVELS)}")
        load_level(args.kernel_level)
    mt = ModelThread("bench-step")  # every pass on one thread, as in the server (engine/model_thread.py)
    try:
        res = mt.call(run, args)
    finally:
        mt.stop(wait=True)
    res["kernel_level"] = args.kernel_level or "this CPU's best"
    res["command"] = shlex.join(["python", "-m", "bench.step", *(argv if argv is not None else sys.argv[1:])])
    suffix = f"-{args.kernel_level}" if args.kernel_level else ""
    out = Path(args.json or Path(__file__).parent / "results" / f"step-{res['cpu_class']}{suffix}.json")
    write_json(out, res)
    print_table(res)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
