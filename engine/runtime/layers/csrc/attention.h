/* Attention over the paged KV pool, one numeric path for prefill, extend and decode.
 *
 * A query row (token at position pos, head h) attends to keys [0, pos] of its request. Its
 * keys are cut at fixed absolute positions, whatever the batch:
 *
 *   keys      0 ........ 255 | 256 ....... 511 | 512 ... pos
 *   spans     [----- 0 -----]  [----- 1 -----]  [-- 2 --]       SPAN = 256 keys
 *   blocks    [64][64][64][64] [64][64][64][64] [64][..]         ABLK = 64 keys
 *
 * Within a span an online softmax runs block by block (row_block); a span's partial (acc, max,
 * denominator) is merged with the earlier spans' in span order (merge_span). Scores are
 * q . k with a fixed chain along head_dim (score8), the block's sum a fixed tree. So a row's
 * output depends on its q and its keys' K/V only: not on the rows beside it, on whether its
 * keys were computed in this forward or read from the cache, on whether this is a prefill
 * chunk or a decode step, or on how the work was split between threads.
 *
 * Work: tasks (request, kv head, tile of up to QT query tokens, spans). A task that owns all
 * of its tile's spans merges them itself; when the batch has too few tiles to keep every
 * thread busy (decode, a short extend after a long prefix), each span is a task of its own and
 * a second pass merges the stored partials, in the same order with the same arithmetic.
 *
 * Keys are read through req_to_token from the device pool, or, for device slots whose KV is
 * still being loaded from the host (HiCache, CPU), in place from the host pool (host_row).
 */
#ifndef HICACHE_ATTENTION_H
#define HICACHE_ATTENTION_H

#include "common.h"

#define ABLK 64    /* keys per online-softmax block */
#define SPAN 256   /* keys per span (a multiple of ABLK) */
#define QT 16      /* query tokens per task */
#define AMAXG 16   /* query heads per kv head handled */
#define AMAXHD 256 /* head_dim handled (a multiple of 8) */

static const float zero_row[AMAXHD]; /* what masked key lanes read */

typedef struct {
    const float *q; /* [T, q_stride]: head h of token t at q + t * q_stride + h * hd */
    int64_t q_stride;
    float *out;     /* [T, heads * hd] */
    const float *k, *v;          /* this layer's pool [slots, kv_heads, hd] */
    const float *hk, *hv;        /* host pool layer [rows, ...], h_stride floats a row, or NULL */
    int64_t h_stride;
    const int64_t *host_row;     /* [slots]: host row of a slot still loading, else -1; or NULL */
    const int32_t *req_to_token; /* [rows, r2t_stride] */
    int64_t r2t_stride;
    const int64_t *rows;    /* [bs] request b's req_to_token row */
    const int64_t *q_first; /* [bs] its first query token in q / out */
    const int64_t *q_len;   /* [bs] its query tokens (1 in decode) */
    const int64_t *kv_len;  /* [bs] its keys = the last query's position + 1 */
    int64_t bs, heads, kv_heads, hd;
    float scale;
} AttnBatch;

typedef struct {
    int64_t b, kvh, j0, j1; /* request, kv head, query tokens [j0, j1) of the request */
    int64_t s0, s1;         /* spans [s0, s1) */
    int64_t part;           /* split: first float of its partials in parts; -1: merges itself */
} AttnTask;

typedef struct {
    const AttnBatch *a;
    AttnTask *tasks;
    int64_t ntasks, nmerges;
    int64_t *merges; /* split tiles: index of their first span task (spans follow in order) */
    float *parts;    /* split tasks' partials: [rows of the tile][hd + 2] per task */
    float *scratch;  /* per thread: 2 * QT * AMAXG * hd floats */
    int64_t scratch_floats;
    atomic_llong next, next_merge;
} AttnRun;

/* A row's running state. */
typedef struct {
    const float *q;
    float *out;
    int64_t pos;
    float *acc; /* [hd] the current span's unnormalised output */
    float m, l; /* the current span's running max and denominator */
    float *o;   /* [hd] merged earlier spans */
    float mo, lo;
    int spans;  /* spans merged into o */
} Row;

/* (q . k_i) * scale for 8 keys: a chain of FMAs along head_dim in 8 lanes, then the 8x8 tree;
 * for one or two rows (R, a compile-time constant after inlining): two share each K load, and
 * each row's chains are the same either way */
