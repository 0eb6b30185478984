// Linear layers straight from GGUF block-quantized weights (Q4_1, Q8_0), fp32 activations and accumulation.
//
// Why a kernel of our own: the point of a 4-bit format is that a decode step reads ~5 bits per weight instead of 32,
// and torch's int4 CPU matmul (_weight_int4pack_mm_for_cpu) keeps scales and zero points in bf16, which cannot hold
// the fp16 d and m of Q4_1 exactly. Here every weight is formed as fma(d, q, m) (Q4_1) or d * q (Q8_0) in fp32 from
// the fp16 d and m: both products are exact in fp32 (11-bit mantissa x 4 or 8 bits), so the weights are exactly the
// dequantized GGUF values and only the summation order differs from an fp32 GEMM over them.
//
// Layout (GGUF's own, unchanged): weight row n = K / 32 blocks, row-major, no padding.
//   Q4_1 block, 20 bytes: fp16 d, fp16 m, 16 bytes qs; element j < 16 = low nibble of qs[j], j >= 16 = high nibble
//        of qs[j - 16]; weight = d * q + m.
//   Q8_0 block, 34 bytes: fp16 d, 32 int8 qs; weight = d * q.
//
// The matmul: out[M, N] = x[M, K] @ W[N, K]^T. Output rows are split across torch's own thread pool (at::parallel_for,
// so no second OpenMP runtime competes for the cores); each weight row is decoded once per tile of up to 8 rows of x
// and multiplied into all of them, so a 1-row GEMV reads each weight byte once and small tree passes reuse the decode.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kTile = 8;  // rows of x per pass over a weight row
constexpr int64_t kChunk = 32;  // weight rows per cache-resident chunk (and the parallel grain)
// Weight rows ahead of the one being read, fetched into L2 (not L1: 32 fp32 rows of K = 1536 are 200 KB). Measured on
// an EPYC Zen 4 over the 135M model's linears: T0 16 rows ahead on one line per block -> T1 32 rows ahead on every
// line: 8 rows of x 31.4 -> 19.7 ms (what 1 row costs: reading the weights), 16 rows 42.0 -> 31.8, 1 row unchanged.
constexpr int64_t kPrefetchRows = 32;

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // IEEE half -> float by hand (exact), for compilers without F16C.
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

struct Q41 {
  static constexpr int bytes = 20;
  static inline void decode_scalar(const uint8_t* b, float* w) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = std::fma(d, (float)(b[4 + j] & 0x0f), m);
      w[j + 16] = std::fma(d, (float)(b[4 + j] >> 4), m);
    }
  }
#if defined(__AVX512F__)
  static inline void decode(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(half_to_float(b)), m = _mm512_set1_ps(half_to_float(b + 2));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 4)));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f))), d, m);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  static inline void decode(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b)), m = _mm256_set1_ps(half_to_float(b + 2));
    const __m128i raw = _mm_loadu_si128((const __m128i*)(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
  }
#endif
};

struct Q80 {
  static constexpr int bytes = 34;
  static inline void decode_scalar(const uint8_t* b, float* w) {
    const float d = half_to_float(b);
    for (int j = 0; j < 32; ++j) w[j] = d * (float)(int8_t)b[2 + j];
  }
#if defined(__AVX512F__)
  static inline void decode(const uint8_t* b, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(half_to_float(b));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2)))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18)))), d);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  static inline void decode(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 2 + 8 * j)))),
                           d);
  }
#endif
};

