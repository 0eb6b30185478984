"""Ops tests reuse the integration fixtures: the real tokenizer, a small stdlib datastore on disk and the model
in fp32 (speculative output must equal the autoregressive output exactly)."""

from tests.integration.conftest import datastore, tm, tokenizer  # noqa: F401  (pytest fixtures)
