"""The lossless speculative decode loop (and, with no drafter, our autoregressive loop).

One step: draft -> verify_tree -> accept -> gather_kv.
    draft        the drafter proposes a tree (tokens, parents) for the context; DraftUnavailable = AR step
    verify_tree  one forward over [last emitted token] + draft nodes with the tree mask -> logits [q, V]
    accept       walk from the root: pick the emitted token from this row's logits (argmax, or one seeded draw),
                 descend to the child holding that token if there is one, else stop; the last pick is the bonus
    gather_kv    keep the KV rows of the root and the accepted path, drop the rest
The verifier picks every emitted token exactly as the AR loop would (same row distribution, same draw order), so
greedy output equals AR output and seeded sampling equals seeded AR sampling, up to floating point ties.

Server API:
    for chunk in generate_stream(tm, prompt_ids, SamplingParams(...), drafter=d, draft_budget=32,
                                 is_cancelled=lambda: not context.is_active()):
        ...  # chunk.token_ids, chunk.text; the last chunk has finish_reason, stats, usage
    result = generate(...)  # the same, collected
A TargetModel runs one request at a time (the caller serializes requests).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Generator, Iterator

import numpy as np
import torch

from generation_service.draft_budget import DraftSizer
from generation_service.drafters import Drafter, DraftUnavailable
from generation_service.model import TargetModel, cache_length, forward, new_cache
from generation_service.sampling import Sampler, SamplingParams
from generation_service.tree_attention import (
    dfs_order,
    gather_kv,
    prune_depth,
    tree_children,
    tree_mask,
    tree_position_ids,
)

log = logging.getLogger(__name__)

# Nodes asked of the drafter per step (REST's 64); the sizer verifies only what the measured pass cost and the
# acceptance estimates say pays (draft_budget.py), usually far fewer.
DEFAULT_DRAFT_BUDGET = 64
PREFILL_CHUNK = 1024  # prompt tokens per prefill pass (cancellation granularity)
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


@dataclass
class SpeculationStats:
    """Per-request decode statistics; field names match proto SpeculationStats."""

    decoding: str = "ar"
    forward_steps: int = 0  # decode forward passes after prefill
    mean_accepted_length: float = 0.0  # tokens emitted per decode forward pass (M)
    accepted_length_histogram: list[int] = field(default_factory=lambda: [0])  # [i] = steps that emitted i tokens
    draft_ms: float = 0.0
    verify_ms: float = 0.0  # decode forward passes + acceptance + KV gather
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    skipped_drafts: int = 0  # steps that did not ask a useless remote source (draft_budget.py)
    degraded: bool = False
    degraded_steps: int = 0
    degraded_reason: str = ""

    def record_step(self, emitted: int) -> None:
        self.forward_steps += 1
        hist = self.accepted_length_histogram
        while len(hist) <= emitted:
            hist.append(0)
        hist[emitted] += 1
        decoded = sum(i * c for i, c in enumerate(hist))
        self.mean_accepted_length = decoded / self.forward_steps

    def as_dict(self) -> dict:
        """Keyword arguments for generation_pb2.SpeculationStats(**stats.as_dict())."""
        return asdict(self)


@dataclass
class StreamChunk:
    token_ids: list[int]
    text: str
    # Set on the final chunk only.
    finish_reason: str | None = None
    stats: SpeculationStats | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class GenerationResult:
    token_ids: list[int]  # completion tokens (no EOS, nothing after a stop sequence)
    text: str
    finish_reason: str  # stop | length | cancelled
    prompt_tokens: int
    stats: SpeculationStats


# ---------------------------------------------------------------------------------------------------------------
# The loop: pure token level.


def prefill(tm: TargetModel, cache, prompt: torch.Tensor, is_cancelled: Callable[[], bool] | None = None,
            chunk: int = PREFILL_CHUNK) -> torch.Tensor | None:
    """prompt: [P] -> logits of the last position [V] (None if cancelled); the cache then holds P rows.

    Long prompts go in chunks so a cancelled request stops within one chunk's time.
    """
    n = prompt.shape[0]
    for start in range(0, n - chunk, chunk) if n > chunk else ():
        forward(tm, prompt[start:start + chunk], cache, logits_to_keep=1)
        if is_cancelled is not None and is_cancelled():
            return None
    start = (n - 1) // chunk * chunk if n > chunk else 0
    return forward(tm, prompt[start:], cache, logits_to_keep=1)[0]  # lm_head on the last row only


def verify_tree(tm: TargetModel, cache, last: int, tokens: np.ndarray, parents: np.ndarray) -> torch.Tensor:
    """[last] + draft nodes in one pass -> logits [q, V], q >= 1 + n; the cache grows by q rows (gather_kv trims).

    `last` is the last emitted token, not yet in the cache; with an empty tree this is the AR step. Passes shorter
    than tm.min_rows get pad rows (root children never accepted) so every decode row comes from the same kernels.
    """
    past = cache_length(cache)
    dev = tm.device
    n_pad = tm.min_rows - 1 - tokens.shape[0]
    if n_pad > 0:
        tokens = np.concatenate((tokens, np.full(n_pad, last, np.int32)))
        parents = np.concatenate((parents, np.full(n_pad, -1, np.int32)))
    if tokens.shape[0] == 0:
        ids = torch.tensor([last], dtype=torch.int64, device=dev)  # [1]
        return forward(tm, ids, cache, position_ids=torch.tensor([[past]], device=dev))  # [1, V]
    ids = torch.from_numpy(np.concatenate(([last], tokens)).astype(np.int64)).to(dev)  # [q]
    return forward(tm, ids, cache, position_ids=tree_position_ids(parents, past, dev),  # [1, q]
                   mask=tree_mask(parents, past, tm.dtype, dev))  # [1, 1, q, past + q]


def accept(logits: torch.Tensor, children: dict[tuple[int, int], int], sampler: Sampler,
           limit: int) -> tuple[list[int], list[int]]:
    """logits: [q, V] from verify_tree -> (accepted node indices, emitted tokens), len(emitted) = len(path) + 1.

    Row r holds the distribution after the context plus the path to row r. Every emitted token is picked from its
    own row exactly as the AR loop would pick it; a draft child is accepted only if it equals the pick. At most
    `limit` tokens are picked (the request's remaining budget), so no random draw is spent past the output.
    """
    if sampler.greedy:
        # [q], one reduction for all rows; in fp32 because torch's bf16 argmax is a slow scalar loop (1.2 ms for
        # 2 x 49152 vs 0.2 ms); the cast is exact, so the pick (first maximum) is the same.
        top = logits.float().argmax(dim=-1).tolist()

        def pick(row: int) -> int:
            return top[row]
    else:
        def pick(row: int) -> int:
            return sampler.pick(logits[row])

    path: list[int] = []
    emitted: list[int] = []
    node = -1  # the root: row 0
    while True:
        token = pick(node + 1)
        emitted.append(token)
        if len(emitted) >= limit:
            break
        child = children.get((node, token))
        if child is None:
            break
        path.append(child)
        node = child
    return path, emitted


def _check_tree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, source_p: np.ndarray | None,
                vocab_size: int) -> None:
    n = tokens.shape[0]
    if parents.shape != (n,) or scores.shape != (n,):
        raise DraftUnavailable(f"malformed draft: {n} tokens but parents {parents.shape}, scores {scores.shape}")
    if n and (np.any(parents >= np.arange(n)) or parents.min() < -1):
        raise DraftUnavailable(f"malformed draft: parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")
    if n and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise DraftUnavailable(f"malformed draft: token ids must lie in [0, {vocab_size})")
    if source_p is not None and (source_p.shape[0] != n or not np.all((source_p >= 0) & (source_p <= 1))):
        raise DraftUnavailable(f"malformed draft: source_p must be [{n}, sources] within [0, 1]")


def draft(drafter: Drafter, context: np.ndarray, budget: int, max_depth: int,
          vocab_size: int, sizer: DraftSizer | None = None) -> tuple[np.ndarray, np.ndarray]:
    """context: int32 [T] -> (tokens int32 [n], parents int32 [n]) in verifier layout (depth first, best child
    first), n <= budget, depth <= max_depth; a sizer then keeps only the cost-effective part of the tree."""
    tree = drafter.propose(context, budget)
    # The first `budget` nodes of a tree with parents[i] < i are again such a tree.
    tokens, parents, scores = tree.tokens[:budget], tree.parents[:budget], tree.scores[:budget]
    source_p = tree.source_p[:budget] if tree.source_p is not None else None
    _check_tree(tokens, parents, scores, source_p, vocab_size)
    keep, parents = prune_depth(parents, max_depth)
    tokens, scores = tokens[keep], scores[keep]
    source_p = source_p[keep] if source_p is not None else None
    if sizer is not None:
        tokens, parents, scores, _ = sizer.shrink(tokens, parents, scores, source_p,
                                                  getattr(drafter, "default_source", 0),
                                                  remote=getattr(drafter, "remote", False),
                                                  matched_suffix=tree.matched_suffix,
                                                  context_matched_suffix=tree.context_matched_suffix)
    order, parents = dfs_order(parents, scores)
    if sizer is not None:
        sizer.expect(order)
    return tokens[order], parents


def cut_emitted(tokens: list[int], remaining: int, eos: frozenset[int]) -> tuple[list[int], str | None]:
    """Apply EOS and the token budget to one step's emitted tokens -> (output tokens, finish reason or None)."""
    tokens = tokens[:remaining]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], FINISH_STOP
    return tokens, (FINISH_LENGTH if len(tokens) >= remaining else None)


