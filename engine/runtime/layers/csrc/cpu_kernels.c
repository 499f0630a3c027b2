/* C kernels for CPU serving (engine/runtime/layers/cpu_kernels.py builds and loads them):
 * the matrix products (products.h), attention over the paged pool (attention.h), fused
 * residual + RMSNorm, RoPE in place, SiLU x up, and a Llama decode stack in one call.
 *
 * Every kernel computes a token row's values with one fixed sequence of roundings, whatever
 * the batch around it (common.h says how): prefill, extend and decode of the same token give
 * the same bits, so a prefix cache never changes an answer.
 * Parallel on the thread pool of thread_pool.h (threads passed explicitly). Needs AVX2 + FMA
 * + F16C (and uses AVX-VNNI or AVX512-VNNI when built with it, the same results); the Python
 * side falls back to torch ops when the build fails.
 */
#include "common.h"
#include "products.h"
#include "attention.h"

/* ------------------------------------------------------------------ products */

/* y [M, n] = x [M, k] @ W^T (+ bias). 0, or -1 when out of memory. */
int linear_packed(const PackedLinear *L, const float *x, int64_t M, float *y, int nthreads) {
    if (M <= 0) return 0;
    Product pr = {.L = L, .M = M, .x = x, .y = y};
    if (L->kind != W_F32) {
        if (qrows_alloc(&pr.xq, M, L->k)) return -1;
        Quantize qz = {x, L->k, pr.xq};
        pool_for(M, M >= 64 ? nthreads : 1, quantize_rows, &qz, POOL_SPIN_NS);
    }
    pool_for(product_groups_count(&pr), nthreads, product_groups, &pr, POOL_SPIN_NS);
    if (L->kind != W_F32) qrows_free(&pr.xq);
    return 0;
}

/* ------------------------------------------------------------------ per-layer small ops */

/* out = rms_norm(x + residual) * w; residual_out = x + residual (residual may be NULL: no add) */
static void rms_norm_row(const float *x, const float *residual, const float *w, float eps,
                         int64_t hidden, float *out, float *residual_out) {
    const float *src = x;
    if (residual) {
        for (int64_t j = 0; j < hidden; j++) residual_out[j] = x[j] + residual[j];
        src = residual_out;
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
    for (j = 0; j < hidden; j++) out[j] = src[j] * inv * w[j];
}

typedef struct {
    const float *x, *residual, *w;
    float eps;
    int64_t hidden;
    float *out, *residual_out;
} Norm;

static void norm_rows(void *ctx, int64_t r0, int64_t r1) {
    const Norm *c = ctx;
    const int64_t h = c->hidden;
    for (int64_t r = r0; r < r1; r++)
        rms_norm_row(c->x + r * h, c->residual ? c->residual + r * h : NULL, c->w, c->eps, h,
                     c->out + r * h, c->residual_out ? c->residual_out + r * h : NULL);
}

void rms_norm_residual(const float *x, const float *residual, const float *w, float eps,
                       int64_t rows, int64_t hidden, float *out, float *residual_out,
                       int nthreads) {
    Norm c = {x, residual, w, eps, hidden, out, residual_out};
    pool_for(rows, rows * hidden >= 65536 ? nthreads : 1, norm_rows, &c, POOL_SPIN_NS);
}

/* Neox RoPE in place on the first `nheads` heads of each token row of x (row stride
 * `token_stride` floats, heads contiguous, head_dim hd); cache [max_pos, hd] = cos half | sin half */
typedef struct {
    float *x;
    int64_t token_stride, nheads, hd;
    const int64_t *positions;
    const float *cos_sin;
} Rope;

static void rope_rows(void *ctx, int64_t t0, int64_t t1) {
    const Rope *c = ctx;
    const int64_t half = c->hd / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = c->cos_sin + c->positions[t] * c->hd;
        for (int64_t h = 0; h < c->nheads; h++) {
            float *v = c->x + t * c->token_stride + h * c->hd;
            for (int64_t i = 0; i < half; i++) {
                const float co = cs[i], si = cs[half + i], a = v[i], b = v[half + i];
                v[i] = a * co - b * si;
                v[half + i] = b * co + a * si;
            }
        }
    }
}

