/* C kernels for CPU serving (engine/runtime/layers/cpu_kernels.py builds and loads them).
 *
 * Block-quantized matrix products for decode: y[M, N] = x[M, K] @ W[N, K]^T, W in blocks of
 * QK = 32 weights along K (GGUF's Q4_1 and Q8_0 layouts, scales as float32):
 *
 *   q4_1: qs uint8 [N, K/2], d, m float [N, K/32];  w = d * q + m,  q in 0..15;
 *         block byte j holds weight j (low nibble) and weight j + 16 (high nibble)
 *   q8_0: qs int8 [N, K],    d float [N, K/32];     w = d * q,      q in -127..127
 *
 * q4_1 takes x as llama.cpp does: each row's blocks of 32 rounded to int8 with a float scale
 * (xd = max|x| / 127) and the block's sum kept for the min term, so a block's product is one
 * u8 x s8 multiply-add (maddubs) and one float FMA. That halved the single-row time here (the
 * float-activation kernel was bound by widening every weight to float, ~7 ns a block) at ~0.3%
 * relative error per product, the error llama.cpp serves with. q8_0 does the same (signed
 * weights: |w| as u8 times x carrying w's sign, llama.cpp's q8_0 x q8_0): with float x its
 * widening of every weight to float left the 49,152 x 576 vocab projection at 2/3 of the
 * memory bandwidth on one row and 7x slower on 16 (measured, Zen 4).
 * Parallel over N on the thread pool of thread_pool.h (threads passed explicitly).
 * Needs AVX2 + FMA + F16C (and uses AVX-VNNI or AVX512-VNNI when built with it); the Python side falls back to
 * torch ops when the build fails.
 */
#define _GNU_SOURCE  /* sched_getaffinity in thread_pool.h */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "thread_pool.h"

#define QK 32

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Rows of x are taken RB at a time so each unpacked weight block is reused from registers. */
#define RB 8

/* x [M, K] -> int8 blocks xq [M, K], scales xd [M, K/32], xs = xd * sum(xq) per block */
static void quantize_rows_q8(const float *x, int64_t M, int64_t K, int8_t *xq, float *xd,
                             float *xs) {
    const int64_t nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < M * nb; r++) {
        const float *xb = x + r * QK;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m256i qi[4];
        for (int j = 0; j < 4; j++) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]),
                                            _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* packs work per 128-bit lane: 32 int32 -> 32 int8 come out in lane order 0,4,1,5,.. */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                             _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(xq + r * QK),
                            _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        xd[r] = amax / 127.0f;
        xs[r] = xd[r] * (float)_mm_cvtsi128_si32(s4);
    }
}

/* A block's u8 x s8 products summed in 4s: 8 int32. AVX-VNNI (built with -mavxvnni where the
 * CPU has it) or AVX512-VNNI on 256-bit registers (-mavx512vnni -mavx512vl: CPUs with AVX-512
 * but not the VEX form, e.g. Zen 4) does it in one instruction; AVX2 in two (pairs to int16,
 * which 15 * 127 * 2 fits without saturating, then pairs of those): the same integers, so the
 * same results. */
#if defined(__AVXVNNI__)
#define DOT_U8_S8(w, x) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8_S8(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
#else
#define DOT_U8_S8(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1))
#endif

/* One weight row n against R rows of x (R a compile-time constant after inlining, so the
 * accumulators stay in registers: a runtime row count spilled them to the stack, a store-forward
 * on every block's dependency chain, ~2x slower). Weight nibbles 0..15 as u8 x int8 x. */
