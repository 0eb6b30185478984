"""Passages for the knowledge base: DPR-style ~100-word blocks with a title, from offline documentation.

Sources (all offline): docstrings of the standard library and of the installed site-packages (parsed with
`ast`, never imported), and the Debian `python3.11-doc` reST sources when installed. A document is a module
(title = dotted module name, sections = one per documented object) or a reST page (title = its first
heading, sections = paragraphs). The large KB adds real text that is on every Debian machine with Python:
the Python source itself (`code`: one section per def/class, so a passage is a few definitions), the English
manual pages (`man`: one section per paragraph, roff reduced to its words) and the C headers of
/usr/include and of the site-packages (`headers`: one section per blank-line-separated block, comments
included). Sections are packed greedily into blocks of at most `words` words; a longer
section is cut into `words`-word windows, as DPR cuts Wikipedia articles.

Doc ids are row numbers in the passage file, stable for the same sources (files are read in sorted order,
exact duplicate texts are dropped in favour of the first). Each passage also carries a readable `key`
(`py:json.decoder#0`, `rst:library/json#3`).

On disk: `passages.jsonl` ({"id", "key", "title", "text"} per line) and `passages.offsets.npy`
(int64 [N+1] byte offsets), so a lookup is one slice of a memory-mapped file.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import mmap
import os
import re
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from ragcore.errors import DataLoss

PASSAGES_FILE = "passages.jsonl"
OFFSETS_FILE = "passages.offsets.npy"
RST_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
DEFAULT_WORDS = 100
# Shorter leftovers are glued to the previous block: a 3-word passage is noise for both retrievers.
MIN_WORDS = 12
MAN_ROOT = Path("/usr/share/man")
INCLUDE_ROOT = Path("/usr/include")
SOURCES = ("rst", "docstrings", "code", "man", "headers")
# Directories whose docstrings are tests, caches or copies of other packages.
_SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "_vendor", "vendored", "site-packages",
                        "idle_test", "node_modules", "dist-packages"})


@dataclass(frozen=True)
class Document:
    key: str                  # source prefix, e.g. "py:json.decoder" or "rst:library/json"
    title: str
    sections: tuple[str, ...]


@dataclass(frozen=True)
class Passage:
    key: str
    title: str
    text: str


# ---------------------------------------------------------------------------------------------- chunking

def pack_sections(sections: Sequence[str], words: int = DEFAULT_WORDS, min_words: int = MIN_WORDS) -> list[str]:
    """Pack sections into blocks of <= `words` words (a block is cut only inside a section longer than `words`).

    pack_sections(["a b", "c d e"], words=4, min_words=1) -> ["a b", "c d e"]   # not ["a b c d", "e"]
    """
    if words < 1:
        raise ValueError(f"words: {words} must be >= 1")
    blocks: list[list[str]] = []
    buf: list[str] = []
    for section in sections:
        toks = section.split()
        if not toks:
            continue
        if len(buf) + len(toks) <= words:
            buf += toks
            continue
        if buf:
            blocks.append(buf)
            buf = []
        while len(toks) > words:
            blocks.append(toks[:words])
            toks = toks[words:]
        buf = toks
    if buf:
        blocks.append(buf)
    # Glue short leftovers to the previous block of the same document (it grows past `words` a little).
    out: list[list[str]] = []
    for block in blocks:
        if out and len(block) < min_words:
            out[-1] = out[-1] + block
        else:
            out.append(block)
    return [" ".join(b) for b in out if len(b) >= min_words]


def iter_passages(documents: Iterable[Document], words: int = DEFAULT_WORDS, limit: int | None = None,
                  min_words: int = MIN_WORDS) -> Iterator[Passage]:
    """Documents -> passages, dropping exact duplicate texts (vendored copies, inherited docstrings)."""
    seen: set[bytes] = set()
    n = 0
    for doc in documents:
        for i, text in enumerate(pack_sections(doc.sections, words, min_words)):
            digest = hashlib.blake2b(" ".join(text.lower().split()).encode(), digest_size=16).digest()
            if digest in seen:
                continue
            seen.add(digest)
            yield Passage(f"{doc.key}#{i}", doc.title, text)
            n += 1
            if limit is not None and n >= limit:
                return


# ------------------------------------------------------------------------------------------- docstrings

def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstring_sections(source: str) -> list[str]:
    """Module source -> one section per docstring: "qualname(args): docstring" (module docstring first)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    sections: list[str] = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        sections.append(doc)

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    if isinstance(node, ast.ClassDef):
                        head = f"class {name}"
                    else:
                        try:
                            head = f"{name}({ast.unparse(node.args)})"
                        except Exception:  # unparse of exotic defaults; the name is enough
                            head = f"{name}()"
                    sections.append(f"{head}: {doc}")
                if isinstance(node, ast.ClassDef):
                    visit(node.body, name + ".")

    visit(tree.body, "")
    return sections


