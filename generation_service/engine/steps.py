"""Step primitives every decoding mode shares: one verify pass over [last token] + a draft tree (as a Segment of a
possibly batched forward), the acceptance walk, KV commit, output cuts, draft-tree checks, per-request stats.

One decode step:  draft -> tree_segment -> forward_batch -> accept -> gather_kv
    tree_segment  [last emitted token] + draft nodes with the tree's positions and 4D mask (pad rows in low
                  precision, so every decode row comes from the same kernels, model/target.py)
    accept        walk from the root: pick the emitted token from this row's logits (argmax, or one seeded draw),
                  descend to the child holding that token if there is one, else stop; the last pick is the bonus
    gather_kv     keep the KV rows of the root and the accepted path, drop the rest
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from generation_service.drafting.drafters import DraftUnavailable
from generation_service.model.lean_llama import Segment
from generation_service.model.sampling import Sampler, SamplingParams, argmax_rows
from generation_service.model.target import TargetModel, cache_length, forward_batch
from generation_service.model.tree_attention import tree_ancestors, tree_depths, tree_mask, tree_position_ids
from ragcore.errors import InvalidArgument

log = logging.getLogger(__name__)

# Nodes asked of the drafter per step (REST's 64); the sizer verifies only what the measured pass cost and the
# acceptance estimates say pays (drafting/budget.py), usually far fewer.
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
    skipped_drafts: int = 0  # steps that did not ask a useless remote source (drafting/budget.py)
    cached_prompt_tokens: int = 0  # prompt tokens restored from the worker's prefix cache (not prefilled)
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


def prefill_segments(prompt: torch.Tensor, cache, chunk: int = PREFILL_CHUNK) -> list[Segment]:
    """prompt [P] -> the passes that put it into `cache`, in order, `chunk` tokens each (the last one carries the
    rest); each keeps the logits of its last row only."""
    n = prompt.shape[0]
    cuts = list(range(0, n - chunk, chunk)) if n > chunk else []
    last = (n - 1) // chunk * chunk if n > chunk else 0
    past = cache_length(cache)
    out = []
    for a, b in [(a, a + chunk) for a in cuts] + [(last, n)]:
        out.append(Segment(prompt[a:b], torch.arange(past + a, past + b, device=prompt.device), cache, None, 1))
    return out


def is_prefill(seg: Segment) -> bool:
    """A chunk of prefill_segments (it keeps the logits of its last row only), not a decode pass's rows."""
    return seg.logits_rows > 0


def prefill(tm: TargetModel, cache, prompt: torch.Tensor, is_cancelled=None, chunk: int = PREFILL_CHUNK):
    """prompt: [P] -> logits of the last position [V] (None if cancelled); the cache then holds P rows.

    Long prompts go in chunks so a cancelled request stops within one chunk's time.
    """
    segments = prefill_segments(prompt, cache, chunk)
    for seg in segments[:-1]:
        forward_batch(tm, [seg])
        if is_cancelled is not None and is_cancelled():
            return None
    return forward_batch(tm, [segments[-1]])[0][0]  # lm_head on the last row only