static inline __attribute__((always_inline)) void q4_1_rows(
    const uint8_t *wq, const float *wd, const float *wm, const int8_t *xq, const float *xd,
    const float *xs, int64_t K, int64_t nb, const int R, float *y, int64_t ystride) {
    __m256 acc[RB];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        /* byte j: weight j (low nibble) and j + 16 (high): low lane 0..15, high lane 16..31 */
        const __m128i v = _mm_loadu_si128((const __m128i *)(wq + b * 16));
        const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), mask);
        for (int i = 0; i < R; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
            const __m256i p = DOT_U8_S8(w, xv);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(wd[b] * xd[i * nb + b]),
                                     _mm256_cvtepi32_ps(p), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) {  /* + sum_b m_b * sum(x_b) */
        const float *xsi = xs + i * nb;
        __m256 mv = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
            mv = _mm256_fmadd_ps(_mm256_loadu_ps(wm + b), _mm256_loadu_ps(xsi + b), mv);
        float mins = hsum8(mv);
        for (; b < nb; b++) mins += wm[b] * xsi[b];
        y[i * ystride] = hsum8(acc[i]) + mins;
    }
}

/* q8_0 rows against int8 x: |w| (u8; -128 -> 128) times x with w's sign, so the u8 x s8 dot
 * applies (x is in -127..127, so negating it never overflows; maddubs' int16 pairs stay within
 * 2 * 128 * 127). */
static inline __attribute__((always_inline)) void q8_0_rows(
    const int8_t *wq, const float *wd, const int8_t *xq, const float *xd, int64_t K, int64_t nb,
    const int R, float *y, int64_t ystride) {
    __m256 acc[RB];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
        const __m256i aw = _mm256_sign_epi8(w, w);
        for (int i = 0; i < R; i++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + b * QK));
            const __m256i p = DOT_U8_S8(aw, _mm256_sign_epi8(xv, w));
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(wd[b] * xd[i * nb + b]),
                                     _mm256_cvtepi32_ps(p), acc[i]);
        }
    }
    for (int i = 0; i < R; i++) y[i * ystride] = hsum8(acc[i]);
}

/* dispatch a runtime row count 1..RB onto the specialised bodies */
#define ROWS_SWITCH(rows, CALL) \
    switch (rows) {             \
    case 1: CALL(1); break;     \
    case 2: CALL(2); break;     \
    case 3: CALL(3); break;     \
    case 4: CALL(4); break;     \
    case 5: CALL(5); break;     \
    case 6: CALL(6); break;     \
    case 7: CALL(7); break;     \
    default: CALL(8); break;    \
    }

/* A product's operands: x as int8 blocks (xq, xd, xs from quantize_rows_q8; xs is the q4_1
 * min term's). W rows [n0, n1) are one thread's share; bias (or NULL) is added after. */
typedef struct {
    const float *x;
    const int8_t *xq;
    const float *xd, *xs;
    int64_t M, K;
    const void *qs;
    const float *d, *m, *bias;  /* m: q4_1 mins, NULL for q8_0 */
    int64_t N;
    float *y;
} Product;

static void product_rows(void *ctx, int64_t n0, int64_t n1) {
    const Product *p = ctx;
    const int64_t K = p->K, nb = K / QK, M = p->M, N = p->N;
    for (int64_t n = n0; n < n1; n++) {
        const float *wd = p->d + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += RB) {
            const int rows = (int)(M - r0 < RB ? M - r0 : RB);
            float *y = p->y + r0 * N + n;
            if (p->m) {
                const uint8_t *wq = (const uint8_t *)p->qs + n * (K / 2);
                const float *wm = p->m + n * nb;
#define Q4_CALL(R) q4_1_rows(wq, wd, wm, p->xq + r0 * K, p->xd + r0 * nb, p->xs + r0 * nb, K, nb, R, y, N)
                ROWS_SWITCH(rows, Q4_CALL)
#undef Q4_CALL
            } else {
                const int8_t *wq = (const int8_t *)p->qs + n * K;
#define Q8_CALL(R) q8_0_rows(wq, wd, p->xq + r0 * K, p->xd + r0 * nb, K, nb, R, y, N)
                ROWS_SWITCH(rows, Q8_CALL)
#undef Q8_CALL
            }
        }
        if (p->bias)
            for (int64_t r = 0; r < M; r++) p->y[r * N + n] += p->bias[n];
    }
}

/* x quantized to int8 blocks once per call (quantize_rows_q8), then rows in parallel over N;
 * m NULL: q8_0 */
