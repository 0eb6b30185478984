"""The kNN-LM datastore: entry i's value is the token after entry i's context, and its key is the model's final
hidden state after reading exactly that context (checked against a brute-force forward pass of the whole causal
LM, a different code path from the builder's decoder-only pass)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from generation_service.knnlm.passes import _output_layer_input
from ragcore.knn_store import check_datastore, entry_offsets, entry_positions, open_datastore
from retrieval_service.knowledge.knn_index import open_vector_index
from tests.knnlm.conftest import OVERLAP, WINDOW
from tools.knn_build import plan_windows


@pytest.mark.parametrize("length, window, overlap, expected", [
    (10, 4, 1, [(0, 4, 0), (3, 7, 4), (6, 10, 7)]),  # Not [(0, 4, 0), (4, 8, 4), ...]: each window re-reads context
    (4, 4, 1, [(0, 4, 0)]),                          # one window; not a second, empty one
    (1, 4, 1, []),                                   # a one-token document has no (context, next token) pair
    (5, 4, 0, [(0, 4, 0), (4, 5, 4)]),               # overlap 0: the cut position's entry has no context
])
def test_plan_windows(length, window, overlap, expected):
    assert plan_windows(length, window, overlap) == expected


def test_every_value_position_is_stored_once():
    for length in range(1, 40):
        stored = [p for s, e, keep in plan_windows(length, 7, 3) for p in range(max(keep, s + 1), e)]
        assert stored == list(range(1, length))  # Not a gap or a repeat at a window cut


def test_values_are_the_next_tokens(ds, doc_tokens):
    # Brute force: enumerate every (document, position >= 1) pair in order.
    expected = np.concatenate([doc[1:] for doc in doc_tokens])
    assert np.array_equal(np.asarray(ds.values), expected)  # Not shifted by one (the context's last token)
    assert ds.size == sum(len(d) - 1 for d in doc_tokens) == int(entry_offsets([len(d) for d in doc_tokens])[-1])
    check_datastore(ds)


def _storing_window(length: int, p: int) -> int:
    """Start of the window that stores the entry whose value is at position p."""
    return next(s for s, e, keep in plan_windows(length, WINDOW, OVERLAP) if max(keep, s + 1) <= p < e)


def _brute_hidden(tm, context: np.ndarray) -> np.ndarray:
    """Full causal-LM forward over `context` -> the input of the output layer at its last position."""
    with torch.inference_mode(), _output_layer_input(tm) as box:
        tm.model(input_ids=torch.from_numpy(context.astype(np.int64))[None], use_cache=False)
    return box[-1][0, -1].float().numpy()


def test_keys_are_hidden_states_of_the_context(tm, ds, doc_tokens):
    starts = entry_offsets([len(d) for d in doc_tokens])
    # First entry, window cuts, last entry of a few documents.
    picks = [(0, 1), (0, WINDOW - 1), (0, WINDOW), (0, WINDOW + 1), (1, 1), (2, 2 * WINDOW - OVERLAP + 3),
             (3, len(doc_tokens[3]) - 1)]
    for d, p in picks:
        doc = doc_tokens[d]
        i = int(starts[d]) + p - 1  # entry id of (document d, value position p)
        assert int(entry_positions(ds.docs, np.array([i]))[0]) == int(ds.docs[d, 0]) + p
        assert int(ds.values[i]) == int(doc[p])
        ws = _storing_window(len(doc), p)
        want = _brute_hidden(tm, doc[ws:p])  # [D]; the context ends with doc[p - 1]
        key = np.asarray(ds.keys[i], np.float32)
        rel = np.linalg.norm(key - want) / np.linalg.norm(want)
        assert rel < 0.05, (d, p, rel)  # bf16 pass + float16 storage
        if p + 1 < len(doc):  # not the key of the next position (an off-by-one in the other direction)
            other = _brute_hidden(tm, doc[ws:p + 1])
            assert np.linalg.norm(key - other) > 4 * np.linalg.norm(key - want), (d, p)


def test_a_key_finds_its_own_entry(ds_path, ds):
    vi = open_vector_index(ds_path)
    ids = np.array([0, 5, ds.size // 2, ds.size - 1])
    queries = np.asarray(ds.keys[ids], np.float32)
    for retriever_approx in (False, True):
        hits = vi.search(queries, 3, approx=retriever_approx)
        assert [int(h[0][0]) for h in hits] == ids.tolist()  # Not a neighbour's id


def test_checker_catches_misaligned_values(ds_path, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(ds_path, bad)
    values = np.load(bad / "values.npy")
    np.save(bad / "values.npy", np.roll(values, 1))  # every value moved one entry later
    with pytest.raises(ValueError, match="entry 0 has value"):
        check_datastore(open_datastore(bad))
