"""Drafting against the brute-force reference: prompt lookup, REST over shards, merged sources."""

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from ragcore.draft_tree import DraftTree, context_draft
from retrieval_service.datastore.shards import Shard
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

from . import reference as ref

TID = "test-tokenizer"


def store(shard_docs: list[list[list[int]]], vocab_size: int = 8) -> SuffixArrayDatastore:
    shards = [Shard.from_documents([np.array(d, np.int64) for d in docs], vocab_size=vocab_size, tokenizer_id=TID)
              for docs in shard_docs]
    return SuffixArrayDatastore(shards)


def expect(rows, weights, max_nodes):
    paths, _, parents, scores = ref.tree(rows, weights, max_nodes)
    return paths, parents, scores


# --------------------------------------------------------------------------------------------------------------
# Scenario tables


def test_context_draft_scenarios():
    ctx = [3, 4, 5, 3, 4, 6, 3, 4]
    # Prompt lookup: both earlier continuations of [3, 4], most recent first, same count -> token order.
    assert context_draft(ctx, min_suffix=2, continuation=1).paths() == [[5], [6]]  # Not [] or [[6], [5]]
    # The longest repeated suffix wins: [4, 6, 3, 4]? no; [3, 4] (len 2) is the longest that repeats.
    assert context_draft(ctx, min_suffix=1).context_matched_suffix == 2  # Not 1 (a shorter match)
    # No repeat of at least min_suffix tokens -> empty tree.
    assert context_draft([1, 2, 3, 4], min_suffix=1).paths() == []  # Not [[2]]
    # An occurrence may overlap the suffix itself (runs of one token): [9] ends at 2 and 1 -> rows [9] and [9, 9].
    assert context_draft([5, 9, 9, 9], max_suffix=1, min_suffix=1, continuation=2).paths() == [[9], [9, 9]]
    # max_matches keeps the most recent occurrences.
    assert context_draft([1, 7, 1, 8, 1], min_suffix=1, max_matches=1, continuation=1).paths() == [[8]]  # Not [[7]]


def test_datastore_scenarios():
    ds = store([[[1, 2, 3, 4], [1, 2, 3, 5], [2, 3, 5, 6], [7, 2, 3]]])
    # REST: longest suffix [1, 2, 3] matches twice; its continuations 4 and 5 each count 1.
    tree = ds.draft([0, 1, 2, 3], max_suffix=4, min_suffix=1)
    assert (tree.matched_suffix, tree.num_matches) == (3, 2)  # Not (2, 4): the longest suffix wins
    assert tree.paths() == [[4], [5]]  # Not [[5], [5, 6], ...] from the shorter suffix [2, 3]
    # Continuations stop at the document end: [7, 2, 3] ends a document, so nothing follows there.
    tree = ds.draft([7, 2, 3], max_suffix=3, min_suffix=1)
    assert tree.paths() == []  # Not [[2]] (the start of the next document)
    # A suffix that occurs nowhere falls back to shorter ones, down to min_suffix.
    assert ds.draft([6, 6, 5], min_suffix=1).paths() == [[6]]  # Not []: [5] matches, followed by 6
    assert ds.draft([6, 6, 5], min_suffix=2).paths() == []  # Not [[6]]: [6, 5] does not occur
    # Merged: the context's own continuation joins the datastore's in one trie.
    tree = ds.draft([1, 2, 3, 0, 1, 2, 3], max_suffix=4, min_suffix=1, source="merged", context_min_suffix=1)
    assert tree.paths()[:3] == [[0], [4], [5]]  # Not [[4], [5]] only (datastore-only REST)
    assert tree.context_matched_suffix == 3


def test_even_sampling_is_spread_over_the_range():
    # Ten occurrences of [1]: continuations 0,0,0,0,0,2,2,2,2,2 in suffix-array order.
    docs = [[1, 0]] * 5 + [[1, 2]] * 5
    ds = store([docs])
    even = ds.draft([1], min_suffix=1, max_matches=2, continuation=1)
    first = ds.draft([1], min_suffix=1, max_matches=2, continuation=1, sampling="first")
    assert even.paths() == [[0], [2]]  # Not [[0]]: evenly spaced picks see both halves
    assert first.paths() == [[0]]  # REST's first-k sees only the smallest continuations


# --------------------------------------------------------------------------------------------------------------
# Property tests (small vocabularies so matches are frequent)

doc_st = st.lists(st.integers(0, 3), min_size=0, max_size=25)
knobs = dict(max_suffix=st.integers(1, 6), min_suffix=st.integers(1, 6), max_matches=st.integers(1, 30),
             continuation=st.integers(1, 6), max_nodes=st.integers(0, 20))


