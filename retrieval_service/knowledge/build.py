"""Build a knowledge base directory: passages, dense embeddings (EDR), HNSW (ADR), Lucene BM25 (SR).

    python -m retrieval_service.knowledge.build --out ~/.cache/ragserve/kb/docs
    python -m retrieval_service.knowledge.build --out /tmp/kb --limit-passages 2000 --no-rst --retrievers edr,sr
    python -m retrieval_service.knowledge.build --out /tmp/kb --to postgresql://postgres@127.0.0.1/postgres

Every output appears atomically (written aside, then renamed) and a rerun resumes: passages are kept when
the same corpus settings are asked for, embeddings are encoded in chunks that survive an interruption, and an
index already built for the same passages (and parameters) is kept. kb.json is the manifest, rewritten after
each stage; KnowledgeBase.open reads it.

Layout: kb.json, passages.jsonl, passages.offsets.npy, dense/{embeddings.npy,meta.json,hnsw.faiss,hnsw.json},
sparse/{lucene/,meta.json,index.log}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from ragcore.encoder import ENCODER_DTYPES, Encoder
from ragcore.process import offline_process
from retrieval_service.knowledge import dense, kb_files, passages as P, pg, sparse
from retrieval_service.knowledge.encode_pool import EncodeWork, auto_workers
from retrieval_service.knowledge.kb import DENSE_DIR, MANIFEST, RETRIEVERS, SPARSE_DIR

FORMAT_VERSION = 1


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    os.replace(tmp, path)


def read_passages_jsonl(path: Path) -> Iterable[P.Passage]:
    """A user-supplied corpus: one {"title", "text"[, "key"]} object per line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if line.strip():
                rec = json.loads(line)
                yield P.Passage(rec.get("key") or f"jsonl:{n}", rec.get("title", ""), rec["text"])


def share_prefix(passages: Path, offsets: Path, parent: Path, parent_offsets: Path) -> bool:
    """Do two passage stores begin alike: the shorter one's records byte for byte the first of the other's?"""
    if not parent.is_file() or not parent_offsets.is_file():
        return False
    ours, theirs = np.load(offsets, mmap_mode="r"), np.load(parent_offsets, mmap_mode="r")
    m = min(len(ours), len(theirs)) - 1  # records both have
    size = int(ours[m])
    if m < 1 or int(theirs[m]) != size:
        return False
    with open(passages, "rb") as a, open(parent, "rb") as b:
        while size > 0:
            step = min(size, 1 << 20)
            if a.read(step) != b.read(step):
                return False
            size -= step
    return True


def _parent_count(parent: Path) -> int:
    """Passages of the KB in `parent` (written so far)."""
    offsets = parent / P.OFFSETS_FILE
    if not (parent / P.PASSAGES_FILE).is_file() or not offsets.is_file():
        raise ValueError(f"embeddings_from: {parent} has no passages yet")
    return len(np.load(offsets, mmap_mode="r")) - 1


def _parent_passages(parent: Path, limit: int | None) -> Iterator[P.Passage]:
    """The first `limit` passages of the KB in `parent` (all of them for None), as they were written there."""
    if not (parent / P.PASSAGES_FILE).is_file():
        raise ValueError(f"embeddings_from: {parent} has no passages yet")
    store = P.PassageStore(parent)
    try:
        n = len(store.offsets) - 1 if limit is None else min(limit, len(store.offsets) - 1)
        for rec in store.iter_range(0, n):
            yield P.Passage(rec["key"], rec["title"], rec["text"])
    finally:
        store.close()


@dataclass
class _Build:
    """What the stages of one build share: where it goes, the manifest it writes after each stage, the previous
    run's manifest (what may be reused) and the passages."""
    out: Path
    manifest: dict
    old: dict  # the last run's manifest ({} when nothing may be reused)
    n: int  # passages
    fp: str  # their fingerprint
    store: P.PassageStore
    progress: bool

    def carry(self, name: str) -> None:
        """Keep the last run's build record of index `name` (reused as it is)."""
        if name in self.old.get("retrievers", []) and self.old.get("fingerprint") == self.fp:
            self.manifest["build"][name] = self.old.get("build", {}).get(name, {})

    def save(self) -> None:
        _write_json(self.out / MANIFEST, self.manifest)


