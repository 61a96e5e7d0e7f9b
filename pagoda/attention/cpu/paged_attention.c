/* Paged attention on CPU, reading keys/values in place from Pagoda's paged KV cache.
 *
 * Layout (pagoda/attention/metadata.py): one layer's cache is [2, num_blocks, block_size,
 * num_kv_heads, head_size]; token t of request b lives at slot
 * block_tables[b][t / block_size] * block_size + t % block_size. Query row i of request b sits
 * at position seq_lens[b] - query_len_b + i and attends causally to keys 0 ..= that position,
 * or with a sliding window of W to keys (position - W, position] only (Mistral, Gemma); scores
 * may be soft-capped (Gemma 2: cap * tanh(score / cap)).
 *
 * The work is a list of items (request, kv heads [h0, h1), query rows [r0, r1)) built by the
 * Python side and shared out over OpenMP threads. An item walks its keys in tiles of TILE_KEYS
 * = 16 positions (one or more vectors of scores per query: one with AVX-512, two with AVX2, four
 * in the portable build): for each KV head it scores the tile against every query vector of
 * that head (the GQA group x the item's rows, so each K/V row is read from memory once per
 * item), then does an online-softmax update (running max m, sum l, fp32 accumulator) as in
 * FlashAttention (Dao et al., 2022) and Milakov & Gimelshein (2018).
 *
 * Vectors are GCC vector extensions of the register's width (vec.h), so the same source
 * compiles to AVX-512, AVX2, SSE2 or NEON, once per ISA level (pagoda/utils/cpu_build.py);
 * x86 intrinsics serve fp16 conversion and the AVX512_BF16 path (tile.h).
 */
#include "tile.h"

/* ---- tile dispatch ------------------------------------------------------------------- */
/* Every tile body is specialised on the number of query vectors (loops unrolled, accumulators in
 * registers); head sizes 64 and 128 also on the chunk count, other head sizes share one body per
 * dtype and group size, which keeps the first-use compile short. */
typedef void (*tile_fn)(const Tile *, int, void *const *, float *const *, float *, float *,
                        const int *, const int *);

#define DEFINE_TILE(NAME, DT, CC)                                                                  \
    static void NAME(const Tile *tl, int nq, void *const *q, float *const *acc, float *m,          \
                     float *l, const int *lo, const int *nv) {                                     \
        float *const *qf = (float *const *)q;                                                      \
        switch (nq) {                                                                              \
        case 1: attend_tile(tl, DT, 1, CC, qf, acc, m, l, lo, nv); break;                          \
        case 2: attend_tile(tl, DT, 2, CC, qf, acc, m, l, lo, nv); break;                          \
        case 3: attend_tile(tl, DT, 3, CC, qf, acc, m, l, lo, nv); break;                          \
        default: attend_tile(tl, DT, 4, CC, qf, acc, m, l, lo, nv); break;                         \
        }                                                                                          \
    }

DEFINE_TILE(tile_f32_64, DT_F32, 64 / LANES)
DEFINE_TILE(tile_f32_128, DT_F32, 128 / LANES)
DEFINE_TILE(tile_f32_n, DT_F32, 0)
DEFINE_TILE(tile_f16_64, DT_F16, 64 / LANES)
DEFINE_TILE(tile_f16_128, DT_F16, 128 / LANES)
DEFINE_TILE(tile_f16_n, DT_F16, 0)
DEFINE_TILE(tile_bf16_64, DT_BF16, 64 / LANES)
DEFINE_TILE(tile_bf16_128, DT_BF16, 128 / LANES)
DEFINE_TILE(tile_bf16_n, DT_BF16, 0)
DEFINE_TILE(tile_e5m2_64, DT_E5M2, 64 / LANES)
DEFINE_TILE(tile_e5m2_128, DT_E5M2, 128 / LANES)
DEFINE_TILE(tile_e5m2_n, DT_E5M2, 0)

