"""REST drafting over suffix-array shards: search, continuation gather, counted trie, top-k — GIL-free kernels.

    ds = SuffixArrayDatastore.open("~/.cache/ragserve/datastores/stdlib", expected_tokenizer_id=tid)
    ds.warmup()                                   # load the compiled kernels before reporting SERVING
    tree = ds.draft(context_ids)                  # REST: longest suffix 16..2, <= 5000 matches, 10 tokens, 64 nodes
    tree = ds.draft(context_ids, source="merged") # + the request's own continuations, one trie (the `rest` default)

Search. The longest context suffix that occurs is found by binary search on its length: if the last L tokens
occur, so do the last L-1 (they sit inside the same occurrence), so "occurs" is monotone in L. The longest
length is probed first (repetitive code often matches it outright), then ~log2(16) probes. Each probe is one
lower-bound binary search per shard inside the bucket of its first token (a vocab-sized table stored in the
shard), comparing from the second token on.

Sampling. A range with more than max_matches occurrences is sampled at evenly spaced suffix-array positions
(i * n // max_matches). REST takes the first max_matches, i.e. the lexicographically smallest continuations,
which biases the counts toward small token ids; even spacing keeps the rows sorted (the trie stays one linear
pass) and gives unbiased frequency estimates. With several shards the budget is split proportionally to each
shard's range size (largest remainder), so below the cap the rows are exactly those of one big shard; above it
the sample differs but remains proportional (the tests pin exact equality below the cap).

Merging sources ("merged"). Datastore rows and the context's own prompt-lookup rows go into one trie; each
source's rows weigh source_weight / rows_of_that_source, so a node's score is a mixture of the two empirical
continuation distributions (weights tuned with bench/draft_simulation.py; see MERGE_WEIGHTS).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from ragcore.draft_kernels import N_SOURCES, draft_kernel, draft_packed
from ragcore.draft_tree import (
    CONTEXT_CONTINUATION,
    CONTEXT_MAX_MATCHES,
    CONTEXT_MIN_SUFFIX,
    DraftTree,
    as_context,
    check_draft_args,
    context_draft,
)
from retrieval_service.datastore import shards as shards_mod
from retrieval_service.datastore.shards import DatastoreCorrupted, DatastoreError, Shard, TokenizerMismatch

__all__ = ["SuffixArrayDatastore", "DatastoreError", "DatastoreCorrupted", "TokenizerMismatch", "Shard",
           "check_datastore", "verify_datastore", "MERGE_WEIGHTS"]

SOURCES = ("datastore", "context", "merged")
# (datastore, context) weights of the merged trie; each source's rows are normalised by their count first.
MERGE_WEIGHTS = (1.0, 1.0)
SAMPLING = ("even", "first")
SHARD_SLOTS = (1, 4, 16, 64, 256)


# ----------------------------------------------------------------------------------------------------------------
# The datastore


class SuffixArrayDatastore:
    """Memory-mapped suffix-array shards (plus optional in-memory delta shards) behind one drafting interface."""

    def __init__(self, shards: Sequence[Shard], path: Path | None = None):
        if not shards:
            raise DatastoreError("a datastore needs at least one shard")
        first = shards[0].header
        for s in shards[1:]:
            if s.header["tokenizer_id"] != first["tokenizer_id"] or s.vocab_size != shards[0].vocab_size:
                raise DatastoreError(f"shard {s.path or 'in memory'} has tokenizer {s.header['tokenizer_id']!r} / "
                                     f"vocab {s.vocab_size}, the datastore {first['tokenizer_id']!r} / "
                                     f"{first['vocab_size']}")
        self.path = path
        self.verification: list[tuple[Path, str]] = []  # (shard file, "verified" | "cached") from open(verify=True)
        self._lock = threading.Lock()
        self._changed: DatastoreCorrupted | None = None  # a shard file changed under the server: every draft fails
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._base = tuple(shards)
        self._set_shards(list(shards))

    def _set_shards(self, shards: list[Shard]) -> None:
        # Shards reach the kernels as tuples of same-typed arrays (numba UniTuples): nothing to compile at open
        # (a numba typed List JITs its own methods in every process, which is slow). A tuple's length is part of
        # its type, so tuples are padded with empty arrays to a few fixed sizes: one cached specialisation serves
        # 1 shard, one 2-4 shards, and so on, instead of one per shard count.
        n = len(shards)
        toks, sas, buckets = (shard_tuple(shards, field) for field in ("tokens", "sa", "bucket"))
        # One tuple, swapped atomically: a concurrent draft sees either the old or the new shard set. Shards past
        # the base ones (set_extra: learned online) are the "learned" source of a draft's per-source estimates.
        self._state = (tuple(shards), toks, sas, buckets, n, len(self._base), shards[0].separator)

    # -- construction ----------------------------------------------------------------------------------------------

    @classmethod
    def build(cls, docs_token_arrays: Iterable[np.ndarray], path: str | os.PathLike, *, vocab_size: int,
              tokenizer_id: str, shard_tokens: int | None = None, progress: bool = True,
              limit_tokens: int | None = None, resume_key: str | None = None) -> "SuffixArrayDatastore":
        """Write a datastore directory from token arrays (one per document) and open it.

        resume_key: a string naming the corpus and settings; with it an interrupted build into `path` continues
        at the first missing shard (the iterable is replayed from the start; finished documents are skipped).
        Without it `path` must not hold a datastore already.
        """
        out = Path(path).expanduser()
        key = resume_key or "api-build"
        if resume_key is None and out.exists() and any(out.iterdir()):
            raise DatastoreError(f"{out} is not empty; choose a new path (or pass resume_key to resume a build)")
        point = shards_mod.resume_point(out, key) if out.exists() else shards_mod.ResumePoint(0, 0, 0)
        if (out / shards_mod.MANIFEST).exists():
            return cls.open(out, expected_tokenizer_id=tokenizer_id)
        bar = tqdm(unit="tok", unit_scale=True, desc="datastore", disable=not progress)
        docs = ((i, d) for i, d in enumerate(docs_token_arrays) if i >= point.next_source)
        try:
            shards_mod.write_shards(docs, out, vocab_size=vocab_size, tokenizer_id=tokenizer_id, corpus_key=key,
                                    shard_tokens=shard_tokens, limit_tokens=limit_tokens, resume=point,
                                    progress=bar.update, log=bar.write if progress else None)
        finally:
            bar.close()
        return cls.open(out, expected_tokenizer_id=tokenizer_id)

    @classmethod
    def open(cls, path: str | os.PathLike, expected_tokenizer_id: str | None = None, *, verify: bool = True,
             verify_cache: str | os.PathLike | None = None, verify_threads: int = 0) -> "SuffixArrayDatastore":
        """Memory-map a datastore directory (or one shard file) and check it before it serves.

        verify: read every byte once (shards.verify_shards: checksums, suffix-array entries and tokens in range;
        cheap with a warm page cache, plus loading the compiled checks once per process), remembered by file
        identity in verify_cache (a JSON file; None = verify every time). verify=False: the structural check only
        (sizes and a few values): a store with garbage content would then serve garbage drafts (the kernels still
        refuse out-of-range reads).
        """
        shards, _ = shards_mod.open_shards(path, expected_tokenizer_id)
        ds = cls(shards, Path(path).expanduser())
        if verify:
            ds.verification = shards_mod.verify_shards(shards, threads=verify_threads, cache=verify_cache)
        return ds

    @classmethod
    def from_documents(cls, docs: Iterable[np.ndarray], *, vocab_size: int,
                       tokenizer_id: str) -> "SuffixArrayDatastore":
        """An in-memory datastore of one shard (tests, small delta stores)."""
        return cls([Shard.from_documents(list(docs), vocab_size=vocab_size, tokenizer_id=tokenizer_id)])

    def set_extra(self, shards: Sequence[Shard]) -> None:
        """Search `shards` next to the datastore's own shards from now on, replacing the previous extras.

        For online learning: compacted shards of learned outputs plus a small in-memory delta shard
        (Shard.from_documents), rebuilt and swapped in periodically. In-flight drafts finish on the shard
        set they started with.
        """
        for shard in shards:
            if (shard.header["tokenizer_id"], shard.vocab_size) != (self.tokenizer_id, self.vocab_size):
                raise TokenizerMismatch(
                    f"shard tokenizer {shard.header['tokenizer_id']!r} (vocab {shard.vocab_size}) does not match "
                    f"the datastore's {self.tokenizer_id!r} (vocab {self.vocab_size})")
        with self._lock:
            self._set_shards(list(self._base) + list(shards))

    def set_delta(self, shard: Shard | None) -> None:
        """One extra shard (or None to remove the extras); see set_extra."""
        self.set_extra([shard] if shard is not None else [])

    # -- properties ------------------------------------------------------------------------------------------------

    @property
    def shards(self) -> tuple[Shard, ...]:
        return self._state[0]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def vocab_size(self) -> int:
        return self._base[0].vocab_size

    @property
    def tokenizer_id(self) -> str:
        return self._base[0].header["tokenizer_id"]

    @property
    def bytes_on_disk(self) -> int:
        total = sum(s.path.stat().st_size for s in self.shards if s.path is not None)
        if self.path is not None and (self.path / shards_mod.MANIFEST).exists():
            total += (self.path / shards_mod.MANIFEST).stat().st_size
        return total

    def __repr__(self) -> str:
        return (f"SuffixArrayDatastore(path={str(self.path)!r}, tokens={self.num_tokens:,}, "
                f"documents={self.num_documents:,}, shards={self.num_shards}, tokenizer={self.tokenizer_id!r})")

    # -- drafting --------------------------------------------------------------------------------------------------

    def _args(self, max_suffix, min_suffix, max_matches, continuation, max_nodes, source, context_min_suffix,
              context_max_matches, context_continuation, weights, sampling) -> tuple:
        check_draft_args(max_suffix, min_suffix, max_matches, continuation, max_nodes)
        check_draft_args(max_suffix, min(context_min_suffix, max_suffix), context_max_matches, context_continuation,
                         max_nodes, prefix="context_")
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {SAMPLING}, got {sampling!r}")
        ds_w, ctx_w = weights
        if not (ds_w >= 0 and ctx_w >= 0 and ds_w + ctx_w > 0):
            raise ValueError(f"merge weights must be >= 0 and not both 0, got {weights!r}")
        return (max_suffix, min_suffix, max_matches, continuation, max_nodes, source == "merged", float(ds_w),
                float(ctx_w), min(context_min_suffix, max_suffix), context_max_matches, context_continuation,
                sampling == "first")

    def _context(self, context_ids) -> np.ndarray:
        ctx = as_context(context_ids)
        if ctx.size and int(ctx.max()) >= self.vocab_size:
            raise ValueError(f"context_ids hold token id {int(ctx.max())} >= vocab_size {self.vocab_size}")
        return ctx

    def draft(self, context_ids, max_suffix: int = 16, min_suffix: int = 2, max_matches: int = 5000,
              continuation: int = 10, max_nodes: int = 64, source: str = "datastore", *,
              context_min_suffix: int = CONTEXT_MIN_SUFFIX, context_max_matches: int = CONTEXT_MAX_MATCHES,
              context_continuation: int = CONTEXT_CONTINUATION, weights: tuple[float, float] = MERGE_WEIGHTS,
              sampling: str = "even") -> DraftTree:
        """Draft tree for one context (int [T]); source "datastore" (REST), "context" or "merged".

        The context_* knobs shape the request's own rows ("merged" and "context"); max_suffix, min_suffix,
        max_matches and continuation shape the datastore's. "context" alone uses `continuation` (as
        context_draft does); "merged" reads context_continuation tokens after each in-context match.
        """
        ctx = self._context(context_ids)
        if source == "context":
            return context_draft(ctx, max_suffix, context_min_suffix, context_max_matches, continuation, max_nodes)
        args = self._args(max_suffix, min_suffix, max_matches, continuation, max_nodes, source, context_min_suffix,
                          context_max_matches, context_continuation, weights, sampling)
        shards, toks, sas, buckets, n_shards, n_base, sep = self._state
        self._check_files(shards, before=True)
        try:
            tok, par, score, src_p, length, m, ctx_len = draft_kernel(toks, sas, buckets, n_shards, n_base, sep,
                                                                      ctx, *args)
        except IndexError as e:  # a bounds check in the kernels: bad data, never a wild read
            self._check_files(shards)
            raise _corrupted(shards, e) from None
        self._check_files(shards)
        return DraftTree(tok, par, score, matched_suffix=int(length), num_matches=int(m),
                         context_matched_suffix=int(ctx_len), source_p=src_p)

    def draft_batch(self, contexts: Sequence, max_suffix: int = 16, min_suffix: int = 2, max_matches: int = 5000,
                    continuation: int = 10, max_nodes: int = 64, source: str = "datastore", *, threads: int = 2,
                    context_min_suffix: int = CONTEXT_MIN_SUFFIX, context_max_matches: int = CONTEXT_MAX_MATCHES,
                    context_continuation: int = CONTEXT_CONTINUATION, weights: tuple[float, float] = MERGE_WEIGHTS,
                    sampling: str = "even") -> list[DraftTree]:
        """Drafts for many contexts, split over `threads` threads running GIL-free kernels (one call each)."""
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        ctxs = [self._context(c) for c in contexts]
        if source == "context":
            return [self.draft(c, max_suffix, min_suffix, max_matches, continuation, max_nodes, source,
                               context_min_suffix=context_min_suffix, context_max_matches=context_max_matches)
                    for c in ctxs]
        args = self._args(max_suffix, min_suffix, max_matches, continuation, max_nodes, source, context_min_suffix,
                          context_max_matches, context_continuation, weights, sampling)
        b = len(ctxs)
        if b == 0:
            return []
        starts = np.zeros(b + 1, np.int64)
        np.cumsum([c.shape[0] for c in ctxs], out=starts[1:])
        flat = np.concatenate(ctxs) if starts[-1] else np.zeros(0, np.int32)
        width = max(max_nodes, 1)
        out_tok = np.zeros((b, width), np.int32)
        out_par = np.zeros((b, width), np.int32)
        out_score = np.zeros((b, width), np.float32)
        out_p = np.zeros((b, width, N_SOURCES), np.float32)
        out_meta = np.zeros((b, 4), np.int64)
        shards, toks, sas, buckets, n_shards, n_base, sep = self._state
        self._check_files(shards, before=True)

        def run(lo: int, hi: int) -> None:
            draft_packed(toks, sas, buckets, n_shards, n_base, sep, flat, starts, lo, hi, *args,
                         out_tok, out_par, out_score, out_p, out_meta)

        n_threads = min(threads, b)
        bounds = [b * i // n_threads for i in range(n_threads + 1)]
        try:
            if n_threads == 1:
                run(0, b)
            else:
                pool = self._executor(threads)
                futures = [pool.submit(run, bounds[i], bounds[i + 1]) for i in range(1, n_threads)]
                try:
                    run(bounds[0], bounds[1])  # the calling thread takes the first chunk
                finally:
                    for f in futures:
                        f.exception()  # every chunk ended before the arrays go out of scope
                for f in futures:
                    f.result()
        except IndexError as e:
            self._check_files(shards)
            raise _corrupted(shards, e) from None
        self._check_files(shards)
        return [DraftTree(out_tok[i, : out_meta[i, 0]], out_par[i, : out_meta[i, 0]], out_score[i, : out_meta[i, 0]],
                          matched_suffix=int(out_meta[i, 1]), num_matches=int(out_meta[i, 2]),
                          context_matched_suffix=int(out_meta[i, 3]), source_p=out_p[i, : out_meta[i, 0]])
                for i in range(b)]

    def _check_files(self, shards: Sequence[Shard], before: bool = False) -> None:
        """Raise DatastoreCorrupted if a shard file changed under the server (map_guard: truncated while mapped,
        or its size / modification time differ from those at open). After a kernel this discards its result;
        once seen, every later draft fails at once (before=True: no per-file check, the kernel runs next)."""
        changed = self._changed
        if changed is None and not before:
            for shard in shards:
                what = shard.guard.change() if shard.guard is not None else None
                if what is not None:
                    changed = DatastoreCorrupted(
                        f"datastore file {shard.name} {what}; drafting from it stopped: restore the file and restart "
                        f"the server (replace store files by renaming a new file over them, never in place)",
                        [shard.path])
                    with self._lock:
                        self._changed = self._changed or changed
                    break
        if changed is not None:
            raise DatastoreCorrupted(str(changed), changed.paths)

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        # threads - 1 helpers: the calling thread drafts a chunk itself.
        with self._lock:
            if self._pool is None or self._pool_size < threads - 1:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool_size = threads - 1
                self._pool = ThreadPoolExecutor(max_workers=self._pool_size, thread_name_prefix="draft")
            return self._pool

    def warmup(self) -> None:
        """Load (or compile) every kernel the server uses, on a tiny context; call before reporting SERVING."""
        shard = self.shards[0]
        n = min(shard.num_tokens, 64)
        ctx = np.asarray(shard.tokens[: n + 1], np.int64)
        ctx = ctx[ctx < self.vocab_size][:32]
        if ctx.size == 0:
            ctx = np.zeros(4, np.int64)
        for source in ("datastore", "merged"):
            self.draft(ctx, source=source)
            self.draft_batch([ctx, ctx], source=source)
        context_draft(ctx)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _corrupted(shards: Sequence[Shard], e: IndexError) -> DatastoreCorrupted:
    """The kernels' IndexError(what, value, bound) as an error naming the shard file(s) (one of them is bad)."""
    what, *values = e.args or ("index out of range",)
    files = ", ".join(s.name for s in shards)
    return DatastoreCorrupted(f"{files} is corrupted: {what} ({', '.join(map(str, values))}); rebuild or restore "
                              f"the datastore", [s.path for s in shards])