static int linear_q8x(const float *x, int64_t M, int64_t K, const void *qs, const float *d,
                      const float *m, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb)), *xs = malloc(sizeof(float) * (size_t)(M * nb));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    quantize_rows_q8(x, M, K, xq, xd, xs);
    Product p = {x, xq, xd, xs, M, K, qs, d, m, NULL, N, y};
    pool_for(N, nthreads, product_rows, &p, POOL_SPIN_NS);
    free(xq), free(xd), free(xs);
    return 0;
}

int linear_q4_1_q8(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                   const float *m, int64_t N, float *y, int nthreads) {
    return linear_q8x(x, M, K, qs, d, m, N, y, nthreads);
}

int linear_q8_0_q8(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                   int64_t N, float *y, int nthreads) {
    return linear_q8x(x, M, K, qs, d, NULL, N, y, nthreads);
}

/* W -> float32 [N, K] (prefill runs a dense GEMM on it, one layer at a time). mul then add, no
 * FMA: the same rounding as gguf-py's dequantization, so the floats equal the dense weights.
 * The _bf16 variants round those floats to bfloat16 (to nearest, ties to even, as torch's
 * conversion does) in the same pass: a separate torch conversion cost ~25x the dequantization. */
typedef struct {
    const void *qs;
    const float *d, *m;
    void *w;   /* float [N, K], or uint16 bf16 bits when bf16 */
    int bf16;
} Dequant;

static inline void store8(const Dequant *a, int64_t at, __m256 v) {
    if (!a->bf16) {
        _mm256_storeu_ps((float *)a->w + at, v);
        return;
    }
    __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    /* packus works per 128-bit lane: [u0..3 u0..3 | u4..7 u4..7] -> take 64 bits of each lane */
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
    _mm_storeu_si128((__m128i *)((uint16_t *)a->w + at), _mm256_castsi256_si128(p));
}

static void dequant_q4_1_blocks(void *ctx, int64_t i0, int64_t i1) {
    const Dequant *a = ctx;
    const uint8_t *qs = a->qs;
    const float *d = a->d, *m = a->m;
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t i = i0; i < i1; i++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(qs + i * 16));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        const __m256 db = _mm256_set1_ps(d[i]), mb = _mm256_set1_ps(m[i]);
        for (int j = 0; j < 4; j++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            store8(a, i * QK + 8 * j, _mm256_add_ps(_mm256_mul_ps(q, db), mb));
        }
    }
}

static void dequant_q8_0_blocks(void *ctx, int64_t i0, int64_t i1) {
    const Dequant *a = ctx;
    const int8_t *qs = a->qs;
    const float *d = a->d;
    for (int64_t i = i0; i < i1; i++) {
        const __m256 db = _mm256_set1_ps(d[i]);
        for (int j = 0; j < 4; j++) {
            __m256 q = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + i * QK + 8 * j))));
            store8(a, i * QK + 8 * j, _mm256_mul_ps(q, db));
        }
    }
}

void dequant_q4_1(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                  float *w, int nthreads) {
    Dequant a = {qs, d, m, w, 0};
    pool_for(N * (K / QK), nthreads, dequant_q4_1_blocks, &a, 0);
}

void dequant_q4_1_bf16(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                       uint16_t *w, int nthreads) {
    Dequant a = {qs, d, m, w, 1};
    pool_for(N * (K / QK), nthreads, dequant_q4_1_blocks, &a, 0);
}

void dequant_q8_0(const int8_t *qs, const float *d, int64_t N, int64_t K, float *w, int nthreads) {
    Dequant a = {qs, d, NULL, w, 0};
    pool_for(N * (K / QK), nthreads, dequant_q8_0_blocks, &a, 0);
}

void dequant_q8_0_bf16(const int8_t *qs, const float *d, int64_t N, int64_t K, uint16_t *w,
                       int nthreads) {
    Dequant a = {qs, d, NULL, w, 1};
    pool_for(N * (K / QK), nthreads, dequant_q8_0_blocks, &a, 0);
}

/* ------------------------------------------------------------------ per-layer small ops
 * The decoder's non-matmul work for CPU decode, one call each instead of 5-10 torch ops. */

