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
// The matmul: out[M, N] = x[M, K] @ W[N, K]^T. Output rows are split into pieces claimed by the pass's threads
// (claimed_range, claim_pool.cpp: a descheduled thread holds no loop up); each weight row is decoded once per tile of
// up to 8 rows of x and multiplied into all of them, so a 1-row GEMV reads each weight byte once and small tree passes
// reuse the decode.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define RAGSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif


namespace {

constexpr int kBlock = 32;
constexpr int kTile = 8;  // rows of x per pass over a weight row (with_rows' largest tile)
// Passes of up to kTileMax rows are one tile of x, longer ones ceil(M / kTileLong) tiles as equal as can be. Why: a
// tile decodes every weight block again, so a 9-row pass split 8 + 1 paid a second decode of the whole model for one
// row. AVX-512's 32 registers take 2 x 10 tiles in any pass; with AVX2's 16 a 10-row tile (10 accumulators + 4
// weight vectors) pays for itself only when it saves a whole decode, so longer passes keep tiles of up to 8 there
// (10-row tiles in longer passes made those slower there). Passes just past 8 rows gain most, the others are
// unchanged (bench.step).
constexpr int kTileMax = 10;
#if defined(__AVX512F__)
constexpr int kTileLong = kTileMax;  // tiles of longer passes: at most this many rows
#else
constexpr int kTileLong = kTile;
#endif
constexpr int64_t kChunk = 32;  // weight rows per cache-resident chunk (and the parallel grain)
// Weight rows ahead of the one being read, fetched into L2 (not L1: 32 fp32 rows of K = 1536 are 200 KB), on every
// line rather than one per block and further ahead: multi-row passes then cost close to what reading the weights
// costs (a 1-row pass), where fewer prefetches left them waiting on memory (bench.step).
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
  // d and m from one conversion, each 8-code half widened straight from memory and split into its low and high
  // nibbles by a mask and a shift (the bytes are zero-extended, so >> 4 leaves the high nibble): 19 instructions a
  // block instead of 22, and no scalar half conversions (each a chain through a general register). Same values in
  // the same lanes, so the same bits. Why: on AVX2 a pass of a row or two is bound by decoding, not by memory, so
  // fewer instructions per block make such passes faster; longer passes are bound elsewhere (bench.step).
  static inline void decode(const uint8_t* b, __m256 w[4]) {
    int32_t dm_bits;
    std::memcpy(&dm_bits, b, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(dm_bits));  // [d, m, 0, 0]: one conversion for both
    const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
    int64_t q0, q1;
    std::memcpy(&q0, b + 4, 8);
    std::memcpy(&q1, b + 12, 8);
    const __m256i v0 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(q0)), v1 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(q1));
    const __m256i mask = _mm256_set1_epi32(0x0f);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, mask)), d, m);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, mask)), d, m);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), d, m);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), d, m);
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

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// The 8 lanes of v summed in a fixed order (halves, then pairs, then the last two).
inline float hsum256(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}
#endif

#if defined(__AVX512F__)
// Lane j of the result = _mm512_reduce_add_ps(v[j]) bit for bit: each level adds the same pairs of partial sums as
// that reduction does (the 256-bit halves, then the 128-bit quarters, then lanes 0 + 2 and 1 + 3, then 0 + 1), for 16
// vectors at once: 4 levels of two shuffles and an add per pair of vectors instead of 16 separate reductions. The
// result's lanes come out as a 4 x 4 transpose (lane 4q + j holds v[4j + q]) and are put back in order by one permute.
// Why: a tile of 16-24 accumulators over K = 576 (most of the model's linears) takes only 18 blocks, so its separate
// reductions were a sizeable share of the tile; the shared levels make multi-row passes faster with bf16 and fp32
// activations alike (bench.step).
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)  // lanes i + i+8: quarters [s(v[2k]) 0-3, 4-7, s(v[2k+1]) 0-3, 4-7]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int k = 0; k < 4; ++k)  // then i + i+4: quarter q holds v[4k + q]'s four partial sums
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int k = 0; k < 2; ++k)  // then 0 + 2, 1 + 3 within each quarter
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

// out[n + r * ldo] = _mm512_reduce_add_ps(acc[n][r]): 16 at a time by reduce16 (a last group of 6 or more padded with
// zero vectors), the rest one by one, all with the same bits.
template <int NR, int R>
inline void store_sums(const __m512 (&acc)[NR][R], float* out, int64_t ldo) {
  constexpr int kN = NR * R;
  int i = 0;
  for (; i + 6 <= kN; i += 16) {
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = i + j < kN ? acc[(i + j) / R][(i + j) % R] : _mm512_setzero_ps();
    alignas(64) float s[16];
    _mm512_store_ps(s, reduce16(v));
    for (int j = 0; j < 16 && i + j < kN; ++j) out[(i + j) / R + (i + j) % R * ldo] = s[j];
  }
  for (; i < kN; ++i) out[i / R + i % R * ldo] = _mm512_reduce_add_ps(acc[i / R][i % R]);
}
#endif

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
  store_sums<NR, R>(acc, out, ldo);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if constexpr (R <= 2) {
    // One or two rows of x: all NR weight rows advance together, block by block, each decoded in turn into the same
    // four registers, with the rows kPrefetchRows ahead asked for. Why: an accumulator takes a block as four
    // dependent FMAs, so one weight row at a time left a 1-row pass one or two chains in flight, waiting out the FMA
    // latency on every product. Each accumulator takes the same products in the same order as below: the same bits.
    // Only for one or two rows: with 3-4 rows (2 x R chains) this loop was slower than the one below, with or without
    // the prefetches, so more rows keep the loop below (bench.step).
    __m256 acc[NR][R];
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < R; ++r) acc[n][r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      for (int64_t line = (b * B::bytes + 63) / 64 * 64; line < (b + 1) * B::bytes; line += 64)
        for (int n = 0; n < NR; ++n)
          _mm_prefetch((const char*)(row + (n + kPrefetchRows) * row_bytes + line), _MM_HINT_T1);
      const float* xb = x + b * kBlock;
      for (int n = 0; n < NR; ++n) {
        __m256 w[4];
        B::decode(row + n * row_bytes + b * B::bytes, w);
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < 4; ++j)
            acc[n][r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + r * ldx + 8 * j), w[j], acc[n][r]);
      }
    }
    for (int n = 0; n < NR; ++n)
      for (int r = 0; r < R; ++r) out[n + r * ldo] = hsum256(acc[n][r]);
    return;
  }
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
    for (int r = 0; r < R; ++r) out[n + r * ldo] = hsum256(acc[r]);
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