static inline __attribute__((always_inline)) void score8(const float *const q[3],
                                                         const float *const kp[8], int64_t hd,
                                                         __m256 scale, const int R, __m256 *out) {
    __m256 a[3][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 8; i++) a[r][i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < hd; c += 8) {
        __m256 qc[3];
        for (int r = 0; r < R; r++) qc[r] = _mm256_loadu_ps(q[r] + c);
        for (int i = 0; i < 8; i++) {
            const __m256 k = _mm256_loadu_ps(kp[i] + c);
            for (int r = 0; r < R; r++) a[r][i] = _mm256_fmadd_ps(qc[r], k, a[r][i]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm256_mul_ps(hsum8x8(a[r]), scale);
}

/* acc[c .. c + 8W) = acc * rescale + sum_{t < n} p_t v_t[c ..] for R rows sharing each V load
 * (keys t < min(n) for all of them, then the longer row's rest alone: the same chain per row) */
static inline __attribute__((always_inline)) void pv_rows(Row *const r[3], const float *const *p,
                                                          const float rescale[3], const int n[3],
                                                          const float *const *vp, int64_t c,
                                                          const int R, const int W) {
    __m256 a[3][8];
    for (int j = 0; j < R; j++) {
        const __m256 rs = _mm256_set1_ps(rescale[j]);
        for (int i = 0; i < W; i++)
            a[j][i] = _mm256_mul_ps(_mm256_loadu_ps(r[j]->acc + c + 8 * i), rs);
    }
    int both = n[0];
    for (int j = 1; j < R; j++) both = n[j] < both ? n[j] : both;
    for (int t = 0; t < both; t++)
        for (int i = 0; i < W; i++) {
            const __m256 v = _mm256_loadu_ps(vp[t] + c + 8 * i);
            for (int j = 0; j < R; j++)
                a[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(p[j][t]), v, a[j][i]);
        }
    for (int j = 0; j < R; j++)
        for (int t = both; t < n[j]; t++)
            for (int i = 0; i < W; i++)
                a[j][i] = _mm256_fmadd_ps(_mm256_set1_ps(p[j][t]), _mm256_loadu_ps(vp[t] + c + 8 * i),
                                          a[j][i]);
    for (int j = 0; j < R; j++)
        for (int i = 0; i < W; i++) _mm256_storeu_ps(r[j]->acc + c + 8 * i, a[j][i]);
}

/* One block of keys t0 .. t0 + n - 1 (pointers kp/vp, padded to a multiple of 8 with
 * zero_row) for R rows with pos >= t0: each row's online-softmax update of its span state. */
static inline __attribute__((always_inline)) void rows_block(Row *const r[3],
                                                             const float *const *kp,
                                                             const float *const *vp, int64_t t0,
                                                             int n, int64_t hd, __m256 scale,
                                                             const int R) {
    float s[3][ABLK] __attribute__((aligned(32)));
    int nv[3];
    for (int j = 0; j < R; j++) /* the row's keys in this block: those <= pos */
        nv[j] = r[j]->pos - t0 + 1 < n ? (int)(r[j]->pos - t0 + 1) : n;
    int most = nv[0];
    for (int j = 1; j < R; j++) most = nv[j] > most ? nv[j] : most;
    const int groups = (most + 7) / 8;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const float *q[3];
    __m256 mx[3];
    for (int j = 0; j < R; j++) q[j] = r[j]->q, mx[j] = _mm256_set1_ps(-INFINITY);
    for (int g = 0; g < groups; g++) {
        __m256 sv[3];
        score8(q, kp + 8 * g, hd, scale, R, sv);
        for (int j = 0; j < R; j++) {
            const __m256 valid = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32(nv[j] - 8 * g), lane));
            sv[j] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sv[j], valid);
            _mm256_store_ps(s[j] + 8 * g, sv[j]);
            mx[j] = _mm256_max_ps(mx[j], sv[j]);
        }
    }
    float rescale[3];
    const float *p[3] = {s[0], s[1], s[2]};
    for (int j = 0; j < R; j++) {
        /* a row's groups end at its own last key: the sum below runs over the same vectors
         * whatever row it shares the block with */
        const int gj = (nv[j] + 7) / 8;
        const float bm = hmax8(mx[j]), m_new = bm > r[j]->m ? bm : r[j]->m;
        rescale[j] = expf(r[j]->m - m_new); /* 0 on the span's first block (m = -inf) */
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int g = 0; g < gj; g++) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s[j] + 8 * g), mv));
            _mm256_store_ps(s[j] + 8 * g, e);
            sum = _mm256_add_ps(sum, e);
        }
        r[j]->l = r[j]->l * rescale[j] + hsum8(sum);
        r[j]->m = m_new;
    }
    /* 64 floats of the head at a time in registers */
    for (int64_t c = 0; c < hd; c += 64) {
        const int w = hd - c < 64 ? (int)((hd - c) / 8) : 8;
        if (w == 8) {
            pv_rows(r, p, rescale, nv, vp, c, R, 8);
        } else {
            switch (w) {
            case 1: pv_rows(r, p, rescale, nv, vp, c, R, 1); break;
            case 2: pv_rows(r, p, rescale, nv, vp, c, R, 2); break;
            case 3: pv_rows(r, p, rescale, nv, vp, c, R, 3); break;
            case 4: pv_rows(r, p, rescale, nv, vp, c, R, 4); break;
            case 5: pv_rows(r, p, rescale, nv, vp, c, R, 5); break;
            case 6: pv_rows(r, p, rescale, nv, vp, c, R, 6); break;
            default: pv_rows(r, p, rescale, nv, vp, c, R, 7); break;
            }
        }
    }
}