/* out = rms_norm(x + residual) * w; residual_out = x + residual (residual may be NULL: no add) */
void rms_norm_residual(const float *x, const float *residual, const float *w, float eps,
                       int64_t rows, int64_t hidden, float *out, float *residual_out) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *ro = residual_out ? residual_out + r * hidden : NULL;
        const float *src = xr;
        if (residual) {
            const float *rr = residual + r * hidden;
            for (int64_t j = 0; j < hidden; j++) ro[j] = xr[j] + rr[j];
            src = ro;
        }
        __m256 ss = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= hidden; j += 8) {
            __m256 v = _mm256_loadu_ps(src + j);
            ss = _mm256_fmadd_ps(v, v, ss);
        }
        float sum = hsum8(ss);
        for (; j < hidden; j++) sum += src[j] * src[j];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
        for (j = 0; j < hidden; j++) o[j] = src[j] * inv * w[j];
    }
}

/* Neox RoPE in place on the first `nheads` heads of each token row of x (row stride
 * `token_stride` floats, heads contiguous, head_dim hd); cache [max_pos, hd] = cos half | sin half */
void rope_neox_inplace(float *x, int64_t tokens, int64_t token_stride, int64_t nheads, int64_t hd,
                       const int64_t *positions, const float *cos_sin) {
    const int64_t half = hd / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *cs = cos_sin + positions[t] * hd;
        for (int64_t h = 0; h < nheads; h++) {
            float *v = x + t * token_stride + h * hd;
            for (int64_t i = 0; i < half; i++) {
                const float c = cs[i], s = cs[half + i], a = v[i], b = v[half + i];
                v[i] = a * c - b * s;
                v[half + i] = b * c + a * s;
            }
        }
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
    float s = hsum8(acc);
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* e^x for 8 floats (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial;
 * ~1 ulp on [-87, 88]); below -87 the result is flushed to 0, as softmax wants. */
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

/* act[r, :] = silu(gu[r, :inter]) * gu[r, inter:] (the MLP's gate and up halves), rows r0..r1 */
typedef struct {
    const float *gu;
    int64_t inter;
    float *act;
} SiluMul;

static void silu_mul_rows(void *ctx, int64_t r0, int64_t r1) {
    const SiluMul *c = ctx;
    const int64_t inter = c->inter;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
        const float *g = c->gu + r * 2 * inter, *u = g + inter;
        float *a = c->act + r * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) a[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

void silu_mul(const float *gu, int64_t M, int64_t inter, float *act, int nthreads) {
    SiluMul c = {gu, inter, act};
    pool_for(M, M * inter > 65536 ? nthreads : 1, silu_mul_rows, &c, POOL_SPIN_NS);
}

#define ABLK 64     /* keys per online-softmax block */
#define AMAXG 16    /* query heads per kv head handled */
#define AMAXHD 256  /* head_dim handled */

/* One query group (G heads sharing kv head kvh) of one request over keys [t0, t1): the
 * un-normalised output acc[G, hd] and each head's running max mx[G] and denominator l[G] (the
 * flash-decoding partial; merging partials of one row gives the exact softmax). */
static void attend_span(const float *qg, const float *k, const float *v, const int32_t *slots,
                        int64_t t0, int64_t t1, int64_t kv_heads, int64_t kvh, int64_t hd,
                        int64_t group, float scale, float *acc, float *mx, float *l) {
    float s[AMAXG][ABLK];
    for (int64_t g = 0; g < group; g++) mx[g] = -INFINITY, l[g] = 0.0f;
    for (int64_t j = 0; j < group * hd; j++) acc[j] = 0.0f;
    for (int64_t b0 = t0; b0 < t1; b0 += ABLK) {
        const int64_t n = t1 - b0 < ABLK ? t1 - b0 : ABLK;
        for (int64_t t = 0; t < n; t++) {  /* each K row is read once for the whole group */
            const float *kt = k + ((int64_t)slots[b0 + t] * kv_heads + kvh) * hd;
            for (int64_t g = 0; g < group; g++) s[g][t] = dot_f32(qg + g * hd, kt, hd) * scale;
        }
        for (int64_t g = 0; g < group; g++) {
            float bm = -INFINITY;
            for (int64_t t = 0; t < n; t++) bm = s[g][t] > bm ? s[g][t] : bm;
            const float m_new = bm > mx[g] ? bm : mx[g];
            const float rescale = expf(mx[g] - m_new);  /* 0 on the first block */
            const __m256 mv = _mm256_set1_ps(m_new);
            __m256 sum = _mm256_setzero_ps();
            int64_t t = 0;
            for (; t + 8 <= n; t += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s[g] + t), mv));
                _mm256_storeu_ps(s[g] + t, p);
                sum = _mm256_add_ps(sum, p);
            }
            float tail = 0.0f;
            for (; t < n; t++) tail += (s[g][t] = expf(s[g][t] - m_new));
            l[g] = l[g] * rescale + hsum8(sum) + tail;
            mx[g] = m_new;
            /* acc = acc * rescale + P V, 64 floats of the head at a time in registers */
            for (int64_t c = 0; c < hd; c += 64) {
                const int64_t w = hd - c < 64 ? (hd - c) / 8 : 8;
                float *ac = acc + g * hd + c;
                __m256 r[8];
                const __m256 rs = _mm256_set1_ps(rescale);
                for (int i = 0; i < w; i++) r[i] = _mm256_mul_ps(_mm256_loadu_ps(ac + 8 * i), rs);
                for (int64_t tt = 0; tt < n; tt++) {
                    const float *vt = v + ((int64_t)slots[b0 + tt] * kv_heads + kvh) * hd + c;
                    const __m256 p = _mm256_set1_ps(s[g][tt]);
                    for (int i = 0; i < w; i++) r[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + 8 * i), r[i]);
                }
                for (int i = 0; i < w; i++) _mm256_storeu_ps(ac + 8 * i, r[i]);
            }
        }
    }
}

