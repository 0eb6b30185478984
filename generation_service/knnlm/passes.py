"""The LM passes of kNN-LM: single-token passes that also yield the query vector (the output layer's input)."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import torch

from generation_service.engine.effects import Effects, ar_pass, prefill_passes, run_inline
from generation_service.model.target import TargetModel, cache_length


@contextmanager
def _output_layer_input(tm: TargetModel):
    """Capture what the output layer multiplies (the final hidden states [1, q, D]) during the passes inside."""
    box: list[torch.Tensor] = []
    # Passes through forward() run the lean forward when there is one (it fills the sink), direct calls of the
    # transformers model fire the hook: each pass appends exactly once.
    if tm.lean is not None:
        tm.lean.hidden_sink = box
    handle = tm.model.get_output_embeddings().register_forward_hook(lambda _m, inp, _out: box.append(inp[0]))
    try:
        yield box
    finally:
        handle.remove()
        if tm.lean is not None:
            tm.lean.hidden_sink = None


def lm_prefill_passes(tm: TargetModel, kv, prompt: np.ndarray) -> Effects:
    """prompt: int [P] -> (logits [V] of the last position, its final hidden state float32 [D]); kv holds P rows."""
    logits, hidden = yield from prefill_passes(tm, kv, torch.from_numpy(prompt.astype(np.int64)).to(tm.device),
                                               hidden=True)
    return logits, hidden.float().cpu().numpy()


def lm_step_passes(tm: TargetModel, kv, token: int) -> Effects:
    """One single-token pass (the AR step the other decoding modes use, pad rows included) -> (logits [V],
    hidden float32 [D]); kv grows by one row."""
    logits, hidden = yield from ar_pass(tm, kv, token, hidden=True)
    return logits, hidden.float().cpu().numpy()


def lm_prefill(tm: TargetModel, kv, prompt: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
    """lm_prefill_passes alone."""
    return run_inline(tm, lm_prefill_passes(tm, kv, prompt))


def lm_step(tm: TargetModel, kv, token: int) -> tuple[torch.Tensor, np.ndarray]:
    """lm_step_passes alone."""
    return run_inline(tm, lm_step_passes(tm, kv, token))


def _truncate(kv, length: int) -> None:
    """Roll the KV cache back to its first `length` rows (transformers' crop takes the rows to drop, negated)."""
    drop = cache_length(kv) - length
    if drop > 0:
        kv.crop(-drop)