// f(std::integral_constant<int, R>{}) with R = rows (1..8, more counts as 8): a tile's row count as a template
// argument, so its accumulators are registers.
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

// Rows of tile t when M rows of x are split into `tiles` tiles as equal in size as can be (13 rows in 3: 5, 4, 4, not
// 6, 6, 1): the last tile is never a row or two that costs a whole pass over the weights.
inline int tile_rows(int64_t M, int64_t tiles, int64_t t) { return (int)(M / tiles + (t < M % tiles)); }

// f(std::integral_constant<int, R>{}) with R = rows for R in [Lo, Hi] (more counts as Hi).
template <int Lo, int Hi, class F>
inline void with_rows_upto(int rows, F&& f) {
  if constexpr (Lo >= Hi)
    f(std::integral_constant<int, Hi>{});
  else if (rows <= Lo)
    f(std::integral_constant<int, Lo>{});
  else
    with_rows_upto<Lo + 1, Hi>(rows, f);
}

// Tiles of more than 8 rows out of line, so the dispatch of the smaller ones compiles as before (tile_dot_bf16_outlined
// says what inlining them all cost there).
template <class B, int NR, int R>
__attribute__((noinline)) void tile_dot_outlined(const float* x, int64_t ldx, const uint8_t* row, int64_t row_bytes,
                                                 int64_t nb, float* out, int64_t ldo) {
  tile_dot<B, NR, R>(x, ldx, row, row_bytes, nb, out, ldo);
}

template <class B, int NR>
void rows_dot(const float* x, int64_t ldx, int rows, const uint8_t* w, int64_t row_bytes, int64_t nb, float* out,
              int64_t ldo) {
  if (rows <= 8)
    with_rows(rows, [&](auto r) { tile_dot<B, NR, decltype(r)::value>(x, ldx, w, row_bytes, nb, out, ldo); });
  else
    with_rows_upto<9, kTileMax>(
        rows, [&](auto r) { tile_dot_outlined<B, NR, decltype(r)::value>(x, ldx, w, row_bytes, nb, out, ldo); });
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
  claimed_range(0, N, kChunk, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += kChunk) {
      const int64_t n1 = std::min(c1, n0 + kChunk);
      const int64_t tiles = M <= kTileMax ? 1 : (M + kTileLong - 1) / kTileLong;
      for (int64_t t = 0, r = 0; t < tiles; ++t) {
        const int rows = tile_rows(M, tiles, t);
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
        r += rows;
      }
    }
  });
  return out;
}


#if defined(__AVX512BF16__)
// bf16 activations with AVX512-BF16 dot products (Zen 4 / Zen 5, Cooper Lake: CPUs without AMX tiles):
// out[M, N] = bf16(x)[M, K] @ bf16(W)[N, K]^T, fp32 accumulation. Why: past a few rows a pass is arithmetic-bound, and
// one VDPBF16PS multiplies 32 pairs into 16 fp32 sums where fp32 FMAs take two instructions for the same 32 products
// (engine/calibrate.py picks the faster format per machine). Exactness: every (weight row, row of x) has its own
// accumulator, which takes block after block in K order, each block as one VDPBF16PS (lane i adds x[2i] w[2i] +
// x[2i+1] w[2i+1]); the 16 lanes are summed at the end in a fixed order. No other row of x takes part, so a row gets
// the same bits in a 1-row step, in a tree pass and in any batch (lossless speculation within the format). The
// values are the q4_1_bf16 format's: x and the decoded weights rounded to bf16 (round to nearest even), products
// summed in fp32; the order of the sums differs from the AMX path's, so the two CPUs' bits differ in the last places.
//
// Two weight sources share one tile routine: GGUF blocks decoded on the fly (passes of up to kOneTileBf16 rows, all
// in one tile, so each decoded block is used by every row of x), and weights decoded to bf16 beforehand (passes of
// more rows, in tiles of up to kWideTileBf16 rows, which would otherwise decode every block once per tile of x).
//
// Tile shapes (every shape gives the same bits): what bounds a tile is loads, one 64-byte vector per cycle, not the
// dot products. A tile of NR weight rows x R rows of x loads NR + R vectors per NR * R products, so 4 x 6 (0.42 loads
// per product) beats 2 x 8 (0.63); 4 x 8 would need more than the 32 vector registers. Hence balanced tiles of up to
// 6 rows over decoded weights (16 rows: 6, 5, 5). And a pass just past one 8-row tile paid a whole second pass over
// the weights for a row or two, where one 2 x 10 tile on the fly costs little more than 8 rows; past 10 rows such a
// tile runs out of registers, and the decoded copy is as fast or faster (bench.step).
constexpr int kOneTileBf16 = 10;    // passes of up to this many rows: one tile, blocks decoded on the fly
static_assert(kWideFromRows == kOneTileBf16 + 1, "the decoded copy by default from the first row past one tile");
constexpr int kWideTileBf16 = 6;    // longer passes: balanced tiles of up to this many rows over decoded weights
constexpr int kQuadRowsBf16 = 6;    // tiles of up to this many rows take 4 weight rows at a time (4 x 6 accumulators)
constexpr int64_t kBufRows = 16;    // weight rows decoded per buffer (K = 1536: 48 KB)

// One block's 32 weights as bf16 (round to nearest even of the exact fp32 value).
template <class B>
inline __m512bh decode_block_bf16(const uint8_t* blk) {
  __m512 w0, w1;
  B::decode(blk, w0, w1);
  return _mm512_cvtne2ps_pbh(w1, w0);  // elements 0..31 in order: w0 -> the low half
}

// Q4_1 by table: a block's weights take only the 16 values d * q + m (q = 0..15), so compute those once, round them
// to bf16 (the same fma and rounding as above: the same bits) and pick each weight's by its nibble with one word
// permute. Why: a pass of a few rows is bound by decoding blocks, not by the dot products or reading memory, so fewer
// instructions per block make such passes faster (passes past one tile read the decoded copy and are unchanged).
// The table holds the 16 values twice, so an index's bit 4 picks the same value and the low nibbles need no mask:
// the indexes are the 16 code bytes widened to words, the upper 16 shifted right by 4 (one variable shift), and d and
// m come broadcast in pairs from one conversion (~10 instructions a block instead of ~14). Decoding is still a large
// share of such a pass (bench.step).
template <>
inline __m512bh decode_block_bf16<Q41>(const uint8_t* blk) {
  int32_t dm_bits;
  std::memcpy(&dm_bits, blk, 4);
  const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(dm_bits));  // d, m, d, m, ...
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 values = _mm512_fmadd_ps(iota, _mm512_moveldup_ps(dm), _mm512_movehdup_ps(dm));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  const __m512i codes = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(blk + 4))));
  const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                         0x0004000400040004, 0, 0, 0, 0);
  // words 0..15: code byte j (its low nibble, and bit 4 from the high one: the table's second copy), 16..31: j >> 4
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_srlv_epi16(codes, shift), table);
}