// Plain fp32 rows through the same tiling: a dense fp32 weight then gives every row of x the same bits in a 1-row step
// and in a tree pass, as the block formats do (MKL's GEMV and GEMM sum in different orders).
struct F32 {
  static constexpr int bytes = 128;
  static inline void decode_scalar(const uint8_t* b, float* w) { std::memcpy(w, b, bytes); }
#if defined(__AVX512F__)
  static inline void decode(const uint8_t* b, __m512& w0, __m512& w1) {
    w0 = _mm512_loadu_ps((const float*)b);
    w1 = _mm512_loadu_ps((const float*)b + 16);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  static inline void decode(const uint8_t* b, __m256 w[4]) {
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps((const float*)b + 8 * j);
  }
#endif
};

// out[n + r * ldo] = dot(x[r * ldx, :K], W row n) for n < NR, r < R; `row` points at row 0's first block.
// Every (n, r) has one accumulator that takes the block's two halves in the same order whatever NR and R are, so a
// row of x gets bit-identical results in a 1-row step and inside a 64-row tree pass (lossless speculation needs it).
template <class B, int NR, int R>
inline void tile_dot(const float* x, int64_t ldx, const uint8_t* row, int64_t row_bytes, int64_t nb, float* out,
                     int64_t ldo) {
#if defined(__AVX512F__)
  __m512 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 w0[NR], w1[NR];
    // Streaming the weights bounds a pass of a few rows: ask for the rows kPrefetchRows ahead, one request per cache
    // line that starts in this block (a 128-byte fp32 block spans two), so the multiply-adds of the rows of x
    // overlap the reads instead of following them.
    for (int64_t line = (b * B::bytes + 63) / 64 * 64; line < (b + 1) * B::bytes; line += 64)
      for (int n = 0; n < NR; ++n)
        _mm_prefetch((const char*)(row + (n + kPrefetchRows) * row_bytes + line), _MM_HINT_T1);
    for (int n = 0; n < NR; ++n) B::decode(row + n * row_bytes + b * B::bytes, w0[n], w1[n]);
    const float* xb = x + b * kBlock;
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(xb + r * ldx), x1 = _mm512_loadu_ps(xb + r * ldx + 16);
      for (int n = 0; n < NR; ++n) acc[n][r] = _mm512_fmadd_ps(x1, w1[n], _mm512_fmadd_ps(x0, w0[n], acc[n][r]));
    }
  }
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) out[n + r * ldo] = _mm512_reduce_add_ps(acc[n][r]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int n = 0; n < NR; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      B::decode(row + n * row_bytes + b * B::bytes, w);
      const float* xb = x + b * kBlock;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * ldx + 8 * j), w[j], acc[r]);
    }
    for (int r = 0; r < R; ++r) {
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[n + r * ldo] = _mm_cvtss_f32(h);
    }
  }
#else
  float w[kBlock];
  for (int n = 0; n < NR; ++n) {
    float acc[R] = {0};
    for (int64_t b = 0; b < nb; ++b) {
      B::decode_scalar(row + n * row_bytes + b * B::bytes, w);
      const float* xb = x + b * kBlock;
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < kBlock; ++j) acc[r] += xb[r * ldx + j] * w[j];
    }
    for (int r = 0; r < R; ++r) out[n + r * ldo] = acc[r];
  }
#endif
}

template <class B, int NR>
void rows_dot(const float* x, int64_t ldx, int rows, const uint8_t* w, int64_t row_bytes, int64_t nb, float* out,
              int64_t ldo) {
  switch (rows) {
    case 1: tile_dot<B, NR, 1>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 2: tile_dot<B, NR, 2>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 3: tile_dot<B, NR, 3>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 4: tile_dot<B, NR, 4>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 5: tile_dot<B, NR, 5>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 6: tile_dot<B, NR, 6>(x, ldx, w, row_bytes, nb, out, ldo); break;
    case 7: tile_dot<B, NR, 7>(x, ldx, w, row_bytes, nb, out, ldo); break;
    default: tile_dot<B, NR, 8>(x, ldx, w, row_bytes, nb, out, ldo); break;
  }
}

void check(const torch::Tensor& x, const torch::Tensor& packed, int64_t block_bytes) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "block-quantized linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K], got ", x.sizes());
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed weight must be contiguous uint8 [N, K / 32 * block bytes]");
  TORCH_CHECK(x.size(1) % kBlock == 0 && packed.size(1) == x.size(1) / kBlock * block_bytes,
              "K = ", x.size(1), " does not match a packed row of ", packed.size(1), " bytes");
}

