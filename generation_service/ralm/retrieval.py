"""One RAG request's view of the knowledge service: query building, sequential search, speculative ranking of
the local cache, batched verification (sync or as a gRPC future), passage texts as model tokens.

The RaLM loops (generation_service/ralm/loop.py) talk to a `Retriever`; `KBRetriever` is the real one over
KBClient, tests substitute scripted ones. Where dense queries are encoded is a per-request choice that both
loops share, so RaLMSeq and RaLMSpec send the KB the very same query and get the very same top-1:
    server  texts go to the KB, which encodes them (MiniLM) and caches each vector by text; speculation is a
            ScoreCandidates(text) call, so the later verification of that text reuses the cached vector;
    local   the worker encodes the text itself (the KB's encoder, one query per call, so a vector never depends
            on its batch), ranks the cache with local inner products and sends vectors to Search.
BM25 (sr) always sends text and speculates with ScoreCandidates.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from generation_service.augment.kb_client import Hits, KBClient, KBUnavailable, SearchFuture, SearchReply
from generation_service.ralm.cache import PassageCache
from ragcore.encoder import ENCODER_NAME, Encoder

log = logging.getLogger(__name__)

PASSAGE_SEPARATOR = "\n\n"  # between the prepended passage and the prompt
# adr: HNSW's top-1 depends on efSearch, and the KB raises efSearch to k + its re-scoring margin (16). Every adr
# call of a request uses one efSearch above any k we send (prefetch <= 256), so a k=1 RaLMSeq search and a
# k=256 verification walk the same graph beam and agree on the top-1.
ADR_EF_SEARCH = 320
# Hits per query up to which a Search also returns passage texts (~700 bytes each): then neither RaLMSeq's step
# nor a mismatched verification needs a GetDocuments round trip; prefetching 256 would make that 180 KB/query.
_TEXT_K = 32
SPEC_SLACK = 2.0  # a speculative search may take this many times its queries' last measured latency


@dataclass
class Query:
    text: str
    vector: np.ndarray | None = None  # float32 [D] when encoded locally


class Retriever(Protocol):
    """What the RaLM loops need from retrieval. `calls` counts this retriever's KB round trips."""

    dim: int  # > 0: verification hits carry vectors and the cache is ranked locally
    calls: int

    def query(self, window: np.ndarray) -> Query | None:
        """window: int [<= query_tokens] token ids -> the query (None when it decodes to blank text)."""

    def search(self, queries: list[Query], k: int, *, sequential: bool) -> list[Hits]:
        """Blocking batched search; raises KBUnavailable."""

    def search_async(self, queries: list[Query], k: int) -> SearchFuture:
        """Batched search in flight (done() / result())."""

    def speculate(self, query: Query, cache: PassageCache) -> int | None:
        """The cache's top-1 for the query under the retriever's own scoring; raises KBUnavailable."""

    def passage(self, doc: int | None, *, sequential: bool = True) -> list[int]:
        """Model tokens of the passage prepended for `doc` ([] for None); raises KBUnavailable."""

    def has_passage(self, doc: int) -> bool:
        """passage(doc) needs no round trip (its text came with a reply, or it was prepended before)."""

    def remember(self, reply: SearchReply) -> None:
        """Take note of what a (verification) reply carried, e.g. passage texts."""


class LocalEncoder:
    """The KB's query encoder (all-MiniLM-L6-v2) loaded in the worker, shared by requests, loaded on first use."""

    def __init__(self, dtype: str = "float32", cache_size: int = 4096):
        self.dtype, self.cache_size = dtype, cache_size
        self._enc = None
        self._lock = threading.Lock()

    def get(self):
        with self._lock:
            if self._enc is None:
                # threads=0: leave torch's thread count to the model (the encoder runs between model steps).
                self._enc = Encoder(threads=0, cache_size=self.cache_size, dtype=self.dtype)
            return self._enc

    @property
    def dim(self) -> int:
        return self.get().dim

    def encode(self, text: str) -> np.ndarray:
        return self.get().encode_queries([text])[0]  # [D], one query per call: batch-independent

    @staticmethod
    def dtype_of(kb: KBClient) -> str:
        """The encoder dtype the KB's passages were embedded with (kb.json), so local queries match them."""
        info = kb.info()
        if info.encoder and info.encoder != ENCODER_NAME:
            raise KBUnavailable(f"the KB encodes with {info.encoder}; the worker only has {ENCODER_NAME}")
        manifest = json.loads(info.manifest_json or "{}")
        return manifest.get("build", {}).get("edr", {}).get("encoder_dtype", "float32")


def speculative_timeout(n_queries: int, per_query_s: float, configured_s: float, ceiling_s: float,
                        slack: float = SPEC_SLACK) -> float:
    """Deadline of a speculative search of n queries: the configured one, or `slack` times what n queries take at
    the KB's last measured rate when that is longer, never past the sequential calls' own deadline (ceiling_s).
    A KB whose single query takes most of the configured deadline (full-text ranking in a database) would
    otherwise fail every verification of a few queries, and each failure costs the deadline plus the sequential
    redo; a KB that hangs still times out."""
    return max(configured_s, min(ceiling_s, slack * n_queries * per_query_s))


