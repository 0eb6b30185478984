"""Statistics of the closed-loop concurrency benchmark (bench/concurrency.py): pure functions, no model, no gRPC.

A cell is one (method, concurrency) run: clients start at t = 0, the first `warmup_s` are excluded, and the
measurement window is [warmup_s, warmup_s + duration_s). Every time below is seconds since the cell started.

Worked example, window [10, 20), three requests:
    A: start 2,  first token 3,  end 12, 128 tokens, OK        finished in the window: counted
    B: start 12, first token 14, end 19, 128 tokens, OK        finished in the window: counted
    C: start 19, first token 21, end 25, 100 tokens, STOPPED   in flight at the end: not counted
    tokens_per_s = (128 + 128) / 10 = 25.6; ms/token from A and B; TTFT from B only (A's first token came
    during the warm-up, C's after the window).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

OK = "OK"
# The benchmark cancelled the request itself at the end of the cell: neither a result nor an error.
STOPPED = "STOPPED"

# The targets a load run is judged against.
SCALING_LEVEL = 8
SCALING_MIN = 4.0  # rest: aggregate tok/s at 8 clients >= 4x at 1 client
REST_VS_AR_MIN = 1.0  # rest >= 1.0x ar aggregate tok/s at every level
TTFT_LEVEL = 8
TTFT_MAX_FACTOR = 3.0  # TTFT p95 at 8 clients <= 3x the solo (1 client) TTFT p95
# A cell with fewer finished requests (or TTFT samples) than this takes no part in a target: one or two requests in
# a window are a coin toss, not a throughput (a loaded machine or a short window gives such cells).
MIN_SAMPLES = 3


@dataclass(frozen=True)
class RequestRecord:
    """One request as a client saw it."""

    method: str
    client: int
    kind: str  # prompt kind: "code" | "chat"
    start_s: float
    end_s: float
    first_token_s: float | None  # None: no token arrived
    tokens: int  # completion tokens streamed
    status: str  # OK, STOPPED, or a gRPC status name
    deltas: tuple[tuple[float, int], ...] = field(default=(), repr=False)  # (arrival time, tokens) per delta
    # The final reply's SpeculationStats fields in STAT_FIELDS (None: the request did not finish).
    stats: dict | None = None

    def as_dict(self) -> dict:
        return {"method": self.method, "client": self.client, "kind": self.kind, "start_s": round(self.start_s, 4),
                "end_s": round(self.end_s, 4),
                "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 4),
                "tokens": self.tokens, "status": self.status, "stats": self.stats}


# What a finished request's stats say about speculation (summed over a cell's finished requests).
STAT_FIELDS = ("forward_steps", "draft_tokens_proposed", "draft_tokens_accepted", "skipped_drafts",
               "degraded_steps", "draft_ms", "verify_ms", "prefill_ms", "cached_prompt_tokens", "prompt_tokens")


@dataclass(frozen=True)
class Window:
    """The measured part of a cell, [start_s, end_s)."""

    start_s: float
    end_s: float

    def __post_init__(self) -> None:
        if not self.end_s > self.start_s >= 0:
            raise ValueError(f"window: [{self.start_s}, {self.end_s}) must satisfy 0 <= start < end")

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    def contains(self, t: float) -> bool:
        return self.start_s <= t < self.end_s


def percentile(values: Iterable[float], q: float) -> float | None:
    """q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default); None if empty.

    [1, 2, 3, 4] -> p50 2.5, p95 3.85.
    """
    xs = sorted(values)
    if not 0 <= q <= 100:
        raise ValueError(f"q: {q} is outside [0, 100]")
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def finished_in(records: Iterable[RequestRecord], window: Window) -> list[RequestRecord]:
    """Requests that completed successfully inside the window (wherever they started)."""
    return [r for r in records if r.status == OK and window.contains(r.end_s)]


def ms_per_token(r: RequestRecord) -> float | None:
    """What the user waited per token, prefill included (bench/serving.py's ms_per_token); None without tokens."""
    return (r.end_s - r.start_s) * 1e3 / r.tokens if r.tokens else None


def ttft_ms(records: Iterable[RequestRecord], window: Window) -> list[float]:
    """TTFT of every request whose first token arrived in the window: at high concurrency few requests finish in
    a window, but many start, so this is the larger sample of the wait a new request sees."""
    return [(r.first_token_s - r.start_s) * 1e3 for r in records
            if r.first_token_s is not None and window.contains(r.first_token_s)]


def streamed_tokens(records: Iterable[RequestRecord], window: Window) -> int:
    """Tokens delivered inside the window, from every request (stopped ones included): smoother than counting
    finished requests when a request takes a large part of the window."""
    return sum(n for r in records for t, n in r.deltas if window.contains(t))


def errors_by_status(records: Iterable[RequestRecord]) -> dict[str, int]:
    """Failed requests by gRPC status over the whole cell (warm-up included: an error is never warm-up noise)."""
    return dict(sorted(Counter(r.status for r in records if r.status not in (OK, STOPPED)).items()))


def _round(v: float | None, digits: int = 2) -> float | None:
    return None if v is None else round(v, digits)


def cell_summary(records: Sequence[RequestRecord], window: Window) -> dict:
    """The figures of one (method, concurrency) cell."""
    return pooled_summary([(records, window)])


def pooled_summary(parts: Sequence[tuple[Sequence[RequestRecord], Window]]) -> dict:
    """The figures of one (method, concurrency) over several cells (rounds), each its records and its window:
    tokens over the windows' summed seconds, latency percentiles over every cell's requests together.
        a 10 s window with 256 tokens finished and a 20 s one with 64 -> tokens_per_s 320 / 30 = 10.7 (time-weighted;
        not the cells' mean (25.6 + 3.2) / 2 = 14.4)"""
    if not parts:
        raise ValueError("pooled_summary needs at least one (records, window) part")
    done = [r for records, window in parts for r in finished_in(records, window)]
    seconds = sum(window.seconds for _, window in parts)
    tokens = sum(r.tokens for r in done)
    mpt = [v for v in map(ms_per_token, done) if v is not None]
    ttft = [t for records, window in parts for t in ttft_ms(records, window)]
    every = [r for records, _ in parts for r in records]
    return {
        "window_s": round(seconds, 3),
        "requests_done": len(done),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 3),
        "streamed_tokens_per_s": round(sum(streamed_tokens(records, window) for records, window in parts) / seconds,
                                       3),
        "ms_per_token_p50": _round(percentile(mpt, 50)), "ms_per_token_p95": _round(percentile(mpt, 95)),
        "ttft_ms_p50": _round(percentile(ttft, 50)), "ttft_ms_p95": _round(percentile(ttft, 95)),
        "ttft_samples": len(ttft),
        "requests_started": len(every),
        "stopped_in_flight": sum(r.status == STOPPED for r in every),
        "errors": errors_by_status(every),
        "speculation": speculation_summary(done),
    }


