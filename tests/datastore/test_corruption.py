"""Corrupted datastores: refused at load with a message naming the file, per kind of damage; a store whose content
is bad behind valid checksums (crafted, or changed after the check) makes Draft fail with DATA_LOSS, never a wild
read (before: SERVING, then signal 11 on the 10th Draft, or garbage drafts)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import draft_pb2, draft_pb2_grpc
from ragcore.wire import pack_tokens
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore import shards as shards_mod
from retrieval_service.datastore.shards import DatastoreError, Shard
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

TID = "test-tokenizer"
VOCAB = 1000


def documents(seed: int = 0, n: int = 300) -> list[np.ndarray]:
    """Repetitive enough that drafts match: tokens drawn from a few hundred n-gram patterns."""
    rng = np.random.default_rng(seed)
    patterns = [rng.integers(0, VOCAB, 12) for _ in range(40)]
    return [np.concatenate([patterns[j] for j in rng.integers(0, len(patterns), rng.integers(3, 20))])
            for _ in range(n)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "ds"
    SuffixArrayDatastore.build(documents(), path, vocab_size=VOCAB, tokenizer_id=TID, progress=False)
    return path


@pytest.fixture
def copy(pristine, tmp_path):
    out = tmp_path / "ds"
    shutil.copytree(pristine, out)
    shard = out / shards_mod.shard_name(0)
    header, data_start = shards_mod.read_header(shard)
    return out, shard, header, data_start


def _overwrite(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _section(header, data_start, name) -> tuple[int, int]:
    s = header["sections"][name]
    return data_start + s["offset"], s["nbytes"]


def truncated(shard, header, data_start):
    start, _ = _section(header, data_start, "sa")
    with open(shard, "r+b") as f:
        f.truncate(start + 100)


def flipped_header(shard, header, data_start):
    b = shard.read_bytes()[30]  # inside the JSON header
    _overwrite(shard, 30, bytes([b ^ 0x01]))


def garbage_suffix_array(shard, header, data_start):
    start, n = _section(header, data_start, "sa")
    _overwrite(shard, start, np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8).tobytes())


def garbage_tokens(shard, header, data_start):
    # Every token replaced by another valid token id: no value is out of range, only the checksum can tell.
    start, n = _section(header, data_start, "tokens")
    tokens = np.frombuffer(shard.read_bytes()[start:start + n], "<u2").copy()
    keep = tokens == np.iinfo(np.uint16).max  # separators stay (the structure check would see them otherwise)
    tokens[~keep] = np.random.default_rng(2).integers(0, VOCAB, int((~keep).sum()))
    _overwrite(shard, start, tokens.astype("<u2").tobytes())


def flipped_bucket_bit(shard, header, data_start):
    start, _ = _section(header, data_start, "bucket")
    b = shard.read_bytes()[start + 8 * 5 + 2]
    _overwrite(shard, start + 8 * 5 + 2, bytes([b ^ 0x10]))


# (kind, damage, what the message must say besides the file name)
KINDS = [
    ("truncated", truncated, "truncated"),
    ("flipped header", flipped_header, "header checksum"),
    ("garbage suffix array", garbage_suffix_array, "corrupted"),
    ("garbage tokens", garbage_tokens, "section 'tokens' checksum"),
    ("flipped bucket bit", flipped_bucket_bit, "section 'bucket' checksum"),
]


@pytest.mark.parametrize("kind,damage,says", KINDS, ids=[k[0] for k in KINDS])
def test_damaged_store_is_refused_naming_the_file(copy, kind, damage, says):
    path, shard, header, data_start = copy
    damage(shard, header, data_start)
    with pytest.raises(DatastoreError) as err:
        SuffixArrayDatastore.open(path)
    assert str(shard) in str(err.value) and says in str(err.value), str(err.value)
    # The server refuses it too, before reporting SERVING (build_server raises; serve() exits 2 with the message).
    from retrieval_service.server import build_server

    with pytest.raises(DatastoreError, match=says):
        build_server(RetrievalConfig(port=0, datastore=str(path), verify_cache="off"))


def test_a_pristine_store_opens_and_the_verification_is_cached(copy, tmp_path):
    path, shard, _, _ = copy
    cache = tmp_path / "verified.json"
    assert SuffixArrayDatastore.open(path, verify_cache=cache).verification == [(shard, "verified")]
    assert SuffixArrayDatastore.open(path, verify_cache=cache).verification == [(shard, "cached")]
    # Changed after it was verified: the identity (size, mtime, ctime, inode, header) no longer matches.
    garbage_tokens(shard, *shards_mod.read_header(shard))
    with pytest.raises(DatastoreError, match="section 'tokens' checksum"):
        SuffixArrayDatastore.open(path, verify_cache=cache)  # Not "cached"


# Crafted stores: the content is wrong, the checksums match it (written through Shard.write).
def _crafted(tmp_path, kind: str):
    good = Shard.from_documents(documents(), vocab_size=VOCAB, tokenizer_id=TID)
    tokens, sa, bucket = good.tokens.copy(), good.sa.copy(), good.bucket.copy()
    n = len(tokens)
    rng = np.random.default_rng(3)
    if kind == "suffix-array entries out of range":
        sa[rng.integers(0, n, n // 2)] = rng.integers(n, 2**31 - 1, n // 2)
    elif kind == "tokens out of vocabulary":
        inner = np.flatnonzero(tokens != np.iinfo(np.uint16).max)
        tokens[rng.choice(inner, len(inner) // 2, replace=False)] = VOCAB + 7
    elif kind == "bucket table out of range":
        bucket[VOCAB // 2:] = n * 4
        bucket[-1] = good.num_tokens  # keeps the fast structural check happy
    path = tmp_path / f"{kind.replace(' ', '-')}.rsa"
    Shard(tokens, sa, bucket, good.doc_starts, dict(good.header)).write(path)
    return path


CRAFTED = [
    ("suffix-array entries out of range", "suffix-array entry"),
    ("tokens out of vocabulary", "outside the vocabulary"),
    ("bucket table out of range", "bucket table"),
]


@pytest.mark.parametrize("kind,says", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_content_is_refused_by_the_range_checks(tmp_path, kind, says):
    path = _crafted(tmp_path, kind)
    with pytest.raises(DatastoreError) as err:
        SuffixArrayDatastore.open(path)  # checksums match: the range checks of the same pass catch it
    assert str(path) in str(err.value) and says in str(err.value), str(err.value)


@pytest.mark.parametrize("kind,says", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_kernels_refuse_out_of_range_reads(tmp_path, kind, says):
    """Unverified (verify=False), drafting must raise DatastoreCorrupted, not crash or return garbage. In a child
    process, so a wild read shows up as a failed test instead of killing the test run."""
    path = _crafted(tmp_path, kind)
    script = textwrap.dedent(f"""
        import numpy as np
        from retrieval_service.datastore.shards import DatastoreCorrupted
        from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
        from tests.datastore.test_corruption import documents
        ds = SuffixArrayDatastore.open({str(path)!r}, verify=False)
        contexts = [d[:n] for d in documents(seed=0, n=60) for n in (4, 9, 17, 30) if len(d) >= n]
        errors, last = 0, ""
        for source in ("datastore", "merged"):
            for c in contexts:
                try:
                    tree = ds.draft(c, source=source)
                except DatastoreCorrupted as e:
                    errors += 1
                    last = str(e)
                    continue
                assert int(tree.tokens.max(initial=0)) < {VOCAB}, "a garbage token was drafted"
            try:
                ds.draft_batch(contexts, source=source)
            except DatastoreCorrupted as e:
                errors += 1
        print("errors", errors)
        print("message", last)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])  # Not -11 (SIGSEGV)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert int(lines["errors"]) > 0, out.stdout
    message = lines["message"]
    assert path.name in message and str(path.parent) not in message and "corrupted" in message, message


