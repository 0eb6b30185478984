// The whole Llama decoder pass in one call: what lean_llama.py's forward_batch computes, without ~40 Python-level
// tensor ops per layer.
//
// Why: at one to a few dozen rows per pass a 135M-parameter step is dominated by per-op overhead, not arithmetic
// (from Python, the linears are the smaller part of a q4_1 step; the rest is dispatch of small ops and Python;
// bench.step). Here each layer is five block_linear calls plus loops over the rows for the norms, RoPE, the KV write,
// attention and SiLU; nothing is allocated per op except the linears' outputs.
//
// Math, per row, as lean_llama.py (and transformers' LlamaForCausalLM) does it in fp32:
//   rms(x) = w * (x * 1 / sqrt(mean(x^2) + eps));  rope(t) = t * cos + rotate_half(t) * sin
//   attention: query head h reads kv head h / G; scores * scale + mask (additive; none = causal over the new rows),
//   softmax in fp32; out = probs @ values;  mlp = down(silu(gate) * up).
// Every row, decode or prompt, attends in the per-row vector kernel (AVX-512 or AVX2) where it is built, so a row's
// result does not depend on the pass it is in: a prompt prefilled in pieces of any size gets the same bits as one
// prefilled in whole chunks. Without it (scalar builds) decode rows and short prompt chunks take scalar loops,
// longer prompt chunks ATen's matmul (blocked GEMM), as the Python path does. exp (softmax, SiLU) is a polynomial
// here, so its values differ from torch's in the last bits.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

// Attention of a segment runs in the loops below when q * S * heads is at most this (else ATen's matmul).
constexpr int64_t kLoopAttentionWork = 1 << 12;

template <typename KV>
inline float dot(const float* a, const KV* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[i + l] * (float)b[i + l];
  for (int w = 8; w >= 1; w /= 2)  // pairwise halving: vectorizes, unlike a scalar chain of 16 adds
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  float s = acc[0];
  for (; i < n; ++i) s += a[i] * (float)b[i];
  return s;
}

// exp over an array, in a form the compiler vectorizes (std::exp stays a scalar call): x = n ln2 + r with
// |r| <= ln2 / 2 (Cody-Waite split of ln2), exp(r) by its Taylor series to r^8 (relative error < 1e-8, below
// float's 6e-8), times 2^n built in the exponent bits. Inputs below -87 (masked positions) give 0.
void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::max(x[i], -87.0f);
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = (v - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 40320;
    p = p * r + 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[i] = x[i] < -87.0f ? 0.0f : p * scale;
  }
}

