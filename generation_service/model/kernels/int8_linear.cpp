// Linear layers with int8 activations over GGUF block weights (the q4_1_i8 format): integer dot products per block
// of 32, exact, and one fixed order for everything in floating point, so a row's result is the same bits whatever
// else shares the pass, whichever instruction set computes it.
//
// The math, per row of x and block b of 32 inputs (the activations of that row alone):
//   dx = max|x_j| / 127, a_j = nearbyint(x_j * (127 / max|x_j|)) in -127..127, xs = dx * sum_j a_j   (fp32)
// and per output column n (weight w_j = d q_j + m for Q4_1, q_j 0..15; w_j = d (u_j - 128) for Q8_0, u_j 0..255):
//   isum = sum_j q_j a_j (int32, exact: the integer dot product)
//   acc  = fma((float)isum, d * dx, acc);  acc = fma(m, xs, acc)      (Q8_0: m = -128 d)
// over the blocks in K order from acc = 0. Every step is one IEEE operation on one column and one row, so the
// scalar loop, AVX2 (maddubs + madd), AVX-VNNI and AVX512-VNNI (vpdpbusd: u8 x s8, exactly 4-bit codes x int8) give
// the same bits, and tests compare them with a numpy reference. Norms, RoPE and attention stay fp32 (lean_forward).
//
// Why int8: past one row a pass is bound by arithmetic, and vpdpbusd does 64 multiply-adds per instruction where an
// fp32 FMA does 16. Why this layout (i8_layout, built at load): the 16 lanes of a vector are 16 output columns, so
// one block's integer sum for 16 columns is 8 vpdpbusd against the row's activations broadcast 4 bytes at a time,
// with no horizontal sums at all, and the per-block scales are lane-wise too; one unpacked block of codes serves
// every row of the tile. AMX-INT8 tiles are left out: no CPU here has them to test on.
//
// Layout: columns in groups of 16 (the last padded with zero weights), each group's blocks in K order:
//   Q4_1, 320 bytes: codes 4 x 64 (vector p, lane i = GGUF code bytes 4p..4p+3 of column i: low nibbles are
//        inputs 4p..4p+3, high nibbles 16+4p..16+4p+3), then 16 fp16 d, then 16 fp16 m;
//   Q8_0, 544 bytes: codes 8 x 64 (vector k, lane i = u = q + 128 of inputs 4k..4k+3 of column i), then 16 fp16 d.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/StringUtil.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#define RAGSERVE_I8_X86 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kCols = 16;                 // output columns per group (the lanes of a 512-bit vector)
constexpr int64_t kQ4GroupBytes = 320;    // one block of a group of columns, Q4_1
constexpr int64_t kQ8GroupBytes = 544;    // Q8_0
constexpr int kTileRows = 8;              // rows of x per tile at most

inline float half_bits_to_float(uint16_t h) {
  // IEEE half -> float, exact (no F16C needed: the scalar path runs anywhere).
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
}

// The activations of M rows, quantized per block of 32 from each row alone.
struct Acts {
  int64_t M = 0, K = 0, nb = 0;
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> dx, xs;   // [M, nb]: the block's scale, and scale * (sum of its codes)
  const int32_t* words(int64_t r, int64_t b) const { return (const int32_t*)(q.data() + r * K + b * kBlock); }
};

// One block of 32 activations -> its codes, scale and scale * code sum (the math at the top of the file).
void quantize_block_scalar(const float* s, int8_t* q, float& dx_out, float& xs_out) {
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(s[j]));
  const float dx = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    // x * id is at most 127 * (1 + 2^-23), so the code is in -127..127
    const int v = (int)std::nearbyint(s[j] * id);
    q[j] = (int8_t)v;
    sum += v;
  }
  dx_out = dx;
  xs_out = dx * (float)sum;
}

