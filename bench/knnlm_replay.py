"""Where kNN-LM speculation's ceiling is: baseline trajectories replayed through the NeighbourCache offline.

    python -m bench.knnlm_replay --prompts 16 --new-tokens 64 --json bench/results/knnlm-replay-zen4.json

1. Trajectories: the baseline (one exact Search per token, k neighbours) for held-out prompts, through the
   retrieval service on loopback (as bench.knnlm starts it): per step the query, the true neighbours, the LM's
   logits and the token. Each step's costs are timed on the way: an LM pass, and a Search of 1 and of s queries.
2. Replay: sync rounds of a fixed stride s over those steps, as knnlm/loop.py _speculative runs them (the first token a
   baseline step, then s guesses from the cache, the round ending at the first wrong guess, the cache filled with
   the verified steps' neighbours), for each cache setting. A guess's query is the baseline's own (a right guess
   leaves the state where the baseline's was), so no LM runs here and settings compare on the same steps.
3. Model: per token, the baseline costs pass + Search(1); a replayed round costs a pass and a cache look-up per
   guess, one Search of its s queries and one fill, all timed in step 1 or during the replay. `ceiling_x` is the
   same model with every guess right: no setting of the cache beats it.

Not the served figure (bench.knnlm --serve decides): no async rounds, no round gate, no OS³, one process.
"""

from __future__ import annotations

from ragcore.process import worker_openmp_spin

if __name__ == "__main__":  # its LM passes run here: the worker's libgomp spin, set before torch loads
    worker_openmp_spin()

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.serving import machine
from generation_service.knnlm.cache import NeighbourCache, key_norms
from generation_service.knnlm.distribution import mixed_distribution, next_token
from generation_service.knnlm.options import KnnLmOptions
from generation_service.knnlm.passes import lm_prefill, lm_step
from generation_service.knnlm.search import KnnBackend
from ragcore.knn_store import DEFAULT_DIR, load_held_out, open_datastore


def trajectories(tm, backend: KnnBackend, prompts: list[np.ndarray], new_tokens: int, opts: KnnLmOptions,
                 strides: list[int]) -> tuple[list[dict], dict]:
    """The baseline's steps per prompt (q [T, D], ids [T, k], logits [T, V], tokens [T]) and median seconds of an
    LM pass and of a Search of 1 and of s queries (s in strides)."""
    from tqdm import tqdm

    from generation_service.model.target import new_cache

    out, pass_s, search_s = [], [], {s: [] for s in [1] + strides}
    bar = tqdm(total=len(prompts) * new_tokens, desc="baseline trajectories", unit="tok")
    for prompt in prompts:
        kv = new_cache(tm)
        logits, q = lm_prefill(tm, kv, prompt)
        steps: dict[str, list] = {"q": [], "ids": [], "logits": [], "tokens": []}
        for _ in range(new_tokens):
            t = time.perf_counter()
            ids, scores = backend.client.search(q[None], opts.k, opts.retriever)[0]
            search_s[1].append(time.perf_counter() - t)
            token = next_token(mixed_distribution(logits, scores, np.asarray(backend.datastore.values[ids]), opts))
            for key, value in (("q", q), ("ids", ids), ("logits", logits.float().numpy()), ("tokens", token)):
                steps[key].append(value)
            t = time.perf_counter()
            logits, q = lm_step(tm, kv, token)
            pass_s.append(time.perf_counter() - t)
            bar.update(1)
        out.append({key: np.stack(v) if key != "tokens" else np.array(v) for key, v in steps.items()})
        for s in strides:  # a verification of s queries, on this prompt's first s steps
            t = time.perf_counter()
            backend.client.search(out[-1]["q"][:s], opts.k, opts.retriever)
            search_s[s].append(time.perf_counter() - t)
    bar.close()
    return out, {"pass_s": float(np.median(pass_s)), **{f"search_{s}_s": float(np.median(v))
                                                         for s, v in search_s.items()}}


def replay(ds, traj: list[dict], opts: KnnLmOptions, stride: int, next_n: int, capacity: int,
           norms: np.ndarray | None = None, fill_top: int = 0) -> dict:
    """Sync rounds of `stride` over the baseline's steps: guesses, rounds, tokens, and timed look-ups and fills.
    norms: the datastore's ‖key‖² as the worker keeps them (knnlm/cache.py key_norms)."""
    rounds = tokens = guesses = right = 0
    look_s, fill_s = [], []
    for steps in traj:
        n = len(steps["tokens"])
        cache = NeighbourCache(ds, next_n, capacity, norms, fill_top)
        cache.fill(steps["ids"][0])  # the first token is a baseline step
        t = 1
        while t < n:
            emitted = 0
            for i in range(min(stride, n - t)):
                t0 = time.perf_counter()
                _, scores, values = cache.nearest(steps["q"][t + i], opts.k)
                look_s.append(time.perf_counter() - t0)
                guess = next_token(mixed_distribution(torch.from_numpy(steps["logits"][t + i]), scores, values, opts))
                guesses += 1
                emitted += 1
                if guess != steps["tokens"][t + i]:
                    break
                right += 1
            t0 = time.perf_counter()
            cache.fill_many(list(steps["ids"][t:t + emitted]))
            fill_s.append(time.perf_counter() - t0)
            t += emitted
            rounds += 1
            tokens += emitted
    return {"stride": stride, "cache_next": next_n, "cache_capacity": capacity, "cache_fill_top": fill_top,
            "guess_accuracy": right / guesses,
            "tokens_per_round": tokens / rounds, "rounds": rounds, "tokens": tokens, "guesses": guesses,
            "lookup_s": float(np.median(look_s)), "fill_s": float(np.median(fill_s))}