#if HAVE_BF16DP
#define DEFINE_TILE_BF16DP(NAME, CC)                                                               \
    static void NAME(const Tile *tl, int nq, void *const *q, float *const *acc, float *m,          \
                     float *l, const int *lo, const int *nv) {                                     \
        const uint16_t *const *qb = (const uint16_t *const *)q;                                    \
        if (CC == 0) attend_tile_bf16dp(tl, nq, 0, qb, acc, m, l, lo, nv);                         \
        else switch (nq) {                                                                         \
        case 1: attend_tile_bf16dp(tl, 1, CC, qb, acc, m, l, lo, nv); break;                       \
        case 2: attend_tile_bf16dp(tl, 2, CC, qb, acc, m, l, lo, nv); break;                       \
        case 3: attend_tile_bf16dp(tl, 3, CC, qb, acc, m, l, lo, nv); break;                       \
        default: attend_tile_bf16dp(tl, 4, CC, qb, acc, m, l, lo, nv); break;                      \
        }                                                                                          \
    }
DEFINE_TILE_BF16DP(tile_bf16dp_2, 2) /* head 64 */
DEFINE_TILE_BF16DP(tile_bf16dp_4, 4) /* head 128 */
DEFINE_TILE_BF16DP(tile_bf16dp_n, 0)
#endif

/* Whether (q dtype, cache dtype, head size) takes the AVX512_BF16 path: raw bf16 q, permuted
 * accumulator. A float32 q over a bf16 cache keeps its fp32 q and widens the keys instead. */
static int uses_bf16dp(int qdt, int dt, int d) {
    return HAVE_BF16DP && qdt == DT_BF16 && dt == DT_BF16 && d % 32 == 0;
}

static tile_fn pick_tile(int qdt, int dt, int d) {
#if HAVE_BF16DP
    if (uses_bf16dp(qdt, dt, d))
        return d == 64 ? tile_bf16dp_2 : d == 128 ? tile_bf16dp_4 : tile_bf16dp_n;
#else
    (void)qdt;
#endif
    if (dt == DT_F32) return d == 64 ? tile_f32_64 : d == 128 ? tile_f32_128 : tile_f32_n;
    if (dt == DT_F16) return d == 64 ? tile_f16_64 : d == 128 ? tile_f16_128 : tile_f16_n;
    if (dt == DT_E5M2) return d == 64 ? tile_e5m2_64 : d == 128 ? tile_e5m2_128 : tile_e5m2_n;
    return d == 64 ? tile_bf16_64 : d == 128 ? tile_bf16_128 : tile_bf16_n;
}

/* ---- one work item --------------------------------------------------------------------- */
typedef struct {
    char *out;
    const char *q;
    int64_t q_stride_token, q_stride_head; /* elements */
    const char *k_cache, *v_cache;
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens, *query_start_loc;
    int num_heads, num_kv_heads, head_size, block_size;
    int qdt, qes; /* dtype and element size of q and out */
    int dt, es;   /* dtype and element size of the cache */
    int bf16dp;
    int sliding_window; /* > 0: a query at position p sees keys (p - sliding_window, p] */
    float scale, soft_cap;
    /* an fp8 cache holds k / k_scale and v / v_scale: q is loaded times scale * k_scale, the
     * output written times v_scale */
    float q_scale, v_scale;
    tile_fn tile;
} Params;

/* Floats of per-thread scratch an item of nqv query vectors needs (see run_item). */
static size_t scratch_floats(int nqv, int d) {
    const int cp = (d + 31) / 32 * 32;
    return (size_t)nqv * (2 * cp + LANES + 2) + 64;
}

/* Byte offsets (slot * token_bytes) of the rows of key positions [t0, t0 + TILE_KEYS) clipped
 * to num_keys > t0 (keys past it repeat key t0); returns the number of valid keys. */
static int tile_rows(const Params *P, const int32_t *table, int64_t token_bytes, int t0,
                     int num_keys, int64_t *row) {
    const int nt = num_keys - t0 < TILE_KEYS ? num_keys - t0 : TILE_KEYS;
    int b = t0 / P->block_size, o = t0 % P->block_size;
    for (int t = 0; t < nt; t++) {
        row[t] = ((int64_t)table[b] * P->block_size + o) * token_bytes;
        if (++o == P->block_size) o = 0, b++;
    }
    for (int t = nt; t < TILE_KEYS; t++) row[t] = row[0];
    return nt;
}

/* Position of an item's first query row; its last row sees keys [0, first + rows). */
static int first_position(const Params *P, const int32_t *item) {
    const int req = item[0], qstart = P->query_start_loc[req];
    return P->seq_lens[req] - (P->query_start_loc[req + 1] - qstart) + (item[3] - qstart);
}

/* The first key any row of an item starting at position `first_pos` sees. */
static int first_key(const Params *P, int first_pos) {
    const int lo = P->sliding_window > 0 ? first_pos - P->sliding_window + 1 : 0;
    return lo > 0 ? lo : 0;
}

