"""Prompt KV reuse across requests: a prompt the worker prefilled before skips its prefill.

Load tests cycle through a prompt set, clients retry, chat requests share a long system prompt or few-shot
preamble: on a CPU a prompt's prefill costs the model thread many decode steps' worth, and with many concurrent
clients prefill is a large share of the worker's time. The engine keeps the KV rows (and the last row's logits) of
prompts it prefilled, and a later request whose prompt matches takes them instead of recomputing them.

Exactness. A prompt's KV rows depend only on its tokens and on the chunks it is prefilled in: every prompt is
prefilled in chunks of `chunk` rows from position 0 (steps.prefill_segments), whatever else shares the pass.
So a request takes cached rows only where its own prefill would have produced those same rows:
    the whole prompt equal      its rows and its last row's logits (the first token is picked from them: no pass)
    the first k * chunk tokens  those chunks' rows; the rest is prefilled in the chunks its own prefill would use
A shorter common prefix is not reused: the rest would be prefilled in a chunk of another length, and chunks of
different lengths round differently (bf16 prefill linears from 32 rows, fp32 below), which the lossless claim does
not allow. Rows are identical to a fresh prefill up to the batch-composition rounding every batched prefill has
(engine/scheduler.py); tests/generation/test_prefix_cache.py checks outputs against the solo run.

Bounded by bytes, least recently used first out. The engine's model thread looks prompts up and stores them; a
gRPC thread may take a whole prompt's hit (lookup_whole) to send its first token at once, so one lock guards both.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class PrefixHit:
    rows: int  # prompt rows restored: a multiple of the chunk, or the whole prompt
    k: torch.Tensor  # [layers, kv_heads, >= rows, head_dim]
    v: torch.Tensor
    logits: torch.Tensor | None  # [V]: the last prompt row's logits, when the whole prompt was cached


@dataclass
class _Entry:
    k: torch.Tensor  # [layers, kv_heads, n, head_dim], n = the prompt's length
    v: torch.Tensor
    logits: torch.Tensor  # [V]
    nbytes: int
    boundaries: list[bytes] = field(default_factory=list)  # keys of its chunk-aligned proper prefixes


def prompt_key(tokens: np.ndarray) -> bytes:
    """The exact tokens as dictionary key (int32: one width whatever the caller's dtype)."""
    return np.ascontiguousarray(tokens, dtype=np.int32).tobytes()


class PrefixCache:
    def __init__(self, max_bytes: int, chunk: int):
        if max_bytes < 0 or chunk < 1:
            raise ValueError(f"max_bytes must be >= 0 and chunk >= 1, got {max_bytes}, {chunk}")
        self.max_bytes, self.chunk = max_bytes, chunk
        self.nbytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # whole prompt -> entry, least recent first
        # aligned prefix -> the prompts holding it, least recently used first (an ordered set)
        self._boundaries: dict[bytes, dict[bytes, None]] = {}
        self.lookups = {"full": 0, "partial": 0, "miss": 0}
        self.rows_reused = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: np.ndarray) -> PrefixHit | None:
        """The longest reusable part of `prompt` (None: nothing; see the module docstring)."""
        key = prompt_key(prompt)
        with self._lock:
            return self._whole(key) or self._aligned(key, len(prompt))

    def lookup_whole(self, prompt: np.ndarray) -> PrefixHit | None:
        """`prompt`'s hit if the whole prompt is held, else None, uncounted (the request's own lookup later counts
        what it finds). An entry's tensors are never written, so a hit stays valid after its eviction."""
        with self._lock:
            return self._whole(prompt_key(prompt))

    def _whole(self, key: bytes) -> PrefixHit | None:
        e = self._entries.get(key)
        if e is None:
            return None
        self._touch(key)
        self.lookups["full"] += 1
        self.rows_reused += e.k.shape[2]
        return PrefixHit(e.k.shape[2], e.k, e.v, e.logits)

    def _aligned(self, key: bytes, n: int) -> PrefixHit | None:
        for rows in range((n - 1) // self.chunk * self.chunk, 0, -self.chunk):
            holders = self._boundaries.get(key[:4 * rows])
            if holders:
                holder = next(reversed(holders))  # the most recently used
                self._touch(holder)
                e = self._entries[holder]
                self.lookups["partial"] += 1
                self.rows_reused += rows
                return PrefixHit(rows, e.k, e.v, None)
        self.lookups["miss"] += 1
        return None

    @torch.inference_mode()
    def store(self, prompt: np.ndarray, k: torch.Tensor, v: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep a freshly prefilled prompt: k, v [layers, kv_heads, >= n, head_dim] (its cache; rows [0, n) are
        copied), logits [V] of its last row. A prompt larger than the whole budget is not kept."""
        key = prompt_key(prompt)
        n = len(prompt)
        with self._lock:
            if key in self._entries:
                self._touch(key)
                return
        nbytes = 2 * k[:, :, :n].numel() * k.element_size() + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return
        # The copies outside the lock: a gRPC thread's lookup need not wait for them.
        entry = _Entry(k[:, :, :n].clone(), v[:, :, :n].clone(), logits.detach().clone(), nbytes)
        with self._lock:
            if key in self._entries:
                return
            while self.nbytes + nbytes > self.max_bytes:
                self._evict()
            for rows in range(self.chunk, n, self.chunk):
                b = key[:4 * rows]
                entry.boundaries.append(b)
                self._boundaries.setdefault(b, {})[key] = None
            self._entries[key] = entry
            self.nbytes += nbytes

    def _touch(self, key: bytes) -> None:
        """Most recently used: last out, and the first holder its chunks are taken from."""
        self._entries.move_to_end(key)
        for b in self._entries[key].boundaries:
            holders = self._boundaries[b]
            del holders[key]
            holders[key] = None

    def _evict(self) -> None:
        key, e = self._entries.popitem(last=False)
        self.nbytes -= e.nbytes
        for b in e.boundaries:
            holders = self._boundaries[b]
            del holders[key]
            if not holders:
                del self._boundaries[b]

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "mb": round(self.nbytes / 2**20, 1), **self.lookups,
                    "rows_reused": self.rows_reused}
