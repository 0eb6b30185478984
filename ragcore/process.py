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


# libgomp's default (300,000 spins) keeps each idle thread of the worker's team busy for a while after a parallel
# region ends (a 2-thread matmul followed by a sleep burns the start of that sleep; with a tenth of the spins, far
# less of it). Inside a forward pass regions follow each other closely, so the spin only matters after a pass:
# where the worker then waits for the retrieval service (a kNN-LM Search, on both cores), the spinning
# thread takes one of its two cores. A tenth of the default shortens that wait where the worker waits on a Search
# (the kNN-LM baseline got faster) and costs drafting and AR decoding nothing beyond noise; much lower, and the
# passes themselves slow down (see docs/benchmarks.md for the served figures).
WORKER_GOMP_SPINCOUNT = 30000


def worker_openmp_spin() -> None:
    """GOMP_SPINCOUNT for the generation worker unless the environment sets it; effective only before torch (and
    with it libgomp) is imported."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(WORKER_GOMP_SPINCOUNT))
