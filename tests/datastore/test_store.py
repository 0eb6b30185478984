"""On-disk datastores: atomic shards, mmap reopen, resume, refusal of corrupted or foreign files, invariants."""

import json
import mmap

import numpy as np
import pytest

from retrieval_service.datastore import shards as shards_mod
from retrieval_service.datastore.shards import DatastoreError, Shard, TokenizerMismatch
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore, check_datastore, verify_datastore

from . import reference as ref

TID = "test-tokenizer"


def corpus(seed: int = 0, n: int = 40, vocab: int = 6) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(0, 30)) for _ in range(n)]


def build(path, docs, **kw) -> SuffixArrayDatastore:
    return SuffixArrayDatastore.build(docs, path, vocab_size=kw.pop("vocab_size", 6), tokenizer_id=TID,
                                      progress=False, **kw)


def test_suffix_array_matches_brute_force():
    for seed in range(5):
        docs = corpus(seed, n=8)
        shard = Shard.from_documents(docs, vocab_size=6, tokenizer_id=TID)
        tokens = ref.concat([d.tolist() for d in docs])
        assert shard.sa.tolist() == ref.suffix_array(tokens)  # Not a byte-level order: uint16 tokens compare whole
        check_datastore(SuffixArrayDatastore([shard]))


def test_reopen_is_memory_mapped_and_drafts_the_same(tmp_path):
    docs = corpus()
    built = build(tmp_path / "ds", docs, shard_tokens=200)
    again = SuffixArrayDatastore.open(tmp_path / "ds", expected_tokenizer_id=TID)
    memory = SuffixArrayDatastore.from_documents(docs, vocab_size=6, tokenizer_id=TID)
    assert again.num_shards > 1 and again.num_tokens == memory.num_tokens == sum(len(d) for d in docs)
    assert again.num_documents == sum(1 for d in docs if len(d))  # empty documents are dropped
    for s in again.shards:
        assert isinstance(s._mmap, mmap.mmap) and not s.tokens.flags.writeable and not s.sa.flags.writeable
    assert again.bytes_on_disk == sum(p.stat().st_size for p in (tmp_path / "ds").iterdir())
    rng = np.random.default_rng(3)
    for _ in range(20):
        ctx = rng.integers(0, 6, rng.integers(1, 10))
        a, b, c = built.draft(ctx, min_suffix=1), again.draft(ctx, min_suffix=1), memory.draft(ctx, min_suffix=1)
        assert a.paths() == b.paths() == c.paths()  # below the 5000-match cap shards equal one big store
    single = SuffixArrayDatastore.open(tmp_path / "ds" / "shard-00000.rsa")  # one shard file opens too
    assert single.num_shards == 1
    assert check_datastore(tmp_path / "ds")["num_tokens"] == again.num_tokens


