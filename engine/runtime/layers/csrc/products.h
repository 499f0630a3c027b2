/* Matrix products y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for every row count, one numeric path.
 *
 * Weights are packed once, at load (quant.py / linear.py), into panels of NP = 8 output columns
 * so that one 256-bit vector holds one value of each of a panel's columns:
 *
 *   q4_1  panel-block (8 columns x 32 k) = 160 bytes:
 *           4 x 32 bytes  nibbles: vector j, lane c = bytes 4j..4j+3 of column c's GGUF block
 *                         (byte i: weight i low nibble, weight i + 16 high nibble)
 *           8 x fp16 d, 8 x fp16 m              w = d * q + m, q in 0..15
 *   q8_0  panel-block = 272 bytes:
 *           8 x 32 bytes  vector g, lane c = weights 4g..4g+3 of column c, as u8 = w + 128
 *           8 x fp16 d                          w = d * q, q in -127..127
 *   f32   panel = K x 8 floats (k-major)
 *
 * SP = 4 panels are interleaved block by block (k step by k step for f32), so that a tile of up
 * to 4 panels reads one sequential stream of memory (decode is bound by streaming the weights:
 * four separate streams of a few KB each left the prefetchers behind, ~7 GB/s a thread):
 *
 *   [panels / SP][blocks][SP][panel-block bytes]
 *
 * The last panel is zero-padded to NP columns (and so is the bias), the panels to a multiple
 * of SP.
 *
 * Quantized products take x as llama.cpp does: each row's blocks of 32 rounded to int8 with a
 * float scale xd = max|x| / 127 (quantize_rows). Per output element and block b:
 *     i   = sum_j wq[j] * xq[j]                                   exact int32
 *     acc = fma(float(i), d_b * xd_b, acc)                        (q4_1, q8_0)
 *     acc = fma(m_b, xd_b * sum_j xq[j], acc)                     (q4_1's min term)
 * over b = 0, 1, ... in order, then + bias. The dense product is acc = fma(x_k, w_k, acc) over
 * k = 0, 1, ... in order, then + bias. Each element is its own chain, so the register tile, the
 * panel group, the thread and the number of rows M never change a bit: a token row gets the
 * same outputs alone or in a batch of 2,000, in decode or prefill.
 */
#ifndef HICACHE_PRODUCTS_H
#define HICACHE_PRODUCTS_H

#include "common.h"

#define Q4_PB 160 /* bytes of a q4_1 panel-block */
#define Q8_PB 272 /* bytes of a q8_0 panel-block */

enum { W_Q4_1 = 0, W_Q8_0 = 1, W_F32 = 2 };

/* A packed weight (its memory is owned by the Python side). */
typedef struct {
    int32_t kind;       /* W_Q4_1 | W_Q8_0 | W_F32 */
    const uint8_t *w;   /* the panels */
    const float *bias;  /* [panels * NP] (zero-padded) or NULL */
    int64_t n, k;
} PackedLinear;

#define SP 4 /* panels interleaved unit by unit */

static inline int64_t panels_of(int64_t n) { return (n + NP - 1) / NP; }

/* The first row tile over some panels prefetches their weights PF_AHEAD units ahead: decode
 * streams the weights from DRAM once, and for products of a MB or two the hardware prefetchers
 * ramp up too slowly (q4_1 at one row: ~9 GB/s a thread without, ~20-28 with). */
#define PF_AHEAD 6
static inline void prefetch_units(const uint8_t *at, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch((const char *)(at + off), _MM_HINT_T0);
}

/* bytes of one panel's unit: a block of 32 k (quantized), one k step (f32) */
static inline int64_t unit_bytes(const PackedLinear *L) {
    return L->kind == W_Q4_1 ? Q4_PB : L->kind == W_Q8_0 ? Q8_PB : NP * (int64_t)sizeof(float);
}

/* panel p's first unit; its unit u lies u * SP * unit_bytes(L) further */
static inline const uint8_t *panel_at(const PackedLinear *L, int64_t p) {
    const int64_t units = L->kind == W_F32 ? L->k : L->k / QK;
    return L->w + (p / SP) * units * SP * unit_bytes(L) + (p % SP) * unit_bytes(L);
}

/* ------------------------------------------------------------------ activations as int8 */

/* x rows as int8 blocks: q [M, K], per block d = max|x| / 127, isum = sum of q, s = d * isum */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *isum;
} QRows;

