"""What the KV cache's storage type costs a batched pass: fp16 against fp32 caches, interleaved, in process.

    python -m bench.kv_dtype                                    # q4_1_bf16 where it runs, else q4_1; ~2 min
    python -m bench.kv_dtype --json bench/results/kv-dtype-<cpu class>.json

Per (sequences B, rows q per sequence, cached tokens P): the ms of one fused pass over B segments of q rows (an AR
step at q = 1, a chain of q - 1 draft nodes otherwise) after P cached tokens, KV slab as the engine runs it; the
median of --reps passes per cache type, the two types alternating pass by pass, so machine drift hits both. Why:
every decode row's attention reads its sequence's whole past, which at 8 sequences of a few hundred tokens is a
third of the pass and bound by memory bandwidth; fp16 halves those reads (lean_llama.LeanLlama.set_kv_dtype).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.serving import cpu_class, machine, write_json
from generation_service.engine.steps import prefill, tree_segment
from generation_service.model.lean_llama import KVSlab
from generation_service.model.target import cache_length, forward_batch, load_model, set_threads

SHAPES = ((1, 1), (8, 1), (8, 4), (16, 1))  # (sequences, rows per sequence)
PASTS = (20, 300, 600)
KINDS = ("fp32", "fp16")


def measure(tm, shapes, pasts, reps: int, progress) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for b, q in shapes:
        for past in pasts:
            caches = {}
            for kind in KINDS:
                tm.lean.set_kv_dtype(kind)
                slab = KVSlab(len(tm.lean.layers), tm.lean.kv_heads, tm.lean.head_dim, b, past + q + 64,
                              tm.lean.kv_dtype, tm.lean.device)
                caches[kind] = [slab.cache(i) for i in range(b)]
                for c in caches[kind]:
                    prefill(tm, c, torch.from_numpy(rng.integers(0, 30000, past)))
            parents = np.arange(-1, q - 2, dtype=np.int32)  # a chain: the cost depends on q, not the shape
            ms = {kind: [] for kind in KINDS}
            for rep in range(reps + 1):
                for kind in (KINDS if rep % 2 else KINDS[::-1]):
                    segs = [tree_segment(tm, c, int(rng.integers(0, 1000)),
                                         rng.integers(0, 30000, q - 1).astype(np.int32), parents)
                            for c in caches[kind]]
                    t0 = time.perf_counter()
                    forward_batch(tm, segs)
                    if rep:  # the first round warms both
                        ms[kind].append((time.perf_counter() - t0) * 1e3)
                    for c in caches[kind]:
                        c.crop(past - cache_length(c))
            row = {"sequences": b, "rows": q, "past": past, **{f"{k}_ms": round(float(np.median(v)), 2)
                                                               for k, v in ms.items()}}
            row["fp16_speedup"] = round(row["fp32_ms"] / row["fp16_ms"], 3)
            rows.append(row)
            progress(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--dtype", default="", help="weight format (default: q4_1_bf16 where it runs, else q4_1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    ap.add_argument("--reps", type=int, default=25, help="passes per cache type and cell (default 25)")
    ap.add_argument("--json", default="", help="write the results here (atomically)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    tm = None
    for fmt in ([args.dtype] if args.dtype else ["q4_1_bf16", "q4_1"]):
        try:
            tm = load_model("", dtype=fmt, device="cpu", forward="lean")
            break
        except (ValueError, RuntimeError) as e:
            print(f"{fmt}: {e}")
    if tm is None or tm.lean is None or tm.lean.fused is None:
        raise SystemExit("the fused forward is not available here (kernels not built): nothing to compare")
    load0 = os.getloadavg()

    def progress(row: dict) -> None:
        print(f"B={row['sequences']:>2} q={row['rows']} past={row['past']:>3}: fp32 {row['fp32_ms']:6.2f} ms  "
              f"fp16 {row['fp16_ms']:6.2f} ms  x{row['fp16_speedup']:.2f}", flush=True)

    rows = measure(tm, SHAPES, PASTS, args.reps, progress)
    out = {"command": "python -m bench.kv_dtype " + " ".join(argv if argv is not None else []),
           "machine": machine(), "cpu_class": cpu_class(), "format": tm.dtype_name, "threads": args.threads, "reps": args.reps,
           "loadavg_start": load0, "loadavg_end": os.getloadavg(), "rows": rows}
    if args.json:
        write_json(Path(args.json), out)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