// The per-row attention kernel (attend_row) over one of two vector widths, behind the same few operations: 16 lanes
// with AVX-512, 8 with AVX2 + FMA. Within one build every row takes the same instructions, which is all the
// pass-invariance below needs; the two widths round differently from each other.
// What both widths declare alike: the vector type VT of LANES floats, the accumulator registers weighted_values
// keeps (ACC), and the lane-wise operations (_mm512_add_ps, _mm256_add_ps, ...).
#define RAGSERVE_SIMD_LANEWISE(P, VT, LANES, ACC)                 \
  using V = VT;                                                   \
  static constexpr int kLanes = LANES;                            \
  static constexpr int kAccumulators = ACC;                       \
  static V zero() { return P##_setzero_ps(); }                    \
  static V set1(float x) { return P##_set1_ps(x); }               \
  static V load(const float* p) { return P##_loadu_ps(p); }       \
  static void store(float* p, V v) { P##_storeu_ps(p, v); }       \
  static V add(V a, V b) { return P##_add_ps(a, b); }             \
  static V sub(V a, V b) { return P##_sub_ps(a, b); }             \
  static V mul(V a, V b) { return P##_mul_ps(a, b); }             \
  static V div(V a, V b) { return P##_div_ps(a, b); }             \
  static V fmadd(V a, V b, V c) { return P##_fmadd_ps(a, b, c); } \
  static V max(V a, V b) { return P##_max_ps(a, b); }             \
  static V min(V a, V b) { return P##_min_ps(a, b); }

#if defined(__AVX512F__)
#define RAGSERVE_ROW_KERNEL 1
struct Simd {
  RAGSERVE_SIMD_LANEWISE(_mm512, __m512, 16, 16)  // 16 accumulators of 32 registers
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  // The first m lanes (m >= kLanes: all) of p; the others read as 0 and are not written.
  static V load_first(const float* p, int64_t m) { return _mm512_maskz_loadu_ps(mask(m), p); }
  static void store_first(float* p, V v, int64_t m) { _mm512_mask_storeu_ps(p, mask(m), v); }
  static V max_first(V acc, V v, int64_t m) { return _mm512_mask_max_ps(acc, mask(m), acc, v); }
  static V keep_first(V v, int64_t m) { return _mm512_maskz_mov_ps(mask(m), v); }
  // out lane i = the sum of v[i]'s 16 lanes, by the same tree of adds for every i (lanes l and l + 2 first, then
  // the pairs, then the four 128-bit groups), so a dot product's bits do not depend on which slot it took.
  static V transpose_sum(const V* v) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit group: [v2i(0+2), v2i+1(0+2), v2i(1+3), v2i+1(1+3)]
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  // per 128-bit group: the group's partial sums of v4i .. v4i+3
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xdd));
  }
  static V floor(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V k) {  // 2^k for integral k in float range, built in the exponent bits
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V e, V x, float lo) {  // e, 0 where x < lo
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_LT_OQ), e, _mm512_setzero_ps());
  }

 private:
  static __mmask16 mask(int64_t m) { return m >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << m) - 1); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define RAGSERVE_ROW_KERNEL 1
struct Simd {
  RAGSERVE_SIMD_LANEWISE(_mm256, __m256, 8, 8)  // 8 accumulators of 16 registers
  static V load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }  // F16C
  static float reduce_max(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static float reduce_add(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static V load_first(const float* p, int64_t m) { return _mm256_maskload_ps(p, mask(m)); }
  static void store_first(float* p, V v, int64_t m) { _mm256_maskstore_ps(p, mask(m), v); }
  static V max_first(V acc, V v, int64_t m) {
    return _mm256_blendv_ps(acc, _mm256_max_ps(acc, v), _mm256_castsi256_ps(mask(m)));
  }
  static V keep_first(V v, int64_t m) { return _mm256_and_ps(v, _mm256_castsi256_ps(mask(m))); }
  // out lane i = the sum of v[i]'s 8 lanes by one tree of adds for every i: adjacent pairs, then pairs of pairs
  // (hadd), then the two 128-bit halves.
  static V transpose_sum(const V* v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  static V floor(V x) { return _mm256_floor_ps(x); }
  static V pow2(V k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V e, V x, float lo) {
    return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_LT_OQ));
  }

 private:
  static __m256i mask(int64_t m) {  // lanes < m all ones
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(m, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
};
#endif

#if defined(RAGSERVE_ROW_KERNEL)
using V = Simd::V;
constexpr int kLanes = Simd::kLanes;

// exp_inplace's polynomial on a vector.
inline V exp_lanes(V x) {
  const V v = Simd::max(x, Simd::set1(-87.0f));
  const V k = Simd::floor(Simd::fmadd(v, Simd::set1(1.44269504088896341f), Simd::set1(0.5f)));
  const V r = Simd::sub(Simd::sub(v, Simd::mul(k, Simd::set1(0.693145751953125f))),
                        Simd::mul(k, Simd::set1(1.42860682030941723212e-6f)));
  V p = Simd::set1(1.0f / 40320);
  const float c[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
  for (float ci : c) p = Simd::fmadd(p, r, Simd::set1(ci));
  return Simd::zero_below(Simd::mul(p, Simd::pow2(k)), x, -87.0f);
}

// out = silu(g) * u = g / (1 + e^-g) * u over n values (the MLP's activation; std::exp would be a scalar call each).
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - j);
    const V gv = Simd::load_first(g + j, m);
    const V e = exp_lanes(Simd::min(Simd::sub(Simd::zero(), gv), Simd::set1(88.0f)));  // e^88 is still a float
    Simd::store_first(out + j, Simd::mul(Simd::div(gv, Simd::add(Simd::set1(1.0f), e)), Simd::load_first(u + j, m)), m);
  }
}

// Another job's cache rows, prefetched into L2 a slice at a time while this job computes. Why: between two layers'
// attention the linears stream ~90 MB of weights through the caches, so a pass's keys and values come from memory
// and a job that reads its rows only as it needs them waits on them; requesting the next job's rows during this one
// hides part of that wait (most of the attention's time went to it, with the weights streamed between layers as the
// linears do). Prefetches change no value.
struct Ahead {
  const char* p = nullptr;
  int64_t bytes = 0, done = 0;
  void upto(int64_t n) {
    for (const int64_t end = std::min(n, bytes); done < end; done += 64) _mm_prefetch(p + done, _MM_HINT_T1);
  }
};

// acc[g] = sum over t of w_g[t] * V[keys[t]] over the CW vectors of columns from c0, for GN query heads at once (each
// V row is read once for all of them): GN * CW independent accumulator chains, each adding the keys in list order.
template <int CW, int GN, typename KV>
inline void weighted_values(const float* p, int64_t n, const float* inv, const KV* vh, const int64_t* keys,
                            int64_t D, int64_t c0, float* out, Ahead& ahead) {
  V acc[GN][CW], w[GN];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < CW; ++j) acc[g][j] = Simd::zero();
  const int64_t row_bytes = D * (int64_t)sizeof(KV);
  for (int64_t t = 0; t < n; ++t) {
    ahead.upto((t + 1) * row_bytes);
    const KV* vt = vh + keys[t] * D + c0;
    for (int g = 0; g < GN; ++g) w[g] = Simd::mul(Simd::set1(p[g * n + t]), Simd::set1(inv[g]));
    for (int j = 0; j < CW; ++j) {
      const V v = Simd::load(vt + kLanes * j);
      for (int g = 0; g < GN; ++g) acc[g][j] = Simd::fmadd(w[g], v, acc[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < CW; ++j) Simd::store(out + g * D + c0 + kLanes * j, acc[g][j]);
}

// Query head qg's scores of a block of kLanes keys (key(i): key i's row as floats): lane i = q . k_i * scale. A
// lane's value depends on its own key alone (transpose_sum adds each lane's products by one tree), so a row's score
// of a key is the same bits whichever keys share its block and whichever function (attend_row, attend_rows) asks.
template <int DV, typename Key>
inline V block_scores(const float* qg, const Key& key, float scale) {
  V q[DV];
  for (int j = 0; j < DV; ++j) q[j] = Simd::load(qg + kLanes * j);
  V part[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    const float* kt = key(i);
    V acc = Simd::mul(q[0], Simd::load(kt));
    for (int j = 1; j < DV; ++j) acc = Simd::fmadd(q[j], Simd::load(kt + kLanes * j), acc);
    part[i] = acc;
  }
  return Simd::mul(Simd::transpose_sum(part), Simd::set1(scale));
}

// pg[0..n) = exp(pg - max), in place, given mx (lane-wise maxima of pg); -> 1 / their sum.
inline float exp_shifted(float* pg, int64_t n, V mx) {
  const V top = Simd::set1(Simd::reduce_max(mx));
  V sum = Simd::zero();
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - t0);
    const V e = exp_lanes(Simd::sub(Simd::load_first(pg + t0, m), top));
    Simd::store_first(pg + t0, e, m);
    sum = Simd::add(sum, Simd::keep_first(e, m));
  }
  return 1.0f / Simd::reduce_add(sum);
}

// One decode row's attention for one kv head and its G query heads, head size kLanes * DV, over the keys it sees.
// keys: the cache rows it attends, in position order (the whole past, then its ancestors-or-self among the new
// rows: entries a mask shuts out contribute nothing and are left out); add: their additive mask values (nullptr: 0).
// Why it is the same in every pass: a row's result depends only on its own key list, and that list is the same for
// a draft node as for the AR step that would decode the same token after the same accepted tokens (prefix, then
// the path in order); every sum below runs over the list's index, never over cache positions or other rows.
// p: scratch of G * n floats.
// kb: scratch of kLanes * D floats; next_k / next_v: the rows to prefetch meanwhile (the thread's next job).
template <int DV, typename KV>
void attend_row(const float* q0, int64_t G, const KV* kh, const KV* vh, const int64_t* keys,
                const float* add, int64_t n, float scale, float* p, float* kb, float* out, Ahead& next_k,
                Ahead& next_v) {
  constexpr int64_t D = kLanes * DV;
  constexpr int CW = DV < Simd::kAccumulators ? DV : Simd::kAccumulators;  // column vectors per pass over V
  constexpr int kGroup = Simd::kAccumulators / CW;                         // query heads per pass over V
  constexpr bool kConvert = !std::is_same_v<KV, float>;
  const int64_t row_bytes = D * (int64_t)sizeof(KV);
  float inv[64];
  V mx[64];
  for (int64_t g = 0; g < G; ++g) mx[g] = Simd::set1(-std::numeric_limits<float>::infinity());
  // Block by block of kLanes keys, every query head. A float16 cache's keys are converted once per block into kb
  // for all G heads (the same values: the conversion is exact), not once per head: with the plan of the pass made
  // once (attention_plan) and the prefetch above, served passes of batches and of a lone tree got faster, with the
  // same logits bit for bit (bench.step).
  for (int64_t t0 = 0; t0 < n; t0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - t0);
    next_k.upto((t0 + kLanes) * row_bytes);
    // A full block without a branch per key; the last one pads with the list's first key and its lanes are dropped
    // below.
    if constexpr (kConvert) {
      for (int i = 0; i < kLanes; ++i) {
        const KV* kt = kh + keys[i < m ? t0 + i : 0] * D;
        for (int j = 0; j < DV; ++j) Simd::store(kb + i * D + kLanes * j, Simd::load(kt + kLanes * j));
      }
    }
    const auto key = [&](int i) -> const float* {
      if constexpr (kConvert) return kb + i * D;
      else return kh + keys[i < m ? t0 + i : 0] * D;
    };
    for (int64_t g = 0; g < G; ++g) {
      V sc = block_scores<DV>(q0 + g * D, key, scale);
      if (add != nullptr) sc = Simd::add(sc, Simd::load_first(add + t0, m));
      Simd::store_first(p + g * n + t0, sc, m);
      mx[g] = Simd::max_first(mx[g], sc, m);
    }
  }
  next_k.upto(next_k.bytes);
  for (int64_t g = 0; g < G; ++g) inv[g] = exp_shifted(p + g * n, n, mx[g]);
  for (int64_t g = 0; g < G; g += kGroup) {
    const float* pg = p + g * n;
    float* og = out + g * D;
    for (int64_t c0 = 0; c0 < D; c0 += kLanes * CW) {
      switch (std::min<int64_t>(kGroup, G - g)) {
        case 1: weighted_values<CW, 1>(pg, n, inv + g, vh, keys, D, c0, og, next_v); break;
        case 2: weighted_values<CW, (kGroup >= 2 ? 2 : 1)>(pg, n, inv + g, vh, keys, D, c0, og, next_v); break;
        case 3: weighted_values<CW, (kGroup >= 3 ? 3 : 1)>(pg, n, inv + g, vh, keys, D, c0, og, next_v); break;
        default: weighted_values<CW, kGroup>(pg, n, inv + g, vh, keys, D, c0, og, next_v); break;
      }
    }
  }
  next_v.upto(next_v.bytes);
}

// Rows of one sequence that attend their whole prefix (prompt rows; row r of the tile sees the first n0 + r cache
// rows) for one kv head, together: each block of keys and of values is read once for all of them instead of once per
// row. Why: deep in a long prompt a row's keys and values are megabytes, read from memory, and every row of a chunk
// read them again (the attention was most of a long prefill). Every row still gets exactly what attend_row computes
// for it alone: its scores come from block_scores over the same keys, its softmax from exp_shifted over its own n,
// and each of its output chains (one per query head and column vector) adds w[t] * V[t] for t = 0, 1, ... in order,
// with w[t] = p[t] * inv rounded as attend_row's is; the tile only interleaves independent chains.
constexpr int64_t kTileRows = 8;    // rows per tile
constexpr int64_t kTilePairs = 64;  // (row, query head) pairs per tile at most: the tile's maxima stay in registers
constexpr int64_t kValueBlock = 128;  // keys per block of values: all the tile's chains pass over it while it is in L1

// The tile's output chains of GN (row, query head) pairs over value rows [b0, b1), CW column vectors at a time:
// acc (stride D) holds the chains between blocks; pair g's weights are w[g * wn + t], and it adds keys t < n[g] only.
template <int CW, int GN, typename KV>
inline void block_values(const float* w, int64_t wn, const int64_t* n, const KV* vh, int64_t D, int64_t b0,
                         int64_t b1, float* acc) {
  const int64_t lo = std::min(b1, n[0]), hi = std::min(b1, n[GN - 1]);  // n ascends with the pair's row
  for (int64_t c0 = 0; c0 < D; c0 += kLanes * CW) {
    V a[GN][CW];
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < CW; ++j) a[g][j] = Simd::load(acc + g * D + c0 + kLanes * j);
    for (int64_t t = b0; t < lo; ++t) {
      const KV* vt = vh + t * D + c0;
      V v[CW];
      for (int j = 0; j < CW; ++j) v[j] = Simd::load(vt + kLanes * j);
      for (int g = 0; g < GN; ++g) {
        const V wg = Simd::set1(w[g * wn + t]);
        for (int j = 0; j < CW; ++j) a[g][j] = Simd::fmadd(wg, v[j], a[g][j]);
      }
    }
    for (int64_t t = std::max(b0, lo); t < hi; ++t) {  // the later rows' last keys
      const KV* vt = vh + t * D + c0;
      V v[CW];
      for (int j = 0; j < CW; ++j) v[j] = Simd::load(vt + kLanes * j);
      for (int g = 0; g < GN; ++g) {
        if (t >= n[g]) continue;
        const V wg = Simd::set1(w[g * wn + t]);
        for (int j = 0; j < CW; ++j) a[g][j] = Simd::fmadd(wg, v[j], a[g][j]);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int j = 0; j < CW; ++j) Simd::store(acc + g * D + c0 + kLanes * j, a[g][j]);
  }
}

// R rows (R * G <= kTilePairs) with queries at q0 + r * q_stride, outputs at out + r * out_stride; the kv head's
// cache rows kh, vh; row r attends keys 0 .. n0 + r - 1. p: scratch of R * G * (n0 + R - 1) floats; kb: of
// kLanes * D; acc: of R * G * D.
template <int DV, typename KV>
void attend_rows(const float* q0, int64_t q_stride, int64_t R, int64_t G, const KV* kh, const KV* vh, int64_t n0,
                 float scale, float* p, float* kb, float* acc, float* out, int64_t out_stride, Ahead& next_k,
                 Ahead& next_v) {
  constexpr int64_t D = kLanes * DV;
  constexpr bool kConvert = !std::is_same_v<KV, float>;
  // Chains per pass over a block of values: CW column vectors x kPairs pairs of accumulators, within the registers.
  constexpr int CW = kLanes == 16 ? 4 : 2;
  constexpr int kPairs = 6;
  const int64_t row_bytes = D * (int64_t)sizeof(KV);
  const int64_t P = R * G, wn = n0 + R - 1;  // pairs; the keys of the last row (p's stride)
  V mx[kTilePairs];
  for (int64_t a = 0; a < P; ++a) mx[a] = Simd::set1(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = 0; t0 < wn; t0 += kLanes) {
    const int64_t m_all = std::min<int64_t>(kLanes, wn - t0);
    next_k.upto((t0 + kLanes) * row_bytes);
    if constexpr (kConvert) {
      for (int i = 0; i < kLanes; ++i) {
        const KV* kt = kh + (i < m_all ? t0 + i : 0) * D;
        for (int j = 0; j < DV; ++j) Simd::store(kb + i * D + kLanes * j, Simd::load(kt + kLanes * j));
      }
    }
    const auto key = [&](int i) -> const float* {
      if constexpr (kConvert) return kb + i * D;
      else return kh + (i < m_all ? t0 + i : 0) * D;
    };
    for (int64_t r = 0; r < R; ++r) {
      if (t0 >= n0 + r) continue;  // the first rows' keys can end before the block
      const int64_t m = std::min<int64_t>(kLanes, n0 + r - t0);
      for (int64_t g = 0; g < G; ++g) {
        const V sc = block_scores<DV>(q0 + r * q_stride + g * D, key, scale);
        Simd::store_first(p + (r * G + g) * wn + t0, sc, m);
        mx[r * G + g] = Simd::max_first(mx[r * G + g], sc, m);
      }
    }
  }
  next_k.upto(next_k.bytes);
  int64_t n[kTilePairs];
  for (int64_t a = 0; a < P; ++a) {
    n[a] = n0 + a / G;
    float* pa = p + a * wn;
    const V inv = Simd::set1(exp_shifted(pa, n[a], mx[a]));
    for (int64_t t0 = 0; t0 < n[a]; t0 += kLanes) {  // the weights, as attend_row's p * inv
      const int64_t m = std::min<int64_t>(kLanes, n[a] - t0);
      Simd::store_first(pa + t0, Simd::mul(Simd::load_first(pa + t0, m), inv), m);
    }
  }
  std::fill(acc, acc + P * D, 0.0f);
  for (int64_t b0 = 0; b0 < wn; b0 += kValueBlock) {
    const int64_t b1 = std::min(wn, b0 + kValueBlock);
    next_v.upto(b1 * row_bytes);
    for (int64_t a = 0; a < P; a += kPairs) {
      const float* w = p + a * wn;
      float* ac = acc + a * D;
      switch (std::min<int64_t>(kPairs, P - a)) {
        case 1: block_values<CW, 1>(w, wn, n + a, vh, D, b0, b1, ac); break;
        case 2: block_values<CW, 2>(w, wn, n + a, vh, D, b0, b1, ac); break;
        case 3: block_values<CW, 3>(w, wn, n + a, vh, D, b0, b1, ac); break;
        case 4: block_values<CW, 4>(w, wn, n + a, vh, D, b0, b1, ac); break;
        case 5: block_values<CW, 5>(w, wn, n + a, vh, D, b0, b1, ac); break;
        default: block_values<CW, kPairs>(w, wn, n + a, vh, D, b0, b1, ac); break;
      }
    }
  }
  next_v.upto(next_v.bytes);
  for (int64_t a = 0; a < P; ++a) std::copy(acc + a * D, acc + (a + 1) * D, out + (a / G) * out_stride + (a % G) * D);
}
#else
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}
#endif

void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t H, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * H;
    const float ms = dot(xr, xr, H) / (float)H;
    const float inv = 1.0f / std::sqrt(ms + eps);
    float* o = out + r * H;
    for (int64_t j = 0; j < H; ++j) o[j] = w[j] * (xr[j] * inv);
  }
}

// In place on `heads` vectors of D at t (stride D), position p: t * cos + rotate_half(t) * sin.
void rope(float* t, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  float tmp[512];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = t + h * D;
    std::copy(v, v + D, tmp);
    for (int64_t j = 0; j < half; ++j) v[j] = tmp[j] * cos[j] + (-tmp[j + half]) * sin[j];
    for (int64_t j = half; j < D; ++j) v[j] = tmp[j] * cos[j] + tmp[j - half] * sin[j];
  }
}

struct Segment {
  int64_t start, q, past;
  torch::Tensor k, v;  // [layers, kv_heads, capacity, D], rows contiguous; float32, or float16 (half the reads)
  torch::Tensor mask;  // additive float32 [q, past + q], or undefined (causal over the new rows)
};

class LeanForward {
 public:
  LeanForward(torch::Tensor embed, std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> wqkv,
              std::vector<torch::Tensor> wo, std::vector<torch::Tensor> ln2, std::vector<torch::Tensor> wgu,
              std::vector<torch::Tensor> wd, torch::Tensor norm, torch::Tensor head, int64_t heads, int64_t kv_heads,
              int64_t head_dim, double eps, bool bf16, bool i8)
      : embed_(embed.contiguous()), ln1_(ln1), wqkv_(wqkv), wo_(wo), ln2_(ln2), wgu_(wgu), wd_(wd),
        norm_(norm.contiguous()), head_(head.contiguous()), H_(heads), Hkv_(kv_heads), D_(head_dim),
        eps_((float)eps), scale_(1.0f / std::sqrt((float)head_dim)), bf16_(bf16), i8_(i8) {
    TORCH_CHECK(!(bf16_ && i8_), "bf16 and int8 activations are two formats: one at a time");
    TORCH_CHECK(!bf16_ || bf16_available(), "bf16: bf16-activation linears (AMX or AVX512-BF16) are not available here");
    TORCH_CHECK(embed_.scalar_type() == torch::kFloat32 && embed_.dim() == 2, "embed must be float32 [V, hidden]");
    const size_t L = ln1.size();
    TORCH_CHECK(wqkv.size() == L && wo.size() == L && ln2.size() == L && wgu.size() == L && wd.size() == L,
                "every layer needs ln1, wqkv, wo, ln2, wgu, wd");
    TORCH_CHECK(H_ % Hkv_ == 0 && D_ <= 512 && D_ % 2 == 0, "unsupported head layout");
    hidden_ = embed_.size(1);
    for (size_t i = 0; i < L; ++i) {
      ln1_[i] = ln1_[i].contiguous();
      ln2_[i] = ln2_[i].contiguous();
    }
  }

  // The weights prepared for this CPU's bf16 linears, or with int8 activations every linear's i8_layout (the head's
  // included), in the order of the constructor's lists; for bf16, block_linear's wide:
  // decoded bf16 copies (decode_bf16) where wide_bf16(), which passes of at least wide_from rows read instead of decoding
  // every block; or the weights' AMX group layout (amx_layout) where bf16() is "amx", which every pass decodes (the
  // head may then be an empty tensor: it decodes its GGUF blocks). Empty lists drop them.
  void set_wide(std::vector<torch::Tensor> wqkv, std::vector<torch::Tensor> wo, std::vector<torch::Tensor> wgu,
                std::vector<torch::Tensor> wd, torch::Tensor head) {
    const size_t L = wqkv_.size();
    TORCH_CHECK((bf16_ && !bf16_kernel().empty()) || i8_ || wqkv.empty(),
                "prepared weights need a path of bf16 linears, or int8 activations");
    TORCH_CHECK(wqkv.empty() ? wo.empty() && wgu.empty() && wd.empty() && !i8_
                             : wqkv.size() == L && wo.size() == L && wgu.size() == L && wd.size() == L &&
                                   (head.numel() > 0 || !(wide_bf16() || i8_)),
                "prepared weights: one per linear of every layer, and the head where they are decoded copies");
    wide_qkv_ = wqkv, wide_o_ = wo, wide_gu_ = wgu, wide_d_ = wd;
    wide_head_ = wqkv.empty() || head.numel() == 0 ? torch::Tensor() : head;
  }

  // Passes of at least `rows` rows read the decoded copies of set_wide (where wide_bf16()), smaller ones decode the
  // blocks: the same bits either way, so this is only a matter of speed (the calibration measures it). Call between
  // passes, on the thread that runs them.
  void set_wide_from(int64_t rows) {
    TORCH_CHECK(rows >= 1, "wide_from must be at least 1 row, got ", rows);
    wide_from_ = rows;
  }

  // ids, positions: int64 [N]; cos, sin: float32 [P, D] tables (P > max position); per segment its row count, past
  // length, cache k/v and mask (an empty tensor for none) and logits rows (0 = all). -> (logits [sum q', V],
  // final normed hidden rows [sum q', hidden]).
  std::vector<torch::Tensor> forward(const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& cos,
                                     const torch::Tensor& sin, const std::vector<int64_t>& rows,
                                     const std::vector<int64_t>& past, const std::vector<torch::Tensor>& ks,
                                     const std::vector<torch::Tensor>& vs, const std::vector<torch::Tensor>& masks,
                                     const std::vector<int64_t>& logits_rows) {
    torch::NoGradGuard no_grad;
    const int64_t N = ids.size(0), Hd = hidden_, D = D_, H = H_, Hkv = Hkv_;
    const int64_t wq = (H + 2 * Hkv) * D;
    TORCH_CHECK(positions.size(0) == N && cos.scalar_type() == torch::kFloat32 && cos.size(1) == D,
                "positions / rope tables do not match");
    std::vector<Segment> segs;
    int64_t start = 0;
    for (size_t j = 0; j < rows.size(); ++j) {
      Segment s{start, rows[j], past[j], ks[j], vs[j], masks[j].numel() ? masks[j].contiguous() : torch::Tensor()};
      TORCH_CHECK((s.k.scalar_type() == torch::kFloat32 || s.k.scalar_type() == torch::kHalf) &&
                      s.v.scalar_type() == s.k.scalar_type() && s.k.scalar_type() == ks[0].scalar_type() &&
                      s.k.dim() == 4 && s.k.stride(3) == 1 && s.k.stride(2) == D && s.v.stride(3) == 1 &&
                      s.v.stride(2) == D,
                  "caches must be float32 or float16 (one type for all) [layers, kv_heads, capacity, D] with "
                  "contiguous rows");
      TORCH_CHECK(s.past + s.q <= s.k.size(2), "cache capacity exceeded");
      TORCH_CHECK(!s.mask.defined() || (s.mask.size(0) == s.q && s.mask.size(1) == s.past + s.q &&
                                        s.mask.scalar_type() == torch::kFloat32),
                  "mask must be float32 [q, past + q]");
      segs.push_back(s);
      start += rows[j];
    }
    TORCH_CHECK(start == N, "segment rows do not add up to the ids");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();

    torch::Tensor x = embed_.index_select(0, ids).contiguous();  // [N, hidden]
    torch::Tensor h = torch::empty_like(x);
    torch::Tensor o = torch::empty({N, H * D}, x.options());
    float* xp = x.data_ptr<float>();
    const KeyLists keys = key_lists(segs, N);  // the same for every layer
    const AttentionPlan plan = attention_plan(segs);
    for (size_t i = 0; i < ln1_.size(); ++i) {
      rms_norm(xp, ln1_[i].data_ptr<float>(), h.data_ptr<float>(), N, Hd, eps_);
      torch::Tensor qkv = linear(h, wqkv_[i], wide(wide_qkv_, i));  // [N, (H + 2 Hkv) D]
      float* qp = qkv.data_ptr<float>();
      for (int64_t n = 0; n < N; ++n)
        rope(qp + n * wq, H + Hkv, D, cp + pos[n] * D, sp + pos[n] * D);  // q and k heads are adjacent
      if (segs[0].k.scalar_type() == torch::kHalf)
        attend_all<c10::Half>(i, segs, keys, plan, qp, wq, o.data_ptr<float>());
      else
        attend_all<float>(i, segs, keys, plan, qp, wq, o.data_ptr<float>());
      add_into(x, linear(o, wo_[i], wide(wide_o_, i)));
      rms_norm(xp, ln2_[i].data_ptr<float>(), h.data_ptr<float>(), N, Hd, eps_);
      torch::Tensor gu = linear(h, wgu_[i], wide(wide_gu_, i));  // [N, 2 I]
      const int64_t I = gu.size(1) / 2;
      torch::Tensor act = torch::empty({N, I}, x.options());
      const float* g = gu.data_ptr<float>();
      float* a = act.data_ptr<float>();
      for (int64_t n = 0; n < N; ++n) silu_mul(g + n * 2 * I, g + n * 2 * I + I, a + n * I, I);
      add_into(x, linear(act, wd_[i], wide(wide_d_, i)));
    }
    // The rows whose logits are asked for, normed.
    std::vector<int64_t> keep;
    for (size_t j = 0; j < segs.size(); ++j) {
      const int64_t from = logits_rows[j] ? segs[j].q - logits_rows[j] : 0;
      for (int64_t r = from; r < segs[j].q; ++r) keep.push_back(segs[j].start + r);
    }
    torch::Tensor sel = (int64_t)keep.size() == N ? x : x.index_select(0, torch::tensor(keep, ids.options()));
    torch::Tensor fin = torch::empty_like(sel);
    rms_norm(sel.data_ptr<float>(), norm_.data_ptr<float>(), fin.data_ptr<float>(), sel.size(0), Hd, eps_);
    return {linear(fin, head_, wide_head_), fin};
  }

 private:
  // x @ w^T by the pass's format: int8 activations over w's i8_layout (`prepared`), else the block kernel.
  torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& prepared) const {
    if (i8_) {
      TORCH_CHECK(prepared.defined(), "int8 activations need every linear's i8_layout (set_wide)");
      return i8_linear(x, prepared, w.size(0));
    }
    return block_linear(x, w, bf16_, prepared, wide_from_);
  }

  static void add_into(torch::Tensor& x, const torch::Tensor& y) {
    float* a = x.data_ptr<float>();
    const float* b = y.data_ptr<float>();
    const int64_t n = x.numel();
    for (int64_t j = 0; j < n; ++j) a[j] += b[j];
  }

  // Layer i's keys/values of segment s's new rows into its cache (a float16 cache: rounded to nearest even; every
  // row, this pass's own included, then attends the rounded values, so a row's result is the same in any pass).
  template <typename KV>
  void write_kv(size_t i, const Segment& s, const float* qkv, int64_t wq) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_;
    KV* kc = s.k.data_ptr<KV>() + i * s.k.stride(0);
    KV* vc = s.v.data_ptr<KV>() + i * s.v.stride(0);
    for (int64_t r = 0; r < s.q; ++r) {
      const float* row = qkv + (s.start + r) * wq;
      for (int64_t h = 0; h < Hkv; ++h) {
        store_kv(row + (H + h) * D, D, kc + h * s.k.stride(1) + (s.past + r) * D);
        store_kv(row + (H + Hkv + h) * D, D, vc + h * s.v.stride(1) + (s.past + r) * D);
      }
    }
  }

  static void store_kv(const float* x, int64_t n, float* out) { std::copy(x, x + n, out); }
  // Saturating, as lean_llama._stored; rounded to nearest even (F16C's conversion, as c10::Half's) 16 or 8 at a time:
  // one element at a time this was ~1/3 of the pass's serial work (every row of every layer, prompts included).
  static void store_kv(const float* x, int64_t n, c10::Half* out) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 lo = _mm512_set1_ps(-65504.0f), hi = _mm512_set1_ps(65504.0f);
    for (; j + 16 <= n; j += 16) {  // max/min with x second: a NaN stays NaN, as with std::max/min below
      const __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_loadu_ps(x + j)));
      _mm256_storeu_si256((__m256i*)(out + j), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#elif defined(__AVX2__) && defined(__F16C__)
    const __m256 lo = _mm256_set1_ps(-65504.0f), hi = _mm256_set1_ps(65504.0f);
    for (; j + 8 <= n; j += 8) {
      const __m256 v = _mm256_min_ps(hi, _mm256_max_ps(lo, _mm256_loadu_ps(x + j)));
      _mm_storeu_si128((__m128i*)(out + j), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
#endif
    for (; j < n; ++j) out[j] = c10::Half(std::min(std::max(x[j], -65504.0f), 65504.0f));
  }

  // The keys each row attends in the vectorized row kernel (attend_row), where it is built for this head size: every
  // row of the pass, decode rows (an AR step, a draft tree) and prompt rows alike, so a row's result is the same bits
  // in any pass whatever the other rows, for every weight format. A row without a mask (an AR step, a prompt row)
  // attends the whole prefix up to itself: its keys are the first ones of one shared 0, 1, 2, ... list, so a long
  // prompt's chunk does not copy thousands of key indices per row. A masked row (a tree node) lists the keys its mask
  // keeps. Without the row kernel no row gets keys.
  struct KeyLists {
    std::vector<int64_t> idx, off;  // keys of masked row n: idx[off[n] .. off[n + 1])
    std::vector<float> add;         // their additive mask values, parallel to idx
    std::vector<char> has_add;      // per row: some kept mask value is not 0
    std::vector<int64_t> iota;      // 0, 1, 2, ...: the keys of every unmasked row
    std::vector<int64_t> prefix;    // per row: the number of keys when they are the whole prefix (0: see idx)
    const int64_t* keys(int64_t row) const { return prefix[row] > 0 ? iota.data() : idx.data() + off[row]; }
    int64_t count(int64_t row) const { return prefix[row] > 0 ? prefix[row] : off[row + 1] - off[row]; }
  };

  bool row_kernel() const {
#if defined(RAGSERVE_ROW_KERNEL)
    return (D_ == 64 || D_ == 128) && H_ / Hkv_ <= 64;  // attend_row: its head sizes, G <= 64
#else
    return false;
#endif
  }

  KeyLists key_lists(const std::vector<Segment>& segs, int64_t N) const {
    KeyLists kl;
    kl.off.assign(N + 1, 0);
    kl.has_add.assign(N, 0);
    kl.prefix.assign(N, 0);
    if (!row_kernel()) return kl;
    int64_t longest = 0;
    for (const Segment& s : segs) {
      const int64_t S = s.past + s.q;
      for (int64_t r = 0; r < s.q; ++r) {
        const int64_t row = s.start + r;
        kl.off[row] = (int64_t)kl.idx.size();
        if (!s.mask.defined()) {
          kl.prefix[row] = s.past + r + 1;
          longest = std::max(longest, kl.prefix[row]);
        } else {
          const float* m = s.mask.data_ptr<float>() + r * S;
          // A value this negative makes exp() exactly 0 after the max is subtracted: the key contributes nothing.
          for (int64_t t = 0; t < S; ++t)
            if (m[t] > -1e30f) {
              kl.idx.push_back(t);
              kl.add.push_back(m[t]);
              kl.has_add[row] |= m[t] != 0.0f;
            }
        }
        kl.off[row + 1] = (int64_t)kl.idx.size();
      }
    }
    kl.iota.resize(longest);
    for (int64_t t = 0; t < longest; ++t) kl.iota[t] = t;
    return kl;
  }

  // The attention work of a pass, the same in every layer (the segments and their key lists do not change): which
  // segments take ATen's matmul, the (segment, row) jobs of the others and their bins per thread (balance).
  struct AttentionPlan {
    std::vector<char> matmul;                        // per segment
    std::vector<std::pair<int64_t, int64_t>> jobs;   // (segment, row)
    std::vector<std::vector<int64_t>> bins;          // jobs x kv heads per thread (balance)
  };

  AttentionPlan attention_plan(const std::vector<Segment>& segs) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_, G = H / Hkv;
    AttentionPlan plan;
    plan.matmul.assign(segs.size(), 0);
    int64_t work = 0;
    for (size_t j = 0; j < segs.size(); ++j) {
      const int64_t S = segs[j].past + segs[j].q;
      // With the row kernel every row takes it. Without, decode rows (an AR step, a draft tree) take the loops, never
      // the matmul, whose rows differ from an AR step's in the last bits (and bf16 activations round those into
      // visible ones): a row gets the same bits in any pass. Long prompt chunks (causal) then take the matmul.
      const bool per_row = row_kernel() || segs[j].mask.defined() || segs[j].q == 1;
      if (segs[j].q * S * H > kLoopAttentionWork && !per_row) {
        plan.matmul[j] = 1;
        continue;
      }
      for (int64_t r = 0; r < segs[j].q; ++r) plan.jobs.emplace_back((int64_t)j, r);
      work += segs[j].q * S;
    }
    if (plan.jobs.empty()) return plan;
    const int64_t n = (int64_t)plan.jobs.size() * Hkv;
    // A job is ~S * D * G * 2 multiply-adds; keep a thread's share above ~64K of them.
    const int64_t grain =
        std::max<int64_t>(1, (int64_t)plan.jobs.size() * Hkv * 65536 / std::max<int64_t>(1, work * D * G * 2));
    plan.bins = balance(segs, plan.jobs, Hkv, n, grain);
    return plan;
  }

  // Layer i's attention of every segment -> o [N, H D]. With the row kernel: attend_row per (row, kv head) for every
  // row, spread over the threads. Without: the scalar loops, one job per (row, kv head); each job's G query heads
  // read each key and value row once, and a row's result does not depend on the other rows of the pass (the same
  // loop order for every row); long prompt chunks ATen's blocked matmul.
  template <typename KV>
  void attend_all(size_t i, const std::vector<Segment>& segs, const KeyLists& kl, const AttentionPlan& plan,
                  const float* qkv, int64_t wq, float* o) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_, G = H / Hkv;
    for (size_t j = 0; j < segs.size(); ++j) {
      write_kv<KV>(i, segs[j], qkv, wq);
      if (plan.matmul[j]) attend_matmul(i, segs[j], qkv, wq, o);
    }
    if (plan.jobs.empty()) return;
    const auto& jobs = plan.jobs;
    // Job j's keys and values in this layer's cache; its row count S.
    auto cache_rows = [&](int64_t job, const KV*& kh, const KV*& vh) {
      const Segment& s = segs[jobs[job / Hkv].first];
      const int64_t h = job % Hkv;
      kh = s.k.data_ptr<KV>() + i * s.k.stride(0) + h * s.k.stride(1);
      vh = s.v.data_ptr<KV>() + i * s.v.stride(0) + h * s.v.stride(1);
      return s.past + s.q;
    };
    claimed_for((int64_t)plan.bins.size(), [&](int64_t bin) {
      thread_local std::vector<float> p, acc, kb;  // per thread, not per bin
      acc.resize(G * D);
      kb.resize(64 * D);  // attend_row's block of converted keys (kLanes <= 64)
      for (size_t u = 0; u < plan.bins[bin].size(); ++u) {
        const int64_t job = plan.bins[bin][u];
        const Segment& s = segs[jobs[job / Hkv].first];
        const int64_t r = jobs[job / Hkv].second, h = job % Hkv;
        const KV* kh;
        const KV* vh;
        const int64_t S = cache_rows(job, kh, vh);
        const float* q0 = qkv + (s.start + r) * wq + h * G * D;  // query heads h G .. h G + G - 1
        const int64_t row = s.start + r, nk = kl.count(row);
#if defined(RAGSERVE_ROW_KERNEL)
        if (nk > 0) {
          // The bin's next jobs that are this kv head's next rows of the segment, all attending their whole prefix
          // (balance keeps such runs together): one tile (attend_rows) with this row.
          int64_t R = 1;
          if (kl.prefix[row] > 0)
            while (R < std::min(kTileRows, kTilePairs / G) && u + R < plan.bins[bin].size() &&
                   plan.bins[bin][u + R] == job + R * Hkv && r + R < s.q && kl.prefix[row + R] > 0)
              ++R;
          float* out = o + row * H * D + h * G * D;
          Ahead next_k, next_v;  // the rows of this thread's next job (all its segment's: a bound on its keys)
          if (u + R < plan.bins[bin].size()) {
            const KV* nkh;
            const KV* nvh;
            const int64_t bytes = cache_rows(plan.bins[bin][u + R], nkh, nvh) * D * (int64_t)sizeof(KV);
            if (nkh != kh) {  // the next row of a tree reads these same rows: in the cache already
              next_k = Ahead{(const char*)nkh, bytes};
              next_v = Ahead{(const char*)nvh, bytes};
            }
          }
          if (R > 1) {
            const int64_t n0 = kl.prefix[row];
            p.resize(R * G * (n0 + R - 1));
            acc.resize(R * G * D);
            if (D == 64)
              attend_rows<64 / kLanes>(q0, wq, R, G, kh, vh, n0, scale_, p.data(), kb.data(), acc.data(), out, H * D,
                                       next_k, next_v);
            else
              attend_rows<128 / kLanes>(q0, wq, R, G, kh, vh, n0, scale_, p.data(), kb.data(), acc.data(), out,
                                        H * D, next_k, next_v);
            u += R - 1;
            continue;
          }
          p.resize(G * nk);
          const int64_t* keys = kl.keys(row);
          const float* add = kl.has_add[row] ? kl.add.data() + kl.off[row] : nullptr;
          if (D == 64)
            attend_row<64 / kLanes>(q0, G, kh, vh, keys, add, nk, scale_, p.data(), kb.data(), out, next_k, next_v);
          else
            attend_row<128 / kLanes>(q0, G, kh, vh, keys, add, nk, scale_, p.data(), kb.data(), out, next_k, next_v);
          continue;
        }
#endif
        const int64_t seen = s.mask.defined() ? S : s.past + r + 1;  // causal without a mask
        const float* mask = s.mask.defined() ? s.mask.data_ptr<float>() + r * S : nullptr;
        p.resize(G * seen);
        for (int64_t t = 0; t < seen; ++t) {
          const KV* kt = kh + t * D;
          for (int64_t g = 0; g < G; ++g) p[g * seen + t] = dot(q0 + g * D, kt, D) * scale_ + (mask ? mask[t] : 0.0f);
        }
        for (int64_t g = 0; g < G; ++g) {
          float* pg = p.data() + g * seen;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < seen; ++t) mx = std::max(mx, pg[t]);
          for (int64_t t = 0; t < seen; ++t) pg[t] -= mx;
          exp_inplace(pg, seen);
          float sum = 0;
          for (int64_t t = 0; t < seen; ++t) sum += pg[t];
          const float inv = 1.0f / sum;
          for (int64_t t = 0; t < seen; ++t) pg[t] *= inv;
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < seen; ++t) {
          const KV* vt = vh + t * D;
          for (int64_t g = 0; g < G; ++g) {
            const float w = p[g * seen + t];
            float* ag = acc.data() + g * D;
            for (int64_t d = 0; d < D; ++d) ag[d] += w * (float)vt[d];
          }
        }
        std::copy(acc.begin(), acc.end(), o + (s.start + r) * H * D + h * G * D);
      }
    });
  }

  // The attention jobs 0..n-1 ((row, kv head) = (jobs[j / Hkv], j % Hkv)) in one bin per thread that takes part,
  // balanced by the keys each job reads: longest first, each to the least-loaded bin (the bins are claimed like any
  // loop's pieces: claimed_for). Why: parallel_for's
  // contiguous ranges gave one thread the first sequences of the pass and the other the last, so in a batch of
  // ragged lengths (a running batch always is) the pass waited for the thread with the long ones.
  // A draft tree's rows of one kv head go to a bin together, one after another (in runs of at most `per` rows, so a
  // lone tree still spreads over the threads): every row reads the whole past of that head, and the rows after the
  // first find it in the core's cache instead of memory (8 trees of 4 rows over 300 keys: the attention half as
  // long). Which thread runs a job does not change its result (every job is its own loop), so outputs are the same
  // bits either way.
  static std::vector<std::vector<int64_t>> balance(const std::vector<Segment>& segs,
                                                   const std::vector<std::pair<int64_t, int64_t>>& jobs, int64_t Hkv,
                                                   int64_t n, int64_t grain) {
    const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain));
    std::vector<std::vector<int64_t>> bins(T);
    if (T == 1) {  // a segment's rows of one kv head after another (tiles of prompt rows: attend_rows)
      for (size_t a = 0, b = 0; a < jobs.size(); a = b) {
        while (b < jobs.size() && jobs[b].first == jobs[a].first) ++b;
        for (int64_t h = 0; h < Hkv; ++h)
          for (size_t r = a; r < b; ++r) bins[0].push_back((int64_t)r * Hkv + h);
      }
      return bins;
    }
    const int64_t per = std::max<int64_t>(1, n / (4 * T));
    std::vector<std::vector<int64_t>> units;
    std::vector<int64_t> cost;
    for (size_t a = 0, b = 0; a < jobs.size(); a = b) {
      while (b < jobs.size() && jobs[b].first == jobs[a].first) ++b;  // the rows of one segment
      const Segment& s = segs[jobs[a].first];
#if defined(RAGSERVE_ROW_KERNEL)
      // Prompt rows: whole tiles; a piece of at most T tiles (one carried beside decoding rows, deep in a long
      // prompt) cut into T runs per kv head instead. Why: as one run per kv head, 3 kv heads on 2 threads left one
      // thread a head's rows alone while the other did two heads' (the pass waited a third longer for its prompt
      // rows), and re-reading a head's keys for a second run costs little beside the rows' multiply-adds.
      const int64_t q = (int64_t)(b - a);
      const int64_t run = s.mask.defined() ? per
                          : q <= T * kTileRows ? (q + T - 1) / T
                                               : std::max(per, kTileRows);
#else
      const int64_t run = per;
#endif
      for (int64_t h = 0; h < Hkv; ++h)
        for (size_t r0 = a; r0 < b; r0 += run) {
          units.emplace_back();
          int64_t c = 0;
          for (size_t r = r0; r < std::min(b, r0 + run); ++r) {
            units.back().push_back((int64_t)r * Hkv + h);
            // keys seen (an upper bound) + a job's fixed cost (its query, its output) in key-row units
            c += (s.mask.defined() ? s.past + s.q : s.past + jobs[r].second + 1) + 16;
          }
          cost.push_back(c);
        }
    }
    std::vector<int64_t> order(units.size());
    for (size_t u = 0; u < units.size(); ++u) order[u] = (int64_t)u;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
    std::vector<int64_t> load(T, 0);
    for (const int64_t u : order) {
      const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
      bins[t].insert(bins[t].end(), units[u].begin(), units[u].end());
      load[t] += cost[u];
    }
    return bins;
  }

  // [Hkv, G q, D] x [Hkv, D, S] through ATen's blocked matmul (keys/values already written).
  void attend_matmul(size_t i, const Segment& s, const float* qkv, int64_t wq, float* o) const {
    const int64_t H = H_, Hkv = Hkv_, D = D_, G = H / Hkv, q = s.q, S = s.past + s.q;
    auto opts = torch::TensorOptions().dtype(torch::kFloat32);
    torch::Tensor qg = torch::empty({Hkv, G * q, D}, opts);
    float* qgp = qg.data_ptr<float>();
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t r = 0; r < q; ++r) {
        const float* src = qkv + (s.start + r) * wq + hq * D;
        std::copy(src, src + D, qgp + (hq * q + r) * D);
      }
    torch::Tensor keys = s.k.select(0, (int64_t)i).narrow(1, 0, S).to(torch::kFloat32);  // [Hkv, S, D]
    torch::Tensor values = s.v.select(0, (int64_t)i).narrow(1, 0, S).to(torch::kFloat32);
    torch::Tensor scores = torch::matmul(qg, keys.transpose(1, 2)).mul_(scale_);  // [Hkv, G q, S]
    torch::Tensor m = s.mask;
    if (!m.defined()) {
      m = torch::zeros({q, S}, opts);
      m.narrow(1, s.past, q).copy_(torch::full({q, q}, -std::numeric_limits<float>::infinity(), opts).triu(1));
    }
    scores.view({Hkv, G, q, S}).add_(m);
    torch::Tensor out = torch::matmul(torch::softmax(scores, -1), values);  // [Hkv, G q, D]
    const float* op = out.data_ptr<float>();
    for (int64_t hq = 0; hq < H; ++hq)
      for (int64_t r = 0; r < q; ++r) {
        const float* src = op + (hq * q + r) * D;
        std::copy(src, src + D, o + (s.start + r) * H * D + hq * D);
      }
  }

  static torch::Tensor wide(const std::vector<torch::Tensor>& w, size_t i) {
    return w.empty() ? torch::Tensor() : w[i];
  }

  torch::Tensor embed_;
  std::vector<torch::Tensor> ln1_, wqkv_, wo_, ln2_, wgu_, wd_;
  std::vector<torch::Tensor> wide_qkv_, wide_o_, wide_gu_, wide_d_;  // set_wide
  torch::Tensor wide_head_;
  int64_t wide_from_ = kWideFromRows;  // set_wide_from
  torch::Tensor norm_, head_;
  int64_t H_, Hkv_, D_, hidden_ = 0;
  float eps_, scale_;
  bool bf16_;  // linears with bf16 activations (the q4_1_bf16 format)
  bool i8_;    // linears with int8 activations (the q4_1_i8 format; set_wide holds their layouts)
};

}  // namespace