/* Decode attention straight from the paged pool (no gather): request b's single query attends
 * to slots req_to_token[row_b, 0:seq_len_b]. q/out [bs, heads*hd]; k/v [slots, kv_heads, hd];
 * hd a multiple of 8 up to AMAXHD, heads / kv_heads up to AMAXG (else -2: the caller falls
 * back). Tasks are (request, kv head, span of keys): a long row is split into spans so both
 * threads have work even at one request, and the spans' partials are merged exactly. Threads
 * take tasks from a shared counter (rows differ in length). */
typedef struct {
    const float *q, *k, *v;
    const int32_t *req_to_token;
    int64_t r2t_stride;
    const int64_t *rows, *seq_lens;
    int64_t bs, heads, kv_heads, hd, group, spans, span_len, ntasks, part;
    float scale;
    float *parts, *out;  /* parts: [ntasks, part] partials (acc | max | denominator) */
    atomic_llong next;   /* the next task to take */
} Attention;

/* Fills in the task split; -2 when the shape is not handled. */
static int attention_plan(Attention *a, int nthreads) {
    a->group = a->heads / a->kv_heads;
    if (a->group > AMAXG || a->hd > AMAXHD || a->hd % 8) return -2;
    int64_t max_len = 1;
    for (int64_t b = 0; b < a->bs; b++) max_len = a->seq_lens[b] > max_len ? a->seq_lens[b] : max_len;
    /* enough tasks for ~4 per thread, spans no shorter than 4 blocks */
    int64_t spans = (4 * (int64_t)nthreads + a->bs * a->kv_heads - 1) / (a->bs * a->kv_heads);
    const int64_t most = (max_len + 4 * ABLK - 1) / (4 * ABLK);
    spans = spans < most ? spans : most;
    a->spans = spans < 1 ? 1 : spans;
    a->span_len = ((max_len + a->spans - 1) / a->spans + ABLK - 1) / ABLK * ABLK;
    a->ntasks = a->bs * a->kv_heads * a->spans;
    a->part = a->group * (a->hd + 2);
    atomic_store(&a->next, 0);
    return 0;
}

