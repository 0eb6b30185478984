// Exact top-k over float16 vectors for a batch of float32 queries, reading the vectors once per batch.
//
// Why: the scan is memory-bound. faiss's float16 scan (IndexScalarQuantizer QT_fp16) reads all N x D halves once per
// query; its float32 IndexFlat reads twice the bytes (once per batch, through BLAS). Here each block of rows is
// widened to float32 in registers (F16C / AVX-512) and multiplied with up to 8 queries at once, so a batch of 8 costs
// about one pass over the float16 bytes. float16 -> float32 is exact, the products are float32 FMAs: the same math as
// faiss's scan up to the summation order, and the caller re-scores the candidates exactly anyway.
//
// Scores are "higher is better": inner product q.x, or 2 q.x - |x|^2 for L2 (the distance minus |q|^2, which does
// not change the order within a query). Ties go to the smaller id. Rows with a NaN score are never selected.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

constexpr int kGroup = 8;     // queries multiplied with one widened row chunk
constexpr int kBlock = 512;   // rows scored before a selection step (their halves stay in L2 for the next group)
// Rows ahead whose lines are prefetched into L2, in address order. Without it a batch of queries ran far below the
// FMA rate (and far slower than with the rows in L1): the arithmetic between lines leaves too few misses in flight
// for the hardware prefetcher, which also loses track of rows read side by side.
constexpr int kAhead = 32;

// Prefetch of `rows` rows starting `kAhead` rows past x. A prefetch never faults, so the ones past the end of the
// array at the end of a scan are harmless.
inline void prefetch_ahead(const uint16_t* x, int rows, int d) {
    const char* p = (const char*)(x + (int64_t)kAhead * d);
    const int64_t bytes = (int64_t)rows * d * 2;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; --exp; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

// out[b * stride + r] = q_b . x_r for rows [0, rows) of x and NB queries.
#if defined(__AVX512F__)
// R rows at a time: R x NB independent FMA chains keep both FMA ports busy (a single query needs several rows).
template <int NB, int R>
__attribute__((noinline))  // inlined into scan_range, GCC keeps the accumulators on the stack
void dots_rows(const uint16_t* x, int d, int dv, const float* q, float* out, int64_t stride) {
    __m512 acc[R][NB];
    for (int i = 0; i < R; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_ps();
    for (int j = 0; j < dv; j += 16) {
        __m512 v[R];
        for (int i = 0; i < R; ++i) v[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + (int64_t)i * d + j)));
        for (int b = 0; b < NB; ++b) {
            __m512 qv = _mm512_loadu_ps(q + (int64_t)b * d + j);
            // One load per query chunk for the R rows: GCC would otherwise fold it into each FMA, and AMD Zen 4
            // issues one 512-bit load per cycle, the same rate as its FMAs.
            asm("" : "+v"(qv));
            for (int i = 0; i < R; ++i) acc[i][b] = _mm512_fmadd_ps(v[i], qv, acc[i][b]);
        }
    }
    for (int i = 0; i < R; ++i) {
        const uint16_t* xi = x + (int64_t)i * d;
        for (int b = 0; b < NB; ++b) {
            float s = _mm512_reduce_add_ps(acc[i][b]);
            for (int j = dv; j < d; ++j) s += half_to_float(xi[j]) * q[(int64_t)b * d + j];
            out[b * stride + i] = s;
        }
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// out[b * stride] = q_b . x0 for NB (<= 4) queries. Two accumulators per query over alternating
// chunks: one chain of dependent FMAs per query made a single query latency-bound (far slower at this level than
// at AVX-512). Each (query, row) sums in the same order whatever the batch,
// so a query's scores do not depend on the queries beside it.
template <int NB>
inline void dots_row_avx2(const uint16_t* x0, int d, int dv, const float* q, float* out, int64_t stride) {
    __m256 a0[NB], a1[NB];
    for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= dv; j += 16) {
        const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x0 + j)));
        const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x0 + j + 8)));
        for (int b = 0; b < NB; ++b) {
            a0[b] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(q + (int64_t)b * d + j), a0[b]);
            a1[b] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(q + (int64_t)b * d + j + 8), a1[b]);
        }
    }
    if (j < dv) {  // one chunk of 8 left
        const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(x0 + j)));
        for (int b = 0; b < NB; ++b) a0[b] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(q + (int64_t)b * d + j), a0[b]);
    }
    for (int b = 0; b < NB; ++b) {
        const __m256 a = _mm256_add_ps(a0[b], a1[b]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
        float s0 = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        for (int k = dv; k < d; ++k) s0 += half_to_float(x0[k]) * q[(int64_t)b * d + k];
        out[b * stride] = s0;
    }
}
#endif

template <int NB>
void dots(const uint16_t* x, int64_t rows, int d, const float* q, float* out, int64_t stride) {
#if defined(__AVX512F__)
    // Two rows per query chunk loaded (R x NB accumulators of 32 registers). 4 rows for up to 4 queries were
    // clearly slower, and 3 rows for more queries slightly slower, than 2.
    constexpr int R = NB == 1 ? 1 : 2;
    const int dv = d - d % 16;
    int64_t r = 0;
    for (; r + R <= rows; r += R) {
        prefetch_ahead(x + r * d, R, d);
        dots_rows<NB, R>(x + r * d, d, dv, q, out + r, stride);
    }
    for (; r < rows; ++r) dots_rows<NB, 1>(x + r * d, d, dv, q, out + r, stride);
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    // One row at a time, queries 4 at a time (16 ymm registers: 2 x 4 accumulators, 2 widened chunks, a query
    // chunk), so a group of 8 reads each row twice, the second time from L1.
    const int dv = d - d % 8;
    for (int64_t r = 0; r < rows; ++r) {
        prefetch_ahead(x + r * d, 1, d);
        dots_row_avx2<(NB < 4 ? NB : 4)>(x + r * d, d, dv, q, out + r, stride);
        if constexpr (NB > 4) dots_row_avx2<NB - 4>(x + r * d, d, dv, q + 4 * (int64_t)d, out + 4 * stride + r, stride);
    }
#else
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* x0 = x + r * d;
        float acc[NB] = {0};
        for (int j = 0; j < d; ++j) {
            const float v = half_to_float(x0[j]);
            for (int b = 0; b < NB; ++b) acc[b] += v * q[(int64_t)b * d + j];
        }
        for (int b = 0; b < NB; ++b) out[b * stride + r] = acc[b];
    }
