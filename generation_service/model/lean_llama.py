"""A lean forward for Llama-family decoders: the same weights and math as transformers' LlamaForCausalLM, without
its per-op framework overhead.

Why. On a 135M-parameter model a decode step is mostly overhead, not arithmetic: 30 layers x dozens of small ops,
DynamicCache concatenation (every step copies the whole cache), repeat_kv copies of keys and values for grouped
attention, and fp32 GEMMs that repack the weights on every call when more than one row comes in (MKL: a 2-row pass
over the MLP up-projection costs several times a 1-row one). Removing that overhead makes AR steps and tree passes
clearly faster in bf16 and fp32 (bench.step, docs/benchmarks.md).

What changes, per layer: q|k|v and gate|up are one GEMM each (fused weights); RoPE reads precomputed cos/sin
tables; keys and values go into a preallocated per-request cache in place (KVCache), and tree rows that were not
accepted are dropped by moving the accepted rows down in one indexed copy for all layers; attention multiplies the
query heads of a key/value group as one [groups x q, D] block against that group's keys (no repeat_kv copy), adds
the tree's 4D mask, softmax in fp32; multi-row fp32 passes use oneDNN linears with prepacked weights (one
single-row GEMV stays on the plain path, where it is fastest). Prefill uses SDPA (memory-efficient causal
attention) like transformers does.

Fused pass. With fp32 activations (fp32 and q4_1 weights) passes of fewer than FUSED_MAX_ROWS rows run as one C++
call (lean_forward.cpp, built with the block kernels by model/kernels/build.py): the same math without ~40 Python-level ops
per layer, the linears through the block kernel's tiling (q4_1 blocks or dense fp32, so a row gets the same bits in
a 1-row step and in a tree pass). That takes most of the per-op overhead out of an AR step, and bench.step compares
it with llama.cpp's decode step on the same GGUF values. The ops below remain the
path for bf16, for larger passes (prefill chunks) and when the extension cannot be built.

Prefill in bf16 (set_prefill_bf16; the server turns it on where calibration measures it faster). A prompt's rows
are computed once and never compared with anything, so their linears may run on bf16 copies of the weights with
bf16 inputs (fp32 accumulation; norms, RoPE and attention stay fp32): with native bf16 dot products the linears of a
prompt chunk then cost well under fp32 oneDNN's or the q4_1 block kernel's (engine/calibrate.py decides per
machine). Decode rows (AR steps and draft trees) keep fp32, so speculation stays lossless and a decode row is the
same whether or not a prefill chunk shares its pass: a pass holding both runs as two, the decode rows first.

Supported: model_type "llama" with default RoPE, no attention/MLP biases (SmolLM2, TinyLlama, Llama 2, ...).
Anything else keeps the generic transformers path (LeanLlama.supports says why not).

    lean = LeanLlama.from_model(hf_model, dtype)     # None if unsupported
    cache = lean.new_cache(capacity=512)              # grows on demand
    logits = lean.forward(ids, positions, cache)      # ids/positions: [q]; logits [q, V]; cache grows by q rows
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from generation_service.model.kernels.build import kernel

# Passes of fewer rows run the fused C++ forward (lean_forward.cpp) when it is built; larger ones (prefill chunks)
# the ops below, whose oneDNN GEMMs win once arithmetic dominates.
FUSED_MAX_ROWS = 128
_NO_MASK = torch.empty(0)
# Passes with at least this many rows use the prepacked fp32 weights (1-row passes are GEMVs: plain is fastest).
_PACK_MIN_ROWS = 2
_PACK_HINT_ROWS = 16  # the batch size oneDNN blocks the packed weights for (any row count works)
# With prefill_bf16 on, a prefill segment of at least this many rows runs its linears in bf16 (set_prefill_bf16).
BF16_PREFILL_MIN_ROWS = 32
KV_DTYPES = ("auto", "fp16", "fp32")
FP16_MAX = 65504.0
_BF16_PACK_HINT_ROWS = 128


class KVCache:
    """Keys and values of one sequence for every layer, preallocated: k, v [layers, kv_heads, capacity, head_dim].

    Rows [0, length) are valid. Speaks the subset of transformers' Cache API the decode loops use
    (get_seq_length, crop) plus gather(), the in-place tree compaction.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (layers, kv_heads, max(capacity, 1), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0
        self.slab: KVSlab | None = None  # set for a slot of a KVSlab (fixed capacity)
        self.slot = -1

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, rows: int) -> None:
        """Make room for `rows` more rows (doubling: amortized O(1) per row)."""
        need = self.length + rows
        if need <= self.capacity:
            return
        if self.slab is not None:
            raise RuntimeError(f"KV slab slot of {self.capacity} rows cannot hold {need}")
        cap = max(need, 2 * self.capacity)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[:2] + (cap,) + old.shape[3:], dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def crop(self, max_length: int) -> None:
        """transformers' semantics: a negative value drops that many rows from the end, else keep max_length."""
        self.length = max(self.length + max_length, 0) if max_length < 0 else min(self.length, max_length)

    def gather(self, past: int, path: list[int]) -> None:
        """Keep rows [0, past], the root row `past` and rows past + 1 + path (accepted tree nodes, ascending);
        drop the rest. A path that is the leftmost chain (most steps) is already in place: no torch call at all,
        since each one releases the GIL and a batched pass's model thread then waits to get it back."""
        m = len(path)
        if path != list(range(m)):
            self._copy_down(past, path)
        self.length = past + 1 + m

    @torch.inference_mode()
    def _copy_down(self, past: int, path: list[int]) -> None:
        src = torch.tensor([past + 1 + p for p in path], dtype=torch.long, device=self.k.device)
        for t in (self.k, self.v):
            t[:, :, past + 1: past + 1 + len(path)] = t.index_select(2, src)  # index_select copies: overlap-safe