void bind_lean_forward(pybind11::module_& m) {
  pybind11::class_<LeanForward>(m, "LeanForward")
      .def(pybind11::init<torch::Tensor, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t,
                          double, bool, bool>(),
           pybind11::arg("embed"), pybind11::arg("ln1"), pybind11::arg("wqkv"), pybind11::arg("wo"),
           pybind11::arg("ln2"), pybind11::arg("wgu"), pybind11::arg("wd"), pybind11::arg("norm"),
           pybind11::arg("head"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("eps"), pybind11::arg("bf16") = false, pybind11::arg("i8") = false)
      .def("set_wide", &LeanForward::set_wide, pybind11::arg("wqkv"), pybind11::arg("wo"), pybind11::arg("wgu"),
           pybind11::arg("wd"), pybind11::arg("head"))
      .def("set_wide_from", &LeanForward::set_wide_from, pybind11::arg("rows"),
           "passes of at least this many rows read the decoded copies (set_wide; the same bits either way)")
      .def("forward", &LeanForward::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_attention", []() {
#if defined(RAGSERVE_ROW_KERNEL)
    return std::string(Simd::kLanes == 16 ? "avx512" : "avx2");
#else
    return std::string("");
#endif
  }, "the vector width of the per-row attention kernel of decode rows ('avx512', 'avx2'), or '' (scalar loops)");
}
