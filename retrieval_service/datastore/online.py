"""Online learning: finished outputs become draftable, as SuffixDecoding's global tree does.

Two levels, so a new output is searchable within a fraction of a second without re-sorting everything:
- a small in-memory *delta* shard over the outputs not yet compacted, rebuilt in a background thread
  (debounced) whenever outputs arrive — a suffix array over <= compact_tokens tokens takes milliseconds;
- once the delta holds compact_tokens tokens it is written as an on-disk shard (atomic, memory-mapped
  afterwards) and a fresh delta starts. On-disk learned shards survive restarts when a directory is given.
Total learned tokens are bounded by max_tokens: the oldest compacted shard is evicted (file deleted) first.
Drafting searches base shards + learned shards + delta as one datastore, merged before the tree is built.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import numpy as np

from retrieval_service.datastore.shards import Shard, verify_shards
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

log = logging.getLogger(__name__)
_NAME = "learned-{:08d}.rsa"
_NAME_RE = re.compile(r"learned-(\d{8})\.rsa$")


class OnlineLearner:
    def __init__(self, datastore: SuffixArrayDatastore, *, directory: str | Path | None = None,
                 max_tokens: int = 4_000_000, compact_tokens: int = 500_000, debounce_s: float = 0.2,
                 background: bool = True):
        if not 1 <= compact_tokens <= max_tokens:
            raise ValueError(f"compact_tokens must lie in [1, max_tokens={max_tokens}], got {compact_tokens}")
        self.ds = datastore
        self.dir = Path(directory).expanduser() if directory else None
        self.max_tokens = max_tokens
        self.compact_tokens = compact_tokens
        self.debounce_s = debounce_s
        self._lock = threading.Lock()
        self._pending: list[np.ndarray] = []  # outputs not yet compacted (the delta's documents)
        self._pending_tokens = 0
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._compacted: list[Shard] = self._load_compacted()
        self._seq = 1 + max((self._seq_of(s) for s in self._compacted), default=0)
        self.documents_learned = 0
        self._searchable = 0  # tokens in the learned shards drafting searches now (_publish)
        self._publish(delta=None)
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="online-learner", daemon=True)
            self._thread.start()

    # -- public ------------------------------------------------------------------------------------------------

    def add(self, tokens: np.ndarray) -> None:
        """Queue one finished output (token ids) for learning; searchable after the next rebuild."""
        doc = np.asarray(tokens)
        if doc.ndim != 1 or doc.size == 0:
            raise ValueError(f"tokens: need a non-empty 1-D token array, got shape {doc.shape}")
        if int(doc.min()) < 0 or int(doc.max()) >= self.ds.vocab_size:
            raise ValueError(f"tokens: ids must lie in [0, {self.ds.vocab_size})")
        if doc.size > self.compact_tokens:
            doc = doc[-self.compact_tokens:]  # keep the newest part of an enormous output
        with self._lock:
            self._pending.append(doc.astype(np.int32))
            self._pending_tokens += int(doc.size)
            self.documents_learned += 1
        self._dirty.set()

    def flush(self) -> None:
        """Rebuild now (tests and benchmarks; the server relies on the background thread)."""
        self._dirty.clear()
        self._rebuild()

    @property
    def learned_tokens(self) -> int:
        with self._lock:
            return self._pending_tokens + sum(s.num_tokens for s in self._compacted)

    @property
    def searchable_tokens(self) -> int:
        """Learned tokens drafts can use now; learned_tokens minus those waiting for the next rebuild."""
        with self._lock:
            return self._searchable

    def stats(self) -> dict:
        with self._lock:
            return {"documents": self.documents_learned, "pending_tokens": self._pending_tokens,
                    "compacted_shards": len(self._compacted),
                    "learned_tokens": self._pending_tokens + sum(s.num_tokens for s in self._compacted)}

    def close(self) -> None:
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- internals -------------------------------------------------------------------------------------------------

    @staticmethod
    def _seq_of(shard: Shard) -> int:
        m = _NAME_RE.search(str(shard.path or ""))
        return int(m.group(1)) if m else 0

    def _load_compacted(self) -> list[Shard]:
        if self.dir is None or not self.dir.exists():
            return []
        shards = []
        for path in sorted(self.dir.glob("learned-*.rsa")):
            try:
                shard = Shard.open(path, expected_tokenizer_id=self.ds.tokenizer_id)
                verify_shards([shard])  # written by us, but a disk can still corrupt it
                shards.append(shard)
            except Exception as e:  # a damaged learned shard must not keep the service down
                log.error("skipping learned shard %s: %s", path, e)
        return shards

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            time.sleep(self.debounce_s)  # batch bursts of outputs into one rebuild
            self._dirty.clear()
            try:
                self._rebuild()
            except Exception:
                log.exception("online learning rebuild failed; will retry on the next output")

    def _rebuild(self) -> None:
        with self._lock:
            docs = list(self._pending)
            pending_tokens = self._pending_tokens
        if not docs:
            self._publish(delta=None)
            return
        shard = Shard.from_documents(docs, vocab_size=self.ds.vocab_size, tokenizer_id=self.ds.tokenizer_id,
                                     extra={"learned": True})
        if pending_tokens >= self.compact_tokens:
            if self.dir is not None:
                self.dir.mkdir(parents=True, exist_ok=True)
                shard.write(self.dir / _NAME.format(self._seq))
                shard = Shard.open(shard.path, expected_tokenizer_id=self.ds.tokenizer_id)
            self._seq += 1
            with self._lock:
                # Outputs that arrived during the build stay pending for the next delta.
                del self._pending[:len(docs)]
                self._pending_tokens -= pending_tokens
                self._compacted.append(shard)
                self._evict()
            self._publish(delta=None)
            if self._pending_tokens:
                self._dirty.set()
            return
        self._publish(delta=shard)

    def _evict(self) -> None:
        """Drop the oldest compacted shards while the learned total exceeds max_tokens (lock held)."""
        while self._compacted and self._pending_tokens + sum(s.num_tokens for s in self._compacted) > self.max_tokens:
            old = self._compacted.pop(0)
            if old.path is not None:
                old.path.unlink(missing_ok=True)

    def _publish(self, delta: Shard | None) -> None:
        with self._lock:
            extra = list(self._compacted) + ([delta] if delta is not None else [])
        self.ds.set_extra(extra)
        with self._lock:
            self._searchable = sum(s.num_tokens for s in extra)
