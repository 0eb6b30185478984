"""docs/benchmarks.md, generated from the records in bench/results/ (so every published figure has a source).

    python -m bench.report                 # write docs/benchmarks.md (every table, then the other records)
    python -m bench.report --stdout --only kb,ralm   # some tables, markdown, to stdout

Each table names the JSON it reads and the command recorded in it; a missing JSON is reported, not invented.
bench/results/ holds the records of record (one per benchmark and CPU class, the machine and commit inside);
one-off A/B runs live in bench/results/archive/, which this page does not read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def _f(v, fmt: str = ".2f") -> str:
    return "–" if v is None else format(v, fmt)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _source(name: str, d: dict) -> str:
    machine = d.get("machine", {})
    load = machine.get("loadavg_before") or machine.get("loadavg_start") or machine.get("loadavg")
    load_s = f"; load average at start {load[0]:.1f}" if load else ""
    cmd = d.get("command", "")
    return f"_Source: `bench/results/{name}`{load_s}. Command: `{cmd}`_" if cmd else f"_Source: `bench/results/{name}`_"


def speculative(name: str, d: dict) -> str:
    order = ["hf-ar", "ar", "hf-pld", "pld", "rest-ds", "rest"]
    methods = d["methods"]
    rows = []
    for m in order + sorted(set(methods) - set(order)):
        if m not in methods or m.startswith("hf-pld:"):
            continue
        s = methods[m]
        label = m + (f" (n={s['setting']})" if "setting" in s else "")
        ident = "–" if s.get("identical") is None else f"{s['identical']}/{s['n']}"
        rows.append([label, _f(s["tokens_per_s"]), _f(s["ms_per_token"], ".1f"), _f(s.get("speedup_vs_hf-ar")),
                     _f(s.get("speedup_vs_ar")), _f(s.get("mean_accepted_length")),
                     _f(s.get("draft_nodes_per_step"), ".1f"), _f(s.get("draft_ms_per_step"), ".3f"), ident])
    title = f"**{d['workload']}**, {d.get('dtype', '')}, {d.get('limit', methods['ar']['n'] if 'ar' in methods else '')} " \
            f"prompts × {d.get('max_new_tokens', '')} new tokens"
    return title + "\n\n" + _table(["method", "tok/s", "ms/token", "× hf-ar", "× ar", "M", "nodes/step", "draft ms/step",
                                    "identical to ar"], rows) + "\n\n" + _source(name, d)


def draft_retrieval(name: str, d: dict) -> str:
    rows = []
    for size, s in sorted(d["sizes"].items(), key=lambda kv: int(kv[0])):
        rows.append([f"{int(size) / 1e6:g} M", _f(s["p50_ms"], ".3f"), _f(s["mean_ms"], ".3f"), _f(s.get("p90_ms"), ".3f"),
                     _f(s["p99_ms"], ".3f"), _f(s.get("search_mean_ms"), ".3f"), _f(s.get("tree_mean_ms"), ".3f"),
                     _f(s["numpy_p50_ms"], ".2f"), _f(s["numpy_p50_ms"] / s["p50_ms"], ".0f") + "×"])
    extra = (f"Merged `rest` drafter (datastore + request context) mean {d['merged_mean_ms']:.3f} ms; over gRPC "
             f"(`Draft`) p50 {d['grpc_p50_ms']:.3f} ms, p99 {d.get('grpc_p99_ms', float('nan')):.3f} ms.")
    return _table(["datastore", "p50 ms", "mean ms", "p90 ms", "p99 ms", "search mean ms", "tree mean ms",
                   "NumPy p50 ms", "speed-up"], rows) + "\n\n" + extra + "\n\n" + _source(name, d)


def online_learning(name: str, d: dict) -> str:
    rows = []
    for p, s in d["passes"].items():
        for arm in ("learning-off", "learning-on"):
            v = s[arm]
            rows.append([p, arm, _f(v["mean_accepted_length"]), _f(v["tokens_per_s"]),
                         f"{v['identical_across_arms']}/{v['n']}"])
        rows.append([p, "on / off", _f(s["on_vs_off"]["mean_accepted_length"]) + "×",
                     _f(s["on_vs_off"]["tokens_per_s"]) + "×", ""])
    title = f"**{d['workload']}**, {d['limit']} prompts × {d['max_new_tokens']} tokens, base datastore " \
            f"{d['datastore_tokens'] / 1e6:.1f} M tokens"
    return title + "\n\n" + _table(["pass", "arm", "M", "tok/s", "same output"], rows) + "\n\n" + _source(name, d)


def crest(name: str, d: dict) -> str:
    def variant(p: dict) -> str:
        if p["store"] == "rest":
            return f"{100 * p['fraction']:g} % sample" if "fraction" in p else ""
        if p.get("strategy") == "single":
            return f"single n={p.get('n')}, t={p.get('t')}"
        return f"combined n≤{p.get('max_n')}, t={p.get('t')}" if p.get("t") else p.get("strategy", "")

    rows = [[p["store"], variant(p), f"{p['bytes'] / 1e6:.2f}", _f(p["mean_accepted_length"], ".3f")]
            for p in sorted(d["points"], key=lambda p: (p["store"], p["bytes"]))
            if p["store"] == "rest" or p.get("strategy") != "single"]
    lk = d.get("lookup_p50_ms", {})
    extra = [f"Lookup p50: embedded {_f(lk.get('embedded'), '.3f')} ms, Redis {_f(lk.get('redis'), '.3f')} ms "
             "(single-n stores are in the JSON and the plot)."]
    t = d.get("targets", {})
    if "smallest_crest_reaching_full_rest_M" in t:
        full, small = t["full_rest"], t["smallest_crest_reaching_full_rest_M"]
        extra.append(f"Full REST store {full['bytes'] / 1e6:.0f} MB, M {full['M']:.3f}; the smallest CREST store "
                     f"reaching it: {small['bytes'] / 1e6:.2f} MB, M {small['M']:.3f} "
                     f"({small['storage_reduction']:.0f}× less storage).")
    if "mean_gain_at_equal_storage" in t:
        gains = [g["gain"] for g in t.get("equal_storage", [])]
        extra.append(f"M gain of CREST over REST at equal storage: {100 * min(gains):.1f}–{100 * max(gains):.1f} % "
                     f"(mean {100 * t['mean_gain_at_equal_storage']:.1f} %).")
    if d.get("m_method"):
        extra.append(f"M measured by: {d['m_method']}")
    return f"**{d['workload']}**\n\n" + _table(["store", "variant", "MB on disk", "M"], rows) + "\n\n" + "\n".join(
        f"- {e}" for e in extra) + "\n\n" + _source(name, d)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds / 3600:.1f} h" if seconds >= 7200 else (f"{seconds / 60:.0f} min" if seconds >= 600
                                                               else f"{seconds:.0f} s")


def _kb_build(build: dict, peak_rss_mb: dict) -> str:
    """kb.json's build record -> 'passages 96 s, 506 MB on disk; edr ...; peak RSS ...'."""
    parts = []
    for stage in ("passages", "edr", "adr", "sr"):
        b = build.get(stage)
        if not b:
            continue
        size = f"{b.get('bytes', 0) / 1e6:,.0f} MB on disk"
        if stage != "edr":
            parts.append(f"{stage} {_duration(b.get('seconds'))}, {size}")
        elif b.get("copied_rows") and not b.get("encoded_rows"):  # a prefix KB
            parts.append(f"edr {b['copied_rows']:,} rows copied from the parent KB, {size}")
        elif "encoded_rows" in b:  # summed over the runs of a resumed build
            rate = b["encoded_rows"] / b["encode_seconds"] if b.get("encode_seconds") else None
            parts.append(f"edr encoding {_duration(b['encode_seconds'])} for {b['encoded_rows']:,} rows"
                         + (f" ({rate:.0f} passages/s)" if rate else "")
                         + (f", {b['copied_rows']:,} rows copied from the parent KB" if b.get("copied_rows") else "")
                         + f", {size}")
        else:
            parts.append(f"edr encoding {_duration(b.get('encode_seconds'))}, {size}")
    names = {"python_mb": "builder", "children_mb": "Anserini indexer"}
    peak = ", ".join(f"{names.get(who, who)} {mb / 1024:.1f} GiB" for who, mb in sorted(peak_rss_mb.items()))
    return "; ".join(parts) + (f"; peak RSS {peak}" if peak else "") + "."