/* a block for the rows of a tile that have keys in it: two at a time where 32 vector
 * registers hold both (AVX-512VL builds), else one (the same bits) */
static void block_rows(Row *const *rows, int nrows, const float *const *kp,
                       const float *const *vp, int64_t t0, int n, int64_t hd, __m256 scale) {
    int i = 0;
#if WIDE_REGS
    for (; i + 3 <= nrows; i += 3) rows_block(rows + i, kp, vp, t0, n, hd, scale, 3);
    if (i + 2 <= nrows) rows_block(rows + i, kp, vp, t0, n, hd, scale, 2), i += 2;
#endif
    for (; i < nrows; i++) {
        Row *const one[3] = {rows[i], NULL, NULL};
        rows_block(one, kp, vp, t0, n, hd, scale, 1);
    }
}

/* merge a span partial (acc, m, l) into the merged state (o, mo, lo): spans in order */
static void merge_span(float *o, float *mo, float *lo, int first, const float *acc, float m,
                       float l, int64_t hd) {
    if (first) {
        for (int64_t j = 0; j < hd; j++) o[j] = acc[j];
        *mo = m, *lo = l;
        return;
    }
    const float mn = m > *mo ? m : *mo, a = expf(*mo - mn), c = expf(m - mn);
    for (int64_t j = 0; j < hd; j++) o[j] = o[j] * a + acc[j] * c;
    *lo = *lo * a + l * c;
    *mo = mn;
}

static void finish_row(float *out, const float *o, float lo, int64_t hd) {
    const float inv = 1.0f / lo;
    for (int64_t j = 0; j < hd; j++) out[j] = o[j] * inv;
}

/* where key position t of request b, kv head kvh lives (device pool or host copy) */
static inline void key_ptrs(const AttnBatch *a, int64_t b, int64_t kvh, int64_t t,
                            const float **kp, const float **vp) {
    const int64_t slot = a->req_to_token[a->rows[b] * a->r2t_stride + t];
    const int64_t h = a->host_row ? a->host_row[slot] : -1;
    if (h >= 0) {
        *kp = a->hk + h * a->h_stride + kvh * a->hd;
        *vp = a->hv + h * a->h_stride + kvh * a->hd;
    } else {
        const int64_t at = (slot * a->kv_heads + kvh) * a->hd;
        *kp = a->k + at, *vp = a->v + at;
    }
}

static inline int64_t pos_of(const AttnBatch *a, int64_t b, int64_t j) {
    return a->kv_len[b] - a->q_len[b] + j;
}

/* rows of a tile: token j0 + i, head kvh * G + g  ->  row i * G + g */
static int tile_rows(const AttnBatch *a, const AttnTask *t, Row *rows, float *scratch) {
    const int64_t G = a->heads / a->kv_heads, hd = a->hd;
    int n = 0;
    for (int64_t j = t->j0; j < t->j1; j++)
        for (int64_t g = 0; g < G; g++, n++) {
            const int64_t tok = a->q_first[t->b] + j, h = t->kvh * G + g;
            rows[n] = (Row){.q = a->q + tok * a->q_stride + h * hd,
                            .out = a->out + tok * a->heads * hd + h * hd,
                            .pos = pos_of(a, t->b, j),
                            .acc = scratch + (int64_t)n * hd,
                            .o = scratch + (int64_t)(QT * AMAXG + n) * hd,
                            .mo = -INFINITY};
        }
    return n;
}