#if defined(RAGSERVE_I8_X86)
// The same codes as quantize_block_scalar, 16 lanes at a time: the max of |x| is exact in any order, the product by
// id is the same IEEE multiply, the conversion rounds in the current mode as nearbyint does (to nearest even), and
// the integer sum is exact. A block with a NaN takes the scalar loop, whose max skips NaNs where max_ps would not.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_block_512(const float* s, int8_t* q,
                                                                             float& dx_out, float& xs_out) {
  const __m512 v0 = _mm512_loadu_ps(s), v1 = _mm512_loadu_ps(s + 16);
  if (_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) |
      _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) {
    quantize_block_scalar(s, q, dx_out, xs_out);
    return;
  }
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dx = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(c0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(c1));
  dx_out = dx;
  xs_out = dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
}
#endif

enum class Path { kScalar, kAvx2, kAvxVnni, kAvx512Vnni };

// The activations of M rows; the AVX512-VNNI path quantizes 16 lanes at a time (the same codes), the others one by
// one: before the threaded part of every linear, this serial loop was a visible share of a pass of many rows.
Acts quantize(const at::Tensor& x, Path path) {
  Acts a;
  a.M = x.size(0), a.K = x.size(1), a.nb = a.K / kBlock;
  a.q.resize(a.M * a.K);
  a.dx.resize(a.M * a.nb);
  a.xs.resize(a.M * a.nb);
  const float* xp = x.data_ptr<float>();
  auto block = quantize_block_scalar;
#if defined(RAGSERVE_I8_X86)
  if (path == Path::kAvx512Vnni) block = quantize_block_512;
#endif
  for (int64_t r = 0; r < a.M; ++r)
    for (int64_t b = 0; b < a.nb; ++b)
      block(xp + r * a.K + b * kBlock, a.q.data() + r * a.K + b * kBlock, a.dx[r * a.nb + b], a.xs[r * a.nb + b]);
  return a;
}

// What the kernels below need of one call: the layout of G groups x nb blocks, and where the output goes.
struct Job {
  const uint8_t* w;   // group 0, block 0
  int64_t gbytes;     // bytes of one group's block (kQ4GroupBytes or kQ8GroupBytes)
  int64_t nb, N;      // blocks per column, output columns
  bool q8;
  const Acts* a;
  float* out;         // [M, N]
  const uint8_t* block(int64_t g, int64_t b) const { return w + (g * nb + b) * gbytes; }
};

// -- scalar reference (every CPU) ------------------------------------------------------------------------------------

