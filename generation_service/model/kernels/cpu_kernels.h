// Declarations shared by the translation units of the CPU kernel extension (generation_service/model/kernels/build.py
// compiles q4_kernel.cpp, lean_forward.cpp, claim_pool.cpp and int8_linear.cpp into one module).
#pragma once

// The tensor type only: torch/extension.h (Python bindings, the whole C++ API) took most of each file's compile
// time; the two files that bind to Python (q4_kernel.cpp, lean_forward.cpp) include it themselves.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

// Passes of at least this many rows read a decoded copy (block_linear's wide) unless told otherwise: the first count
// past one tile of blocks decoded on the fly (q4_kernel.cpp's kOneTileBf16). Where the copy pays from fewer rows
// depends on the machine (memory bandwidth against decoding speed), so the calibration measures it (wide_from).
constexpr int64_t kWideFromRows = 11;

// x [M, K] float32 contiguous @ w^T -> [M, N]; w is a dense float32 [N, K] or GGUF blocks (uint8 [N, K / 32 * 20]
// Q4_1 or [N, K / 32 * 34] Q8_0). Every row of x gets the same bits whatever M is. bf16: x and the weights
// rounded to bf16, products summed in fp32 (AMX tiles or AVX512-BF16 dot products; only where bf16_available()).
// wide: optional, w prepared for this CPU's bf16 path (same bits: the same values in the same sums): where
// wide_bf16(), bf16 [N, K], w's weights as the bf16 path multiplies them (decode_bf16), taken instead of w by passes
// of at least wide_from rows; where bf16_kernel() is "amx", w's group layout (amx_layout), taken by every pass.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& w, bool bf16,
                           const at::Tensor& wide = at::Tensor(), int64_t wide_from = kWideFromRows);

// Whether bf16-activation linears run here: the AMX path (built for it, tile state granted) or AVX512-BF16.
bool bf16_available();

// What runs bf16-activation linears here: "amx", "avx512_bf16", or "" (neither).
std::string bf16_kernel();

// Whether the bf16 path here takes decoded copies of the weights (block_linear's wide): AVX512-BF16 dot products,
// not AMX tiles (whose sums run in another order).
bool wide_bf16();

// int8-activation linears (int8_linear.cpp, the q4_1_i8 format): x [M, K] float32 @ W^T -> [M, N], W given as
// i8_layout(GGUF Q4_1 or Q8_0 blocks [N, K / 32 * block bytes], K); each row's activations quantized per block of 32
// from that row alone, exact integer dot products, a fixed order for the rest: a row gets the same bits in any pass
// and on every path.
at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& layout, int64_t N);
at::Tensor i8_layout(const at::Tensor& w, int64_t K);
// x -> (codes int8 [M, K], scales float32 [M, K / 32], scale * code sums float32 [M, K / 32]): what i8_linear
// multiplies (for tests against a reference).
std::vector<at::Tensor> i8_quantize(const at::Tensor& x);
// The path i8_linear takes ("avx512_vnni", "avx_vnni", "avx2", "scalar"), those this CPU runs (best first), and a
// choice among them ("" = the best): every path gives the same bits, so this is for tests and benchmarks.
std::string i8_path();
std::vector<std::string> i8_paths();
void set_i8_path(const std::string& name);
int64_t i8_groups();
void set_i8_groups(int64_t n);

// Runs piece(0) .. piece(n - 1), each once, on the calling thread and helper threads of our own (claim_pool.cpp):
// each thread claims pieces of its own share, then what is left of the others', so a thread the OS has descheduled
// holds up no other beyond the piece it is in. Returns when
// all are done. Serial with one thread (torch's thread count), for one piece, and inside a piece. piece must not
// throw.
void claimed_for(int64_t n, const std::function<void(int64_t)>& piece);

// off: claimed_for hands its pieces to at::parallel_for instead (one fixed range of them per OpenMP thread), the
// split the kernels had before; for measuring one against the other in one process.
void set_claimed_loops(bool on);

// Pieces per thread a claimed_range cuts its range into (at most). Why several: a thread that is away for a while
// leaves most of its share to the others; why not many: each is a claim and a call, and a pass is some 150 loops,
// many of them short at one row.
constexpr int64_t kPiecesPerThread = 8;

// f(a, b) over [begin, end) cut into claimed pieces of whole multiples of grain (as at::parallel_for, serial when
// the range is at most one grain).
template <class F>
void claimed_range(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t len = end - begin;
  if (len <= 0) return;
  const int64_t units = (len + grain - 1) / grain;
  const int64_t pieces = std::min<int64_t>(units, at::get_num_threads() * kPiecesPerThread);
  const int64_t per = (units + pieces - 1) / pieces * grain;
  claimed_for((len + per - 1) / per, [&](int64_t i) { f(begin + i * per, std::min(end, begin + (i + 1) * per)); });
}
