"""kNN-LM fixtures: the real model (bf16, the serving dtype), a tiny datastore built with it from a few stdlib
docstrings (real text nobody here wrote), and the real retrieval service serving that datastore (faiss exact +
HNSW) in-process on a free loopback port."""

from __future__ import annotations

import argparse
import json
import textwrap

import numpy as np
import pytest

DOC_TOKENS = 160  # per document: 4 documents -> ~640 entries, enough for k up to 256 and a few windows each
WINDOW, OVERLAP = 64, 16  # small windows so every document spans several (the cut logic is exercised)


def doc_texts() -> list[str]:
    return [json.__doc__, textwrap.TextWrapper.__doc__, argparse.__doc__, textwrap.dedent.__doc__ * 3]


@pytest.fixture(scope="session")
def doc_tokens(tm) -> list[np.ndarray]:
    return [np.asarray(tm.tokenizer(t, add_special_tokens=False)["input_ids"][:DOC_TOKENS], np.int32)
            for t in doc_texts()]


@pytest.fixture(scope="session")
def ds_path(tm, doc_tokens, tmp_path_factory):
    from tools.knn_build import build_datastore

    docs = [(f"doc{i}", t) for i, t in enumerate(doc_tokens)]
    return build_datastore(tmp_path_factory.mktemp("knn") / "tiny", docs, tm, window=WINDOW, overlap=OVERLAP,
                           chunk_entries=100, hnsw_m=8, hnsw_ef_construction=40, progress=False)


@pytest.fixture(scope="session")
def ds(ds_path):
    from ragcore.knn_store import open_datastore

    return open_datastore(ds_path)


@pytest.fixture(scope="session")
def retrieval(ds_path):
    from retrieval_service.config import RetrievalConfig
    from retrieval_service.server import build_server

    running = build_server(RetrievalConfig(port=0, workers=4, kb_knn_datastores=str(ds_path), kb_warmup_s=0.0))
    yield running
    running.stop(0)


@pytest.fixture(scope="session")
def backend(ds_path, retrieval):
    from generation_service.knnlm.search import KnnBackend

    b = KnnBackend.open(str(ds_path), retrieval.address)
    yield b
    b.close()