/* span s of a tile's rows: each row with keys in it gets its span partial in acc / m / l */
/* key pointers of keys t0 .. t0 + n - 1 (padded to a multiple of 8 with zero_row) */
static void block_ptrs(const AttnBatch *a, const AttnTask *t, int64_t t0, int n,
                       const float **kp, const float **vp) {
    for (int i = 0; i < n; i++) key_ptrs(a, t->b, t->kvh, t0 + i, kp + i, vp + i);
    for (int i = n; i < (n + 7) / 8 * 8; i++) kp[i] = vp[i] = zero_row;
}

/* the K and V rows of a block into the cache while the block before it is computed: the
 * keys' slots are scattered (paged pool, or host rows), which the hardware prefetchers do not
 * follow, and a one-query row over long keys is bound by reading them */
static void prefetch_block(const float *const *kp, const float *const *vp, int n, int64_t hd) {
    for (int i = 0; i < n; i++)
        for (int64_t c = 0; c < hd; c += 16) {
            _mm_prefetch((const char *)(kp[i] + c), _MM_HINT_T0);
            _mm_prefetch((const char *)(vp[i] + c), _MM_HINT_T0);
        }
}

static void tile_span(const AttnBatch *a, const AttnTask *t, Row *rows, int nrows, int64_t s) {
    const int64_t hd = a->hd, t_end = pos_of(a, t->b, t->j1 - 1) + 1; /* the tile's keys */
    const int64_t s_end = (s + 1) * SPAN < t_end ? (s + 1) * SPAN : t_end;
    const __m256 scale = _mm256_set1_ps(a->scale);
    const float *kp[2][ABLK], *vp[2][ABLK]; /* this block's pointers, the next one's */
    for (int i = 0; i < nrows; i++) {
        if (rows[i].pos < s * SPAN) continue;
        for (int64_t j = 0; j < hd; j++) rows[i].acc[j] = 0.0f;
        rows[i].m = -INFINITY, rows[i].l = 0.0f;
    }
    Row *active[QT * AMAXG];
    int cur = 0;
    int n = s_end - s * SPAN < ABLK ? (int)(s_end - s * SPAN) : ABLK;
    block_ptrs(a, t, s * SPAN, n, kp[0], vp[0]);
    for (int64_t t0 = s * SPAN; t0 < s_end; t0 += ABLK) {
        const int64_t t1 = t0 + ABLK;
        const int next = t1 < s_end ? (s_end - t1 < ABLK ? (int)(s_end - t1) : ABLK) : 0;
        if (next) {
            block_ptrs(a, t, t1, next, kp[cur ^ 1], vp[cur ^ 1]);
            prefetch_block(kp[cur ^ 1], vp[cur ^ 1], next, hd);
        }
        int na = 0;
        for (int i = 0; i < nrows; i++)
            if (rows[i].pos >= t0) active[na++] = rows + i;
        block_rows(active, na, kp[cur], vp[cur], t0, n, hd, scale);
        cur ^= 1, n = next;
    }
}

static void attn_task(AttnRun *run, const AttnTask *t, float *scratch) {
    const AttnBatch *a = run->a;
    const int64_t hd = a->hd;
    Row rows[QT * AMAXG];
    const int nrows = tile_rows(a, t, rows, scratch);
    for (int64_t s = t->s0; s < t->s1; s++) {
        tile_span(a, t, rows, nrows, s);
        for (int i = 0; i < nrows; i++) {
            Row *r = rows + i;
            if (r->pos < s * SPAN) continue;
            if (t->part >= 0) { /* stored for the merge pass */
                float *p = run->parts + t->part + (int64_t)i * (hd + 2);
                for (int64_t j = 0; j < hd; j++) p[j] = r->acc[j];
                p[hd] = r->m, p[hd + 1] = r->l;
            } else {
                merge_span(r->o, &r->mo, &r->lo, r->spans++ == 0, r->acc, r->m, r->l, hd);
            }
        }
    }
    if (t->part < 0)
        for (int i = 0; i < nrows; i++) finish_row(rows[i].out, rows[i].o, rows[i].lo, hd);
}

/* a split tile: its span tasks' partials merged in span order */
static void attn_merge(AttnRun *run, int64_t first, float *scratch) {
    const AttnBatch *a = run->a;
    const AttnTask *t = run->tasks + first;
    const int64_t hd = a->hd;
    Row rows[QT * AMAXG];
    const int nrows = tile_rows(a, t, rows, scratch);
    const int64_t ns = pos_of(a, t->b, t->j1 - 1) / SPAN + 1; /* tasks first .. first + ns - 1 */
    for (int64_t s = 0; s < ns; s++)
        for (int i = 0; i < nrows; i++) {
            Row *r = rows + i;
            if (r->pos < s * SPAN) continue;
            const float *p = run->parts + t[s].part + (int64_t)i * (hd + 2);
            merge_span(r->o, &r->mo, &r->lo, r->spans++ == 0, p, p[hd], p[hd + 1], hd);
        }
    for (int i = 0; i < nrows; i++) finish_row(rows[i].out, rows[i].o, rows[i].lo, hd);
}

