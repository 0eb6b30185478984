"""Store files changed under a running retrieval server (an in-place `cp`, a `truncate`): the process survives,
the affected Drafts get DATA_LOSS naming the file relative to its store (no server path), the DraftService and
the overall health turn NOT_SERVING, and the server's log names the file. Before: SIGBUS killed the process on
the first Draft that read a vanished page, or it served drafts from bytes nobody verified.

The server runs in a child process, so a crash shows up as a failed test rather than the end of the test run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import draft_pb2, draft_pb2_grpc
from ragcore.wire import pack_tokens
from retrieval_service.datastore import ngram_store, shards as shards_mod
from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore
from tests.datastore.test_corruption import TID, VOCAB, documents

ROOT = Path(__file__).resolve().parents[2]
_SERVER = textwrap.dedent("""
    import logging, sys
    from retrieval_service.config import RetrievalConfig
    from retrieval_service.server import build_server
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    running = build_server(RetrievalConfig(port=0, workers=4, datastore=sys.argv[1], crest=sys.argv[2],
                                           verify_cache="off"))
    print(running.address, flush=True)
    sys.stdin.read()  # until the test closes stdin
    running.stop(0)
""")


def _stores(root: Path, seed: int) -> tuple[Path, Path]:
    ds_dir = root / "ds"
    ds = SuffixArrayDatastore.build(documents(seed), ds_dir, vocab_size=VOCAB, tokenizer_id=TID, progress=False)
    crest = root / "store.crest"
    build_store(ds, crest, max_n=4, t=400, progress=False)
    return ds_dir, crest


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The stores a server opens (seed 0) and others of the same tokenizer to copy over them (seed 1)."""
    return _stores(tmp_path_factory.mktemp("a"), 0), _stores(tmp_path_factory.mktemp("b"), 1)


def _truncate(target: Path, _other: Path) -> None:
    os.truncate(target, os.path.getsize(target) // 3)


def _copy_in_place(target: Path, other: Path) -> None:
    shutil.copyfile(other, target)  # open(target, "wb"): the same inode, truncated, then rewritten


# (store, change): every combination must end with DATA_LOSS and a live process.
CASES = [("shard", _truncate), ("shard", _copy_in_place), ("crest", _truncate), ("crest", _copy_in_place)]


@pytest.mark.parametrize("store,change", CASES, ids=[f"{s}-{c.__name__.strip('_')}" for s, c in CASES])
def test_store_changed_under_a_running_server(built, tmp_path, store, change):
    (ds_src, crest_src), (other_ds, other_crest) = built
    ds_dir, crest = tmp_path / "ds", tmp_path / "store.crest"
    shutil.copytree(ds_src, ds_dir)
    shutil.copyfile(crest_src, crest)
    target = ds_dir / shards_mod.shard_name(0) if store == "shard" else crest
    other = other_ds / shards_mod.shard_name(0) if store == "shard" else other_crest
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(ds_dir), str(crest)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        address = proc.stdout.readline().strip()
        assert address, proc.stderr.read()[-3000:]
        params = draft_pb2.DraftParams(source="datastore" if store == "shard" else "crest")
        contexts = [d[:12] for d in documents(0, n=40)]
        with grpc.insecure_channel(address) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)

            def draft(ctx) -> tuple[str, str]:
                try:
                    reply = stub.Draft(draft_pb2.DraftRequest(context=pack_tokens(ctx), params=params), timeout=30)
                    return "OK", str(len(reply.tokens))
                except grpc.RpcError as e:
                    return e.code().name, e.details()

            before = [draft(c) for c in contexts[:10]]
            assert [code for code, _ in before] == ["OK"] * 10
            assert any(n != "0" for _, n in before)  # the drafts read the store
            # Drafts keep running while the file changes (the race an in-place copy on a busy server runs).
            racing: list[tuple[str, str]] = []
            racer = threading.Thread(target=lambda: racing.extend(draft(c) for c in contexts * 2))
            racer.start()
            change(target, other)
            racer.join(120)
            after = [draft(c) for c in contexts]
            assert proc.poll() is None, f"server died with {proc.returncode}"  # Not -7 (SIGBUS)
            codes = [code for code, _ in racing + after]
            assert set(codes) <= {"OK", "DATA_LOSS"}, codes  # Not UNAVAILABLE (a dead server) or UNKNOWN
            assert [code for code, _ in after] == ["DATA_LOSS"] * len(after)  # Not OK from unverified bytes
            detail = after[0][1]
            assert target.name in detail and str(tmp_path) not in detail, detail  # no server path to clients
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("ragserve.v1.DraftService", ""):
                status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
                assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            info = stub.Info(draft_pb2.DatastoreInfoRequest(), timeout=5)  # still answering
            assert info.num_shards == 1 and info.path == "ds", info.path  # Not the server's path
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log = proc.stderr.read()
    assert str(target) in log, log[-3000:]  # the server's own log names the file with its path


def test_an_unchanged_store_is_not_flagged(tmp_path):
    """The check never fires on a file left alone (or only read, or given another name by a hard link)."""
    ds_dir, crest = _stores(tmp_path, 0)
    ds = SuffixArrayDatastore.open(ds_dir)
    store = ngram_store.EmbeddedNgramStore.open(crest)
    os.link(crest, tmp_path / "link.crest")
    for d in documents(0, n=20):
        ds.draft(d[:12])
        ds.draft_batch([d[:12], d[:5]])
        store.lookup(d[:12])
    assert all(s.guard.change() is None for s in ds.shards)