template <class B>
torch::Tensor linear_rows(const torch::Tensor& x, const uint8_t* wp, int64_t N, int64_t row_bytes) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Loop order: a chunk of kChunk weight rows (a few KB) against every tile of x, so both stay in L1 and neither is
  // re-read from L2 per row (x of a 64-row pass is 150-400 KB).
  at::parallel_for(0, N, kChunk, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += kChunk) {
      const int64_t n1 = std::min(c1, n0 + kChunk);
      for (int64_t r = 0; r < M; r += kTile) {
        const int rows = (int)std::min<int64_t>(kTile, M - r);
        int64_t n = n0;
        // Few rows of x: more weight rows at once, so enough independent FMA chains hide the FMA latency and more
        // weight streams are in flight (4 x 4 accumulators still fit the 32 vector registers).
        if (rows <= 4)
          for (; n + 4 <= n1; n += 4)
            rows_dot<B, 4>(xp + r * K, K, rows, wp + n * row_bytes, row_bytes, nb, op + r * N + n, N);
        for (; n + 2 <= n1; n += 2)
          rows_dot<B, 2>(xp + r * K, K, rows, wp + n * row_bytes, row_bytes, nb, op + r * N + n, N);
        for (; n < n1; ++n)
          rows_dot<B, 1>(xp + r * K, K, rows, wp + n * row_bytes, row_bytes, nb, op + r * N + n, N);
      }
    }
  });
  return out;
}

template <class B>
torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  check(x, packed, B::bytes);
  x = x.contiguous();
  return linear_rows<B>(x, packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1));
}

template <class B>
torch::Tensor dequantize(torch::Tensor packed, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() &&
                  K % kBlock == 0 && packed.size(1) == K / kBlock * B::bytes,
              "packed weight must be contiguous uint8 [N, K / 32 * ", B::bytes, "] with K = ", K);
  const int64_t N = packed.size(0), nb = K / kBlock;
  auto out = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) B::decode_scalar(wp + (n * nb + b) * B::bytes, op + n * K + b * kBlock);
  });
  return out;
}

}  // namespace

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be contiguous float32 [M, K], K a multiple of 32, got ", x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous matrix");
  const int64_t K = x.size(1), nb = K / kBlock;
  if (w.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(w.size(1) == K, "fp32 weight has ", w.size(1), " inputs, x ", K);
    return linear_rows<F32>(x, (const uint8_t*)w.data_ptr<float>(), w.size(0), K * 4);
  }
  TORCH_CHECK(w.scalar_type() == torch::kUInt8, "weight must be float32 or GGUF blocks (uint8)");
  if (w.size(1) == nb * Q41::bytes) return linear_rows<Q41>(x, w.data_ptr<uint8_t>(), w.size(0), w.size(1));
  if (w.size(1) == nb * Q80::bytes) return linear_rows<Q80>(x, w.data_ptr<uint8_t>(), w.size(0), w.size(1));
  TORCH_CHECK(false, "a packed row of ", w.size(1), " bytes is neither Q4_1 nor Q8_0 for K = ", K);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &linear<Q41>, "x[M, K] float32 @ Q4_1 weight[N, K]^T -> [M, N]");
  m.def("q8_0_linear", &linear<Q80>, "x[M, K] float32 @ Q8_0 weight[N, K]^T -> [M, N]");
  m.def("f32_linear", &block_linear, "x[M, K] float32 @ float32 weight[N, K]^T -> [M, N] (the block kernel's tiling)");
  m.def("q4_1_dequantize", &dequantize<Q41>, "Q4_1 weight -> float32 [N, K]");
  m.def("q8_0_dequantize", &dequantize<Q80>, "Q8_0 weight -> float32 [N, K]");
  bind_lean_forward(m);
  m.def("isa", []() {
#if defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return std::string("avx2");
#else
    return std::string("scalar");
#endif
  });
}