def iter_py_files(root: Path, skip_dirs: frozenset[str] = _SKIP_DIRS) -> Iterator[Path]:
    """Sorted walk (stable ids), skipping tests, caches, vendored copies and non-package directories."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in skip_dirs and not d.endswith((".dist-info", ".egg-info", ".data"))
                             and d.isidentifier())
        for f in sorted(filenames):
            if f.endswith(".py") and f[:-3].isidentifier():
                yield Path(dirpath) / f


def _python_document(args: tuple[str, str], sections_of=docstring_sections, prefix: str = "py",
                     suffix: str = "") -> Document | None:
    root, path = Path(args[0]), Path(args[1])
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    sections = sections_of(source)
    if not sections:
        return None
    name = module_name(root, path)
    return Document(f"{prefix}:{name}", name + suffix, tuple(sections))


def _module_document(args: tuple[str, str]) -> Document | None:
    return _python_document(args)


_DEF = re.compile(r"^[ \t]*(?:@|async[ \t]+def[ \t]|def[ \t]|class[ \t])", re.M)


def code_sections(source: str) -> list[str]:
    """Python source -> one section per definition (decorators included), module-level code in between.

    code_sections("x = 1\ndef f():\n    return x\n") -> ["x = 1", "def f():\n    return x"]
    """
    starts = [m.start() for m in _DEF.finditer(source)]
    is_start = set(starts)
    cuts = [0]
    for a in starts:
        head = source[cuts[-1]:a].strip()
        # Decorator lines start their definition: the def below them does not cut again.
        if cuts[-1] in is_start and head and all(ln.strip().startswith("@") for ln in head.splitlines()):
            continue
        if a != cuts[-1]:
            cuts.append(a)
    cuts.append(len(source))
    return [source[a:b].strip() for a, b in zip(cuts, cuts[1:]) if source[a:b].strip()]


def _code_document(args: tuple[str, str]) -> Document | None:
    return _python_document(args, code_sections, "code", " (source)")


# ----------------------------------------------------------------------------------------- man / headers

_ROFF_ESCAPE = re.compile(r"\\(?:f(?:\[[^\]]*\]|\(..|.)|\(..|\*(?:\(..|\[[^\]]*\]|.)|\[[^\]]*\]|s[-+]?\d+|[&e|^%0 ~.'`c,/])")


def man_document(text: str, key: str, title: str) -> Document | None:
    """A roff manual page -> paragraphs of its words (requests dropped, a macro's arguments kept)."""
    paragraphs: list[str] = []
    current: list[str] = []
    for raw in text.splitlines():
        if raw.startswith(("'", '.\\"', "'\\\"")):
            continue
        if raw.startswith("."):
            macro, _, rest = raw[1:].partition(" ")
            if macro in ("SH", "SS", "PP", "P", "LP", "TP", "IP", "sp", "br") and current:
                paragraphs.append(" ".join(current))
                current = []
            if macro not in ("B", "I", "BR", "IR", "RB", "RI", "BI", "IB", "SH", "SS", "IP", "Nm", "Nd", "Sh"):
                continue
            raw = rest.replace('"', " ")
        line = _ROFF_ESCAPE.sub("", raw.replace("\\-", "-")).replace("\\", "").strip()
        if line:
            current.append(line)
    if current:
        paragraphs.append(" ".join(current))
    return Document(key, title, tuple(paragraphs)) if paragraphs else None


def _man_document(path_s: str) -> Document | None:
    path = Path(path_s)
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError):
        return None
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    page, _, section = name.rpartition(".")
    return man_document(raw.decode("utf-8", errors="replace"), f"man:{name}", f"{page}({section})")


