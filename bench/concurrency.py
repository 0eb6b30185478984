"""Concurrency benchmark: closed-loop clients against the services started as a user starts them (default flags).

    python -m bench.concurrency                                        # levels 1,2,4,8,16; ar and rest; ~15 min
    python -m bench.concurrency --levels 1,2,4 --duration-s 20 --json /tmp/conc.json   # a quick look
    python -m bench.concurrency --rounds 3 --duration-s 20             # rest / ar from 3 back-to-back pairs per level

The retrieval service serves one datastore (default: the code datastore, `make bench-datastores`) and the worker
starts with its defaults (tools.launcher.up, as bench/serving.py). At each concurrency level N, N clients run
closed loops, each with its own GenerationClient: stream a request, and as soon as it ends send the next. Requests
alternate HumanEval code prompts (raw prompt + four spaces: the body of the function is what is asked for) and
MT-Bench first turns (chat template), 128 new tokens, greedy, decoding = the method (`ar`, `rest`).
A cell is one (method, level): a warm-up (excluded), then the measurement window; at the end of the cell the
requests still in flight are cancelled (not counted). The methods' order alternates per level (ar, rest at 1;
rest, ar at 2; ...) so machine drift hits both. Statistics (bench/load_stats.py): aggregate tok/s = completion
tokens of the requests finished in the window / window seconds; per-request ms/token (prefill included) p50/p95
over those requests; TTFT (first streamed token) p50/p95 over requests whose first token came in the window;
errors by gRPC status; load average. The issue's targets are evaluated as booleans with their figures (None =
not measured). Bounded: --duration-s per cell, --max-minutes overall (cells that would not fit are skipped and
the JSON says so). JSON (atomic, after every cell) and a PNG plot of throughput and latency vs concurrency.
--rounds N runs each level's cells N times back to back, the methods' order alternating: the figures and targets
pool the rounds, and each round's rest / ar ratio is kept. Why: on a shared 2-vCPU VM the same cell measured 595 to
830 tok/s (ar, 8 clients) within minutes, more than the methods differ by; two neighbouring cells share the drift.
Before the cells every prompt of the mix is sent once (1 token): the worker keeps prompts' KV rows (its prefix
cache, on by default), so every cell runs with all 80 prompts cached, i.e. a workload of repeated prompts, as a load
test's is; `--worker-args "--prefix-cache-mb 0"` measures every prompt prefilled (the cached share of prompt tokens
is in each cell's speculation summary).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

import grpc
import psutil
from tqdm import tqdm

from bench.load_stats import (
    OK,
    STAT_FIELDS,
    STOPPED,
    RequestRecord,
    Window,
    cell_order,
    cell_summary,
    evaluate_targets,
    fits,
    interleave,
    pooled_summary,
    round_ratios,
    steal_share,
)
from bench.serving import (
    cpu_class,
    humaneval_requests,
    machine,
    mtbench_requests,
    warm_page_cache,
    worker_info_dict,
    write_json,
)
from generation_service.client import GenerationClient
from ragcore.model_files import ragserve_home
from tools import launcher

METHODS = ("ar", "rest")
LEVELS = (1, 2, 4, 8, 16)
# A refused or failed request is retried after this pause: a closed loop against a server that refuses at once
# would otherwise spin, flooding the cell with errors and taking CPU from the server it measures.
ERROR_PAUSE_S = 0.2
# After the cell ends, how long cancelled streams get to unwind before the cell is declared stuck.
JOIN_GRACE_S = 30.0


# ---------------------------------------------------------------------------------------------------------------
# Workload


def prompt_mix(per_kind: int) -> list[tuple[str, dict]]:
    """(kind, request kwargs), code and chat alternating."""
    code = [("code", {"prompt": r["prompt"] + "    "}) for r in humaneval_requests(per_kind)]
    chat = [("chat", r) for r in mtbench_requests(per_kind)]
    return interleave(code, chat)


class PromptFeed:
    """Hands out the mix in order to every client of a cell (thread-safe): each cell starts at the mix's first
    prompt, so both methods of a level see the same sequence."""

    def __init__(self, prompts: list[tuple[str, dict]]):
        self._it: Iterator[tuple[str, dict]] = itertools.cycle(prompts)
        self._lock = threading.Lock()

    def next(self) -> tuple[str, dict]:
        with self._lock:
            return next(self._it)


# ---------------------------------------------------------------------------------------------------------------
# One cell: N closed-loop clients


class Cell:
    """Shared state of one (method, level) run: the clock, the stop flag, the calls in flight, the records."""

    def __init__(self, target: str, method: str, feed: PromptFeed, max_new: int, cell_s: float):
        self.target, self.method, self.feed, self.max_new = target, method, feed, max_new
        self.timeout_s = cell_s + JOIN_GRACE_S  # a deadline so a hung server cannot hold a client forever
        self.t0 = time.monotonic()
        self.stop = threading.Event()
        self.records: list[RequestRecord] = []
        self._calls: dict[int, grpc.Call] = {}
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _track(self, client: int, call: grpc.Call) -> None:
        with self._lock:
            self._calls[client] = call
        if self.stop.is_set():  # stop() ran between the loop's check and this registration
            call.cancel()

    def cancel_all(self) -> None:
        self.stop.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()

    def one_request(self, client: GenerationClient, cid: int) -> RequestRecord:
        kind, request = self.feed.next()
        start, first, deltas, status, stats = self.now(), None, [], OK, None
        call = client.stream(**request, max_new_tokens=self.max_new, decoding=self.method, timeout=self.timeout_s)
        self._track(cid, call)
        try:
            for msg in call:
                if msg.token_ids:
                    t = self.now()
                    first = t if first is None else first
                    deltas.append((t, len(msg.token_ids)))
                if msg.HasField("stats"):
                    stats = {k: getattr(msg.stats, k) for k in STAT_FIELDS if k != "prompt_tokens"}
                    stats["prompt_tokens"] = msg.usage.prompt_tokens
        except grpc.RpcError as e:
            status = STOPPED if self.stop.is_set() and e.code() == grpc.StatusCode.CANCELLED else e.code().name
        return RequestRecord(self.method, cid, kind, start, self.now(), first, sum(n for _, n in deltas), status,
                             tuple(deltas), stats)

    def client_loop(self, cid: int) -> None:
        with GenerationClient(self.target) as client:
            while not self.stop.is_set():
                r = self.one_request(client, cid)
                self.records.append(r)  # list.append is atomic under the GIL
                if r.status not in (OK, STOPPED):
                    self.stop.wait(ERROR_PAUSE_S)


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user + system CPU seconds each service process has used so far (0 for one that is gone)."""
    out = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
            out[name] = t.user + t.system
        except psutil.Error:
            out[name] = 0.0
    return out