#endif
}

void dots_group(int nb, const uint16_t* x, int64_t rows, int d, const float* q, float* out, int64_t stride) {
    switch (nb) {
        case 1: dots<1>(x, rows, d, q, out, stride); break;
        case 2: dots<2>(x, rows, d, q, out, stride); break;
        case 3: dots<3>(x, rows, d, q, out, stride); break;
        case 4: dots<4>(x, rows, d, q, out, stride); break;
        case 5: dots<5>(x, rows, d, q, out, stride); break;
        case 6: dots<6>(x, rows, d, q, out, stride); break;
        case 7: dots<7>(x, rows, d, q, out, stride); break;
        default: dots<8>(x, rows, d, q, out, stride); break;
    }
}

// Bounds are dot products with few columns (~128), where dots' horizontal sum per (row, query) would cost as much
// as the products, and a single query's pass is memory-bound. So the bound array holds int8 (a fixed scale per
// column: half the bytes of float16) in blocks of kLanes rows, column pairs interleaved inside a block
// ([n / kLanes][dp / 2][kLanes][2] int8): one widened load holds a column pair of kLanes rows as int16, and each
// query's pair of int16 weights multiplies it into kLanes int32 row sums at once (AVX-512 VNNI's vpdpwssd, else
// pmaddwd + add). The sums are exact integers; the caller's bound covers both quantisations (fp16_scan.py).
constexpr int kLanes = 16;

// out[b * stride + i] = q_b . row i (int32 sums, as float), for the RB * kLanes rows of RB consecutive blocks and
// NB queries; q_b: [dp / 2] int32, each a pair of int16 weights (low half: the even column).
template <int NB, int RB>
void block_dots(const int8_t* p, int pairs, const int32_t* q, float* out, int64_t stride) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i acc[RB][NB];
    for (int i = 0; i < RB; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = _mm512_setzero_si512();
    for (int j = 0; j < pairs; ++j) {
        __m512i v[RB];
        for (int i = 0; i < RB; ++i)
            v[i] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(p + ((int64_t)i * pairs + j) * 2 * kLanes)));
        for (int b = 0; b < NB; ++b) {
            const __m512i qb = _mm512_set1_epi32(q[(int64_t)b * pairs + j]);
#if defined(__AVX512VNNI__)
            for (int i = 0; i < RB; ++i) acc[i][b] = _mm512_dpwssd_epi32(acc[i][b], v[i], qb);
#else
            for (int i = 0; i < RB; ++i) acc[i][b] = _mm512_add_epi32(acc[i][b], _mm512_madd_epi16(v[i], qb));
#endif
        }
    }
    for (int i = 0; i < RB; ++i)
        for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + b * stride + i * kLanes, _mm512_cvtepi32_ps(acc[i][b]));
#elif defined(__AVX2__)
    __m256i acc[2 * RB][NB];  // a block is two halves of 8 rows
    for (int i = 0; i < 2 * RB; ++i)
        for (int b = 0; b < NB; ++b) acc[i][b] = _mm256_setzero_si256();
    for (int j = 0; j < pairs; ++j) {
        __m256i v[2 * RB];
        for (int i = 0; i < 2 * RB; ++i)
            v[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + ((int64_t)(i / 2) * pairs + j) * 2 * kLanes + (i % 2) * kLanes)));
        for (int b = 0; b < NB; ++b) {
            const __m256i qb = _mm256_set1_epi32(q[(int64_t)b * pairs + j]);
            for (int i = 0; i < 2 * RB; ++i) acc[i][b] = _mm256_add_epi32(acc[i][b], _mm256_madd_epi16(v[i], qb));
        }
    }
    for (int i = 0; i < 2 * RB; ++i)
        for (int b = 0; b < NB; ++b) _mm256_storeu_ps(out + b * stride + i * 8, _mm256_cvtepi32_ps(acc[i][b]));
#else
    for (int b = 0; b < NB; ++b) {
        for (int i = 0; i < RB * kLanes; ++i) {
            const int8_t* row = p + (int64_t)(i / kLanes) * pairs * 2 * kLanes + (i % kLanes) * 2;
            int32_t a = 0;
            for (int j = 0; j < pairs; ++j) {
                const int32_t w = q[(int64_t)b * pairs + j];
                a += row[(int64_t)j * 2 * kLanes] * (int32_t)(int16_t)(w & 0xffff) +
                     row[(int64_t)j * 2 * kLanes + 1] * (int32_t)(int16_t)(w >> 16);
            }
            out[b * stride + i] = (float)a;
        }
    }
#endif
}

// block_dots over `blocks` consecutive blocks and nb (<= kGroup) queries. Queries per call and blocks per call
// keep the accumulators in registers: AVX-512 32 zmm (8 queries x 2 blocks, or 4 blocks for up to 2 queries),
// AVX2 16 ymm (4 queries x 1 block of two halves; more queries take a second call over the same rows, from L1).
void bound_dots(int nb, const int8_t* p, int64_t blocks, int pairs, const int32_t* q, float* out, int64_t stride) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr int kMaxNB = 8;
#else
    constexpr int kMaxNB = 4;