def kb(name: str, d: dict) -> str:
    batches = sorted({int(b) for r in d["retrievers"].values() for b in r}, key=int)
    rows = []
    for ret, per in d["retrievers"].items():
        for where, key in (("in-process", "ms_per_query"), ("gRPC", "grpc_ms_per_query")):
            rows.append([ret, where] + [_f(per.get(str(b), {}).get(key)) for b in batches])
    extra = []
    if "speedup_batch8" in d:
        extra.append("Per-query speed-up at batch 8 vs batch 1: " + ", ".join(
            f"{k} {v['in_process']:.2f}× in-process / {v['grpc']:.2f}× over gRPC" for k, v in d["speedup_batch8"].items()))
    if "hnsw_recall_at_1" in d:
        extra.append(f"HNSW (efSearch {d.get('hnsw_ef_search')}) recall@1 {d['hnsw_recall_at_1']:.3f}, "
                     f"recall@10 {d.get('hnsw_recall_at_10', float('nan')):.3f} vs exact search.")
    if "score_candidates_ms" in d:
        extra.append(f"ScoreCandidates on 20 docs over gRPC: {d['score_candidates_ms']:.2f} ms (median).")
    if d.get("build"):
        extra.append("Build: " + _kb_build(d["build"], d.get("build_peak_rss_mb") or {}))
    if "open_s" in d:
        extra.append(f"Opening the KB (all retrievers, warm-up included): {d['open_s']:.1f} s.")
    if "encode" in d:
        extra.append("Query encoding (MiniLM), measured separately: " + ", ".join(
            f"batch {b} {v['ms_per_query']:.1f} ms/query" for b, v in d["encode"].items()) + ".")
    return (f"{d['passages']:,} passages, ms per query by batch size\n\n"
            + _table(["retriever", "path"] + [str(b) for b in batches], rows) + "\n\n" + "\n".join(
                f"- {e}" for e in extra) + "\n\n" + _source(name, d))