static void quantize_block(const float *xb, int8_t *q, float *d, float *s, int32_t *isum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    const float amax = hmax8(mx);
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
    _mm256_storeu_si256((__m256i *)q,
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d = amax / 127.0f;
    *isum = _mm_cvtsi128_si32(s4);
    *s = *d * (float)*isum;
}

typedef struct {
    const float *x;
    int64_t K;
    QRows out;
} Quantize;

static void quantize_rows(void *ctx, int64_t r0, int64_t r1) {
    const Quantize *c = ctx;
    const int64_t nb = c->K / QK;
    for (int64_t i = r0 * nb; i < r1 * nb; i++)
        quantize_block(c->x + i * QK, c->out.q + i * QK, c->out.d + i, c->out.s + i,
                       c->out.isum + i);
}

/* ------------------------------------------------------------------ register tiles
 * R rows x P panels; R and P are compile-time constants after inlining (a runtime count spilled
 * the accumulators to the stack). Rows m0.., panels p0.. */

typedef struct {
    const PackedLinear *L;
    int64_t M;
    const float *x; /* [M, K] float rows (f32 weights) */
    QRows xq;       /* the same rows as int8 blocks (quantized weights) */
    float *y;       /* [M, N] */
} Product;

static inline __attribute__((always_inline)) void tile_store(const Product *pr, int64_t m0,
                                                             int64_t p0, const int R, const int P,
                                                             __m256 acc[][4]) {
    const PackedLinear *L = pr->L;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) {
            const int64_t n0 = (p0 + p) * NP;
            __m256 v = acc[r][p];
            if (L->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(L->bias + n0));
            const int64_t left = L->n - n0;
            store_lanes(pr->y + (m0 + r) * L->n + n0, v, left < NP ? (int)left : NP);
        }
}

static inline __attribute__((always_inline)) void q4_tile(const Product *pr, int64_t m0,
                                                          int64_t p0, const int R, const int P) {
    const PackedLinear *L = pr->L;
    const int64_t K = L->k, nb = K / QK, step = SP * Q4_PB;
    const uint8_t *w[4];
    for (int p = 0; p < P; p++) w[p] = panel_at(L, p0 + p);
    const int8_t *xq = pr->xq.q + m0 * K;
    const float *xd = pr->xq.d + m0 * nb, *xs = pr->xq.s + m0 * nb;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (m0 == 0) prefetch_units(w[0] + (b + PF_AHEAD) * step, P * Q4_PB);
        __m256i ia[4][4];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) ia[r][p] = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i lo[4], hi[4];
            for (int p = 0; p < P; p++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(w[p] + b * step + 32 * j));
                lo[p] = _mm256_and_si256(v, mask);
                hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            }
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + r * K + b * QK;
                const __m256i xl = _mm256_set1_epi32(*(const int32_t *)(xb + 4 * j));
                const __m256i xh = _mm256_set1_epi32(*(const int32_t *)(xb + 16 + 4 * j));
                for (int p = 0; p < P; p++) {
                    ia[r][p] = DOT_U8_S8(ia[r][p], lo[p], xl);
                    ia[r][p] = DOT_U8_S8(ia[r][p], hi[p], xh);
                }
            }
        }
        __m256 dv[4], mv[4];
        for (int p = 0; p < P; p++) {
            dv[p] = load_half8(w[p] + b * step + 128);
            mv[p] = load_half8(w[p] + b * step + 144);
        }
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(xd[r * nb + b]), s = _mm256_set1_ps(xs[r * nb + b]);
            for (int p = 0; p < P; p++) {
                acc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][p]), _mm256_mul_ps(dv[p], d),
                                            acc[r][p]);
                acc[r][p] = _mm256_fmadd_ps(mv[p], s, acc[r][p]);
            }
        }
    }
    tile_store(pr, m0, p0, R, P, acc);
}