#endif
    if (nb > kMaxNB) {
        bound_dots(kMaxNB, p, blocks, pairs, q, out, stride);
        bound_dots(nb - kMaxNB, p, blocks, pairs, q + (int64_t)kMaxNB * pairs, out + kMaxNB * stride, stride);
        return;
    }
    auto run = [&](auto nbc) {
        constexpr int NB = decltype(nbc)::value;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        // One block for more than 4 queries: with two, GCC spilled accumulators to the stack and copied the rest
        // every column pair (one block is clearly faster for 8 and 16 queries).
        constexpr int RB = NB <= 2 ? 4 : NB <= 4 ? 2 : 1;
#else
        constexpr int RB = 1;
#endif
        const int64_t step = (int64_t)pairs * 2 * kLanes;  // bytes per block
        int64_t i = 0;
        for (; i + RB <= blocks; i += RB) {
            // The blocks 4 ahead into L1: without it the widening loads waited on memory (a bounded search is
            // faster with it, for one query and for a batch).
            const char* ahead = (const char*)(p + (i + 4) * step);
            for (int64_t b = 0; b < RB * step; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
            block_dots<NB, RB>(p + i * step, pairs, q, out + i * kLanes, stride);
        }
        for (; i < blocks; ++i) block_dots<NB, 1>(p + i * step, pairs, q, out + i * kLanes, stride);
    };
    switch (nb) {
        case 1: run(std::integral_constant<int, 1>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        case 4: run(std::integral_constant<int, 4>()); break;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        case 5: run(std::integral_constant<int, 5>()); break;
        case 6: run(std::integral_constant<int, 6>()); break;
        case 7: run(std::integral_constant<int, 7>()); break;
        case 8: run(std::integral_constant<int, 8>()); break;
#endif
        default: break;
    }
}

struct Hit {
    float score;
    int64_t id;
};

inline bool better(const Hit& a, const Hit& b) { return a.score > b.score || (a.score == b.score && a.id < b.id); }

// The best k hits of one query seen so far: candidates better than the current k-th hit are appended; when the
// buffer holds 2k, a selection keeps the best k and raises the bar to the new k-th (score, id). Rows may come in
// any id order (a thread scans again a chunk a helper has not finished).
struct TopK {
    int64_t k;
    float threshold = -INFINITY;           // the k-th hit's score once full
    int64_t threshold_id = INT64_MAX;      // ... and its id: a later row with that score wins if its id is smaller
    std::vector<Hit> buf;

    explicit TopK(int64_t k_) : k(k_) { buf.reserve(2 * k_ + kBlock); }

    void shrink() {
        std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better);
        buf.resize(k);
        threshold = buf[k - 1].score;  // the worst of the best k: nth_element put it at k - 1
        threshold_id = buf[k - 1].id;
    }

    void take(float s, int64_t id) {
        if (s > threshold || (s == threshold && id < threshold_id)) buf.push_back({s, id});
    }

    // Once the buffer has filled, few rows beat the bar: a vector compare per 8 or 16 rows skips the rest (a
    // bounded search offers N bounds per query: one row at a time, offering was a sizeable share of its time).
    // NaN compares false.
    void offer(const float* scores, int64_t rows, int64_t first_id) {
        int64_t r = 0;
#if defined(__AVX512F__)
        const __m512 bar = _mm512_set1_ps(threshold);
        for (; r + 16 <= rows; r += 16) {
            for (uint32_t m = _mm512_cmp_ps_mask(_mm512_loadu_ps(scores + r), bar, _CMP_GE_OQ); m; m &= m - 1) {
                const int l = __builtin_ctz(m);
                take(scores[r + l], first_id + r + l);
            }
        }
#elif defined(__AVX__)
        const __m256 bar = _mm256_set1_ps(threshold);
        for (; r + 8 <= rows; r += 8) {
            const __m256 v = _mm256_loadu_ps(scores + r);
            for (uint32_t m = _mm256_movemask_ps(_mm256_cmp_ps(v, bar, _CMP_GE_OQ)); m; m &= m - 1) {
                const int l = __builtin_ctz(m);
                take(scores[r + l], first_id + r + l);
            }
        }
#endif
        for (; r < rows; ++r) take(scores[r], first_id + r);
        if ((int64_t)buf.size() >= 2 * k) shrink();
    }
};

void scan_range(const uint16_t* x, int64_t lo, int64_t hi, int d, const float* q, int nq, const float* sq_norms,
                std::vector<TopK>& tops) {
    std::vector<float> scores((size_t)nq * kBlock);
    for (int64_t r0 = lo; r0 < hi; r0 += kBlock) {
        const int64_t rows = std::min<int64_t>(kBlock, hi - r0);
        for (int g = 0; g < nq; g += kGroup) {
            dots_group(std::min(kGroup, nq - g), x + r0 * d, rows, d, q + (int64_t)g * d, scores.data() + (int64_t)g * kBlock,
                       kBlock);
        }
        for (int b = 0; b < nq; ++b) {
            float* s = scores.data() + (int64_t)b * kBlock;
            if (sq_norms != nullptr) {
                for (int64_t r = 0; r < rows; ++r) s[r] = 2.0f * s[r] - sq_norms[r0 + r];
            }
            tops[b].offer(s, rows, r0);
        }
    }
}

// Runs work(c, p) for chunks c in [0, nchunks) on `parts` threads (p = the thread's slot). Chunks go out from a
// shared counter, so a thread that gets less CPU (another process on its core) takes fewer of them instead of
// holding up the call. At the end the calling thread runs again whatever a helper has taken and not finished,
// rather than wait for it: work must tolerate a chunk run twice (by two slots, possibly at the same time, writing
// the same values).
template <class Work>
void parallel_chunks(int64_t nchunks, int parts, Work work) {
    std::atomic<int64_t> next{0};
    std::unique_ptr<std::atomic<bool>[]> done(new std::atomic<bool>[nchunks]);
    for (int64_t c = 0; c < nchunks; ++c) done[c].store(false, std::memory_order_relaxed);
    auto run = [&](int64_t c, int p) {
        work(c, p);
        done[c].store(true, std::memory_order_release);
    };
    auto loop = [&](int p) {
        for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) run(c, p);
    };
    // Plain threads, not OpenMP: the library then needs no libgomp, which the retrieval image (no compiler) lacks.
    std::vector<std::thread> pool;
    for (int p = 1; p < parts; ++p) pool.emplace_back(loop, p);
    loop(0);
    for (int64_t c = 0; c < nchunks && parts > 1; ++c) {
        if (!done[c].load(std::memory_order_acquire)) run(c, 0);
    }
    for (std::thread& t : pool) t.join();
}