def speculation_summary(done: Sequence[RequestRecord]) -> dict | None:
    """Sums of STAT_FIELDS over the finished requests that carry stats, and what they add up to: M (tokens per
    decode pass), draft nodes verified per pass, the share of them accepted. None when no request has stats."""
    with_stats = [r for r in done if r.stats]
    if not with_stats:
        return None
    total = {k: round(sum(r.stats.get(k, 0) for r in with_stats), 3) for k in STAT_FIELDS}
    steps = total["forward_steps"]
    decoded = sum(r.tokens for r in with_stats) - len(with_stats)  # the first token of each comes from prefill
    return {"requests": len(with_stats), **total,
            "mean_accepted_length": _round(decoded / steps if steps else None),
            "draft_nodes_per_step": _round(total["draft_tokens_proposed"] / steps if steps else None),
            "draft_acceptance": _round(_ratio(total["draft_tokens_accepted"], total["draft_tokens_proposed"])),
            # the share of prompt tokens the worker's prefix cache supplied (not prefilled)
            "prompt_cached_share": _round(_ratio(total["cached_prompt_tokens"], total["prompt_tokens"]))}


# ---------------------------------------------------------------------------------------------------------------
# Plan


def cell_order(levels: Sequence[int], methods: Sequence[str], rounds: int = 1) -> list[tuple[int, str]]:
    """Every (level, method) `rounds` times, levels in the given order, each level's rounds back to back, the
    methods' order reversed from one round to the next and at every other level (ar, rest at 1; rest, ar at 2;
    with 2 rounds: ar, rest, rest, ar at 1; rest, ar, ar, rest at 2): slow machine drift hits both methods alike,
    and each round is a pair of neighbouring cells whose ratio the drift between rounds does not move."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    out = []
    for i, level in enumerate(levels):
        for r in range(rounds):
            order = list(methods) if (i + r) % 2 == 0 else list(reversed(methods))
            out += [(level, m) for m in order]
    return out


def fits(elapsed_s: float, cell_s: float, budget_s: float) -> bool:
    """Whether one more cell ends within the overall budget."""
    return elapsed_s + cell_s <= budget_s


# /proc/stat's fields of a CPU's time (psutil.cpu_times()); guest time is inside user already.
CPU_TIME_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def steal_share(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Share of the machine's CPU time the hypervisor ran other guests on over an interval (None: no time passed,
    or no steal field). Why: on a shared VM the worker's passes ran at 1.5-2.5x their calibrated ms for minutes in
    one session (its log's "pass costs" lines); steal is the part of such a slowdown that other guests took.
        steal_share({"user": 10, "idle": 88, "steal": 2}, {"user": 20, "idle": 166, "steal": 14}) -> 0.12
    """
    if "steal" not in before or "steal" not in after:
        return None
    total = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in CPU_TIME_FIELDS)
    return round((after["steal"] - before["steal"]) / total, 4) if total > 0 else None


