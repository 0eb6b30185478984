"""The prompt KV cache: which prompts reuse which rows (against a brute-force reference), its byte bound, and in the
engine with the real model: a repeated or chunk-sharing prompt decodes exactly as the solo run, without its prefill.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from generation_service.engine import scheduler
from generation_service.engine.model_thread import ModelThread
from generation_service.engine.prefix_cache import PrefixCache
from generation_service.engine.speculative import decode, first_divergence
from generation_service.model.sampling import SamplingParams
from tests.generation.test_engine import _collect, _engine, _job
from tests.generation.test_lossless import chat, encode, humaneval_prompts

CHUNK = 4
LAYERS, HEADS, DIM, VOCAB = 2, 1, 3, 5


def _rows(prompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake KV rows that encode (position, token prefix sum), so a restored row shows which prompt it came from;
    a capacity past the prompt, as a real cache has."""
    p = np.asarray(prompt, np.float32)
    n = p.shape[0]
    k = torch.zeros(LAYERS, HEADS, n + 3, DIM)
    k[:, :, :n, 0] = torch.from_numpy(np.cumsum(p))
    k[:, :, :n, 1] = torch.arange(n, dtype=torch.float32)
    return k, -k, torch.full((VOCAB,), float(p.sum()))


def _entry_bytes(n: int) -> int:
    return 2 * LAYERS * HEADS * n * DIM * 4 + VOCAB * 4


def _store(cache: PrefixCache, prompt) -> None:
    cache.store(np.asarray(prompt), *_rows(prompt))


@pytest.mark.parametrize("stored, prompt, rows, full", [
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4, 5], 5, True),            # the same prompt: every row and the first logits
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4, 9], 4, False),           # one chunk in common: that chunk; Not 5 rows
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 9, 9], 0, False),           # 3 tokens in common, less than a chunk: nothing
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4], 0, False),              # a prefix of a stored prompt, but its last chunk
                                                              # would be prefilled as 0 rows: whole prompts only
    ([[1, 2, 3, 4, 5, 6, 7, 8, 9]], [1, 2, 3, 4, 5, 6, 7, 8, 0], 8, False),  # two aligned chunks
    ([[1, 2, 3, 4], [1, 2, 3, 4, 5]], [1, 2, 3, 4, 6], 4, False),           # a stored prompt one chunk long is
                                                                             # found through the longer one's chunk
    ([[1, 2, 3, 4]], [1, 2, 3, 4, 6], 0, False),              # a chunk-long prompt alone has no proper boundary
    ([], [1, 2, 3, 4, 5], 0, False),
])
def test_lookup(stored, prompt, rows, full):
    cache = PrefixCache(1 << 20, CHUNK)
    for p in stored:
        _store(cache, p)
    hit = cache.lookup(np.asarray(prompt))
    if rows == 0:
        assert hit is None
        assert cache.lookups["miss"] == 1
        return
    assert hit is not None and hit.rows == rows and (hit.logits is not None) == full
    want_k, _, want_logits = _rows(prompt)
    assert torch.equal(hit.k[:, :, :rows], want_k[:, :, :rows])  # rows of a prompt sharing these tokens
    assert torch.equal(hit.v[:, :, :rows], -want_k[:, :, :rows])
    if full:
        assert torch.equal(hit.logits, want_logits)


@pytest.mark.parametrize("stored, prompt, full", [
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4, 5], True),     # held whole: its rows and logits
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4, 9], False),    # a chunk in common: Not a whole-prompt hit (lookup's business)
    ([[1, 2, 3, 4, 5]], [1, 2, 3, 4], False),       # a prefix of a held prompt: Not held whole
    ([], [1, 2, 3, 4, 5], False),
])
def test_lookup_whole_takes_only_whole_prompts_and_counts_only_hits(stored, prompt, full):
    """The gRPC thread's lookup (a stream's first token at submit): a miss is left uncounted, so the request's own
    lookup later counts it once, as a partial hit or a miss."""
    cache = PrefixCache(1 << 20, CHUNK)
    for p in stored:
        _store(cache, p)
    hit = cache.lookup_whole(np.asarray(prompt))
    assert (hit is not None) == full
    assert cache.lookups == {"full": int(full), "partial": 0, "miss": 0}
    if full:
        assert hit.rows == len(prompt) and torch.equal(hit.logits, _rows(prompt)[2])


