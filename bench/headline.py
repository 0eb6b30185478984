"""The README's tables of record: one small table per headline claim, generated from the committed records.

    python -m bench.headline                      # the tables, markdown, to stdout
    python -m bench.headline --readme README.md   # rewrite the README between <!-- bench:headline --> markers

Each table names its records, the command recorded in them, the CPU and the date. A missing record is reported as
missing, never invented. docs/benchmarks.md (`python -m bench.report`) has every table of every record.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

from bench.report import _f, _table

RESULTS = Path(__file__).parent / "results"
MARK_BEGIN, MARK_END = "<!-- bench:headline -->", "<!-- /bench:headline -->"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _cpu(m: dict) -> str:
    flags = set(m.get("cpu_flags") or m.get("flags") or [])
    isa = ("AMX" if any(f.startswith("amx") for f in flags) else "AVX512-VNNI" if "avx512_vnni" in flags
           else "AVX512-BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "")
    cores = m.get("cores") or m.get("cpus")
    return f"{m.get('cpu', m.get('cpu_model', '?'))}{', ' + isa if isa else ''}{f', {cores} cores' if cores else ''}"


def _date(d: dict) -> str:
    for key in ("started", "created", "date"):
        if isinstance(d.get(key), str):
            return d[key][:10]
    return (d.get("machine") or {}).get("date") or "date not recorded"


def _source(names: list[str], d: dict) -> str:
    cmd = d.get("command") or "?"
    return (f"_{_cpu(d.get('machine') or {})}; {_date(d)}. Records: "
            + ", ".join(f"`bench/results/{n}`" for n in names) + f". Command: `{cmd}`_")


def speculation(names: list[str]) -> str:
    d = _load(names[0])
    if d is None:
        return f"_missing record `{names[0]}`_"
    rows = []
    floors = [w.get("ar_against_itself") for w in d["workloads"].values()]
    noise = all(floors)  # records with --repeats >= 2
    for wname, w in d["workloads"].items():
        s = w["summary"]
        for meth in ("rest", "pld", "crest"):
            if meth in s:
                x = s[meth]
                rows.append([wname, meth, _f(x["speedup_vs_ar"]) + "×", _f(x["min_speedup_vs_ar"]) + "×",
                             _f(x["mean_accepted_length"]), f"{x['identical_to_ar']}/{x['n']}"]
                            + ([_f(w["ar_against_itself"]["worst"]) + "×"] if noise else []))
    dtype = next(iter(d["workloads"].values())).get("worker", {}).get("dtype", "?")
    head = (f"**One request at a time, through the services** (default flags; the worker chose {dtype}): "
            f"speed-up over `ar`, median and worst of {d.get('limit', '?')} prompts × {d.get('max_new_tokens', '?')} "
            "new tokens" + (f", each the median of {floors[0]['repeats']} runs; the noise floor is `ar`'s odd runs "
                            "against its even ones, its worst prompt" if noise else ""))
    cols = ["workload", "method", "median", "worst prompt", "M", "same tokens as ar"] + (["noise floor"] if noise else [])
    return head + "\n\n" + _table(cols, rows) + "\n\n" + _source(names, d)


def step(names: list[str]) -> str:
    d = _load(names[0])
    if d is None:
        return f"_missing record `{names[0]}`_"
    rows = []
    for key, r in d["results"].items():
        forward, fmt = key.split("/", 1)
        if forward != "lean" or fmt == "bf16":
            continue
        b1 = r.get("batch1", {})
        one = (b1.get("1") or {}).get("min_ms")
        cells = [_f(one, ".1f")]
        for q in ("8", "16"):
            v = (b1.get(q) or {}).get("min_ms")
            cells.append("–" if v is None or not one else f"{v:.1f} ({v / one:.2f}×)")
        rows.append([fmt] + cells)
    anchor = (d.get("llama_cpp") or {}).get("q4_1") or {}
    if anchor.get("status") == "measured":
        rows.append([f"llama.cpp {anchor.get('version', '')} Q4_1 (same GGUF), decode step",
                     _f(anchor["decode_ms_per_token"]["min"], ".1f"), "", ""])
    head = (f"**One forward pass after {d.get('prefix_tokens', '?')} cached tokens, in process, "
            f"{d.get('threads', '?')} threads** (ms, min of {d.get('reps', '?')} interleaved rounds): the 1-row step "
            "and what a draft tree of 8 or 16 rows costs against it")
    return head + "\n\n" + _table(["weight format", "1 row", "8 rows", "16 rows"], rows) + "\n\n" + _source(names, d)


def concurrency(names: list[str]) -> str:
    rows, last = [], None
    for name in names:
        d = _load(name)
        if d is None:
            rows.append([f"missing `{name}`", "", "", "", ""])
            continue
        per = d["targets"]["rest_vs_ar"].get("per_level", {})
        levels = sorted(per, key=int)
        ratios = " / ".join(f"{per[k]['ratio']:.2f}" for k in levels)
        scale = d["targets"].get("rest_scaling", {}).get("ratio")
        rows.append([_cpu(d["machine"]), " / ".join(levels), ratios, _f(scale) + "×" if scale else "–", _date(d)])
        last = (name, d)
    head = ("**Many clients at once** (continuous batching; both services with default flags; closed-loop streaming "
            "clients, HumanEval + MT-Bench prompts, 128 new tokens)")
    cmd = f"Command: `{last[1]['command']}`" if last else ""
    return head + "\n\n" + _table(["CPU", "clients", "`rest` / `ar` tok/s", "`rest` 8 vs 1 client", "date"], rows) + \
        "\n\n_Records: " + ", ".join(f"`bench/results/{n}`" for n in names) + f". {cmd}_"


def ralm(names: list[str]) -> str:
    d = _load(names[0])
    if d is None:
        return f"_missing record `{names[0]}`_"
    rows = []
    for retriever, configs in d["concurrent"].items():
        base = configs.get("B", {}).get("tokens_per_s")
        for cfg, c in configs.items():
            rows.append([retriever, cfg, _f(c["tokens_per_s"], ".1f"), _f(c.get("throughput_x")) + "×",
                         f"{c.get('identical', '?')}/{c.get('requests', '?')}"])
        del base
    kb = d.get("kb") or {}
    where = (f", {kb['passages'] // 1000} K passages "
             + ("in PostgreSQL" if kb.get("backend") == "postgresql" else "in process")) if kb.get("passages") else ""
    head = (f"**RaLMSpec from 4 concurrent clients{where}** (configs against RaLMSeq = B: P prefetch, S OS³ stride, "
            "A async verification; tokens/s pooled over rounds, the configs' order alternating)")
    return head + "\n\n" + _table(["retriever", "config", "tok/s", "× B", "same output as B"], rows) + \
        "\n\n" + _source(names, d)


def gateway(names: list[str]) -> str:
    d = _load(names[0])
    if d is None:
        return f"_missing record `{names[0]}`_"
    labels = {"request_overhead_ms": "added per request (ms, p50)", "stream_overhead_ms_per_token":
              "added per streamed token (ms)", "ttft_ratio": "time to first token, gateway / direct"}
    sdk = d.get("httpx2", {})
    rows = [[labels.get(k, k), _f(t["measured"], ".2f"), _f(sdk.get("targets", {}).get(k, {}).get("measured"), ".2f"),
             f"≤ {t['target']}", "met" if t["met"] else "not met"] for k, t in d["targets"].items()]
    if "ttft_cached_overhead_ms" in d:
        rows.append(["first token of a prefix-cached prompt: added (ms, p50)", _f(d["ttft_cached_overhead_ms"], ".2f"),
                     _f(sdk.get("ttft_cached_overhead_ms"), ".2f"), "reported", ""])
    load = d.get("loadavg_start") or [None]
    head = (f"**The OpenAI HTTP gateway against calling the worker's gRPC directly** ({d.get('requests', '?')} "
            f"requests, {d.get('streams', '?')} streams of {d.get('stream_tokens', '?')} tokens and "
            f"{d.get('ttft_pairs', d.get('streams', '?'))} first tokens of new prompts per client, interleaved; "
            f"load average {_f(load[0], '.1f')}; targets judged with the standard library's client, httpx2 is the "
            f"OpenAI SDK's transport)")
    table = _table(["figure", "http.client", "httpx2", "target", ""], rows)
    return head + "\n\n" + table + "\n\n" + _source(names, d)


HEADLINES: list[tuple[Callable[[list[str]], str], list[str]]] = [
    (speculation, ["serving-q4_1_i8-zen4.json"]),
    (step, ["step-q4_1_i8-avx512bf16.json"]),
    (concurrency, ["concurrency-amx.json", "concurrency-avx512bf16-zen5-rounds.json",
                   "concurrency-avx512bf16-zen4-rounds.json"]),
    (ralm, ["ralm-postgresql-clients-300000-avx512bf16.json"]),
    (gateway, ["gateway-avx512bf16.json"]),
]


def render(headlines: list[tuple[Callable[[list[str]], str], list[str]]] = HEADLINES) -> str:
    return "\n\n".join(fn(names) for fn, names in headlines)


def rewrite_readme(path: Path, body: str) -> None:
    text = path.read_text()
    start, end = text.index(MARK_BEGIN) + len(MARK_BEGIN), text.index(MARK_END)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text[:start] + "\n" + body + "\n" + text[end:])
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default="", help="README to rewrite between its headline markers ('' = stdout)")
    args = ap.parse_args(argv)
    body = render()
    if args.readme:
        rewrite_readme(Path(args.readme), body)
    else:
        print(body)


if __name__ == "__main__":
    main()