// The best k of the hits in `lists`, sorted, a row offered twice kept once (same code, same summation order: the
// same score both times); ids -1 and scores -inf past the hits.
void write_best(const std::vector<std::vector<Hit>*>& lists, int64_t k, int64_t* out_ids, float* out_scores) {
    std::vector<Hit> all;
    for (auto* l : lists) all.insert(all.end(), l->begin(), l->end());
    std::sort(all.begin(), all.end(), better);
    all.erase(std::unique(all.begin(), all.end(), [](const Hit& a, const Hit& h) { return a.id == h.id; }), all.end());
    const int64_t m = std::min<int64_t>(k, (int64_t)all.size());
    for (int64_t i = 0; i < k; ++i) {
        out_ids[i] = i < m ? all[i].id : -1;
        out_scores[i] = i < m ? all[i].score : -INFINITY;
    }
}

// The scan's score of row x0 for one query: dots<NB> sums each (row, query) in this order whatever NB and the row
// grouping, so a row scored here scores bit for bit as in the scan.
inline float row_score(const uint16_t* x0, int d, const float* q, const float* sq_norm) {
    float s;
#if defined(__AVX512F__)
    dots_rows<1, 1>(x0, d, d - d % 16, q, &s, 1);
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    dots_row_avx2<1>(x0, d, d - d % 8, q, &s, 1);
#else
    dots<1>(x0, 1, d, q, &s, 1);
#endif
    return sq_norm != nullptr ? 2.0f * s - *sq_norm : s;
}

// Scores of kPairs (row, query) pairs, each bit for bit row_score's (the same chains of FMAs in column order, the
// same reduction). Why: one pair's chains are FMA-latency-bound (36 dependent FMAs for d = 576 at AVX-512), and a
// bounded search scores many thousands of rows per query; independent pairs side by side keep the FMA ports busy
// (8 pairs a little faster than 4).
constexpr int kPairs = 8;
#if defined(__AVX512F__)
constexpr int kPairLanes = 16;  // row_score's dv: the columns its vector loop covers
__attribute__((noinline)) void pair_dots(const uint16_t* const* xs, const float* const* qs, int d, int dv,
                                         float* out) {
    __m512 acc[kPairs];
    for (int i = 0; i < kPairs; ++i) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < dv; j += 16) {
        for (int i = 0; i < kPairs; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(xs[i] + j))),
                                     _mm512_loadu_ps(qs[i] + j), acc[i]);
    }
    for (int i = 0; i < kPairs; ++i) {
        float s = _mm512_reduce_add_ps(acc[i]);
        for (int j = dv; j < d; ++j) s += half_to_float(xs[i][j]) * qs[i][j];
        out[i] = s;
    }
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
constexpr int kPairLanes = 8;
// dots_row_avx2<1>'s sums per pair: two chains over alternating chunks of 8, one chunk of 8 left to the first.
void pair_dots(const uint16_t* const* xs, const float* const* qs, int d, int dv, float* out) {
    __m256 a0[kPairs], a1[kPairs];
    for (int i = 0; i < kPairs; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= dv; j += 16) {
        for (int i = 0; i < kPairs; ++i) {
            a0[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(xs[i] + j))),
                                    _mm256_loadu_ps(qs[i] + j), a0[i]);
            a1[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(xs[i] + j + 8))),
                                    _mm256_loadu_ps(qs[i] + j + 8), a1[i]);
        }
    }
    if (j < dv) {
        for (int i = 0; i < kPairs; ++i)
            a0[i] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(xs[i] + j))),
                                    _mm256_loadu_ps(qs[i] + j), a0[i]);
    }
    for (int i = 0; i < kPairs; ++i) {
        const __m256 a = _mm256_add_ps(a0[i], a1[i]);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
        float s0 = _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
        for (int k = dv; k < d; ++k) s0 += half_to_float(xs[i][k]) * qs[i][k];
        out[i] = s0;
    }
}
#endif

// Pairs to score, kPairs at a time, each offered to its TopK once scored (a TopK's answer does not depend on the
// order of its offers).
class PairScorer {
  public:
    PairScorer(const uint16_t* x, int d, const float* sq_norms) : x_(x), d_(d), sq_norms_(sq_norms) {}
    ~PairScorer() { flush(); }

    void add(int64_t id, const float* q, TopK* top) {
        xs_[n_] = x_ + id * d_;
        qs_[n_] = q;
        ids_[n_] = id;
        tops_[n_] = top;
        if (++n_ == kPairs) flush();
    }

    void flush() {
        float s[kPairs];
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
        if (n_ == kPairs) {
            pair_dots(xs_, qs_, d_, d_ - d_ % kPairLanes, s);
        } else {
            for (int i = 0; i < n_; ++i) s[i] = row_score(xs_[i], d_, qs_[i], nullptr);
        }
#else
        for (int i = 0; i < n_; ++i) s[i] = row_score(xs_[i], d_, qs_[i], nullptr);
#endif
        for (int i = 0; i < n_; ++i) {
            if (sq_norms_ != nullptr) s[i] = 2.0f * s[i] - sq_norms_[ids_[i]];
            tops_[i]->offer(s + i, 1, ids_[i]);
        }
        n_ = 0;
    }

  private:
    const uint16_t* x_;
    int d_;
    const float* sq_norms_;
    const uint16_t* xs_[kPairs];
    const float* qs_[kPairs];
    int64_t ids_[kPairs];
    TopK* tops_[kPairs];
    int n_ = 0;
};

