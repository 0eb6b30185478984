"""Corpora for datastores: find documents, tokenize them with the serving model's tokenizer.

The tokenizer identity is a hash of the vocabulary (token -> id) and the special tokens, so a datastore
built with one tokenizer is refused by a worker using another (ids would mean different strings).
"""

from __future__ import annotations

import hashlib
import json


def tokenizer_identity(tokenizer) -> str:
    """Stable identity of a tokenizer's id space: same vocab and specials -> same string."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    payload = json.dumps(
        {"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens))},
        ensure_ascii=False,
        separators=(",", ":"),
    ).encode("utf-8")
    return f"vocab{len(vocab)}-{hashlib.sha256(payload).hexdigest()[:16]}"