class KVSlab:
    """KV caches of up to `slots` sequences in one tensor: k, v [layers, slots, kv_heads, capacity, head_dim].

    Sequences in neighbouring slots attend in one chain of ops per layer (their keys are one strided view of the
    slab), where separate caches need one chain per sequence: on a CPU that per-sequence chain (~10 small ops x
    30 layers) costs more than the arithmetic of a small batch (the fused forward takes each slot's view as a
    cache of its own). A finished sequence's slot is free for the next one; holes are masked.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.slots, self.capacity = slots, capacity
        # Per slot, rows [0, finite) hold finite numbers: written by a pass (now or by an earlier occupant), or
        # zeroed. The grouped attention (_SlabGroup) reads every slot up to its longest member and masks the rest,
        # but a masked row still multiplies its value by 0, and 0 x NaN from uninitialized memory is NaN; so rows
        # no pass ever wrote are zeroed the first time a group reads them (once per row over the slab's life).
        self._finite = [0] * slots

    def mark_written(self, slot: int, rows: int) -> None:
        self._finite[slot] = max(self._finite[slot], rows)

    @torch.inference_mode()
    def ensure_finite(self, lo: int, hi: int, rows: int) -> None:
        """Slots lo..hi-1 hold finite numbers in rows [0, rows) (rows beyond what any pass wrote are zeroed)."""
        for slot in range(lo, hi):
            if self._finite[slot] < rows:
                self.k[:, slot, :, self._finite[slot]:rows] = 0
                self.v[:, slot, :, self._finite[slot]:rows] = 0
                self._finite[slot] = rows

    def cache(self, slot: int) -> KVCache:
        """An empty cache living in `slot` (fixed capacity)."""
        c = KVCache.__new__(KVCache)
        c.k, c.v, c.length, c.slab, c.slot = self.k[:, slot], self.v[:, slot], 0, self, slot
        return c


@dataclass
class _Layer:
    ln1: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    ln2: torch.Tensor
    wgu: torch.Tensor  # [2 * intermediate, hidden]
    wd: torch.Tensor  # [hidden, intermediate]
    packed: dict  # name -> oneDNN-packed weight (fp32 only)
    quant: dict | None = None  # name -> block-quantized weight (q4_weights.LeanLlamaQ4)
    packed_bf16: dict = field(default_factory=dict)  # name -> oneDNN-packed bf16 copy (set_prefill_bf16)


class LeanLlama:
    _prepack = True  # keep oneDNN-packed fp32 copies for multi-row passes (subclasses with other weights: False)
    bf16 = False  # the fused forward's linears take bf16 activations (LeanLlamaQ4 in q4_1_bf16)
    i8 = False  # the fused forward's linears take int8 activations (LeanLlamaQ4 in q4_1_i8)

    def __init__(self, model, dtype: torch.dtype):
        cfg = model.config
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.inter = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.lm_head = model.lm_head.weight.detach()
        self.pack = (self._prepack and dtype == torch.float32 and self.device.type == "cpu"
                     and _onednn_linear_available())
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, mlp = layer.self_attn, layer.mlp
                wqkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous()
                wgu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().contiguous()
                # The transformers modules keep working on views of the fused weights: no second copy in memory.
                nq, nk = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
                a.q_proj.weight.data, a.k_proj.weight.data, a.v_proj.weight.data = (
                    wqkv[:nq], wqkv[nq: nq + nk], wqkv[nq + nk:])
                mlp.gate_proj.weight.data, mlp.up_proj.weight.data = wgu[: self.inter], wgu[self.inter:]
                ly = _Layer(layer.input_layernorm.weight.detach(), wqkv, a.o_proj.weight.detach(),
                            layer.post_attention_layernorm.weight.detach(), wgu, mlp.down_proj.weight.detach(), {})
                if self.pack:
                    for name in ("wqkv", "wo", "wgu", "wd"):
                        ly.packed[name] = torch.ops.mkldnn._reorder_linear_weight(getattr(ly, name), _PACK_HINT_ROWS)
                self.layers.append(ly)
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32,
                                                      device=self.device) / self.head_dim))
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=dtype, device=self.device)
        # When a list: every forward appends the final hidden states it multiplies by the output layer, [1, q', D]
        # (kNN-LM keys; what a forward hook on transformers' lm_head sees).
        self.hidden_sink: list | None = None
        # Keys and values as the caches store them: float16 where the fused forward runs (set_kv_dtype).
        self.kv_dtype = dtype
        # The whole pass in one C++ call (lean_forward.cpp) for passes of fewer rows than this; None = ops in Python.
        self.fused = None
        self.fused_max_rows = FUSED_MAX_ROWS
        self.prefill_bf16 = False  # set_prefill_bf16
        if type(self)._fused_weights is LeanLlama._fused_weights:  # subclasses build theirs once their weights exist
            self._build_fused()

    # -- construction ------------------------------------------------------------------------------------------

    @staticmethod
    def supports(model) -> str:
        """'' when the lean path computes exactly what `model` computes, else why not."""
        cfg = model.config
        if getattr(cfg, "model_type", "") != "llama":
            return f"model_type {getattr(cfg, 'model_type', '?')!r} (only llama)"
        rope = getattr(cfg, "rope_parameters", None) or {"rope_type": (getattr(cfg, "rope_scaling", None) or {}).get(
            "rope_type", "default")}
        if rope.get("rope_type", "default") != "default":
            return f"rope_type {rope.get('rope_type')!r} (only default)"
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            return "biases in attention or MLP"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act!r} (only silu)"
        if getattr(cfg, "pretraining_tp", 1) != 1:
            return "pretraining_tp != 1"
        return ""

    @classmethod
    def from_model(cls, model, dtype: torch.dtype) -> "LeanLlama | None":
        return None if cls.supports(model) else cls(model, dtype)

    def rows_pass_invariant(self) -> bool:
        """Whether every row's logits are the same bits in any pass, prompt rows included, so that a prompt
        prefilled in pieces of any size equals one prefilled in whole chunks. Not here: passes past fused_max_rows
        leave the fused forward, and the dense linears round differently by row count (LeanLlamaQ4 overrides)."""
        return False

    def new_cache(self, capacity: int = 256) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, capacity, self.kv_dtype, self.device)

    def set_kv_dtype(self, kind: str) -> torch.dtype:
        """How caches made from now on store keys and values: 'fp16', 'fp32' (the activations' dtype), or 'auto'
        (fp16 where the fused forward runs, else the activations' dtype). Why fp16: a decode row's attention reads
        its whole past, and at 8 sequences of a few hundred tokens those reads are a third of the pass on a 2-core
        CPU, bound by memory bandwidth; fp16 halves them. Every row (its own pass's included) attends the stored,
        rounded values, so a row's result is still the same in any pass (batched == solo, tree == AR steps).
        Values beyond fp16's range are stored as +-65504. Caches made before keep their type."""
        if kind not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {kind!r} is not one of {', '.join(KV_DTYPES)}")
        if kind == "fp16" and (self.fused is None or self.dtype != torch.float32):
            raise ValueError("kv cache dtype fp16 needs the fused forward (fp32 activations on the CPU, the kernels "
                             "built)")
        half = kind == "fp16" or (kind == "auto" and self.fused is not None and self.dtype == torch.float32)
        self.kv_dtype = torch.float16 if half else self.dtype
        return self.kv_dtype

    def _fused_weights(self) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
        """The linears' weights as the fused kernel takes them (dense fp32 or GGUF blocks): per name the layers'
        weights, and the output layer."""
        return {n: [getattr(ly, n) for ly in self.layers] for n in ("wqkv", "wo", "wgu", "wd")}, self.lm_head

    def _build_fused(self) -> None:
        """Set self.fused when the fused C++ forward can run this model here (fp32 activations on the CPU, the
        kernel built)."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            return
        k = kernel()  # the extension: built on first use, cached per machine
        if k is None or not hasattr(k, "LeanForward"):
            return
        w, head = self._fused_weights()
        self.fused = k.LeanForward(self.embed.contiguous(), [ly.ln1 for ly in self.layers], w["wqkv"], w["wo"],
                                   [ly.ln2 for ly in self.layers], w["wgu"], w["wd"], self.norm, head, self.heads,
                                   self.kv_heads, self.head_dim, self.eps, self.bf16, self.i8)
        self.set_kv_dtype("auto")

    def has_decoded_copies(self) -> bool:
        """Whether the fused pass holds weights decoded to bf16 whose use set_wide_from decides (LeanLlamaQ4)."""
        return False

    def can_prefill_bf16(self) -> bool:
        """Whether set_prefill_bf16(True) would change anything: fp32 activations on a CPU with oneDNN bf16 linears."""
        return self.dtype == torch.float32 and self.device.type == "cpu" and _onednn_linear_available(torch.bfloat16)

    def set_prefill_bf16(self, on: bool) -> bool:
        """Run the linears of prefill segments of >= BF16_PREFILL_MIN_ROWS rows in bf16 (module docstring), or
        stop (dropping the bf16 weights). -> whether it is on."""
        on = bool(on) and self.can_prefill_bf16()
        with torch.no_grad():
            for ly in self.layers:
                ly.packed_bf16 = {name: torch.ops.mkldnn._reorder_linear_weight(
                    getattr(ly, name).to(torch.bfloat16), _BF16_PACK_HINT_ROWS)
                    for name in ("wqkv", "wo", "wgu", "wd")} if on else {}
        self.prefill_bf16 = on
        return on

    # -- pieces ------------------------------------------------------------------------------------------------

    def _rope_tables(self, upto: int) -> None:
        """cos/sin for positions < upto, computed like transformers (fp32 angles, cast to the model dtype)."""
        if self._cos.shape[0] >= upto:
            return
        n = max(upto, 2 * self._cos.shape[0], 1024)
        t = torch.arange(n, dtype=torch.float32, device=self.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _linear(self, x: torch.Tensor, layer: _Layer, name: str) -> torch.Tensor:
        if self.pack and x.shape[0] >= _PACK_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, layer.packed[name], None, "none", [], "")
        return F.linear(x, getattr(layer, name))

    def _linear_bf16(self, x: torch.Tensor, layer: _Layer, name: str) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), layer.packed_bf16[name], None, "none", [], "")
        return y.float()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed[ids]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lm_head)

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_dim // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin

    # -- the forward -------------------------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, mask: torch.Tensor | None = None,
                logits_rows: int = 0) -> torch.Tensor:
        """ids, positions: int [q]; mask: additive [q, past + q] (tree), or None = causal over the new rows
        (q == 1: attend to everything cached). Appends q rows to `cache` -> logits [q', V], q' = the last
        `logits_rows` rows (0 = all)."""
        return self.forward_batch([Segment(ids, positions, cache, mask, logits_rows)])[0]

    @torch.inference_mode()
    def forward_batch(self, segments: "Sequence[Segment]") -> list[torch.Tensor]:
        """Several sequences' new rows in one pass: every linear layer (and the output layer) runs once over all
        rows together — the weights are read once per step, which is what batching buys on a memory-bound CPU —
        while attention runs per sequence against its own cache, with its own positions and mask.
        -> per segment its logits [q', V] (see forward)."""
        if self.prefill_bf16:
            wide = [s.logits_rows > 0 and s.ids.shape[0] >= BF16_PREFILL_MIN_ROWS for s in segments]
            if any(wide):
                return self._forward_split(segments, wide)
        return self._forward(segments)

    def _forward_split(self, segments: "Sequence[Segment]", wide: list[bool]) -> list[torch.Tensor]:
        """The decode rows (and short prefill chunks) as one pass, then the wide prefill chunks in bf16 as another;
        logits (and the hidden sink's rows) in the segments' order."""
        sink = self.hidden_sink
        logits: list = [None] * len(segments)
        hidden: list = [None] * len(segments)
        try:
            for bf16 in (False, True):
                idx = [j for j, w in enumerate(wide) if w == bf16]
                if not idx:
                    continue
                box: list | None = [] if sink is not None else None
                self.hidden_sink = box
                part = self._forward([segments[j] for j in idx], bf16=bf16)
                rows = torch.split(box[-1][0], [lg.shape[0] for lg in part]) if box else [None] * len(part)
                for j, lg, h in zip(idx, part, rows):
                    logits[j], hidden[j] = lg, h
        finally:
            self.hidden_sink = sink
        if sink is not None:
            sink.append(torch.cat(hidden)[None])
        return logits

    def _forward(self, segments: "Sequence[Segment]", bf16: bool = False) -> list[torch.Tensor]:
        out = self._forward_rows(segments, bf16)
        for s in segments:
            if s.cache.slab is not None:
                s.cache.slab.mark_written(s.cache.slot, s.cache.length)
        return out

    def _forward_rows(self, segments: "Sequence[Segment]", bf16: bool = False) -> list[torch.Tensor]:
        qs = [s.ids.shape[0] for s in segments]
        if self.fused is not None and sum(qs) < self.fused_max_rows and not bf16:
            return self._forward_fused(segments, qs)
        linear = self._linear_bf16 if bf16 else self._linear
        starts = [0]
        for q in qs:
            starts.append(starts[-1] + q)
        ids = segments[0].ids if len(segments) == 1 else torch.cat([s.ids for s in segments])  # [N]
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        plans = [self._plan(s) for s in segments]
        self._rope_tables(int(positions.max()) + 1)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]  # [N, 1, D]
        N = starts[-1]
        H, Hkv, D = self.heads, self.kv_heads, self.head_dim
        group = _SlabGroup.of(self, segments, plans, starts)
        alone = [j for j in range(len(segments)) if group is None or j not in group.members]
        x = self._embed(ids)  # [N, hidden]
        for i, ly in enumerate(self.layers):
            h = self._rms(x, ly.ln1)
            qkv = linear(h, ly, "wqkv")  # [N, (H + 2 Hkv) D]
            qh = self._rotate(qkv[:, : H * D].view(N, H, D), cos, sin)
            kh = self._rotate(qkv[:, H * D: (H + Hkv) * D].view(N, Hkv, D), cos, sin)
            vh = qkv[:, (H + Hkv) * D:].view(N, Hkv, D)
            if group is None:
                outs = [self._attend(i, qh[a:b], kh[a:b], vh[a:b], seg.cache, plan)
                        for seg, plan, a, b in zip(segments, plans, starts, starts[1:])]
                o = outs[0] if len(outs) == 1 else torch.cat(outs)  # [N, H D]
            else:
                o = torch.empty(N, H * D, dtype=x.dtype, device=x.device)
                o[group.rows] = group.attend(self, i, qh, kh, vh)
                for j in alone:
                    a, b = starts[j], starts[j + 1]
                    o[a:b] = self._attend(i, qh[a:b], kh[a:b], vh[a:b], segments[j].cache, plans[j])
            x = x + linear(o, ly, "wo")
            h = self._rms(x, ly.ln2)
            gu = linear(h, ly, "wgu")  # [N, 2 I]
            x = x + linear(F.silu(gu[:, : self.inter]) * gu[:, self.inter:], ly, "wd")
        keep = [(b - s.logits_rows if s.logits_rows else a, b) for s, a, b in zip(segments, starts, starts[1:])]
        for s, plan in zip(segments, plans):
            s.cache.length = plan.past + s.ids.shape[0]
        if len(segments) == 1:
            x = x[keep[0][0]:]
        elif any(a != s for (a, _), s in zip(keep, starts)):
            x = torch.cat([x[a:b] for a, b in keep])
        x = self._rms(x, self.norm)
        if self.hidden_sink is not None:
            self.hidden_sink.append(x[None])
        logits = self._logits(x)  # [sum q', V]
        if len(segments) == 1:
            return [logits]
        sizes = [b - a for a, b in keep]
        return list(torch.split(logits, sizes))

    def _forward_fused(self, segments: "Sequence[Segment]", qs: list[int]) -> list[torch.Tensor]:
        ids = segments[0].ids if len(segments) == 1 else torch.cat([s.ids for s in segments])
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        ids, positions = ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()  # read raw in C++
        self._rope_tables(int(positions.max()) + 1)
        past = []
        for s, q in zip(segments, qs):
            past.append(s.cache.length)
            s.cache.reserve(q)
        logits, hidden = self.fused.forward(
            ids, positions, self._cos, self._sin, qs, past, [s.cache.k for s in segments],
            [s.cache.v for s in segments], [_NO_MASK if s.mask is None else s.mask for s in segments],
            [s.logits_rows for s in segments])
        for s, p, q in zip(segments, past, qs):
            s.cache.length = p + q
        if self.hidden_sink is not None:
            self.hidden_sink.append(hidden[None])
        if len(segments) == 1:
            return [logits]
        return list(torch.split(logits, [s.logits_rows or q for s, q in zip(segments, qs)]))

    def _plan(self, seg: "Segment") -> "_Plan":
        """Where a segment's rows go in its cache and which attention they take (reserves the rows)."""
        q = seg.ids.shape[0]
        cache, mask = seg.cache, seg.mask
        past = cache.length
        cache.reserve(q)
        causal_sdpa = mask is None and q > 1
        if causal_sdpa and past > 0:  # chunked prefill: causal over the new rows, everything cached before
            mask = torch.zeros(q, past + q, dtype=self.dtype, device=self.device)
            mask[:, past:] = torch.full((q, q), torch.finfo(self.dtype).min, dtype=self.dtype,
                                        device=self.device).triu(1)
            causal_sdpa = False
        grouped = mask.repeat(self.groups, 1) if mask is not None and not causal_sdpa else None  # [G q, S]
        return _Plan(past, causal_sdpa, grouped)

    def _attend(self, i: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, cache: KVCache,
                plan: "_Plan") -> torch.Tensor:
        """Layer i's attention of one sequence's q new rows (qh [q, H, D], kh/vh [q, Hkv, D], already rotated);
        writes their keys/values into the cache -> [q, H D]."""
        q = qh.shape[0]
        H, Hkv, D, G = self.heads, self.kv_heads, self.head_dim, self.groups
        past = plan.past
        S = past + q
        cache.k[i, :, past:S] = _stored(kh.transpose(0, 1), cache.k.dtype)
        cache.v[i, :, past:S] = _stored(vh.transpose(0, 1), cache.v.dtype)
        keys, values = cache.k[i, :, :S].to(self.dtype), cache.v[i, :, :S].to(self.dtype)  # [Hkv, S, D]
        if plan.causal_sdpa:  # prefill from an empty cache: memory-efficient causal attention
            # 4D inputs with keys/values expanded per query head (as transformers' repeat_kv): with 3D inputs
            # or enable_gqa SDPA falls back to its materializing math kernel on CPU (much slower on long prompts).
            kx = keys[:, None].expand(Hkv, G, S, D).reshape(1, H, S, D)
            vx = values[:, None].expand(Hkv, G, S, D).reshape(1, H, S, D)
            o = F.scaled_dot_product_attention(qh.transpose(0, 1)[None], kx, vx, is_causal=True,
                                               scale=self.scale)  # [1, H, q, D]
            return o[0].transpose(0, 1).reshape(q, H * D)
        qg = qh.reshape(q, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * q, D)  # query heads by kv group
        scores = torch.matmul(qg, keys.transpose(1, 2)) * self.scale  # [Hkv, G q, S]
        if plan.grouped_mask is not None:
            scores = scores + plan.grouped_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
        o = torch.matmul(probs, values)  # [Hkv, G q, D]
        return o.view(Hkv, G, q, D).permute(2, 0, 1, 3).reshape(q, H * D)


@dataclass
class Segment:
    """One sequence's share of a (batched) forward pass."""

    ids: torch.Tensor  # int64 [q] new tokens
    positions: torch.Tensor  # int64 [q]
    cache: KVCache  # grows by q rows
    mask: torch.Tensor | None = None  # additive [q, past + q] (a tree), None = causal
    logits_rows: int = 0  # logits of the last rows only (0 = every row)


@dataclass
class _Plan:
    past: int
    causal_sdpa: bool
    grouped_mask: torch.Tensor | None


class _SlabGroup:
    """The segments of one pass whose caches share a KVSlab (and need no SDPA prefill): one attention chain per
    layer for all of them, over slots lo..hi-1 (keys padded to the longest; the padding and any slot not in the
    pass are masked out)."""

    @staticmethod
    def of(model: "LeanLlama", segments: "Sequence[Segment]", plans: list[_Plan], starts: list[int]
           ) -> "_SlabGroup | None":
        members = [j for j, (s, p) in enumerate(zip(segments, plans))
                   if s.cache.slab is not None and not p.causal_sdpa]
        if len(members) < 2 or len({id(segments[j].cache.slab) for j in members}) != 1:
            return None
        return _SlabGroup(model, segments, plans, starts, members)

    def __init__(self, model: "LeanLlama", segments, plans, starts, members: list[int]):
        self.members = set(members)
        self.slab = segments[members[0]].cache.slab
        slots = [segments[j].cache.slot for j in members]
        self.lo, hi = min(slots), max(slots) + 1
        n_slots = hi - self.lo
        qs = [segments[j].ids.shape[0] for j in members]
        self.qmax = max(qs)
        self.smax = max(plans[j].past + q for j, q in zip(members, qs))
        dev, dt = model.device, model.dtype
        rows, b_idx, r_idx, pos = [], [], [], []
        neg = torch.finfo(dt).min
        mask = torch.full((n_slots, self.qmax, self.smax), neg, dtype=dt, device=dev)
        mask[:, :, 0] = 0  # rows that are only padding attend somewhere (softmax of all -inf is NaN); discarded
        for j, q in zip(members, qs):
            seg, plan = segments[j], plans[j]
            b = seg.cache.slot - self.lo
            past = plan.past
            rows += range(starts[j], starts[j] + q)
            b_idx += [b] * q
            r_idx += range(q)
            pos += range(past, past + q)
            if seg.mask is not None:
                mask[b, :q, :past + q] = seg.mask
            elif q == 1:
                mask[b, 0, :past + 1] = 0
            else:  # chunked prefill: everything cached before, causal over the new rows
                mask[b, :q, :past + q] = torch.zeros(q, past + q, dtype=dt, device=dev)
                mask[b, :q, past:past + q] = torch.full((q, q), neg, dtype=dt, device=dev).triu(1)
        self.rows = torch.tensor(rows, device=dev)
        self.b_idx = torch.tensor(b_idx, device=dev)
        self.r_idx = torch.tensor(r_idx, device=dev)
        self.slot_idx = self.b_idx + self.lo
        self.pos = torch.tensor(pos, device=dev)
        G, Hkv = model.groups, model.kv_heads
        # [slots, qmax, S] -> per (slot, kv head): [slots * Hkv, G * qmax, S], query rows ordered (group, row)
        self.mask = mask[:, None, None].expand(n_slots, Hkv, G, self.qmax, self.smax).reshape(
            n_slots * Hkv, G * self.qmax, self.smax)
        self.n_slots = n_slots
        self.slab.ensure_finite(self.lo, hi, self.smax)

    def attend(self, model: "LeanLlama", i: int, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor
               ) -> torch.Tensor:
        """Layer i for the group's rows of qh/kh/vh ([N, heads, D]) -> [rows, H D]; writes their keys/values."""
        H, Hkv, D, G = model.heads, model.kv_heads, model.head_dim, model.groups
        n, qmax, S = self.n_slots, self.qmax, self.smax
        k, v = self.slab.k[i], self.slab.v[i]  # [slots, Hkv, cap, D]
        k[self.slot_idx, :, self.pos] = _stored(kh[self.rows], k.dtype)
        v[self.slot_idx, :, self.pos] = _stored(vh[self.rows], v.dtype)
        q = torch.zeros(n, qmax, H, D, dtype=qh.dtype, device=qh.device)
        q[self.b_idx, self.r_idx] = qh[self.rows]
        qg = q.view(n, qmax, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n * Hkv, G * qmax, D)
        keys = k[self.lo:self.lo + n, :, :S].reshape(n * Hkv, S, D).to(model.dtype)
        values = v[self.lo:self.lo + n, :, :S].reshape(n * Hkv, S, D).to(model.dtype)
        scores = torch.matmul(qg, keys.transpose(1, 2)) * model.scale + self.mask  # [n Hkv, G qmax, S]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(model.dtype)
        o = torch.matmul(probs, values)  # [n Hkv, G qmax, D]
        o = o.view(n, Hkv, G, qmax, D).permute(0, 3, 1, 2, 4).reshape(n, qmax, H * D)
        return o[self.b_idx, self.r_idx]


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: fp16 saturates at +-65504 (as the fused kernel's write) instead of inf."""
    if dtype == torch.float16 and x.dtype != dtype:
        return x.clamp(-FP16_MAX, FP16_MAX).to(dtype)
    return x.to(dtype)


@functools.lru_cache(maxsize=None)
def _onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's packed linear runs here in `dtype`: not in a build without oneDNN, and in bf16 not on a CPU
    without AVX512-BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only EPYC: the reorder raises there)."""
    try:
        w = torch.zeros(4, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 4, dtype=dtype), packed, None, "none", [], "")
        return True
    except (RuntimeError, AttributeError):
        return False


def capacity_for(prompt_len: int, max_new: int, tree_nodes: int) -> int:
    """KV rows a request needs at most: prompt + output + one tree's rows (rounded up to 64)."""
    need = prompt_len + max_new + tree_nodes + 2
    return int(math.ceil(need / 64) * 64)