def test_byte_bound_evicts_least_recently_used():
    cache = PrefixCache(2 * _entry_bytes(5) + 1, CHUNK)
    a, b, c = [1, 2, 3, 4, 5], [6, 7, 8, 9, 1], [2, 3, 4, 5, 6]
    _store(cache, a)
    _store(cache, b)
    assert cache.lookup(np.asarray(a)) is not None  # a is now the most recent
    _store(cache, c)  # over the bound: b goes, Not a
    assert cache.lookup(np.asarray(b)) is None
    assert cache.lookup(np.asarray(a)) is not None and cache.lookup(np.asarray(c)) is not None
    assert cache.nbytes <= cache.max_bytes and len(cache) == 2
    assert cache.lookup(np.asarray([6, 7, 8, 9, 0])) is None  # b's chunk went with it
    _store(cache, list(range(100)))  # larger than the whole budget: Not kept, nothing evicted for it
    assert len(cache) == 2 and cache.lookup(np.asarray(list(range(100)))) is None


def test_stored_rows_are_copies():
    cache = PrefixCache(1 << 20, CHUNK)
    k, v, logits = _rows([1, 2, 3, 4, 5])
    cache.store(np.asarray([1, 2, 3, 4, 5]), k, v, logits)
    k.zero_()  # the request's cache is reused by the next request in its slot
    logits.zero_()
    hit = cache.lookup(np.asarray([1, 2, 3, 4, 5]))
    assert torch.equal(hit.k[:, :, :5], _rows([1, 2, 3, 4, 5])[0][:, :, :5]) and torch.all(hit.logits == 15)


def _reference_rows(stored: list[tuple[int, ...]], prompt: tuple[int, ...]) -> tuple[int, bool]:
    """Brute force: the whole prompt if stored, else the longest chunk-aligned proper prefix of the prompt that is
    also a proper prefix of a stored prompt."""
    if prompt in stored:
        return len(prompt), True
    best = 0
    for s in stored:
        common = 0
        while common < min(len(s), len(prompt)) and s[common] == prompt[common]:
            common += 1
        rows = min(common, len(prompt) - 1, len(s) - 1) // CHUNK * CHUNK
        best = max(best, rows)
    return best, False


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2), min_size=1, max_size=11).map(tuple)),
                min_size=1, max_size=25))
def test_lookup_matches_brute_force(ops):
    """Random stores and lookups over a 3-token alphabet (many shared prefixes), a budget of ~3 prompts: every
    lookup reuses what the reference finds among the prompts still held, with those prompts' rows."""
    cache = PrefixCache(3 * _entry_bytes(11), CHUNK)
    held: list[tuple[int, ...]] = []  # least recently used first, as the cache evicts
    for is_store, prompt in ops:
        if is_store:
            _store(cache, prompt)
            if prompt in held:
                held.remove(prompt)
            held.append(prompt)
            while sum(_entry_bytes(len(p)) for p in held) > cache.max_bytes:
                held.pop(0)
            continue
        rows, full = _reference_rows(held, prompt)
        hit = cache.lookup(np.asarray(prompt))
        assert (hit.rows if hit else 0) == rows
        if hit is None:
            continue
        assert (hit.logits is not None) == full
        assert torch.equal(hit.k[:, :, :rows], _rows(prompt)[0][:, :, :rows])
        holder = prompt if full else next(p for p in reversed(held) if p[:rows] == prompt[:rows] and len(p) > rows)
        held.remove(holder)  # a hit refreshes the prompt it came from
        held.append(holder)


# --------------------------------------------------------------------------------------- in the engine (model)

PREFILL = 48
N_NEW = 16


@pytest.mark.model
def test_engine_reuses_prompts_losslessly(tm32):
    """Repeated prompts take their rows from the cache (the exact repeat without a prefill pass), a prompt sharing
    its first chunk with an earlier one takes that chunk; every output equals the solo run (near-ties aside)."""
    greedy = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=0.8, top_p=0.9, seed=11)
    code = np.asarray(encode(tm32, humaneval_prompts(1)[0]), np.int64)
    talk = np.asarray(chat(tm32, "Name three sorting algorithms and say which is fastest."), np.int64)
    assert code.shape[0] > PREFILL + 8
    shares_chunk = np.concatenate([code[:PREFILL], np.asarray(encode(tm32, " # and now something else"), np.int64)])
    mt = ModelThread("test-solo")
    try:
        def solo(prompt, params):
            return [t for out, _ in decode(tm32, prompt, params, prefill_chunk=PREFILL) for t in out]
        cases = [  # (prompt, params, cached prompt tokens)
            (code, greedy, 0), (talk, greedy, 0),
            (code, greedy, code.shape[0]), (talk, seeded, talk.shape[0]), (talk, seeded, talk.shape[0]),
            (shares_chunk, greedy, PREFILL), (shares_chunk, greedy, shares_chunk.shape[0]),
        ]
        want = [mt.call(solo, p, params) for p, params, _ in cases]
    finally:
        mt.stop(wait=True)
    engine = _engine(tm32, {}, prefix_cache_mb=64)
    try:
        got = []
        for prompt, params, _ in cases:  # one at a time: each finds what the earlier ones left
            passes = engine.passes
            job = _job(prompt, params)
            t = time.monotonic()
            engine.submit(job)
            got.append((*_collect(job), engine.passes - passes))
            assert time.monotonic() - t < 120
        stats = engine.prefix_cache.stats()
    finally:
        engine.stop()
    near_ties = 0
    for (prompt, params, cached), w, (tokens, finish, st_, passes) in zip(cases, want, got):
        assert finish == "length" and st_.cached_prompt_tokens == cached
        if cached == prompt.shape[0]:
            assert passes == N_NEW - 1  # decode passes only: the first token came from the cached logits
        else:
            assert passes >= N_NEW  # a prefill pass (or more) before them
        if tokens != w:
            div = first_divergence(tm32, prompt, w, tokens)
            assert params.greedy and div is not None and div.near_tie, div
            near_ties += 1
    assert near_ties <= 1
    assert stats["full"] == 4 and stats["partial"] == 1 and stats["miss"] == 2, stats


