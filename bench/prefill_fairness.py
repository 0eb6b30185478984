"""Prefill fairness: a long prompt beside decoding streams, against each alone, interleaved.

    python -m bench.prefill_fairness                                   # 8,190-token prompt, 4 streams, 3 rounds
    python -m bench.prefill_fairness --prompt-tokens 2048 --rounds 2   # a quick look
    python -m bench.prefill_fairness --worker-args "--prefill-slowdown 100"   # whole chunks beside decoding

The services start as a user starts them (tools.launcher.up: the retrieval service over a datastore, the worker
with its default flags) and everything goes over gRPC. Each round runs three cells, their order reversed every other
round so a shared machine's drift hits each alike:

    streams   `--streams` closed-loop streams (a HumanEval prompt each, `--stream-tokens` new tokens, greedy, the
              worker's default decoding) for as long as the long prompt's solo prefill took (at least 2 s):
              their inter-token gaps (a chunk's gap split over its tokens; the first token of each request is TTFT,
              not counted)
    long      one `--prompt-tokens`-token prompt alone (stdlib source, a different slice every time: the prefix
              cache never has it), 1 new token: its TTFT is the solo prefill time
    loaded    the long prompt while the streams run: its TTFT, and the streams' gaps between its submit and its
              first token

Targets (the issue's): loaded inter-token p95 <= 3x the streams-alone p95; loaded TTFT <= 1.5x the solo one. Ratios
pool the rounds (p95 over every gap of a cell kind; TTFT medians), and each round's ratios are kept. JSON (atomic,
after every round): bench/results/prefill_fairness-<cpu class>.json with the machine, load average and commit.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.serving import cpu_class, humaneval_requests, machine, worker_info_dict, write_json
from generation_service.client import GenerationClient
from ragcore.model_files import default_model_dir, load_tokenizer, ragserve_home
from tools import launcher

TARGET_ITL_RATIO = 3.0
TARGET_TTFT_RATIO = 1.5
MIN_WINDOW_S = 2.0  # the streams-alone cell lasts at least this long
SETTLE_S = 1.0  # streams run this long before a cell's window opens (their prompts prefilled, decoding)


class LongPrompts:
    """Distinct `n`-token prompts of stdlib source: slice i starts i * n tokens into the concatenated text, so no
    two share a first chunk (the worker's prefix cache never serves one)."""

    def __init__(self, n: int, count: int):
        tok = load_tokenizer(default_model_dir())
        root = Path(sysconfig.get_paths()["stdlib"])
        ids: list[int] = []
        for f in sorted(root.glob("*.py")):
            ids += tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
            if len(ids) >= n * count:
                break
        if len(ids) < n * count:
            raise ValueError(f"the stdlib holds {len(ids)} tokens, fewer than {count} prompts of {n}")
        self.prompts = [ids[i * n:(i + 1) * n] for i in range(count)]
        self._next = 0

    def take(self) -> list[int]:
        p = self.prompts[self._next]
        self._next += 1
        return p


class Streams:
    """`n` closed-loop GenerateStream clients; every chunk's arrival is kept as (time, tokens, request index)."""

    def __init__(self, target: str, n: int, max_new: int, decoding: str, timeout_s: float):
        self.stop = threading.Event()
        self.chunks: list[list[tuple[float, int, int]]] = [[] for _ in range(n)]
        self.errors: list[str] = []
        prompts = [r["prompt"] + "    " for r in humaneval_requests(n)]
        self._threads = [threading.Thread(target=self._loop, args=(target, i, prompts[i], max_new, decoding,
                                                                   timeout_s), daemon=True) for i in range(n)]

    def _loop(self, target: str, i: int, prompt: str, max_new: int, decoding: str, timeout_s: float) -> None:
        with GenerationClient(target) as client:
            k = 0
            while not self.stop.is_set():
                try:
                    for msg in client.stream(prompt, max_new_tokens=max_new, ignore_eos=True, decoding=decoding,
                                             timeout=timeout_s):
                        if msg.token_ids:
                            self.chunks[i].append((time.perf_counter(), len(msg.token_ids), k))
                        if self.stop.is_set():
                            break
                except Exception as e:  # counted; the loop goes on (a bench reports, it does not crash)
                    self.errors.append(type(e).__name__ + ": " + str(e)[:200])
                    time.sleep(0.2)
                k += 1

    def __enter__(self) -> "Streams":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def gaps_ms(self, t0: float, t1: float) -> list[float]:
        """Per-token gaps of chunks that arrived in [t0, t1], within one request (a chunk of n tokens after a gap
        of g gives n gaps of g / n)."""
        out: list[float] = []
        for chunks in self.chunks:
            for (ta, _, ka), (tb, n, kb) in zip(chunks, chunks[1:]):
                if ka == kb and t0 <= tb <= t1:
                    out += [(tb - ta) * 1e3 / n] * n
        return out


def first_token_s(target: str, prompt: list[int], timeout_s: float) -> float:
    """Seconds from sending the prompt to its first streamed token."""
    with GenerationClient(target) as client:
        t = time.perf_counter()
        for msg in client.stream(prompt_tokens=prompt, max_new_tokens=1, ignore_eos=True, decoding="ar",
                                 timeout=timeout_s):
            if msg.token_ids:
                return time.perf_counter() - t
    raise RuntimeError("the long prompt's stream ended without a token")


def p95(xs: list[float]) -> float | None:
    return float(np.percentile(xs, 95)) if xs else None


def gap_summary(gaps: list[float]) -> dict:
    return {"tokens": len(gaps), "p50_ms": float(np.percentile(gaps, 50)) if gaps else None, "p95_ms": p95(gaps),
            "mean_ms": statistics.fmean(gaps) if gaps else None}


def run_round(target: str, prompts: LongPrompts, args: argparse.Namespace, order: list[str],
              solo_ttft_hint: float) -> dict:
    """One round's three cells in `order` -> their figures."""
    out: dict = {"order": order}
    for kind in order:
        if kind == "long":
            out["solo_ttft_s"] = first_token_s(target, prompts.take(), args.timeout_s)
        elif kind == "streams":
            window = max(MIN_WINDOW_S, out.get("solo_ttft_s", solo_ttft_hint))
            with Streams(target, args.streams, args.stream_tokens, args.decoding, args.timeout_s) as s:
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                time.sleep(window)
                t1 = time.perf_counter()
            out["streams_alone"] = {**gap_summary(s.gaps_ms(t0, t1)), "window_s": window, "errors": s.errors}
            out["_alone_gaps"] = s.gaps_ms(t0, t1)
        else:
            with Streams(target, args.streams, args.stream_tokens, args.decoding, args.timeout_s) as s:
                time.sleep(SETTLE_S)
                t0 = time.perf_counter()
                ttft = first_token_s(target, prompts.take(), args.timeout_s)
                t1 = time.perf_counter()
            out["loaded_ttft_s"] = ttft
            out["streams_loaded"] = {**gap_summary(s.gaps_ms(t0, t1)), "window_s": t1 - t0, "errors": s.errors}
            out["_loaded_gaps"] = s.gaps_ms(t0, t1)
    a, b = out["streams_alone"]["p95_ms"], out["streams_loaded"]["p95_ms"]
    out["itl_p95_ratio"] = b / a if a and b else None
    out["ttft_ratio"] = out["loaded_ttft_s"] / out["solo_ttft_s"]
    return out


def pooled(rounds: list[dict]) -> dict:
    alone = [g for r in rounds for g in r["_alone_gaps"]]
    loaded = [g for r in rounds for g in r["_loaded_gaps"]]
    solo = statistics.median(r["solo_ttft_s"] for r in rounds)
    ttft = statistics.median(r["loaded_ttft_s"] for r in rounds)
    a, b = p95(alone), p95(loaded)
    itl_ratio = b / a if a and b else None
    return {"streams_alone": gap_summary(alone), "streams_loaded": gap_summary(loaded),
            "solo_ttft_s_median": solo, "loaded_ttft_s_median": ttft, "itl_p95_ratio": itl_ratio,
            "ttft_ratio": ttft / solo,
            "targets": {"itl_p95_ratio_le_3": itl_ratio is not None and itl_ratio <= TARGET_ITL_RATIO,
                        "ttft_ratio_le_1_5": ttft / solo <= TARGET_TTFT_RATIO}}


def measure(target: str, args: argparse.Namespace, on_round=None) -> tuple[list[dict], dict]:
    """The rounds against a running worker -> (per-round figures, pooled figures)."""
    prompts = LongPrompts(args.prompt_tokens, 2 * args.rounds + 1)
    with GenerationClient(target) as client:  # load kernels and page in what decoding touches: not recorded
        list(client.stream(humaneval_requests(1)[0]["prompt"], max_new_tokens=8, decoding=args.decoding,
                           timeout=args.timeout_s))
    hint = first_token_s(target, prompts.take(), args.timeout_s)  # a first long prefill, not recorded
    rounds: list[dict] = []
    for i in range(args.rounds):
        order = ["streams", "long", "loaded"] if i % 2 == 0 else ["loaded", "long", "streams"]
        rounds.append(run_round(target, prompts, args, order, hint))
        if on_round is not None:
            on_round(rounds)
    return rounds, pooled(rounds)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def public(rounds: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rounds]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_fairness", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=8190, help="tokens of the long prompt (default 8190)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent decoding streams (default 4)")
    ap.add_argument("--stream-tokens", type=int, default=256,
                    help="new tokens per stream request; each stream sends the next at once (default 256)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three cells (default 3)")
    ap.add_argument("--decoding", default="", help="the streams' decoding mode ('' = the worker's default)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="deadline of every request (default 600)")
    ap.add_argument("--datastore", default=str(ragserve_home() / "datastores" / "stdlib"),
                    help="datastore the retrieval service serves (default: the stdlib datastore)")
    ap.add_argument("--worker-args", default="", help="extra flags for the generation worker (default: none)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0,
                    help="how long the services may take to report SERVING; a worker's first start on a machine "
                         "calibrates, minutes on a busy one (default 900)")
    ap.add_argument("--target", default="",
                    help="measure a worker already running here (host:port) instead of starting the services")
    ap.add_argument("--json", default="",
                    help="write the results here (atomic); default bench/results/prefill_fairness-<cpu class>.json")
    args = ap.parse_args(argv)
    if args.prompt_tokens < 1 or args.streams < 1 or args.rounds < 1 or args.stream_tokens < 2:
        ap.error("--prompt-tokens, --streams and --rounds must be >= 1, --stream-tokens >= 2")
    if not args.target and not (Path(args.datastore) / "datastore.json").exists():
        ap.error(f"--datastore {args.datastore} is not built (make datastore)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path = (Path(args.json) if args.json else
                 Path(__file__).parent / "results" / f"prefill_fairness-{cpu_class()}.json")
    cmd = list(sys.argv[1:] if argv is None else argv)
    result = {"command": "python -m bench.prefill_fairness " + shlex.join(cmd), "machine": machine(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": os.getloadavg(),
              "settings": {k: getattr(args, k) for k in ("prompt_tokens", "streams", "stream_tokens", "rounds",
                                                         "decoding", "datastore", "worker_args")},
              "targets_of_the_issue": {"itl_p95_ratio": TARGET_ITL_RATIO, "ttft_ratio": TARGET_TTFT_RATIO}}

    def save(rounds: list[dict]) -> None:
        result["rounds"] = public(rounds)
        result["loadavg_end"] = os.getloadavg()
        write_json(json_path, result)

    state = Path(tempfile.mkdtemp(prefix="bench-prefill-")) / "launcher.json"
    topo = None
    if not args.target:
        topo = launcher.up(datastore=args.datastore, state=state, extra_generation=shlex.split(args.worker_args),
                           timeout_s=args.start_timeout_s)
    try:
        target = args.target or topo.get("generation").address
        with GenerationClient(target) as client:
            result["worker"] = worker_info_dict(client.info())
        with tqdm(total=args.rounds, unit="round", desc="prefill fairness") as bar:
            rounds, summary = measure(target, args, on_round=lambda r: (save(r), bar.update(1)))
    finally:
        if topo is not None:
            launcher.down(state=state)
    result["pooled"] = summary
    save(rounds)
    print(f"long prompt {args.prompt_tokens} tokens, {args.streams} streams, {args.rounds} rounds "
          f"(load average {result['loadavg_end'][0]:.2f})")
    for r in result["rounds"]:
        print(f"  round {r['order']}: TTFT solo {_f(r['solo_ttft_s'])} s, loaded {_f(r['loaded_ttft_s'])} s "
              f"({_f(r['ttft_ratio'])}x); inter-token p95 alone {_f(r['streams_alone']['p95_ms'])} ms, "
              f"loaded {_f(r['streams_loaded']['p95_ms'])} ms ({_f(r['itl_p95_ratio'])}x)")
    print(f"pooled: TTFT {_f(summary['ttft_ratio'])}x (target <= {TARGET_TTFT_RATIO}), inter-token p95 "
          f"{_f(summary['itl_p95_ratio'])}x (target <= {TARGET_ITL_RATIO}); {summary['targets']}")
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
