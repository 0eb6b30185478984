"""Build a suffix-array draft datastore from text/code files or JSONL, tokenized with the serving model's tokenizer.

    python -m retrieval_service.datastore.build --stdlib --site-packages --out ~/.cache/ragserve/datastores/code
    python -m retrieval_service.datastore.build --input 'docs/**/*.md' --jsonl data.jsonl --text-field text --out DIR

Shards of --shard-tokens tokens are written atomically one by one; rerunning the same command after an
interruption resumes at the first missing shard (the corpus key — files, sizes, mtimes, settings — must match).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ragcore.model_files import default_model_dir, load_tokenizer, ragserve_home, resolve_model_dir, tokenizer_identity
from ragcore.process import offline_process
from retrieval_service.datastore import corpus, shards
from retrieval_service.datastore.shards import DatastoreError

# One shard up to this size: drafting searches every shard, so fewer is faster; a 128 M-token uint16 shard needs
# ~1.8 GB of RAM while its suffix array is built (tokens + big-endian copy + 4 bytes per byte of tokens).
DEFAULT_SHARD_TOKENS = 128_000_000


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m retrieval_service.datastore.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", action="append", default=[], metavar="PATH|GLOB",
                    help="directory (text/code files, recursive), file, or glob; repeatable")
    ap.add_argument("--jsonl", action="append", default=[], metavar="FILE", help="JSONL file, one document per line")
    ap.add_argument("--text-field", default="text", help="JSONL field holding the text (default: text)")
    ap.add_argument("--stdlib", action="store_true", help="the interpreter's standard library .py files")
    ap.add_argument("--site-packages", action="store_true", help=".py files of the installed site-packages")
    ap.add_argument("--docs", action="store_true",
                    help="documentation: python3.11-doc reST pages + docstrings of stdlib and site-packages "
                         "(written once to $RAGSERVE_HOME/corpora/docs.jsonl)")
    ap.add_argument("--tokenizer", default=str(default_model_dir()), metavar="MODEL_DIR",
                    help="local model directory whose tokenizer the serving model uses (default: %(default)s)")
    ap.add_argument("--out", required=True, help="datastore directory to create (or resume)")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                    help="tokens per shard (default: %(default)s)")
    ap.add_argument("--limit-tokens", type=int, default=None, metavar="N", help="stop after N tokens (sampled stores)")
    ap.add_argument("--keep-finished", action="store_true",
                    help="if --out already holds a finished datastore, keep it even when the corpus has changed "
                         "since (a reinstalled venv gives every site-packages file a new mtime) instead of failing")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--report", default="", metavar="FILE",
                    help="write build figures (tokens, bytes, seconds, peak RSS, machine) as JSON here")
    args = ap.parse_args(argv)
    if not (args.input or args.jsonl or args.stdlib or args.site_packages or args.docs):
        ap.error("give a corpus: --input, --jsonl, --stdlib, --site-packages and/or --docs")
    if args.shard_tokens < 1:
        ap.error(f"--shard-tokens must be >= 1, got {args.shard_tokens}")
    if args.limit_tokens is not None and args.limit_tokens < 1:
        ap.error(f"--limit-tokens must be >= 1, got {args.limit_tokens}")
    return args


def build(args: argparse.Namespace) -> dict:
    """Run one (possibly resumed) build; returns the manifest plus timing and memory figures."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(resolve_model_dir(args.tokenizer))
    tokenizer_id = tokenizer_identity(tokenizer)
    vocab_size = len(tokenizer)
    jsonl = list(args.jsonl)
    if args.docs:
        bar = tqdm(unit="doc", desc="docs corpus", disable=args.no_progress)
        jsonl.append(str(corpus.write_docs_jsonl(ragserve_home() / "corpora" / "docs.jsonl", progress=bar.update)))
        bar.close()
    sources = corpus.corpus_sources(args.input, jsonl, args.text_field, args.stdlib, args.site_packages)
    if not sources:
        raise FileNotFoundError("the corpus is empty: no files matched")
    key = corpus.corpus_key(sources, tokenizer_id=tokenizer_id, shard_tokens=args.shard_tokens,
                            limit_tokens=args.limit_tokens, format_version=shards.FORMAT_VERSION)
    out = Path(args.out).expanduser()
    if args.keep_finished and (out / shards.MANIFEST).exists():
        manifest = shards.read_manifest(out)
        if manifest.get("corpus_key") != key:
            print(f"{out} is already built ({manifest['num_tokens']:,} tokens) from a corpus that has changed since; "
                  f"kept as it is (--keep-finished; remove it to rebuild)")
            return manifest
    point = shards.resume_point(out, key) if out.exists() else shards.ResumePoint(0, 0, 0)
    if (out / shards.MANIFEST).exists():
        manifest = shards.read_manifest(out)
        print(f"{out} is already built from this corpus ({manifest['num_tokens']:,} tokens); nothing to do")
        return manifest
    if point.next_shard:
        print(f"resuming at shard {point.next_shard} "
              f"(document {point.next_source:,}, {point.tokens_done:,} tokens done)")
    files_only = all(isinstance(s, corpus.FileSource) for s in sources)
    bar = tqdm(total=len(sources) if files_only else None, initial=point.next_source if files_only else 0,
               unit="doc", desc="tokenize", disable=args.no_progress, smoothing=0.05)
    tokens = [point.tokens_done]

    def progress(n: int) -> None:
        tokens[0] += n
        bar.update(1)
        if bar.n % 256 == 0:
            bar.set_postfix_str(f"{tokens[0] / 1e6:.1f}M tok", refresh=False)

    docs = corpus.tokenize_documents(corpus.iter_documents(sources, point.next_source), tokenizer)
    try:
        manifest = shards.write_shards(docs, out, vocab_size=vocab_size, tokenizer_id=tokenizer_id, corpus_key=key,
                                       shard_tokens=args.shard_tokens, limit_tokens=args.limit_tokens, resume=point,
                                       progress=progress, log=bar.write)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    nbytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"{out}: {manifest['num_tokens']:,} tokens, {manifest['num_documents']:,} documents, "
          f"{len(manifest['shards'])} shard(s), {nbytes / 1e6:.0f} MB, {seconds:.0f} s, peak RSS {peak_mb:.0f} MB")
    return {**manifest, "seconds": seconds, "peak_rss_mb": peak_mb, "bytes_on_disk": nbytes}


def write_report(path: str, result: dict, argv: list[str] | None) -> None:
    """Build figures as JSON (atomic), for the README's datastore table."""
    report = {k: v for k, v in result.items() if k not in ("shards", "corpus_key")}
    report["num_shards"] = len(result.get("shards", []))
    report["command"] = "python -m retrieval_service.datastore.build " + " ".join(
        sys.argv[1:] if argv is None else argv)
    report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_end": os.getloadavg()}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        result = build(args)
        if args.report and "seconds" in result:  # a fresh build, not "already built"
            write_report(args.report, result, argv)
    except (DatastoreError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    offline_process(tokenizer_threads=True)  # bulk tokenization: the tokenizer's own threads pay here
    sys.exit(main())