void rope_neox_inplace(float *x, int64_t tokens, int64_t token_stride, int64_t nheads, int64_t hd,
                       const int64_t *positions, const float *cos_sin, int nthreads) {
    Rope c = {x, token_stride, nheads, hd, positions, cos_sin};
    pool_for(tokens, tokens * nheads * hd >= 65536 ? nthreads : 1, rope_rows, &c, POOL_SPIN_NS);
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

/* ------------------------------------------------------------------ attention */

/* 0; -1 out of memory; -2 heads / head_dim not taken (the caller says so) */
int attention(const AttnBatch *a, int nthreads) {
    AttnRun run;
    const int rc = attn_plan(&run, a, nthreads);
    if (rc == 0) pool_run(attn_job, &run, nthreads, POOL_SPIN_NS);
    attn_free(&run);
    return rc;
}

/* ------------------------------------------------------------------ a whole decode stack
 * Decode of a Llama-family stack (pre-norm, fused qkv and gate_up, neox RoPE, SiLU MLP) in one
 * call: at a few rows the per-layer Python and torch dispatch (~40 ops, ~0.3 ms a layer) cost
 * as much as the matmuls. The products, norm, RoPE and attention are the functions above, in
 * the modules' order, so the outputs are the module path's bit for bit. */

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const PackedLinear *qkv, *o, *gate_up, *down;
    float *k_cache, *v_cache; /* this layer's pool [slots, kv_heads, hd] */
} DecodeLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, hd, inter;
    float eps, scale;
    const float *cos_sin; /* [max_position, hd]: cos half | sin half */
} DecodeShape;

/* A whole step is one pool job: the products are split over each thread's share of the weight
 * panels, attention tasks come from a shared counter, and the small serial work (norms, RoPE,
 * the K/V store, rounding x to int8 blocks) runs on thread 0 while the others wait at the
 * barrier. */
typedef struct {
    const DecodeLayer *layers;
    int64_t nlayers, M;
    const DecodeShape *s;
    float *hidden, *residual;
    const int64_t *positions, *out_loc;
    float *normed, *wide, *narrow; /* see decode_layers */
    QRows xq;                      /* x of the next product as int8 blocks */
    AttnBatch attn;
    AttnRun run;
} Step;

/* y = x @ W^T (+ bias): this thread's share of W's panel groups (x is st->xq already) */
static void step_product(const Step *st, const PackedLinear *L, const float *x, float *y, int tid,
                         int nt) {
    const Product p = {.L = L, .M = st->M, .x = x, .xq = st->xq, .y = y};
    const int64_t groups = product_groups_count(&p);
    const int64_t g0 = groups * tid / nt, g1 = groups * (tid + 1) / nt;
    if (g1 > g0) product_groups((void *)&p, g0, g1);
}

