"""Tree encoding, the embedded store's lookup (longest stored suffix first) and its refusal of damaged files."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ragcore.draft_tree import DraftTree
from retrieval_service.datastore.crest_build import build_store
from retrieval_service.datastore.ngram_codec import Codec, decode_payload, encode_payload, trim_tree
from retrieval_service.datastore.ngram_store import (
    EmbeddedNgramStore,
    NgramStoreError,
    StoreRecords,
    TokenizerMismatch,
    write_store,
)

from .conftest import TID, VOCAB, corpus, datastore_of

U16 = np.dtype(np.uint16)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parents, b.parents)
            and np.array_equal(a.scores, b.scores) and a.matched_suffix == b.matched_suffix
            and a.num_matches == b.num_matches)


# ----------------------------------------------------------------------------------------------------------------
# Encoding


def test_payload_worked_example():
    raw = encode_payload(np.array([7, 9, 8]), np.array([-1, -1, 0]), np.array([2, 1, 1]), 2, U16)
    assert raw.hex() == "03" "0200" "0700" "0900" "0800" "000001" "0200" "0100" "0100"  # the docstring's layout
    tokens, parents, counts, m = decode_payload(raw, U16)
    assert tokens.tolist() == [7, 9, 8] and parents.tolist() == [-1, -1, 0]  # Not parents + 1
    assert counts.tolist() == [2.0, 1.0, 1.0] and m == 2


def test_payload_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError, match="at most 255 nodes, got 256"):
        encode_payload(np.zeros(256), np.full(256, -1), np.ones(256), 1, U16)
    with pytest.raises(ValueError, match="counts must be integers in \\[0, 65535\\], got 1.0..70000.0"):
        encode_payload(np.array([1, 2]), np.array([-1, -1]), np.array([1.0, 70000.0]), 1, U16)
    with pytest.raises(ValueError, match="num_matches must lie in \\[0, 65535\\], got 70000"):
        encode_payload(np.array([1]), np.array([-1]), np.array([1]), 70000, U16)


@st.composite
def bfs_trees(draw):
    n = draw(st.integers(0, 40))
    parents = [-1 if i == 0 else draw(st.integers(-1, i - 1)) for i in range(n)]
    parents.sort()  # a non-decreasing parent list is a valid BFS order
    return (np.array(draw(st.lists(st.integers(0, 70_000), min_size=n, max_size=n)), np.int64),
            np.array(parents, np.int64), np.array(draw(st.lists(st.integers(0, 65535), min_size=n, max_size=n))),
            draw(st.integers(0, 65535)))


@settings(max_examples=80, deadline=None)
@given(tree=bfs_trees(), compression=st.sampled_from(["zstd", "none"]), wide=st.booleans())
def test_payload_round_trip(tree, compression, wide):
    tokens, parents, counts, m = tree
    tok = np.dtype(np.uint32) if wide else U16
    tokens = tokens if wide else tokens % 65535
    codec = Codec(compression)
    t, p, c, mm = decode_payload(codec.decompress(codec.compress(encode_payload(tokens, parents, counts, m, tok))),
                                 tok)
    assert t.tolist() == tokens.tolist() and p.tolist() == parents.tolist()
    assert c.tolist() == counts.astype(float).tolist() and mm == m


def test_trim_scenarios():
    # Tree: a(5) -> b(3), a -> c(3), d(4); BFS [a, d, b, c].
    t, p, c = np.array([1, 4, 2, 3], np.int32), np.array([-1, -1, 0, 0], np.int32), np.array([5, 4, 3, 3], np.float32)
    tt, pp, cc = trim_tree(t, p, c, 3)
    assert tt.tolist() == [1, 4, 2] and pp.tolist() == [-1, -1, 0]  # Not [1, 2, 3]: d (4) outranks b and c (3)
    tt, pp, _ = trim_tree(t, p, c, 1)
    assert tt.tolist() == [1] and pp.tolist() == [-1]
    # Ties at equal depth keep the earlier (path-order) node.
    tt, _, _ = trim_tree(np.array([1, 2, 3], np.int32), np.array([-1, -1, -1], np.int32),
                         np.array([2, 2, 2], np.float32), 2)
    assert tt.tolist() == [1, 2]  # Not [2, 3]


# ----------------------------------------------------------------------------------------------------------------
# Lookup


@pytest.fixture(scope="module")
def built(small_ds, tmp_path_factory):
    path = tmp_path_factory.mktemp("crest") / "small.crest"
    report = build_store(small_ds, path, max_n=3, t=25, progress=False)
    return EmbeddedNgramStore.open(path), report


def brute_lookup(small_ds, stored: set, ctx: list[int], max_n: int, max_nodes: int) -> DraftTree:
    """Reference: the longest suffix that is a stored key, its tree drafted by REST from scratch."""
    for n in range(min(max_n, len(ctx)), 0, -1):
        if tuple(ctx[-n:]) in stored:
            return small_ds.draft(ctx[-n:], max_suffix=n, min_suffix=n, max_nodes=max_nodes)
    return DraftTree.empty()


def test_lookup_matches_brute_force(small_ds, built):
    store, _ = built
    assert store.check()["num_records"] == store.num_records
    stored = {tuple(k.tolist()) for k, _ in store.items()}
    rng = np.random.default_rng(1)
    docs = corpus()
    hits = 0
    for _ in range(300):
        d = docs[rng.integers(0, len(docs))] + [int(rng.integers(0, VOCAB))]
        end = int(rng.integers(1, len(d) + 1))
        ctx = d[max(0, end - 6):end]
        for max_nodes in (64, 5, 1, 0):
            got = store.lookup(ctx, max_nodes)
            want = brute_lookup(small_ds, stored, ctx, 3, max_nodes)
            assert same_tree(got, want), (ctx, max_nodes, got, want)
            hits += got.matched_suffix > 0
    assert hits > 100  # the scenarios exercise real hits


def test_lookup_scenarios(tmp_path):
    ds = datastore_of([[[1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 6], [2, 3, 7, 8]]], vocab_size=12)
    # Store only (2, 3) and (1, 2, 3): the longest stored suffix wins, a missing longer one falls back.
    keys = [np.array([2, 3]), np.array([1, 2, 3])]
    trees = [ds.draft(k, max_suffix=len(k), min_suffix=len(k)) for k in keys]
    codec = Codec("none")
    payloads = [codec.compress(encode_payload(t.tokens, t.parents, t.scores, t.num_matches, U16)) for t in trees]
    path = write_store(tmp_path / "s.crest", StoreRecords(keys, payloads, b"", "none"),
                       {"tokenizer_id": TID, "vocab_size": 12, "max_n": 3})
    store = EmbeddedNgramStore.open(path)
    tree = store.lookup([0, 1, 2, 3])
    assert tree.matched_suffix == 3 and tree.paths() == [[4], [5]]  # Not the (2, 3) tree [[4], [5], [6], [7] ...]
    tree = store.lookup([9, 2, 3])  # (9, 2, 3) is not stored -> (2, 3)
    assert tree.matched_suffix == 2 and [4] in tree.paths() and [7, 8] in tree.paths()
    assert store.lookup([5, 3]).matched_suffix == 0  # Not a hit on (3,): 1-grams are not stored here
    assert store.lookup([]).paths() == []
    assert len(store.lookup([2, 3], max_nodes=2)) == 2
    with pytest.raises(ValueError, match="max_nodes must be an integer >= 0, got -1"):
        store.lookup([2, 3], max_nodes=-1)
    with pytest.raises(ValueError, match="context_ids must be 1-D"):
        store.lookup([[2, 3]])


def test_tree_stats_per_n(built):
    store, report = built
    stats = store.tree_stats()
    assert set(stats) == {1, 2, 3}
    assert all(0 < s["mean_nodes"] <= 64 for s in stats.values())
    assert sum(s["ngrams"] for s in stats.values()) == store.num_records == sum(report["take"].values())


# ----------------------------------------------------------------------------------------------------------------
# Damaged files


def _damaged(src, tmp_path, name, mutate):
    data = bytearray(src.read_bytes())
    mutate(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def test_corrupted_store_is_refused_at_open(built, tmp_path):
    store, _ = built
    src = store.path
    size = src.stat().st_size

    def flip_last(data):
        data[size - 100] ^= 0xFF  # inside the records / dictionary

    cases = [
        ("flip.crest", flip_last, "is corrupted: section '(records|zdict)' checksum"),
        ("magic.crest", lambda d: d.__setitem__(slice(0, 8), b"NOTCREST"), "is not a CREST store"),
        ("header.crest", lambda d: d.__setitem__(30, d[30] ^ 1), "header checksum mismatch"),
        ("cut.crest", lambda d: d.__delitem__(slice(size - 200, size)), "truncated or corrupted"),
        ("empty.crest", lambda d: d.__delitem__(slice(0, size)), "not a CREST store \\(only 0 bytes\\)"),
    ]
    for name, mutate, message in cases:
        with pytest.raises(NgramStoreError, match=message):  # Not an open store that drafts garbage
            EmbeddedNgramStore.open(_damaged(src, tmp_path, name, mutate))
    with pytest.raises(NgramStoreError, match="does not exist"):
        EmbeddedNgramStore.open(tmp_path / "missing.crest")
    with pytest.raises(TokenizerMismatch, match="was built with tokenizer 'test-tokenizer'"):
        EmbeddedNgramStore.open(src, expected_tokenizer_id="another-tokenizer")
