"""Sampling: request parameters, logits processing (temperature, top-k, top-p) and the token draw.

Lossless speculative sampling rests on one rule: every emitted token costs exactly one uniform draw from the
request's own random stream, taken in emission order. The autoregressive loop and the tree verifier call the same
`Sampler.pick` on the logits row of the position being emitted, so with the same seed they draw the same u for
the same position and, given the same distribution, pick the same token (inverse CDF over a deterministic order).

Worked example (top_k=2, temperature=1): logits [2.0, 0.0, 1.0] -> sorted ids [0, 2], probs [0.73, 0.27];
u=0.5 -> token 0, u=0.9 -> token 2.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from generation_service.model.kernels import build as q4_kernel
from ragcore.errors import InvalidArgument

_MAX_SEED = 2**64
MAX_TOP_LOGPROBS = 5


@dataclass(frozen=True)
class SamplingParams:
    """Everything a request says about how to pick tokens and when to stop (vLLM/TGI vocabulary)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy (argmax, no random draws)
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None with temperature > 0 = fresh entropy (the chosen seed is kept in `seed_used`)
    stop: tuple[str, ...] = ()  # text-level stop sequences, not included in the output
    ignore_eos: bool = False
    # Return each output token's log-probability and this many alternatives (None = off; 0 = the token's alone).
    logprobs: int | None = None
    seed_used: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, (int, np.integer)) \
                or self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        t = float(self.temperature)
        if not math.isfinite(t) or t < 0:
            raise InvalidArgument("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        p = float(self.top_p)
        if not (0.0 < p <= 1.0):
            raise InvalidArgument("top_p", f"must lie in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InvalidArgument("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or not 0 <= self.seed < _MAX_SEED):
            raise InvalidArgument("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(
                self.logprobs, (int, np.integer)) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgument("top_logprobs", f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for s in stop:
            if not isinstance(s, str) or s == "":
                raise InvalidArgument("stop", f"sequences must be non-empty strings, got {s!r}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", p)
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")
        object.__setattr__(self, "seed_used", int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [V] -> (token ids [K], probs float64 [K]) of the tokens that stay eligible, most likely first.

    Order of operations follows HF / vLLM: temperature, then top-k, then top-p (nucleus over the top-k set).
    Ties keep ascending token id order (stable sort) so the AR loop and the verifier agree on the order.
    """
    scaled = logits.float() / temperature  # [V]
    values, ids = torch.sort(scaled, descending=True, stable=True)  # [V]
    if 0 < top_k < values.shape[0]:
        values, ids = values[:top_k], ids[:top_k]
    probs = torch.softmax(values.double(), dim=-1)  # [K]
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p: token i stays if the mass before it is < top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        keep = int((before < top_p).sum())  # >= 1: the first token has 0 mass before it
        ids, probs = ids[:keep], probs[:keep] / probs[:keep].sum()
    return ids, probs


def sample_from(ids: torch.Tensor, probs: torch.Tensor, u: float) -> int:
    """Inverse CDF: the first token whose cumulative probability exceeds u (u in [0, 1))."""
    cdf = torch.cumsum(probs, dim=-1)  # [K]
    target = torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype, device=cdf.device)
    i = int(torch.searchsorted(cdf, target, right=True))
    return int(ids[min(i, ids.shape[0] - 1)])


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The first maximum of each row of logits [q, V] ([V]: a list of one), a NaN counting as the largest. On the CPU
    through the CPU kernels' argmax_rows (vectorized; only a big batch of rows spread over the threads) when they
    are loaded, else numpy: torch's argmax dispatches a parallel reduction, an order of magnitude slower per row
    than numpy's, and with a batch of requests decoding it took a large share of the model thread (py-spy); numpy's
    single pass over rows fresh from the forward still took a noticeable share."""
    x = logits.float()  # exact; torch's bf16 argmax is a slow scalar loop
    if x.device.type != "cpu":
        return x.argmax(dim=-1).reshape(-1).tolist()
    k = _loaded_kernel()
    if k is not None and hasattr(k, "argmax_rows") and x.is_contiguous():
        return k.argmax_rows(x.reshape(-1, x.shape[-1])).tolist()
    return np.asarray(x.numpy().argmax(axis=-1)).reshape(-1).tolist()


def argmax_each(logits: list[torch.Tensor]) -> list[list[int]]:
    """argmax_rows of each of several logits tensors ([q_i, V] or [V]), as one kernel call when every one is
    contiguous float32 on the CPU. Why one call: a batched pass's commits each ran tensor ops that release the GIL,
    and the model thread then waited to get it back from the gRPC threads (with many clients even a no-op .float()
    before the kernel showed in the model thread's profile, py-spy)."""
    k = _loaded_kernel()
    if k is not None and hasattr(k, "argmax_each") and all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in logits):
        return k.argmax_each([t if t.dim() == 2 else t.view(1, -1) for t in logits])
    return [argmax_rows(t) for t in logits]


def _loaded_kernel():
    """The CPU kernels if this process has loaded them already (never builds them: sampling alone must not)."""
    return q4_kernel.kernel() if q4_kernel.kernel.cache_info().currsize else None


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the model's distribution at its position, and the `top` most
    likely tokens there (most likely first)."""

    token: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows: [n, V] logits, tokens: the n tokens emitted from them -> their log-probabilities (log-softmax of the
    raw logits: before temperature, top-k and top-p) with the `top` best alternatives of each row.

    Worked example: logits [2.0, 0.0] and token 1 -> logprob 0 - log(e^2 + 1) = -2.127; top 1 -> [(0, -0.127)].
    """
    lp = torch.log_softmax(rows.float(), dim=-1)  # [n, V]
    chosen = lp[torch.arange(len(tokens)), torch.as_tensor(tokens, dtype=torch.int64)].tolist()
    if top:
        values, ids = torch.topk(lp, top, dim=-1)  # [n, top], sorted
        vs, ix = values.tolist(), ids.tolist()
        return [TokenLogprob(t, c, tuple(i), tuple(v)) for t, c, i, v in zip(tokens, chosen, ix, vs)]
    return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]


class Sampler:
    """Picks the emitted token from one logits row; owns the request's random stream (one draw per token)."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.greedy = params.greedy
        # numpy's PCG64 is device independent: CPU and CUDA runs with the same seed draw the same u's.
        self._rng = np.random.Generator(np.random.PCG64(params.seed_used))
        self.draws = 0

    def pick(self, logits: torch.Tensor) -> int:
        """logits: [V] for the position being emitted -> token id."""
        if self.greedy:
            return argmax_rows(logits)[0]
        self.draws += 1
        u = float(self._rng.random())
        ids, probs = process_logits(logits, self.params.temperature, self.params.top_k, self.params.top_p)
        return sample_from(ids, probs, u)