static void attention_tasks(Attention *a) {
    const int64_t kv_heads = a->kv_heads, spans = a->spans, group = a->group, hd = a->hd;
    for (int64_t task; (task = atomic_fetch_add(&a->next, 1)) < a->ntasks;) {
        const int64_t b = task / (kv_heads * spans), kvh = task / spans % kv_heads;
        const int64_t t0 = task % spans * a->span_len, n = a->seq_lens[b];
        const int64_t t1 = t0 + a->span_len < n ? t0 + a->span_len : n;
        float *pa = a->parts + task * a->part;
        attend_span(a->q + b * a->heads * hd + kvh * group * hd, a->k, a->v,
                    a->req_to_token + a->rows[b] * a->r2t_stride, t0, t1 > t0 ? t1 : t0, kv_heads,
                    kvh, hd, group, a->scale, pa, pa + group * hd, pa + group * hd + group);
    }
}

/* each head's spans: out = sum_i e^(m_i - m) acc_i / sum_i e^(m_i - m) l_i */
static void attention_merge(const Attention *a) {
    const int64_t group = a->group, hd = a->hd, spans = a->spans, part = a->part;
    for (int64_t b = 0; b < a->bs; b++)
        for (int64_t kvh = 0; kvh < a->kv_heads; kvh++)
            for (int64_t g = 0; g < group; g++) {
                const float *p0 = a->parts + (b * a->kv_heads + kvh) * spans * part;
                float m = -INFINITY, denom = 0.0f;
                for (int64_t i = 0; i < spans; i++) {
                    const float mi = p0[i * part + group * hd + g];
                    m = mi > m ? mi : m;
                }
                float *o = a->out + b * a->heads * hd + (kvh * group + g) * hd;
                for (int64_t j = 0; j < hd; j++) o[j] = 0.0f;
                for (int64_t i = 0; i < spans; i++) {
                    const float *pi = p0 + i * part;
                    const float mi = pi[group * hd + g];
                    if (mi == -INFINITY) continue;  /* an empty span */
                    const float w = expf(mi - m);
                    denom += w * pi[group * hd + group + g];
                    for (int64_t j = 0; j < hd; j++) o[j] += w * pi[g * hd + j];
                }
                const float inv = denom > 0.0f ? 1.0f / denom : 0.0f;
                for (int64_t j = 0; j < hd; j++) o[j] *= inv;
            }
}

static void attention_job(void *ctx, int tid, int nt) {
    (void)tid, (void)nt;
    attention_tasks(ctx);
}

int decode_attention(const float *q, const float *k, const float *v, const int32_t *req_to_token,
                     int64_t r2t_stride, const int64_t *rows, const int64_t *seq_lens, int64_t bs,
                     int64_t heads, int64_t kv_heads, int64_t hd, float scale, float *out,
                     int nthreads) {
    Attention a = {.q = q, .k = k, .v = v, .req_to_token = req_to_token, .r2t_stride = r2t_stride,
                   .rows = rows, .seq_lens = seq_lens, .bs = bs, .heads = heads,
                   .kv_heads = kv_heads, .hd = hd, .scale = scale, .out = out};
    if (attention_plan(&a, nthreads)) return -2;
    a.parts = malloc(sizeof(float) * (size_t)(a.ntasks * a.part));
    if (!a.parts) return -1;
    pool_run(attention_job, &a, a.ntasks < nthreads ? (int)a.ntasks : nthreads, POOL_SPIN_NS);
    attention_merge(&a);
    free(a.parts);
    return 0;
}

/* ------------------------------------------------------------------ a whole decode stack
 * Decode of a Llama-family stack (pre-norm, fused qkv and gate_up, neox RoPE, SiLU MLP) in one
 * call: at 1-16 rows the per-layer Python and torch dispatch (~40 ops, ~0.3 ms a layer) cost
 * as much as the matmuls. The products, norm, RoPE and attention are the functions above, so
 * the numbers are those of the per-module path. */