/* Runs one item; `next` (or NULL) is the item this thread runs after it, whose first tile is
 * prefetched during this one's last. */
static void run_item(const Params *P, const int32_t *item, const int32_t *next_item,
                     float *scratch) {
    const int req = item[0], h0 = item[1], h1 = item[2], r0 = item[3], r1 = item[4];
    const int d = P->head_size, es = P->es, qdt = P->qdt, qes = P->qes;
    const int group = P->num_heads / P->num_kv_heads, nrows = r1 - r0;
    const int per_head = nrows * group; /* query vectors per KV head */
    const int nqv = (h1 - h0) * per_head;
    const int cp = (d + 31) / 32 * 32; /* padded head size */
    const int first_pos = first_position(P, item);
    const int num_keys = first_pos + nrows; /* the last row sees keys [0, num_keys) */
    const int32_t *table = P->block_tables + (int64_t)req * P->block_table_stride;
    const int64_t head_bytes = (int64_t)d * es, token_bytes = head_bytes * P->num_kv_heads;

    /* Per query vector i = (kv head - h0) * per_head + row * group + g: its q (fp32 pre-scaled,
     * or raw bf16 for bf16dp), accumulator, running sum (LANES partial sums), running max and
     * position. */
    float *qf = scratch, *acc = qf + (size_t)nqv * cp, *l = acc + (size_t)nqv * cp;
    float *m = l + (size_t)nqv * LANES;
    int *pos = (int *)(m + nqv);
    for (int h = h0; h < h1; h++)
        for (int r = 0; r < nrows; r++)
            for (int g = 0; g < group; g++) {
                const int i = (h - h0) * per_head + r * group + g;
                const char *src = P->q + ((int64_t)(r0 + r) * P->q_stride_token +
                                          (int64_t)(h * group + g) * P->q_stride_head) * qes;
                if (P->bf16dp)
                    memcpy((uint16_t *)(qf + (size_t)i * cp), src, (size_t)d * 2);
                else
                    for (int c = 0; c < cp / LANES; c++) {
                        const vf x =
                            load_chunk(src, qdt, qes, c, d, (c + 1) * LANES > d) * P->q_scale;
                        memcpy(qf + (size_t)i * cp + c * LANES, &x, sizeof x);
                    }
                memset(acc + (size_t)i * cp, 0, sizeof(float) * cp);
                m[i] = -INFINITY;
                memset(l + (size_t)i * LANES, 0, sizeof(float) * LANES);
                pos[i] = first_pos + r;
            }

    Tile tl;
    tl.d = d, tl.scale = P->scale, tl.soft_cap = P->soft_cap;
    const int key0 = first_key(P, first_pos); /* keys before it are out of every row's window */
    int nt_next = tile_rows(P, table, token_bytes, key0, num_keys, tl.next_row);
    for (int t0 = key0; t0 < num_keys; t0 += TILE_KEYS) {
        const int nt = nt_next;
        memcpy(tl.row, tl.next_row, sizeof tl.row);
        int next_h0 = h0, next_h1 = h1; /* kv heads of the rows in `next_row` */
        if (t0 + TILE_KEYS < num_keys) {
            nt_next = tile_rows(P, table, token_bytes, t0 + TILE_KEYS, num_keys, tl.next_row);
        } else if (next_item != NULL) {
            const int32_t *next_table = P->block_tables + next_item[0] * P->block_table_stride;
            const int next_first = first_position(P, next_item);
            const int next_keys = next_first + next_item[4] - next_item[3];
            tile_rows(P, next_table, token_bytes, first_key(P, next_first), next_keys,
                      tl.next_row);
            next_h0 = next_item[1], next_h1 = next_item[2];
        }
        for (int h = h0; h < h1; h++) {
            const int next_h = next_h0 + (h - h0) < next_h1 ? next_h0 + (h - h0) : next_h0;
            tl.k = P->k_cache + h * head_bytes, tl.v = P->v_cache + h * head_bytes;
            tl.next_k = P->k_cache + next_h * head_bytes;
            tl.next_v = P->v_cache + next_h * head_bytes;
            for (int i0 = 0; i0 < per_head; i0 += MAX_GROUP) {
                const int nq = per_head - i0 < MAX_GROUP ? per_head - i0 : MAX_GROUP;
                void *qp[MAX_GROUP];
                float *ap[MAX_GROUP];
                int nlo[MAX_GROUP], nvalid[MAX_GROUP];
                const int base = (h - h0) * per_head + i0;
                for (int j = 0; j < nq; j++) {
                    qp[j] = qf + (size_t)(base + j) * cp;
                    ap[j] = acc + (size_t)(base + j) * cp;
                    const int n = pos[base + j] - t0 + 1;
                    nvalid[j] = n < nt ? n : nt;
                    nlo[j] = P->sliding_window > 0 ? n - P->sliding_window : 0;
                }
                P->tile(&tl, nq, qp, ap, m + base, l + (size_t)base * LANES, nlo, nvalid);
            }
        }
    }

    for (int h = h0; h < h1; h++)
        for (int r = 0; r < nrows; r++)
            for (int g = 0; g < group; g++) {
                const int i = (h - h0) * per_head + r * group + g;
                const int head = h * group + g;
                char *dst = P->out + ((int64_t)(r0 + r) * P->num_heads + head) * d * qes;
                vf lv;
                memcpy(&lv, l + (size_t)i * LANES, sizeof lv);
                const float sum = hsum(lv), inv = sum > 0.0f ? P->v_scale / sum : 0.0f;
                const float *a = acc + (size_t)i * cp;
#if HAVE_BF16DP
                if (P->bf16dp) {
                    for (int j = 0; j < d; j++)
                        store_scalar(dst, qdt, bf16dp_column(j), a[j] * inv);
                    continue;
                }
#endif
                for (int e = 0; e < d; e++) store_scalar(dst, qdt, e, a[e] * inv);
            }
}