@pytest.mark.model
def test_engine_without_prefix_cache_prefills_every_time(tm32):
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompt = encode(tm32, "def add(a, b):\n    return")
    engine = _engine(tm32, {})  # prefix_cache_mb defaults to 0 in the engine
    try:
        outs = []
        for _ in range(2):
            job = _job(prompt, params)
            engine.submit(job)
            outs.append(_collect(job))
    finally:
        engine.stop()
    assert engine.prefix_cache is None
    assert [o[2].cached_prompt_tokens for o in outs] == [0, 0] and outs[0][0] == outs[1][0]


@pytest.mark.model
def test_a_cached_prompt_streams_its_first_token_while_a_pass_runs(tm32, monkeypatch):
    """A stream whose prompt is cached whole gets its first token from submit(), not after the pass in flight (held
    here); the rest of its output is the solo run's, seeded sampling included. Unary calls and uncached prompts wait
    for the engine, as before; a stop string in the first token ends the request from the engine; a request the full
    queue refuses gets nothing."""
    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, top_p=0.9, seed=5)
    code = np.asarray(encode(tm32, humaneval_prompts(1)[0]), np.int64)
    talk = np.asarray(chat(tm32, "Say hello."), np.int64)
    other = np.asarray(chat(tm32, "Count to three."), np.int64)
    held, in_pass = threading.Event(), threading.Event()
    held.set()
    real = scheduler.forward_batch

    def forward_when_let(tm, segments):
        in_pass.set()
        assert held.wait(120)
        return real(tm, segments)

    monkeypatch.setattr(scheduler, "forward_batch", forward_when_let)
    engine = _engine(tm32, {}, prefix_cache_mb=64, queue_size=5)
    try:
        want = {}
        for name, prompt, params in (("code", code, greedy), ("talk", talk, seeded)):
            job = _job(prompt, params)
            engine.submit(job)
            want[name] = _collect(job)[0]
        first_text = tm32.tokenizer.decode(want["code"][:1])
        busy = _job(other, SamplingParams(max_new_tokens=40, ignore_eos=True))
        engine.submit(busy)
        assert not isinstance(busy.chunks.get(timeout=120), BaseException)  # it decodes: passes keep coming
        held.clear()
        in_pass.clear()
        assert in_pass.wait(120)  # the model thread is inside a pass now, and stays there
        cases = [  # (name, job, first token before the pass ends?)
            ("code", _job(code, greedy), True),
            ("talk", _job(talk, seeded), True),
            ("code", _job(code, greedy, stream=False), False),  # unary: one merged reply at the end
            ("fresh", _job(code[:-1], greedy), False),  # not cached: its prefill needs the pass
            ("stop", _job(code, dataclasses.replace(greedy, stop=[first_text])), False),  # ends at once: engine
        ]
        for _, job, _ in cases:
            engine.submit(job)
        refused = _job(code, greedy)
        with pytest.raises(queue.Full):  # the queue holds len(cases) jobs
            engine.submit(refused)
        time.sleep(0.5)
        assert refused.chunks.empty()  # Not a first token for a request the worker refused
        firsts = []
        for name, job, early in cases:
            if early:
                first = job.chunks.get(timeout=5)
                assert first.token_ids == want[name][:1] and first.finish_reason is None
                firsts.append(first.token_ids)
            else:
                assert job.chunks.empty(), name
                firsts.append([])
        held.set()
        got = [(f + tokens, finish, stats) for f, (_, job, _) in zip(firsts, cases)
               for tokens, finish, stats in [_collect(job)]]
        _collect(busy)
    finally:
        held.set()
        engine.stop()
    for (name, job, early), (tokens, finish, stats) in zip(cases, got):
        if name == "stop":
            assert finish == "stop" and tokens == []  # the stop string is cut from the output
            continue
        if name != "fresh":
            assert stats.cached_prompt_tokens == job.prompt_ids.shape[0]
            assert tokens == want[name], name  # the first token sent once, the rest as solo
        assert finish == "length" and len(tokens) == greedy.max_new_tokens
