/* C kernels for CPU serving (engine/runtime/layers/cpu_kernels.py builds and loads them).
 *
 * Block-quantized matrix products for decode: y[M, N] = x[M, K] @ W[N, K]^T, W in blocks of
 * QK = 32 weights along K (GGUF's Q4_1 and Q8_0 layouts, scales as float32):
 *
 *   q4_1: qs uint8 [N, K/2], d, m float [N, K/32];  w = d * q + m,  q in 0..15;
 *         block byte j holds weight j (low nibble) and weight j + 16 (high nibble)
 *   q8_0: qs int8 [N, K],    d float [N, K/32];     w = d * q,      q in -127..127
 *
 * x stays float32: each weight block is widened to float once and FMA'd with up to RB rows, so
 * the product equals the dense one up to float reassociation. (Quantizing x to int8 per block
 * as llama.cpp does was measured no faster here for 1-16 rows and 1e4x less exact.)
 * Parallel over N with OpenMP (the same libgomp torch loads; threads passed explicitly).
 * Needs AVX2 + FMA + F16C; the Python side falls back to torch ops when the build fails.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define QK 32

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* Rows of x are taken RB at a time so each widened weight block is reused from registers. */
#define RB 8

/* One weight row n against R rows of x (R a compile-time constant after inlining, so the
 * accumulators stay in registers: a runtime row count spilled them to the stack, a store-forward
 * on every block's dependency chain, ~2x slower). */
static inline __attribute__((always_inline)) void q4_1_rows(
    const uint8_t *wq, const float *wd, const float *wm, const float *x, const float *xsum,
    int64_t K, int64_t nb, const int R, float *y, int64_t ystride) {
    __m256 acc[RB];
    float mins[RB];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps(), mins[i] = 0.0f;
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(wq + b * 16));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
        const __m256 db = _mm256_set1_ps(wd[b]);
        for (int i = 0; i < R; i++) {
            const float *xb = x + i * K + b * QK;
            __m256 s = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), s);
            s = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), s);
            s = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), s);
            acc[i] = _mm256_fmadd_ps(db, s, acc[i]);
            mins[i] += wm[b] * xsum[i * nb + b];
        }
    }
    for (int i = 0; i < R; i++) y[i * ystride] = hsum8(acc[i]) + mins[i];
}

static inline __attribute__((always_inline)) void q8_0_rows(
    const int8_t *wq, const float *wd, const float *x, int64_t K, int64_t nb, const int R,
    float *y, int64_t ystride) {
    __m256 acc[RB];
    for (int i = 0; i < R; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256 w[4];
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wq + b * QK + 8 * j))));
        const __m256 db = _mm256_set1_ps(wd[b]);
        for (int i = 0; i < R; i++) {
            const float *xb = x + i * K + b * QK;
            __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
            for (int j = 1; j < 4; j++) s = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + 8 * j), s);
            acc[i] = _mm256_fmadd_ps(db, s, acc[i]);
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

/* float32 activations; the q4_1 min term uses sum(x) per block */
int linear_q4_1_f32(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                    const float *m, int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
    float *xsum = malloc(sizeof(float) * (size_t)(M * nb));
    if (!xsum) return -1;
    for (int64_t r = 0; r < M * nb; r++) {
        float s = 0.0f;
        for (int j = 0; j < QK; j++) s += x[r * QK + j];
        xsum[r] = s;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wq = qs + n * (K / 2);
        const float *wd = d + n * nb, *wm = m + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += RB) {
            const int rows = (int)(M - r0 < RB ? M - r0 : RB);
#define Q4_CALL(R) q4_1_rows(wq, wd, wm, x + r0 * K, xsum + r0 * nb, K, nb, R, y + r0 * N + n, N)
            ROWS_SWITCH(rows, Q4_CALL)
#undef Q4_CALL
        }
    }
    free(xsum);
    return 0;
}