def test_interrupted_build_resumes_at_the_next_missing_shard(tmp_path):
    docs = corpus(1, n=60)

    def interrupted():
        for i, d in enumerate(docs):
            if i == 45:
                raise KeyboardInterrupt
            yield d

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "ds", interrupted(), shard_tokens=150, resume_key="corpus-1")
    done = sorted(p.name for p in (tmp_path / "ds").glob("shard-*.rsa"))
    assert done and not (tmp_path / "ds" / shards_mod.MANIFEST).exists()
    with pytest.raises(DatastoreError, match="did not finish"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    mtimes = {n: (tmp_path / "ds" / n).stat().st_mtime_ns for n in done}
    resumed = build(tmp_path / "ds", docs, shard_tokens=150, resume_key="corpus-1")
    assert {n: (tmp_path / "ds" / n).stat().st_mtime_ns for n in done} == mtimes  # finished shards untouched
    fresh = build(tmp_path / "fresh", docs, shard_tokens=150)
    assert [s.header["sections"] for s in resumed.shards] == [s.header["sections"] for s in fresh.shards]
    with pytest.raises(DatastoreError, match="another corpus"):
        build(tmp_path / "ds", docs, shard_tokens=150, resume_key="corpus-2")
    with pytest.raises(DatastoreError, match="not empty"):
        build(tmp_path / "ds", docs)


def test_limit_tokens_truncates_exactly(tmp_path):
    ds = build(tmp_path / "ds", corpus(2), limit_tokens=101, shard_tokens=40)
    assert ds.num_tokens == 101


def test_wrong_tokenizer_is_refused(tmp_path):
    build(tmp_path / "ds", corpus())
    with pytest.raises(TokenizerMismatch, match="built with tokenizer 'test-tokenizer'.*'vocab49152-other'"):
        SuffixArrayDatastore.open(tmp_path / "ds", expected_tokenizer_id="vocab49152-other")


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupted_files_are_refused(tmp_path):
    ds = build(tmp_path / "ds", corpus())
    shard_path = ds.shards[0].path
    header, data_start = shards_mod.read_header(shard_path)
    del ds

    # A flipped data bit passes the structural check (verify=False) but not the content verification open() runs.
    _flip(shard_path, data_start + header["sections"]["sa"]["offset"] + 1)
    SuffixArrayDatastore.open(tmp_path / "ds", verify=False)
    with pytest.raises(DatastoreError, match="section 'sa' checksum"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    with pytest.raises(DatastoreError, match="section 'sa' checksum"):
        verify_datastore(tmp_path / "ds")
    with pytest.raises(DatastoreError, match="checksum"):
        check_datastore(tmp_path / "ds")

    # A flipped header bit or a truncated file fails at open.
    _flip(shard_path, data_start + header["sections"]["sa"]["offset"] + 1)  # undo
    _flip(shard_path, 30)
    with pytest.raises(DatastoreError, match="header checksum"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    _flip(shard_path, 30)  # undo
    shard_path.write_bytes(shard_path.read_bytes()[: data_start + 100])
    with pytest.raises(DatastoreError, match="truncated"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    shard_path.write_bytes(b"not a shard at all, just some text")
    with pytest.raises(DatastoreError, match="magic"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    (tmp_path / "ds" / shards_mod.MANIFEST).write_text("{")
    with pytest.raises(DatastoreError, match="corrupted"):
        SuffixArrayDatastore.open(tmp_path / "ds")
    with pytest.raises(DatastoreError, match="does not exist"):
        SuffixArrayDatastore.open(tmp_path / "nowhere")


def test_invariant_checker_catches_a_broken_suffix_array(tmp_path):
    good = Shard.from_documents(corpus(4), vocab_size=6, tokenizer_id=TID)
    sa = good.sa.copy()
    sa[3], sa[4] = sa[4], sa[3]  # still a permutation, checksums recomputed on write: only order is wrong
    broken = Shard(good.tokens, sa, good.bucket, good.doc_starts, dict(good.header))
    broken.write(tmp_path / "broken.rsa")
    SuffixArrayDatastore.open(tmp_path / "broken.rsa")  # structurally fine
    with pytest.raises(DatastoreError, match="suffix array broken at index 3: suffixes out of order"):
        check_datastore(tmp_path / "broken.rsa")

    sa = good.sa.copy()
    sa[0] = sa[1]
    Shard(good.tokens, sa, good.bucket, good.doc_starts, dict(good.header)).write(tmp_path / "dup.rsa")
    with pytest.raises(DatastoreError, match="duplicate entry"):
        check_datastore(tmp_path / "dup.rsa")

    tokens = good.tokens.copy()
    tokens[int(good.doc_starts[1]) - 1] = 2  # a separator overwritten: two documents run together
    Shard(tokens, good.sa, good.bucket, good.doc_starts, dict(good.header)).write(tmp_path / "sep.rsa")
    with pytest.raises(DatastoreError, match="not closed by exactly one separator"):
        check_datastore(tmp_path / "sep.rsa")


def test_bad_documents_are_named():
    with pytest.raises(ValueError, match=r"document 1 holds token ids 0..9 outside the vocabulary \[0, 6\)"):
        Shard.from_documents([np.array([1]), np.array([0, 9])], vocab_size=6, tokenizer_id=TID)
    with pytest.raises(ValueError, match="vocab_size"):
        Shard.from_documents([np.array([1])], vocab_size=0, tokenizer_id=TID)


def test_manifest_lists_every_shard(tmp_path):
    ds = build(tmp_path / "ds", corpus(), shard_tokens=100)
    manifest = json.loads((tmp_path / "ds" / shards_mod.MANIFEST).read_text())
    assert [s["file"] for s in manifest["shards"]] == [s.path.name for s in ds.shards]
    assert manifest["num_tokens"] == ds.num_tokens and manifest["tokenizer_id"] == TID
    ds.shards[1].write(tmp_path / "ds" / "shard-00099.rsa")  # a stray shard the manifest does not know
    with pytest.raises(DatastoreError, match="does not list"):
        SuffixArrayDatastore.open(tmp_path / "ds")
