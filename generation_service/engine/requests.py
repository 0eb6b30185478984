"""One draft-tree request (`ar`, `pld`, `rest-ds`, `rest`, `crest`) as a state machine over the step primitives.

The same object serves a request decoded alone (speculative.decode drives it pass by pass) and one decoded in a
continuous batch (engine/scheduler.py puts its rows into a shared pass). Its lifecycle:

    req = TreeRequest(tm, prompt_ids, params, drafter=d)
    while req.prefilling:                      # prompt chunks
        logits = forward_batch(tm, [req.prefill_segment()])[0]
        step = req.prefilled(logits)           # None until the last chunk; then (output tokens, finish)
    while req.finish is None:
        req.fetch_draft()                      # the drafter's tree, checked and pruned (may be an RPC)
        req.choose()                           # how much of it to verify (alone: its own cost curve)
        logits = forward_batch(tm, [req.decode_segment()])[0]
        out, finish = req.commit(logits)       # accept, KV commit, stats

A batch replaces choose() by choose(n) with n from draft_budget.batch_sizes over every request in the pass.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from generation_service.drafting.budget import (
    LOCAL_SOURCES,
    DraftSizer,
    SharedCalibration,
    best_size,
    keep_best,
    subtree,
)
from generation_service.drafting.drafters import Drafter, DraftUnavailable
from generation_service.engine.prefill_share import MIN_ROWS, piece_rows
from generation_service.engine.prefix_cache import PrefixCache, PrefixHit
from generation_service.engine.steps import (
    DEFAULT_DRAFT_BUDGET,
    FINISH_CANCELLED,
    PREFILL_CHUNK,
    SpeculationStats,
    accept,
    check_prompt,
    check_tree,
    cut_emitted,
    degrade,
    tree_segment,
)
from generation_service.model.lean_llama import Segment, capacity_for
from generation_service.model.sampling import Sampler, SamplingParams, TokenLogprob, token_logprobs
from generation_service.model.step_cost import StepCost
from generation_service.model.target import TargetModel, cache_length, new_cache
from generation_service.model.tree_attention import dfs_order, gather_kv, prune_depth, tree_children
from ragcore.draft_tree import DraftTree

log = logging.getLogger(__name__)
_EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class FirstPick:
    """A prompt held whole in the prefix cache and its first output step, taken before the request starts (the
    engine sends that token from the submitting thread instead of after the pass in flight)."""
    hit: PrefixHit
    sampler: Sampler  # it drew the first token: the request goes on with its stream
    token: int
    step: tuple[list[int], str | None]  # (output tokens, finish), as TreeRequest.first_step will give them


def pick_first(tm: TargetModel, prompt_ids, params: SamplingParams, prefix_cache: PrefixCache) -> FirstPick | None:
    """The first step of a prompt the prefix cache holds whole, else None. Pure but for the cache's LRU order and
    counts: the token is the one the request's own first step picks from the same logits."""
    prompt = check_prompt(tm, prompt_ids, params)
    hit = prefix_cache.lookup_whole(prompt)
    if hit is None:
        return None
    sampler = Sampler(params)
    token = sampler.pick(hit.logits)
    return FirstPick(hit, sampler, token, cut_emitted([token], params.max_new_tokens, output_eos(tm, params)))


def output_eos(tm: TargetModel, params: SamplingParams) -> frozenset[int]:
    """The tokens that end this request's output."""
    return frozenset() if params.ignore_eos else tm.eos_token_ids


PROBE_WAIT_STEPS = 2  # steps a background probe's answer may come after the step it was asked for


@dataclass
class _Probe:
    """A remote draft asked in the background while the step ran on the in-process draft."""

    answer: Future  # the remote drafter's tree (or its DraftUnavailable)
    start: int  # the context length it was asked for
    end: int = -1  # the context length after that step's tokens (-1: the step is not committed yet)
    local_accepted: int = 0  # draft tokens that step accepted from the in-process draft
    waited: int = 0  # steps committed after that one while the answer was still out