def modelled(r: dict, costs: dict) -> dict:
    """Speed-ups over the baseline from the measured costs: at the replayed accuracy and with every guess right."""
    s = r["stride"]
    base = costs["pass_s"] + costs["search_1_s"]  # per token
    round_fixed = costs[f"search_{s}_s"] + r["fill_s"]
    step = costs["pass_s"] + r["lookup_s"]
    spec = (r["guesses"] * step + r["rounds"] * round_fixed) / r["tokens"]
    return {"modelled_x": base / spec, "ceiling_x": base / (step + round_fixed / s)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.knnlm_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--datastore", default=str(DEFAULT_DIR), help="kNN-LM datastore directory (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts (default %(default)s)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default %(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="baseline tokens per prompt (default %(default)s)")
    ap.add_argument("--k", type=int, default=1024, help="neighbours per Search (default %(default)s)")
    ap.add_argument("--lam", type=float, default=0.25, help="λ (default %(default)s)")
    ap.add_argument("--temperature", type=float, default=30.0, help="T (default %(default)s)")
    ap.add_argument("--strides", default="2,4,8,16", help="comma list of replayed strides (default %(default)s)")
    ap.add_argument("--capacities", default="16384,65536",
                    help="comma list of cache capacities, replayed at stride 4 (default %(default)s)")
    ap.add_argument("--nexts", default="",
                    help="comma list of cache_next values (entries after each neighbour), replayed at stride 4 "
                         "and 8 (default: none)")
    ap.add_argument("--fill-tops", default="",
                    help="comma list of cache_fill_top values (successors of each query's best m neighbours only; "
                         "0 = all), replayed at stride 4 and 8 with each of --capacities (default: none)")
    ap.add_argument("--dtype", default="auto",
                    help="the LM's weights: auto = what the server would serve (this machine's calibration, measured "
                         "where the cache lacks it), or a fixed dtype loaded without calibrating (default %(default)s)")
    ap.add_argument("--json", default="", help="write the results here (atomic; '' = none)")
    args = ap.parse_args(argv)
    strides = [int(s) for s in args.strides.split(",") if s.strip()]
    capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    nexts = [int(n) for n in args.nexts.split(",") if n.strip()]
    fill_tops = [int(m) for m in args.fill_tops.split(",") if m.strip()]

    from bench.knnlm import RetrievalProcess, _atomic_json
    from generation_service.engine.calibrate import calibrated_model
    from generation_service.model.target import load_model

    t_start = time.time()
    ds = open_datastore(args.datastore)
    held = load_held_out(args.datastore)
    prompts = [d[: args.prompt_tokens].astype(np.int64) for d in held if len(d) >= args.prompt_tokens][: args.prompts]
    opts = KnnLmOptions(k=args.k, lam=args.lam, temperature=args.temperature, speculate=False)
    if args.dtype == "auto":
        tm, choice = calibrated_model("", "cpu", "auto", 0)  # what the server would serve
        model_dtype = choice.curve.dtype
    else:
        tm, model_dtype = load_model("", dtype=args.dtype, device="cpu"), args.dtype
    proc = RetrievalProcess(Path(args.datastore), "edr", 1, Path("var"))
    try:
        proc.wait()
        backend = KnnBackend.open(args.datastore, proc.address, timeout_ms=120_000)
        try:
            traj, costs = trajectories(tm, backend, prompts, args.new_tokens, opts, strides)
        finally:
            backend.close()
    finally:
        proc.stop()
    default = KnnLmOptions()
    top = default.cache_fill_top
    settings = [(s, default.cache_next, default.cache_capacity, top) for s in strides]
    settings += [(4, default.cache_next, c, top) for c in capacities if c != default.cache_capacity]
    settings += [(s, n, default.cache_capacity, top) for s in (4, 8) for n in nexts if n != default.cache_next]
    settings += [(s, default.cache_next, c, m) for s in (4, 8) for m in fill_tops for c in capacities
                 if m != top or c != default.cache_capacity]
    rows = []
    norms = key_norms(ds)
    for stride, next_n, capacity, fill_top in dict.fromkeys(settings):  # each setting once, in order
        r = replay(ds, traj, opts, stride, next_n, capacity, norms, fill_top)
        rows.append({**r, **modelled(r, costs)})
        print(f"s={stride:2d} n={next_n} C={capacity:6d} top={fill_top or args.k:4d}  "
              f"accuracy {r['guess_accuracy']:.3f}  tokens/round {r['tokens_per_round']:.2f}  "
              f"look-up {r['lookup_s'] * 1e3:.2f} ms  fill {r['fill_s'] * 1e3:.1f} ms  "
              f"modelled {rows[-1]['modelled_x']:.2f}x  ceiling {rows[-1]['ceiling_x']:.2f}x", flush=True)
    print("costs (median s): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in costs.items()))
    if args.json:
        result = {"command": "python -m bench.knnlm_replay " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "machine": machine(), "loadavg_end": list(os.getloadavg()), "model_dtype": model_dtype,
                  "setup": {"prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
                            "new_tokens": args.new_tokens, "k": args.k, "lambda": args.lam,
                            "temperature": args.temperature, "datastore_entries": ds.size},
                  "costs": costs, "replays": rows, "wall_s": time.time() - t_start}
        _atomic_json(Path(args.json), result)


if __name__ == "__main__":
    main()