template <class B>
struct BlockSrc {  // weight rows as GGUF blocks
  static constexpr int64_t bytes = B::bytes;
  static constexpr bool prefetch = true;
  static inline __m512bh load(const uint8_t* blk) { return decode_block_bf16<B>(blk); }
};

struct BufSrc {  // weight rows already decoded to bf16, 64 bytes per block
  static constexpr int64_t bytes = 64;
  static constexpr bool prefetch = false;
  static inline __m512bh load(const uint8_t* blk) { return (__m512bh)_mm512_loadu_si512((const void*)blk); }
};

struct DenseSrc {  // weight rows decoded to bf16 once, at load (decode_rows_bf16): streamed from memory like blocks
  static constexpr int64_t bytes = 64;
  static constexpr bool prefetch = true;
  static inline __m512bh load(const uint8_t* blk) { return (__m512bh)_mm512_loadu_si512((const void*)blk); }
};

// out[n + r * ldo] = dot(x row r, weight row n) for n < NR, r < R; x: bf16 rows of ldx elements.
template <class S, int NR, int R>
inline void tile_dot_bf16(const uint16_t* x, int64_t ldx, const uint8_t* row, int64_t row_bytes, int64_t nb,
                          float* out, int64_t ldo) {
  __m512 acc[NR][R];
  for (int n = 0; n < NR; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (S::prefetch)  // as the fp32 path: the rows kPrefetchRows ahead, one request per line starting in this block
      for (int64_t line = (b * S::bytes + 63) / 64 * 64; line < (b + 1) * S::bytes; line += 64)
        for (int n = 0; n < NR; ++n)
          _mm_prefetch((const char*)(row + (n + kPrefetchRows) * row_bytes + line), _MM_HINT_T1);
    __m512bh w[NR];
    for (int n = 0; n < NR; ++n) w[n] = S::load(row + n * row_bytes + b * S::bytes);
    const uint16_t* xb = x + b * kBlock;
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xb + r * ldx));
      for (int n = 0; n < NR; ++n) acc[n][r] = _mm512_dpbf16_ps(acc[n][r], xv, w[n]);
    }
  }
  store_sums<NR, R>(acc, out, ldo);
}

// Tiles of more than 8 rows out of line. Why: inlined beside the smaller ones, the compiler's register allocation of
// the whole dispatch changed, which slowed the 10-row tile and the 7- and 8-row tiles too.
template <class S, int NR, int R>
__attribute__((noinline)) void tile_dot_bf16_outlined(const uint16_t* x, int64_t ldx, const uint8_t* row,
                                                      int64_t row_bytes, int64_t nb, float* out, int64_t ldo) {
  tile_dot_bf16<S, NR, R>(x, ldx, row, row_bytes, nb, out, ldo);
}

template <class S, int NR>
void rows_dot_bf16(const uint16_t* x, int64_t ldx, int rows, const uint8_t* w, int64_t row_bytes, int64_t nb,
                   float* out, int64_t ldo) {
  if (rows <= 8)
    with_rows(rows, [&](auto r) { tile_dot_bf16<S, NR, decltype(r)::value>(x, ldx, w, row_bytes, nb, out, ldo); });
  else
    with_rows_upto<9, kOneTileBf16>(
        rows, [&](auto r) { tile_dot_bf16_outlined<S, NR, decltype(r)::value>(x, ldx, w, row_bytes, nb, out, ldo); });
}

// Weight rows [n0, n1) against every tile of x: ceil(M / max_tile) tiles (tile_rows), 4 weight rows at a time in
// tiles of up to kQuadRowsBf16 rows, else 2.
template <class S>
void chunk_dot_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                    int64_t n1, float* op, int64_t N, int max_tile) {
  const int64_t nb = K / kBlock, tiles = (M + max_tile - 1) / max_tile;
  for (int64_t t = 0, r = 0; t < tiles; ++t) {
    const int rows = tile_rows(M, tiles, t);
    int64_t n = n0;
    if (rows <= kQuadRowsBf16)
      for (; n + 4 <= n1; n += 4)
        rows_dot_bf16<S, 4>(x + r * K, K, rows, w + (n - n0) * row_bytes, row_bytes, nb, op + r * N + n, N);
    for (; n + 2 <= n1; n += 2)
      rows_dot_bf16<S, 2>(x + r * K, K, rows, w + (n - n0) * row_bytes, row_bytes, nb, op + r * N + n, N);
    for (; n < n1; ++n)
      rows_dot_bf16<S, 1>(x + r * K, K, rows, w + (n - n0) * row_bytes, row_bytes, nb, op + r * N + n, N);
    r += rows;
  }
}

// x [M, K] fp32 -> bf16 rows (round to nearest even).
std::vector<uint16_t> x_to_bf16(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  std::vector<uint16_t> xb(M * K);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* s = xp + m * K + b * kBlock;
      _mm512_storeu_si512((void*)(xb.data() + m * K + b * kBlock),
                          (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s)));
    }
  return xb;
}

// The same products as linear_rows_bf16dp over weights decoded to bf16 [N, K] once: the same values in the same chains,
// so the same bits, without decoding every block in every pass. Why: decoding is what a pass's weights cost beyond
// reading them (the same whatever the rows), and past one tile of x the dot products no longer hide it; reading 2
// bytes per weight instead of 0.6 costs less there. Up to 10 rows, in one tile, the blocks are as fast or faster;
// from which row count the copy wins is the machine's (engine/calibrate.py; bench.step).
torch::Tensor linear_dense_bf16dp(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const std::vector<uint16_t> xb = x_to_bf16(x);
  auto out = torch::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const uint8_t* wp = (const uint8_t*)w.data_ptr();
  claimed_range(0, N, kChunk, [&](int64_t c0, int64_t c1) {
    for (int64_t n0 = c0; n0 < c1; n0 += kChunk)
      chunk_dot_bf16<DenseSrc>(xb.data(), M, K, wp + n0 * K * 2, K * 2, n0, std::min(c1, n0 + kChunk), op, N,
                               kWideTileBf16);
  });
  return out;
}

