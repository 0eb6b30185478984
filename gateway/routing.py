"""Which worker gets a request: prefix affinity by rendezvous hashing, least load when that worker is busy or down.

The key is a stable prefix of the prompt as the worker will see it: for chat, the messages (role and content) up to
and including the last leading system/developer message, else all of them; for completions, the prompt text.
Either is cut to its first `affinity_chars` characters (~4 characters a token: about the first prefill chunk the
worker's prefix cache keys). Requests that share it rank the workers in the same order (highest random weight,
so adding or removing a worker moves only the keys that ranked it first), and a worker keeps the KV rows of the
prompts it has seen (engine/prefix_cache.py).

    rank("You are a pirate.", ["a:1", "b:1"])   -> e.g. ["b:1", "a:1"], the same order for every call
    choose(ranked, inflight={"b:1": 9, "a:1": 0}, busy=8) -> ("a:1", "least_loaded")   # b is busy
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

_LEADING_ROLES = ("system", "developer")


def chat_key(messages: Sequence[Mapping[str, str]], chars: int) -> str:
    """messages: [{"role", "content"(str)}] -> the affinity key (see the module docstring)."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in _LEADING_ROLES:
        lead += 1
    part = messages[:lead] if lead else messages
    out: list[str] = []
    size = 0
    for m in part:
        piece = f"{m.get('role', '')}\x00{m.get('content', '')}\x00"
        out.append(piece)
        size += len(piece)
        if size >= chars:
            break
    return "".join(out)[:chars]


def prompt_key(prompt: str | Sequence[int], chars: int) -> str:
    """A completion prompt (text, or token ids: their first chars//4 ids) -> the affinity key."""
    if isinstance(prompt, str):
        return prompt[:chars]
    return ",".join(str(t) for t in list(prompt)[:max(1, chars // 4)])


def _weight(key: bytes, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + b"\x00" + worker.encode(), digest_size=8).digest(), "big")


def rank(key: str, workers: Sequence[str]) -> list[str]:
    """Workers by descending rendezvous weight for this key: the same order for the same key and worker set."""
    k = key.encode("utf-8", "surrogatepass")
    return sorted(workers, key=lambda w: (_weight(k, w), w), reverse=True)


def choose(ranked: Sequence[str], inflight: Mapping[str, int], busy: int) -> tuple[str, str] | None:
    """-> (worker, why) among the healthy `ranked` ones (first = the key's own worker): that worker while it has
    fewer than `busy` requests in flight ("affinity"), else the least-loaded one, ties to the better-ranked
    ("least_loaded"). None when there is none."""
    if not ranked:
        return None
    first = ranked[0]
    if inflight.get(first, 0) < busy:
        return first, "affinity"
    best = min(range(len(ranked)), key=lambda i: (inflight.get(ranked[i], 0), i))
    return ranked[best], ("affinity" if best == 0 else "least_loaded")