// Prefetch into L1 of the row `ahead` rows after i in ids (rows by id are scattered: the hardware prefetcher cannot
// guess them). kAheadRows where a row costs a dot product per query it passed for; kAheadRowsLight where it costs
// little arithmetic (widening, exact re-scoring), so more misses must be in flight: exact scores of scattered rows
// took little more than half the time with 8 ahead instead of 4.
constexpr int kAheadRows = 4;
constexpr int kAheadRowsLight = 8;
inline void prefetch_id_ahead(const uint16_t* x, int d, const int64_t* ids, int64_t i, int64_t cnt,
                              int ahead = kAheadRows) {
    if (i + ahead >= cnt) return;
    const char* p = (const char*)(x + ids[i + ahead] * d);
    for (int64_t b = 0; b < (int64_t)d * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

// Queries per bit mask of the rows that passed their bounds (fp16_topk_bounded, step 5).
constexpr int kMaskBits = 32;

// The top k of rows whose bound passed tau: a row worse than tau is not in the top k (tau's own row is: id + 1).
TopK above(const Hit& tau, int64_t k) {
    TopK top(k);
    top.threshold = tau.score;
    top.threshold_id = tau.id == INT64_MAX ? INT64_MAX : tau.id + 1;
    return top;
}

// A bounded search streams its bounds (stream_floats) above this many bytes of them, else stores them plainly
// (4 MB for one query over 1 M rows stay in cache until step 3): streamed, a single query's search was no faster,
// batches of queries were.
constexpr int64_t kStreamBytes = int64_t(8) << 20;

// dst[0, cnt) = src[0, cnt), with non-temporal stores where dst is aligned. Why: a bounded search writes nq x n
// bounds (64 MB for 16 queries over 1 M rows) that are read once, in step 3; plain stores first read each line
// from memory. The caller fences before other threads read dst.
inline void stream_floats(float* dst, const float* src, int64_t cnt) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < cnt && ((uintptr_t)(dst + i) & 63); ++i) dst[i] = src[i];
    for (; i + 16 <= cnt; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__AVX__)
    for (; i < cnt && ((uintptr_t)(dst + i) & 31); ++i) dst[i] = src[i];
    for (; i + 8 <= cnt; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < cnt; ++i) dst[i] = src[i];
}

// Bit l set for each of the kLanes values v[l] >= bar (NaN: not set). Written out: GCC compared them one at a time
// (this helps batches of queries most).
inline uint32_t lanes_at_least(const float* v, float bar) {
#if defined(__AVX512F__)
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(v), _mm512_set1_ps(bar), _CMP_GE_OQ);
#elif defined(__AVX__)
    const __m256 b = _mm256_set1_ps(bar);
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v), b, _CMP_GE_OQ))
           | (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + 8), b, _CMP_GE_OQ)) << 8;
#else
    uint32_t mask = 0;
    for (int l = 0; l < kLanes; ++l) mask |= (uint32_t)(v[l] >= bar) << l;
    return mask;
#endif
}

// The terms of a row's bound for a query (fp16_topk_bounded): ub_b(r) = a_b dot - c_r + e_b + g_b dn_r for the
// int32 dot product of the query's weights with the row's steps.
struct BoundTerms {
    const float *a, *e, *g;  // [nq]
    const float *c, *dn;     // [n]

    // s[i] = the bound of row r0 + i for query b, from s[i] = its dot product, for i in [0, rows).
    void apply(int b, int64_t r0, int64_t rows, float* s) const {
        const float ab = a[b], eb = e[b], gb = g[b];  // in registers: s could alias them
        const float *cr = c + r0, *dnr = dn + r0;
        for (int64_t i = 0; i < rows; ++i) s[i] = ab * s[i] - cr[i] + eb + gb * dnr[i];
    }
};

// Step 1's starting bar per query (fp16_topk_bounded): a bound that about kBarMargin x m rows reach, from the bounds
// of one block of rows in `stride`. Why: from -inf, each query's top m of 1 M bounds filled and shrank its buffer
// ~12 times (a selection over 2 m hits each, plus a push per row that beat a lagging bar). Any m rows would do for
// tau (the answer is exact whatever they are); when at least m rows reach the bar, they are the same m rows as
// without it. -inf where the sample would be too small to place the bar (small m: fewer than kMinRank rows above
// it in the sample, or a sample of more than one block in kMinStride).
constexpr int64_t kBarMargin = 3, kMinRank = 32, kMaxStride = 64, kMinStride = 16;
std::vector<float> starting_bars(const int8_t* p, int64_t n, int dp, const int32_t* qp, int nq, const BoundTerms& terms,
                                 int64_t m) {
    std::vector<float> bars(nq, -INFINITY);
    const int64_t stride = std::min<int64_t>(kMaxStride, kBarMargin * m / kMinRank);
    const int64_t full = n / kLanes;  // blocks without padding rows
    if (stride < kMinStride || full < stride) return bars;
    const int64_t blocks = (full + stride - 1) / stride, rows = blocks * kLanes;
    const int64_t rank = kBarMargin * m * rows / n;  // about kBarMargin x m of the n rows score above it
    if (rank < kMinRank || rank >= rows) return bars;
    std::vector<float> s((size_t)nq * rows);
    const int64_t step = (int64_t)dp * kLanes;  // bytes per block
    for (int64_t i = 0; i < blocks; ++i) {
        for (int g = 0; g < nq; g += kGroup)
            bound_dots(std::min(kGroup, nq - g), p + i * stride * step, 1, dp / 2, qp + (int64_t)g * (dp / 2),
                       s.data() + (int64_t)g * rows + i * kLanes, rows);
    }
    for (int b = 0; b < nq; ++b) {
        float* v = s.data() + (int64_t)b * rows;
        for (int64_t i = 0; i < blocks; ++i) terms.apply(b, i * stride * kLanes, kLanes, v + i * kLanes);
        for (int64_t i = 0; i < rows; ++i) v[i] = v[i] == v[i] ? v[i] : -INFINITY;  // NaN breaks the order
        std::nth_element(v, v + rank - 1, v + rows, std::greater<float>());
        bars[b] = v[rank - 1];
    }
    return bars;
}

