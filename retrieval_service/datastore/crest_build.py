"""Build a CREST n-gram store from a suffix-array datastore (and push it to Redis).

    python -m retrieval_service.datastore.crest_build build --datastore ~/.cache/ragserve/datastores/code \\
        --out ~/.cache/ragserve/crest/code.crest --max-n 5 --budget 50MB          # or --t 20000
    python -m retrieval_service.datastore.crest_build push --store ~/.cache/ragserve/crest/code.crest \\
        --redis redis://127.0.0.1:6379/0 --namespace crest:code     # or --redis redis+cluster://h1:p1,h2:p2,...
    python -m retrieval_service.datastore.crest_build info --store ~/.cache/ragserve/crest/code.crest --check

Pipeline: count every n-gram (n <= m) of the datastore exactly (ngram_count: one streaming pass over the suffix
array) -> keep the most frequent per n (ngram_select: combined equal-t, or one n) -> draft each kept n-gram's
tree with REST's rules from the same datastore (the n-gram is the context, max_suffix = min_suffix = n: the
tree REST drafts whenever its longest match is exactly that n-gram) -> encode compactly (ngram_codec) -> one
store file written atomically (ngram_store).

With a byte budget, trees are drafted for growing t until a store of that t would exceed the budget, then the
largest t that fits is found by binary search over the exact size formula.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from retrieval_service.datastore.ngram_cluster import is_cluster_url, push_to_cluster
from retrieval_service.datastore.ngram_codec import (
    COMPRESSIONS,
    MAX_COUNT,
    MAX_NODES,
    Codec,
    encode_payload,
    train_dictionary,
)
from retrieval_service.datastore.ngram_count import NgramCounts, count_ngrams
from retrieval_service.datastore.ngram_redis import push_to_redis
from retrieval_service.datastore.ngram_select import check_strategy, largest_t_within, take_for
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    NgramStoreError,
    StoreRecords,
    StoreUnavailable,
    record_nbytes,
    store_size,
    write_store,
)
from retrieval_service.datastore.shards import DatastoreError
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

# The dictionary is trained on the trees of the DICT_SAMPLE most frequent n-grams of each n, whatever the store
# size: stores of different sizes from one datastore share it (and builds are deterministic).
DICT_SAMPLE = 2048
DICT_SIZE = 16 * 1024
ZSTD_LEVEL = 9  # level 19 saves little more on code trees, at a multiple of the build time
_BATCH = 4096  # n-grams per draft_batch call (one progress update)
DEFAULT_MAX_N = {"code": 5, "chat": 4, "docs": 4}


@dataclass(frozen=True)
class TreeParams:
    """REST's drafting rules for the precomputed trees."""

    max_matches: int = 5000
    continuation: int = 10
    max_nodes: int = 64
    sampling: str = "even"

    def __post_init__(self) -> None:
        for name, value, hi in (("max_matches", self.max_matches, MAX_COUNT), ("continuation", self.continuation, 255),
                                ("max_nodes", self.max_nodes, MAX_NODES)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
                raise ValueError(f"{name} must be an integer in [1, {hi}], got {value!r}")


class CandidatePool:
    """Encoded trees of the most frequent n-grams of each n, drafted on demand in rank order.

    One pool serves stores of every size and strategy over the same datastore (the bench builds several).
    """

    def __init__(self, datastore, counts: NgramCounts, *, params: TreeParams = TreeParams(),
                 compression: str = "zstd", level: int = ZSTD_LEVEL, dict_size: int = DICT_SIZE, threads: int = 2,
                 progress: bool = True):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        self.ds, self.counts, self.params = datastore, counts, params
        self.compression, self.level, self.dict_size = compression, level, dict_size
        self.threads, self.progress = threads, progress
        self.tok = np.dtype(datastore.shards[0].tokens.dtype)
        self.available = {n: int(g.shape[0]) for n, g in counts.ngrams.items()}
        self.raw: dict[int, list[bytes]] = {n: [] for n in self.available}
        self.payloads: dict[int, list[bytes]] = {n: [] for n in self.available}
        self.nodes: dict[int, list[int]] = {n: [] for n in self.available}
        self._cum: dict[int, np.ndarray] = {}
        self.codec: Codec | None = None
        self.draft_seconds = 0.0

    @property
    def zdict(self) -> bytes:
        return self.codec.zdict if self.codec else b""

    def _draft(self, want: dict[int, int]) -> None:
        """Draft and raw-encode ranks [have, want[n]) of each n."""
        todo = {n: min(want.get(n, 0), self.available[n]) - len(self.raw[n]) for n in self.available}
        total = sum(max(v, 0) for v in todo.values())
        if total <= 0:
            return
        p = self.params
        t0 = time.perf_counter()
        with tqdm(total=total, unit="tree", desc="draft trees", disable=not self.progress) as bar:
            for n, k in todo.items():
                have = len(self.raw[n])
                for lo in range(have, have + max(k, 0), _BATCH):
                    hi = min(lo + _BATCH, have + k)
                    ctxs = list(self.counts.ngrams[n][lo:hi])
                    trees = self.ds.draft_batch(ctxs, max_suffix=n, min_suffix=n, max_matches=p.max_matches,
                                                continuation=p.continuation, max_nodes=p.max_nodes,
                                                source="datastore", threads=self.threads, sampling=p.sampling)
                    for tree in trees:
                        self.raw[n].append(encode_payload(tree.tokens, tree.parents, tree.scores, tree.num_matches,
                                                          self.tok))
                        self.nodes[n].append(len(tree))
                    bar.update(hi - lo)
        self.draft_seconds += time.perf_counter() - t0

    def ensure(self, take: dict[int, int]) -> None:
        """Make payloads available for the first take[n] n-grams of each n."""
        if self.codec is None:
            # The dictionary's training sample comes first, so it never depends on the requested size.
            self._draft({n: DICT_SAMPLE for n in self.available})
            zdict = b""
            if self.compression == "zstd":
                sample = [r for n in sorted(self.raw) for r in self.raw[n][:DICT_SAMPLE]]
                zdict = train_dictionary(sample, self.dict_size)
            self.codec = Codec(self.compression, zdict, self.level)
        self._draft(take)
        for n, t in take.items():
            t = min(t, self.available[n])
            if len(self.payloads[n]) < t:
                self.payloads[n] += [self.codec.compress(r) for r in self.raw[n][len(self.payloads[n]):t]]
                sizes = [record_nbytes(n, len(p), self.ds.vocab_size) for p in self.payloads[n]]
                self._cum[n] = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def size(self, take: dict[int, int], meta: dict) -> int:
        """Exact bytes of the store holding `take` (payloads must be ensured)."""
        records = sum(int(self._cum[n][t]) for n, t in take.items() if t)
        return store_size(meta, {n: t for n, t in take.items()}, records, len(self.zdict), self.compression)

    def records(self, take: dict[int, int]) -> StoreRecords:
        keys, payloads = [], []
        for n in sorted(take):
            t = take[n]
            keys += list(self.counts.ngrams[n][:t])
            payloads += self.payloads[n][:t]
        return StoreRecords(keys, payloads, self.zdict, self.compression)

    def meta(self, strategy: str, n: int | None) -> dict:
        """Header fields every store from this pool carries (t is added per store)."""
        ds = self.ds
        return {"tokenizer_id": ds.tokenizer_id, "vocab_size": ds.vocab_size, "max_n": self.counts.max_n,
                "strategy": strategy, "single_n": n, "draft": asdict(self.params),
                "zstd_level": self.level if self.compression == "zstd" else None,
                "source": {"datastore": str(ds.path), "num_tokens": ds.num_tokens,
                           "corpus_key": ds.shards[0].header.get("corpus_key", "")},
                "corpus_ngrams": {"distinct": {str(k): v for k, v in self.counts.distinct.items()},
                                  "total": {str(k): v for k, v in self.counts.total.items()}}}


def choose_take(pool: CandidatePool, strategy: str, *, t: int | None = None, budget: int | None = None,
                n: int | None = None) -> tuple[int, dict[int, int]]:
    """(t, take) by count or by byte budget (drafting as many trees as the decision needs)."""
    if (t is None) == (budget is None):
        raise ValueError(f"give exactly one of t and budget (got t={t!r}, budget={budget!r})")
    check_strategy(strategy, n, pool.counts.max_n)
    meta = {**pool.meta(strategy, n), "t": 0}
    if t is not None:
        take = take_for(pool.available, strategy, t, n)
        pool.ensure(take)
        return t, take
    width = 1 if strategy == "single" else len(pool.available)
    limit = max(pool.available[k] for k in take_for(pool.available, strategy, 0, n))
    guess = max(1, budget // (width * 400))  # a 64-node tree takes ~200-250 bytes: start below, then double
    while True:
        take = take_for(pool.available, strategy, guess, n)
        pool.ensure(take)
        if pool.size(take, meta) > budget or guess >= limit:
            break
        guess *= 2
    best = largest_t_within(budget, lambda x: pool.size(take_for(pool.available, strategy, x, n), meta),
                            min(guess, limit))
    return best, take_for(pool.available, strategy, best, n)


def write_from_pool(pool: CandidatePool, out: str | os.PathLike, strategy: str, t: int, take: dict[int, int],
                    n: int | None = None, extra: dict | None = None) -> Path:
    meta = {**pool.meta(strategy, n), "t": t, **(extra or {})}
    return write_store(out, pool.records(take), meta)


def build_store(datastore, out: str | os.PathLike, *, max_n: int, strategy: str = "combined", n: int | None = None,
                t: int | None = None, budget: int | None = None, params: TreeParams = TreeParams(),
                compression: str = "zstd", threads: int = 2, progress: bool = True) -> dict:
    """Count, select, draft, encode, write. Returns a report (sizes, timings, peak RSS)."""
    check_strategy(strategy, n, max_n)
    t0 = time.perf_counter()
    # How many candidates per n counting keeps: t itself, or a bound for the budget (a record with its index
    # slot takes >= 48 bytes unless its tree is nearly empty; combined shares the budget among >= m - 1 n's,
    # as the 1-grams run out first). choose_take reports a store that falls short of its budget.
    per = 48 * (1 if strategy == "single" else max(1, max_n - 1))
    top = t if t is not None else max(DICT_SAMPLE, budget // per)
    counts = count_ngrams(datastore, max_n, top, progress=progress)
    t_count = time.perf_counter() - t0
    pool = CandidatePool(datastore, counts, params=params, compression=compression, threads=threads,
                         progress=progress)
    chosen_t, take = choose_take(pool, strategy, t=t, budget=budget, n=n)
    path = write_from_pool(pool, out, strategy, chosen_t, take, n)
    if budget is not None and path.stat().st_size < 0.95 * budget and all(take[k] == pool.available[k] for k in take):
        print(f"note: every counted candidate fits: the store takes {path.stat().st_size:,} of {budget:,} bytes")
    return {"path": str(path), "bytes": path.stat().st_size, "t": chosen_t, "take": take,
            "count_seconds": t_count, "draft_seconds": pool.draft_seconds,
            "total_seconds": time.perf_counter() - t0, "counting_peak_rss_mb": counts.peak_rss_mb,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "distinct": counts.distinct}


# ----------------------------------------------------------------------------------------------------------------
# CLI

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'50MB' -> 50_000_000, '6MiB' -> 6291456, '1234' -> 1234."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 50MB, 6MiB, 1234)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"byte size must be >= 1, got {text!r}")
    return value


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m retrieval_service.datastore.crest_build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="count n-grams, draft their trees, write a store file")
    b.add_argument("--datastore", required=True, help="suffix-array datastore directory (the corpus and the trees)")
    b.add_argument("--out", required=True, help="store file to write (atomically)")
    b.add_argument("--max-n", type=int, default=DEFAULT_MAX_N["code"],
                   help="longest n-gram (defaults: 5 for code, 4 for chat/docs; default %(default)s)")
    b.add_argument("--strategy", choices=("combined", "single"), default="combined",
                   help="combined: the t most frequent n-grams of every n = 1..max-n; single: of --n only "
                        "(default %(default)s)")
    b.add_argument("--n", type=int, default=None, help="the n of --strategy single")
    size = b.add_mutually_exclusive_group(required=True)
    size.add_argument("--t", type=int, help="n-grams per n")
    size.add_argument("--budget", type=parse_bytes, help="largest store that fits this many bytes (50MB, 6MiB)")
    b.add_argument("--max-matches", type=int, default=5000,
                   help="datastore occurrences read per drafted tree (default %(default)s)")
    b.add_argument("--continuation", type=int, default=10,
                   help="tokens read after each occurrence (default %(default)s)")
    b.add_argument("--max-nodes", type=int, default=64, help="nodes kept per drafted tree (default %(default)s)")
    b.add_argument("--compression", choices=COMPRESSIONS, default="zstd",
                   help="tree payloads: zstd with a dictionary trained on the store's trees, or none (raw); "
                        "default %(default)s")
    b.add_argument("--threads", type=int, default=2, help="threads drafting the trees (default %(default)s)")
    b.add_argument("--no-progress", action="store_true", help="no progress bars")
    p = sub.add_parser("push", help="bulk-load a store file into Redis or Redis Cluster (pipelined)")
    p.add_argument("--store", required=True, help="store file written by build")
    p.add_argument("--redis", required=True,
                   help="redis://host:port/db, or redis+cluster://host:port,host:port,... (any reachable nodes)")
    p.add_argument("--namespace", required=True, help="key prefix naming this store in Redis, e.g. crest:code")
    p.add_argument("--keep-old", action="store_true", help="keep keys of earlier pushes under the namespace")
    p.add_argument("--no-resume", action="store_true",
                   help="Redis Cluster: rewrite every n-gram instead of resuming an interrupted push of the same "
                        "store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("info", help="header, per-n tree sizes; --check runs the invariant checker")
    i.add_argument("--store", required=True, help="store file to describe")
    i.add_argument("--check", action="store_true",
                   help="also decode every record and look it up by its own key (reads the whole store)")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        if args.t is not None and args.t < 1:
            ap.error(f"--t must be >= 1, got {args.t}")
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        if (args.strategy == "single") != (args.n is not None):
            ap.error("--n goes with --strategy single (and only with it)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.cmd == "build":
            ds = SuffixArrayDatastore.open(args.datastore)
            params = TreeParams(args.max_matches, args.continuation, args.max_nodes)
            report = build_store(ds, args.out, max_n=args.max_n, strategy=args.strategy, n=args.n, t=args.t,
                                 budget=args.budget, params=params, compression=args.compression,
                                 threads=args.threads, progress=not args.no_progress)
            print(f"{report['path']}: {report['bytes']:,} bytes, t={report['t']:,} {report['take']}; counting "
                  f"{report['count_seconds']:.0f} s (peak RSS {report['counting_peak_rss_mb']:.0f} MB, memory-mapped "
                  f"datastore pages included), trees {report['draft_seconds']:.0f} s, total "
                  f"{report['total_seconds']:.0f} s, peak RSS {report['peak_rss_mb']:.0f} MB")
        elif args.cmd == "push":
            store = EmbeddedNgramStore.open(args.store)
            if is_cluster_url(args.redis):
                r = push_to_cluster(store, args.redis, args.namespace, drop_old=not args.keep_old,
                                    resume=not args.no_resume, progress=not args.no_progress)
                resumed = f", resumed after {r['resumed_from']:,}" if r["resumed_from"] else ""
                print(f"pushed {r['ngrams']:,} n-grams ({r['written']:,} written{resumed}) to the Redis Cluster as "
                      f"{r['namespace']} (build {r['build']}); dropped {r['dropped_keys']:,} keys of older builds")
            else:
                r = push_to_redis(store, args.redis, args.namespace, drop_old=not args.keep_old,
                                  progress=not args.no_progress)
                print(f"pushed {r['ngrams']:,} n-grams to {args.redis} as {r['namespace']} (build {r['build']}); "
                      f"dropped {r['dropped_keys']:,} keys of older builds")
        else:
            store = EmbeddedNgramStore.open(args.store)
            h = store.header
            print(f"{store}\n tokenizer {h['tokenizer_id']}, strategy {h['strategy']}, t={h['t']}, "
                  f"compression {h['compression']}, n-grams per n {h['ngrams_per_n']}")
            for n, s in store.tree_stats().items():
                print(f" n={n}: {s['ngrams']:,} n-grams, {s['mean_nodes']:.1f} nodes/tree, "
                      f"{s['mean_payload_bytes']:.0f} payload bytes/tree")
            if args.check:
                print(f" check: {store.check()}")
    except (DatastoreError, NgramStoreError, StoreUnavailable, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
