"""Quality guard of the int8-activation format: perplexity of q4_1_i8 against q4_1 (the same GGUF blocks with fp32
activations) on a sample of the docs corpus, and how often their greedy picks agree.

    python -m bench.int8_quality                       # 8192 tokens in windows of 256; ~2 min on 2 cores
    python -m bench.int8_quality --tokens 512 --window 128

The sample: the documentation corpus as the knowledge base reads it (python3.11-doc reST pages when installed, then
the standard library's module docstrings; retrieval_service/knowledge/passages.py), every --stride-th document, its
text tokenized and cut into windows of --window tokens until --tokens are taken. Each window is one prompt pass from
an empty cache; every position but the first is scored (negative log-likelihood of the next token, fp32 softmax).
The target: q4_1_i8's perplexity within 1 % of q4_1's (reported as a ratio; the JSON says whether it passed).
Results: bench/results/int8_quality-<cpuclass>.json with the machine, load average and commit.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from bench.serving import cpu_class, machine, write_json
from generation_service.model.target import load_model

FORMATS = ("q4_1", "q4_1_i8")
TARGET_RATIO = 1.01  # q4_1_i8's perplexity at most this times q4_1's


def sample_windows(tokenizer, tokens: int, window: int, stride: int) -> list[np.ndarray]:
    """Windows of `window` token ids from every stride-th document of the docs corpus, `tokens` in all."""
    from retrieval_service.knowledge.passages import iter_documents

    out, taken = [], 0
    for doc in itertools.islice(iter_documents(site=False), 0, None, stride):
        ids = np.asarray(tokenizer("\n\n".join((doc.title,) + doc.sections))["input_ids"], np.int64)
        for a in range(0, len(ids) - window + 1, window):
            out.append(ids[a:a + window])
            taken += window
            if taken >= tokens:
                return out
    if not out:
        raise RuntimeError("the docs corpus gave no window of that many tokens")
    return out


@torch.inference_mode()
def score(tm, windows: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """-> (mean negative log-likelihood per scored token, per window its greedy picks)."""
    nll, n, picks = 0.0, 0, []
    for ids in windows:
        t = torch.from_numpy(ids)
        logits = tm.lean.forward(t, torch.arange(len(ids)), tm.lean.new_cache(len(ids) + 8)).float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        nll -= float(logp.gather(1, t[1:, None]).sum())
        n += len(ids) - 1
        picks.append(logits.argmax(-1).numpy())
    return nll / n, picks


def run(args) -> dict:
    load_before = os.getloadavg()[0]
    results, picks = {}, {}
    windows = None
    for fmt in FORMATS:
        tm = load_model("", dtype=fmt, device="cpu", forward="lean")
        if windows is None:
            windows = sample_windows(tm.tokenizer, args.tokens, args.window, args.stride)
        t0 = time.perf_counter()
        nll, picks[fmt] = score(tm, windows)
        results[fmt] = {"nll": nll, "perplexity": math.exp(nll), "seconds": time.perf_counter() - t0}
        del tm
    ratio = results["q4_1_i8"]["perplexity"] / results["q4_1"]["perplexity"]
    agree = float(np.mean(np.concatenate([a == b for a, b in zip(picks["q4_1"], picks["q4_1_i8"])])))
    return {"bench": "int8_quality", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
            "cpu_class": cpu_class(), "torch": torch.__version__, "tokens": sum(len(w) for w in windows),
            "windows": len(windows), "window": args.window, "stride": args.stride, "results": results,
            "perplexity_ratio": ratio, "target_ratio": TARGET_RATIO, "within_target": ratio <= TARGET_RATIO,
            "greedy_agreement": agree, "load_before": load_before, "load_after": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens scored in all (default %(default)s)")
    ap.add_argument("--window", type=int, default=256, help="tokens per window (default %(default)s)")
    ap.add_argument("--stride", type=int, default=7, help="take every n-th document of the corpus (default "
                    "%(default)s)")
    ap.add_argument("--json", default="", help="output file (default bench/results/int8_quality-<cpuclass>.json)")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.window < 2 or args.stride < 1:
        ap.error("--tokens and --window need at least 2, --stride at least 1")
    res = run(args)
    out = Path(args.json or Path(__file__).parent / "results" / f"int8_quality-{res['cpu_class']}.json")
    write_json(out, res)
    for fmt, r in res["results"].items():
        print(f"{fmt:<8} perplexity {r['perplexity']:.4f} ({r['seconds']:.1f} s)")
    print(f"q4_1_i8 / q4_1: {res['perplexity_ratio']:.4f} (target <= {TARGET_RATIO}: "
          f"{'met' if res['within_target'] else 'NOT met'}); greedy picks agree at {res['greedy_agreement']:.1%} "
          f"of {res['tokens']} positions; load {res['load_before']:.2f} -> {res['load_after']:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
