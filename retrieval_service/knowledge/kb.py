"""The knowledge base: passages + the three retrievers (EDR exact dense, ADR HNSW, SR BM25) + named vector
indexes, behind one typed API that validates its inputs (the gRPC servicer is a thin shell over it).

    kb = KnowledgeBase.open("~/.cache/ragserve/kb/docs", RetrievalConfig())
    res = kb.search("edr", 10, texts=["how do I parse json"])     # one batched encode + one faiss call
    res.hits[0].ids, res.hits[0].scores                           # int64 [n], float32 [n], best first
    kb.score_candidates("sr", res.hits[0].ids, text="how do I parse json").order

Errors: `KBInputError` (bad request field; message starts with the field name) -> INVALID_ARGUMENT,
`RetrieverUnavailable` (index absent or not loaded) -> UNAVAILABLE, `SearchStopped` (the caller gave up between
two chunks of a batch) -> DEADLINE_EXCEEDED / CANCELLED, `KBOpenError` from open() for a missing or corrupted KB.

Size is checked before work: queries x k is bounded (`max_results`), and so is the reply a Search could need
(`reply_bytes`, against the gRPC message limit). A batch is searched in chunks of SEARCH_CHUNK queries, so a
cancelled or expired call stops within one chunk and memory stays bounded; batches up to SEARCH_CHUNK run as
one chunk, exactly as before.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ragcore.errors import Cancelled, DataLoss, InvalidArgument, Unavailable
from ragcore.wire import clip
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore import container
from retrieval_service.datastore.map_guard import MappedFile
from retrieval_service.knowledge import dense, kb_files, sparse
from retrieval_service.knowledge.passages import PassageStore, fingerprint

log = logging.getLogger(__name__)

MANIFEST = "kb.json"
DENSE_DIR = "dense"
SPARSE_DIR = "sparse"
RETRIEVERS = ("edr", "adr", "sr")
KB_INDEX = "kb"
SEARCH_CHUNK = 64  # queries per encode + index search step (the re-scoring gathers chunk x (k + 16) x dim floats)
# Encoder tokens per step of a text batch (two full-length queries): the deadline is checked and the encoder's lock
# released this often, so a batch of long texts stops soon after its caller left.
CHUNK_TOKENS = 512
# Text Searches of at most this many encoder tokens (by the characters-based bound, see express_tokens) take the
# express lane: the service runs them on a thread and an encoder of their own, never behind a large batch.
EXPRESS_TOKENS = 256


class KBInputError(InvalidArgument):
    """A request field is invalid (`field` names it)."""


class RetrieverUnavailable(Unavailable, LookupError):
    """The retriever or index asked for is not loaded on this server."""


class KBOpenError(RuntimeError):
    """The knowledge base directory is missing, incomplete or corrupted."""


class KBFileChanged(DataLoss):
    """A memory-mapped KB file changed under the server (map_guard); the message names it relative to the KB."""


class SearchStopped(Cancelled):
    """should_stop() said the caller is gone (cancelled, deadline passed) before the batch was done."""


@dataclass
class Hits:
    ids: np.ndarray              # int64 [n], best first
    scores: np.ndarray           # float32 [n]


@dataclass
class SearchResult:
    hits: list[Hits]             # one per query
    query_vectors: np.ndarray | None  # [B, D] float32 when the queries were encoded (or given) as vectors
    encode_ms: float = 0.0
    search_ms: float = 0.0


@dataclass
class CandidateScores:
    scores: np.ndarray           # float32 [n], aligned with the given ids
    order: np.ndarray            # int32 [n], positions best first (ties: smaller id; BM25: unmatched last)
    matched: np.ndarray          # bool [n]; False only for BM25 docs without a query term
    query_vector: np.ndarray | None = None
    encode_ms: float = 0.0
    score_ms: float = 0.0


@dataclass
class KBLimits:
    max_batch: int = 1024
    max_k: int = 1000
    max_ids: int = 10_000
    max_query_chars: int = 10_000
    max_results: int = 65_536  # queries x k per Search
    max_search_chars: int = 262_144  # characters of all text queries of one Search
    max_encode_tokens: int = 8_192  # tokens the encoder runs for one Search
    max_reply_bytes: int = 64 << 20  # the gRPC message limit replies must fit

    @classmethod
    def from_config(cls, cfg: RetrievalConfig) -> "KBLimits":
        return cls(max_batch=cfg.limit_batch, max_k=cfg.kb_limit_k, max_ids=cfg.kb_limit_ids,
                   max_query_chars=cfg.kb_limit_query_chars, max_results=cfg.kb_limit_results,
                   max_search_chars=cfg.kb_limit_search_chars, max_encode_tokens=cfg.kb_limit_encode_tokens,
                   max_reply_bytes=cfg.max_message_bytes)


def _token_steps(tokens: np.ndarray | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """Split queries [lo, hi) into consecutive steps of at most CHUNK_TOKENS encoder tokens (one query alone may
    exceed it). tokens None: one step."""
    if tokens is None:
        return [(lo, hi)]
    steps, start, used = [], lo, 0
    for i in range(lo, hi):
        t = int(tokens[i])
        if i > start and used + t > CHUNK_TOKENS:
            steps.append((start, i))
            start, used = i, 0
        used += t
    steps.append((start, hi))
    return steps


def _mmap_of(a) -> "mmap.mmap | None":  # noqa: F821
    """The mmap under a (view of a) numpy memmap, or None for an array in memory."""
    while a is not None:
        mm = getattr(a, "_mmap", None)
        if mm is not None:
            return mm
        a = getattr(a, "base", None)
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _which(cfg_value: str) -> set[str]:
    wanted = {r.strip() for r in cfg_value.split(",") if r.strip()} if cfg_value else set(RETRIEVERS)
    bad = wanted - set(RETRIEVERS)
    if bad:
        raise ValueError(f"kb_retrievers: {sorted(bad)} not in {RETRIEVERS}")
    return wanted


class _NoPassages:
    """The passage store of a vectors-only KB: empty (doc-id lookups fail validation before reaching it)."""

    def __len__(self) -> int:
        return 0

    def get(self, ids) -> list[tuple[str, str]]:
        return []

    def close(self) -> None:
        pass


@dataclass
class KnowledgeBase:
    path: Path
    passages: PassageStore
    manifest: dict
    limits: KBLimits
    vector_indexes: dict[str, dense.VectorIndex] = field(default_factory=dict)
    bm25: sparse.BM25Index | None = None
    encoder: dense.Encoder | None = None
    # A second copy of the encoder for the express lane (small Searches; see express_tokens), so they never wait
    # for a large batch's encode. Loaded by add_express_encoder (the service does it before SERVING).
    express_encoder: dense.Encoder | None = None
    open_s: dict = field(default_factory=dict)
    warmup_s: float = 10.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _guards: list = field(default_factory=list, repr=False)  # MappedFile of each memory-mapped KB file
    _changed: str | None = field(default=None, repr=False)

    # ------------------------------------------------------------------------------------------- open

    @classmethod
    def open(cls, path: str | Path, config: RetrievalConfig | None = None, *, warmup: bool = True,
             encoder: dense.Encoder | None = None) -> "KnowledgeBase":
        """Load passages and every built index (those named in config.kb_retrievers, default all), check
        they belong together, and warm them up. Raises KBOpenError naming what is missing or corrupted."""
        cfg = config or RetrievalConfig()
        path = Path(path).expanduser()
        wanted = _which(cfg.kb_retrievers)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise KBOpenError(f"knowledge base {path}: no {MANIFEST} (build it with "
                              f"`python -m retrieval_service.knowledge.build --out {path}`)")
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest.get(kb_files.MANIFEST_KEY)
            if cfg.kb_verify and files:  # every file before any is read: checksums, finite embeddings
                t0 = time.perf_counter()
                states = [state for _, state in kb_files.verify(path, files, container.cache_path(cfg.verify_cache))]
                log.info("knowledge base %s: %d file(s) verified, %d unchanged since verified (%.2f s)", path,
                         states.count("verified"), states.count("cached"), time.perf_counter() - t0)
            elif cfg.kb_verify:
                log.warning("knowledge base %s has no file checksums (built by an older version): only "
                            "passages.jsonl is checked; rerun its build command to add them", path)
            store = PassageStore(path)
        except (OSError, ValueError) as e:
            raise KBOpenError(f"knowledge base {path}: {e}") from None
        n = len(store)
        if manifest.get("passages") != n:
            raise KBOpenError(f"knowledge base {path}: manifest says {manifest.get('passages')} passages, "
                              f"passages file has {n}; rebuild")
        fp = manifest.get("fingerprint", "")
        if cfg.kb_verify and not files and fingerprint(path / "passages.jsonl") != fp:
            raise KBOpenError(f"knowledge base {path}: passages.jsonl does not match the manifest fingerprint")
        kb = cls(path=path, passages=store, manifest=manifest, limits=KBLimits.from_config(cfg),
                 warmup_s=cfg.kb_warmup_s)
        built = set(manifest.get("retrievers", []))
        dense.configure_faiss(cfg.kb_omp_threads)
        try:
            if wanted & built & {"edr", "adr"}:
                t0 = time.perf_counter()
                vi = dense.open_kb_vectors(path / DENSE_DIR, fingerprint=fp, n=n,
                                           load_exact="edr" in wanted & built, load_approx="adr" in wanted & built,
                                           ef_search=cfg.kb_ef_search, rescore_margin=cfg.kb_rescore_margin,
                                           fp16=cfg.kb_fp16_scan, scan_threads=cfg.kb_scan_threads,
                                           scan_bounds=cfg.kb_scan_bounds)
                kb.vector_indexes[KB_INDEX] = vi
                kb.encoder = encoder or dense.Encoder(threads=cfg.kb_omp_threads, cache_size=cfg.kb_query_cache,
                                                      dtype=vi.info["encoder_dtype"])
                if kb.encoder.dtype != vi.info["encoder_dtype"]:
                    raise ValueError(f"encoder dtype {kb.encoder.dtype} != {vi.info['encoder_dtype']} used for the "
                                     "passages (queries must be encoded the same way)")
                if kb.encoder.dim != vi.dim:
                    raise ValueError(f"encoder dimension {kb.encoder.dim} != KB embeddings dimension {vi.dim}")
                kb.open_s["dense"] = time.perf_counter() - t0
            if "sr" in wanted & built:
                t0 = time.perf_counter()
                kb.bm25 = sparse.BM25Index(path / SPARSE_DIR, fingerprint=fp, n=n, threads=cfg.kb_threads,
                                           heap=cfg.kb_jvm_heap)
                kb.open_s["sparse"] = time.perf_counter() - t0
        except (OSError, ValueError, RuntimeError) as e:
            kb.close()
            raise KBOpenError(f"knowledge base {path}: {e}") from None
        kb.check()
        kb._watch_files()
        if warmup:
            kb.warmup()
        return kb

    def _watch_files(self) -> None:
        """Watch the memory-mapped files (passages, embeddings) for changes under the server (map_guard): a
        truncation then reads zeros instead of ending the process, and the calls answer DATA_LOSS."""
        if self.passages._mm is not None:
            self._guards.append(MappedFile(self.passages._file.fileno(), self.passages._mm,
                                           self.path / "passages.jsonl", "passages.jsonl"))
        vi = self.vector_indexes.get(KB_INDEX)
        mm = _mmap_of(vi.vectors) if vi is not None else None
        if mm is not None:
            path = self.path / DENSE_DIR / dense.EMBEDDINGS_FILE
            with open(path, "rb") as f:
                self._guards.append(MappedFile(f.fileno(), mm, path, f"{DENSE_DIR}/{dense.EMBEDDINGS_FILE}"))

    def check_files(self) -> None:
        """KBFileChanged if a watched file changed since open; after a call it discards the call's result, and
        every later call fails at once (restart the server once the files are restored)."""
        if self._changed is None:
            for guard in self._guards:
                what = guard.change()
                if what is not None:
                    log.error("knowledge base file %s %s; calls answer DATA_LOSS until a restart", guard.path, what)
                    self._changed = (f"knowledge base file {guard.name} {what}; restore it and restart the server "
                                     f"(replace KB files by renaming new ones over them, never in place)")
                    break
        if self._changed is not None:
            raise KBFileChanged(self._changed)

    @classmethod
    def vectors_only(cls, config: RetrievalConfig | None = None) -> "KnowledgeBase":
        """A KB without passages that serves named vector indexes only (e.g. a kNN-LM datastore, no --kb)."""
        cfg = config or RetrievalConfig()
        dense.configure_faiss(cfg.kb_omp_threads)
        return cls(path=Path(""), passages=_NoPassages(), manifest={}, limits=KBLimits.from_config(cfg),
                   warmup_s=cfg.kb_warmup_s)

    def add_vector_index(self, index: dense.VectorIndex) -> None:
        """Register another named vector index (e.g. kNN-LM keys); searched with retriever edr/adr + index name."""
        if not index.name or index.name == KB_INDEX:
            raise ValueError(f"vector index name {index.name!r} is empty or reserved")
        with self._lock:
            self.vector_indexes = {**self.vector_indexes, index.name: index}

    def warmup(self) -> None:
        t0 = time.perf_counter()
        if self.encoder is not None:
            self.encoder.encode(["warm up the encoder", "a second query"] * 4)
        for vi in self.vector_indexes.values():
            vi.warmup()
        if self.bm25 is not None:
            self.bm25.warmup(seconds=self.warmup_s)
        if len(self.passages):
            self.passages.get([0, len(self.passages) - 1])
        self.open_s["warmup"] = time.perf_counter() - t0

    def check(self) -> None:
        """Invariant checker: every loaded index covers exactly the passages of this KB."""
        n = len(self.passages)
        vi = self.vector_indexes.get(KB_INDEX)
        if vi is not None and vi.size != n:
            raise KBOpenError(f"dense index has {vi.size} vectors for {n} passages")
        if self.bm25 is not None and self.bm25.n != n:
            raise KBOpenError(f"Lucene index has {self.bm25.n} docs for {n} passages")
        if n:
            rec = self.passages.record(n - 1)
            if rec.get("id") != n - 1:
                raise KBOpenError(f"passage row {n - 1} carries id {rec.get('id')}")

    def close(self) -> None:
        if self.bm25 is not None:
            self.bm25.close()
        self.passages.close()

    # ------------------------------------------------------------------------------------------ queries

    @property
    def retrievers(self) -> list[str]:
        vi = self.vector_indexes.get(KB_INDEX)
        out = list(vi.retrievers) if vi is not None else []
        return out + (["sr"] if self.bm25 is not None else [])

    def serves(self, retriever: str, index: str) -> bool:
        """Would a dense Search with this retriever on this index run (not fail on the retriever or index)?"""
        vi = self.vector_indexes.get(index or KB_INDEX)
        return vi is not None and retriever in vi.retrievers

    def _vector_index(self, retriever: str, index: str) -> dense.VectorIndex:
        name = index or KB_INDEX
        vi = self.vector_indexes.get(name)
        if vi is None:
            if name == KB_INDEX:
                raise RetrieverUnavailable(f"retriever {clip(retriever)}: this server has no dense KB index")
            raise KBInputError("index", f"unknown vector index {clip(name)} (known: {sorted(self.vector_indexes)})")
        if retriever not in vi.retrievers:
            raise RetrieverUnavailable(f"retriever {clip(retriever)}: index {clip(name)} has no "
                                       f"{'exact' if retriever == 'edr' else 'HNSW'} index loaded")
        return vi

    def _check_retriever(self, retriever: str, index: str) -> None:
        if retriever not in RETRIEVERS:
            raise KBInputError("retriever", f"{clip(retriever)} is not one of {', '.join(RETRIEVERS)}")
        if retriever == "sr":
            if index:  # the proto: "Must be "" for sr" (not even "kb": one spelling, one meaning)
                raise KBInputError("index", f"must be empty for retriever 'sr' (BM25 searches the KB passages only), "
                                   f"got {clip(index)}")
            if self.bm25 is None:
                raise RetrieverUnavailable("retriever 'sr': this server has no BM25 (Lucene) index")

    def _check_texts(self, texts: Sequence[str], field: str, single: bool = False) -> None:
        """single: `field` is one string (ScoreCandidates.text), not a repeated field: no [i] in messages."""
        for i, t in enumerate(texts):
            where = field if single else f"{field}[{i}]"
            if len(t) > self.limits.max_query_chars:
                raise KBInputError(f"{where}", f"{len(t)} characters exceeds the limit of {self.limits.max_query_chars}")
            if not t.strip():
                raise KBInputError(f"{where}", "query text is empty")

    def _check_vectors(self, vectors: np.ndarray, dim: int, field: str) -> np.ndarray:
        v = np.asarray(vectors, dtype=np.float32)
        if v.ndim == 1:
            v = v[None, :]
        if v.ndim != 2 or v.shape[1] != dim:
            raise KBInputError(f"{field}", f"vectors of dimension {v.shape[-1] if v.ndim else 0} for an index of "
                               f"dimension {dim}")
        if not np.all(np.isfinite(v)):
            raise KBInputError(f"{field}", "values must be finite (found NaN or inf)")
        return np.ascontiguousarray(v)

    def query_dim(self, retriever: str, index: str = "") -> int:
        """Dimension of vector queries for (retriever, index); raises for sr or an unknown/absent index."""
        self._check_retriever(retriever, index)
        if retriever == "sr":
            raise KBInputError("vectors", "retriever 'sr' (BM25) takes text queries only")
        return self._vector_index(retriever, index).dim

    def stored_dim(self, index: str = "", field: str = "with_vectors") -> int:
        """Dimension of the stored vectors GetDocuments/with_vectors return for `index` ("" = KB)."""
        vi = self.vector_indexes.get(index or KB_INDEX)
        if vi is None:
            if index and index != KB_INDEX:
                raise KBInputError("index", f"unknown vector index {clip(index)} (known: {sorted(self.vector_indexes)})")
            raise RetrieverUnavailable(f"{field}: vectors asked for, but this server has no dense KB index")
        return vi.dim

    def check_ids(self, ids: np.ndarray, field: str, size: int | None = None) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        size = len(self.passages) if size is None else size
        if ids.ndim != 1 or ids.size == 0:
            raise KBInputError(f"{field}", "must hold at least one doc id")
        if ids.size > self.limits.max_ids:
            raise KBInputError(f"{field}", f"{ids.size} ids exceeds the limit of {self.limits.max_ids}")
        bad = (ids < 0) | (ids >= size)
        if bad.any():
            j = int(np.argmax(bad))
            raise KBInputError(f"{field}[{j}]", f"unknown doc id {int(ids[j])} (valid ids are 0..{size - 1})")
        return ids

    def reply_bytes(self, batch: int, k: int, *, index: str = "", with_text: bool = False,
                    with_vectors: bool = False, with_query_vectors: bool = False) -> int:
        """Upper bound on the serialized SearchResponse of `batch` queries x k hits (before any work)."""
        hits = batch * min(k, max(len(self.passages), self._index_size(index)))
        per_hit = 8 + 4 + 4  # id, score, protobuf framing
        if with_vectors:
            per_hit += 4 * self._index_dim(index)
        if with_text:
            per_hit += self.passages.max_record_bytes + 24  # title + text (JSON line bound), Document framing
        return 64 + batch * 16 + hits * per_hit + (batch * 4 * self._index_dim(index) if with_query_vectors else 0)

    def _index_size(self, index: str) -> int:
        vi = self.vector_indexes.get(index or KB_INDEX)
        return vi.size if vi is not None else 0

    def _index_dim(self, index: str) -> int:
        vi = self.vector_indexes.get(index or KB_INDEX)
        return vi.dim if vi is not None else 0

    def check_search_size(self, batch: int, k: int, **reply) -> None:
        """Refuse, before any work, a Search whose result count or reply would be too large (KBInputError)."""
        if batch * k > self.limits.max_results:
            raise KBInputError("k", f"{batch} queries x k {k} = {batch * k} results exceeds the limit of "
                               f"{self.limits.max_results} per call (kb_limit_results); split the batch")
        need = self.reply_bytes(batch, k, **reply)
        if need > self.limits.max_reply_bytes:
            asked = [name for name in ("with_text", "with_vectors", "with_query_vectors") if reply.get(name)]
            raise KBInputError("k", f"{batch} queries x k {k}{' with ' + ', '.join(asked) if asked else ''} could "
                               f"need a {_mib(need)} reply, over the {_mib(self.limits.max_reply_bytes)} message "
                               f"limit (max_message_bytes); ask for fewer queries or hits")

    def add_express_encoder(self, threads: int, cache_size: int) -> None:
        """Load the express lane's own encoder (same model and dtype; ~90 MB), once."""
        with self._lock:
            if self.encoder is not None and self.express_encoder is None:
                self.express_encoder = dense.Encoder(threads=threads, cache_size=cache_size, dtype=self.encoder.dtype)
                self.express_encoder.share_cache(self.encoder)
                self.express_encoder.encode(["warm up the encoder"])

    def express_tokens(self, texts: Sequence[str]) -> int:
        """An upper bound of the encoder tokens of `texts` from their lengths alone (a token spans at least one
        character; each text is cut at the encoder's length): no tokenizing, so the service can pick a lane."""
        cap = self.encoder.max_tokens if self.encoder is not None else 512
        return sum(min(len(t) + 2, cap) for t in texts)

    def _check_text_work(self, texts: Sequence[str], encoder: dense.Encoder | None) -> np.ndarray | None:
        """Refuse a text batch whose work exceeds the per-Search bounds, before any encoding (KBInputError naming
        the limit). -> the encoder tokens of each text (None without an encoder)."""
        chars = sum(len(t) for t in texts)
        if chars > self.limits.max_search_chars:
            raise KBInputError("texts", f"{len(texts)} texts of {chars} characters in all exceed the limit of "
                               f"{self.limits.max_search_chars} characters per Search (kb_limit_search_chars); "
                               f"split the batch")
        if encoder is None:
            return None
        tokens = encoder.count_tokens(texts)
        total = int(tokens.sum())
        if total > self.limits.max_encode_tokens:
            raise KBInputError("texts", f"{len(texts)} texts need {total} encoder tokens, over the limit of "
                               f"{self.limits.max_encode_tokens} per Search (kb_limit_encode_tokens); split the "
                               f"batch or shorten the texts")
        return tokens

    def search(self, retriever: str, k: int, *, texts: Sequence[str] | None = None,
               vectors: np.ndarray | None = None, index: str = "", ef_search: int = 0,
               should_stop: Callable[[], bool] | None = None, express: bool = False) -> SearchResult:
        """One batched search: B text queries (encoded together for edr/adr) or B query vectors [B, D].

        Text batches are bounded in characters and encoder tokens (refused before any work, see KBLimits).
        Batches above SEARCH_CHUNK queries run chunk by chunk, texts are encoded CHUNK_TOKENS at a time;
        should_stop() is asked between those steps and ends the search with SearchStopped (the caller left or
        its deadline passed: the rest would be wasted). express: encode with the express lane's encoder.
        """
        self._check_retriever(retriever, index)
        texts = list(texts or [])
        n_vec = 0 if vectors is None else (1 if np.ndim(vectors) == 1 else len(vectors))
        if texts and n_vec:
            raise KBInputError("texts", "give either texts or vectors, not both")
        batch = len(texts) or n_vec
        if batch == 0:
            raise KBInputError("texts", "empty batch (give at least one text or vector query)")
        if batch > self.limits.max_batch:
            raise KBInputError(f"{'texts' if texts else 'vectors'}", f"batch of {batch} exceeds the limit of "
                               f"{self.limits.max_batch}")
        if not 1 <= k <= self.limits.max_k:
            raise KBInputError("k", f"{k} is outside [1, {self.limits.max_k}]")
        if batch * k > self.limits.max_results:
            self.check_search_size(batch, k, index=index)
        if ef_search < 0 or ef_search > 1 << 16:
            raise KBInputError("ef_search", f"{ef_search} is outside [0, 65536]")
        if texts:
            self._check_texts(texts, "texts")
        encoder = (self.express_encoder if express else None) or self.encoder
        tokens = None
        if texts:
            dense_texts = retriever != "sr" and (index or KB_INDEX) == KB_INDEX
            tokens = self._check_text_work(texts, encoder if dense_texts else None)
        # Even chunks (not 64 + a remainder of 1): every chunk stays on faiss's BLAS path.
        n_chunks = -(-batch // SEARCH_CHUNK)
        bounds = [batch * i // n_chunks for i in range(n_chunks + 1)]

        def stop_check() -> None:
            if should_stop is not None and should_stop():
                raise SearchStopped(f"search stopped after {len(hits)} of {batch} queries: the caller is gone")

        hits: list[tuple[np.ndarray, np.ndarray]] = []
        if retriever == "sr":
            if not texts:
                raise KBInputError("vectors", "retriever 'sr' (BM25) takes text queries only")
            t0 = time.perf_counter()
            for lo, hi in zip(bounds, bounds[1:]):
                stop_check()
                hits += self.bm25.search(texts[lo:hi], k)
            return SearchResult([Hits(i, s) for i, s in hits], None, 0.0, (time.perf_counter() - t0) * 1e3)
        vi = self._vector_index(retriever, index)
        if texts and (vi.name != KB_INDEX or self.encoder is None):
            raise KBInputError("texts", f"index {vi.name!r} takes vector queries only (no text encoder)")
        given = None if texts else self._check_vectors(vectors, vi.dim, "vectors")
        queries = np.empty((batch, vi.dim), np.float32)  # [B, D]
        encode_ms = search_ms = 0.0
        for lo, hi in zip(bounds, bounds[1:]):
            stop_check()
            if texts:
                t0 = time.perf_counter()
                for a, b in _token_steps(tokens, lo, hi):
                    queries[a:b] = encoder.encode_queries(texts[a:b])
                    stop_check()
                encode_ms += (time.perf_counter() - t0) * 1e3
            else:
                queries[lo:hi] = given[lo:hi]
            t0 = time.perf_counter()
            hits += vi.search(queries[lo:hi], k, approx=retriever == "adr", ef_search=ef_search)
            search_ms += (time.perf_counter() - t0) * 1e3
        self.check_files()
        return SearchResult([Hits(i, s) for i, s in hits], queries, encode_ms, search_ms)

    def score_candidates(self, retriever: str, ids: np.ndarray, *, text: str = "",
                         vector: np.ndarray | None = None, index: str = "") -> CandidateScores:
        """Score the given docs for one query with exactly the scores `search` gives them."""
        self._check_retriever(retriever, index)
        has_vec = vector is not None and np.size(vector) > 0
        if bool(text) == has_vec:
            raise KBInputError("text", "give exactly one of text or vector")
        if text:
            self._check_texts([text], "text", single=True)
        if retriever == "sr":
            if has_vec:
                raise KBInputError("vector", "retriever 'sr' (BM25) takes a text query only")
            ids = self.check_ids(ids, "ids")
            t0 = time.perf_counter()
            scores, rank = self.bm25.score(text, ids)
            ms = (time.perf_counter() - t0) * 1e3
            # Lucene's own order (raw BM25, then id), not a re-sort of the rounded scores.
            order = np.lexsort((ids, rank)).astype(np.int32)
            return CandidateScores(scores, order, rank < len(ids), None, 0.0, ms)
        vi = self._vector_index(retriever, index)
        ids = self.check_ids(ids, "ids", vi.size)
        encode_ms = 0.0
        if text:
            if vi.name != KB_INDEX or self.encoder is None:
                raise KBInputError("text", f"index {vi.name!r} takes vector queries only (no text encoder)")
            t0 = time.perf_counter()
            q = self.encoder.encode_queries([text])[0]
            encode_ms = (time.perf_counter() - t0) * 1e3
        else:
            q = self._check_vectors(vector, vi.dim, "vector")
            if len(q) != 1:
                raise KBInputError("vector", f"{len(q)} vectors given, ScoreCandidates takes one query")
            q = q[0]
        t0 = time.perf_counter()
        try:
            scores = vi.score(q, ids)
        except LookupError as e:
            raise RetrieverUnavailable(str(e)) from None
        ms = (time.perf_counter() - t0) * 1e3
        matched = np.ones(len(ids), dtype=bool)
        self.check_files()
        return CandidateScores(scores, dense.rank_order(scores, ids), matched, q, encode_ms, ms)

    def documents(self, ids: np.ndarray, field: str = "ids") -> list[tuple[int, str, str]]:
        ids = self.check_ids(ids, field)
        try:
            docs = self.passages.get(ids)
        except DataLoss:  # bytes that do not parse: say first if the file changed under the server
            self.check_files()
            raise
        self.check_files()
        return [(int(i), t, x) for i, (t, x) in zip(ids, docs)]

    def passage_vectors(self, ids: np.ndarray, field: str = "ids", index: str = "") -> np.ndarray:
        """ids: [n] -> stored vectors [n, D] float32 of the KB embeddings (or of a named vector index)."""
        self.stored_dim(index, field)
        vi = self.vector_indexes[index or KB_INDEX]
        ids = self.check_ids(ids, "ids", vi.size)
        vectors = vi.get_vectors(ids)
        self.check_files()
        return vectors

    def info(self) -> dict:
        """What GetInfo tells clients: names relative to the KB, never a server path."""
        corpus = self.manifest.get("corpus")
        if isinstance(corpus, dict):  # the build's source files, named by their base name only
            corpus = {k: Path(v).name if k in ("path", "embeddings_from") and isinstance(v, str) else v
                      for k, v in corpus.items()}
        return {
            "path": self.path.name,
            "passages": len(self.passages),
            "retrievers": self.retrievers,
            "encoder": self.encoder.name if self.encoder else "",
            "indexes": [{"name": vi.name, "dim": vi.dim, "metric": vi.metric, "size": vi.size,
                         "retrievers": vi.retrievers, "ef_search": vi.default_ef_search}
                        for vi in self.vector_indexes.values()],
            "manifest": {**self.manifest, "corpus": corpus} if corpus is not None else self.manifest,
        }