def cpu_share(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Cores each service got over the cell: on a shared machine the worker may get far less than its threads
    ask for, and throughput is only comparable between cells that got similar shares."""
    return {name: round((after[name] - before[name]) / seconds, 3) for name in before}


def cpu_times() -> dict[str, float]:
    """The machine's CPU time by kind, summed over its CPUs (load_stats.steal_share reads it)."""
    return psutil.cpu_times()._asdict()


def worker_cpu_ms_per_token(cores: dict[str, float], seconds: float, tokens: int) -> float | None:
    """Worker CPU time per streamed token over the cell. Against the calibrated step (GetInfo) it shows CPU
    burnt without progress: OpenMP threads spinning at a barrier while their sibling waits for a core on a
    crowded machine use a full core and produce little."""
    return round(cores["generation"] * seconds * 1e3 / tokens, 1) if tokens and "generation" in cores else None


def run_cell(target: str, method: str, level: int, feed: PromptFeed, max_new: int, warmup_s: float,
             duration_s: float, pids: dict[str, int], bar: tqdm) -> tuple[dict, list[RequestRecord], Window]:
    """One cell -> (its JSON entry, its requests and its measurement window, for pooling over rounds)."""
    cell_s = warmup_s + duration_s
    cell = Cell(target, method, feed, max_new, cell_s)
    load_start, cpu_start, times_start = os.getloadavg(), cpu_seconds(pids), cpu_times()
    threads = [threading.Thread(target=cell.client_loop, args=(i,), name=f"client-{i}", daemon=True)
               for i in range(level)]
    for th in threads:
        th.start()
    shown = 0
    while (t := cell.now()) < cell_s:
        time.sleep(min(1.0, cell_s - t))
        step = int(min(cell.now(), cell_s)) - shown
        bar.update(step)
        shown += step
        bar.set_postfix_str(f"{method} x{level}: {len(cell.records)} ended", refresh=False)
    bar.update(int(cell_s) - shown)
    cell_wall = cell.now()
    cpu = cpu_share(cpu_start, cpu_seconds(pids), cell_wall)
    steal = steal_share(times_start, cpu_times())
    cell.cancel_all()
    deadline = time.monotonic() + JOIN_GRACE_S
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(th.is_alive() for th in threads)
    records = list(cell.records)
    window = Window(warmup_s, cell_s)
    return {"method": method, "concurrency": level, "warmup_s": warmup_s, "duration_s": duration_s,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(), "cpu_cores_used": cpu,
            "steal_share": steal,
            "worker_cpu_ms_per_token": worker_cpu_ms_per_token(cpu, cell_wall, sum(r.tokens for r in records)),
            "stuck_clients": stuck,
            "summary": cell_summary(records, window),
            "records": [r.as_dict() for r in records]}, records, window


# ---------------------------------------------------------------------------------------------------------------
# Results


def by_method(parts: dict[tuple[str, int], list[tuple[list[RequestRecord], Window]]]) -> dict[str, dict[int, dict]]:
    """method -> level -> the summary of its cells pooled over rounds (one cell: that cell's summary)."""
    out: dict[str, dict[int, dict]] = {}
    for (method, level), cells in parts.items():
        out.setdefault(method, {})[level] = pooled_summary(cells)
    return out


def plot(cells: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    """Aggregate tok/s and per-request latency (ms/token, TTFT) vs concurrency, both methods."""
    import matplotlib  # heavy; only when a plot is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    # Per panel: (solid line, dashed line of the same colour, axis label).
    panels = [("tokens_per_s", "streamed_tokens_per_s", "aggregate tok/s (dashed: tokens streamed in window)"),
              ("ms_per_token_p50", "ms_per_token_p95", "ms/token per request (dashed: p95)"),
              ("ttft_ms_p50", "ttft_ms_p95", "TTFT ms (dashed: p95)")]
    all_levels = sorted({n for levels in cells.values() for n in levels})
    for ax, (solid, dashed, label) in zip(axes, panels):
        for method, levels in sorted(cells.items()):
            xs = sorted(levels)
            line = ax.plot(xs, [levels[x][solid] for x in xs], marker="o", label=method)
            ax.plot(xs, [levels[x][dashed] for x in xs], marker="^", linestyle="--", color=line[0].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_levels, [str(n) for n in all_levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def print_table(cells: list[dict], targets: dict, pooled: dict[str, dict[int, dict]] | None = None) -> None:
    """One line per cell (its round when there are several), then, with several rounds, the pooled figures of each
    (method, level) and the rest / ar ratio pooled and per round."""
    rounds = max((c.get("round", 0) for c in cells), default=0) + 1
    print(f"\n{'method':<6} {'N':>3} {'rnd':>3} {'tok/s':>7} {'stream':>7} {'done':>5} {'ms/tok p50':>10} {'p95':>7} "
          f"{'TTFT p50':>9} {'p95':>7} {'load':>5} {'cores':>5} {'steal':>5} {'cpu ms/tok':>10} {'M':>5} {'nodes':>5} {'acc':>5} {'cached':>6} errors")
    for c in sorted(cells, key=lambda c: (c["method"], c["concurrency"], c.get("round", 0))):
        s = c["summary"]
        print(f"{c['method']:<6} {c['concurrency']:>3} {c.get('round', 0):>3} {_latency(s)} "
              f"{c['loadavg_end'][0]:>5.1f} "
              f"{c['cpu_cores_used'].get('generation', 0):>5.2f} {_share(c.get('steal_share')):>5} "
              f"{_num(c['worker_cpu_ms_per_token']):>10} "
              f"{_spec(s.get('speculation'))} {s['errors'] or ''}")
    if rounds > 1 and pooled:
        print(f"\npooled over {rounds} rounds")
        for method, levels in sorted(pooled.items()):
            for level, s in sorted(levels.items()):
                print(f"{method:<6} {level:>3} {'all':>3} {_latency(s)} {_spec(s.get('speculation'))} {s['errors'] or ''}")
        for level, v in targets["rest_vs_ar"]["per_level"].items():
            per_round = ", ".join(f"{r:.2f}" for r in v.get("round_ratios", []))
            print(f"rest / ar at {level:>2}: {_num(v['ratio'], 2)} pooled; rounds {per_round or '-'}")
    print("targets:", {k: v if k == "passed" else v["passed"] for k, v in targets.items()})


def _num(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _latency(s: dict) -> str:
    """tok/s, streamed tok/s, requests done, ms/token and TTFT p50 / p95 of a summary, as table cells."""
    return (f"{s['tokens_per_s']:>7.1f} {s['streamed_tokens_per_s']:>7.1f} {s['requests_done']:>5} "
            f"{_num(s['ms_per_token_p50']):>10} {_num(s['ms_per_token_p95']):>7} "
            f"{_num(s['ttft_ms_p50']):>9} {_num(s['ttft_ms_p95']):>7}")


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _spec(sp: dict | None) -> str:
    """M, draft nodes verified per pass, their acceptance and the prompt share from the prefix cache, as cells."""
    f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    sp = sp or {}
    return (f"{f(sp.get('mean_accepted_length'), 2):>5} {f(sp.get('draft_nodes_per_step'), 1):>5} "
            f"{f(sp.get('draft_acceptance'), 2):>5} {f(sp.get('prompt_cached_share'), 2):>6}")


# ---------------------------------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or any(n < 1 or n > 64 for n in levels):
        raise argparse.ArgumentTypeError(f"--levels: {text!r} must be a comma list of integers in [1, 64]")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=parse_levels, default=list(LEVELS), help="concurrency levels (default 1,2,4,8,16)")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma list of decoding methods (default ar,rest)")
    ap.add_argument("--duration-s", type=float, default=60.0, help="measurement window per cell (default 60)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="cells per (method, level), run back to back with the methods' order alternating: the "
                         "figures pool every round, and each round's rest / ar ratio is kept (a shared machine's "
                         "drift between cells shows as their spread) (default 1)")
    ap.add_argument("--warmup-s", type=float, default=15.0,
                    help="excluded start of every cell: the closed loop reaches steady state (default 15)")
    ap.add_argument("--max-minutes", type=float, default=40.0,
                    help="overall bound, start-up included; cells that would end later are skipped (default 40)")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="tokens generated per request (default 128)")
    ap.add_argument("--dtype", default="", help="the worker's --dtype ('' = its default, measured on this machine)")
    ap.add_argument("--worker-args", default="",
                    help="extra flags for the generation worker, e.g. '--prefix-cache-mb 0' (default: none)")
    ap.add_argument("--prompts", type=int, default=40, help="prompts of each kind in the mix (default 40)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "code"),
                    help="datastore the retrieval service serves (default: the code datastore)")
    ap.add_argument("--target", default="",
                    help="measure the worker at this address instead of starting the services (its datastore, "
                         "dtype and flags are its own; no per-process CPU shares; '' = start them, the benchmark "
                         "of record)")
    ap.add_argument("--json", default="",
                    help="write the results here (atomic); default bench/results/concurrency-<cpu class>.json")
    ap.add_argument("--plot", default="", help="PNG plot path (default: the JSON path with .png)")
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not args.methods:
        ap.error("--methods: give at least one method")
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds} must be >= 1")
    if args.duration_s <= 0 or args.warmup_s < 0:
        ap.error(f"--duration-s {args.duration_s} must be > 0 and --warmup-s {args.warmup_s} >= 0")
    if not args.target and not (Path(args.datastore) / "datastore.json").exists():
        ap.error(f"--datastore {args.datastore} is not built (make bench-datastores)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    budget_s = args.max_minutes * 60
    t_start = time.monotonic()
    json_path = Path(args.json) if args.json else Path(__file__).parent / "results" / f"concurrency-{cpu_class()}.json"
    plot_path = Path(args.plot) if args.plot else json_path.with_suffix(".png")
    prompts = prompt_mix(args.prompts)
    plan = cell_order(args.levels, args.methods, args.rounds)
    cell_s = args.warmup_s + args.duration_s
    cmd = list(sys.argv[1:] if argv is None else argv)
    if not args.json:  # the command of record names the file it wrote, which a default depends on the CPU for
        cmd += ["--json", os.path.relpath(json_path, Path(__file__).resolve().parent.parent)]
    result = {"command": "python -m bench.concurrency " + shlex.join(cmd),
              "machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "loadavg_start": os.getloadavg(), "datastore": args.datastore,
              "settings": {"levels": args.levels, "methods": args.methods, "duration_s": args.duration_s,
                           "warmup_s": args.warmup_s, "rounds": args.rounds, "max_minutes": args.max_minutes,
                           "dtype": args.dtype,
                           "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
                           "worker_args": args.worker_args,
                           "mix": "HumanEval raw prompt + 4 spaces / MT-Bench first turn, alternating"},
              "page_cache_warm_s": warm_page_cache(args.datastore) if not args.target else 0.0,
              "cells": [], "skipped": [], "by_method": {},
              "targets": evaluate_targets({})}
    target, pids, state = args.target, {}, None
    if not target:
        state = Path(tempfile.mkdtemp(prefix="bench-concurrency-")) / "launcher.json"
        topo = launcher.up(datastore=args.datastore, state=state, dtype=args.dtype,  # default flags unless told
                           extra_generation=shlex.split(args.worker_args))
        target, pids = topo.get("generation").address, {p.name: p.pid for p in topo.procs}
    try:
        with GenerationClient(target) as client:
            result["worker"] = worker_info_dict(client.info())
            for m in args.methods:  # load kernels, page in what drafting touches: not recorded
                list(client.stream(**prompts[0][1], max_new_tokens=8, decoding=m, timeout=300))
            # Every prompt of the mix once (1 token, not recorded): with the worker's prefix cache on (its
            # default), every cell then finds the same prompts cached instead of the first cells filling it.
            for _, request in tqdm(prompts, desc="priming prompts", unit="prompt"):
                list(client.stream(**request, max_new_tokens=1, decoding="ar", timeout=300))
        result["start_s"] = round(time.monotonic() - t_start, 1)
        parts: dict[tuple[str, int], list[tuple[list[RequestRecord], Window]]] = {}
        planned: Counter[tuple[str, int]] = Counter()  # cells of each (method, level) so far: the next one's round
        with tqdm(total=int(cell_s) * len(plan), unit="s", desc="concurrency bench") as bar:
            for level, method in plan:
                rnd = planned[(method, level)]
                planned[(method, level)] += 1
                if not fits(time.monotonic() - t_start, cell_s, budget_s):
                    result["skipped"].append({"method": method, "concurrency": level, "round": rnd,
                                              "reason": "--max-minutes"})
                    bar.update(int(cell_s))
                    continue
                feed = PromptFeed(prompts)
                entry, records, window = run_cell(target, method, level, feed, args.max_new_tokens, args.warmup_s,
                                                  args.duration_s, pids, bar)
                result["cells"].append({**entry, "round": rnd})
                parts.setdefault((method, level), []).append((records, window))
                result["by_method"] = by_method(parts)
                result["targets"] = evaluate_targets(result["by_method"], round_ratios(result["cells"]))
                result["loadavg_end"] = os.getloadavg()
                write_json(json_path, result)  # after every cell: a stopped run keeps what it measured
    finally:
        if state is not None:
            launcher.down(state=state)
    if result["cells"]:
        w = result["worker"]
        plot(result["by_method"], plot_path,
             f"{result['machine']['cpu']} - worker {w['dtype']}/{w['threads']}t, {args.max_new_tokens} tokens")
        result["plot"] = str(plot_path)
    write_json(json_path, result)
    print_table(result["cells"], result["targets"], result["by_method"])
    print(f"\nwrote {json_path} and {plot_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