template <class B>
torch::Tensor decode_rows_bf16(const uint8_t* wp, int64_t N, int64_t row_bytes, int64_t K) {
  const int64_t nb = K / kBlock;
  auto out = torch::empty({N, K}, torch::kBFloat16);
  uint16_t* op = (uint16_t*)out.data_ptr();
  at::parallel_for(0, N, kChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b)
        _mm512_storeu_si512((void*)(op + n * K + b * kBlock),
                            (__m512i)BlockSrc<B>::load(wp + n * row_bytes + b * B::bytes));
  });
  return out;
}

template <class B>
torch::Tensor linear_rows_bf16dp(const torch::Tensor& x, const uint8_t* wp, int64_t N, int64_t row_bytes) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const std::vector<uint16_t> xb = x_to_bf16(x);
  auto out = torch::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  if (M <= kOneTileBf16) {  // one tile of x: decode each block once, right where it is used
    claimed_range(0, N, kChunk, [&](int64_t c0, int64_t c1) {
      for (int64_t n0 = c0; n0 < c1; n0 += kChunk)
        chunk_dot_bf16<BlockSrc<B>>(xb.data(), M, K, wp + n0 * row_bytes, row_bytes, n0, std::min(c1, n0 + kChunk),
                                    op, N, kOneTileBf16);
    });
    return out;
  }
  claimed_range(0, N, kBufRows, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<uint16_t> buf;  // per thread, not per piece
    buf.resize(kBufRows * K);
    for (int64_t n0 = c0; n0 < c1; n0 += kBufRows) {
      const int64_t n1 = std::min(c1, n0 + kBufRows);
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t b = 0; b < nb; ++b)
          _mm512_storeu_si512((void*)(buf.data() + (n - n0) * K + b * kBlock),
                              (__m512i)BlockSrc<B>::load(wp + n * row_bytes + b * B::bytes));
      chunk_dot_bf16<BufSrc>(xb.data(), M, K, (const uint8_t*)buf.data(), K * 2, n0, n1, op, N, kWideTileBf16);
    }
  });
  return out;
}
#endif

#if defined(RAGSERVE_AMX)
// bf16 activations on AMX tiles (Sapphire Rapids and later): out[M, N] = bf16(x)[M, K] @ bf16(W)[N, K]^T, fp32
// accumulation. Why: a pass over q rows with fp32 FMAs grows with q on this path (arithmetic), while
// one TDPBF16PS multiplies a 16 x 32 tile of weights into 16 rows of x at once, so up to 96 rows cost what decoding
// the weights costs -- the same as one row. Exactness: each output element is its own chain of pair products summed
// in fp32 in the tile unit's fixed order over K; no other row of x takes part, so a row gets the same bits in a 1-row
// step and in any batch or tree (lossless speculation within this format). The values differ from the fp32-activation
// kernel's: x and the decoded weights are rounded to bf16 (round to nearest even).
//
// Tiles: tmm0 = 16 weight rows x one 32-element block (decoded to bf16 per pass), tmm1 = x's block for 16 rows in
// the pair-interleaved (VNNI) layout the unit takes, tmm2..tmm7 = C: even / odd blocks for up to 3 groups of 16
// rows of x.
constexpr int kAmxRows = 16;     // weight rows per A tile, rows of x per B / C tile
// Two C tiles per group of 16 rows of x, one for the even blocks of K and one for the odd, added at the end: a tile
// multiply-add waits for the previous one on its C tile, so two chains halve that dependency (at 1 row the decode
// bounds a pass instead, and this changes nothing there). The split is the same for every pass size, so rows
// stay bit-identical.
constexpr int kAmxGroups = 3;    // rows of x per pass over the weights = 48
constexpr int64_t kAmxTileBytes = 1024;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Linux hands out the 8 KB tile state only to processes that ask (once per process).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// cols: rows of x per B / C tile (A, the weights, is always 16 x 64 bytes). Passes of fewer than 16 rows configure
// that many columns: the unit then loads and multiplies only them, where 16 would multiply zero padding, which makes
// passes of a few rows faster (bench.step). Bits: a column of C is one row of x's own chain of products, so its width
// changes none.
void amx_configure(int cols) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = t == 0 ? 64 : 4 * cols;
  }
  _tile_loadconfig(&cfg);
}

// One block's 32 weights as bf16 into dst: the AVX512-BF16 path's decode (Q4_1 by table), so the same values.
template <class B>
inline void decode_bf16(const uint8_t* blk, uint16_t* dst) {
  _mm512_store_si512((__m512i*)dst, (__m512i)decode_block_bf16<B>(blk));
}