def decode(tm: TargetModel, prompt_ids, params: SamplingParams, *, drafter: Drafter | None = None,
           draft_budget: int = DEFAULT_DRAFT_BUDGET, stats: SpeculationStats | None = None,
           is_cancelled: Callable[[], bool] | None = None,
           adaptive_budget: bool = True) -> Iterator[tuple[list[int], str | None]]:
    """Token-level generation: yields (new output tokens, finish reason) once per forward pass; the last item
    carries the finish reason (stop = EOS, length, cancelled). EOS is not part of the output.

    adaptive_budget: verify only the cost-effective part of each draft tree and skip useless remote drafts
    (draft_budget.py); False = always verify up to draft_budget nodes. Either way the output is the same."""
    prompt = _check_prompt(tm, prompt_ids, params)
    if isinstance(draft_budget, bool) or not isinstance(draft_budget, (int, np.integer)) or draft_budget < 0:
        raise ValueError(f"draft_budget must be an integer >= 0 (0 = no drafting), got {draft_budget!r}")
    stats = stats if stats is not None else SpeculationStats(decoding=drafter.name if drafter else "ar")
    eos = frozenset() if params.ignore_eos else tm.eos_token_ids
    sampler = Sampler(params)
    n_prompt = prompt.shape[0]
    context = np.empty(n_prompt + params.max_new_tokens, np.int32)  # prompt + output, the drafter's view
    context[:n_prompt] = prompt
    n_ctx = n_prompt
    cancelled = is_cancelled or (lambda: False)
    sizer = DraftSizer(tm.step_cost) if adaptive_budget and drafter is not None else None
    if sizer is not None:
        # Nodes beyond the largest tree that could ever pay on this machine's curve are never worth asking for.
        draft_budget = min(draft_budget, tm.step_cost.max_nodes)

    if cancelled():
        yield [], FINISH_CANCELLED
        return
    t0 = time.perf_counter()
    cache = new_cache(tm)
    logits = prefill(tm, cache, torch.from_numpy(prompt.astype(np.int64)).to(tm.device), is_cancelled)
    if logits is None:
        stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        yield [], FINISH_CANCELLED
        return
    last = sampler.pick(logits)
    stats.prefill_ms = (time.perf_counter() - t0) * 1e3
    out, finish = cut_emitted([last], params.max_new_tokens, eos)
    context[n_ctx] = last
    n_ctx += 1
    n_out = len(out)
    yield out, finish
    if finish:
        return

    while True:
        if cancelled():
            yield [], FINISH_CANCELLED
            return
        remaining = params.max_new_tokens - n_out
        tokens = parents = np.zeros(0, np.int32)
        source = drafter if draft_budget > 0 and remaining > 1 else None
        if source is not None and sizer is not None and getattr(source, "remote", False) \
                and not sizer.query_remote():
            source = source.local  # a remote source that keeps being useless is skipped for a while
            stats.skipped_drafts += 1
        if source is not None:
            t = time.perf_counter()
            try:
                # One step emits at most depth + 1 tokens: deeper nodes could never be used.
                tokens, parents = draft(source, context[:n_ctx], draft_budget, remaining - 1, tm.vocab_size,
                                        sizer)
            except DraftUnavailable as e:
                _degrade(stats, str(e))
            except Exception as e:  # a drafter bug must not fail the request; AR is always correct
                log.exception("drafter %s failed", getattr(source, "name", source))
                _degrade(stats, f"drafter error: {type(e).__name__}: {e}")
            stats.draft_ms += (time.perf_counter() - t) * 1e3

        t = time.perf_counter()
        past = cache_length(cache)
        logits = verify_tree(tm, cache, last, tokens, parents)
        path, emitted = accept(logits, tree_children(tokens, parents) if tokens.shape[0] else {}, sampler, remaining)
        gather_kv(cache, past, path)  # also when nothing was accepted: rejected and pad rows must go
        stats.verify_ms += (time.perf_counter() - t) * 1e3
        stats.draft_tokens_proposed += int(tokens.shape[0])
        stats.draft_tokens_accepted += len(path)
        stats.record_step(len(emitted))
        if sizer is not None:
            sizer.observe(path)

        last = emitted[-1]
        context[n_ctx:n_ctx + len(emitted)] = emitted
        n_ctx += len(emitted)
        out, finish = cut_emitted(emitted, remaining, eos)
        n_out += len(out)
        yield out, finish
        if finish:
            return