/* Plans the tasks (tile + spans; split into span tasks when tiles are fewer than 4 per
 * thread). Returns -2 for shapes not taken, -1 for no memory, else 0. Free with attn_free. */
static int attn_plan(AttnRun *run, const AttnBatch *a, int nthreads) {
    memset(run, 0, sizeof *run);
    run->a = a;
    if (a->kv_heads < 1 || a->heads % a->kv_heads) return -2;
    const int64_t G = a->heads / a->kv_heads, hd = a->hd;
    if (G > AMAXG || hd > AMAXHD || hd % 8 || hd < 8) return -2;
    int64_t tiles = 0, spans = 0;
    for (int64_t b = 0; b < a->bs; b++) {
        const int64_t nt = (a->q_len[b] + QT - 1) / QT;
        tiles += nt;
        for (int64_t i = 0; i < nt; i++) {
            const int64_t j1 = (i + 1) * QT < a->q_len[b] ? (i + 1) * QT : a->q_len[b];
            spans += (pos_of(a, b, j1 - 1)) / SPAN + 1;
        }
    }
    const int split = tiles * a->kv_heads < 4 * (int64_t)nthreads;
    const int64_t cap = split ? spans * a->kv_heads : tiles * a->kv_heads;
    run->tasks = malloc(sizeof(AttnTask) * (size_t)(cap + 1));
    run->merges = malloc(sizeof(int64_t) * (size_t)(tiles * a->kv_heads + 1));
    run->scratch_floats = 2 * QT * AMAXG * hd;
    run->scratch = malloc(sizeof(float) * (size_t)(run->scratch_floats * nthreads));
    const int64_t part_floats = QT * G * (hd + 2);
    run->parts = split ? malloc(sizeof(float) * (size_t)(cap * part_floats + 1)) : NULL;
    if (!run->tasks || !run->merges || !run->scratch || (split && !run->parts)) return -1;
    /* the longest tiles first: they finish last otherwise */
    int64_t n = 0;
    for (int64_t b = 0; b < a->bs; b++) {
        const int64_t nt = (a->q_len[b] + QT - 1) / QT;
        for (int64_t i = nt - 1; i >= 0; i--) {
            const int64_t j0 = i * QT, j1 = j0 + QT < a->q_len[b] ? j0 + QT : a->q_len[b];
            const int64_t ns = pos_of(a, b, j1 - 1) / SPAN + 1;
            for (int64_t kvh = 0; kvh < a->kv_heads; kvh++) {
                if (!split) {
                    run->tasks[n++] = (AttnTask){b, kvh, j0, j1, 0, ns, -1};
                    continue;
                }
                run->merges[run->nmerges++] = n;
                for (int64_t s = 0; s < ns; s++, n++)
                    run->tasks[n] = (AttnTask){b, kvh, j0, j1, s, s + 1, n * part_floats};
            }
        }
    }
    run->ntasks = n;
    atomic_store(&run->next, 0);
    atomic_store(&run->next_merge, 0);
    return 0;
}

static void attn_free(AttnRun *run) {
    free(run->tasks), free(run->merges), free(run->scratch), free(run->parts);
}

/* this thread's share of the tasks (taken from a shared counter: tiles differ in length) */
static void attn_work(AttnRun *run, int tid) {
    float *scratch = run->scratch + (int64_t)tid * run->scratch_floats;
    for (int64_t i; (i = atomic_fetch_add(&run->next, 1)) < run->ntasks;)
        attn_task(run, run->tasks + i, scratch);
}

/* after every thread's attn_work: the split tiles' merges */
static void attn_merge_work(AttnRun *run, int tid) {
    float *scratch = run->scratch + (int64_t)tid * run->scratch_floats;
    for (int64_t i; (i = atomic_fetch_add(&run->next_merge, 1)) < run->nmerges;)
        attn_merge(run, run->merges[i], scratch);
}

static void attn_job(void *ctx, int tid, int nt) {
    AttnRun *run = ctx;
    attn_work(run, tid);
    if (run->nmerges) {
        pool_barrier(nt);
        attn_merge_work(run, tid);
    }
}

#endif
