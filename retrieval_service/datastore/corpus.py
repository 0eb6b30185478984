"""Corpora for datastores: find documents, tokenize them with the serving model's tokenizer.

Sources are files (one document each) and JSONL files (one document per line), listed in a fixed order so a
document's index is stable across runs (an interrupted build resumes by index).

A datastore records its tokenizer's identity (ragcore.model_files.tokenizer_identity), so a worker using
another tokenizer is refused (ids would mean different strings).
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import xxhash

from retrieval_service.knowledge.passages import iter_documents as iter_doc_documents

# Extensions taken from a directory given with --input (a glob takes whatever it matches).
TEXT_SUFFIXES = frozenset({
    ".py", ".pyi", ".pyx", ".txt", ".md", ".rst", ".c", ".h", ".cc", ".cpp", ".hpp", ".java", ".js", ".ts",
    ".go", ".rs", ".rb", ".sh", ".toml", ".yaml", ".yml", ".json", ".cfg", ".ini", ".html", ".css", ".sql",
})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})


@dataclass(frozen=True)
class FileSource:
    path: Path


@dataclass(frozen=True)
class JsonlSource:
    path: Path
    text_field: str


Source = FileSource | JsonlSource


def _walk(root: Path, suffixes: frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
        out.extend(Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix in suffixes)
    return out


def stdlib_files() -> list[Path]:
    """The running interpreter's standard library .py files (site-packages excluded)."""
    return _walk(Path(sysconfig.get_paths()["stdlib"]), frozenset({".py"}), _SKIP_DIRS)


# setuptools' editable-install shims (__editable___<project>_finder.py) hold only this checkout's paths, and every
# `pip install -e .` rewrites them: in the corpus, reinstalling the project made its datastore "another corpus".
_SHIM_PREFIX = "__editable__"


def site_packages_files(roots: list[Path] | None = None) -> list[Path]:
    """.py files of the running interpreter's installed site-packages (or of `roots`), editable-install shims
    excluded."""
    if roots is None:
        roots = [Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")]
    files: list[Path] = []
    for root in dict.fromkeys(roots):
        if root.is_dir():
            files.extend(f for f in _walk(root, frozenset({".py"}), frozenset({"__pycache__", ".git"}))
                         if not f.name.startswith(_SHIM_PREFIX))
    return list(dict.fromkeys(files))


def write_docs_jsonl(path: Path, workers: int = 2, progress=None) -> Path:
    """The documentation corpus as JSONL ({"text"} per document), written once (atomic): the python3.11-doc reST
    pages and the docstrings of the standard library and site-packages (the knowledge base's documents, whole).
    An existing file is reused; delete it to rebuild."""
    path = Path(path).expanduser()
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for doc in iter_doc_documents(workers=workers):
                out.write(json.dumps({"text": "\n\n".join((doc.title,) + doc.sections)}, ensure_ascii=False))
                out.write("\n")
                if progress is not None:
                    progress(1)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def input_files(spec: str) -> list[Path]:
    """A directory (its text/code files, recursively), a glob pattern, or one file."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return _walk(p, TEXT_SUFFIXES, frozenset({"__pycache__", ".git"}))
    if p.is_file():
        return [p]
    anchor = Path(p.anchor or ".")
    matches = sorted(q for q in anchor.glob(str(p.relative_to(anchor)) if p.anchor else spec) if q.is_file())
    if not matches:
        raise FileNotFoundError(f"--input {spec!r} is neither a directory, a file, nor a glob matching files")
    return matches


def corpus_sources(inputs: list[str] = (), jsonl: list[str] = (), text_field: str = "text",
                   stdlib: bool = False, site_packages: bool = False) -> list[Source]:
    """Sources in a fixed order: stdlib, site-packages, --input entries, --jsonl files (duplicates dropped)."""
    files: list[Path] = []
    if stdlib:
        files += stdlib_files()
    if site_packages:
        files += site_packages_files()
    for spec in inputs:
        files += input_files(spec)
    sources: list[Source] = [FileSource(f) for f in dict.fromkeys(files)]
    for j in jsonl:
        path = Path(j).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--jsonl {j!r} is not a file")
        sources.append(JsonlSource(path, text_field))
    return sources


def corpus_key(sources: list[Source], **settings) -> str:
    """Identity of a corpus (paths, sizes, mtimes) and build settings: a resumed build must match it."""
    h = xxhash.xxh3_128()
    for s in sources:
        st = s.path.stat()
        h.update(f"{type(s).__name__}\0{s.path}\0{st.st_size}\0{st.st_mtime_ns}\0"
                 f"{getattr(s, 'text_field', '')}\n".encode("utf-8", "surrogateescape"))
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def iter_documents(sources: list[Source], start: int = 0) -> Iterator[tuple[int, str]]:
    """(document index, text) from document `start` on; files are read only when reached."""
    index = 0
    for s in sources:
        if isinstance(s, FileSource):
            if index >= start:
                data = s.path.read_bytes()
                # Binary files (NUL bytes) would only add noise tokens.
                yield index, "" if b"\0" in data else data.decode("utf-8", errors="replace")
            index += 1
            continue
        with open(s.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if index >= start:
                    try:
                        text = json.loads(line)[s.text_field]
                    except (ValueError, KeyError, TypeError) as e:
                        raise ValueError(f"{s.path}:{lineno}: no string field {s.text_field!r} ({e!r})") from None
                    if not isinstance(text, str):
                        raise ValueError(f"{s.path}:{lineno}: field {s.text_field!r} is {type(text).__name__}, not str")
                    yield index, text
                index += 1


def tokenize_documents(docs: Iterator[tuple[int, str]], tokenizer, *, batch_chars: int = 1_000_000,
                       threads: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(index, text) -> (index, token ids) in order, in the smallest dtype that fits (uint16 / uint32).

    Batches are encoded by the Rust tokenizer on `threads` Python threads (it releases the GIL): one big batch
    kept less than a core busy, while two threads with small batches used most of two.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no fast (Rust) backend; batch encoding needs one")
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast skips offsets: quicker
    dtype = np.uint16 if len(tokenizer) < 0xFFFF else np.uint32
    threads = threads or os.cpu_count() or 1

    def work(batch: list[tuple[int, str]]) -> list[tuple[int, np.ndarray]]:
        encodings = encode([t for _, t in batch], add_special_tokens=False)
        return [(i, np.array(enc.ids, dtype=dtype)) for (i, _), enc in zip(batch, encodings)]

    def batches() -> Iterator[list[tuple[int, str]]]:
        batch, size = [], 0
        for i, text in docs:
            batch.append((i, text))
            size += len(text)
            if size >= batch_chars:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    with ThreadPoolExecutor(threads, thread_name_prefix="tokenize") as pool:
        in_flight: deque = deque()
        for batch in batches():
            in_flight.append(pool.submit(work, batch))
            if len(in_flight) > 2 * threads:  # bounded read-ahead keeps memory flat
                yield from in_flight.popleft().result()
        while in_flight:
            yield from in_flight.popleft().result()