int linear_q8_0_f32(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                    int64_t N, float *y, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wq = qs + n * K;
        const float *wd = d + n * nb;
        for (int64_t r0 = 0; r0 < M; r0 += RB) {
            const int rows = (int)(M - r0 < RB ? M - r0 : RB);
#define Q8_CALL(R) q8_0_rows(wq, wd, x + r0 * K, K, nb, R, y + r0 * N + n, N)
            ROWS_SWITCH(rows, Q8_CALL)
#undef Q8_CALL
        }
    }
    return 0;
}

/* W -> float32 [N, K] (prefill runs a dense GEMM on it, one layer at a time). mul then add, no
 * FMA: the same rounding as gguf-py's dequantization, so the floats equal the dense weights. */
void dequant_q4_1(const uint8_t *qs, const float *d, const float *m, int64_t N, int64_t K,
                  float *w, int nthreads) {
    const int64_t nb = K / QK;
    const __m128i mask = _mm_set1_epi8(0x0F);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < N * nb; i++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(qs + i * 16));
        const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        const __m256 db = _mm256_set1_ps(d[i]), mb = _mm256_set1_ps(m[i]);
        for (int j = 0; j < 4; j++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            _mm256_storeu_ps(w + i * QK + 8 * j, _mm256_add_ps(_mm256_mul_ps(q, db), mb));
        }
    }
}

void dequant_q8_0(const int8_t *qs, const float *d, int64_t N, int64_t K, float *w, int nthreads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < N * nb; i++) {
        const __m256 db = _mm256_set1_ps(d[i]);
        for (int j = 0; j < 4; j++) {
            __m256 q = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + i * QK + 8 * j))));
            _mm256_storeu_ps(w + i * QK + 8 * j, _mm256_mul_ps(q, db));
        }
    }
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

/* Decode attention straight from the paged pool (no gather): request b's single query attends
 * to slots req_to_token[row_b, 0:seq_len_b]. q/out [bs, heads*hd]; k/v [slots, kv_heads, hd].
 * Parallel over (request, kv head): the group's G query heads share each K/V row read. Scores
 * in a per-task buffer [G, seq_len]; softmax in float, two passes. */
int decode_attention(const float *q, const float *k, const float *v, const int32_t *req_to_token,
                     int64_t r2t_stride, const int64_t *rows, const int64_t *seq_lens, int64_t bs,
                     int64_t heads, int64_t kv_heads, int64_t hd, float scale, float *out,
                     int nthreads) {
    const int64_t group = heads / kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t task = 0; task < bs * kv_heads; task++) {
        const int64_t b = task / kv_heads, kvh = task % kv_heads;
        const int64_t n = seq_lens[b];
        const int32_t *slots = req_to_token + rows[b] * r2t_stride;
        const float *qg = q + b * heads * hd + kvh * group * hd;  /* G heads, adjacent */
        float *og = out + b * heads * hd + kvh * group * hd;
        float *scores = malloc(sizeof(float) * (size_t)(group * (n > 0 ? n : 1)));
        if (!scores) {
            failed = 1;
            continue;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *kt = k + ((int64_t)slots[t] * kv_heads + kvh) * hd;
            for (int64_t g = 0; g < group; g++) scores[g * n + t] = dot_f32(qg + g * hd, kt, hd) * scale;
        }
        for (int64_t g = 0; g < group; g++) {
            float *sg = scores + g * n, mx = -INFINITY, denom = 0.0f;
            for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
            for (int64_t t = 0; t < n; t++) denom += (sg[t] = expf(sg[t] - mx));
            for (int64_t t = 0; t < n; t++) sg[t] /= denom;
        }
        for (int64_t j = 0; j < group * hd; j++) og[j] = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            const float *vt = v + ((int64_t)slots[t] * kv_heads + kvh) * hd;
            for (int64_t g = 0; g < group; g++) {
                const __m256 p = _mm256_set1_ps(scores[g * n + t]);
                float *oh = og + g * hd;
                int64_t j = 0;
                for (; j + 8 <= hd; j += 8)
                    _mm256_storeu_ps(oh + j, _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + j),
                                                              _mm256_loadu_ps(oh + j)));
                for (; j < hd; j++) oh[j] += scores[g * n + t] * vt[j];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
