"""Fill numba's on-disk cache with every drafting kernel the services run, once, at install time.

The kernels (ragcore/draft_kernels.py, retrieval_service/datastore/*, the draft sizer) are compiled with
cache=True: the first process that calls one with a new argument type compiles it (up to tens of seconds for the
fused draft kernels on 2 cores) and leaves the machine code beside the source. Without this step that process is
a user's first request, or every process of a fresh checkout's test run at once (each worker and each service
it starts compiles the same kernels until one of them has written the cache).

numba caches per signature (dtype, read-only or not, tuple length), so this goes through the services' own code
paths on tiny data rather than naming types: datastores built and memory-mapped as the retrieval service opens
them (uint16 and uint32 tokens; one shard, and base + learned shards), a CREST store built, opened and looked up,
prompt lookup and the draft sizer as a worker warms them up.

    python -m tools.warm_kernels        # make kernels runs it; a second run only loads the cache (~seconds)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from generation_service.drafting.budget import warmup_sizer
from ragcore.draft_tree import warmup_context_draft
from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.ngram_store import EmbeddedNgramStore
from retrieval_service.datastore.shards import Shard
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore, check_datastore

_TID = "kernel-warmup"
# The served model's vocabulary fits uint16 tokens; a larger one (any HF model a user brings) takes uint32.
_VOCABS = (49152, 70000)


def _documents(rng: np.random.Generator, vocab: int, n: int) -> list[np.ndarray]:
    # Repeated phrases, so the suffix-array searches find matches and the drafts have trees to build.
    phrases = [rng.integers(0, vocab, 12) for _ in range(8)]
    return [np.concatenate([phrases[j] for j in rng.integers(0, len(phrases), 6)]) for _ in range(n)]


def warm(work: Path) -> None:
    rng = np.random.default_rng(0)
    for vocab in _VOCABS:
        path = work / f"ds-{vocab}"
        ds = SuffixArrayDatastore.build(_documents(rng, vocab, 40), path, vocab_size=vocab, tokenizer_id=_TID,
                                        progress=False)
        ds.close()
        ds = SuffixArrayDatastore.open(path, expected_tokenizer_id=_TID)  # memory-mapped and verified
        check_datastore(ds)
        ds.warmup()  # one shard
        # Base shards plus shards learned online (in memory): the next tuple size of the kernels.
        ds.set_delta(Shard.from_documents(_documents(rng, vocab, 4), vocab_size=vocab, tokenizer_id=_TID))
        ds.warmup()
        if vocab == _VOCABS[0]:
            build_store(ds, work / "crest-2.rns", max_n=4, t=16, progress=False)  # counting over 2-4 shards
            ds.set_delta(None)
            store = work / "crest.rns"
            build_store(ds, store, max_n=4, t=16, progress=False)
            ngrams = EmbeddedNgramStore.open(store, expected_tokenizer_id=_TID)
            ngrams.check()
            ngrams.warmup()
            ngrams.close()
        ds.close()
    warmup_context_draft()
    warmup_sizer()


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ragserve-warm-") as tmp:
        warm(Path(tmp))
    print(f"numba kernels compiled or loaded from the cache in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