void tile_scalar(const Job& j, int64_t g, int64_t r0, int rows) {
  const Acts& a = *j.a;
  float acc[kTileRows][kCols] = {};
  for (int64_t b = 0; b < j.nb; ++b) {
    const uint8_t* blk = j.block(g, b);
    for (int i = 0; i < kCols; ++i) {
      int32_t w[kBlock];  // column i's codes of this block, in input order
      float d, m;
      uint16_t h;
      if (j.q8) {
        for (int e = 0; e < kBlock; ++e) w[e] = blk[(e / 4) * 64 + 4 * i + e % 4];
        std::memcpy(&h, blk + 512 + 2 * i, 2);
        d = half_bits_to_float(h);
        m = d * -128.0f;
      } else {
        for (int e = 0; e < 16; ++e) {
          const uint8_t c = blk[(e / 4) * 64 + 4 * i + e % 4];
          w[e] = c & 0x0f;
          w[e + 16] = c >> 4;
        }
        std::memcpy(&h, blk + 256 + 2 * i, 2);
        d = half_bits_to_float(h);
        std::memcpy(&h, blk + 288 + 2 * i, 2);
        m = half_bits_to_float(h);
      }
      for (int r = 0; r < rows; ++r) {
        const int8_t* x = a.q.data() + (r0 + r) * a.K + b * kBlock;
        int32_t isum = 0;
        for (int e = 0; e < kBlock; ++e) isum += w[e] * x[e];
        const int64_t s = (r0 + r) * a.nb + b;
        const float dd = d * a.dx[s];
        acc[r][i] = std::fma((float)isum, dd, acc[r][i]);
        acc[r][i] = std::fma(m, a.xs[s], acc[r][i]);
      }
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < kCols && g * kCols + i < j.N; ++i) j.out[(r0 + r) * j.N + g * kCols + i] = acc[r][i];
}

#if defined(RAGSERVE_I8_X86)
// Each vector path is compiled for its instruction set whatever the build's -march (function targets), and chosen
// at run time by what the CPU has (i8_path): an x86-64-v4 image's kernels still use VNNI on a CPU with it.
#define RAGSERVE_TARGET_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define RAGSERVE_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RAGSERVE_TARGET_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

// -- AVX512-VNNI: NG groups of 16 columns x R rows --------------------------------------------------------------------

template <int NG, int R>
RAGSERVE_TARGET_512 void tile_512(const Job& j, int64_t g0, int64_t r0) {
  const Acts& a = *j.a;
  __m512 acc[NG][R];
  for (int g = 0; g < NG; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int64_t b = 0; b < j.nb; ++b) {
    for (int g = 0; g < NG; ++g) {
      const uint8_t* blk = j.block(g0 + g, b);
      _mm_prefetch((const char*)(blk + 4 * j.gbytes), _MM_HINT_T0);
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
      __m512 d, m;
      if (j.q8) {
        for (int k = 0; k < 8; ++k) {
          const __m512i w = _mm512_loadu_si512((const void*)(blk + 64 * k));
          for (int r = 0; r < R; ++r)
            isum[r] = _mm512_dpbusd_epi32(isum[r], w, _mm512_set1_epi32(a.words(r0 + r, b)[k]));
        }
        d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 512)));
        m = _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
      } else {
        for (int p = 0; p < 4; ++p) {
          const __m512i c = _mm512_loadu_si512((const void*)(blk + 64 * p));
          const __m512i lo = _mm512_and_si512(c, low), hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
          for (int r = 0; r < R; ++r) {
            const int32_t* xw = a.words(r0 + r, b);
            isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(xw[p]));
            isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(xw[p + 4]));
          }
        }
        d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 256)));
        m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 288)));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t s = (r0 + r) * a.nb + b;
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(a.dx[s]));
        acc[g][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), dd, acc[g][r]);
        acc[g][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.xs[s]), acc[g][r]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const int64_t n0 = (g0 + g) * kCols, left = j.N - n0;
    const __mmask16 keep = left >= kCols ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(j.out + (r0 + r) * j.N + n0, keep, acc[g][r]);
  }
}

// -- AVX2 (maddubs + madd) and AVX-VNNI (vpdpbusd on 256 bits): one half of a group (8 columns) x R rows -------------
//
// maddubs multiplies u8 by s8 and adds pairs into int16, saturating. Q4_1 codes (<= 15) times codes in -127..127
// are at most 3810 a pair, 30480 for all 16 pairs of a block's column: no saturation, so the int16 sums of the 8
// maddubs of a block are exact and one madd widens them. Q8_0's u (<= 255) would saturate: it is split into nibbles,
// u = 16 hi + lo, each summed as Q4_1's and recombined exactly in int32.
#define RAGSERVE_I8_HALF_TILE(NAME, TARGET, DOT_Q4, DOT_Q8)                                                       \
  template <int R>                                                                                                \
  TARGET void NAME(const Job& j, int64_t g, int half, int64_t r0) {                                               \
    const Acts& a = *j.a;                                                                                         \
    __m256 acc[R];                                                                                                \
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();                                                     \
    const __m256i low = _mm256_set1_epi8(0x0f);                                                                   \
    const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);                                   \
    (void)ones, (void)sixteen;                                                                                    \
    for (int64_t b = 0; b < j.nb; ++b) {                                                                          \
      const uint8_t* blk = j.block(g, b);                                                                         \
      _mm_prefetch((const char*)(blk + 4 * j.gbytes), _MM_HINT_T0);                                               \
      __m256i isum[R];                                                                                            \
      __m256 d, m;                                                                                                \
      if (j.q8) {                                                                                                 \
        DOT_Q8                                                                                                    \
        d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 512 + 16 * half)));                           \
        m = _mm256_mul_ps(d, _mm256_set1_ps(-128.0f));                                                            \
      } else {                                                                                                    \
        DOT_Q4                                                                                                    \
        d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 256 + 16 * half)));                           \
        m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 288 + 16 * half)));                           \
      }                                                                                                           \
      for (int r = 0; r < R; ++r) {                                                                               \
        const int64_t s = (r0 + r) * a.nb + b;                                                                    \
        const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(a.dx[s]));                                              \
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), dd, acc[r]);                                        \
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.xs[s]), acc[r]);                                             \
      }                                                                                                           \
    }                                                                                                             \
    const int64_t n0 = g * kCols + half * 8, left = std::min<int64_t>(8, j.N - n0);                              \
    for (int r = 0; r < R; ++r) {                                                                                 \
      float* o = j.out + (r0 + r) * j.N + n0;                                                                     \
      if (left == 8) {                                                                                            \
        _mm256_storeu_ps(o, acc[r]);                                                                              \
      } else if (left > 0) {                                                                                      \
        alignas(32) float tmp[8];                                                                                 \
        _mm256_store_ps(tmp, acc[r]);                                                                             \
        std::memcpy(o, tmp, left * sizeof(float));                                                                \
      }                                                                                                           \
    }                                                                                                             \
  }