def iter_man_pages(root: Path = MAN_ROOT) -> Iterator[str]:
    """English pages only (man1..man8, not the translations), sorted; symlinked aliases skipped."""
    for sub in sorted(root.glob("man[1-8]")):
        for path in sorted(sub.iterdir()):
            if path.is_file() and not path.is_symlink():
                yield str(path)


def _header_document(args: tuple[str, str]) -> Document | None:
    root, path = Path(args[0]), Path(args[1])
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    blocks = tuple(b.strip() for b in re.split(r"\n\s*\n", text) if b.strip())
    rel = path.relative_to(root).as_posix()
    return Document(f"h:{rel}", f"<{rel}>", blocks) if blocks else None


def iter_headers(roots: Sequence[Path]) -> Iterator[tuple[str, str]]:
    """C/C++ headers under each root, sorted (site-packages ship theirs: torch's C++ API, numpy's C API)."""
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for f in sorted(filenames):
                if f.endswith((".h", ".hpp", ".cuh")):
                    yield str(root), os.path.join(dirpath, f)


# ------------------------------------------------------------------------------------------------ reST

_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])\1{2,}\s*$")
_DIRECTIVE = re.compile(r"^\s*\.\.\s+[\w:-]+::\s*(.*)$")
_COMMENT = re.compile(r"^\s*\.\.(\s|$)")
_FIELD = re.compile(r"^\s*:[\w ._-]+:\s*(.*)$")
_ROLE = re.compile(r":[\w:.+-]+:`[~!]?([^`<]*?)(?:\s*<[^>]*>)?`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^>]*>`__?")
_LITERAL = re.compile(r"``([^`]*)``")
_EMPH = re.compile(r"\*\*?([^*\s][^*]*?)\*\*?")
_REF = re.compile(r"`([^`]+)`_{1,2}")


def clean_rst_line(line: str) -> str:
    line = _ROLE.sub(r"\1", line)
    line = _LINK.sub(r"\1", line)
    line = _LITERAL.sub(r"\1", line)
    line = _REF.sub(r"\1", line)
    line = _EMPH.sub(r"\1", line)
    return line.replace("::", ":")


def rst_document(text: str, key: str) -> Document | None:
    """reST page -> (first heading, paragraphs) with markup reduced to its words."""
    title = ""
    paragraphs: list[str] = []
    current: list[str] = []
    lines = text.splitlines()
    for i, raw in enumerate(lines):
        if _UNDERLINE.match(raw):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not title and raw.strip() and _UNDERLINE.match(nxt) and not _DIRECTIVE.match(raw):
            title = clean_rst_line(raw.strip())
        m = _DIRECTIVE.match(raw)
        if m:
            line = m.group(1)
        elif _COMMENT.match(raw):
            continue
        else:
            f = _FIELD.match(raw)
            line = f.group(1) if f else raw
        line = clean_rst_line(line).strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    if not paragraphs:
        return None
    return Document(key, title or key.split("/")[-1], tuple(paragraphs))


def iter_rst_documents(root: Path = RST_ROOT) -> Iterator[Document]:
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()[: -len(".rst.txt")]
        doc = rst_document(path.read_text(encoding="utf-8", errors="replace"), f"rst:{rel}")
        if doc is not None:
            yield doc


# --------------------------------------------------------------------------------------------- sources

def default_roots(site: bool = True) -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [Path(paths["stdlib"])]
    if site:
        for key in ("purelib", "platlib"):
            p = Path(paths[key])
            if p not in roots:
                roots.append(p)
    return roots


def _mapped(fn, jobs: Iterable, workers: int) -> Iterator[Document]:
    if workers <= 1:
        docs = map(fn, jobs)
        yield from (d for d in docs if d is not None)
        return
    with ProcessPoolExecutor(workers) as pool:
        # map keeps the input order, so ids stay stable whatever the worker count.
        yield from (d for d in pool.map(fn, jobs, chunksize=32) if d is not None)