def _degrade(stats: SpeculationStats, reason: str) -> None:
    stats.degraded = True
    stats.degraded_steps += 1
    if not stats.degraded_reason:
        stats.degraded_reason = reason[:500]


def _check_prompt(tm: TargetModel, prompt_ids, params: SamplingParams) -> np.ndarray:
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.shape[0] == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of token ids, got shape {prompt.shape}")
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_ids must hold integer token ids, got dtype {prompt.dtype}")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= tm.vocab_size:
        raise ValueError(f"prompt_ids must lie in [0, {tm.vocab_size}), got {lo}..{hi}")
    if prompt.shape[0] + params.max_new_tokens > tm.max_positions:
        raise ValueError(f"max_new_tokens: prompt ({prompt.shape[0]}) + max_new_tokens ({params.max_new_tokens}) "
                         f"exceeds the model's {tm.max_positions} positions")
    return prompt.astype(np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Checking losslessness (tests and the benchmark).


@dataclass
class Divergence:
    index: int  # first output position where the two runs differ
    ar_token: int
    other_token: int
    gap: float  # AR-path logit of ar_token minus that of other_token at that position
    near_tie: bool


def near_tie_threshold(top_logit: float, dtype: torch.dtype) -> float:
    """Two units in the last place of the top logit in `dtype`: below that, rounding alone can flip the order."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}.get(dtype, 23)
    return float(2.0 * 2.0 ** (np.floor(np.log2(max(abs(top_logit), 1e-30))) - mantissa))


def first_divergence(tm: TargetModel, prompt_ids, ar_tokens: list[int], other: list[int]) -> Divergence | None:
    """None if `other` equals `ar_tokens` (up to the shorter length); else where and how narrowly they differ.

    The gap is measured on the AR loop's own logits (prefill + single steps, the same kernels), so it says how
    close the AR decision was at the position where the other run decided differently.
    """
    n = min(len(ar_tokens), len(other))
    i = next((k for k in range(n) if ar_tokens[k] != other[k]), None)
    if i is None:
        return None
    cache = new_cache(tm)
    empty = np.zeros(0, np.int32)
    logits = prefill(tm, cache, torch.as_tensor(np.asarray(prompt_ids, np.int64), device=tm.device))
    for k in range(i):
        past = cache_length(cache)
        logits = verify_tree(tm, cache, ar_tokens[k], empty, empty)[0]
        gather_kv(cache, past, [])
    row = logits.float()
    gap = float(row[ar_tokens[i]] - row[other[i]])
    return Divergence(i, ar_tokens[i], other[i], gap, bool(abs(gap) <= near_tie_threshold(float(row.max()), tm.dtype)))


# ---------------------------------------------------------------------------------------------------------------
# Text level: incremental detokenization, stop sequences, streaming.


class TextStream:
    """Detokenizes output tokens incrementally, finds stop sequences, and holds back text that could still turn
    into a stop sequence (a stop string may span chunk boundaries), together with the tokens that produced it."""

    # Decode a few prompt tokens before the output so tokenizers that strip a leading space decode the first
    # output token the way the full text would (vLLM's prefix/read offsets).
    _PROMPT_TAIL = 6

    def __init__(self, tokenizer, prompt: np.ndarray, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self._ids: list[int] = [int(t) for t in prompt[-self._PROMPT_TAIL:]] if tokenizer is not None else []
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.text = ""
        self.tokens: list[int] = []
        self.ends: list[int] = []  # [i] = len(text) once token i was decoded
        self._searched = 0  # text before this index holds no stop sequence start
        self._sent_tokens = 0
        self._sent_chars = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, tokens: list[int]) -> bool:
        """Append output tokens; return True if a stop sequence appeared (the text is then cut before it)."""
        if self.stopped:
            return True
        for t in tokens:
            self.tokens.append(t)
            if self.tokenizer is not None:
                self._ids.append(t)
                new = self._decode(self._ids[self._prefix:])
                # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the token that completes it.
                if len(new) > len(self._prefix_text) and not new.endswith("\ufffd"):
                    self.text += new[len(self._prefix_text):]
                    self._prefix, self._read = self._read, len(self._ids)
                    self._prefix_text = self._decode(self._ids[self._prefix:self._read])
            self.ends.append(len(self.text))
        return self._find_stop()

    def flush(self) -> bool:
        """At the end: emit bytes still waiting for completion (as the tokenizer renders them)."""
        if self.tokenizer is not None and not self.stopped and self._read < len(self._ids):
            new = self._decode(self._ids[self._prefix:])
            self.text += new[len(self._prefix_text):]
            if self.ends:
                self.ends[-1] = len(self.text)
            self._prefix = self._read = len(self._ids)
            self._prefix_text = ""
            return self._find_stop()
        return self.stopped

    def _find_stop(self) -> bool:
        if not self.stop:
            return False
        start = max(0, self._searched - self.max_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        cut = min(hits)
        self.text = self.text[:cut]
        # Keep the tokens whose text starts before the cut (the one straddling it included).
        keep = 0
        while keep < len(self.tokens) and (self.ends[keep - 1] if keep else 0) < cut:
            keep += 1
        del self.tokens[keep:], self.ends[keep:]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop sequence."""
        for n in range(min(self.max_stop - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def release(self, final: bool) -> tuple[list[int], str]:
        """-> (tokens, text) not yet sent; unless final, keep back a possible stop-sequence prefix."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        n = len(self.tokens) if final or self.stopped else self._sent_tokens
        while not (final or self.stopped) and n < len(self.tokens) and self.ends[n] <= end:
            n += 1
        tokens, text = self.tokens[self._sent_tokens:n], self.text[self._sent_chars:end]
        self._sent_tokens, self._sent_chars = n, max(end, self._sent_chars)
        return tokens, text


def generate_stream(tm: TargetModel, prompt_ids, params: SamplingParams, *, drafter: Drafter | None = None,
                    draft_budget: int = DEFAULT_DRAFT_BUDGET, is_cancelled: Callable[[], bool] | None = None,
                    tokenizer="model", decoding: str | None = None,
                    adaptive_budget: bool = True) -> Iterator[StreamChunk]:
    """Stream output chunks (about one per forward pass); the final chunk has finish_reason, stats and usage.

    tokenizer: "model" = tm.tokenizer; None = token ids only (no text, stop sequences not allowed).
    decoding: the name reported in stats (default: the drafter's name, or "ar").
    """
    t0 = time.perf_counter()
    tok = stream_tokenizer(tm, tokenizer, params)
    stats = SpeculationStats(decoding=decoding or (drafter.name if drafter is not None else "ar"))
    steps = decode(tm, prompt_ids, params, drafter=drafter, draft_budget=draft_budget, stats=stats,
                   is_cancelled=is_cancelled, adaptive_budget=adaptive_budget)
    finish, ids, delta, n_tokens = yield from text_chunks(steps, tok, prompt_ids, params.stop, StreamChunk)
    stats.total_ms = (time.perf_counter() - t0) * 1e3
    yield StreamChunk(ids, delta, finish_reason=finish, stats=stats, prompt_tokens=len(prompt_ids),
                      completion_tokens=n_tokens)


def stream_tokenizer(tm: TargetModel, tokenizer, params: SamplingParams):
    """tokenizer: "model" = tm.tokenizer, None = token ids only (then stop sequences cannot be matched)."""
    tok = tm.tokenizer if isinstance(tokenizer, str) and tokenizer == "model" else tokenizer
    if tok is None and params.stop:
        raise ValueError("stop: stop sequences need a tokenizer to match text")
    return tok


def text_chunks(steps: Iterator[tuple[list[int], str | None]], tok, prompt_ids, stop: list[str],
                chunk: type[StreamChunk]) -> Generator[StreamChunk, None, tuple[str, list[int], str, int]]:
    """Token steps (tokens, finish reason or None) -> text chunks, shared by every decoding loop; returns what the
    final chunk needs: (finish reason, last ids, last text, completion tokens). Closes `steps` on a stop."""
    text = TextStream(tok, np.asarray(prompt_ids), stop)
    finish = FINISH_LENGTH
    try:
        for tokens, finish_step in steps:
            if text.add(tokens):
                finish = FINISH_STOP
                break
            if finish_step:
                finish = finish_step
                break
            ids, delta = text.release(final=False)
            if ids or delta:
                yield chunk(ids, delta)
    finally:
        steps.close()
    if (finish != FINISH_STOP or not text.stopped) and text.flush():
        finish = FINISH_STOP
    ids, delta = text.release(final=True)
    return finish, ids, delta, len(text.tokens)


def generate(tm: TargetModel, prompt_ids, params: SamplingParams, **kwargs) -> GenerationResult:
    """generate_stream, collected. Same keyword arguments."""
    tokens: list[int] = []
    parts: list[str] = []
    for chunk in generate_stream(tm, prompt_ids, params, **kwargs):
        tokens += chunk.token_ids
        parts.append(chunk.text)
        if chunk.finish_reason is not None:
            return GenerationResult(tokens, "".join(parts), chunk.finish_reason, chunk.prompt_tokens, chunk.stats)
    raise AssertionError("generate_stream ended without a final chunk")
