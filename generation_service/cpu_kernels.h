// Declarations shared by the two translation units of the CPU kernel extension (generation_service/q4_kernel.py
// compiles q4_kernel.cpp and lean_forward.cpp into one module).
#pragma once

#include <torch/extension.h>

// x [M, K] float32 contiguous @ w^T -> [M, N]; w is a dense float32 [N, K] or GGUF blocks (uint8 [N, K / 32 * 20]
// Q4_1 or [N, K / 32 * 34] Q8_0). Every row of x gets the same bits whatever M is. bf16: x and the weights
// rounded to bf16, products summed in fp32 (AMX tiles or AVX512-BF16 dot products; only where bf16_available()).
// wide: optional, w prepared for this CPU's bf16 path (same bits: the same values in the same sums): where
// wide_bf16(), bf16 [N, K], w's weights as the bf16 path multiplies them (decode_bf16), taken instead of w by passes
// of more than 10 rows; where bf16_kernel() is "amx", w's group layout (amx_layout), taken by every pass.
torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& w, bool bf16,
                           const torch::Tensor& wide = torch::Tensor());

// Whether bf16-activation linears run here: the AMX path (built for it, tile state granted) or AVX512-BF16.
bool bf16_available();

// What runs bf16-activation linears here: "amx", "avx512_bf16", or "" (neither).
std::string bf16_kernel();

// Whether the bf16 path here takes decoded copies of the weights (block_linear's wide): AVX512-BF16 dot products,
// not AMX tiles (whose sums run in another order).
bool wide_bf16();

// Registers LeanForward (lean_forward.cpp) in the module.
void bind_lean_forward(pybind11::module_& m);
