"""Process-wide settings, made once by each service's and tool's `main` (library code never touches the
environment).

- HF_HUB_OFFLINE=1: nothing may contact a model hub (the libraries also get local_files_only=True; this covers
  the code paths that do not take it, e.g. sentence-transformers' module loading).
- TOKENIZERS_PARALLELISM=false: no tokenizer thread pool next to torch's. The services tokenize one request at a
  time, and on a small machine every extra runnable thread stalls torch's OpenMP team. Builders that tokenize a
  corpus in bulk pass `tokenizer_threads=True`.
"""

from __future__ import annotations

import os


def offline_process(tokenizer_threads: bool = False) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if tokenizer_threads else "false")