def interleave(*lists: Sequence) -> list:
    """[a0, b0, a1, b1, ...], the longer lists' tails appended in turn: a mix where every stretch holds both."""
    out = []
    for i in range(max((len(xs) for xs in lists), default=0)):
        out += [xs[i] for xs in lists if i < len(xs)]
    return out


# ---------------------------------------------------------------------------------------------------------------
# Targets: cells[method][level] = cell_summary(...)


def _ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None when either is missing or den is 0 (a ratio over nothing measured says nothing)."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _all(flags: Iterable[bool | None]) -> bool | None:
    """True if every flag is True, False if any is False, None if nothing was evaluated or some could not be."""
    flags = list(flags)
    if any(f is False for f in flags):
        return False
    if not flags or any(f is None for f in flags):
        return None
    return True


def throughput(cell: dict | None) -> float | None:
    """A cell's aggregate tok/s, or None when it was not run or finished fewer than MIN_SAMPLES requests."""
    if not cell or cell.get("requests_done", 0) < MIN_SAMPLES:
        return None
    return cell["tokens_per_s"]


def ttft_p(cell: dict | None, key: str) -> float | None:
    """A cell's TTFT percentile (key), or None with fewer than MIN_SAMPLES first tokens in its window."""
    if not cell or cell.get("ttft_samples", 0) < MIN_SAMPLES:
        return None
    return cell[key]


def scaling_target(cells: dict[str, dict[int, dict]], method: str = "rest") -> dict:
    by_level = cells.get(method, {})
    one = throughput(by_level.get(1))
    many = throughput(by_level.get(SCALING_LEVEL))
    ratio = _ratio(many, one)
    return {"target": f"{method}: tok/s at {SCALING_LEVEL} clients >= {SCALING_MIN}x tok/s at 1",
            "tokens_per_s_1": one, f"tokens_per_s_{SCALING_LEVEL}": many, "ratio": _round(ratio, 3),
            "passed": None if ratio is None else ratio >= SCALING_MIN}