class KBRetriever:
    """The real Retriever over a KBClient (one per request)."""

    def __init__(self, kb: KBClient, retriever: str, tokenizer, passage_budget: int, *,
                 encoder: LocalEncoder | None = None, ef_search: int = 0, deadline: float | None = None,
                 kb_timeout_s: float = 10.0, spec_timeout_s: float = 2.0, spec_slack: float = SPEC_SLACK):
        """passage_budget: max model tokens of a passage incl. the separator; deadline: time.monotonic();
        spec_slack: see speculative_timeout (0: the configured deadline only)."""
        self.kb, self.retriever, self.tok = kb, retriever, tokenizer
        self.encoder = encoder if retriever != "sr" else None
        self.dim = self.encoder.dim if self.encoder is not None else 0
        self.budget = passage_budget
        self.ef = (ef_search or ADR_EF_SEARCH) if retriever == "adr" else 0
        self.deadline = deadline
        self.kb_timeout_s, self.spec_timeout_s, self.spec_slack = kb_timeout_s, spec_timeout_s, spec_slack
        self._sep = list(tokenizer(PASSAGE_SEPARATOR, add_special_tokens=False)["input_ids"])
        self._tokens: dict[int, list[int]] = {}  # doc -> passage tokens, tokenized when first prepended
        self._texts: dict[int, tuple[str, str]] = {}  # doc -> (title, text) a reply carried, not tokenized yet
        # This request's round trips (the KBClient is shared by every request, and their calls run side by side).
        self.calls = 0
        self.per_query_s = 0.0  # the last search's wall time per query (speculative_timeout)
        self.encode_s = 0.0  # local query encoding time (part of R)

    def query(self, window: np.ndarray) -> Query | None:
        text = self.tok.decode([int(t) for t in window], skip_special_tokens=True).strip()
        if not text:
            return None
        if self.encoder is None:
            return Query(text)
        t0 = time.perf_counter()
        vec = self.encoder.encode(text)
        self.encode_s += time.perf_counter() - t0
        return Query(text, vec)

    def _payload(self, queries: list[Query]) -> dict:
        if self.encoder is not None:
            return {"vectors": np.stack([q.vector for q in queries])}  # [B, D]
        return {"texts": [q.text for q in queries]}

    def spec_timeout(self, n_queries: int) -> float:
        return speculative_timeout(n_queries, self.per_query_s, self.spec_timeout_s, self.kb_timeout_s,
                                   self.spec_slack)

    def search(self, queries: list[Query], k: int, *, sequential: bool) -> list[Hits]:
        self.calls += 1
        reply = self.kb.search(self.retriever, k, with_vectors=self.dim > 0, with_text=k <= _TEXT_K,
                               ef_search=self.ef, deadline=self.deadline,
                               timeout_s=self.kb_timeout_s if sequential else self.spec_timeout(len(queries)),
                               **self._payload(queries))
        self.remember(reply)
        return reply.hits

    def search_async(self, queries: list[Query], k: int) -> SearchFuture:
        self.calls += 1
        return self.kb.search_async(self.retriever, k, with_vectors=self.dim > 0, with_text=k <= _TEXT_K, ef_search=self.ef,
                                    deadline=self.deadline, timeout_s=self.spec_timeout(len(queries)),
                                    **self._payload(queries))

    def remember(self, reply: SearchReply) -> None:
        """Keep the passage texts a reply carried (a later mismatch then needs no GetDocuments call). Only
        stored: a verification with prefetch carries 20 texts per query and most are never prepended, so
        tokenizing them here would put their cost on the critical path for nothing."""
        if reply.rpc_s > 0 and reply.hits:
            self.per_query_s = reply.rpc_s / len(reply.hits)
        for h in reply.hits:
            for d in h.documents or ():
                if d.id not in self._tokens:
                    self._texts.setdefault(d.id, (d.title, d.text))

    def speculate(self, query: Query, cache: PassageCache) -> int | None:
        if len(cache) == 0:
            return None
        if self.dim:
            return cache.top1_local(query.vector)
        ids = cache.ids.copy()
        self.calls += 1
        cand = self.kb.score_candidates(self.retriever, ids, text=query.text, deadline=self.deadline,
                                        timeout_s=self.spec_timeout_s)
        return cache.top1_from_order(ids, cand.order, cand.scores, unmatched_zero=self.retriever == "sr")

    def _tokenize(self, title: str, text: str) -> list[int]:
        if self.budget <= len(self._sep):
            return []
        body = f"{title}\n{text}" if title else text
        ids = self.tok(body, add_special_tokens=False)["input_ids"]
        return list(ids[:self.budget - len(self._sep)]) + self._sep

    def has_passage(self, doc: int) -> bool:
        return doc in self._tokens or doc in self._texts

    def passage(self, doc: int | None, *, sequential: bool = True) -> list[int]:
        if doc is None:
            return []
        toks = self._tokens.get(doc)
        if toks is None:
            known = self._texts.pop(doc, None)
            if known is None:
                self.calls += 1
                docs, _ = self.kb.get_documents([doc], deadline=self.deadline,
                                                timeout_s=self.kb_timeout_s if sequential else self.spec_timeout_s)
                known = (docs[0].title, docs[0].text)
            toks = self._tokens[doc] = self._tokenize(*known)
        return toks