#define RAGSERVE_CODES(P) _mm256_loadu_si256((const __m256i*)(blk + 64 * (P) + 32 * half))
#define RAGSERVE_XW(R, K) _mm256_set1_epi32(a.words(r0 + (R), b)[K])

RAGSERVE_I8_HALF_TILE(
    half_avx2, RAGSERVE_TARGET_AVX2,
    {
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i c = RAGSERVE_CODES(p);
        const __m256i lo = _mm256_and_si256(c, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        for (int r = 0; r < R; ++r) {
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, RAGSERVE_XW(r, p)));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, RAGSERVE_XW(r, p + 4)));
        }
      }
      for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(s16[r], ones);
    },
    {
      __m256i s_hi[R];
      __m256i s_lo[R];
      for (int r = 0; r < R; ++r) s_hi[r] = s_lo[r] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i c = RAGSERVE_CODES(k);
        const __m256i lo = _mm256_and_si256(c, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i xw = RAGSERVE_XW(r, k);
          s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(lo, xw));
          s_hi[r] = _mm256_add_epi16(s_hi[r], _mm256_maddubs_epi16(hi, xw));
        }
      }
      for (int r = 0; r < R; ++r)
        isum[r] = _mm256_add_epi32(_mm256_madd_epi16(s_hi[r], sixteen), _mm256_madd_epi16(s_lo[r], ones));
    })

RAGSERVE_I8_HALF_TILE(
    half_avxvnni, RAGSERVE_TARGET_AVXVNNI,
    {
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {
        const __m256i c = RAGSERVE_CODES(p);
        const __m256i lo = _mm256_and_si256(c, low);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
        for (int r = 0; r < R; ++r) {
          isum[r] = _mm256_dpbusd_avx_epi32(isum[r], lo, RAGSERVE_XW(r, p));
          isum[r] = _mm256_dpbusd_avx_epi32(isum[r], hi, RAGSERVE_XW(r, p + 4));
        }
      }
    },
    {
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i c = RAGSERVE_CODES(k);
        for (int r = 0; r < R; ++r) isum[r] = _mm256_dpbusd_avx_epi32(isum[r], c, RAGSERVE_XW(r, k));
      }
    })

#undef RAGSERVE_CODES
#undef RAGSERVE_XW
#undef RAGSERVE_I8_HALF_TILE
#endif  // RAGSERVE_I8_X86

// -- dispatch ---------------------------------------------------------------------------------------------------------