def round_ratios(run_cells: Sequence[dict], num: str = "rest", den: str = "ar") -> dict[int, list[float]]:
    """Per level, num's tok/s over den's in each round that measured both (cells as bench/concurrency.py writes
    them: method, concurrency, round, summary), in round order. The two cells of a round ran back to back, so
    their ratio is free of the drift between rounds that moves the pooled figures.
        rounds 0 and 1 at 8 clients: ar 700 / rest 770, ar 600 / rest 570 -> {8: [1.1, 0.95]}"""
    by_round: dict[tuple[int, int], dict[str, float | None]] = {}
    for c in run_cells:
        by_round.setdefault((c["concurrency"], c.get("round", 0)), {})[c["method"]] = throughput(c["summary"])
    out: dict[int, list[float]] = {}
    for (level, _), tps in sorted(by_round.items()):
        ratio = _ratio(tps.get(num), tps.get(den))
        if ratio is not None:
            out.setdefault(level, []).append(round(ratio, 3))
    return out


def rest_vs_ar_target(cells: dict[str, dict[int, dict]], rounds: dict[int, list[float]] | None = None) -> dict:
    """Decided on the pooled cells; rounds (round_ratios): each round's ratio per level, kept beside it as the
    spread a single round would have shown."""
    levels = sorted(set(cells.get("rest", {})) & set(cells.get("ar", {})))
    per_level = {}
    for level in levels:
        ar, rest = throughput(cells["ar"][level]), throughput(cells["rest"][level])
        ratio = _ratio(rest, ar)
        per_level[str(level)] = {"ar_tokens_per_s": ar, "rest_tokens_per_s": rest, "ratio": _round(ratio, 3),
                                 "passed": None if ratio is None else ratio >= REST_VS_AR_MIN}
        if rounds and len(rounds.get(level, [])) > 1:
            per_level[str(level)]["round_ratios"] = rounds[level]
    return {"target": f"rest tok/s >= {REST_VS_AR_MIN}x ar at every level", "per_level": per_level,
            "passed": _all(v["passed"] for v in per_level.values())}


def ttft_target(cells: dict[str, dict[int, dict]]) -> dict:
    """Per method: TTFT p95 at 8 clients against the solo TTFT (p95 at 1 client: the same prompt mix's tail at
    both levels; the ratio to the solo p50 is kept as a figure too)."""
    per_method = {}
    for method, by_level in sorted(cells.items()):
        solo = by_level.get(1)
        solo_p50, solo_p95 = ttft_p(solo, "ttft_ms_p50"), ttft_p(solo, "ttft_ms_p95")
        at = ttft_p(by_level.get(TTFT_LEVEL), "ttft_ms_p95")
        ratio = _ratio(at, solo_p95)
        per_method[method] = {"solo_ttft_ms_p50": solo_p50, "solo_ttft_ms_p95": solo_p95,
                              f"ttft_ms_p95_at_{TTFT_LEVEL}": at, "ratio": _round(ratio, 3),
                              "ratio_vs_solo_p50": _round(_ratio(at, solo_p50), 3),
                              "passed": None if ratio is None else ratio <= TTFT_MAX_FACTOR}
    return {"target": f"TTFT p95 at {TTFT_LEVEL} clients <= {TTFT_MAX_FACTOR}x solo TTFT p95",
            "per_method": per_method, "passed": _all(v["passed"] for v in per_method.values())}


def evaluate_targets(cells: dict[str, dict[int, dict]], rounds: dict[int, list[float]] | None = None) -> dict:
    """The issue's three targets as booleans with their figures; None = not measured in this run (level not run,
    or fewer than MIN_SAMPLES requests in a cell it needs). cells: pooled over rounds where there are several;
    rounds: round_ratios of the run (rest / ar per round), shown beside the pooled ratios."""
    out = {"rest_scaling": scaling_target(cells), "rest_vs_ar": rest_vs_ar_target(cells, rounds),
           "ttft": ttft_target(cells)}
    out["passed"] = _all(t["passed"] for t in out.values())
    return out