def ralm(name: str, d: dict) -> str:
    rows = []
    for ret, per in d["retrievers"].items():
        base = per.get("B", {}).get("latency_s")
        order = ["B", "P", "S", "A", "PS", "SA", "PA", "PSA"]
        for cfg, v in sorted(per.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
            rows.append([ret, cfg, _f(v["latency_s"]), _f(v["retrieval_s"]), _f(v["generation_s"]),
                         _f(base / v["latency_s"]) + "×" if base else "–", f"{v['identical']}/{v['n']}"])
    return _table(["retriever", "config", "latency s", "R s", "G s", "speed-up vs B", "identical"], rows) + \
        "\n\n" + _source(name, d)


def ralm_curve(name: str, d: dict) -> str:
    order = ["P", "S", "A", "PS", "SA", "PA", "PSA"]
    cells: dict = {}
    for p in d["points"]:
        key = (p.get("backend", "in-process"), p["passages"] or 0, p["retriever"])
        row = cells.setdefault(key, {"share": p["b_r_share"], "ident": [0, 0]})
        if p["config"] != "B":
            row[p["config"]] = p["speedup"]
            row["ident"][0] += p["identical"]
            row["ident"][1] += p["n"]
    rows = [[backend, f"{n:,}", ret, _f(c["share"])] + [_f(c.get(x)) + "×" if c.get(x) else "–" for x in order]
            + [f"{c['ident'][0]}/{c['ident'][1]}"] for (backend, n, ret), c in sorted(cells.items())]
    t = d["targets"]
    psa, never = t["psa_edr_at_share_0.5"], t["never_slower"]
    verdict = lambda met: "**met**" if met else ("not measured" if met is None else "**not met**")
    worst = never.get("worst") or {}
    lines = [f"- PSA ≥ {psa['target']}× with edr where B's retrieval share ≥ 0.5: {verdict(psa['met'])}",
             f"- every config ≥ {never['target']}× B at every KB size and backend: {verdict(never['met'])}"
             + (f" (worst {worst['config']} {worst['retriever']} at {worst['passages'] or 0:,} passages"
                f"{', ' + worst['backend'] if worst.get('backend') else ''}: "
                f"{worst['speedup']:.2f}×)" if worst else ""),
             f"- identical outputs: {t['identical']['identical']}/{t['identical']['outputs']}"]
    if "below_by_more_than_noise" in never:
        below = never["below_by_more_than_noise"]
        lines.insert(2, "- below the floor beyond run noise (95 % bootstrap interval over questions under "
                     f"{never['target']}×): " + (", ".join(
                         f"{p['config']} {p['retriever']} at {p['passages'] or 0:,} ({p['speedup']:.2f}×, "
                         f"{p['speedup_ci95'][0]:.2f}–{p['speedup_ci95'][1]:.2f})" for p in below) or "none"))
    cmds = "; ".join(f"`{s.get('command', '')}`" for s in d.get("runs", []) if s.get("command"))
    return _table(["KB", "passages", "retriever", "B: R share", *order, "identical"], rows) + "\n\n" + \
        "\n".join(lines) + "\n\n" + f"_Source: `bench/results/{name}` (merged from {', '.join(d['sources'])})._" + \
        (f" Runs: {cmds}" if cmds else "")


_KNN_ORDER = ("base", "s1", "s2", "s4", "s8", "s16", "os3")


def _knn_label(c: str) -> str:
    spec, _, sync = c.partition("-")
    label = "OS³" if spec == "os3" else ("base s" if spec == "base" else f"s={spec[1:]}")
    return label + (" sync" if sync else "")


def knnlm(name: str, d: dict) -> str:
    present = {c for per_k in d["retrievers"].values() for per in per_k.values() for c in per}
    order = [c for spec in _KNN_ORDER for c in (spec, f"{spec}-sync") if c in present]
    rows = []
    for ret, per_k in d["retrievers"].items():
        for k, per in sorted(per_k.items(), key=lambda kv: int(kv[0])):
            b = per.get("base", {})
            base = b.get("latency_s")
            rows.append([ret, k, f"{_f(b.get('retrieval_s'))} / {_f(b.get('generation_s'))}"] + [
                (f"{per[c]['latency_s']:.2f} ({base / per[c]['latency_s']:.2f}×)" if c in per and base else "–")
                for c in order])
    ppl = d.get("perplexity", {})
    n = d.get("datastore", {}).get("n")
    served = d.get("knnlm_over")
    m = d.get("machine") or {}
    extra = (f"**{m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m.get('cores', '?')} cores.** "
             if m.get("cpu") else "") + \
        (f"Through the services ({served}); worker {d['setup']['served']['dtype']}, "
             f"{d['setup']['served']['threads']} threads. " if served else "") + \
        (f"Datastore {n:,} entries. " if n else "") + \
        f"Held-out perplexity: LM {_f(ppl.get('lm'))}, kNN-LM {_f(ppl.get('knnlm'))}. " + \
        "Latency per request in s (speed-up over base); R / G = the baseline's retrieval / generation seconds."
    out = _table(["retriever", "k", "base R / G s"] + [_knn_label(c) for c in order], rows) + "\n\n" + extra
    conc = d.get("concurrent", {})
    if conc:
        clients = next(iter(next(iter(conc.values())).values()))["clients"]
        crows = [[ret] + [(f"{per[c]['tokens_per_s']:.1f} ({per[c]['throughput_x']:.2f}×)" if c in per else "–")
                          for c in order] for ret, per in conc.items()]
        out += "\n\n" + _table(["retriever"] + [_knn_label(c) for c in order], crows) + "\n\n" + \
            f"{clients} concurrent clients, 2 x {clients} requests per config at the largest k: aggregate tokens/s " \
            "(over base at the same concurrency)."
    return out + "\n\n" + _source(name, d)


def load(name: str, d: dict) -> str:
    rows = [[e["name"], str(e["requests"]), str(e["failures"]), _f(e["rps"]), _f(e["p50_ms"], ".0f"),
             _f(e["p95_ms"], ".0f"), _f(e["p99_ms"], ".0f")] for e in d["entries"]]
    title = (f"{d['users']} users ({d['generation_users']} generating), {d['duration_s']} s, decoding "
             f"{d['decoding']}, {d['max_new_tokens']} new tokens, {d['replicas']} retrieval replica(s)")
    return title + "\n\n" + _table(["RPC", "requests", "failures", "RPS", "p50 ms", "p95 ms", "p99 ms"], rows) + \
        "\n\n" + _source(name, d)


def serving(name: str, d: dict) -> str:
    m = d["machine"]
    isa = m.get("kernel_isa", {})
    override = ", ".join(f"{k}={v}" for k, v in isa.items() if k != "aten")
    cpu = f"{m['cpu']} ({' '.join(m.get('cpu_flags', []))}; kernels {isa.get('aten', '?')}" + \
        (f", {override}" if override else "") + f"), {m.get('cores', '?')} cores"
    out = [f"**{cpu}** — {d['limit']} prompts × {d['max_new_tokens']} new tokens per workload"]
    for wname, w in d["workloads"].items():
        wi = w["worker"]
        rows = []
        for meth, s in w["summary"].items():
            rows.append([meth, _f(s["ms_per_token"], ".1f"), _f(s["decode_ms_per_token"], ".1f"),
                         _f(s["speedup_vs_ar"]), _f(s["min_speedup_vs_ar"]), _f(s["mean_accepted_length"]),
                         _f(s["nodes_per_step"], ".1f"), _f(s["verify_cost_vs_ar_step"]),
                         _f(s["draft_ms_per_step"], ".2f"), _f(s["ttft_ms"], ".0f"), f"{s['identical_to_ar']}/{s['n']}"])
        out.append(f"\n*{wname}* (datastore `{Path(w['datastore']).name}`; worker chose {wi['dtype']}, "
                   f"{wi['threads']} threads)\n")
        out.append(_table(["method", "ms/token", "decode ms/token", "× ar (median)", "× ar (worst)", "M",
                           "nodes/step", "pass / AR step", "draft ms/step", "TTFT ms", "same as ar"], rows))
        a = w.get("ar_vs_inprocess") or {}
        notes = []
        noise = w.get("ar_against_itself")
        if noise:
            notes.append(f"each (prompt, method) the median of {noise['repeats']} runs; `ar`'s odd runs against its "
                         f"even ones (the noise floor of a per-prompt ratio): median {noise['median']:.2f}×, worst "
                         f"prompt {noise['worst']:.2f}×")
        if "ratio_vs_inprocess" in a:
            notes.append(f"`ar` through the server {a['server_ar_decode_ms_per_token']:.1f} ms/token vs our AR loop "
                         f"in-process {a['inprocess_ar_decode_ms_per_token']:.1f} "
                         f"({a['ratio_vs_inprocess']:.2f}×); calibrated AR step {a['calibrated_ar_step_ms']:.1f} ms")
        if w.get("ttft_by_prompt_length"):
            notes.append("TTFT by prompt length (ar / rest, ms): " + ", ".join(
                f"{n} tokens {t['ar']:.0f} / {t['rest']:.0f}" for n, t in w["ttft_by_prompt_length"].items()))
        if notes:
            out.append("\n" + "\n".join(f"- {n}" for n in notes))
    load = d.get("loadavg_start")
    out.append(f"\n_Source: `bench/results/{name}`; load average at start {load[0]:.1f}, at end "
               f"{d.get('loadavg_end', [0])[0]:.1f}. Command: `{d['command']}`_" if load else "")
    return "\n".join(out)


def contention(name: str, d: dict) -> str:
    m = d["machine"]
    settings = d["settings"]
    phases = [p["busy_processes"] for p in settings[0]["phases"]]
    header = ["worker threads"] + [f"{b} busy" for b in phases]
    rows = [[s["setting"]] + [_f(p["median_ms_per_token"], ".1f") for p in s["phases"]] for s in settings]
    w = settings[-1]["worker"]
    title = (f"**{m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m.get('cores', '?')} cores**; worker {w['dtype']}; "
             f"`ar`, {d['tokens']} new tokens, median ms/token of {d['rounds']} requests per phase, beside busy "
             "single-threaded processes in other sessions")
    return title + "\n\n" + _table(header, rows) + "\n\n" + _source(name, d)


def concurrency(name: str, d: dict) -> str:
    m, w = d["machine"], d.get("worker", {})
    rounds = d["settings"].get("rounds", 1)
    if rounds > 1:  # every (method, level) pooled over its rounds (by_method), not one row per cell
        summaries = [(method, int(level), s) for method, levels in d["by_method"].items() for level, s in levels.items()]
    else:
        summaries = [(c["method"], c["concurrency"], c["summary"]) for c in d["cells"]]
    rows = [[method, str(level), _f(s["tokens_per_s"], ".1f"), _f(s["ms_per_token_p50"], ".0f"),
             _f(s["ms_per_token_p95"], ".0f"), _f(s["ttft_ms_p50"], ".0f"), _f(s["ttft_ms_p95"], ".0f"),
             _f((s.get("speculation") or {}).get("prompt_cached_share"), ".2f"),
             str(s["requests_done"]), str(sum(s["errors"].values()))]
            for method, level, s in sorted(summaries, key=lambda x: (x[0], x[1]))]
    t = d["targets"]
    verdicts = []
    for key in ("rest_scaling", "rest_vs_ar", "ttft"):
        v = t.get(key) or {}
        fig = f" ({v['ratio']:.2f}×)" if v.get("ratio") is not None else ""
        if "per_method" in v:
            figs = [f"{k} {x['ratio']:.2f}×" for k, x in v["per_method"].items() if x.get("ratio") is not None]
            fig = f" ({', '.join(figs)})" if figs else ""
        if "per_level" in v:
            figs = [f"{k}: {x['ratio']:.2f}×" + (f" (rounds {min(x['round_ratios']):.2f}–{max(x['round_ratios']):.2f}×)"
                                                  if x.get("round_ratios") else "")
                    for k, x in sorted(v["per_level"].items(), key=lambda kv: int(kv[0])) if x.get("ratio") is not None]
            fig = f" ({'; '.join(figs)})" if figs else ""
        verdict = "not measured" if v.get("passed") is None else "met" if v["passed"] else "not met"
        verdicts.append(f"{v.get('target', key)}: **{verdict}**{fig}")
    per_cell = (f"{rounds} rounds of {d['settings'].get('duration_s', '?')} s cells per method and level, the "
                "methods' order alternating (figures pooled over the rounds)" if rounds > 1 else
                f"{d['settings'].get('duration_s', '?')} s per cell")
    head = (f"**{m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m.get('cores', '?')} cores**; worker chose "
            f"{w.get('dtype', '?')}, {w.get('threads', '?')} threads; closed-loop clients, HumanEval + MT-Bench "
            f"prompts, {d['settings'].get('max_new_tokens', '?')} new tokens, {per_cell}"
            + (f"; worker flags `{d['settings']['worker_args']}`" if d["settings"].get("worker_args") else ""))
    return head + "\n\n" + _table(["method", "clients", "tok/s (all)", "ms/token p50", "p95", "TTFT p50 ms", "p95",
                                    "prompt cached", "requests", "errors"], rows) + "\n\n" + "\n".join(f"- {v}" for v in verdicts) + \
        "\n\n" + _source(name, d)


TABLES: dict[str, tuple[list[str], Callable[[str, dict], str]]] = {
    "concurrency": (sorted(p.name for p in RESULTS.glob("concurrency-*.json")), concurrency),
    "contention": (["contention.json"], contention),
    "serving": (sorted(p.name for p in RESULTS.glob("serving-*.json")), serving),
    "speculative": (["speculative-humaneval.json", "speculative-mtbench.json"], speculative),
    "draft-retrieval": (["draft-retrieval.json"], draft_retrieval),
    "online-learning": (["online-learning.json"], online_learning),
    "crest": (["crest-humaneval.json", "crest-mtbench.json"], crest),
    "kb": (["kb.json"] + sorted(p.name for p in RESULTS.glob("kb-*.json")), kb),
    "ralm": (["ralm.json"], ralm),
    "ralm-curve": (sorted(p.name for p in RESULTS.glob("ralm-curve*.json")), ralm_curve),
    "knnlm": (["knnlm.json", "knnlm-q4_1.json", "knnlm-served.json", "knnlm-served-zen4.json",
               "knnlm-served-zen5.json"], knnlm),
    "load": (sorted(p.name for p in RESULTS.glob("load*.json")), load),
}


# What each table measures, in one line (its section's lead).
ABOUT = {
    "concurrency": "Closed-loop clients against the services as `make up` starts them: throughput, ms/token and "
                   "time to first token by concurrency level, `ar` against `rest` drafting.",
    "contention": "The worker's decode speed beside busy processes, with fixed and with adaptive thread counts.",
    "serving": "The services started with default flags, called over gRPC one request at a time: ms/token per "
               "decoding method and workload.",
    "speculative": "One process, one model: Hugging Face generate against this project's loop, per drafting method.",
    "draft-retrieval": "Draft retrieval latency of the suffix-array datastore by size, against a NumPy baseline.",
    "online-learning": "The same prompts twice, `rest` drafting with learning from outputs on and off.",
    "crest": "CREST against REST at equal storage: mean accepted length against bytes on disk.",
    "kb": "Knowledge-base retrieval latency by batch size, in process and over gRPC.",
    "ralm": "RaLMSeq against RaLMSpec and its components (prefetch, OS³ strides, async verification).",
    "ralm-curve": "RaLMSpec's speed-up against the share of retrieval in the baseline's time.",
    "knnlm": "kNN-LM: one Search per token against speculative retrieval, and perplexity with and without the "
             "datastore.",
    "load": "The load test's summary: requests, failures and latency under mixed traffic.",
}


def _cited(name: str) -> set[str]:
    return set(TABLES[name][0])


def other_records() -> str:
    """The records no table renders: their benchmark command, CPU and commit, so each is still findable."""
    shown = set().union(*(_cited(t) for t in TABLES))
    rows = []
    for path in sorted(RESULTS.glob("*.json")):
        if path.name in shown:
            continue
        d = json.loads(path.read_text())
        m = d.get("machine", {}) if isinstance(d, dict) else {}
        m = m if isinstance(m, dict) else {}
        code = m.get("code") if isinstance(m.get("code"), dict) else {}
        cmd = (d.get("command") or "") if isinstance(d, dict) else ""
        rows.append([f"`bench/results/{path.name}`", f"`{cmd}`" if cmd else "–", m.get("cpu") or "–",
                     (code.get("commit") or "")[:12] or "–"])
    if not rows:
        return "_Every record is rendered above._\n"
    return _table(["record", "command", "CPU", "commit"], rows) + "\n"


def page(wanted: list[str]) -> str:
    parts = ["# Benchmarks\n",
             "Generated by `python -m bench.report` from the records in `bench/results/` — edit the records or the "
             "report, not this page. Each table names its record and the command that produced it; the record holds "
             "the machine (CPU model and flags, cores, load average) and the commit it measured. One record per "
             "benchmark and CPU class is kept; one-off A/B runs are in `bench/results/archive/` and are not cited.\n"]
    for t in wanted:
        parts.append(f"## {t}\n")
        if t in ABOUT:
            parts.append(ABOUT[t] + "\n")
        parts.append(render_table(t))
    if len(wanted) == len(TABLES):
        parts.append("## Other records\n")
        parts.append("Records of record that no table above renders.\n")
        parts.append(other_records())
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(TABLES)}")
    ap.add_argument("--out", default=str(PAGE), help="the page to write (default: docs/benchmarks.md)")
    ap.add_argument("--stdout", action="store_true", help="print the markdown instead of writing --out")
    args = ap.parse_args(argv)
    wanted = [t for t in args.only.split(",") if t] or list(TABLES)
    unknown = sorted(set(wanted) - set(TABLES))
    if unknown:
        ap.error(f"--only: unknown table(s) {', '.join(unknown)}; known: {', '.join(TABLES)}")
    text = page(wanted)
    if args.stdout:
        print(text)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)


def render_table(name: str) -> str:
    files, render = TABLES[name]
    parts = []
    for f in files:
        path = RESULTS / f
        if not path.exists():
            parts.append(f"_`bench/results/{f}` not present._\n")
            continue
        parts.append(render(f, json.loads(path.read_text())) + "\n")
    return "\n".join(parts)


if __name__ == "__main__":
    main()