/* ---- entry point ----------------------------------------------------------------------- */
/* The pool (pagoda/kernels/cpu/pool.c) the loader hands over; without it an OpenMP region
 * runs the same body on every thread. */
typedef void (*pool_body)(void *ctx, int thread);
typedef void (*parallel_run_fn)(pool_body body, void *ctx, int nthreads);
static parallel_run_fn parallel_run;

void pagoda_paged_attention_set_parallel_run(parallel_run_fn fn) { parallel_run = fn; }

typedef struct {
    const Params *P;
    const int32_t *items;
    int num_items;
    size_t scratch_bytes;
    int next_item; /* atomic */
    int failed;    /* atomic */
} AttnJob;

/* Each participant claims items one at a time (they come longest first), claiming its next
 * before running the current one so it can prefetch it. */
static void attn_body(void *p, int thread) {
    AttnJob *j = p;
    (void)thread;
    /* 64-byte aligned, rounded to whole cache lines: no line shared between threads. */
    float *scratch = (float *)aligned_alloc(64, (j->scratch_bytes + 63) / 64 * 64);
    if (scratch == NULL) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int cur = __atomic_fetch_add(&j->next_item, 1, __ATOMIC_RELAXED);
    while (cur < j->num_items) {
        const int nxt = __atomic_fetch_add(&j->next_item, 1, __ATOMIC_RELAXED);
        run_item(j->P, j->items + 5 * cur, nxt < j->num_items ? j->items + 5 * nxt : NULL, scratch);
        cur = nxt;
    }
    free(scratch);
}

/* out: [num_tokens, num_heads, head_size] contiguous, in q's dtype (`dtype`); the cache holds
 * `cache_dtype`: the same, a 16-bit cache under float32 q, or fp8 e5m2 (DT_E5M2) under any q,
 * holding k / k_scale and v / v_scale (the scales are ignored for other caches); keys and
 * values are widened on load.
 * items: [num_items, 5] int32 rows (request, kv_head_begin, kv_head_end, row_begin, row_end).
 * sliding_window: 0 for full causal attention; soft_cap: 0 for none.
 * Returns 0, or a negative code for arguments it cannot serve (checked before any work). */
