"""Which knowledge base a --kb value names: a directory of files (kb.py) or a table in PostgreSQL (pg.py).

    kb = open_knowledge_base("~/.cache/ragserve/kb/docs", RetrievalConfig())
    kb = open_knowledge_base("postgresql://user@host:5432/db", RetrievalConfig(kb_pg_table="ragserve_kb"))
"""

from __future__ import annotations

from pathlib import Path

from retrieval_service.config import RetrievalConfig
from retrieval_service.knowledge import dense, pg
from retrieval_service.knowledge.kb import KnowledgeBase


def open_knowledge_base(where: str | Path, config: RetrievalConfig | None = None, *, warmup: bool = True,
                        encoder: dense.Encoder | None = None) -> KnowledgeBase:
    """Open, check and warm the knowledge base at `where`; KBOpenError names what is missing or corrupted."""
    cfg = config or RetrievalConfig()
    if str(where).startswith(pg.URL_SCHEMES):
        return pg.open_kb(str(where), cfg, warmup=warmup, encoder=encoder)
    return KnowledgeBase.open(where, cfg, warmup=warmup, encoder=encoder)
