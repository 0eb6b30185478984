"""The target model: load any local Hugging Face causal LM (default SmolLM2-135M-Instruct), run forward passes.

Which dtype and thread count serve best depends on the machine (bf16 is fast with AMX or avx512_bf16 and many times
slower per tree node on AVX2-only CPUs): the server measures and chooses (engine/calibrate.py); load_model takes what
it is given. Nothing here contacts a model hub.

Bit-identical rows. Lossless speculation needs the verifier's row for a position to equal what the AR loop computes
for it. Measured on CPU bf16: linear layers give the same row for any M >= 2 but not for M = 1 (a different kernel),
and SDPA's result depends on the query length; plain matmul attention is row-consistent for every query length. So
decode passes use `_decode_attention` (matmul + fp32 softmax, the 4D mask added) and always carry >= 2 rows
(`TargetModel.min_rows`): an AR step is [last, pad] with the pad row masked away and dropped from the cache. With
that, bf16 AR and tree rows matched bit for bit for trees of 1..129 nodes. Prefill keeps SDPA (memory-efficient
causal attention for long prompts; AR and speculative runs share it, so it cannot make them differ).

    tm = load_model("", dtype="bf16")      # "" = the default model, prepared on first use
    warmup(tm)                             # before reporting SERVING: the first passes pay kernel set-up costs
Run every forward pass of a process on one thread (engine/model_thread.py explains why).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from generation_service.model.lean_llama import LeanLlama, Segment
from generation_service.model.q4_weights import lean_for_format
from generation_service.model.step_cost import StepCost
from generation_service.model.tree_attention import tree_mask, tree_position_ids
from ragcore.model_files import load_tokenizer, resolve_model_dir

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
# Weight formats the lean forward serves from GGUF blocks (model/q4_weights.py) -> their activation dtype. They change
# the outputs relative to fp32 of a model that was not quantized, so nothing picks them unless a user asks.
# q4_1_bf16: the same blocks with bf16 activations on AMX tiles (q4_kernel.cpp), where the CPU has them.
# q4_1_i8: the same blocks with int8 activations per row and block of 32 (int8_linear.cpp), on any CPU.
WEIGHT_FORMATS = {"q4_1": torch.float32, "q4_1_bf16": torch.float32, "q4_1_i8": torch.float32}
ATTENTION = "ragserve_decode"


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [B, H, q, D], key/value: [B, H_kv, kv, D], attention_mask: [1, 1, q, kv] additive float, bool or None.

    Our decode passes send an additive float mask: matmul attention, whose rows do not depend on how many other
    rows are in the pass. Everything else (causal prefill: None; HF-built boolean masks: chunked prefill, HF
    generate) goes to SDPA, which is memory-efficient for long queries.
    """
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward  # seconds to import

    if attention_mask is None or attention_mask.dtype == torch.bool or kwargs.get("s_aux") is not None \
            or kwargs.get("sinks") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, kv, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale  # [B, H, q, kv]
    softcap = kwargs.get("softcap")
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [B, H, q, D]
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D]


def _register_attention() -> None:
    from transformers import AttentionInterface  # seconds to import: only processes that load a model pay
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, _decode_attention)
    # HF builds SDPA-style masks for our name (None for a plain causal prefill, else boolean), so chunked prefill
    # and HF generate / its prompt lookup run correctly on the same model object.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)


@dataclass
class TargetModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode
    tokenizer: object  # transformers tokenizer (decode, apply_chat_template)
    device: torch.device
    dtype: torch.dtype
    vocab_size: int  # rows of the output layer (may exceed the tokenizer's vocabulary)
    eos_token_ids: frozenset[int]
    max_positions: int  # positions the model supports (prompt + generated)
    model_dir: str
    min_rows: int = 2  # every decode pass carries at least this many rows (see the module docstring)
    # Cost of a decode pass by draft-tree size, relative to an AR step (drafting/budget.py): the calibrated curve
    # when the server measured one (engine/calibrate.py), else a linear default.
    step_cost: StepCost = field(default_factory=StepCost.linear)
    # The lean forward (model/lean_llama.py) when the architecture is supported and not turned off; None = transformers.
    lean: LeanLlama | None = None
    weights: str = ""  # a WEIGHT_FORMATS name when the linears are block-quantized, else "" (weights in `dtype`)

    @property
    def forward_name(self) -> str:
        return "lean" if self.lean is not None else "hf"

    @property
    def rows_pass_invariant(self) -> bool:
        """Whether a row's logits are the same bits in any pass, prompt rows too (LeanLlama.rows_pass_invariant):
        then prefill may be cut into pieces by load without changing any output."""
        return self.lean is not None and self.lean.rows_pass_invariant()

    @property
    def dtype_name(self) -> str:
        return self.weights or {v: k for k, v in DTYPES.items()}[self.dtype]