// Offers rows ids[0, cnt) of x, scored for query q, to `top`, prefetching ahead.
void offer_rows(const uint16_t* x, int d, const int64_t* ids, int64_t cnt, const float* q, const float* sq_norms,
                TopK& top) {
    PairScorer pairs(x, d, sq_norms);
    for (int64_t i = 0; i < cnt; ++i) {
        prefetch_id_ahead(x, d, ids, i, cnt);
        pairs.add(ids[i], q, &top);
    }
}

// dst[0, d) = the float16 row src widened to float32 (exact).
void widen_row(const uint16_t* src, int d, float* dst) {
    int j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= d; j += 16) _mm512_storeu_ps(dst + j, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + j))));
#elif defined(__F16C__)
    for (; j + 8 <= d; j += 8) _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + j))));
#endif
    for (; j < d; ++j) dst[j] = half_to_float(src[j]);
}

// numpy's sum of n float64 values along a contiguous axis (pairwise_sum in numpy/_core/src/umath/
// loops_utils.h.src, numpy 2.x): the same additions in the same order, so the same bits. Under 8 values a plain
// loop from -0.0; up to 128, eight running sums (lane j takes values j, j + 8, ...) combined as a tree, then the
// values past the last multiple of 8; above, the halves (the first a multiple of 8 long) summed recursively.
double pairwise_sum(const double* a, int64_t n) {
    if (n < 8) {
        double res = -0.0;
        for (int64_t i = 0; i < n; ++i) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) r[j] = a[j];
        int64_t i = 8;
        for (; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; ++j) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

}  // namespace

extern "C" {

// x: [n, d] float16 bits, q: [nq, d] float32, sq_norms: [n] |x|^2 for L2 or NULL for inner product.
// out_ids / out_scores: [nq, k], best first; -1 / -inf where n < k. threads: row ranges scanned in parallel.
// Returns 0, or -1 on bad arguments.
int fp16_topk(const uint16_t* x, int64_t n, int d, const float* q, int nq, const float* sq_norms, int64_t k,
              int threads, int64_t* out_ids, float* out_scores) {
    if (n < 0 || d <= 0 || nq < 0 || k <= 0 || threads <= 0) return -1;
    for (int64_t i = 0; i < (int64_t)nq * k; ++i) {
        out_ids[i] = -1;
        out_scores[i] = -INFINITY;
    }
    if (n == 0 || nq == 0) return 0;
    const int64_t chunk = 16384;
    const int parts = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / (4 * chunk)));
    std::vector<std::vector<TopK>> tops(parts, std::vector<TopK>(nq, TopK(k)));
    parallel_chunks((n + chunk - 1) / chunk, parts, [&](int64_t c, int p) {
        scan_range(x, c * chunk, std::min(n, (c + 1) * chunk), d, q, nq, sq_norms, tops[p]);
    });
    for (int b = 0; b < nq; ++b) {
        std::vector<std::vector<Hit>*> lists;
        for (int p = 0; p < parts; ++p) lists.push_back(&tops[p][b].buf);
        write_best(lists, k, out_ids + (int64_t)b * k, out_scores + (int64_t)b * k);
    }
    return 0;
}