// The AMX group layout of a block weight (amx_layout): per group of 16 weight rows and block b, the 16 rows' blocks
// contiguous and reordered for decoding 16 rows at once. Why: decoding, not the tiles, bounds a pass of a few rows,
// and the GGUF layout decodes a Q4_1 row's block with ~15 vector instructions, 9-10 of them on the one port that also
// permutes (broadcasts of d and m from a register, the nibble unpack and widening, the table look-up). Here the 16
// rows' scales are converted at once and broadcast from memory (load ports). The values are the GGUF path's (the same
// fma / product and rounding), so a pass gives its bits, faster than from the GGUF layout at every pass size
// (bench.step).
//   Q4_1, 320 bytes: the rows' (d, m) fp16 pairs (64 bytes), then each row's 16 bytes of codes, reordered so that one
//   variable shift per 16-bit word and a mask put code w in word w (byte 2p = code p | code 8 + p << 4, byte 2p + 1 =
//   code 16 + p | code 24 + p << 4: word p of the 128-bit lane L holds code 8 L + p at bit 4 L); two rows share one
//   conversion of their 16-value tables: 6 instructions a row.
//   Q8_0, 544 bytes: the rows' d (32 bytes), then each row's 32 codes.
template <class B>
struct GroupLayout;
template <>
struct GroupLayout<Q41> {
  static constexpr int64_t bytes = kAmxRows * Q41::bytes;
  static void pack(const uint8_t* blk, int64_t n, uint8_t* dst) {
    std::memcpy(dst + 4 * n, blk, 4);
    uint8_t code[kBlock];
    for (int j = 0; j < 16; ++j) code[j] = blk[4 + j] & 0x0f, code[16 + j] = blk[4 + j] >> 4;
    uint8_t* codes = dst + 4 * kAmxRows + 16 * n;
    for (int p = 0; p < 8; ++p) {
      codes[2 * p] = (uint8_t)(code[p] | code[8 + p] << 4);
      codes[2 * p + 1] = (uint8_t)(code[16 + p] | code[24 + p] << 4);
    }
  }
  // Block b of a group's 16 rows (gb: its bytes) -> dst [16][32] bf16.
  static inline void decode(const uint8_t* gb, uint16_t* dst) {
    alignas(64) float dm[2 * kAmxRows];  // d0 m0 d1 m1 ...
    const __m512i h = _mm512_loadu_si512((const void*)gb);
    _mm512_store_ps(dm, _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    _mm512_store_ps(dm + kAmxRows, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    asm volatile("" ::: "memory");  // else GCC broadcasts d and m by permutes of these registers, on the busy port
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shifts = _mm512_set_epi64(0x000c000c000c000cLL, 0x000c000c000c000cLL, 0x0008000800080008LL,
                                            0x0008000800080008LL, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0);
    const __m512i low4 = _mm512_set1_epi16(0x000f), second = _mm512_set1_epi16(0x0010);
    const uint8_t* codes = gb + 4 * kAmxRows;
    for (int n = 0; n < kAmxRows; n += 2) {
      const __m512 v0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * n]), _mm512_set1_ps(dm[2 * n + 1]));
      const __m512 v1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * n + 2]), _mm512_set1_ps(dm[2 * n + 3]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // words 0..15: row n's values, 16..31: n + 1's
      const __m512i c0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(codes + 16 * n)));
      const __m512i c1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(codes + 16 * n + 16)));
      const __m512i i0 = _mm512_and_si512(_mm512_srlv_epi16(c0, shifts), low4);
      const __m512i i1 = _mm512_ternarylogic_epi32(_mm512_srlv_epi16(c1, shifts), low4, second, 0xEA);  // a & b | c
      _mm512_store_si512((__m512i*)(dst + n * kBlock), _mm512_permutexvar_epi16(i0, table));
      _mm512_store_si512((__m512i*)(dst + (n + 1) * kBlock), _mm512_permutexvar_epi16(i1, table));
    }
  }
};
template <>
struct GroupLayout<Q80> {
  static constexpr int64_t bytes = kAmxRows * Q80::bytes;
  static void pack(const uint8_t* blk, int64_t n, uint8_t* dst) {
    std::memcpy(dst + 2 * n, blk, 2);
    std::memcpy(dst + 2 * kAmxRows + kBlock * n, blk + 2, kBlock);
  }
  static inline void decode(const uint8_t* gb, uint16_t* dst) {
    alignas(64) float d[kAmxRows];
    _mm512_store_ps(d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)gb)));
    asm volatile("" ::: "memory");  // broadcast from memory, as above
    const uint8_t* codes = gb + 2 * kAmxRows;
    for (int n = 0; n < kAmxRows; ++n) {
      const __m512 dn = _mm512_set1_ps(d[n]);
      const int8_t* q = (const int8_t*)(codes + kBlock * n);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q))), dn);
      const __m512 w1 =
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)))), dn);
      _mm512_store_si512((__m512i*)(dst + n * kBlock), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
};

template <class B>
torch::Tensor amx_layout(const torch::Tensor& w, int64_t K) {
  const int64_t N = w.size(0), nb = K / kBlock, groups = (N + kAmxRows - 1) / kAmxRows;
  torch::Tensor out = torch::zeros({groups * nb, GroupLayout<B>::bytes}, torch::kUInt8);  // rows past N: zero
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t n = 0; n < kAmxRows && g * kAmxRows + n < N; ++n)
          GroupLayout<B>::pack(wp + (g * kAmxRows + n) * w.size(1) + b * B::bytes, n,
                               op + (g * nb + b) * GroupLayout<B>::bytes);
  });
  return out;
}

// Where linear_rows_amx gets a group's decoded block: GGUF rows (any block format) or the group layout.
template <class B>
struct GgufRows {
  const uint8_t* wp;
  int64_t row_bytes;
  void operator()(int64_t n0, int64_t nr, int64_t b, uint16_t* dst) const {
    for (int64_t n = 0; n < nr; ++n) {
      const uint8_t* blk = wp + (n0 + n) * row_bytes + b * B::bytes;
      // The next group's rows, block by block as this group reads them (the fp32 path's rows-ahead scheme).
      _mm_prefetch((const char*)(blk + kAmxRows * row_bytes), _MM_HINT_T1);
      decode_bf16<B>(blk, dst + n * kBlock);
    }
  }
};

template <class B>
struct Groups {
  const uint8_t* wp;
  int64_t nb;
  void operator()(int64_t n0, int64_t, int64_t b, uint16_t* dst) const {
    constexpr int64_t bytes = GroupLayout<B>::bytes;
    const uint8_t* gb = wp + (n0 / kAmxRows * nb + b) * bytes;
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(gb + 2 * bytes + l), _MM_HINT_T0);
    GroupLayout<B>::decode(gb, dst);
  }
};

// r[0..15] as the rows of a 16 x 16 matrix of 32-bit elements -> its columns, in place: unpacks of 32- then 64-bit
// pairs leave a 4 x 4 block transposed in each 128-bit lane, then two lane shuffles move the blocks.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int k = 0; k < 16; k += 2) {
    t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
  }
  __m512i u[16];  // u[4 k + c], lane L: column 4 L + c of rows 4 k .. 4 k + 3
  for (int k = 0; k < 16; k += 4) {
    u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
    u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
    u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
    u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                  v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// x [M, K] fp32 -> bf16 B tiles: [nb][groups][16 pairs][16 rows][2], rows past M zero. A group's block is one 16 x 16
// transpose of its rows' bf16 pairs. Why (with amx_write): element by element, packing x and writing out cost more
// per row of a pass than the tiles' arithmetic; transposed, passes of many rows cost clearly less (bench.step).
std::vector<uint32_t> amx_pack_x(const float* x, int64_t M, int64_t K, int64_t groups) {
  const int64_t nb = K / kBlock;
  std::vector<uint32_t> out(nb * groups * kAmxRows * kAmxRows);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t mr = std::min<int64_t>(kAmxRows, M - g * kAmxRows);
    for (int64_t b = 0; b < nb; ++b) {
      __m512i r[kAmxRows];
      for (int64_t c = 0; c < kAmxRows; ++c) {
        const float* xb = x + (g * kAmxRows + c) * K + b * kBlock;
        r[c] = c < mr ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xb + 16), _mm512_loadu_ps(xb))
                      : _mm512_setzero_si512();
      }
      transpose16(r);
      uint32_t* tile = out.data() + (b * groups + g) * kAmxRows * kAmxRows;
      for (int p = 0; p < kBlock / 2; ++p) _mm512_storeu_si512((__m512i*)(tile + p * kAmxRows), r[p]);
    }
  }
  return out;
}