typedef struct {
    const void *qs;   /* q4_1: uint8 [n, k/2]; q8_0: int8 [n, k] */
    const float *d;   /* [n, k/32] */
    const float *m;   /* q4_1 mins [n, k/32]; NULL for q8_0 */
    const float *bias;  /* [n] or NULL */
    int64_t n, k;
} QLinear;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] */
    QLinear qkv, o, gate_up, down;
    float *k_cache, *v_cache;  /* this layer's pool [slots, kv_heads, hd] */
} DecodeLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, hd, inter;
    float eps, scale;
    const float *cos_sin;  /* [max_position, hd]: cos half | sin half */
} DecodeShape;

/* A whole step is one pool job: the products are split over each thread's share of the weight
 * rows, attention tasks come from a shared counter, and the small serial work (norms, RoPE,
 * the K/V store, rounding x to int8 blocks, the attention merge) runs on thread 0 while the
 * others wait at the barrier. */
typedef struct {
    const DecodeLayer *layers;
    int64_t nlayers, M;
    const DecodeShape *s;
    float *hidden, *residual;
    const int64_t *positions, *out_loc;
    float *normed, *wide, *narrow;  /* see decode_layers */
    int8_t *xq;                     /* x of the next product as int8 blocks */
    float *xd, *xs;
    Attention attn;
} Step;

/* y = x @ W^T (+ bias): this thread's share of W's rows; x is st->xq already */
static void step_product(const Step *st, const QLinear *L, const float *x, float *y, int tid,
                         int nt) {
    const Product p = {x, st->xq, st->xd, st->xs, st->M, L->k, L->qs, L->d, L->m, L->bias, L->n, y};
    const int64_t n0 = L->n * tid / nt, n1 = L->n * (tid + 1) / nt;
    if (n1 > n0) product_rows((void *)&p, n0, n1);
}

/* thread 0, before a product of x [M, K] by L: x as int8 blocks */
static void step_round(const Step *st, const QLinear *L, const float *x) {
    quantize_rows_q8(x, st->M, L->k, st->xq, st->xd, st->xs);
}

static void step_job(void *ctx, int tid, int nt) {
    Step *st = ctx;
    const DecodeShape *s = st->s;
    const int64_t M = st->M, H = s->hidden, qkv_n = (s->heads + 2 * s->kv_heads) * s->hd;
    const int64_t q_n = s->heads * s->hd, kv_n = s->kv_heads * s->hd;
    float *hidden = st->hidden, *residual = st->residual;
    float *normed = st->normed, *wide = st->wide, *narrow = st->narrow;
    for (int64_t l = 0; l < st->nlayers; l++) {
        const DecodeLayer *L = st->layers + l;
        if (tid == 0) {
            if (l == 0) {
                for (int64_t i = 0; i < M * H; i++) residual[i] = hidden[i];
                rms_norm_residual(hidden, NULL, L->input_norm, s->eps, M, H, normed, NULL);
            } else {  /* residual += hidden (in place: element-wise), normed = norm(residual) */
                rms_norm_residual(hidden, residual, L->input_norm, s->eps, M, H, normed, residual);
            }
            step_round(st, &L->qkv, normed);
        }
        pool_barrier(nt);
        step_product(st, &L->qkv, normed, wide, tid, nt);  /* [M, q | k | v] */
        pool_barrier(nt);
        if (tid == 0) {
            rope_neox_inplace(wide, M, qkv_n, s->heads + s->kv_heads, s->hd, st->positions,
                              s->cos_sin);
            for (int64_t b = 0; b < M; b++) {  /* the new token's K/V into the pool */
                const float *kb = wide + b * qkv_n + q_n;
                for (int64_t j = 0; j < kv_n; j++) {
                    L->k_cache[st->out_loc[b] * kv_n + j] = kb[j];
                    L->v_cache[st->out_loc[b] * kv_n + j] = kb[kv_n + j];
                }
            }
            /* q rows are strided by qkv_n: pack them for the attention kernel */
            for (int64_t b = 0; b < M; b++)
                for (int64_t j = 0; j < q_n; j++) normed[b * q_n + j] = wide[b * qkv_n + j];
            st->attn.k = L->k_cache, st->attn.v = L->v_cache;
            atomic_store(&st->attn.next, 0);
        }
        pool_barrier(nt);
        attention_tasks(&st->attn);  /* q = normed, out = narrow */
        pool_barrier(nt);
        if (tid == 0) {
            attention_merge(&st->attn);
            step_round(st, &L->o, narrow);
        }
        pool_barrier(nt);
        step_product(st, &L->o, narrow, hidden, tid, nt);
        pool_barrier(nt);
        if (tid == 0) {
            rms_norm_residual(hidden, residual, L->post_norm, s->eps, M, H, normed, residual);
            step_round(st, &L->gate_up, normed);
        }
        pool_barrier(nt);
        step_product(st, &L->gate_up, normed, wide, tid, nt);
        pool_barrier(nt);
        if (tid == 0) {
            const SiluMul sm = {wide, s->inter, narrow};
            silu_mul_rows((void *)&sm, 0, M);
            step_round(st, &L->down, narrow);
        }
        pool_barrier(nt);
        step_product(st, &L->down, narrow, hidden, tid, nt);
        pool_barrier(nt);
    }
}