const char* path_name(Path p) {
  switch (p) {
    case Path::kAvx512Vnni: return "avx512_vnni";
    case Path::kAvxVnni: return "avx_vnni";
    case Path::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// The paths this CPU runs, best first.
std::vector<Path> runnable() {
  std::vector<Path> out;
#if defined(RAGSERVE_I8_X86)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && avx2)
    out.push_back(Path::kAvx512Vnni);
  if (__builtin_cpu_supports("avxvnni") && avx2) out.push_back(Path::kAvxVnni);
  if (avx2) out.push_back(Path::kAvx2);
#endif
  out.push_back(Path::kScalar);
  return out;
}

Path& chosen() {
  static Path p = runnable().front();
  return p;
}

// f(std::integral_constant<int, R>{}) for R = rows in 1..kTileRows.
template <class F>
inline void with_rows(int rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// Most groups of 16 columns a 512-bit tile of 1-4 rows takes at once (1, 2 or 4; set_i8_groups). More groups give
// more independent vpdpbusd chains to hide its latency, but interleave as many weight streams in each tile: which
// wins depends on the core (on an AMD Zen 4 one group made passes of 1-4 rows cheaper than the 4 and 2 chosen for
// latency), so the worker times the choices when it loads the weights (model/i8_groups.py).
int& small_groups() {
  static int n = 4;
  return n;
}

// Groups [g0, g1) against the rows [r0, r0 + rows) of x, on `path`. Which tile computes a (column, row) changes
// nothing in its value: every tile runs the same operations on it.
void groups_rows(Path path, const Job& j, int64_t g0, int64_t g1, int64_t r0, int rows) {
#if defined(RAGSERVE_I8_X86)
  if (path == Path::kAvx512Vnni) {
    const int most = small_groups();
    const int ng = rows <= 2 ? std::min(4, most) : rows <= 4 ? std::min(2, most) : 1;
    int64_t g = g0;
    with_rows(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (ng == 4)
        for (; g + 4 <= g1; g += 4) tile_512<4, R>(j, g, r0);
      if (ng >= 2)
        for (; g + 2 <= g1; g += 2) tile_512<2, R>(j, g, r0);
      for (; g < g1; ++g) tile_512<1, R>(j, g, r0);
    });
    return;
  }
  if (path == Path::kAvx2 || path == Path::kAvxVnni) {
    // 16 vector registers: tiles of up to 4 rows (sums and accumulators per row), then the next 4.
    for (int64_t rr = 0; rr < rows; rr += 4) {
      const int part = (int)std::min<int64_t>(4, rows - rr);
      for (int64_t g = g0; g < g1; ++g)
        for (int half = 0; half < 2; ++half)
          with_rows(part, [&](auto r) {
            constexpr int R = decltype(r)::value < 4 ? decltype(r)::value : 4;
            if (path == Path::kAvxVnni)
              half_avxvnni<R>(j, g, half, r0 + rr);
            else
              half_avx2<R>(j, g, half, r0 + rr);
          });
    }
    return;
  }
#endif
  for (int64_t g = g0; g < g1; ++g) tile_scalar(j, g, r0, rows);
}

int64_t group_bytes_for(int64_t row_bytes, int64_t nb) {
  if (row_bytes == nb * 20) return kQ4GroupBytes;
  if (row_bytes == nb * 34) return kQ8GroupBytes;
  TORCH_CHECK(false, "a layout row of ", row_bytes, " bytes is neither Q4_1 nor Q8_0 for ", nb, " blocks");
  return 0;
}

}  // namespace

std::string i8_path() { return path_name(chosen()); }

std::vector<std::string> i8_paths() {
  std::vector<std::string> out;
  for (Path p : runnable()) out.emplace_back(path_name(p));
  return out;
}

int64_t i8_groups() { return small_groups(); }

void set_i8_groups(int64_t n) {
  TORCH_CHECK(n == 1 || n == 2 || n == 4, "groups must be 1, 2 or 4, got ", n);
  small_groups() = (int)n;
}

void set_i8_path(const std::string& name) {
  for (Path p : runnable())
    if (name.empty() || name == path_name(p)) {
      chosen() = p;
      return;
    }
  TORCH_CHECK(false, "int8 path ", name, " does not run here; this CPU runs: ", c10::Join(", ", i8_paths()));
}

at::Tensor i8_layout(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && K % kBlock == 0 && K > 0,
              "w must be contiguous GGUF blocks uint8 [N, K / 32 * block bytes], K a multiple of 32");
  const int64_t N = w.size(0), nb = K / kBlock, rb = w.size(1);
  const bool q8 = rb == nb * 34;
  TORCH_CHECK(q8 || rb == nb * 20, "a packed row of ", rb, " bytes is neither Q4_1 nor Q8_0 for K = ", K);
  const int64_t G = (N + kCols - 1) / kCols, gb = q8 ? kQ8GroupBytes : kQ4GroupBytes;
  auto out = at::zeros({G, nb * gb}, at::kByte);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / kCols, i = n % kCols;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = dst + (g * nb + b) * gb;
      if (q8) {
        const uint8_t* s = src + n * rb + b * 34;
        for (int k = 0; k < 8; ++k)
          for (int t = 0; t < 4; ++t) blk[64 * k + 4 * i + t] = (uint8_t)((int)(int8_t)s[2 + 4 * k + t] + 128);
        std::memcpy(blk + 512 + 2 * i, s, 2);
      } else {
        const uint8_t* s = src + n * rb + b * 20;
        for (int p = 0; p < 4; ++p) std::memcpy(blk + 64 * p + 4 * i, s + 4 + 4 * p, 4);
        std::memcpy(blk + 256 + 2 * i, s, 2);
        std::memcpy(blk + 288 + 2 * i, s + 2, 2);
      }
    }
  }
  // Padding columns: d = m = 0 and codes 0 (Q8_0's u = 0 with d = 0): their sums are computed and never stored.
  return out;
}