static inline __attribute__((always_inline)) void q8_tile(const Product *pr, int64_t m0,
                                                          int64_t p0, const int R, const int P) {
    const PackedLinear *L = pr->L;
    const int64_t K = L->k, nb = K / QK, step = SP * Q8_PB;
    const uint8_t *w[4];
    for (int p = 0; p < P; p++) w[p] = panel_at(L, p0 + p);
    const int8_t *xq = pr->xq.q + m0 * K;
    const float *xd = pr->xq.d + m0 * nb;
    const int32_t *xi = pr->xq.isum + m0 * nb;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        if (m0 == 0) prefetch_units(w[0] + (b + PF_AHEAD) * step, P * Q8_PB);
        __m256i ia[4][4];
        for (int r = 0; r < R; r++)
            for (int p = 0; p < P; p++) ia[r][p] = _mm256_setzero_si256();
        for (int g = 0; g < 8; g++) {
            __m256i wv[4];
            for (int p = 0; p < P; p++)
                wv[p] = _mm256_loadu_si256((const __m256i *)(w[p] + b * step + 32 * g));
#if !HAVE_VNNI
            /* maddubs would saturate on (w + 128) * x: |w| times x carrying w's sign instead */
            __m256i ws[4], aw[4];
            for (int p = 0; p < P; p++) {
                ws[p] = _mm256_xor_si256(wv[p], _mm256_set1_epi8((char)0x80));
                aw[p] = _mm256_abs_epi8(ws[p]);
            }
#endif
            for (int r = 0; r < R; r++) {
                const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(xq + r * K + b * QK + 4 * g));
                for (int p = 0; p < P; p++) {
#if HAVE_VNNI
                    ia[r][p] = DOT_U8_S8(ia[r][p], wv[p], xb);
#else
                    ia[r][p] = DOT_U8_S8(ia[r][p], aw[p], _mm256_sign_epi8(xb, ws[p]));
#endif
                }
            }
        }
        __m256 dv[4];
        for (int p = 0; p < P; p++) dv[p] = load_half8(w[p] + b * step + 256);
        for (int r = 0; r < R; r++) {
#if HAVE_VNNI /* sum (w + 128) x = sum w x + 128 sum x */
            const __m256i corr = _mm256_set1_epi32(128 * xi[r * nb + b]);
            for (int p = 0; p < P; p++) ia[r][p] = _mm256_sub_epi32(ia[r][p], corr);
#else
            (void)xi;
#endif
            const __m256 d = _mm256_set1_ps(xd[r * nb + b]);
            for (int p = 0; p < P; p++)
                acc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r][p]), _mm256_mul_ps(dv[p], d),
                                            acc[r][p]);
        }
    }
    tile_store(pr, m0, p0, R, P, acc);
}

static inline __attribute__((always_inline)) void f32_tile(const Product *pr, int64_t m0,
                                                           int64_t p0, const int R, const int P) {
    const PackedLinear *L = pr->L;
    const int64_t K = L->k, step = SP * NP;
    const float *w[4];
    for (int p = 0; p < P; p++) w[p] = (const float *)panel_at(L, p0 + p);
    const float *x = pr->x + m0 * K;
    __m256 acc[8][4];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wv[4];
        for (int p = 0; p < P; p++) wv[p] = _mm256_loadu_ps(w[p] + k * step);
        for (int r = 0; r < R; r++) {
            const __m256 xb = _mm256_set1_ps(x[r * K + k]);
            for (int p = 0; p < P; p++) acc[r][p] = _mm256_fmadd_ps(xb, wv[p], acc[r][p]);
        }
    }
    /* tile_store takes [R][4]: rows past 4 go in a second call */
    tile_store(pr, m0, p0, R < 4 ? R : 4, P, acc);
    if (R > 4) tile_store(pr, m0 + 4, p0, R - 4, P, acc + 4);
}

/* ------------------------------------------------------------------ tiles over the matrix
 * Shapes: few rows (decode) take more panels per tile to keep enough independent chains in
 * flight; many rows take more rows per tile to reuse each weight load. Both give the same bits. */

#if WIDE_REGS
#define QMR 4  /* quantized: rows of the many-row tile */
#define QFNP 4 /* quantized: panels of the few-row tile */
#define FMR 6  /* dense: rows x panels of the many-row tile */
#define FNP 4
#else
#define QMR 2
#define QFNP 2
#define FMR 4
#define FNP 3
#endif
#define QNP 2  /* quantized: panels of the many-row tile */
#define QFEW 2 /* rows of the streaming tile (x QFNP panels) */
#define QSTREAM 8 /* up to this many rows: streaming tiles, QFEW rows at a time (measured
                   * faster than the many-row tile at 3-8 rows: the weights stream once, in
                   * order, and the second pass over a super-panel hits L1) */
#define FFEW 2 /* dense: up to this many rows, all rows in one tile */

#define TILE_CASES4(FN, pr, m0, p0, R, P)  \
    switch (R) {                           \
    case 1: FN(pr, m0, p0, 1, P); break;   \
    case 2: FN(pr, m0, p0, 2, P); break;   \
    case 3: FN(pr, m0, p0, 3, P); break;   \
    default: FN(pr, m0, p0, 4, P); break;  \
    }