// out rows m0 .. m0 + mr - 1, columns n0 .. n0 + nr - 1 <- c0 + c1, tiles of [weight row n][row of x m]. The sum is
// the scalar c0 + c1 in either branch; past a few rows one transpose beats 16 strided reads per row.
inline void amx_write(const float* c0, const float* c1, int64_t mr, int64_t nr, float* op, int64_t N) {
  if (mr < 4) {
    for (int64_t m = 0; m < mr; ++m)
      for (int64_t n = 0; n < nr; ++n) op[m * N + n] = c0[n * kAmxRows + m] + c1[n * kAmxRows + m];
    return;
  }
  __m512i r[kAmxRows];
  for (int n = 0; n < kAmxRows; ++n)
    r[n] = (__m512i)_mm512_add_ps(_mm512_load_ps(c0 + n * kAmxRows), _mm512_load_ps(c1 + n * kAmxRows));
  transpose16(r);
  const __mmask16 keep = (__mmask16)((1u << nr) - 1);
  for (int64_t m = 0; m < mr; ++m) _mm512_mask_storeu_ps(op + m * N, keep, (__m512)r[m]);
}

// C tile 2 + j (j = 2 * group + block parity) += tmm0 x tmm1; tile registers are immediates.
inline void amx_dp(int j) {
  switch (j) {
    case 0: _tile_dpbf16ps(2, 0, 1); break;
    case 1: _tile_dpbf16ps(3, 0, 1); break;
    case 2: _tile_dpbf16ps(4, 0, 1); break;
    case 3: _tile_dpbf16ps(5, 0, 1); break;
    case 4: _tile_dpbf16ps(6, 0, 1); break;
    default: _tile_dpbf16ps(7, 0, 1); break;
  }
}

inline void amx_store(int j, float* c) {
  switch (j) {
    case 0: _tile_stored(2, c, 64); break;
    case 1: _tile_stored(3, c, 64); break;
    case 2: _tile_stored(4, c, 64); break;
    case 3: _tile_stored(5, c, 64); break;
    case 4: _tile_stored(6, c, 64); break;
    default: _tile_stored(7, c, 64); break;
  }
}

// decode(n0, nr, b, dst): weight rows n0 .. n0 + nr - 1, block b -> dst [16][32] bf16 (GgufRows, Groups).
template <class Decode>
torch::Tensor linear_rows_amx(const torch::Tensor& x, const Decode& decode_rows, int64_t N) {
  TORCH_CHECK(amx_permitted(), "AMX tiles are not available to this process");
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const int64_t groups = (M + kAmxRows - 1) / kAmxRows;
  const std::vector<uint32_t> xt = amx_pack_x(x.data_ptr<float>(), M, K, groups);
  auto out = torch::empty({M, N}, x.options());
  float* op = out.data_ptr<float>();
  const int64_t ngroups = (N + kAmxRows - 1) / kAmxRows;
  claimed_range(0, ngroups, 1, [&](int64_t a, int64_t z) {
    amx_configure(groups == 1 ? (int)M : kAmxRows);  // tile configuration is per thread (and released per piece)
    // Two A buffers: block b + 1 is decoded while block b's tile multiplies, so a tile load does not wait for the
    // stores that just wrote its buffer (no change at 1 row, where the decode bounds the pass; harmless).
    alignas(64) uint16_t wt[2][kAmxRows * kBlock];
    alignas(64) float c[2][kAmxRows * kAmxRows];
    for (int64_t ng = a; ng < z; ++ng) {
      const int64_t n0 = ng * kAmxRows, nr = std::min<int64_t>(kAmxRows, N - n0);
      if (nr < kAmxRows) std::memset(wt, 0, sizeof(wt));
      auto decode = [&](int64_t b, uint16_t* dst) { decode_rows(n0, nr, b, dst); };
      for (int64_t g0 = 0; g0 < groups; g0 += kAmxGroups) {
        const int cnt = (int)std::min<int64_t>(kAmxGroups, groups - g0);
        _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
        decode(0, wt[0]);
        for (int64_t b = 0; b < nb; ++b) {
          _tile_loadd(0, wt[b & 1], 64);
          const uint32_t* xb = xt.data() + (b * groups + g0) * kAmxRows * kAmxRows;
          for (int j = 0; j < cnt; ++j) {
            _tile_loadd(1, xb + j * kAmxRows * kAmxRows, 64);
            amx_dp(2 * j + (int)(b & 1));
          }
          if (b + 1 < nb) decode(b + 1, wt[(b + 1) & 1]);
        }
        for (int j = 0; j < cnt; ++j) {
          amx_store(2 * j, c[0]);  // c[.][n][m]: weight row n0 + n, row of x (g0 + j) * 16 + m
          amx_store(2 * j + 1, c[1]);
          const int64_t m0 = (g0 + j) * kAmxRows;
          amx_write(c[0], c[1], std::min<int64_t>(kAmxRows, M - m0), nr, op + m0 * N + n0, N);
        }
      }
    }
    _tile_release();
  });
  return out;
}
#endif

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

std::string bf16_kernel() {
#if defined(RAGSERVE_AMX)
  if (amx_permitted()) return "amx";
#endif
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "";
#endif
}

bool bf16_available() { return !bf16_kernel().empty(); }

bool wide_bf16() { return bf16_kernel() == "avx512_bf16"; }

namespace {

template <class B>
torch::Tensor rows_for(const torch::Tensor& x, const uint8_t* wp, int64_t N, int64_t row_bytes, bool bf16) {
  if (!bf16) return linear_rows<B>(x, wp, N, row_bytes);
#if defined(RAGSERVE_AMX)
  if (amx_permitted()) return linear_rows_amx(x, GgufRows<B>{wp, row_bytes}, N);
#endif
#if defined(__AVX512BF16__)
  return linear_rows_bf16dp<B>(x, wp, N, row_bytes);
#else
  TORCH_CHECK(false, "bf16 activations need AMX tiles or AVX512-BF16, which these kernels were not built for");
#endif
}

}  // namespace

