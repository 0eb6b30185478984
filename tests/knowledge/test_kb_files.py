"""Every knowledge-base file is checksummed at build and verified before SERVING; damage is refused naming the file
relative to the KB (before: random or NaN bytes in the embeddings and random bytes in the HNSW file served, an
edited offsets file answered INTERNAL with a traceback, a corrupted Lucene index was refused naming no file)."""

from __future__ import annotations

import json
import shutil

import grpc
import numpy as np
import pytest

from proto import knowledge_pb2
from ragcore.errors import DataLoss
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import kb_files
from retrieval_service.knowledge.kb import MANIFEST, KBOpenError, KnowledgeBase
from retrieval_service.knowledge.passages import PassageStore


@pytest.fixture
def copy(kb_dir, tmp_path):
    out = tmp_path / "kb"
    shutil.copytree(kb_dir, out)
    return out


def _flip(path, at: float = 0.5, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + n] = np.random.default_rng(0).integers(0, 256, min(n, len(data) - start), np.uint8).tobytes()
    path.write_bytes(bytes(data))




def random_embeddings(kb):
    _flip(kb / "dense/embeddings.npy", 0.6)


def nan_embeddings(kb):
    path = kb / "dense/embeddings.npy"
    vectors = np.load(path)
    vectors[3, 7] = np.nan
    np.save(path, vectors)
    manifest = json.loads((kb / MANIFEST).read_text())
    import xxhash  # the checksum of the crafted file, computed without the finiteness check

    start, _ = kb_files._npy_data_start(path)
    raw = path.read_bytes()
    digest = xxhash.xxh3_64_hexdigest(f"{xxhash.xxh3_64_hexdigest(raw[:start])}:"
                                      f"{xxhash.xxh3_64_hexdigest(raw[start:])}".encode())
    manifest["files"]["dense/embeddings.npy"] = {"bytes": len(raw), "xxh3_64": digest}
    (kb / MANIFEST).write_text(json.dumps(manifest))


def random_hnsw(kb):
    _flip(kb / "dense/hnsw.faiss", 0.5)


def edited_offsets(kb):
    path = kb / "passages.offsets.npy"
    offsets = np.load(path)
    offsets[5] += 3
    np.save(path, offsets)


def corrupted_lucene(kb):
    biggest = max((p for p in (kb / "sparse/lucene").iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    _flip(biggest, 0.5)
    return str(biggest.relative_to(kb))


def truncated_passages(kb):
    path = kb / "passages.jsonl"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def unlisted_index_file(kb):
    (kb / "sparse/lucene/_extra.cfs").write_bytes(b"\0" * 100)
    return "sparse/lucene/_extra.cfs"


# (kind, damage, file the message must name (None: the damage returns it), what it must say)
CASES = [
    ("random bytes in the embeddings", random_embeddings, "dense/embeddings.npy", "checksum"),
    ("NaN in the embeddings, checksum matching", nan_embeddings, "dense/embeddings.npy", "non-finite"),
    ("random bytes in the HNSW file", random_hnsw, "dense/hnsw.faiss", "checksum"),
    ("an edited offsets file", edited_offsets, "passages.offsets.npy", "checksum"),
    ("a corrupted Lucene index", corrupted_lucene, None, "checksum"),
    ("truncated passages", truncated_passages, "passages.jsonl", "truncated"),
    ("a file added to the Lucene index", unlisted_index_file, None, "not in its manifest"),
]


@pytest.mark.parametrize("kind,damage,name,says", CASES, ids=[c[0] for c in CASES])
def test_damaged_kb_file_is_refused_naming_it(copy, encoder, kind, damage, name, says):
    name = damage(copy) or name
    with pytest.raises(KBOpenError) as err:  # Not an open KB that serves NaN scores or crashes in faiss
        KnowledgeBase.open(copy, RetrievalConfig(verify_cache="off", kb_warmup_s=0.5), encoder=encoder)
    assert name in str(err.value) and says in str(err.value), str(err.value)


def test_every_file_is_listed_and_verification_is_cached(copy, tmp_path):
    files = json.loads((copy / MANIFEST).read_text())["files"]
    assert {"passages.jsonl", "passages.offsets.npy", "dense/embeddings.npy", "dense/hnsw.faiss",
            "sparse/meta.json"} <= set(files)
    assert any(n.startswith("sparse/lucene/") for n in files)
    cache = tmp_path / "verified.json"
    assert {s for _, s in kb_files.verify(copy, files, cache)} == {"verified"}
    assert {s for _, s in kb_files.verify(copy, files, cache)} == {"cached"}
    random_hnsw(copy)  # changed after it was verified: its identity no longer matches the cache
    with pytest.raises(kb_files.KBFileError, match="dense/hnsw.faiss is corrupted"):
        kb_files.verify(copy, files, cache)  # Not "cached"


def test_offsets_that_disagree_at_runtime_answer_data_loss(copy):
    """Unverified (kb_verify off, or crafted with a matching checksum): a lookup through a bad offset is DATA_LOSS
    naming the file, not INTERNAL with a traceback."""
    edited_offsets(copy)
    store = PassageStore(copy)
    assert store.get([0])  # untouched rows still read
    with pytest.raises(DataLoss) as err:
        store.get([4])
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert "passages" in str(err.value) and str(copy) not in str(err.value), str(err.value)


def test_get_info_names_no_server_path(stub, kb_dir):
    info = stub.Info(knowledge_pb2.KnowledgeInfoRequest(), timeout=10)
    assert info.path == kb_dir.name  # Not the absolute path of the KB on the server
    assert str(kb_dir) not in info.manifest_json


_SERVER = """
import logging, sys
from retrieval_service.config import RetrievalConfig
from retrieval_service.server import build_server
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
running = build_server(RetrievalConfig(port=0, workers=4, kb=sys.argv[1], kb_retrievers="edr", verify_cache="off",
                                       kb_warmup_s=0.5))
print(running.address, flush=True)
sys.stdin.read()
running.stop(0)
"""


@pytest.mark.parametrize("name", ["passages.jsonl", "dense/embeddings.npy"])
def test_kb_file_truncated_under_a_running_server(copy, name):
    """The process survives (before: SIGBUS), the calls answer DATA_LOSS naming the file, the log names its path."""
    import subprocess
    import sys
    from pathlib import Path

    from proto import knowledge_pb2_grpc

    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(copy)], cwd=Path(__file__).resolve().parents[2],
                            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read()[-3000:]
        with grpc.insecure_channel(address) as ch:
            stub = knowledge_pb2_grpc.KnowledgeServiceStub(ch)

            def calls() -> list[str]:
                codes = []
                for call in (lambda: stub.Search(knowledge_pb2.SearchRequest(retriever="edr", k=50,
                                                                             texts=["capital of France"],
                                                                             with_text=True), timeout=60),
                             lambda: stub.GetDocuments(knowledge_pb2.GetDocumentsRequest(
                                 ids=np.arange(40, dtype="<i8").tobytes()), timeout=60)):
                    try:
                        call()
                        codes.append("OK")
                    except grpc.RpcError as e:
                        codes.append(e.code().name)
                        if e.code() == grpc.StatusCode.DATA_LOSS:
                            assert name in e.details() and str(copy) not in e.details(), e.details()
                return codes

            assert calls() == ["OK", "OK"]
            with open(copy / name, "r+b") as f:
                f.truncate(64)
            assert calls() == ["DATA_LOSS", "DATA_LOSS"]  # Not a dead server (-7)
            assert proc.poll() is None
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert str(copy / name) in proc.stderr.read()