#define TILE_CASES6(FN, pr, m0, p0, R, P)  \
    switch (R) {                           \
    case 1: FN(pr, m0, p0, 1, P); break;   \
    case 2: FN(pr, m0, p0, 2, P); break;   \
    case 3: FN(pr, m0, p0, 3, P); break;   \
    case 4: FN(pr, m0, p0, 4, P); break;   \
    case 5: FN(pr, m0, p0, 5, P); break;   \
    default: FN(pr, m0, p0, 6, P); break;  \
    }

static void q4_tiles(const Product *pr, int64_t m0, int64_t p0, int R, int P) {
    if (P == QFNP && QFNP != QNP) { TILE_CASES4(q4_tile, pr, m0, p0, R > QFEW ? QFEW : R, QFNP) }
    else if (P == QNP) { TILE_CASES4(q4_tile, pr, m0, p0, R > QMR ? QMR : R, QNP) }
    else { TILE_CASES4(q4_tile, pr, m0, p0, R > QMR ? QMR : R, 1) }
}

static void q8_tiles(const Product *pr, int64_t m0, int64_t p0, int R, int P) {
    if (P == QFNP && QFNP != QNP) { TILE_CASES4(q8_tile, pr, m0, p0, R > QFEW ? QFEW : R, QFNP) }
    else if (P == QNP) { TILE_CASES4(q8_tile, pr, m0, p0, R > QMR ? QMR : R, QNP) }
    else { TILE_CASES4(q8_tile, pr, m0, p0, R > QMR ? QMR : R, 1) }
}

static void f32_tiles(const Product *pr, int64_t m0, int64_t p0, int R, int P) {
    if (P == FNP) { TILE_CASES6(f32_tile, pr, m0, p0, R > FMR ? FMR : R, FNP) }
    else { TILE_CASES6(f32_tile, pr, m0, p0, R > FMR ? FMR : R, 1) }
}

/* (rows per tile, panels per tile) for a product of M rows */
static void tile_shape(const Product *pr, int *mr, int *np) {
    if (pr->L->kind == W_F32) {
        *mr = pr->M <= FFEW ? (int)pr->M : FMR;
        *np = FNP;
    } else {
        *mr = pr->M <= QSTREAM ? (pr->M < QFEW ? (int)pr->M : QFEW) : QMR;
        *np = pr->M <= QSTREAM ? QFNP : QNP;
    }
}

/* groups of np panels [g0, g1), every row */
static void product_groups(void *ctx, int64_t g0, int64_t g1) {
    const Product *pr = ctx;
    int mr, np;
    tile_shape(pr, &mr, &np);
    const int64_t panels = panels_of(pr->L->n);
    for (int64_t g = g0; g < g1; g++) {
        const int64_t p0 = g * np;
        const int whole = p0 + np <= panels;
        for (int64_t m0 = 0; m0 < pr->M; m0 += mr) {
            const int R = (int)(pr->M - m0 < mr ? pr->M - m0 : mr);
            for (int64_t p = p0; p < (whole ? p0 + 1 : panels); p++) {
                const int P = whole ? np : 1;
                switch (pr->L->kind) {
                case W_Q4_1: q4_tiles(pr, m0, p, R, P); break;
                case W_Q8_0: q8_tiles(pr, m0, p, R, P); break;
                default: f32_tiles(pr, m0, p, R, P); break;
                }
            }
        }
    }
}

static int64_t product_groups_count(const Product *pr) {
    int mr, np;
    tile_shape(pr, &mr, &np);
    return (panels_of(pr->L->n) + np - 1) / np;
}

/* scratch for M rows of K as int8 blocks (NULL on no memory) */
static int qrows_alloc(QRows *q, int64_t M, int64_t K) {
    const int64_t nb = K / QK;
    q->q = malloc((size_t)(M * K) + 32);
    q->d = malloc(sizeof(float) * (size_t)(M * nb + 1));
    q->s = malloc(sizeof(float) * (size_t)(M * nb + 1));
    q->isum = malloc(sizeof(int32_t) * (size_t)(M * nb + 1));
    if (q->q && q->d && q->s && q->isum) return 0;
    free(q->q), free(q->d), free(q->s), free(q->isum);
    return -1;
}

static void qrows_free(QRows *q) { free(q->q), free(q->d), free(q->s), free(q->isum); }

#endif