def tree_segment(tm: TargetModel, cache, last: int, tokens: np.ndarray, parents: np.ndarray) -> Segment:
    """[last] + draft nodes as one sequence's rows of a pass (q >= 1 + n; the cache grows by q rows, gather_kv
    trims). `last` is the last emitted token, not yet in the cache; an empty tree is the AR step. Passes shorter than
    tm.min_rows get pad rows (root children never accepted) so every decode row comes from the same kernels."""
    past = cache_length(cache)
    dev = tm.device
    n_pad = tm.min_rows - 1 - tokens.shape[0]
    if n_pad > 0:
        tokens = np.concatenate((tokens, np.full(n_pad, last, np.int32)))
        parents = np.concatenate((parents, np.full(n_pad, -1, np.int32)))
    if tokens.shape[0] == 0:
        if dev.type == "cpu":  # numpy-built, as below
            return Segment(torch.from_numpy(np.array([last], np.int64)), torch.from_numpy(np.array([past], np.int64)),
                           cache)
        return Segment(torch.tensor([last], dtype=torch.int64, device=dev),
                       torch.tensor([past], dtype=torch.int64, device=dev), cache)
    ids = np.concatenate(([last], tokens)).astype(np.int64)  # [q]
    if dev.type == "cpu" and tm.dtype == torch.float32:
        # The same tensors built in numpy and wrapped once: each torch op releases the GIL, and with 8 requests
        # decoding the model thread then waited on gRPC threads to get it back, ~10 times per request a pass.
        mask = np.zeros((ids.shape[0], past + ids.shape[0]), np.float32)  # [q, past + q]
        mask[:, past:][~tree_ancestors(parents)] = np.finfo(np.float32).min  # torch.finfo(float32).min
        return Segment(torch.from_numpy(ids), torch.from_numpy(tree_depths(parents) + past), cache,
                       torch.from_numpy(mask))
    return Segment(torch.from_numpy(ids).to(dev), tree_position_ids(parents, past, dev)[0], cache,  # positions [q]
                   tree_mask(parents, past, tm.dtype, dev)[0, 0])  # [q, past + q]


def verify_tree(tm: TargetModel, cache, last: int, tokens: np.ndarray, parents: np.ndarray) -> torch.Tensor:
    """tree_segment's pass alone -> logits [q, V]."""
    return forward_batch(tm, [tree_segment(tm, cache, last, tokens, parents)])[0]


def accept(logits: torch.Tensor, children: dict[tuple[int, int], int], sampler: Sampler,
           limit: int, top: list[int] | None = None) -> tuple[list[int], list[int]]:
    """logits: [q, V] from verify_tree -> (accepted node indices, emitted tokens), len(emitted) = len(path) + 1.

    Row r holds the distribution after the context plus the path to row r. Every emitted token is picked from its
    own row exactly as the AR loop would pick it; a draft child is accepted only if it equals the pick. At most
    `limit` tokens are picked (the request's remaining budget), so no random draw is spent past the output.
    top: greedy picks of the rows already taken (sampling.argmax_each over a batched pass), else computed here.
    """
    if sampler.greedy:
        if top is None:
            top = argmax_rows(logits)  # one reduction for all rows

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


def check_tree(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, source_p: np.ndarray | None,
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


def cut_emitted(tokens: list[int], remaining: int, eos: frozenset[int]) -> tuple[list[int], str | None]:
    """Apply EOS and the token budget to one step's emitted tokens -> (output tokens, finish reason or None)."""
    tokens = tokens[:remaining]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i], FINISH_STOP
    return tokens, (FINISH_LENGTH if len(tokens) >= remaining else None)


def degrade(stats: SpeculationStats, reason: str) -> None:
    stats.degraded = True
    stats.degraded_steps += 1
    if not stats.degraded_reason:
        stats.degraded_reason = reason[:500]


def check_prompt(tm: TargetModel, prompt_ids, params: SamplingParams) -> np.ndarray:
    """prompt ids -> int32 [P], or InvalidArgument naming the field."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.shape[0] == 0 or not np.issubdtype(prompt.dtype, np.integer):
        raise InvalidArgument("prompt_ids", f"need a non-empty 1-D sequence of token ids, got {prompt.dtype} "
                                            f"{prompt.shape}")
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= tm.vocab_size:
        raise InvalidArgument("prompt_ids", f"ids must lie in [0, {tm.vocab_size}), got {lo}..{hi}")
    if prompt.shape[0] + params.max_new_tokens > tm.max_positions:
        raise InvalidArgument("max_new_tokens", f"prompt ({prompt.shape[0]}) + max_new_tokens "
                                                f"({params.max_new_tokens}) exceeds the model's {tm.max_positions} "
                                                "positions")
    return prompt.astype(np.int32)