def _context(draw, docs):
    """A context that often ends with a fragment of a document (so long suffixes match)."""
    noise = draw(st.lists(st.integers(0, 4), max_size=6))
    flat = [t for d in docs for t in d]
    if flat and draw(st.booleans()):
        a = draw(st.integers(0, len(flat) - 1))
        b = draw(st.integers(a + 1, min(len(flat), a + 8)))
        noise = noise + flat[a:b]
    return noise or [draw(st.integers(0, 3))]


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=30), data=st.data(), **knobs)
def test_context_draft_matches_reference(ctx, data, max_suffix, min_suffix, max_matches, continuation, max_nodes):
    assume(min_suffix <= max_suffix)
    tree = context_draft(ctx, max_suffix, min_suffix, max_matches, continuation, max_nodes)
    tree.validate()
    length, rows = ref.context_rows(ctx, max_suffix, min_suffix, max_matches, continuation)
    paths, parents, scores = expect(rows, [1.0] * len(rows), max_nodes)
    assert tree.context_matched_suffix == length
    assert tree.paths() == paths and tree.parents.tolist() == parents
    assert np.array_equal(tree.scores, scores)


@settings(max_examples=300, deadline=None)
@given(shard_docs=st.lists(st.lists(doc_st, min_size=1, max_size=5), min_size=1, max_size=3),
       sample_first=st.booleans(), data=st.data(), **knobs)
def test_datastore_draft_matches_reference(shard_docs, sample_first, data, max_suffix, min_suffix, max_matches,
                                           continuation, max_nodes):
    assume(min_suffix <= max_suffix)
    assume(any(len(d) for docs in shard_docs for d in docs))
    shard_docs = [docs for docs in shard_docs if any(len(d) for d in docs)]
    ctx = data.draw(st.composite(lambda draw: _context(draw, [d for ds in shard_docs for d in ds]))())
    ds = store(shard_docs)
    tree = ds.draft(ctx, max_suffix, min_suffix, max_matches, continuation, max_nodes,
                    sampling="first" if sample_first else "even")
    tree.validate(vocab_size=8)
    length, rows = ref.datastore_rows(shard_docs, ctx, max_suffix, min_suffix, max_matches, continuation, sample_first)
    paths, parents, scores = expect(rows, [1.0] * len(rows), max_nodes)
    assert (tree.matched_suffix, tree.num_matches) == (length, len(rows))
    assert tree.paths() == paths and tree.parents.tolist() == parents
    assert np.array_equal(tree.scores, scores)


@settings(max_examples=300, deadline=None)
@given(shard_docs=st.lists(st.lists(doc_st, min_size=1, max_size=5), min_size=1, max_size=3),
       weights=st.sampled_from([(1.0, 1.0), (1.0, 3.0), (0.0, 1.0), (2.0, 0.5)]),
       ctx_min=st.integers(1, 3), ctx_max_matches=st.integers(1, 10), ctx_cont=st.integers(1, 8), data=st.data(),
       **knobs)
def test_merged_draft_matches_reference(shard_docs, weights, ctx_min, ctx_max_matches, ctx_cont, data, max_suffix,
                                        min_suffix, max_matches, continuation, max_nodes):
    assume(min_suffix <= max_suffix)
    assume(any(len(d) for docs in shard_docs for d in docs))
    shard_docs = [docs for docs in shard_docs if any(len(d) for d in docs)]
    ctx = data.draw(st.composite(lambda draw: _context(draw, [d for ds in shard_docs for d in ds]))())
    ds = store(shard_docs)
    tree = ds.draft(ctx, max_suffix, min_suffix, max_matches, continuation, max_nodes, source="merged",
                    context_min_suffix=ctx_min, context_max_matches=ctx_max_matches, context_continuation=ctx_cont,
                    weights=weights)
    tree.validate(vocab_size=8)
    length, ds_rows = ref.datastore_rows(shard_docs, ctx, max_suffix, min_suffix, max_matches, continuation)
    ctx_len, ctx_rows = ref.context_rows(ctx, max_suffix, min(ctx_min, max_suffix), ctx_max_matches, ctx_cont)
    w = [weights[0] / max(len(ds_rows), 1)] * len(ds_rows) + [weights[1] / max(len(ctx_rows), 1)] * len(ctx_rows)
    paths, parents, scores = expect(ds_rows + ctx_rows, w, max_nodes)
    assert (tree.matched_suffix, tree.num_matches, tree.context_matched_suffix) == (length, len(ds_rows), ctx_len)
    assert tree.paths() == paths and tree.parents.tolist() == parents
    assert np.array_equal(tree.scores, scores)


@settings(max_examples=150, deadline=None)
@given(docs=st.lists(doc_st, min_size=2, max_size=10), cuts=st.lists(st.integers(1, 9), max_size=3),
       ctx=st.lists(st.integers(0, 3), min_size=1, max_size=8), max_nodes=st.integers(1, 20))
def test_shards_equal_one_big_shard_below_the_cap(docs, cuts, ctx, max_nodes):
    assume(any(len(d) for d in docs))
    bounds = sorted({c for c in cuts if c < len(docs)} | {0, len(docs)})
    pieces = [docs[a:b] for a, b in zip(bounds, bounds[1:])]
    pieces = [p for p in pieces if any(len(d) for d in p)]
    one, many = store([docs]), store(pieces)
    for source in ("datastore", "merged"):
        # max_matches above every range: the shards together read exactly the big shard's occurrences.
        a = one.draft(ctx, 4, 1, 10_000, 4, max_nodes, source)
        b = many.draft(ctx, 4, 1, 10_000, 4, max_nodes, source)
        assert a.paths() == b.paths() and np.array_equal(a.scores, b.scores)
        assert (a.matched_suffix, a.num_matches) == (b.matched_suffix, b.num_matches)