def test_server_answers_data_loss_and_leaves_serving(tmp_path):
    """A store that turns bad after the check: Draft gets DATA_LOSS naming the file, health says NOT_SERVING for
    the DraftService, the server keeps answering everything else."""
    from retrieval_service.server import build_server

    path = tmp_path / "good.rsa"
    Shard.from_documents(documents(), vocab_size=VOCAB, tokenizer_id=TID).write(path)
    running = build_server(RetrievalConfig(port=0, datastore=str(path), verify_cache="off"))  # verified: fine
    # Then the file changes under the running server (the map is shared: it sees the new bytes).
    header, data_start = shards_mod.read_header(path)
    start, n = _section(header, data_start, "sa")
    _overwrite(path, start, np.full(n // 4, 2**30, "<i4").tobytes())
    try:
        with grpc.insecure_channel(running.address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            health = health_pb2_grpc.HealthStub(ch)
            codes = []
            for doc in documents(seed=0, n=40):
                try:
                    stub.Draft(draft_pb2.DraftRequest(context=pack_tokens(doc[:20])), timeout=30)
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
                    if e.code() == grpc.StatusCode.DATA_LOSS:  # the file, not where the server keeps it
                        assert path.name in e.details() and str(tmp_path) not in e.details(), e.details()
            assert "DATA_LOSS" in codes and set(codes) <= {"OK", "DATA_LOSS"}, codes  # Not UNKNOWN / a crash
            for service in ("ragserve.v1.DraftService", ""):  # the overall status too (orchestrators read it)
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            assert stub.Info(draft_pb2.DatastoreInfoRequest(), timeout=5).num_shards == 1  # still answering
    finally:
        running.stop(0)


STDLIB = Path(os.environ.get("RAGSERVE_HOME", Path.home() / ".cache" / "ragserve")) / "datastores" / "stdlib"


@pytest.mark.skipif(not (STDLIB / "datastore.json").exists(), reason="stdlib datastore not prepared")
def test_verifying_the_stdlib_store_is_fast():
    path = STDLIB
    SuffixArrayDatastore.open(path)  # page cache warm, kernels compiled
    t0 = time.perf_counter()
    ds = SuffixArrayDatastore.open(path)
    took = time.perf_counter() - t0
    assert ds.verification and all(state == "verified" for _, state in ds.verification)
    print(f"verified {ds.bytes_on_disk / 1e6:.0f} MB in {took * 1e3:.0f} ms")
    assert took < 2.0, took
