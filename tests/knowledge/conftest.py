"""A tiny knowledge base built once per session: a few hand-written passages with known answers plus the
docstrings of seven small stdlib modules (~66 passages, <= 60 words each), all three retrievers."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import grpc
import pytest

from ragcore.encoder import Encoder
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import passages as P
from retrieval_service.knowledge.build import build_kb
from retrieval_service.knowledge.kb import KnowledgeBase

# (title, text, a query whose answer is this passage for every retriever)
KNOWN = [
    ("Paris", "Paris is the capital and most populous city of France, on the river Seine.",
     "capital city of France"),
    ("Photosynthesis", "Photosynthesis lets plants turn sunlight, water and carbon dioxide into glucose and oxygen.",
     "how do plants make glucose from sunlight"),
    ("Mount Everest", "Mount Everest in the Himalayas is the highest mountain above sea level on Earth.",
     "highest mountain on Earth"),
    ("Espresso", "Espresso is coffee brewed by forcing hot water under pressure through finely ground beans.",
     "espresso coffee brewed under pressure"),
    ("Volcano", "A volcano is a rupture in a planet's crust where lava, ash and gases escape from a magma chamber.",
     "lava and ash escaping from a magma chamber"),
    ("Chess", "Chess is a board game for two players; each starts with sixteen pieces including a king and a queen.",
     "board game with a king and a queen"),
]
MODULES = ["json/decoder.py", "csv.py", "textwrap.py", "heapq.py", "bisect.py", "fractions.py", "calendar.py"]
WORDS = 60
EXTRA_LIMIT = 60


def tiny_corpus() -> list[P.Passage]:
    known = [P.Passage(f"known:{i}", t, x) for i, (t, x, _) in enumerate(KNOWN)]
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for rel in MODULES:
        sections = P.docstring_sections((root / rel).read_text())
        name = P.module_name(root, root / rel)
        docs.append(P.Document(f"py:{name}", name, tuple(sections)))
    return known + list(P.iter_passages(docs, words=WORDS, limit=EXTRA_LIMIT))


@pytest.fixture(scope="session")
def encoder() -> Encoder:
    return Encoder(threads=1, cache_size=256)


@pytest.fixture(scope="session")
def kb_dir(tmp_path_factory, encoder) -> Path:
    out = tmp_path_factory.mktemp("kb")
    build_kb(out, tiny_corpus(), retrievers=("edr", "adr", "sr"), corpus={"source": "tests"},
             hnsw_m=8, hnsw_ef_construction=64, chunk=48, encoder=encoder, progress=False)
    return out


@pytest.fixture(scope="session")
def kb_config() -> RetrievalConfig:
    return RetrievalConfig(limit_batch=16, kb_limit_k=50, kb_limit_ids=64, kb_ef_search=64, kb_warmup_s=1.0)


@pytest.fixture(scope="session")
def kb(kb_dir, kb_config, encoder) -> KnowledgeBase:
    kb = KnowledgeBase.open(kb_dir, kb_config, encoder=encoder)
    yield kb
    kb.close()


@pytest.fixture(scope="session")
def edr_only_kb(tmp_path_factory, kb_config, encoder) -> KnowledgeBase:
    """A KB built with the exact dense index only: sr and adr are absent on disk."""
    out = tmp_path_factory.mktemp("kb_edr")
    build_kb(out, tiny_corpus()[:8], retrievers=("edr",), corpus={"source": "tests-edr"}, encoder=encoder,
             progress=False)
    kb = KnowledgeBase.open(out, kb_config, encoder=encoder)
    yield kb
    kb.close()


def serve(servicer) -> tuple[object, grpc.Channel]:
    """The servicer on a real gRPC server bound to a free loopback port."""
    from ragcore.grpc_shell import start_server

    running = start_server(servicer.add_to_server, host="127.0.0.1", port=0, workers=4, max_concurrent_rpcs=None,
                           max_message_bytes=16 << 20)
    running.set_serving(True)
    return running, grpc.insecure_channel(running.address)


@pytest.fixture(scope="session")
def stub(kb, kb_config):
    from proto import knowledge_pb2_grpc
    from retrieval_service.knowledge.service import KnowledgeServicer

    servicer = KnowledgeServicer(kb, kb_config)
    servicer.warmup()
    running, channel = serve(servicer)
    yield knowledge_pb2_grpc.KnowledgeServiceStub(channel)
    channel.close()
    running.stop(0)