def test_draft_batch_equals_draft():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 5, rng.integers(1, 40)) for _ in range(30)]
    ds = SuffixArrayDatastore.from_documents(docs, vocab_size=5, tokenizer_id=TID)
    contexts = [rng.integers(0, 5, rng.integers(0, 20)) for _ in range(25)]
    for source in ("datastore", "merged", "context"):
        batch = ds.draft_batch(contexts, max_nodes=12, source=source, threads=2)
        for ctx, tree in zip(contexts, batch):
            single = ds.draft(ctx, max_nodes=12, source=source)
            assert tree.paths() == single.paths() and np.array_equal(tree.scores, single.scores)
            assert (tree.matched_suffix, tree.num_matches, tree.context_matched_suffix) == (
                single.matched_suffix, single.num_matches, single.context_matched_suffix)


def test_uint16_and_uint32_stores_agree():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 6, rng.integers(1, 30)) for _ in range(20)]
    small = SuffixArrayDatastore.from_documents(docs, vocab_size=6, tokenizer_id=TID)
    big = SuffixArrayDatastore.from_documents(docs, vocab_size=70_000, tokenizer_id=TID)
    assert small.shards[0].tokens.dtype == np.uint16 and big.shards[0].tokens.dtype == np.uint32
    for _ in range(30):
        ctx = rng.integers(0, 6, rng.integers(1, 12))
        a, b = small.draft(ctx, min_suffix=1), big.draft(ctx, min_suffix=1)
        assert a.paths() == b.paths() and (a.matched_suffix, a.num_matches) == (b.matched_suffix, b.num_matches)


def test_delta_shard_is_searched_and_swapped():
    ds = SuffixArrayDatastore.from_documents([[1, 2, 3]], vocab_size=10, tokenizer_id=TID)
    assert ds.draft([4, 5], min_suffix=2).paths() == []
    ds.set_delta(Shard.from_documents([np.array([4, 5, 6])], vocab_size=10, tokenizer_id=TID))
    assert ds.draft([4, 5], min_suffix=2).paths() == [[6]]  # Not []: the delta shard now answers
    assert ds.draft([1, 2], min_suffix=2).paths() == [[3]]  # the base shard still answers
    ds.set_delta(Shard.from_documents([np.array([4, 5, 7])], vocab_size=10, tokenizer_id=TID))
    assert ds.draft([4, 5], min_suffix=2).paths() == [[7]]  # Not [[6], [7]]: a new delta replaces the old one
    ds.set_delta(None)
    assert ds.draft([4, 5], min_suffix=2).paths() == [] and ds.num_shards == 1
    with pytest.raises(ValueError, match="does not match"):
        ds.set_delta(Shard.from_documents([np.array([1])], vocab_size=10, tokenizer_id="other"))


@pytest.mark.parametrize("bad, message", [
    (dict(context_ids=[[1, 2]]), "1-D"), (dict(context_ids=[-1]), r"\[0, 2\*\*31\)"),
    (dict(context_ids=[99]), "vocab_size"), (dict(min_suffix=0), "min_suffix"),
    (dict(max_suffix=2, min_suffix=3), "exceeds"), (dict(source="crest"), "source"),
    (dict(max_nodes=-1), "max_nodes"), (dict(context_ids=[1.5]), "integer"),
])
def test_bad_arguments_are_named(bad, message):
    ds = SuffixArrayDatastore.from_documents([[1, 2, 3]], vocab_size=10, tokenizer_id=TID)
    args = dict(context_ids=[1, 2]) | bad
    with pytest.raises(ValueError, match=message):
        ds.draft(**args)


def _follow_reference(tree: DraftTree, tokens: list[int]) -> list[int]:
    """Brute force: every node's root path, the deepest one that is a prefix of tokens (the first such node at
    each depth, as a trie has one)."""
    best: list[int] = []
    for i in range(len(tree)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = int(tree.parents[j])
        path.reverse()
        if [int(tree.tokens[k]) for k in path] == tokens[:len(path)] and len(path) > len(best):
            best = path
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=12), st.lists(st.integers(0, 3), min_size=0, max_size=6),
       st.randoms(use_true_random=False))
def test_follow_matches_brute_force(node_tokens, tokens, rnd):
    # A trie: a node's token is unique among its siblings (what every drafter builds).
    parents, toks, seen = [], [], set()
    for t in node_tokens:
        parent = rnd.randrange(-1, len(parents))
        if (parent, t) not in seen:
            seen.add((parent, t))
            parents.append(parent)
            toks.append(t)
    tree = DraftTree(np.array(toks, np.int32), np.array(parents, np.int32))
    assert tree.follow(tokens) == _follow_reference(tree, tokens)
