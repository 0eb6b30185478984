"""Adaptive drafting in the decode loop, with the real model: no draft call when the measured curve says no tree
can pay, useless remote drafts skipped (the request's own tokens still drafted in process), outputs unchanged."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import numpy as np
import pytest

from generation_service.drafting.drafters import DraftUnavailable, PromptLookupDrafter
from generation_service.engine.speculative import decode, generate
from generation_service.model.sampling import SamplingParams
from generation_service.model.step_cost import StepCost
from ragcore.draft_tree import SOURCES, DraftTree

pytestmark = pytest.mark.model

N_NEW = 48
FLAT = StepCost([1, 2, 4, 8, 16, 32, 64], [24.5, 26.0, 29.4, 29.4, 29.4, 36.2, 49.4])  # Zen 5 bf16, calibrated
NOTHING_PAYS = StepCost([1, 2, 64], [10.0, 20.0, 640.0])  # one node costs a whole AR step


class Counting:
    """A drafter that counts its calls; `remote` as the loop should see it, `local` what it drafts with while
    skipped."""

    def __init__(self, propose, remote: bool, local=None, name: str = "counting"):
        self._propose, self.remote, self.local, self.name = propose, remote, local, name
        self.default_source = SOURCES.index("datastore")
        self.calls = 0

    def propose(self, context_ids, max_nodes):
        self.calls += 1
        return self._propose(context_ids, max_nodes)


def wrong_datastore_tree(context_ids, max_nodes) -> DraftTree:
    """Two thousand scattered datastore matches: eight rare continuations (tokens 0..7), each a root child."""
    n = min(max_nodes, 8)
    source_p = np.zeros((n, len(SOURCES)), np.float32)
    source_p[:, SOURCES.index("datastore")] = 0.002
    return DraftTree(np.arange(n, dtype=np.int32), np.full(n, -1, np.int32), np.ones(n, np.float32),
                     matched_suffix=2, num_matches=2000, source_p=source_p)


def tokens_of(tm, prompt, params, **kw) -> list[int]:
    return [t for chunk, _ in decode(tm, prompt, params, **kw) for t in chunk]


@pytest.fixture(scope="module")
def looping_prompt(tm32):
    # Output that repeats itself (more one-line functions): prompt lookup alone reaches M 2.76 here (fp32).
    return tm32.tokenizer("def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):\n    return x\n\ndef")[
        "input_ids"]


def test_no_draft_call_when_the_curve_says_no_tree_pays(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    steep = dataclasses.replace(tm32, step_cost=NOTHING_PAYS)
    drafter = Counting(PromptLookupDrafter().propose, remote=True)
    res = generate(steep, looping_prompt, params, drafter=drafter, tokenizer=None)
    assert res.token_ids == ar
    assert drafter.calls == 0  # Not one call per step: no RPC when nothing can pay
    assert res.stats.forward_steps == N_NEW - 1  # plain AR steps (the first token comes from the prefill)


def test_a_useless_remote_source_is_skipped_and_outputs_do_not_change(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    flat = dataclasses.replace(tm32, step_cost=FLAT)
    remote = Counting(wrong_datastore_tree, remote=True)
    res = generate(flat, looping_prompt, params, drafter=remote, tokenizer=None)
    assert res.token_ids == ar
    steps = res.stats.forward_steps
    assert remote.calls < steps / 3  # Not an RPC on every step
    assert res.stats.skipped_drafts + remote.calls >= steps - 1  # every step but the last (1 token left) drafts
    assert res.stats.draft_tokens_proposed == 0  # nothing was worth verifying


def test_rest_keeps_drafting_the_request_s_own_tokens_while_the_remote_is_skipped(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    flat = dataclasses.replace(tm32, step_cost=FLAT)
    local = Counting(PromptLookupDrafter().propose, remote=False, name="pld")
    remote = Counting(wrong_datastore_tree, remote=True, local=local)
    res = generate(flat, looping_prompt, params, drafter=remote, tokenizer=None)
    assert res.token_ids == ar
    assert remote.calls < res.stats.forward_steps / 2 and local.calls >= remote.calls
    assert res.stats.mean_accepted_length > 2.0  # Not ~1: the loop is drafted from the context


class Probed(Counting):
    """A remote drafter that also answers in the background (propose_async, as RemoteDrafter does): its answer is
    computed at once, so whether the loop waited for it shows only in which counter moved."""

    def __init__(self, propose, local):
        super().__init__(propose, remote=True, local=local)
        self.background_calls = 0

    def propose_async(self, context_ids, max_nodes) -> Future:
        self.background_calls += 1
        answer: Future = Future()
        try:
            answer.set_result(self._propose(np.array(context_ids), max_nodes))
        except Exception as e:
            answer.set_exception(e)
        return answer


def oracle_after(ar_tokens: list[int], n_prompt: int, start: int):
    """A datastore that knows the greedy continuation once the output has `start` tokens (nothing before)."""

    def propose(context_ids, max_nodes) -> DraftTree:
        done = len(context_ids) - n_prompt
        nxt = ar_tokens[done:done + min(max_nodes, 6)] if done >= start else []
        n = len(nxt)
        source_p = np.zeros((n, len(SOURCES)), np.float32)
        source_p[:, SOURCES.index("datastore")] = 0.9
        return DraftTree(np.asarray(nxt, np.int32), np.arange(-1, n - 1, dtype=np.int32), np.ones(n, np.float32),
                         matched_suffix=8, num_matches=3, source_p=source_p)

    return propose


def test_probes_after_a_skipped_stretch_are_not_waited_for(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    flat = dataclasses.replace(tm32, step_cost=FLAT)
    remote = Probed(wrong_datastore_tree, local=Counting(PromptLookupDrafter().propose, remote=False, name="pld"))
    res = generate(flat, looping_prompt, params, drafter=remote, tokenizer=None)
    assert res.token_ids == ar
    assert remote.calls == 2  # the two asks before the first backoff; Not one waited-for probe per stretch
    assert remote.background_calls >= 2  # the probes still ask, in the background


def test_a_probe_that_finds_the_continuation_brings_the_waited_asks_back(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    flat = dataclasses.replace(tm32, step_cost=FLAT)
    nothing = Counting(lambda c, m: DraftTree.empty(), remote=False, name="nothing")
    useless_first = Probed(oracle_after(ar, len(looping_prompt), start=N_NEW // 3), local=nothing)
    res = generate(flat, looping_prompt, params, drafter=useless_first, tokenizer=None)
    assert res.token_ids == ar
    assert useless_first.background_calls >= 1
    assert useless_first.calls > 2  # asked every step again once a probe found the continuation, Not left skipped
    # A third of the output undrafted, then the oracle's chains: Not ~1, as a source left skipped would give.
    assert res.stats.mean_accepted_length > 1.5


class DownInTheBackground(Probed):
    """A remote source that answers its waited-for asks and then goes down: every background probe fails."""

    def propose_async(self, context_ids, max_nodes) -> Future:
        self.background_calls += 1
        answer: Future = Future()
        answer.set_exception(DraftUnavailable("retrieval: UNAVAILABLE (connection refused)"))
        return answer


def test_a_failed_background_probe_marks_the_request_degraded(tm32, looping_prompt):
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    ar = tokens_of(tm32, looping_prompt, params)
    flat = dataclasses.replace(tm32, step_cost=FLAT)
    remote = DownInTheBackground(wrong_datastore_tree,
                                 local=Counting(PromptLookupDrafter().propose, remote=False, name="pld"))
    res = generate(flat, looping_prompt, params, drafter=remote, tokenizer=None)
    assert res.token_ids == ar  # a source that went down changes nothing but the stats
    assert remote.background_calls >= 1
    # Not silent: the caller learns the source was down although no step waited for it
    assert res.stats.degraded and res.stats.degraded_steps == remote.background_calls
    assert "UNAVAILABLE" in res.stats.degraded_reason


@pytest.mark.parametrize("emitted, local_accepted, answer, useful", [
    ([7, 8], 1, "chain 7 8 9 datastore", True),  # the tree held the bonus token the local draft missed
    ([7, 8], 1, "chain 7 8 9 context", False),  # Not useful: only the request's own tokens predicted it
    ([7, 5], 1, "chain 7 8 9 datastore", False),  # the tree went another way at the missed token
    ([7, 8], 2, "chain 7 8 9 datastore", False),  # the local draft got as far: nothing the probe added
    ([7], 0, "failed", False),  # a probe that failed found nothing
])
def test_probe_was_useful(emitted, local_accepted, answer, useful):
    from generation_service.engine.requests import probe_was_useful

    future: Future = Future()
    if answer == "failed":
        future.set_exception(RuntimeError("retrieval down"))
    else:
        source = answer.split()[-1]
        source_p = np.zeros((3, len(SOURCES)), np.float32)
        source_p[:, SOURCES.index(source)] = 0.5
        future.set_result(DraftTree(np.array([7, 8, 9], np.int32), np.array([-1, 0, 1], np.int32),
                                    source_p=source_p))
    assert probe_was_useful(future, np.array(emitted, np.int32), local_accepted) is useful


class Fixed:
    """A drafter that always proposes the same tree."""

    def __init__(self, tree: DraftTree, remote: bool = False, trusted: bool = False):
        self.tree, self.remote, self.trusted, self.name = tree, remote, trusted, "fixed"
        self.default_source = SOURCES.index("context")

    def propose(self, context_ids, max_nodes):
        return self.tree


def _chain_tree(n: int, parents=None) -> DraftTree:
    source_p = np.full((n, len(SOURCES)), 0.5, np.float32)
    return DraftTree(np.arange(n, dtype=np.int32) + 7, np.arange(-1, n - 1, dtype=np.int32) if parents is None
                     else np.asarray(parents, np.int32), np.ones(n, np.float32), source_p=source_p)


# (drafter, nodes the step may verify, degraded) per scenario; the wrong answers are in the comments
TAKE_DRAFT_SCENARIOS = {
    "an empty local tree is an AR step, not a degraded one": (Fixed(DraftTree.empty()), 0, False),
    "an untrusted local drafter's malformed tree degrades the step": (Fixed(_chain_tree(3, [-1, 1, 0])), 0, True),
    "a trusted drafter's tree is taken as it came": (Fixed(_chain_tree(3), trusted=True), 3, False),
    "an empty remote tree is taken (its miss counts against the source)": (Fixed(DraftTree.empty(), remote=True), 0,
                                                                          False),
}


@pytest.mark.parametrize("name", list(TAKE_DRAFT_SCENARIOS))
def test_take_draft_scenarios(tm32, looping_prompt, name):
    from generation_service.engine.requests import TreeRequest
    from generation_service.model.target import forward_batch

    drafter, nodes, degraded = TAKE_DRAFT_SCENARIOS[name]
    req = TreeRequest(tm32, looping_prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), drafter=drafter,
                      adaptive_budget=False)
    while req.prefilling:
        req.prefilled(forward_batch(tm32, [req.prefill_segment()])[0])
    req.fetch_draft()
    taken = req._tree
    assert (0 if taken is None else len(taken[0])) == nodes  # Not the malformed tree, not a dropped valid one
    assert req.stats.degraded is degraded  # Not degraded for a plain miss
    assert (taken is not None) == (nodes > 0 or drafter.remote)  # an empty local tree leaves no tree at all
