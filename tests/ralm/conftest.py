"""RaLM fixtures: the real model (bf16, the serving dtype: committed steps run the very kernels RaLMSeq runs, so
even bf16 output must match token for token), the tiny knowledge base of tests/knowledge (real stdlib
docstrings + known passages, all three retrievers) served by the real retrieval server on a free loopback
port, and helpers that run RaLMSeq / RaLMSpec over it."""

from __future__ import annotations

import numpy as np
import pytest

from ragcore.encoder import Encoder
from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge.build import build_kb
from retrieval_service.knowledge.kb import KnowledgeBase
from tests.knowledge.conftest import tiny_corpus

QUESTIONS = [
    "What does the heapq module do and how do I push an item onto a heap?",
    "How do I wrap a long paragraph of text to a fixed width in Python?",
    "Explain how to parse a CSV file with a header row.",
]
N_TOKENS = 12  # 6 retrieval steps of k = 2 tokens: enough rounds for OS³, rollbacks and async overlap


@pytest.fixture(scope="session")
def rag_encoder() -> Encoder:
    return Encoder(threads=1, cache_size=1024)


@pytest.fixture(scope="session")
def rag_kb(tmp_path_factory, rag_encoder) -> KnowledgeBase:
    out = tmp_path_factory.mktemp("ralm_kb")
    build_kb(out, tiny_corpus(), retrievers=("edr", "adr", "sr"), corpus={"source": "tests-ralm"},
             hnsw_m=8, hnsw_ef_construction=64, chunk=48, encoder=rag_encoder, progress=False)
    cfg = RetrievalConfig(kb_limit_k=300, kb_ef_search=64, kb_warmup_s=0.5)
    kb = KnowledgeBase.open(out, cfg, encoder=rag_encoder)
    yield kb
    kb.close()


def start_kb_server(kb: KnowledgeBase, port: int = 0):
    from retrieval_service.server import build_server

    return build_server(RetrievalConfig(port=port, workers=4, kb_limit_k=300, kb_warmup_s=0.0), kb=kb)


@pytest.fixture(scope="session")
def kb_server(rag_kb):
    running = start_kb_server(rag_kb)
    yield running
    running.stop(0)


@pytest.fixture(scope="session")
def kb_client(kb_server):
    from generation_service.augment.kb_client import KBClient

    c = KBClient(kb_server.address, timeout_ms=10_000)
    yield c
    c.close()


@pytest.fixture(scope="session")
def prompts(tm) -> list[np.ndarray]:
    return [np.asarray(tm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False), np.int64)
            for q in QUESTIONS]


def run_rag(tm, kb_client, prompt: np.ndarray, rag, *, n_tokens: int = N_TOKENS, wrap=None, spec_timeout_s: float = 10.0,
            encoder=None, round_costs=None, spec_slack: float | None = None):
    """One RAG request in-process -> (committed tokens, RagStats). wrap: retriever -> retriever (fault injection)."""
    from generation_service.engine.passage_rows import passage_budget
    from generation_service.model.sampling import SamplingParams
    from generation_service.ralm.loop import RagStats, ralm_decode
    from generation_service.ralm.retrieval import KBRetriever

    retr = KBRetriever(kb_client, rag.retriever, tm.tokenizer, passage_budget(len(prompt), rag), encoder=encoder,
                       spec_timeout_s=spec_timeout_s, **({} if spec_slack is None else {"spec_slack": spec_slack}))
    if wrap is not None:
        retr = wrap(retr)
    stats = RagStats()
    out: list[int] = []
    for tokens, _ in ralm_decode(tm, prompt, SamplingParams(max_new_tokens=n_tokens, ignore_eos=True), rag, retr,
                                 stats=stats, round_costs=round_costs):
        out += tokens
    return out, stats


@pytest.fixture(scope="session")
def reference(tm, kb_client, prompts):
    """RaLMSeq (B) outputs, computed once: {(retriever, prompt index, stride): tokens}."""
    from generation_service.ralm.loop import RagParams

    memo: dict = {}

    def get(retriever: str, i: int, stride: int = 2) -> list[int]:
        key = (retriever, i, stride)
        if key not in memo:
            memo[key] = run_rag(tm, kb_client, prompts[i], RagParams(retriever=retriever, stride=stride,
                                                                     speculate=False))
        return memo[key][0]

    return get