// fp16_topk's answer (the same ids and scores, bit for bit) from fewer rows, when each row r has a bound
// ub_b(r) >= its score for query b:
//   ub_b(r) = a_b * (qp_b . p_r) - c_r + e_b + g_b * dn_r
// p: [ceil(n / 16), dp / 2, 16, 2] int8 (the caller's quantised projection of x, principal directions and the
// residual's norm, in blocks of 16 rows: bound_dots), qp: [nq, dp / 2] int32 (pairs of int16 weights), dp even,
// c, dn: [n], a, e, g: [nq] (the caller's terms cover both quantisations and rounding: fp16_scan.py). One pass
// over p (dp bytes per row, not 2 d) gives every bound and the m rows of highest bound; their scores give tau,
// the k-th best of them, which no true top-k row is below; then only rows with ub >= tau are scored.
// ub: [nq, n] floats of workspace (the caller's, so a search does not page-fault a fresh buffer in).
// out_scored: [nq] rows scored per query: the m plus those that pass, or n for a query scanned instead.
// Returns 0, or -1 on bad arguments.
int fp16_topk_bounded(const uint16_t* x, int64_t n, int d, const float* q, int nq, const float* sq_norms, int64_t k,
                      const int8_t* p, int dp, const int32_t* qp, const float* a, const float* c, const float* e,
                      const float* g, const float* dn, int64_t m, int threads, float* ub, int64_t* out_ids,
                      float* out_scores, int64_t* out_scored) {
    if (n < 0 || d <= 0 || dp <= 0 || dp % 2 || nq < 0 || k <= 0 || m < k || threads <= 0) return -1;
    if (n <= m) {  // nothing to prune
        for (int b = 0; b < nq; ++b) out_scored[b] = n;
        return fp16_topk(x, n, d, q, nq, sq_norms, k, threads, out_ids, out_scores);
    }
    if (nq == 0) return 0;
    // 1. Bounds of every row for every query ([nq, n] floats) and each query's m rows of highest bound. A chunk
    // run twice writes the same bounds (computed in a buffer of its own, then stored).
    const int64_t chunk = 16384;
    const int parts = (int)std::max<int64_t>(1, std::min<int64_t>(threads, n / (4 * chunk)));
    std::vector<std::vector<TopK>> tops(parts, std::vector<TopK>(nq, TopK(m)));
    const bool stream = (int64_t)nq * n * (int64_t)sizeof(float) > kStreamBytes;
    const BoundTerms terms{a, e, g, c, dn};
    const std::vector<float> bars = starting_bars(p, n, dp, qp, nq, terms, m);
    for (auto& part_tops : tops)
        for (int b = 0; b < nq; ++b) part_tops[b].threshold = bars[b];  // the threshold id stays: ties pass
    parallel_chunks((n + chunk - 1) / chunk, parts, [&](int64_t ci, int part) {
        std::vector<float> block((size_t)nq * kBlock);
        const int64_t hi = std::min(n, (ci + 1) * chunk);
        for (int64_t r0 = ci * chunk; r0 < hi; r0 += kBlock) {
            const int64_t rows = std::min<int64_t>(kBlock, hi - r0);
            for (int g = 0; g < nq; g += kGroup) {
                bound_dots(std::min(kGroup, nq - g), p + r0 * dp, (rows + kLanes - 1) / kLanes, dp / 2,
                           qp + (int64_t)g * (dp / 2), block.data() + (int64_t)g * kBlock, kBlock);
            }
            for (int b = 0; b < nq; ++b) {
                float* s = block.data() + (int64_t)b * kBlock;
                terms.apply(b, r0, rows, s);
                if (stream) {
                    stream_floats(ub + (int64_t)b * n + r0, s, rows);
                } else {
                    memcpy(ub + (int64_t)b * n + r0, s, rows * sizeof(float));
                }
                tops[part][b].offer(s, rows, r0);
            }
        }
        _mm_sfence();  // the streamed bounds are read by other threads in step 3
    });
    // 2. Per query, tau: the k-th best score among its m rows of highest bound (-inf when fewer than k of them
    // have a score: NaN rows). No row of the true top k is worse than tau, so each is one of these or has a bound
    // >= tau. Results per thread slot: a task may run twice.
    const int slots = std::max(1, std::min<int>(threads, nq));
    std::vector<std::vector<std::pair<int64_t, Hit>>> taus(slots);
    parallel_chunks(nq, slots, [&](int64_t b, int slot) {
        std::vector<std::vector<Hit>*> lists;
        for (int part = 0; part < parts; ++part) lists.push_back(&tops[part][b].buf);
        std::vector<int64_t> ids(m);
        std::vector<float> unused(m);
        write_best(lists, m, ids.data(), unused.data());
        ids.erase(std::remove(ids.begin(), ids.end(), -1), ids.end());
        std::sort(ids.begin(), ids.end());  // address order
        TopK top(k);
        offer_rows(x, d, ids.data(), (int64_t)ids.size(), q + b * d, sq_norms, top);
        Hit bar{-INFINITY, INT64_MAX};
        if ((int64_t)top.buf.size() >= k) {
            top.shrink();
            bar = {top.threshold, top.threshold_id};
        }
        taus[slot].push_back({b, bar});
    });
    std::vector<Hit> tau(nq);
    for (auto& list : taus)
        for (auto& [b, bar] : list) tau[b] = bar;
    // 3. The rows whose bound reaches tau, a slice of rows per task (results per thread slot: a task may run twice).
    const int64_t slice = 65536;
    const int64_t nslices = (n + slice - 1) / slice;
    std::vector<std::vector<std::pair<int64_t, std::vector<int64_t>>>> passed(threads);
    parallel_chunks(nq * nslices, threads, [&](int64_t t, int slot) {
        const int64_t b = t / nslices, lo = (t % nslices) * slice, hi = std::min(n, lo + slice);
        const float* s = ub + b * n;
        const float bar = tau[b].score;
        std::vector<int64_t> ids;
        int64_t r = lo;
        for (; r + kLanes <= hi; r += kLanes) {  // a mask per 16 rows (vectorised), most of them empty
            for (uint32_t mask = lanes_at_least(s + r, bar); mask; mask &= mask - 1)
                ids.push_back(r + __builtin_ctz(mask));
        }
        for (; r < hi; ++r) {
            if (s[r] >= bar) ids.push_back(r);
        }
        passed[slot].push_back({t, std::move(ids)});
    });
    std::vector<const std::vector<int64_t>*> rows_of(nq * nslices, nullptr);
    for (auto& list : passed)
        for (auto& [t, ids] : list) rows_of[t] = &ids;  // a task run twice found the same rows
    // 4. Queries whose bounds leave many rows (queries unlike the rows: the bounds are loose) are scanned instead:
    // a row scored for one query costs more than a row of a scan shared by the batch. Rule: the queries with more
    // than n / 8 rows, when together they have more than n / 2.
    std::vector<int64_t> count(nq, 0);
    for (int b = 0; b < nq; ++b)
        for (int64_t i = 0; i < nslices; ++i) count[b] += (int64_t)rows_of[b * nslices + i]->size();
    std::vector<int> heavy;
    int64_t heavy_rows = 0;
    for (int b = 0; b < nq; ++b) {
        if (count[b] > n / 8) {
            heavy.push_back(b);
            heavy_rows += count[b];
        }
    }
    std::vector<char> scan(nq, 0);
    if (heavy_rows > n / 2) {
        std::vector<float> hq((size_t)heavy.size() * d);
        for (size_t i = 0; i < heavy.size(); ++i) memcpy(hq.data() + i * d, q + (int64_t)heavy[i] * d, d * sizeof(float));
        std::vector<int64_t> hids((size_t)heavy.size() * k);
        std::vector<float> hscores((size_t)heavy.size() * k);
        fp16_topk(x, n, d, hq.data(), (int)heavy.size(), sq_norms, k, threads, hids.data(), hscores.data());
        for (size_t i = 0; i < heavy.size(); ++i) {
            const int b = heavy[i];
            scan[b] = 1;
            memcpy(out_ids + (int64_t)b * k, hids.data() + i * k, k * sizeof(int64_t));
            memcpy(out_scores + (int64_t)b * k, hscores.data() + i * k, k * sizeof(float));
            out_scored[b] = n;  // tells a scanned query from a bounded one whose rows all passed (m + n)
        }
    }
    // 5. Score the rows that passed, for the other queries: per slice, each row that passed for any of them is read
    // once and scored for every query it passed for (row_score: the same bits as scoring it query by query). The
    // queries of one batch are often alike (a kNN-LM round's are consecutive states of one text), so their rows
    // overlap (more (query, row) pairs than distinct rows, the more so on a smaller store), and one address-ordered
    // pass over a slice's rows for all queries beat one pass per query for batches of 8 and 16.
    std::vector<std::vector<std::pair<int64_t, std::vector<std::vector<Hit>>>>> found(threads);
    parallel_chunks(nslices, threads, [&](int64_t i, int slot) {
        const int64_t lo = i * slice, rows = std::min(n, lo + slice) - lo;
        std::vector<std::vector<Hit>> hits(nq);
        std::vector<uint32_t> mask(nq > 1 ? rows : 0);
        std::vector<int64_t> ids;
        for (int g = 0; g < nq; g += kMaskBits) {  // queries in groups of 32: one bit each
            const int gn = std::min(kMaskBits, nq - g);
            if (gn == 1) {  // one query: its rows as they are (a mask would cost a pass over the slice)
                if (!scan[g]) {
                    const std::vector<int64_t>& own = *rows_of[g * nslices + i];
                    TopK top = above(tau[g], k);
                    offer_rows(x, d, own.data(), (int64_t)own.size(), q + (int64_t)g * d, sq_norms, top);
                    hits[g] = std::move(top.buf);
                }
                continue;
            }
            std::fill(mask.begin(), mask.end(), 0u);
            for (int j = 0; j < gn; ++j) {
                if (scan[g + j]) continue;
                for (int64_t id : *rows_of[(g + j) * nslices + i]) mask[id - lo] |= 1u << j;
            }
            ids.clear();
            for (int64_t r = 0; r < rows; ++r) {
                if (mask[r]) ids.push_back(lo + r);  // address order
            }
            std::vector<TopK> tops;
            for (int j = 0; j < gn; ++j) tops.push_back(above(tau[g + j], k));
            {
                PairScorer pairs(x, d, sq_norms);
                for (int64_t u = 0; u < (int64_t)ids.size(); ++u) {
                    prefetch_id_ahead(x, d, ids.data(), u, (int64_t)ids.size());
                    const int64_t id = ids[u];
                    for (uint32_t bits = mask[id - lo]; bits; bits &= bits - 1) {
                        const int j = __builtin_ctz(bits);
                        pairs.add(id, q + (int64_t)(g + j) * d, &tops[j]);
                    }
                }
            }  // the last pairs are scored before the hits are taken
            for (int j = 0; j < gn; ++j) hits[g + j] = std::move(tops[j].buf);
        }
        found[slot].push_back({i, std::move(hits)});
    });
    std::vector<const std::vector<Hit>*> hits_of(nq * nslices, nullptr);
    for (auto& list : found)
        for (auto& [i, hits] : list)
            for (int b = 0; b < nq; ++b) hits_of[b * nslices + i] = &hits[b];  // a task run twice found the same
    for (int b = 0; b < nq; ++b) {
        if (scan[b]) continue;
        std::vector<std::vector<Hit>*> lists;
        for (int64_t i = 0; i < nslices; ++i) lists.push_back(const_cast<std::vector<Hit>*>(hits_of[b * nslices + i]));
        out_scored[b] = m + count[b];
        write_best(lists, k, out_ids + (int64_t)b * k, out_scores + (int64_t)b * k);
    }
    return 0;
}