namespace {

// The first index of the maximum of x[0, n), a NaN counting as the largest (numpy's and torch's rule).
int64_t argmax_row(const float* x, int64_t n) {
  int64_t arg = 0, j = 1;
#if defined(__AVX512F__)
  if (n >= 32) {
    // Per lane the first maximum (strictly greater replaces), then the smallest index among the lanes holding the
    // overall maximum; a NaN anywhere sends the row to the scalar loop below, which returns the first one.
    __m512 best = _mm512_loadu_ps(x);
    __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = where;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= n; j += 16) {
      at = _mm512_add_epi32(at, step);
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_blend_ps(gt, best, v);
      where = _mm512_mask_blend_epi32(gt, where, at);
    }
    if (nan) {
      j = 1;
    } else {
      const float top = _mm512_reduce_max_ps(best);
      arg = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ), where);
    }
  }
#endif
  if (x[arg] != x[arg]) return arg;
  for (; j < n; ++j) {
    if (x[j] != x[j]) return j;
    if (x[j] > x[arg]) arg = j;
  }
  return arg;
}

}  // namespace

// The argmax of every row of logits [M, N] (float32, contiguous), vectorized. Why: the greedy
// pick of every verified row read each row once more from memory on the model thread (numpy: a noticeable share of a
// batched step).
constexpr int64_t kArgmaxGrain = 16;  // rows per thread at least

torch::Tensor argmax_rows(const torch::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be contiguous float32 [M, N] with N > 0");
  const int64_t M = logits.size(0), N = logits.size(1);
  auto out = torch::empty({M}, torch::kInt64);
  const float* x = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // A request's few rows on this thread: served with many clients, a parallel region for a request's few rows (which
  // then waits for a pool thread the busy cores may have descheduled) cost the model thread several times what this
  // thread alone takes (py-spy); only a big batch of rows is spread.
  claimed_range(0, M, kArgmaxGrain, [&](int64_t a, int64_t b) {
    for (int64_t m = a; m < b; ++m) op[m] = argmax_row(x + m * N, N);
  });
  return out;
}

// argmax_rows of several logits tensors in one call -> per tensor its rows' picks. Why: a batched pass's requests
// each took their picks with tensor ops that release the GIL, and the model thread then waited to get it back
// from the gRPC threads (served with many clients, even a no-op .float() before the kernel showed in a profile).
// The pass's rows are spread over the threads once there are kArgmaxBatch of them (a batch's rows, not a request's
// few: see argmax_rows): the head wrote them from both cores, so one thread reading them all waited on the other's
// cache (a batch's rows are read faster on two threads than on one).
constexpr int64_t kArgmaxBatch = 8;
std::vector<std::vector<int64_t>> argmax_each(const std::vector<torch::Tensor>& logits) {
  std::vector<std::vector<int64_t>> out(logits.size());
  struct Row {
    const float* x;
    int64_t n;
    int64_t* pick;
  };
  std::vector<Row> rows;
  for (size_t i = 0; i < logits.size(); ++i) {
    const torch::Tensor& t = logits[i];
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous() && t.size(1) > 0,
                "logits ", i, " must be contiguous float32 [M, N] with N > 0");
    const int64_t M = t.size(0), N = t.size(1);
    out[i].resize(M);  // out itself is never resized: the picks' addresses stay valid
    for (int64_t m = 0; m < M; ++m) rows.push_back({t.data_ptr<float>() + m * N, N, out[i].data() + m});
  }
  const int64_t n = (int64_t)rows.size();
  auto pick = [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) *rows[r].pick = argmax_row(rows[r].x, rows[r].n);
  };
  if (n >= kArgmaxBatch)
    claimed_range(0, n, kArgmaxBatch / 2, pick);
  else
    pick(0, n);
  return out;
}

torch::Tensor block_linear(const torch::Tensor& x, const torch::Tensor& w, bool bf16, const torch::Tensor& wide,
                           int64_t wide_from) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) % kBlock == 0,
              "x must be contiguous float32 [M, K], K a multiple of 32, got ", x.sizes());
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "weight must be a contiguous matrix");
  const int64_t K = x.size(1), nb = K / kBlock;
  if (w.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(w.size(1) == K, "fp32 weight has ", w.size(1), " inputs, x ", K);
    return rows_for<F32>(x, (const uint8_t*)w.data_ptr<float>(), w.size(0), K * 4, bf16);
  }
#if defined(__AVX512BF16__)
  if (wide.defined() && bf16 && wide_bf16()) {  // checked whatever the rows: a wrong copy fails on every pass
    TORCH_CHECK(wide.scalar_type() == torch::kBFloat16 && wide.dim() == 2 && wide.is_contiguous() &&
                    wide.size(0) == w.size(0) && wide.size(1) == K,
                "wide must be contiguous bf16 [", w.size(0), ", ", K, "]");
    if (x.size(0) >= wide_from) return linear_dense_bf16dp(x, wide);
  }
#endif
  TORCH_CHECK(w.scalar_type() == torch::kUInt8, "weight must be float32 or GGUF blocks (uint8)");
#if defined(RAGSERVE_AMX)
  if (wide.defined() && bf16 && amx_permitted()) {
    const bool q41 = w.size(1) == nb * Q41::bytes;
    TORCH_CHECK((q41 || w.size(1) == nb * Q80::bytes) && wide.scalar_type() == torch::kUInt8 && wide.dim() == 2 &&
                    wide.is_contiguous() && wide.size(0) == (w.size(0) + kAmxRows - 1) / kAmxRows * nb &&
                    wide.size(1) == (q41 ? GroupLayout<Q41>::bytes : GroupLayout<Q80>::bytes),
                "wide must be this weight's AMX group layout (amx_layout)");
    if (q41) return linear_rows_amx(x, Groups<Q41>{wide.data_ptr<uint8_t>(), nb}, w.size(0));
    return linear_rows_amx(x, Groups<Q80>{wide.data_ptr<uint8_t>(), nb}, w.size(0));
  }
#endif
  if (w.size(1) == nb * Q41::bytes) return rows_for<Q41>(x, w.data_ptr<uint8_t>(), w.size(0), w.size(1), bf16);
  if (w.size(1) == nb * Q80::bytes) return rows_for<Q80>(x, w.data_ptr<uint8_t>(), w.size(0), w.size(1), bf16);
  TORCH_CHECK(false, "a packed row of ", w.size(1), " bytes is neither Q4_1 nor Q8_0 for K = ", K);
}

