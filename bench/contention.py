"""Contended cores: the worker's decode speed beside busy processes, with fixed and with adaptive thread counts.

    python -m bench.contention                                   # ~6 min on 2 cores
    python -m bench.contention --tokens 64 --rounds 1 --json /tmp/contention.json   # a quick look

For each worker setting — all cores fixed (`--threads <cores>`), one thread fixed (`--threads 1`), and the
default flags (threads measured, adapted per pass: generation_service/engine/threads.py) — the services start as a
user starts them (tools.launcher.up), then for each phase (0, 1, 2 ... busy processes, then 0 again) the benchmark
starts that many single-threaded CPU-bound Python processes, each in its own session like a neighbouring container
(the kernel shares the CPU between sessions' autogroups first, so `nice` would not help), and times --rounds
`ar` requests of --tokens tokens (greedy, ignore_eos; ms/token = request wall time / tokens, prefill included).
Bounded: a busy process exits by itself after --busy-s seconds and is killed at the end of its phase; traffic only
to the services on 127.0.0.1. JSON written atomically after every setting.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from bench.serving import machine, worker_info_dict, write_json
from generation_service.client import GenerationClient
from ragcore.model_files import ragserve_home
from tools import launcher

PROMPT = "Write a Python function that parses an ISO 8601 date and returns the weekday, with a docstring and tests."
BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def busy_processes(n: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(n)]


def ms_per_token(client: GenerationClient, tokens: int) -> float:
    t = time.perf_counter()
    reply = client.generate(PROMPT, max_new_tokens=tokens, decoding="ar", ignore_eos=True, timeout=600)
    return (time.perf_counter() - t) * 1e3 / max(1, len(reply.token_ids))


def run_setting(name: str, extra: list[str], args, bar: tqdm) -> dict:
    state = Path(tempfile.mkdtemp(prefix="bench-contention-")) / "launcher.json"
    topo = launcher.up(datastore=args.datastore, state=state, extra_generation=extra)
    phases = []
    try:
        with GenerationClient(topo.get("generation").address) as client:
            info = worker_info_dict(client.info())
            ms_per_token(client, 8)  # the first request's one-off costs (page cache, allocator) out of the way
            for busy in args.phases:
                procs = busy_processes(busy, args.busy_s)
                try:
                    time.sleep(0.5)
                    ms = []
                    for _ in range(args.rounds):
                        ms.append(ms_per_token(client, args.tokens))
                        bar.update(1)
                        bar.set_postfix_str(f"{name} busy={busy} {ms[-1]:.1f} ms/token")
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
                phases.append({"busy_processes": busy, "ms_per_token": ms, "median_ms_per_token": statistics.median(ms)})
    finally:
        launcher.down(state=state, grace_s=10)
    return {"setting": name, "generation_flags": extra, "worker": info, "phases": phases}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=160, help="new tokens per request (default 160)")
    ap.add_argument("--rounds", type=int, default=3, help="requests per phase (default 3)")
    ap.add_argument("--phases", default="0,1,2,0", help="busy processes per phase, in order (default 0,1,2,0)")
    ap.add_argument("--busy-s", type=float, default=300.0, help="a busy process exits after this long at most")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "stdlib"),
                    help="the retrieval service's datastore (unused by ar; the services start as deployed)")
    ap.add_argument("--json", default="bench/results/contention.json",
                    help="results file, rewritten after each setting (default %(default)s)")
    args = ap.parse_args(argv)
    args.phases = [int(x) for x in args.phases.split(",") if x]
    cores = len(os.sched_getaffinity(0))
    settings = [(f"{cores} threads, fixed", ["--threads", str(cores)]), ("1 thread, fixed", ["--threads", "1"]),
                ("adaptive (default flags)", [])]
    out = {"command": " ".join(["python -m bench.contention", *(argv if argv is not None else sys.argv[1:])]),
           "machine": {**machine(), "loadavg_start": list(os.getloadavg())}, "tokens": args.tokens,
           "rounds": args.rounds, "settings": []}
    with tqdm(total=len(settings) * len(args.phases) * args.rounds, desc="contention", unit="req") as bar:
        for name, extra in settings:
            out["settings"].append(run_setting(name, extra, args, bar))
            out["machine"]["loadavg_end"] = list(os.getloadavg())
            write_json(Path(args.json), out)
    for s in out["settings"]:
        print(f"{s['setting']:28s}", "  ".join(f"busy {p['busy_processes']}: {p['median_ms_per_token']:.1f}"
                                             for p in s["phases"]))


if __name__ == "__main__":
    main()