def build_kb(out: str | Path, passages: Iterable[P.Passage] | None = None, *,
             retrievers: Sequence[str] = RETRIEVERS, corpus: dict | None = None, limit: int | None = None,
             rst: bool = True, site: bool = True, code: bool = False, man: bool = False, headers: bool = False,
             words: int = P.DEFAULT_WORDS, workers: int = 2,
             dtype: str = "float32", encoder_dtype: str = "float32", batch_size: int = 32, chunk: int = 4096,
             hnsw_m: int = 32, hnsw_ef_construction: int = 200, threads: int = 2, omp_threads: int = 1,
             jvm_heap: str = "", force: bool = False, embeddings_from: str | Path | None = None,
             encoder: Encoder | None = None, progress: bool = True, encode_workers: int = 0) -> dict:
    """Build (or finish building) a KB in `out`; returns the manifest.

    passages: an explicit corpus (tests, --passages-jsonl); None = extract docstrings (+ reST) offline.
    corpus: a description of `passages` for the resume check (same description -> passages are reused).
    embeddings_from: a KB (built or still encoding) whose rows are copied instead of encoded where its passages
    and these are the same. A larger one gives this one its first `limit` passages, read from its passage store (the
    corpus on disk may have changed since it was extracted, with packages installed since): a 100 K / 300 K KB from
    the large one's prefix. A smaller one gives its rows to a KB that grows it (300 K from a 100 K KB built before):
    the passages come from the corpus and must begin with the parent's.
    encode_workers: encoder processes of omp_threads torch threads each (0: one per omp_threads usable cores); an
    explicit `encoder` encodes in this process.
    """
    out = Path(out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    bad = set(retrievers) - set(RETRIEVERS)
    if bad:
        raise ValueError(f"retrievers: {sorted(bad)} not in {RETRIEVERS}")
    manifest_path = out / MANIFEST
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() and not force else {}
    corpus_desc = corpus or ({"source": "docs", "limit": limit, "rst": rst and P.RST_ROOT.is_dir(), "site": site,
                              "words": words} if passages is None else {"source": "given", "limit": limit})
    extra = {"code": code, "man": man and P.MAN_ROOT.is_dir(), "headers": headers}
    if passages is None and any(extra.values()):  # absent when off, so a docs KB built before still resumes
        corpus_desc.update(extra)
    manifest = {"version": FORMAT_VERSION, "corpus": corpus_desc, "retrievers": [], "build": {}}

    def source() -> Iterable[P.Passage]:  # asked only when the last run's passages cannot be reused
        if passages is None and embeddings_from is not None and (
                limit is None or _parent_count(Path(embeddings_from).expanduser()) >= limit):
            return _parent_passages(Path(embeddings_from).expanduser(), limit)
        if passages is None:
            docs = P.iter_documents(rst=rst, site=site, workers=workers, code=code, man=man, headers=headers)
            return P.iter_passages(docs, words=words, limit=limit)
        return passages if limit is None else (p for _, p in zip(range(limit), passages))

    n, fp, reused = _passages_stage(out, old, corpus_desc, manifest, source, progress)
    b = _Build(out, manifest, old if reused else {}, n, fp, P.PassageStore(out), progress)  # every index depends on them
    if {"edr", "adr"} & set(retrievers):
        _dense_stage(b, dtype=dtype, encoder_dtype=encoder_dtype, batch_size=batch_size, chunk=chunk,
                     omp_threads=omp_threads, encode_workers=encode_workers, embeddings_from=embeddings_from,
                     encoder=encoder)
    if "adr" in retrievers:
        _hnsw_stage(b, hnsw_m, hnsw_ef_construction, omp_threads)
    if "sr" in retrievers:
        _lucene_stage(b, threads, jvm_heap)
    # Peak resident memory of the build (this process; the Anserini JVM is a child), over resumed runs too.
    peak = {who: getattr(resource.getrusage(flag), "ru_maxrss") / 1024 for who, flag in
            (("python_mb", resource.RUSAGE_SELF), ("children_mb", resource.RUSAGE_CHILDREN))}
    before = b.old.get("peak_rss", {}) if b.old.get("fingerprint") == fp else {}
    manifest["peak_rss"] = {k: round(max(v, before.get(k, 0.0)), 1) for k, v in peak.items()}
    # Indexes built by an earlier run for the same passages stay usable even if not asked for this time.
    for name in b.old.get("retrievers", []):
        if name not in manifest["retrievers"] and b.old.get("fingerprint") == fp:
            manifest["retrievers"].append(name)
            b.carry(name)
    # Last: every file is final now. KnowledgeBase.open verifies them all before the KB serves.
    manifest[kb_files.MANIFEST_KEY] = kb_files.checksums(out)
    b.save()
    b.store.close()
    return manifest


def _passages_stage(out: Path, old: dict, corpus_desc: dict, manifest: dict,
                    source: Callable[[], Iterable[P.Passage]], progress: bool) -> tuple[int, str, bool]:
    """1. The passage store: the last run's when it was built from the same corpus, else written from source()
    -> (passages, fingerprint, whether the last run's were reused)."""
    reused = (old.get("corpus") == corpus_desc and old.get("version") == FORMAT_VERSION
              and (out / P.PASSAGES_FILE).is_file() and (out / P.OFFSETS_FILE).is_file()
              and P.fingerprint(out / P.PASSAGES_FILE) == old.get("fingerprint"))
    if reused:
        n, fp = old["passages"], old["fingerprint"]
        manifest["build"]["passages"] = old.get("build", {}).get("passages", {})
        print(f"passages: reusing {n} passages in {out}")
    else:
        t0 = time.perf_counter()
        with tqdm(desc="passages", unit=" psg", disable=not progress) as bar:
            n, fp = P.write_passages(out, source(), progress=bar)
        manifest["build"]["passages"] = {"seconds": time.perf_counter() - t0}
    if n == 0:
        raise ValueError("the corpus produced no passages")
    manifest.update(passages=n, fingerprint=fp)
    manifest["build"]["passages"]["bytes"] = _dir_bytes(out / P.PASSAGES_FILE) + _dir_bytes(out / P.OFFSETS_FILE)
    _write_json(out / MANIFEST, manifest)
    return n, fp, reused


def _dense_stage(b: _Build, *, dtype: str, encoder_dtype: str, batch_size: int, chunk: int, omp_threads: int,
                 encode_workers: int, embeddings_from: str | Path | None, encoder: Encoder | None) -> None:
    """2. Dense embeddings (EDR; ADR's HNSW is built from them): kept when up to date, else encoded in resumable
    chunks, copying a parent KB's rows where its passages are these."""
    dense_dir = b.out / DENSE_DIR
    dense_dir.mkdir(exist_ok=True)
    meta_path = dense_dir / dense.META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if (meta.get("fingerprint") == b.fp and meta.get("n") == b.n and meta.get("dtype") == dtype
            and meta.get("encoder_dtype", "float32") == encoder_dtype
            and (dense_dir / dense.EMBEDDINGS_FILE).is_file()):
        print("embeddings: up to date")
        b.carry("edr")
    else:
        t0 = time.perf_counter()
        enc = encoder or Encoder(threads=omp_threads, cache_size=0, dtype=encoder_dtype)
        reuse = None
        if embeddings_from is not None:
            parent = Path(embeddings_from).expanduser()
            if not share_prefix(b.out / P.PASSAGES_FILE, b.out / P.OFFSETS_FILE, parent / P.PASSAGES_FILE,
                                parent / P.OFFSETS_FILE):
                raise ValueError(f"embeddings_from: the passages of {parent} and these {b.n} begin differently")
            reuse = dense.prefix_rows(parent / DENSE_DIR, encoder=enc.name, encoder_dtype=encoder_dtype,
                                      dtype=dtype, dim=enc.dim)
        pool = None if encoder is not None else EncodeWork(
            passages_dir=str(b.out), chunks_dir=str(dense_dir / "chunks"), encoder_dtype=encoder_dtype, dtype=dtype,
            batch_size=batch_size, threads=omp_threads)
        workers = encode_workers or auto_workers(omp_threads)
        with tqdm(total=b.n, desc=f"encode ({workers} x {omp_threads} threads)" if pool else "encode",
                  unit=" psg", smoothing=0.05, disable=not b.progress) as bar:
            dense.encode_passages(lambda i, j: b.store.iter_range(i, j), b.n, dense_dir, enc, fingerprint=b.fp,
                                  dtype=dtype, chunk=chunk, batch_size=batch_size, progress=bar, reuse=reuse,
                                  pool=pool, workers=workers)
        done = json.loads(meta_path.read_text()).get("build", {})
        # encode_seconds: the encoder's time over every run of a resumed build (chunks encoded by a version that
        # kept no time count are in neither it nor encoded_rows); wall_seconds: this run, copies included.
        b.manifest["build"]["edr"] = {**done, "wall_seconds": time.perf_counter() - t0}
    edr = b.manifest["build"].setdefault("edr", {})
    edr.update(bytes=_dir_bytes(dense_dir / dense.EMBEDDINGS_FILE), dtype=dtype, encoder_dtype=encoder_dtype)
    b.manifest["retrievers"].append("edr")  # the exact index is built from the embeddings at open
    b.save()


def _hnsw_stage(b: _Build, hnsw_m: int, hnsw_ef_construction: int, omp_threads: int) -> None:
    """3. The HNSW graph over the embeddings (ADR): kept when built for the same passages and parameters."""
    dense_dir = b.out / DENSE_DIR
    hnsw_meta_path = dense_dir / "hnsw.json"
    want = {"fingerprint": b.fp, "n": b.n, "M": hnsw_m, "efConstruction": hnsw_ef_construction, "metric": "ip"}
    have = json.loads(hnsw_meta_path.read_text()) if hnsw_meta_path.is_file() else {}
    if {k: have.get(k) for k in want} == want and (dense_dir / dense.HNSW_FILE).is_file():
        print("hnsw: up to date")
        b.carry("adr")
    else:
        dense.configure_faiss(omp_threads)
        vectors = np.load(dense_dir / dense.EMBEDDINGS_FILE, mmap_mode="r")
        t0 = time.perf_counter()
        with tqdm(total=b.n, desc=f"hnsw M={hnsw_m} efC={hnsw_ef_construction}", unit=" vec",
                  disable=not b.progress) as bar:
            index = dense.build_hnsw(vectors, "ip", hnsw_m, hnsw_ef_construction, progress=bar.update)
        seconds = time.perf_counter() - t0
        tmp = dense_dir / (dense.HNSW_FILE + ".tmp")
        dense.faiss.write_index(index, str(tmp))
        os.replace(tmp, dense_dir / dense.HNSW_FILE)
        _write_json(hnsw_meta_path, {**want, "seconds": seconds})
        b.manifest["build"]["adr"] = {"seconds": seconds, "M": hnsw_m, "efConstruction": hnsw_ef_construction}
    b.manifest["build"].setdefault("adr", {})["bytes"] = _dir_bytes(dense_dir / dense.HNSW_FILE)
    b.manifest["retrievers"].append("adr")
    b.save()


def _lucene_stage(b: _Build, threads: int, jvm_heap: str) -> None:
    """4. The Lucene BM25 index (SR), built by Anserini: kept when built for the same passages."""
    sparse_dir = b.out / SPARSE_DIR
    sparse_dir.mkdir(exist_ok=True)
    meta_path = sparse_dir / sparse.META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    index_dir = sparse_dir / sparse.INDEX_DIR
    if meta.get("fingerprint") == b.fp and meta.get("n") == b.n and any(index_dir.glob("segments_*")):
        print("lucene: up to date")
        b.carry("sr")
    else:
        t0 = time.perf_counter()
        coll = sparse_dir / "collection"
        if coll.exists():
            shutil.rmtree(coll)
        records = ((r["id"], r["title"], r["text"]) for r in
                   tqdm(b.store.iter_range(0, b.n), total=b.n, desc="lucene collection", unit=" psg",
                        disable=not b.progress))
        sparse.write_collection(records, coll, parts=max(1, threads) * 2)
        print(f"lucene: indexing {b.n} passages with Anserini (log: {sparse_dir / 'index.log'}) ...", flush=True)
        sparse.build_lucene_index(coll, index_dir, threads=threads, heap=jvm_heap, log_path=sparse_dir / "index.log")
        shutil.rmtree(coll)
        seconds = time.perf_counter() - t0
        _write_json(meta_path, {"fingerprint": b.fp, "n": b.n, "seconds": seconds, "k1": 0.9, "b": 0.4,
                                "id_width": sparse.ID_WIDTH})
        b.manifest["build"]["sr"] = {"seconds": seconds}
        print(f"lucene: done in {seconds:.1f} s")
    b.manifest["build"].setdefault("sr", {})["bytes"] = _dir_bytes(index_dir)
    b.manifest["retrievers"].append("sr")
    b.save()


def main(argv: list[str] | None = None) -> None:
    offline_process()
    sparse.prepare_process()
    ap = argparse.ArgumentParser(prog="python -m retrieval_service.knowledge.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="KB directory (created; resumed if it exists)")
    ap.add_argument("--limit-passages", type=int, default=None, help="stop the corpus after N passages")
    ap.add_argument("--no-rst", action="store_true", help="skip the python3.11-doc reST sources")
    ap.add_argument("--no-site", action="store_true", help="docstrings of the standard library only")
    ap.add_argument("--code", action="store_true", help="add the Python source (stdlib + site-packages), by definition")
    ap.add_argument("--man", action="store_true", help="add the English manual pages of /usr/share/man")
    ap.add_argument("--headers", action="store_true", help="add the C/C++ headers of /usr/include and site-packages")
    ap.add_argument("--passages-jsonl", default="", help="use this corpus ({title, text} per line) instead")
    ap.add_argument("--retrievers", default="edr,adr,sr", help="comma list of edr, adr, sr")
    ap.add_argument("--words", type=int, default=P.DEFAULT_WORDS, help="words per passage")
    ap.add_argument("--float16", action="store_true", help="store embeddings as float16 (half the disk)")
    ap.add_argument("--encoder-dtype", choices=ENCODER_DTYPES, default="float32",
                    help="encoder compute dtype; bfloat16 is ~2x faster on avx512_bf16 CPUs (queries use the same)")
    ap.add_argument("--batch-size", type=int, default=32, help="encoder batch size (32 encoded 1.1-1.4x faster than 64 with bf16 on 2 cores)")
    ap.add_argument("--chunk", type=int, default=4096, help="passages per resumable encoding chunk")
    ap.add_argument("--hnsw-m", type=int, default=32,
                    help="HNSW M of the adr (dense) index: graph links per vector (default %(default)s)")
    ap.add_argument("--hnsw-ef-construction", type=int, default=200,
                    help="HNSW efConstruction of the adr index: candidates kept per insertion (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="Anserini indexing threads")
    ap.add_argument("--omp-threads", type=int, default=1,
                    help="torch threads per encoder process, and HNSW (faiss) threads; >1 pays only on idle cores")
    ap.add_argument("--encode-workers", type=int, default=0,
                    help="encoder processes (0: one per --omp-threads usable cores; on 2 cores 2 x 1 thread encoded "
                         "1.35-1.6x as fast as 1 x 2)")
    ap.add_argument("--workers", type=int, default=2, help="processes parsing source files")
    ap.add_argument("--jvm-heap", default="", help="Anserini indexer -Xmx, e.g. 4g")
    ap.add_argument("--force", action="store_true", help="rebuild everything")
    ap.add_argument("--embeddings-from", default=None,
                    help="a KB (built or still encoding, larger or smaller) whose passages begin like these: "
                         "copy its rows where both have them, encode only the rest")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--to", default="",
                    help="also load the KB into PostgreSQL at this postgresql:// URL (pgvector; --retrievers picks its "
                         "indexes: edr = the table, adr = HNSW, sr = full-text GIN); only passages and embeddings are "
                         "built in --out then")
    ap.add_argument("--table", default="ragserve_kb", help="table of the KB in PostgreSQL (with --to)")
    ap.add_argument("--maintenance-work-mem", default="512MB",
                    help="PostgreSQL's maintenance_work_mem while it builds the indexes (with --to), e.g. 4GB: an HNSW "
                         "graph that does not fit is built far more slowly (2-3 KB a passage at m = 32)")
    args = ap.parse_args(argv)
    retrievers = [r.strip() for r in args.retrievers.split(",") if r.strip()]
    if args.limit_passages is not None and args.limit_passages < 1:
        ap.error(f"--limit-passages: {args.limit_passages} must be >= 1")
    if args.encode_workers < 0 or args.omp_threads < 1:
        ap.error("--encode-workers must be >= 0 and --omp-threads >= 1")
    passages = None
    corpus = None
    if args.passages_jsonl:
        path = Path(args.passages_jsonl)
        passages = read_passages_jsonl(path)
        corpus = {"source": "jsonl", "path": str(path.resolve()), "sha256": P.fingerprint(path),
                  "limit": args.limit_passages}
    t0 = time.perf_counter()
    if args.to and not pg.is_url(args.to):
        ap.error(f"--to: {args.to!r} is not a postgresql:// URL")
    try:
        manifest = build_kb(args.out, passages, retrievers=("edr",) if args.to else retrievers, corpus=corpus, limit=args.limit_passages,
                            rst=not args.no_rst, site=not args.no_site, code=args.code, man=args.man,
                            headers=args.headers, words=args.words, workers=args.workers,
                            dtype="float16" if args.float16 else "float32",
                            encoder_dtype=args.encoder_dtype, batch_size=args.batch_size,
                            chunk=args.chunk, hnsw_m=args.hnsw_m, hnsw_ef_construction=args.hnsw_ef_construction,
                            threads=args.threads, omp_threads=args.omp_threads, jvm_heap=args.jvm_heap,
                            force=args.force, embeddings_from=args.embeddings_from,
                            progress=not args.no_progress, encode_workers=args.encode_workers)
    except ValueError as e:
        ap.error(str(e))
    except RuntimeError as e:  # an encoder process died: what was encoded is kept for the rerun
        raise SystemExit(f"build stopped: {e}") from None
    if args.to:
        try:
            with tqdm(total=manifest["passages"], desc=f"postgresql {args.table}", unit=" psg",
                      disable=args.no_progress) as bar:
                loaded = pg.load_kb(args.out, args.to, table=args.table, retrievers=retrievers, hnsw_m=args.hnsw_m,
                                    hnsw_ef_construction=args.hnsw_ef_construction, force=args.force,
                                    progress=bar.update, maintenance_work_mem=args.maintenance_work_mem)
        except ValueError as e:
            ap.error(str(e))
        except pg.DatabaseError as e:
            raise SystemExit(f"load into {pg.masked(args.to)} stopped (rerun to resume): {e}") from None
        print(f"PostgreSQL {pg.masked(args.to)} table {args.table}: {loaded['passages']} passages, retrievers "
              f"{','.join(loaded['retrievers'])}, copied {loaded['build']['copy']['rows']} rows in "
              f"{loaded['build']['copy']['seconds']:.1f} s")
    print(f"KB {args.out}: {manifest['passages']} passages, retrievers {','.join(manifest['retrievers'])}, "
          f"{time.perf_counter() - t0:.1f} s")
    for name, b in manifest["build"].items():
        print(f"  {name:8s} " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in sorted(b.items())))


if __name__ == "__main__":
    main()
