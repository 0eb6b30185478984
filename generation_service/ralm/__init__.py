"""Iterative retrieval-augmented generation (RaLMSeq, RaLMSpec): the decoding loops (loop), the per-request passage
cache, the retrievers over the knowledge base, and the service glue the server calls (service)."""