// out[i] = row ids[i] of x widened to float32 ([cnt, d]; exact: every float16 is a float32), for exact re-scoring
// of candidates: numpy widens float16 one value at a time, which for a batch's candidates adds up.
// Returns 0, or -1 when an id is outside [0, n).
int fp16_rows_f32(const uint16_t* x, int64_t n, int d, const int64_t* ids, int64_t cnt, float* out) {
    if (n < 0 || d <= 0 || cnt < 0) return -1;
    for (int64_t i = 0; i < cnt; ++i)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < cnt; ++i) {
        prefetch_id_ahead(x, d, ids, i, cnt, kAheadRowsLight);
        widen_row(x + ids[i] * d, d, out + i * d);
    }
    return 0;
}

// out[b * cnt + i] = the exact score of row ids[b * cnt + i] for query b, bit for bit as ragcore.encoder's
// exact_scores (numpy, float64) computes it from the widened row: ip sum(x * q), l2 -sum((x - q)^2), each product
// or square in float64 and the sum numpy's pairwise one (pairwise_sum), rounded once to float32. Why here: numpy
// gathers, widens and copies the rows to float64 first; here the same scores cost a fraction of that, the rest of
// it the memory latency of scattered rows, which prefetching rows ahead hides in part.
// l2: 1 for -|x - q|^2, 0 for q.x. Returns 0, or -1 on bad arguments or an id outside [0, n).
int fp16_exact_scores(const uint16_t* x, int64_t n, int d, const float* q, int nq, const int64_t* ids, int64_t cnt,
                      int l2, float* out) {
    if (n < 0 || d <= 0 || nq < 0 || cnt < 0) return -1;
    for (int64_t i = 0; i < (int64_t)nq * cnt; ++i)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    std::vector<float> row(d);
    std::vector<double> terms(d);
    for (int b = 0; b < nq; ++b) {
        const float* qb = q + (int64_t)b * d;
        const int64_t* own = ids + (int64_t)b * cnt;
        for (int64_t i = 0; i < cnt; ++i) {
            prefetch_id_ahead(x, d, own, i, cnt, kAheadRowsLight);
            widen_row(x + own[i] * d, d, row.data());
            if (l2) {
                for (int j = 0; j < d; ++j) {
                    const double t = (double)row[j] - (double)qb[j];
                    terms[j] = t * t;
                }
                out[b * cnt + i] = (float)-pairwise_sum(terms.data(), d);
            } else {
                for (int j = 0; j < d; ++j) terms[j] = (double)row[j] * (double)qb[j];
                out[b * cnt + i] = (float)pairwise_sum(terms.data(), d);
            }
        }
    }
    return 0;
}

// The instruction set this library was compiled for.
const char* fp16_isa() {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}

}  // extern "C"