/* thread 0, before a product of x [M, K] by L: x as int8 blocks */
static void step_round(Step *st, const PackedLinear *L, const float *x) {
    if (L->kind == W_F32) return;
    Quantize qz = {x, L->k, st->xq};
    quantize_rows(&qz, 0, st->M);
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
            Norm nm = {hidden, l ? residual : NULL, L->input_norm, s->eps, H, normed,
                       l ? residual : NULL};
            if (l == 0)
                for (int64_t i = 0; i < M * H; i++) residual[i] = hidden[i];
            norm_rows(&nm, 0, M); /* l > 0: residual += hidden (in place), normed = norm */
            step_round(st, L->qkv, normed);
        }
        pool_barrier(nt);
        step_product(st, L->qkv, normed, wide, tid, nt); /* [M, q | k | v] */
        pool_barrier(nt);
        if (tid == 0) {
            Rope rp = {wide, qkv_n, s->heads + s->kv_heads, s->hd, st->positions, s->cos_sin};
            rope_rows(&rp, 0, M);
            for (int64_t b = 0; b < M; b++) { /* the new token's K/V into the pool */
                const float *kb = wide + b * qkv_n + q_n;
                for (int64_t j = 0; j < kv_n; j++) {
                    L->k_cache[st->out_loc[b] * kv_n + j] = kb[j];
                    L->v_cache[st->out_loc[b] * kv_n + j] = kb[kv_n + j];
                }
            }
            st->attn.k = L->k_cache, st->attn.v = L->v_cache;
            atomic_store(&st->run.next, 0);
            atomic_store(&st->run.next_merge, 0);
        }
        pool_barrier(nt);
        attn_work(&st->run, tid); /* q: the rows of wide; out: narrow */
        if (st->run.nmerges) {
            pool_barrier(nt);
            attn_merge_work(&st->run, tid);
        }
        pool_barrier(nt);
        if (tid == 0) step_round(st, L->o, narrow);
        pool_barrier(nt);
        step_product(st, L->o, narrow, hidden, tid, nt);
        pool_barrier(nt);
        if (tid == 0) {
            Norm nm = {hidden, residual, L->post_norm, s->eps, H, normed, residual};
            norm_rows(&nm, 0, M);
            step_round(st, L->gate_up, normed);
        }
        pool_barrier(nt);
        step_product(st, L->gate_up, normed, wide, tid, nt);
        pool_barrier(nt);
        if (tid == 0) {
            const SiluMul sm = {wide, s->inter, narrow};
            silu_mul_rows((void *)&sm, 0, M);
            step_round(st, L->down, narrow);
        }
        pool_barrier(nt);
        step_product(st, L->down, narrow, hidden, tid, nt);
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
                  int nthreads) {
    const int64_t H = s->hidden, qkv_n = (s->heads + 2 * s->kv_heads) * s->hd;
    const int64_t q_n = s->heads * s->hd;
    const int64_t widest = qkv_n > 2 * s->inter ? qkv_n : 2 * s->inter;
    int64_t kmax = H > q_n ? H : q_n;
    kmax = kmax > s->inter ? kmax : s->inter;
    Step st = {.layers = layers, .nlayers = nlayers, .M = M, .s = s, .hidden = hidden,
               .residual = residual, .positions = positions, .out_loc = out_loc};
    int64_t *ones = malloc(sizeof(int64_t) * (size_t)(3 * M));
    if (!ones) return -1;
    int64_t *first = ones + M, *kv_len = ones + 2 * M;
    for (int64_t b = 0; b < M; b++) ones[b] = 1, first[b] = b, kv_len[b] = positions[b] + 1;
    st.normed = malloc(sizeof(float) * (size_t)(M * H));
    st.wide = malloc(sizeof(float) * (size_t)(M * widest));
    st.narrow = malloc(sizeof(float) * (size_t)(M * (q_n > s->inter ? q_n : s->inter)));
    int rc = qrows_alloc(&st.xq, M, kmax);
    /* attention reads q from wide (rows qkv_n apart), writes narrow */
    st.attn = (AttnBatch){.q = st.wide, .q_stride = qkv_n, .out = st.narrow,
                          .req_to_token = req_to_token, .r2t_stride = r2t_stride, .rows = rows,
                          .q_first = first, .q_len = ones, .kv_len = kv_len, .bs = M,
                          .heads = s->heads, .kv_heads = s->kv_heads, .hd = s->hd,
                          .scale = s->scale};
    if (rc == 0 && st.normed && st.wide && st.narrow) {
        rc = attn_plan(&st.run, &st.attn, nthreads);
        if (rc == 0) pool_run(step_job, &st, nthreads, POOL_SPIN_NS);
        attn_free(&st.run);
        qrows_free(&st.xq);
    } else if (rc == 0) {
        qrows_free(&st.xq);
        rc = -1;
    }
    free(st.normed), free(st.wide), free(st.narrow), free(ones);
    return rc;
}