def pick_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else list(eos))
    return frozenset(int(i) for i in ids)


def cap_blas_threads(threads: int, blas: int = 1) -> None:
    """In the calling thread: OpenMP pools (torch's, faiss's) at `threads`, BLAS pools (numpy's OpenBLAS) at `blas`.

    torch.set_num_threads only covers torch. numpy's OpenBLAS starts one spinning thread per core for every
    matrix-vector product the worker does (the kNN-LM cache look-up, draft scoring); on a 2-core machine shared
    with the retrieval service those threads take the core its Search runs on (capping them raised kNN-LM
    speculation's gains markedly: bench.knnlm, docs/benchmarks.md). The worker's numpy work is tiny vectors, so one
    BLAS thread is enough.
    """
    threadpool_limits(limits={"openmp": max(1, threads), "blas": max(1, blas)})


FORWARDS = ("auto", "lean", "hf")


def set_threads(threads: int) -> None:
    """Process-level, for mains and the model thread (never called by library code on its own): torch's intra-op
    threads and the calling thread's OpenMP / BLAS pools. 0 = leave the defaults (all cores)."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an integer >= 0 (0 = all cores), got {threads!r}")
    if threads:
        torch.set_num_threads(threads)
        cap_blas_threads(threads)


def load_model(model_dir: str | os.PathLike | None = "", dtype: str = "bf16", device: str = "auto",
               forward: str = "auto") -> TargetModel:
    """A local HF model directory ("" / None = default model) -> TargetModel in eval mode on `device`.

    forward: auto = the lean forward where the architecture is supported, else transformers'; lean = require it;
    hf = always transformers' forward.
    """
    if dtype not in DTYPES and dtype not in WEIGHT_FORMATS:
        raise ValueError(f"dtype must be one of {sorted(DTYPES) + sorted(WEIGHT_FORMATS)}, got {dtype!r}")
    if forward not in FORWARDS:
        raise ValueError(f"forward must be one of {', '.join(FORWARDS)}, got {forward!r}")
    from transformers import AutoModelForCausalLM  # seconds to import: only processes that load a model pay

    dev = pick_device(device)
    path = resolve_model_dir(model_dir)
    torch_dtype = DTYPES.get(dtype) or WEIGHT_FORMATS[dtype]
    _register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, attn_implementation=ATTENTION,
                                                 local_files_only=True)
    model.to(dev).eval()
    tokenizer = load_tokenizer(path)
    out = model.get_output_embeddings()
    vocab = int(out.weight.shape[0]) if out is not None else int(model.config.vocab_size)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_pos = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 30)
    tm = TargetModel(model, tokenizer, dev, torch_dtype, vocab, _eos_ids(model, tokenizer), max_pos, str(path),
                     min_rows_for(torch_dtype), weights=dtype if dtype in WEIGHT_FORMATS else "")
    return with_forward(tm, forward)


def with_forward(tm: TargetModel, forward: str = "auto") -> TargetModel:
    """Attach the lean forward to `tm` (in place) as `forward` asks; raises ValueError for lean on an
    unsupported architecture (and for a block-quantized format with forward hf)."""
    if tm.weights:
        tm.lean = lean_for_format(tm.model, tm.model_dir, tm.weights, forward)
        return tm
    why = LeanLlama.supports(tm.model)
    if forward == "lean" and why:
        raise ValueError(f"forward: the lean forward does not support this model: {why}")
    tm.lean = LeanLlama(tm.model, tm.dtype) if forward != "hf" and not why else None
    return tm


def min_rows_for(dtype: torch.dtype) -> int:
    """Rows every decode pass carries: 2 in low precision (see the module docstring); fp32 GEMMs are not
    row-consistent anyway (differences ~1e-7), so a pad row would buy nothing there."""
    return 2 if dtype != torch.float32 else 1


def new_cache(tm: TargetModel, capacity: int = 256):
    """An empty KV cache for one sequence (capacity: rows preallocated by the lean forward; it grows on demand)."""
    if tm.lean is not None:
        return tm.lean.new_cache(capacity)
    from transformers import DynamicCache  # the generic path only (the lean forward has its own cache)

    return DynamicCache(config=tm.model.config)


def cache_length(cache) -> int:
    return int(cache.get_seq_length())


@torch.inference_mode()
def forward(tm: TargetModel, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
            mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
    """input_ids: [q] -> logits [q', V] (q' = logits_to_keep last rows, or all q when 0); appends q rows to `cache`.

    mask: None = causal (plain prefill / single-token step), else a 4D additive mask [1, 1, q, past + q].
    """
    if tm.lean is not None:
        past = cache.length
        positions = position_ids[0] if position_ids is not None else torch.arange(
            past, past + input_ids.shape[0], device=input_ids.device)
        return tm.lean.forward(input_ids, positions, cache, mask[0, 0] if mask is not None else None, logits_to_keep)
    out = tm.model(input_ids=input_ids.unsqueeze(0), position_ids=position_ids, attention_mask=mask,
                   past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0]  # [q', V]


@torch.inference_mode()
def same_logits_at(tm: TargetModel, counts: Sequence[int]) -> bool:
    """Whether a 64-token prompt chunk, a 1-row step and a 4-row step give bit-identical logits at every torch
    thread count in `counts` (call on the model thread; its count is restored). Changing the count between passes
    is lossless only then: a GEMM that splits its reduction by thread count rounds differently."""
    before = torch.get_num_threads()
    ids = torch.arange(100, 164, device=tm.device) % tm.vocab_size
    outs = []
    try:
        for n in counts:
            torch.set_num_threads(n)
            cache = new_cache(tm, 128)
            outs.append([forward(tm, ids, cache), forward(tm, ids[:1], cache), forward(tm, ids[1:5], cache)])
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))


def forward_batch(tm: TargetModel, segments: list[Segment]) -> list[torch.Tensor]:
    """Several sequences' new rows -> per segment its logits [q', V] (Segment.logits_rows). The lean forward runs
    them as one pass (linear layers over all rows at once); the generic path runs one pass per segment."""
    if tm.lean is not None:
        return tm.lean.forward_batch(segments)
    out = []
    for seg in segments:
        mask = seg.mask[None, None] if seg.mask is not None else None
        out.append(forward(tm, seg.ids, seg.cache, position_ids=seg.positions[None], mask=mask,
                           logits_to_keep=seg.logits_rows))
    return out


def forward_batch_hidden(tm: TargetModel, segments: list[Segment]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """forward_batch, plus per segment the final (normed) hidden rows the output layer reads [q', D], the rows
    its logits come from (kNN-LM queries)."""
    box: list[torch.Tensor] = []
    if tm.lean is not None:
        tm.lean.hidden_sink = box  # the pass appends its kept rows [1, sum q', D] once
        try:
            logits = tm.lean.forward_batch(segments)
        finally:
            tm.lean.hidden_sink = None
        return logits, list(torch.split(box[-1][0], [lg.shape[0] for lg in logits]))
    # The generic path runs one forward per segment: the output layer's input, captured per segment.
    handle = tm.model.get_output_embeddings().register_forward_hook(lambda _m, inp, _out: box.append(inp[0]))
    try:
        logits = forward_batch(tm, segments)
    finally:
        handle.remove()
    return logits, [b[0] for b in box]


def warmup(tm: TargetModel, prompt_len: int = 64, tree_sizes: tuple[int, ...] = (8, 32, 64), rounds: int = 2) -> float:
    """Run prefill, single-token steps and tree passes so one-time kernel set-up (oneDNN/AMX JIT, allocator growth)
    happens before the server reports SERVING. Returns the seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, min(tm.vocab_size, 1000), prompt_len)).to(tm.device)
    for _ in range(rounds):
        cache = new_cache(tm)
        forward(tm, ids, cache, logits_to_keep=1)
        past = prompt_len
        forward(tm, ids[:1], cache, position_ids=torch.tensor([[past]], device=tm.device))  # fp32 AR step
        cache.crop(-1)
        for n in (1,) + tuple(tree_sizes):
            # A chain of n nodes is a valid tree; the pass exercises the 4D-mask path at this query length.
            parents = np.arange(-1, n - 1, dtype=np.int32)
            q_ids = torch.from_numpy(rng.integers(0, min(tm.vocab_size, 1000), n + 1)).to(tm.device)
            forward(tm, q_ids, cache, position_ids=tree_position_ids(parents, past, tm.device),
                    mask=tree_mask(parents, past, tm.dtype, tm.device))
            cache.crop(-(n + 1))
    return time.perf_counter() - t0