std::vector<at::Tensor> i8_quantize(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % kBlock == 0,
              "x must be float32 [M, K], K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  Acts a = quantize(xc, chosen());
  auto q = at::empty({a.M, a.K}, at::kChar);
  auto dx = at::empty({a.M, a.nb}, at::kFloat), xs = at::empty({a.M, a.nb}, at::kFloat);
  std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.q.size());
  std::memcpy(dx.data_ptr<float>(), a.dx.data(), a.dx.size() * 4);
  std::memcpy(xs.data_ptr<float>(), a.xs.data(), a.xs.size() * 4);
  return {q, dx, xs};
}

at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& layout, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be contiguous float32 [M, K], K a multiple of 32, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock, G = (N + kCols - 1) / kCols;
  TORCH_CHECK(layout.scalar_type() == at::kByte && layout.dim() == 2 && layout.is_contiguous() &&
                  layout.size(0) == G && layout.size(1) % nb == 0,
              "layout must be i8_layout's [ceil(N / 16), K / 32 * group bytes] for N = ", N, ", K = ", K);
  const int64_t gb = layout.size(1) / nb;
  TORCH_CHECK(gb == kQ4GroupBytes || gb == kQ8GroupBytes, "layout rows of ", layout.size(1),
              " bytes are not i8_layout's for K = ", K);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const Path path = chosen();
  const Acts a = quantize(x, path);
  const Job j{layout.data_ptr<uint8_t>(), gb, nb, N, gb == kQ8GroupBytes, &a, out.data_ptr<float>()};
  // Rows in tiles of up to kTileRows, as equal as can be (13 rows: 7 + 6); columns split among the threads in
  // pieces of whole groups, each piece taking every tile of rows while its weights are in cache.
  const int64_t tiles = (M + kTileRows - 1) / kTileRows;
  // Pieces of ~16 KB of weights: small enough to stay in L1 across the tiles of rows.
  const int64_t grain = std::max<int64_t>(1, 16384 / (nb * gb));
  claimed_range(0, G, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t t = 0, r = 0; t < tiles; ++t) {
      const int rows = (int)(M / tiles + (t < M % tiles));
      groups_rows(path, j, g0, g1, r, rows);
      r += rows;
    }
  });
  return out;
}