/* hidden [M, H] in: the embeddings; out: the last layer's MLP output. residual [M, H] out: the
 * stream before the final norm (the caller applies it: norm(hidden + residual)). Row b is
 * request b: position positions[b], new KV slot out_loc[b], KV row rows[b] of req_to_token.
 * 0 ok, -1 out of memory, -2 attention shape not taken. */
int decode_layers(const DecodeLayer *layers, int64_t nlayers, const DecodeShape *s, float *hidden,
                  float *residual, int64_t M, const int64_t *positions, const int64_t *out_loc,
                  const int32_t *req_to_token, int64_t r2t_stride, const int64_t *rows,
                  const int64_t *seq_lens, int nthreads) {
    const int64_t H = s->hidden, qkv_n = (s->heads + 2 * s->kv_heads) * s->hd;
    const int64_t q_n = s->heads * s->hd;
    const int64_t widest = qkv_n > 2 * s->inter ? qkv_n : 2 * s->inter;
    int64_t kmax = H > q_n ? H : q_n;
    kmax = kmax > s->inter ? kmax : s->inter;
    Step st = {.layers = layers, .nlayers = nlayers, .M = M, .s = s, .hidden = hidden,
               .residual = residual, .positions = positions, .out_loc = out_loc};
    st.attn = (Attention){.q = NULL, .req_to_token = req_to_token, .r2t_stride = r2t_stride,
                          .rows = rows, .seq_lens = seq_lens, .bs = M, .heads = s->heads,
                          .kv_heads = s->kv_heads, .hd = s->hd, .scale = s->scale};
    if (attention_plan(&st.attn, nthreads)) return -2;
    /* normed: the norm's output, then the packed q; narrow: attention out, then the SiLU's */
    st.normed = malloc(sizeof(float) * (size_t)(M * (q_n > H ? q_n : H)));
    st.wide = malloc(sizeof(float) * (size_t)(M * widest));
    st.narrow = malloc(sizeof(float) * (size_t)(M * (q_n > s->inter ? q_n : s->inter)));
    st.xq = malloc((size_t)(M * kmax));
    st.xd = malloc(sizeof(float) * (size_t)(M * (kmax / QK)));
    st.xs = malloc(sizeof(float) * (size_t)(M * (kmax / QK)));
    st.attn.parts = malloc(sizeof(float) * (size_t)(st.attn.ntasks * st.attn.part));
    int rc = -1;
    if (st.normed && st.wide && st.narrow && st.xq && st.xd && st.xs && st.attn.parts) {
        st.attn.q = st.normed, st.attn.out = st.narrow;
        pool_run(step_job, &st, nthreads, POOL_SPIN_NS);
        rc = 0;
    }
    free(st.normed), free(st.wide), free(st.narrow), free(st.xq), free(st.xd), free(st.xs);
    free(st.attn.parts);
    return rc;
}