def shard_tuple(shards: Sequence[Shard], field: str) -> tuple[np.ndarray, ...]:
    """One array of every shard (its `field`: tokens, sa, bucket) as the kernels take them: read-only, the tuple
    padded with empty arrays to the next of SHARD_SLOTS (a tuple's length is part of its numba type)."""
    n = len(shards)
    slots = next((k for k in SHARD_SLOTS if k >= n), None)
    if slots is None:
        raise DatastoreError(f"{n} shards exceed the supported {SHARD_SLOTS[-1]}; rebuild with larger shards")
    arrays = [_readonly(getattr(s, field)) for s in shards]
    return tuple(arrays) + (arrays[0][:0],) * (slots - n)


def _readonly(a: np.ndarray) -> np.ndarray:
    # In-memory shards must have the same numba type as memory-mapped (read-only) ones: one compiled kernel.
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


# ----------------------------------------------------------------------------------------------------------------
# Checks


def verify_datastore(path: str | os.PathLike, expected_tokenizer_id: str | None = None,
                     cache: str | os.PathLike | None = None) -> list[tuple[Path, str]]:
    """Full content verification of every shard (shards.verify_shards). DatastoreError naming the file."""
    shards, _ = shards_mod.open_shards(path, expected_tokenizer_id)
    return shards_mod.verify_shards(shards, cache=cache)


def check_datastore(path_or_datastore) -> dict:
    """Every invariant: structure, checksums, tokens in vocab, separators, buckets, suffix array sorted.

    Accepts a path or an open SuffixArrayDatastore (in-memory shards included). Returns a summary dict;
    raises DatastoreError listing the violations.
    """
    if isinstance(path_or_datastore, SuffixArrayDatastore):
        shard_list = list(path_or_datastore.shards)
    else:
        shard_list, _ = shards_mod.open_shards(path_or_datastore)
    for s in shard_list:
        shards_mod.check_shard(s)
    return {"num_shards": len(shard_list), "num_tokens": sum(s.num_tokens for s in shard_list),
            "num_documents": sum(s.num_documents for s in shard_list)}
