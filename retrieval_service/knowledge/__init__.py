"""Knowledge base of the retrieval service: passages + EDR (exact dense), ADR (HNSW), SR (BM25) retrievers.

    passages.py  corpus extraction (docstrings, python3.11-doc reST) and the passage store
    dense.py     MiniLM encoder, resumable encoding, named faiss vector indexes with exact re-scoring
    sparse.py    JVM start-up, Anserini indexing, pyserini LuceneSearcher search and candidate scoring
    kb.py        KnowledgeBase: open/check/warm up, batched search, ScoreCandidates, documents
    service.py   KnowledgeServicer (proto/knowledge.proto)
    pg.py        the KB in PostgreSQL + pgvector (--kb postgresql://...): load, search, pool, health
    backends.py  open_knowledge_base: a --kb value names a directory (kb.py) or a PostgreSQL table (pg.py)
    deadline.py  the running KB call's gRPC deadline, handed to a database as statement_timeout
    build.py     CLI: python -m retrieval_service.knowledge.build --out DIR [--to postgresql://...]
"""