def iter_documents(*, rst: bool = True, site: bool = True, roots: Sequence[Path] | None = None,
                   workers: int = 1, rst_root: Path = RST_ROOT, code: bool = False, man: bool = False,
                   headers: bool = False, man_root: Path = MAN_ROOT,
                   include_root: Path = INCLUDE_ROOT) -> Iterator[Document]:
    """reST pages first (prose), then module docstrings root by root, each in sorted order; then, when asked,
    the Python source, the manual pages and the C headers (so the docs KB is a prefix of the large one)."""
    if rst and rst_root.is_dir():
        yield from iter_rst_documents(rst_root)
    roots = list(roots or default_roots(site))

    def py_jobs():
        return ((str(root), str(path)) for root in roots for path in iter_py_files(root))

    yield from _mapped(_module_document, py_jobs(), workers)
    if code:
        yield from _mapped(_code_document, py_jobs(), workers)
    if man and man_root.is_dir():
        yield from _mapped(_man_document, iter_man_pages(man_root), workers)
    if headers:
        header_roots = [r for r in (include_root, *roots[1:]) if r.is_dir()]  # roots[0]: the stdlib, no headers
        yield from _mapped(_header_document, iter_headers(header_roots), workers)


# ---------------------------------------------------------------------------------------------- storage

def write_passages(out_dir: Path, passages: Iterable[Passage], progress=None) -> tuple[int, str]:
    """Write passages.jsonl + offsets atomically; return (count, sha256 fingerprint of the jsonl)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (PASSAGES_FILE + ".tmp")
    offsets = [0]
    sha = hashlib.sha256()
    with open(tmp, "wb") as f:
        for i, p in enumerate(passages):
            line = (json.dumps({"id": i, "key": p.key, "title": p.title, "text": p.text},
                               ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            sha.update(line)
            offsets.append(offsets[-1] + len(line))
            if progress is not None:
                progress.update(1)
        f.flush()
        os.fsync(f.fileno())
    off_tmp = out_dir / (OFFSETS_FILE + ".tmp.npy")
    np.save(off_tmp, np.asarray(offsets, dtype=np.int64))
    os.replace(off_tmp, out_dir / OFFSETS_FILE)
    os.replace(tmp, out_dir / PASSAGES_FILE)
    return len(offsets) - 1, sha.hexdigest()


def fingerprint(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


class PassagesCorrupted(DataLoss):
    """The passages or their offsets changed or were damaged behind the open-time checks (-> DATA_LOSS)."""


class PassageStore:
    """Read-only passages: random access by id through a memory-mapped jsonl and its offsets."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        path = self.directory / PASSAGES_FILE
        off_path = self.directory / OFFSETS_FILE
        if not path.is_file() or not off_path.is_file():
            raise FileNotFoundError(f"{self.directory}: no {PASSAGES_FILE}/{OFFSETS_FILE} (build the KB first)")
        # int64 [N+1], read into memory (8 bytes a passage): a file changed under the server cannot fault here.
        self.offsets = np.load(off_path)
        self._file = open(path, "rb")
        size = self._size = os.fstat(self._file.fileno()).st_size
        if self.offsets.ndim != 1 or len(self.offsets) < 1 or int(self.offsets[-1]) != size:
            raise ValueError(f"{off_path}: offsets do not match {path} ({size} bytes); rebuild the KB")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @functools.cached_property
    def max_record_bytes(self) -> int:
        """Bytes of the longest JSON line: an upper bound on one passage's title + text (for reply sizes)."""
        return int(np.diff(self.offsets).max()) if len(self) else 0

    def record(self, i: int) -> dict:
        """Passage i's JSON record; PassagesCorrupted (DATA_LOSS, naming the file) when the files disagree."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if not 0 <= start < end <= self._size:
            raise PassagesCorrupted(f"knowledge base file {OFFSETS_FILE} is corrupted: passage {i} spans bytes "
                                    f"[{start}, {end}) of the {self._size}-byte {PASSAGES_FILE}; rebuild the KB")
        try:
            rec = json.loads(self._mm[start:end])
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or not isinstance(rec.get("title"), str) or not isinstance(rec.get("text"), str):
            raise PassagesCorrupted(f"knowledge base file {PASSAGES_FILE} (or {OFFSETS_FILE}) is corrupted: passage "
                                    f"{i} is not a JSON record with a title and a text; rebuild the KB")
        return rec

    def get(self, ids: Sequence[int]) -> list[tuple[str, str]]:
        """ids -> [(title, text)]; ids are trusted (validated at the service boundary)."""
        out = []
        for i in ids:
            rec = self.record(int(i))
            out.append((rec["title"], rec["text"]))
        return out

    def iter_range(self, start: int, stop: int) -> Iterator[dict]:
        for i in range(start, stop):
            yield self.record(i)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._file.close()
