"""The stores the CREST benchmark compares, built once and cached (resumable, written atomically).

    rest_sample(full, 0.04, seed=0, root)   # REST datastore of a random 4 % document sample of `full`
    cached_counts(full, max_n=5, top, root) # n-gram counts of the full corpus (npz, no pickle)
    CrestStores(full, counts, root).combined(budget) / .single(n, budget)   # CREST store files

Samples are nested: one seeded permutation of the corpus's documents, and a fraction f keeps the shortest
prefix of that permutation holding >= f of the tokens. So a larger sample contains every smaller one, as a
growing datastore would (and the curve is not noisier than the sampling itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from retrieval_service.datastore.crest_build import CandidatePool, choose_take, write_from_pool
from retrieval_service.datastore.ngram_count import NgramCounts, count_ngrams
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore


def corpus_key(ds: SuffixArrayDatastore) -> str:
    return ds.shards[0].header.get("corpus_key", "") or str(ds.path)


def dir_bytes(ds: SuffixArrayDatastore) -> int:
    """Bytes on disk of a datastore directory (shards + manifest): what REST has to store."""
    return sum(p.stat().st_size for p in Path(ds.path).iterdir() if p.is_file())


def sample_documents(full: SuffixArrayDatastore, fraction: float, seed: int) -> list[tuple[int, int]]:
    """(shard, document) pairs of the nested random sample holding >= fraction of the tokens, in corpus order."""
    pairs = [(s, i) for s, shard in enumerate(full.shards) for i in range(shard.num_documents)]
    lengths = np.concatenate([np.diff(shard.doc_starts) - 1 for shard in full.shards])
    order = np.random.default_rng(seed).permutation(len(pairs))
    cum = np.cumsum(lengths[order])
    keep = int(np.searchsorted(cum, fraction * cum[-1])) + 1
    return [pairs[j] for j in sorted(order[:keep].tolist())]


def rest_sample(full: SuffixArrayDatastore, fraction: float, seed: int, root: Path) -> SuffixArrayDatastore:
    """The REST datastore of a random document sample (fraction 1 = the full datastore itself)."""
    if fraction >= 1.0:
        return full
    name = f"{Path(full.path).name}-sample-s{seed}-{fraction:g}"
    out = root / "rest" / name
    chosen = sample_documents(full, fraction, seed)
    docs = (full.shards[s].document(i) for s, i in chosen)
    # The key names the source corpus and the sample: a rerun resumes (or finds the finished store).
    key = f"sample:{corpus_key(full)}:seed={seed}:fraction={fraction!r}:docs={len(chosen)}"
    return SuffixArrayDatastore.build(docs, out, vocab_size=full.vocab_size, tokenizer_id=full.tokenizer_id,
                                      resume_key=key, progress=True)


def cached_counts(full: SuffixArrayDatastore, max_n: int, top: int, root: Path) -> NgramCounts:
    """count_ngrams of the full corpus, cached as .npz (plain arrays, allow_pickle=False)."""
    path = root / "counts" / f"{Path(full.path).name}-m{max_n}-top{top}.npz"
    want = json.dumps({"corpus_key": corpus_key(full), "max_n": max_n, "top": top})
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) == want:
                meta = json.loads(str(z["meta"]))
                return NgramCounts(max_n, {n: z[f"ngrams_{n}"] for n in range(1, max_n + 1)},
                                   {n: z[f"counts_{n}"] for n in range(1, max_n + 1)},
                                   {int(k): v for k, v in meta["distinct"].items()},
                                   {int(k): v for k, v in meta["total"].items()}, meta["peak_rss_mb"])
    counts = count_ngrams(full, max_n, top, progress=True)
    arrays = {f"ngrams_{n}": counts.ngrams[n] for n in counts.ngrams}
    arrays.update({f"counts_{n}": counts.counts[n] for n in counts.counts})
    meta = {"distinct": counts.distinct, "total": counts.total, "peak_rss_mb": counts.peak_rss_mb}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, key=np.array(want), meta=np.array(json.dumps(meta)), **arrays)
    os.replace(tmp, path)
    return counts


class CrestStores:
    """CREST stores of given byte budgets from one full datastore; the candidate trees are drafted once (lazily,
    only when a store file is missing) and shared by every store and strategy."""

    def __init__(self, full: SuffixArrayDatastore, counts: NgramCounts, root: Path, threads: int = 2):
        self.full, self.counts, self.threads = full, counts, threads
        self.dir = root / "crest"
        self._pool: CandidatePool | None = None

    @property
    def pool(self) -> CandidatePool:
        if self._pool is None:
            self._pool = CandidatePool(self.full, self.counts, threads=self.threads, progress=True)
        return self._pool

    def _store(self, strategy: str, n: int | None, budget: int) -> tuple[EmbeddedNgramStore, int]:
        label = f"{strategy}-n{n}" if n else strategy
        path = self.dir / f"{Path(self.full.path).name}-m{self.counts.max_n}-{label}-{budget}.crest"
        if not path.exists():
            t, take = choose_take(self.pool, strategy, budget=budget, n=n)
            write_from_pool(self.pool, path, strategy, t, take, n, extra={"budget": budget})
        store = EmbeddedNgramStore.open(path)
        return store, int(store.header["t"])

    def combined(self, budget: int) -> tuple[EmbeddedNgramStore, int]:
        return self._store("combined", None, budget)

    def single(self, n: int, budget: int) -> tuple[EmbeddedNgramStore, int]:
        return self._store("single", n, budget)

    @property
    def draft_seconds(self) -> float:
        return self._pool.draft_seconds if self._pool else 0.0