def probe_was_useful(answer: Future, emitted: np.ndarray, local_accepted: int) -> bool:
    """Would the probe's tree have paid on its step: did it hold the step's emitted tokens past the ones the
    in-process draft got accepted, at a node a remote source predicted (not only the request's own tokens)?"""
    try:
        tree = answer.result()
    except Exception:  # a probe that failed found nothing; drafting never fails a request
        return False
    path = tree.follow(emitted)
    if len(path) <= local_accepted:
        return False
    if tree.source_p is None:  # a tree without per-source estimates (CREST) is the remote source's alone
        return True
    remote = [i for i in range(tree.source_p.shape[1]) if i not in LOCAL_SOURCES]
    return bool(tree.source_p[path[local_accepted], remote].max() > 0)


class TreeRequest:
    def __init__(self, tm: TargetModel, prompt_ids, params: SamplingParams, *, drafter: Drafter | None = None,
                 draft_budget: int = DEFAULT_DRAFT_BUDGET, stats: SpeculationStats | None = None,
                 adaptive_budget: bool = True, prefill_chunk: int = PREFILL_CHUNK, cache=None,
                 calibration: SharedCalibration | None = None, prefix_cache: PrefixCache | None = None,
                 first: FirstPick | None = None):
        """adaptive_budget: verify only the cost-effective part of each draft tree and skip useless remote drafts
        (drafting/budget.py); False = always verify up to draft_budget nodes. Either way the output is the same.
        cache: an empty KV cache to use (a batch's slab slot; it must hold kv_rows_needed()), else a new one.
        calibration: acceptance evidence pooled over the worker's requests (the sizer's prior), None = none.
        prefix_cache: the worker's prompt KV cache (engine/prefix_cache.py): the prompt takes what it holds of it
        (all of it: first_step is then the first output step, no prefill pass) and leaves its own rows there.
        first: pick_first's answer for this prompt and params, taken earlier (its hit and its pick stand in for the
        lookup and the first draw)."""
        self.prompt = check_prompt(tm, prompt_ids, params)
        if isinstance(draft_budget, bool) or not isinstance(draft_budget, (int, np.integer)) or draft_budget < 0:
            raise ValueError(f"draft_budget must be an integer >= 0 (0 = no drafting), got {draft_budget!r}")
        self.tm, self.params, self.drafter = tm, params, drafter
        self.stats = stats if stats is not None else SpeculationStats(decoding=drafter.name if drafter else "ar")
        self.eos = output_eos(tm, params)
        self.sampler = first.sampler if first is not None else Sampler(params)
        n_prompt = self.prompt.shape[0]
        self.context = np.empty(n_prompt + params.max_new_tokens, np.int32)  # prompt + output, the drafter's view
        self.context[:n_prompt] = self.prompt
        self.n_ctx = n_prompt
        self.n_out = 0
        self.sizer = DraftSizer(tm.step_cost, shared=calibration) if adaptive_budget and drafter is not None else None
        self._probe: _Probe | None = None  # a remote draft asked in the background, not yet judged
        # Nodes beyond the largest tree that could ever pay on this machine's curve are never worth asking for.
        self.budget = min(draft_budget, tm.step_cost.max_nodes) if self.sizer is not None else draft_budget
        self.cache = cache if cache is not None else new_cache(tm, capacity_for(n_prompt, params.max_new_tokens,
                                                                                 self.budget))
        self.finish: str | None = None
        self.last = -1  # the last emitted token (not yet in the cache)
        # Each output token's log-probability (params.logprobs set), from the rows it was picked from.
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self._t_prefill = 0.0
        self._prefix_cache = prefix_cache
        if first is not None:
            hit = first.hit
        else:
            hit = prefix_cache.lookup(self.prompt) if prefix_cache is not None else None
        self.stats.cached_prompt_tokens = hit.rows if hit is not None else 0
        if hit is not None:
            self._restore(hit)
        # The prompt rows still to prefill, in pieces the engine sizes per pass (engine/prefill_share.py) within
        # the grid of prefill_chunk from position 0 (the prefix cache's boundaries).
        rest = self.prompt[self.stats.cached_prompt_tokens:]
        self._rest = torch.from_numpy(rest.astype(np.int64)).to(tm.device)
        self._chunk = max(1, prefill_chunk)
        self._done = 0  # rows of _rest prefilled
        self._piece = 0  # rows of the piece in flight (prefill_segment)
        self._cacheable = True  # its prompt rows may go to the prefix cache (prefill_segment)
        self._base = cache_length(self.cache)  # rows restored from the prefix cache: whole chunks, or none
        # The first output step when the whole prompt came from the prefix cache (the engine sends it at once).
        self.first_step = None
        if first is not None:
            self.first_step = self._first(first.token, hit.logits)
        elif hit is not None and hit.logits is not None:
            self.first_step = self._first(self.sampler.pick(hit.logits), hit.logits)
        # The current step's draft: the full checked tree, then the chosen part in verifier order.
        self._tree: tuple | None = None
        self.tokens, self.parents = _EMPTY, _EMPTY
        self.p = np.zeros(0)  # acceptance estimates of the fetched tree's nodes (for batch sizing)
        self._past = 0

    # ------------------------------------------------------------------------------------------------ prefill

    @property
    def prefilling(self) -> bool:
        return self._done < self._rest.shape[0]

    @property
    def kv_rows(self) -> int:
        """KV rows this request may need at most (its cache's capacity)."""
        return self.cache.capacity if hasattr(self.cache, "capacity") else 0

    @property
    def next_prefill_rows(self) -> int:
        """Rows of the next prefill chunk when a pass takes all it may (0 once prefilled)."""
        return self.prefill_rows(self._chunk)

    def prefill_rows(self, allowed: int) -> int:
        """Rows of the next prefill piece when a pass may carry about `allowed` (engine/prefill_share.py)."""
        if not self.prefilling:
            return 0
        return piece_rows(self._base + self._done, int(self._rest.shape[0]) - self._done, self._chunk, allowed,
                          MIN_ROWS if allowed >= MIN_ROWS else 1)

    def prefill_segment(self, allowed: int | None = None) -> Segment:
        """The next prefill piece (about `allowed` rows, None = a whole chunk); prefilled() takes its logits."""
        if not self._t_prefill:
            self._t_prefill = time.perf_counter()
        n = self.prefill_rows(self._chunk if allowed is None else allowed)
        a = self._done
        self._piece = n
        if not self.tm.rows_pass_invariant and n < min(MIN_ROWS, self._chunk - (self._base + a) % self._chunk,
                                                       self._rest.shape[0] - a):
            # Smaller than the piece a prefill alone would run and below the prefill linears' precision threshold:
            # its rows are not what a fresh prefill of this prompt computes, so the prefix cache must not hand them
            # to a later request (engine/prefix_cache.py).
            self._cacheable = False
        past = self._base
        return Segment(self._rest[a:a + n], torch.arange(past + a, past + a + n, device=self._rest.device),
                       self.cache, None, 1)

    def prefilled(self, logits: torch.Tensor) -> tuple[list[int], str | None] | None:
        """After the pass of prefill_segment(): None while chunks remain; then the first output step."""
        self._done += self._piece
        self._piece = 0
        if self.prefilling:
            return None
        self.stats.prefill_ms = (time.perf_counter() - self._t_prefill) * 1e3
        if self._prefix_cache is not None:
            if self._cacheable:
                self._prefix_cache.store(self.prompt, self.cache.k, self.cache.v, logits[-1])
        return self._first(self.sampler.pick(logits[-1]), logits[-1])

    def _first(self, token: int, row: torch.Tensor) -> tuple[list[int], str | None]:
        """The first output step: the token picked from the last prompt row's logits (row [V])."""
        self.last = token
        return self._emit([token], self.params.max_new_tokens, row.view(1, -1))

    @torch.inference_mode()
    def _restore(self, hit: PrefixHit) -> None:
        """The prompt's first hit.rows rows from the prefix cache into this request's (empty) cache."""
        c = self.cache
        c.reserve(hit.rows)
        c.k[:, :, :hit.rows] = hit.k[:, :, :hit.rows]
        c.v[:, :, :hit.rows] = hit.v[:, :, :hit.rows]
        c.length = hit.rows
        if c.slab is not None:
            c.slab.mark_written(c.slot, hit.rows)

    # ------------------------------------------------------------------------------------------------- decode

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.n_out

    def fetch_draft(self, allow_remote: bool = True) -> None:
        """Ask the drafter for this step's tree (an RPC for remote drafters: safe to run beside other requests'
        fetches); a failing drafter makes this step AR and the request degraded, never failed. allow_remote=False:
        only the drafter's in-process part (the engine's DraftGate)."""
        source = self.draft_source(allow_remote)
        if source is None:
            return
        t = time.perf_counter()
        try:
            tree = source.propose(self.draft_context(), self.budget)
        except Exception as e:  # take_draft: a failed draft is an AR step
            tree = e
        self.take_draft(source, tree, (time.perf_counter() - t) * 1e3)

    def draft_source(self, allow_remote: bool = True) -> Drafter | None:
        """Who drafts this step (None: nobody, an AR step). The first half of fetch_draft: the engine asks the
        remote sources of a whole pass in one call and hands each request its tree (take_draft)."""
        self._tree, self.p = None, np.zeros(0)
        source = self.drafter if self.budget > 0 and self.remaining > 1 else None
        if source is None or not getattr(source, "remote", False):
            return source
        if self._probe is not None or not allow_remote or (self.sizer is not None and not self.sizer.query_remote()):
            self.stats.skipped_drafts += 1
            return source.local  # a remote source that keeps being useless is skipped for a while
        if self.sizer is not None and self.sizer.probing and source.local is not None and hasattr(
                source, "propose_async"):
            # The probe after a skipped stretch: asked in the background, judged after this step (_judge_probe).
            self._probe = _Probe(source.propose_async(self.draft_context(), self.budget), self.n_ctx)
            self.stats.skipped_drafts += 1
            return source.local
        return source

    def skip_draft(self) -> None:
        """No draft this step (the engine's DraftGate found drafting does not pay in this batch): an AR step."""
        self._tree, self.p = None, np.zeros(0)
        if getattr(self.drafter, "remote", False):
            self.stats.skipped_drafts += 1

    def draft_context(self) -> np.ndarray:
        """int32 [T]: prompt + output so far, what the drafter drafts from."""
        return self.context[:self.n_ctx]

    def take_draft(self, source: Drafter, tree: DraftTree | BaseException, ms: float) -> None:
        """The tree `source` proposed (or the exception it raised, `ms` after it was asked): checked, cut to the
        budget and to what can still be emitted, estimated."""
        self.stats.draft_ms += ms
        if isinstance(tree, DraftUnavailable):
            degrade(self.stats, str(tree))
            return
        if isinstance(tree, BaseException):  # a drafter bug must not fail the request; AR is always correct
            log.error("drafter %s failed", getattr(source, "name", source), exc_info=tree)
            degrade(self.stats, f"drafter error: {type(tree).__name__}: {tree}")
            return
        remote = getattr(source, "remote", False)
        if len(tree) == 0 and not remote:  # nothing to verify; only a remote source's misses count (sizer)
            return
        try:
            # The first `budget` nodes of a tree with parents[i] < i are again such a tree.
            b = self.budget
            tokens, parents, scores = tree.tokens[:b], tree.parents[:b], tree.scores[:b]
            source_p = tree.source_p[:b] if tree.source_p is not None else None
            if not getattr(source, "trusted", False):
                check_tree(tokens, parents, scores, source_p, self.tm.vocab_size)
            # One step emits at most depth + 1 tokens: deeper nodes could never be used. A tree of n nodes is at
            # most n deep.
            if tokens.shape[0] > self.remaining - 1:
                keep, parents = prune_depth(parents, self.remaining - 1)
                tokens, scores = tokens[keep], scores[keep]
                source_p = source_p[keep] if source_p is not None else None
            self._tree = (tokens, parents, scores, remote)
            if self.sizer is not None:
                self.p = self.sizer.estimate(parents, scores, source_p, getattr(source, "default_source", 0),
                                             tree.matched_suffix, tree.context_matched_suffix)
        except DraftUnavailable as e:
            degrade(self.stats, str(e))
        except Exception as e:  # a tree we cannot use is an AR step, as a drafter failure is
            log.exception("draft from %s unusable", getattr(source, "name", source))
            degrade(self.stats, f"drafter error: {type(e).__name__}: {e}")

    def choose(self, n: int | None = None, cost: StepCost | None = None) -> None:
        """Keep n nodes of the fetched tree (the best by estimate, plus their ancestors); None = as many as pay
        for this request alone on `cost` (default: the sizer's calibrated curve; all of them without a sizer)."""
        self.tokens, self.parents = _EMPTY, _EMPTY
        if self._tree is None:
            return
        tokens, parents, scores, remote = self._tree
        if self.sizer is not None:
            if n is None:
                n = best_size(np.sort(self.p)[::-1], cost or self.sizer.cost)
            if n == 0:  # an AR step after all (most requests of a big batch): nothing to lay out
                self.sizer.keep_none(remote)
                return
            keep = keep_best(parents, self.p, n)
            self.sizer.keep(keep, remote)
            tokens, parents, scores = tokens[keep], subtree(keep, parents), scores[keep]
        order, parents = dfs_order(parents, scores)
        if self.sizer is not None:
            self.sizer.expect(order)
        self.tokens, self.parents = tokens[order], parents

    def decode_segment(self) -> Segment:
        self._t_step = time.perf_counter()
        self._past = self.cache.get_seq_length()
        return tree_segment(self.tm, self.cache, self.last, self.tokens, self.parents)

    def commit(self, logits: torch.Tensor, top: list[int] | None = None) -> tuple[list[int], str | None]:
        """After the pass of decode_segment(): accept, keep the accepted rows' KV -> (output tokens, finish).
        top: the greedy picks of the logits' rows if the caller took them already (steps.accept)."""
        remaining = self.remaining
        children = tree_children(self.tokens, self.parents) if self.tokens.shape[0] else {}
        path, emitted = accept(logits, children, self.sampler, remaining, top)
        gather_kv(self.cache, self._past, path)  # also when nothing was accepted: rejected and pad rows must go
        s = self.stats
        s.verify_ms += (time.perf_counter() - self._t_step) * 1e3
        s.draft_tokens_proposed += int(self.tokens.shape[0])
        s.draft_tokens_accepted += len(path)
        s.record_step(len(emitted))
        if self.sizer is not None:
            self.sizer.observe(path)
        self.last = emitted[-1]
        # Emitted token i was picked from row 0 (the root) or from the row of the i-th accepted node.
        rows = logits[[0] + [c + 1 for c in path]] if self.logprobs is not None else None
        out = self._emit(emitted, remaining, rows)
        if self._probe is not None:
            self._judge_probe(len(path))
        return out

    def _judge_probe(self, accepted: int) -> None:
        """After a commit: judge the background probe once its answer is in (accepted: draft tokens this step
        accepted). Its step is the one it was asked for; an answer later than PROBE_WAIT_STEPS steps is useless."""
        probe = self._probe
        if probe.end < 0:
            probe.end, probe.local_accepted = self.n_ctx, accepted
        elif not probe.answer.done():
            probe.waited += 1
        if not probe.answer.done():
            if probe.waited < PROBE_WAIT_STEPS:
                return
            probe.answer.cancel()
            useful = False
        else:
            useful = probe_was_useful(probe.answer, self.context[probe.start:probe.end], probe.local_accepted)
            failure = None if probe.answer.cancelled() else probe.answer.exception()
            if failure is not None:  # the step did not wait for it, but the caller must still learn the source is down
                degrade(self.stats, str(failure) if isinstance(failure, DraftUnavailable)
                        else f"drafter error: {type(failure).__name__}: {failure}")
        self._probe = None
        if self.sizer is not None:
            self.sizer.probe_result(useful)

    def cancel(self) -> tuple[list[int], str]:
        self.finish = FINISH_CANCELLED
        return [], FINISH_CANCELLED

    def _emit(self, emitted: list[int], remaining: int, rows: torch.Tensor | None = None
              ) -> tuple[list[int], str | None]:
        """rows: [len(emitted), V] the logits each token was picked from (needed when logprobs are asked for)."""
        self.context[self.n_ctx:self.n_ctx + len(emitted)] = emitted
        self.n_ctx += len(emitted)
        out, finish = cut_emitted(emitted, remaining, self.eos)
        if self.logprobs is not None and out:
            self.logprobs += token_logprobs(rows[:len(out)], out, self.params.logprobs)
        self.n_out += len(out)
        self.finish = finish
        return out, finish
