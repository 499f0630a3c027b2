/* What every kernel file shares: headers, the thread pool, the integer dot of the ISA this
 * library is built for, and the few cross-lane reductions.
 *
 * Numerics rule of the whole library: the value computed for a token row never depends on the
 * rows beside it, on how many there are, on the thread count or on the ISA (AVX2, AVX-VNNI,
 * AVX512-VNNI builds give the same bits). So:
 *   - integer dot products are exact (any order gives the same integer);
 *   - each float output element is one fixed chain of roundings (a sequential FMA chain along k,
 *     along keys, along blocks), whatever tile, panel or thread computes it;
 *   - every cross-lane float reduction uses the 8-lane trees below, never the vector width;
 *   - -ffp-contract=off: only the FMAs written here, never ones the compiler forms.
 */
#ifndef HICACHE_COMMON_H
#define HICACHE_COMMON_H

#define _GNU_SOURCE /* sched_getaffinity in thread_pool.h */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "thread_pool.h"

#define QK 32 /* weights per quantization block along k */
#define NP 8  /* output columns per weight panel: one 256-bit vector of floats */

/* lanes 0..7 summed as ((0+4)+(2+6)) + ((1+5)+(3+7)): one fixed tree */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 vectors -> one vector whose lane i is hsum-like tree of a[i]:
 * ((a0+a1)+(a2+a3)) + ((a4+a5)+(a6+a7)) over a[i]'s lanes, the same tree for every i */
static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* e^x for 8 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial;
 * ~1 ulp on [-87, 88]); below -87 (and -inf) the result is 0, as softmax wants. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f);
    const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    const __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                      _mm256_set1_ps(0.5f)),
                                      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* acc + the u8 x s8 products of w and x summed in 4s (8 int32 lanes). AVX-VNNI (-mavxvnni) or
 * AVX512-VNNI on 256-bit registers (-mavx512vnni -mavx512vl: CPUs with AVX-512 but not the VEX
 * form, e.g. Zen 4) in one instruction; AVX2 in three (pairs to int16, which 15 * 127 * 2 and
 * 127 * 127 * 2 fit without saturating, then pairs of those). Exact integers either way. */
#if defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DOT_U8_S8(acc, w, x) _mm256_dpbusd_avx_epi32(acc, w, x)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DOT_U8_S8(acc, w, x) _mm256_dpbusd_epi32(acc, w, x)
#else
#define HAVE_VNNI 0
#define DOT_U8_S8(acc, w, x) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#endif

/* Register tiles of the products: with AVX-512VL the compiler has 32 vector registers */
#if defined(__AVX512VL__)
#define WIDE_REGS 1
#else
#define WIDE_REGS 0
#endif

static inline __m256 load_half8(const void *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* the first `n` (0..8) lanes of v to y; the rest of y untouched */
static inline void store_lanes(float *y, __m256 v, int n) {
    if (n == NP) {
        _mm256_storeu_ps(y, v);
        return;
    }
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx), v);
}

#endif
