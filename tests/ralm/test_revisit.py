"""Returning to an earlier passage: the step takes up that passage's kept KV cache and prefills only the output
written since. Scenario table of which steps revisit (least recently used out), a brute-force reference for the
rows it builds on (the same logits as prefilling passage + prompt + output from scratch, to rounding), and
checkpoint/restore across revisits and evictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from generation_service.engine.effects import prefill_passes, run_inline
from generation_service.engine.passage_rows import passage_budget
from generation_service.model.sampling import SamplingParams
from generation_service.model.target import cache_length, new_cache
from generation_service.ralm.loop import RagParams, RagStats, StepRunner
from generation_service.ralm.retrieval import KBRetriever

pytestmark = pytest.mark.model
STRIDE = 2


@pytest.fixture(scope="module")
def passages(tm, kb_client, prompts) -> list[list[int]]:
    retr = KBRetriever(kb_client, "edr", tm.tokenizer, passage_budget(len(prompts[0]), RagParams()))
    return [retr.passage(d) for d in range(4)]


def _run(tm, prompt, passages, docs: list[int], steps: int = 0, **rag) -> StepRunner:
    """A runner of `steps` (default: len(docs)) steps of STRIDE tokens, run through docs' passages."""
    r = StepRunner(tm, prompt, SamplingParams(max_new_tokens=STRIDE * (steps or len(docs)), ignore_eos=True),
                   RagParams(stride=STRIDE, speculate=False, **rag), RagStats())
    for d in docs:
        r.step(d, passages[d])
    return r


@pytest.mark.parametrize("docs,rag,revisits", [
    ([0, 1, 0], {}, 1),                               # back to 0: its rows kept
    ([0, 1, 2, 0], {"revisit_passages": 1}, 0),       # Not 1: 0 was the least recently used, evicted for 1
    ([0, 1, 2, 0], {"revisit_passages": 2}, 1),
    ([0, 1, 2, 1, 0], {"revisit_passages": 2}, 2),    # 1 taken up again, 0 still kept beside 2
    ([0, 1, 0], {"revisit_passages": 0}, 0),          # off: re-prefill
    ([0, 1, 0], {"reuse_kv": False}, 0),              # Not kept without KV reuse
    ([0, 0, 1, 1, 0], {}, 1),                         # same passage twice: decoding on, no prefill at all
])
def test_which_steps_revisit(tm, prompts, passages, docs, rag, revisits):
    r = _run(tm, prompts[0], passages, docs, **rag)
    assert r.stats.revisits == revisits
    changes = sum(1 for i, d in enumerate(docs) if i == 0 or d != docs[i - 1])
    want_prefills = changes if rag.get("reuse_kv", True) else len(docs)
    assert r.stats.prefills == want_prefills  # a revisit is still a prefill (of the output since), Not a decode


def test_a_revisit_prefills_only_the_output_since(tm, prompts, passages):
    prompt = prompts[0]
    kept = _run(tm, prompt, passages, [0, 1, 0])
    fresh = _run(tm, prompt, passages, [0, 1, 0], revisit_passages=0)
    # Step 3 with passage 0: the kept rows end before out[1] (out[-1] of step 1 is never cached), so it feeds
    # out[1:4]; from scratch, passage + prompt + out[:4].
    full = len(passages[0]) + len(prompt) + 2 * STRIDE
    assert fresh.stats.prefill_tokens - kept.stats.prefill_tokens == full - (2 * STRIDE - 1)
    assert kept.cache_doc == 0 and len(kept.kept) == 1 and 1 in kept.kept


def test_revisited_rows_give_the_fresh_prefills_logits(tm, prompts, passages):
    """Brute force: the kept cache of passage + prompt + out[:j] plus a prefill of out[j:] against one prefill of
    the whole sequence; rows of a decode and of a prefill round differently in bf16, so equal to rounding."""
    prompt = prompts[1]
    r = _run(tm, prompt, passages, [2, 3])
    cache = r.kept[2]
    j = cache_length(cache) - len(passages[2]) - len(prompt)
    assert j == STRIDE - 1  # step 1 left out[:1] in passage 2's rows (out[1] was `last`, never cached)
    seq = np.concatenate([np.asarray(passages[2], np.int64), prompt.astype(np.int64), np.asarray(r.out, np.int64)])
    got, _ = run_inline(tm, prefill_passes(tm, cache, torch.from_numpy(np.asarray(r.out[j:], np.int64))))
    want, _ = run_inline(tm, prefill_passes(tm, new_cache(tm), torch.from_numpy(seq)))
    assert got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=0.35, rtol=0.05)
    assert int(got.argmax()) == int(want.argmax())  # Not another token (no near-tie here)


def test_restore_across_a_revisit_and_an_eviction(tm, prompts, passages):
    """Checkpoint, revisit 0 and evict 1, restore: the kept caches are back as they were, and stepping on gives
    what stepping from the checkpoint gave the first time (the very same computation)."""
    prompt = prompts[2]
    direct = _run(tm, prompt, passages, [0, 1, 0, 2], revisit_passages=1)

    r = _run(tm, prompt, passages, [0, 1], steps=4, revisit_passages=1)
    ck = r.checkpoint()
    r.step(2, passages[2])  # 0 evicted (1 kept), then ...
    r.step(1, passages[1])  # ... 1 taken up again and grown
    r.restore(ck)
    assert list(r.kept) == [0] and r.cache_doc == 1 and r.out == direct.out[:2 * STRIDE]
    r.step(0, passages[0])
    r.step(2, passages[2])
    assert r.out == direct.out  # Not tokens written on rows of the undone steps
    assert r.stats.revisits == 2 and direct.stats.revisits == 1  # the undone revisit of 1, then 0's

