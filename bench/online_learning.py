"""Online learning benchmark: the same prompts twice in a row, `rest` drafting with learning on vs off.

    python -m bench.online_learning --workload mtbench --limit 20 --max-new-tokens 128 \\
        --datastore ~/.cache/ragserve/datastores/docs --json bench/results/online-learning.json

Learning on = what the generation worker does with `learn_from_outputs`: every finished output (with the last
16 prompt tokens, as generation_service/server.py sends it) goes to an OnlineLearner over the base datastore, and
drafting searches base + learned shards. Learning off = the same base datastore alone. Both arms run in one
process on one model, alternating per prompt (the order rotates), so machine noise hits both alike. Reported per
pass and arm: mean accepted length M, tokens/s, ms/token, and whether the outputs equal the other arm's (they
must: drafting never changes greedy output).

Pass 2 repeats pass 1's prompts, which is the case learning is for (a workload that repeats itself: retries,
agents re-asking, evaluation reruns). In pass 1 the learning arm already profits from earlier outputs of the same
pass. Greedy decoding, so the second pass's outputs equal the first's — the upper end of what learning can give;
`--pass2-temperature` samples pass 2 instead (same seed in both arms) for a less flattering repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from bench.speculative import load_prompts, our_runner, summarize
from generation_service.drafting.drafters import DatastoreDrafter
from generation_service.engine.speculative import DEFAULT_DRAFT_BUDGET, generate
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import load_model, set_threads, warmup
from retrieval_service.datastore.online import OnlineLearner
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

LEARN_PROMPT_TAIL = 16  # as generation_service/server.py: the prompt's tail lets the output's first tokens match


def sampled_runner(tm, max_new: int, drafter, budget: int, temperature: float, seed: int):
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=seed)

    def run(prompt: list[int]):
        t = time.perf_counter()
        res = generate(tm, prompt, params, drafter=drafter, draft_budget=budget, tokenizer=None)
        return res.token_ids, time.perf_counter() - t, res.stats

    return run


def run_pass(prompts, runners: dict, learner: OnlineLearner, log) -> dict[str, list[dict]]:
    """Both arms on every prompt (order rotating); the learning arm learns each output right after it."""
    from dataclasses import asdict

    names = list(runners)
    records: dict[str, list[dict]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            tokens, seconds, stats = runners[name](prompt)
            records[name].append({"prompt": i, "tokens": len(tokens), "seconds": seconds, "stats": asdict(stats),
                                  "output": tokens})
            if name == "learning-on" and tokens:
                learner.add(np.asarray(list(prompt[-LEARN_PROMPT_TAIL:]) + list(tokens), np.int32))
                learner.flush()  # the server's background rebuild lands within ~0.2 s, before a next request
        log(f"  prompt {i + 1}/{len(prompts)}: " + "  ".join(
            f"{n} M {records[n][-1]['stats']['mean_accepted_length']:.2f}" for n in names))
    on, off = records["learning-on"], records["learning-off"]
    for a, b in zip(on, off):
        a["identical"] = b["identical"] = a["output"] == b["output"]
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="mtbench", choices=("humaneval", "mtbench"),
                    help="prompts: HumanEval code completions or MT-Bench first turns (default %(default)s)")
    ap.add_argument("--limit", type=int, default=20, help="first N prompts of the workload (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default %(default)s)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="model dtype (default %(default)s)")
    ap.add_argument("--model", default="", help="local model directory ('' = default SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the default, all cores)")
    ap.add_argument("--datastore", required=True, help="base suffix-array datastore")
    ap.add_argument("--draft-budget", type=int, default=DEFAULT_DRAFT_BUDGET,
                    help="max draft-tree nodes per step (default %(default)s)")
    ap.add_argument("--pass2-temperature", type=float, default=0.0, help="0 = greedy pass 2 (default)")
    ap.add_argument("--seed", type=int, default=1,
                    help="sampling seed of pass 2, the same in both arms (only with --pass2-temperature > 0)")
    ap.add_argument("--json", default="", help="write the results here (atomic; '' = print only)")
    args = ap.parse_args(argv)

    set_threads(args.threads)
    tm = load_model(args.model, dtype=args.dtype, device="cpu")
    warmup(tm)
    prompts = load_prompts(args.workload, tm.tokenizer, args.limit)
    ds_off = SuffixArrayDatastore.open(args.datastore)
    ds_on = SuffixArrayDatastore.open(args.datastore)  # a second handle on the same mmapped files
    ds_off.warmup()
    ds_on.warmup()
    learner = OnlineLearner(ds_on, directory=None, background=False)
    drafters = {"learning-on": DatastoreDrafter(ds_on, "merged"), "learning-off": DatastoreDrafter(ds_off, "merged")}

    load_before = os.getloadavg()
    passes = {}
    for p in (1, 2):
        print(f"pass {p}", file=sys.stderr)
        if p == 2 and args.pass2_temperature > 0:
            runners = {n: sampled_runner(tm, args.max_new_tokens, d, args.draft_budget, args.pass2_temperature,
                                         args.seed) for n, d in drafters.items()}
        else:
            runners = {n: our_runner(tm, args.max_new_tokens, False, d, args.draft_budget) for n, d in drafters.items()}
        records = run_pass(prompts, runners, learner, lambda s: print(s, file=sys.stderr))
        summary = summarize(records, args.dtype)
        for name, recs in records.items():
            summary[name]["identical_across_arms"] = sum(r["identical"] for r in recs)
        on, off = summary["learning-on"], summary["learning-off"]
        summary["on_vs_off"] = {"tokens_per_s": on["tokens_per_s"] / off["tokens_per_s"],
                                "mean_accepted_length": on["mean_accepted_length"] / off["mean_accepted_length"]}
        passes[str(p)] = summary
    learner.close()

    print(f"\n{args.workload}, {len(prompts)} prompts x {args.max_new_tokens} tokens, {args.dtype}, rest drafting")
    print(f"{'pass':>4} {'arm':>13} {'M':>6} {'tok/s':>7} {'ms/tok':>7} {'same output':>11}")
    for p, s in passes.items():
        for arm in ("learning-off", "learning-on"):
            v = s[arm]
            print(f"{p:>4} {arm:>13} {v['mean_accepted_length']:6.2f} {v['tokens_per_s']:7.2f} "
                  f"{v['ms_per_token']:7.1f} {v['identical_across_arms']:>5}/{v['n']}")
        print(f"{p:>4} {'on / off':>13} {s['on_vs_off']['mean_accepted_length']:6.2f} "
              f"{s['on_vs_off']['tokens_per_s']:7.2f}")
    if args.json:
        out = {"command": "python -m bench.online_learning " + " ".join(argv if argv is not None else sys.argv[1:]),
               "workload": args.workload, "dtype": args.dtype, "limit": len(prompts),
               "max_new_tokens": args.max_new_tokens, "datastore": args.datastore,
               "datastore_tokens": int(ds_off.num_tokens), "learned_tokens": learner.learned_tokens,
               "pass2_temperature": args.pass2_temperature,
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
               "passes": {p: {k: {kk: vv for kk, vv in v.items() if kk != "divergence_gaps"} for k, v in s.items()}
                          for p, s in passes.items()}}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)


if __name__ == "__main__":
    main()