namespace {

// f(Q41{}) or f(Q80{}) by the size of w's rows, w checked to be contiguous GGUF blocks of K inputs.
template <class F>
torch::Tensor by_block_kind(const torch::Tensor& w, int64_t K, F f) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && K % kBlock == 0,
              "w must be contiguous GGUF blocks [N, K / 32 * block bytes]");
  if (w.size(1) == K / kBlock * Q41::bytes) return f(Q41{});
  TORCH_CHECK(w.size(1) == K / kBlock * Q80::bytes, "a packed row of ", w.size(1), " bytes is neither Q4_1 nor Q8_0");
  return f(Q80{});
}

}  // namespace

// Registers LeanForward (lean_forward.cpp) in the module.
void bind_lean_forward(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_1_linear", &linear<Q41>, "x[M, K] float32 @ Q4_1 weight[N, K]^T -> [M, N]");
  m.def("q8_0_linear", &linear<Q80>, "x[M, K] float32 @ Q8_0 weight[N, K]^T -> [M, N]");
  m.def("f32_linear", [](const torch::Tensor& x, const torch::Tensor& w) { return block_linear(x, w, false); },
        "x[M, K] float32 @ float32 weight[N, K]^T -> [M, N] (the block kernel's tiling)");
  m.def("block_linear",
        [](const torch::Tensor& x, const torch::Tensor& w, bool bf16, const std::optional<torch::Tensor>& wide,
           int64_t wide_from) { return block_linear(x, w, bf16, wide ? *wide : torch::Tensor(), wide_from); },
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bf16") = false, pybind11::arg("wide") = pybind11::none(),
        pybind11::arg("wide_from") = kWideFromRows,
        "x[M, K] float32 @ W^T, W dense float32 or Q4_1 / Q8_0 blocks; bf16: bf16 activations (AMX or AVX512-BF16); "
        "wide: W prepared for this CPU's bf16 path: decoded to bf16 (decode_bf16), used by passes of at least "
        "wide_from rows where wide_bf16() (the same bits either way); or W in the AMX group layout (amx_layout), used "
        "by every pass where bf16() is 'amx'");
  m.def("wide_bf16", &wide_bf16, "whether bf16-activation linears here take decoded bf16 weights (block_linear's "
        "wide): AVX512-BF16 dot products, not AMX tiles");
  m.def("bf16", &bf16_kernel, "what runs bf16-activation linears here: 'amx' (built for AMX and granted the tile "
        "state), 'avx512_bf16' (built for AVX512-BF16), or '' (neither: the q4_1_bf16 format is not offered)");
  m.def("set_claimed_loops", &set_claimed_loops, "True (the default): the kernels' loops run as pieces claimed by "
        "whichever thread is free (claim_pool.cpp); False: one fixed range per OpenMP thread (at::parallel_for)");
  m.def("argmax_rows", &argmax_rows, "the first maximum of each row of contiguous float32 logits [M, N] (a NaN wins, "
        "the first one) -> int64 [M]");
  m.def("argmax_each", &argmax_each, "argmax_rows of each of several contiguous float32 logits [M_i, N_i] -> per "
        "tensor a list of M_i ints (on the calling thread, the GIL held)");
  m.def("decode_bf16", [](const torch::Tensor& w, int64_t K) {
#if defined(__AVX512BF16__)
    return by_block_kind(w, K, [&](auto kind) {
      return decode_rows_bf16<decltype(kind)>(w.data_ptr<uint8_t>(), w.size(0), w.size(1), K);
    });
#else
    TORCH_CHECK(false, "decode_bf16 needs the AVX512-BF16 build");
    return torch::Tensor();
#endif
  }, pybind11::arg("w"), pybind11::arg("in_features"),
        "Q4_1 / Q8_0 weight -> bf16 [N, in_features]: the values the bf16-activation linears multiply (block_linear's "
        "wide)");
  m.def("amx_layout", [](const torch::Tensor& w, int64_t K) {
#if defined(RAGSERVE_AMX)
    return by_block_kind(w, K, [&](auto kind) { return amx_layout<decltype(kind)>(w, K); });
#else
    TORCH_CHECK(false, "amx_layout needs the AMX build");
    return torch::Tensor();
#endif
  }, pybind11::arg("w"), pybind11::arg("in_features"),
        "Q4_1 / Q8_0 weight -> its AMX group layout (uint8 [ceil(N / 16) * K / 32, 16 * block bytes]): what "
        "block_linear's wide takes where bf16() is 'amx'; the same values, decoded with fewer instructions");
  m.def("q4_1_dequantize", &dequantize<Q41>, "Q4_1 weight -> float32 [N, K]");
  m.def("q8_0_dequantize", &dequantize<Q80>, "Q8_0 weight -> float32 [N, K]");
  m.def("i8_layout", &i8_layout, pybind11::arg("w"), pybind11::arg("in_features"),
        "Q4_1 / Q8_0 weight [N, in_features / 32 * block bytes] -> the int8-activation kernel's layout (uint8 "
        "[ceil(N / 16), in_features / 32 * 320 or 544]): 16 columns per group, the same values");
  m.def("i8_linear", &i8_linear, pybind11::arg("x"), pybind11::arg("layout"), pybind11::arg("out_features"),
        "x[M, K] float32 @ W^T with int8 activations (per row, per block of 32), W as i8_layout -> [M, N]");
  m.def("i8_quantize", &i8_quantize, pybind11::arg("x"),
        "x[M, K] float32 -> (int8 codes [M, K], block scales [M, K / 32], scale * code sum [M, K / 32])");
  m.def("i8_path", &i8_path, "the path of the int8-activation linears: avx512_vnni, avx_vnni, avx2 or scalar");
  m.def("i8_paths", &i8_paths, "the int8-activation paths this CPU runs, best first");
  m.def("set_i8_path", &set_i8_path, pybind11::arg("name"),
        "run the int8-activation linears on this path ('' = the best here); every path gives the same bits");
  m.def("i8_groups", &i8_groups, "most groups of 16 columns an AVX512-VNNI tile of 1-4 rows takes at once");
  m.def("set_i8_groups", &set_i8_groups, pybind11::arg("n"),
        "1, 2 or 4: most groups an AVX512-VNNI tile of 1-4 rows takes at once (the same bits whichever)");
  bind_lean_forward(m);
  m.def("isa", []() {
#if defined(RAGSERVE_AMX)
    return std::string("avx512+amx");
#elif defined(__AVX512BF16__)
    return std::string("avx512+bf16");
#elif defined(__AVX512F__)
    return std::string("avx512");
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return std::string("avx2");
#else
    return std::string("scalar");
#endif
  });
}
