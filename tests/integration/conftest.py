"""Both services in-process on free loopback ports, over a small real datastore and the real model (fp32,
where speculative output must equal autoregressive output exactly)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import grpc
import numpy as np
import pytest

from generation_service.client import GenerationClient
from generation_service.config import GenerationConfig
from proto import draft_pb2_grpc
from ragcore.model_files import default_model_dir, load_tokenizer, tokenizer_identity
from retrieval_service.config import RetrievalConfig
from retrieval_service.datastore.suffix_array import SuffixArrayDatastore

# Real code nobody here wrote: a few stdlib packages (~0.5 M tokens), enough for REST to find continuations.
STDLIB_PARTS = ["json", "collections", "unittest", "argparse.py", "dataclasses.py", "textwrap.py", "functools.py"]

PROMPTS = [
    "import json\n\n\ndef load_config(path):\n    \"\"\"Read a JSON config file and return a dict.\"\"\"\n",
    "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(description='Process some files.')\n",
]


def stdlib_documents() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for part in STDLIB_PARTS:
        p = root / part
        files += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return [f.read_text(encoding="utf-8") for f in files]


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="session")
def datastore(tmp_path_factory, tokenizer) -> SuffixArrayDatastore:
    docs = [np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"], np.int32) for t in stdlib_documents()]
    path = tmp_path_factory.mktemp("ds") / "stdlib-small"
    return SuffixArrayDatastore.build(docs, path, vocab_size=len(tokenizer), tokenizer_id=tokenizer_identity(tokenizer),
                                      progress=False)


@pytest.fixture(scope="session")
def tm():
    from generation_service.model.target import load_model

    return load_model("", dtype="fp32")


@pytest.fixture(scope="session")
def retrieval(datastore):
    from retrieval_service.server import build_server

    running = build_server(RetrievalConfig(port=0, workers=4), datastore=datastore)
    yield running
    running.stop(0)


@pytest.fixture(scope="session")
def draft_stub(retrieval):
    channel = grpc.insecure_channel(retrieval.address)
    yield draft_pb2_grpc.DraftServiceStub(channel)
    channel.close()


def start_generation(tm, retrieval_address: str, **overrides):
    from generation_service.server import build_server

    # acceptance_state off: a test's trees must not depend on what earlier test servers (or the user's own worker,
    # which keeps its evidence per model in RAGSERVE_HOME) learned; the engine tests cover keeping it.
    cfg = GenerationConfig(port=0, retrieval=retrieval_address, dtype="fp32", **{"acceptance_state": "off",
                                                                              **overrides})
    running, servicer = build_server(cfg, tm=tm)
    return running, servicer


@pytest.fixture(scope="session")
def generation(tm, retrieval):
    # A generous draft deadline: on a loaded CI machine the default 50 ms can pass, and these tests assert that
    # no step was degraded (degraded mode has its own tests).
    running, servicer = start_generation(tm, retrieval.address, draft_timeout_ms=5000)
    yield running
    running.stop(0)
    servicer.worker.stop()


@pytest.fixture(scope="session")
def client(generation):
    with GenerationClient(generation.address) as c:
        yield c
