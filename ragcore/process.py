"""Process-wide settings, made once by each service's and tool's `main` (library code never touches the
environment).

- HF_HUB_OFFLINE=1: nothing may contact a model hub (the libraries also get local_files_only=True; this covers
  the code paths that do not take it, e.g. sentence-transformers' module loading).
- TOKENIZERS_PARALLELISM=false: no tokenizer thread pool next to torch's. The services tokenize one request at a
  time, and on a small machine every extra runnable thread stalls torch's OpenMP team. Builders that tokenize a
  corpus in bulk pass `tokenizer_threads=True`.
- GOMP_SPINCOUNT (the generation worker, `worker_openmp_spin`): how long torch's idle OpenMP threads spin before
  they sleep. libgomp reads it once, when it loads, so the worker's entry point sets it before torch is imported.
"""

from __future__ import annotations

import os


def offline_process(tokenizer_threads: bool = False) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if tokenizer_threads else "false")


# libgomp's default (300,000 spins) keeps each idle thread of the worker's team busy ~10 ms after a parallel region
# ends (measured: a 2-thread matmul, then a 30 ms sleep: 9.6 ms of CPU burnt; 1.8 ms at 30,000, 0.4 at 10,000).
# Inside a forward pass regions follow each other within microseconds, so the spin only matters after a pass:
# where the worker then waits for the retrieval service (a kNN-LM Search, ~12 ms on both cores), the spinning
# thread takes one of its two cores. Served on an AMD EPYC Zen 4 (2 vCPU), A/B/A/B, 8 requests each: the kNN-LM
# baseline 1.33 / 1.41 -> 1.20 / 1.24 s (R 0.92 / 0.98 -> 0.77 / 0.77 s), its default request 1.12 / 1.14 ->
# 1.10 / 1.10 s; ar / rest ms per token on HumanEval 7.8, 4.1 / 7.6, 4.2 -> 7.1, 3.9 / 6.9, 3.8 and on MT-Bench
# 6.8, 7.1 / 7.4, 7.9 -> 6.9, 7.4 / 7.5, 8.2 (within run-to-run noise). At 3,000 a pass itself got ~0.8 ms slower.
WORKER_GOMP_SPINCOUNT = 30000


def worker_openmp_spin() -> None:
    """GOMP_SPINCOUNT for the generation worker unless the environment sets it; effective only before torch (and
    with it libgomp) is imported."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(WORKER_GOMP_SPINCOUNT))