int pagoda_paged_attention(void *out, const void *q, int64_t q_stride_token,
                           int64_t q_stride_head, const void *k_cache, const void *v_cache,
                           const int32_t *block_tables, int64_t block_table_stride,
                           const int32_t *seq_lens, const int32_t *query_start_loc,
                           const int32_t *items, int32_t num_items, int32_t num_heads,
                           int32_t num_kv_heads, int32_t head_size, int32_t block_size,
                           int32_t dtype, int32_t cache_dtype, float scale, float k_scale,
                           float v_scale, int32_t sliding_window, float soft_cap,
                           int32_t num_threads) {
    if (dtype < 0 || dtype > 2 || cache_dtype < 0 || cache_dtype > 3) return -1;
    if (cache_dtype != DT_E5M2) k_scale = v_scale = 1.0f; /* only fp8 is stored scaled */
    if (head_size <= 0 || head_size > LANES * MAX_CHUNKS) return -2;
    if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return -3;
    Params P = {(char *)out, (const char *)q, q_stride_token, q_stride_head,
                (const char *)k_cache, (const char *)v_cache, block_tables, block_table_stride,
                seq_lens, query_start_loc, num_heads, num_kv_heads, head_size, block_size,
                dtype, dt_size(dtype), cache_dtype, dt_size(cache_dtype),
                uses_bf16dp(dtype, cache_dtype, head_size),
                sliding_window > 0 ? sliding_window : 0, scale, soft_cap > 0.0f ? soft_cap : 0.0f,
                scale * k_scale, v_scale, pick_tile(dtype, cache_dtype, head_size)};
    const int group = num_heads / num_kv_heads;
    int max_qv = 0;
    for (int i = 0; i < num_items; i++) {
        const int32_t *it = items + 5 * i;
        const int n = (it[2] - it[1]) * (it[4] - it[3]) * group;
        max_qv = n > max_qv ? n : max_qv;
    }
    const size_t scratch_bytes = scratch_floats(max_qv, head_size) * sizeof(float);
    AttnJob j = {&P, items, num_items, scratch_bytes, 0, 0};
    if (num_threads < 1) num_threads = 1;
    if (parallel_run && num_threads > 1 && num_items > 1) {
        parallel_run(attn_body, &j, num_threads);
        return j.failed ? -4 : 0;
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    attn_body(&j, 0);
    return j.failed ? -4 : 0;
}

/* Writes row t of k and of v (`width` elements each, rows `row_stride` elements apart, in
 * `dtype`) to slot slots[t] of the caches (rows of `width` elements in `cache_dtype`),
 * narrowing float32 to a 16-bit cache, or to fp8 e5m2 as x / scale saturated to +-57344 (what
 * the torch backend writes; k_scale and v_scale apply to e5m2 only); a slot < 0 is not written.
 * Returns 0, or -1 for arguments it cannot serve (a narrower source than the cache, an unknown
 * dtype). */
int pagoda_write_kv(const void *k, const void *v, int64_t row_stride, int32_t dtype,
                    void *k_cache, void *v_cache, int32_t cache_dtype, const int64_t *slots,
                    int64_t rows, int64_t width, float k_scale, float v_scale) {
    if (dtype < 0 || dtype > 2 || cache_dtype < 0 || cache_dtype > 3) return -1;
    if (dtype != cache_dtype && dtype != DT_F32) return -1;
    const int es = dt_size(dtype), ces = dt_size(cache_dtype);
    const int64_t row_bytes = width * ces, whole = width / LANES * LANES;
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0) continue;
        for (int kv = 0; kv < 2; kv++) {
            const char *src = (const char *)(kv ? v : k) + t * row_stride * es;
            char *dst = (char *)(kv ? v_cache : k_cache) + slots[t] * row_bytes;
            if (dtype == cache_dtype) {
                memcpy(dst, src, (size_t)row_bytes);
                continue;
            }
            const float *x = (const float *)src;
            if (cache_dtype == DT_E5M2) {
                const float scale = kv ? v_scale : k_scale, bound = 57344.0f;
                for (int64_t i = 0; i < width; i++) {
                    const float y = x[i] / scale;
                    ((uint8_t *)dst)[i] = f32_to_e5m2(y > bound ? bound : y < -bound ? -bound : y);
                }
                continue;
            }
            int64_t i = 0;
            for (; i < whole; i += LANES)
                store_lanes(dst + i * ces, cache_dtype, load_lanes(x + i, DT_F32));
            for (; i < width; i++) store_scalar(dst, cache_dtype, (int)i, x[i]);
        }
    }
    return 0;
}

/* Lets the loader check it has the library it built (bump when the signature changes). */
int pagoda_paged_attention_abi(void) { return 5; }

/* 1 when bf16 caches take the AVX512_BF16 path (p.v rounds p to bf16), for tests and logs. */
int pagoda_paged_attention_bf16dp(void) { return HAVE_BF16DP; }
