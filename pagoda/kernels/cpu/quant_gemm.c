/* y = x @ W^T with W kept in its GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), as
 * llama.cpp computes it: each activation row is quantized on the fly to int8 in blocks of
 * 32 (scale d = max|x| / 127 and the block sum s = d * sum(q), ggml's Q8_1), each 32-weight
 * sub-block of W is decoded to small integers (quant_blocks.h), their dot product is taken in
 * integers and the block scales applied in fp32:
 *     y[i, n] = sum_b  dx[i, b] * sum_l dv_w[n, b, l/4] * qw[n, b, l] * qx[i, b, l]
 *                    + m_w[n, b] * s_x[i, b]
 * (m_w is the block offset of the asymmetric types: Q4_1's min, Q4_0's -8d, k-quants' -dmin*m).
 *
 * The integer dot is `vpdpbusd` where the compiler targets AVX512-VNNI (the x8 layout's
 * 512-bit tile, quant_x8.h, and 256-bit with VL elsewhere), `vpmaddubsw` + `vpmaddwd` with
 * AVX2, plain C otherwise: the same source builds at any ISA level, and every level computes
 * the same integers (only the fp32 summation order differs, and not between the x8 layout's
 * SIMD tiles).
 * On a CPU with AMX-INT8, x8 weights at batch take their integer dots from AMX tiles instead
 * (quant_amx.h), with the same bits as the vector tiles.
 * Work is split over OpenMP threads by chunks of weight rows; within a chunk, tiles of 2
 * weight rows x 4 activation rows reuse each decoded weight block four times and each
 * activation block twice (prefill), while a decode's single row streams the weights once.
 * Entry points return 0, or -1 for arguments they do not handle. */
#include "quant_blocks.h"

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PAGODA_QUANT_ABI 3
#define TILE_W 2  /* weight rows per tile */
#define TILE_X 4  /* activation rows per tile */
#define CHUNK 16  /* weight rows per thread work item */
#define PANEL 64  /* activation rows per pass over a thread's weights */

int pagoda_quant_abi(void) { return PAGODA_QUANT_ABI; }

const char *pagoda_quant_isa(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512vnni";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX2__) && defined(__FMA__)
#define QUANT_VNNI 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define QUANT_AVX2 1
#endif
#if defined(QUANT_VNNI) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_VNNI512 1 /* x8 weights: 16 rows x 8 activation rows a tile */
#define X16_ROWS 8
#endif

/* Quantized activations: rows of K int8 (q) with per-32 scales d and sums s = d * sum(q),
 * and the integer sums sum(q) themselves (qsum). */
typedef struct {
    int8_t *q;
    float *d, *s;
    int32_t *qsum;
    int64_t K, nb;
} QActs;

INLINE float bf16_to_fp32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t fp32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                                       /* nearest even */
    return (uint16_t)(u >> 16);
}

/* One row of x (fp32, or bf16 when x_bf16) -> K int8 + nb scales and sums. Rounds half to
 * even (nearbyint / _mm256_round_ps), so every ISA level makes the same integers. */
static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *d, float *s,
                         int32_t *qsum) {
    for (int64_t b = 0; b < K / 32; b++) {
        float v[32], amax = 0.0f;
#if defined(QUANT_AVX2)
        /* max|x| in vectors: max_ps(a, m) keeps m when a is NaN, as the scalar loop does */
        __m256 m8 = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
        for (int k = 0; k < 4; k++) {
            __m256 xv;
            if (x_bf16) {
                const uint16_t *src = (const uint16_t *)x + b * 32 + 8 * k;
                const __m128i h = _mm_loadu_si128((const __m128i *)src);
                xv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            } else {
                xv = _mm256_loadu_ps((const float *)x + b * 32 + 8 * k);
            }
            _mm256_storeu_ps(v + 8 * k, xv);
            m8 = _mm256_max_ps(_mm256_and_ps(xv, abs_mask), m8);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        amax = _mm_cvtss_f32(m4);
#else
        for (int l = 0; l < 32; l++) {
            v[l] = x_bf16 ? bf16_to_fp32(((const uint16_t *)x)[b * 32 + l])
                          : ((const float *)x)[b * 32 + l];
            const float a = fabsf(v[l]);
            amax = a > amax ? a : amax; /* fmaxf's result (a NaN is skipped), but inlined */
        }
#endif
        const float dd = amax / 127.0f, id = dd != 0.0f ? 1.0f / dd : 0.0f;
        int sum = 0;
#if defined(QUANT_AVX2)
        __m256i i[4];
        for (int k = 0; k < 4; k++) {
            __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * k), _mm256_set1_ps(id)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            i[k] = _mm256_cvtps_epi32(r);
        }
        __m256i t = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_hadd_epi32(t4, t4);
        sum = _mm_cvtsi128_si32(_mm_hadd_epi32(t4, t4));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + b * 32), p);
#else
        for (int l = 0; l < 32; l++) {
            int qi = (int)nearbyintf(v[l] * id);
            q[b * 32 + l] = (int8_t)qi;
            sum += qi;
        }
#endif
        d[b] = dd;
        s[b] = dd * (float)sum;
        qsum[b] = sum;
    }
}

#include "quant_rows.h"
#include "quant_x8.h"

typedef struct {
    const uint8_t *w;
    int64_t w_stride; /* bytes between weight rows (x8: between groups of 8 rows) */
    const float *bias;
    void *y;
    int64_t y_stride; /* elements between output rows */
    int y_bf16;
    int64_t M, N;
} GemmArgs;

/* y[m, n] = v + bias[n], in fp32 or rounded to bf16. */
INLINE void store_value(const GemmArgs *g, int64_t n, int64_t m, float v) {
    v += g->bias ? g->bias[n] : 0.0f;
    const int64_t at = m * g->y_stride + n;
    if (g->y_bf16) ((uint16_t *)g->y)[at] = fp32_to_bf16(v);
    else ((float *)g->y)[at] = v;
}

INLINE void store_tile(const GemmArgs *g, int64_t n0, int nr, int64_t m0, int nc,
                       float out[TILE_W][TILE_X]) {
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) store_value(g, n0 + r, m0 + c, out[r][c]);
}

/* Weight rows [n0, n1) against every activation row; `offsets` is TILE_W * nb floats. */
INLINE void gemm_chunk(const int type, const GemmArgs *g, const QActs *a, int64_t n0, int64_t n1,
                       int64_t ma, int64_t mb, float *offsets) {
    float out[TILE_W][TILE_X];
    for (int64_t m0 = ma; m0 < mb; m0 += TILE_X) {
        const int nc = mb - m0 < TILE_X ? (int)(mb - m0) : TILE_X;
        for (int64_t n = n0; n < n1; n += TILE_W) {
            const uint8_t *w = g->w + n * g->w_stride;
            const int nr = n1 - n < TILE_W ? 1 : TILE_W;
            /* constant tile shapes, so each call below is unrolled and kept in registers */
            if (nr == TILE_W && nc == 4) tile(type, w, g->w_stride, TILE_W, a, m0, 4, out, offsets);
            else if (nr == TILE_W && nc == 3) tile(type, w, g->w_stride, TILE_W, a, m0, 3, out, offsets);
            else if (nr == TILE_W && nc == 2) tile(type, w, g->w_stride, TILE_W, a, m0, 2, out, offsets);
            else if (nr == TILE_W) tile(type, w, g->w_stride, TILE_W, a, m0, 1, out, offsets);
            else if (nc == 4) tile(type, w, g->w_stride, 1, a, m0, 4, out, offsets);
            else if (nc == 3) tile(type, w, g->w_stride, 1, a, m0, 3, out, offsets);
            else if (nc == 2) tile(type, w, g->w_stride, 1, a, m0, 2, out, offsets);
            else tile(type, w, g->w_stride, 1, a, m0, 1, out, offsets);
            store_tile(g, n, nr, m0, nc, out);
        }
    }
}

/* out[c][r] (an x8 tile: activation row m0 + c, weight row n0 + r) into y, with the bias. */
INLINE void store_rows(const GemmArgs *g, int64_t n0, int nr, int64_t m0, int nc,
                       const float out[][8]) {
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++) store_value(g, n0 + r, m0 + c, out[c][r]);
}

#if defined(QUANT_VNNI512)
/* store_rows for one activation row of a 16-row tile, in vectors: the same fp32 bias add and
 * the same rounding to bf16 (nearest even, NaN kept quiet) as fp32_to_bf16. */
INLINE void store16(const GemmArgs *g, int64_t n0, int nr, int64_t m, __m512 v) {
    const __mmask16 k = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    if (g->bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, g->bias + n0));
    const int64_t at = m * g->y_stride + n0;
    if (!g->y_bf16) {
        _mm512_mask_storeu_ps((float *)g->y + at, k, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i up = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(up, one))),
        16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(up, _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16((uint16_t *)g->y + at, k, _mm512_cvtepi32_epi16(r));
}

/* Groups [g0, g1) of an x8 weight, two at a time, against every activation row. */
INLINE void x16_chunk(const int type, const GemmArgs *g, const QActs *a, int64_t g0, int64_t g1,
                      int64_t ma, int64_t mb) {
    for (int64_t m0 = ma; m0 < mb; m0 += X16_ROWS) {
        const int nc = mb - m0 < X16_ROWS ? (int)(mb - m0) : X16_ROWS;
        for (int64_t gi = g0; gi < g1; gi += 2) {
            const uint8_t *grp = g->w + gi * g->w_stride;
            const int64_t gs = gi + 1 < g1 ? g->w_stride : 0; /* a last odd group: twice */
            __m512 v[X16_ROWS];
            switch (nc) { /* constant tile shapes, so each call is unrolled into registers */
            case 8: x16_tile(type, grp, gs, a, m0, 8, v); break;
            case 7: x16_tile(type, grp, gs, a, m0, 7, v); break;
            case 6: x16_tile(type, grp, gs, a, m0, 6, v); break;
            case 5: x16_tile(type, grp, gs, a, m0, 5, v); break;
            case 4: x16_tile(type, grp, gs, a, m0, 4, v); break;
            case 3: x16_tile(type, grp, gs, a, m0, 3, v); break;
            case 2: x16_tile(type, grp, gs, a, m0, 2, v); break;
            default: x16_tile(type, grp, gs, a, m0, 1, v); break;
            }
            const int64_t left = g->N - gi * 8;
            const int nr = left < (gs ? 16 : 8) ? (int)left : (gs ? 16 : 8);
            for (int c = 0; c < nc; c++) store16(g, gi * 8, nr, m0 + c, v[c]);
        }
    }
}
#endif

/* Groups [g0, g1) of an x8 weight against every activation row. */
INLINE void x8_chunk(const int type, const GemmArgs *g, const QActs *a, int64_t g0, int64_t g1,
                     int64_t ma, int64_t mb) {
#if defined(QUANT_VNNI512)
    /* Q8_0 streams twice Q4's bytes: under 8 rows the 256-bit tile, one stream, keeps ahead */
    if (type != GGML_Q8_0 || mb - ma >= 8) {
        x16_chunk(type, g, a, g0, g1, ma, mb);
        return;
    }
#endif
    float out[TILE_X][8];
    for (int64_t m0 = ma; m0 < mb; m0 += TILE_X) {
        const int nc = mb - m0 < TILE_X ? (int)(mb - m0) : TILE_X;
        for (int64_t gi = g0; gi < g1; gi++) {
            const uint8_t *grp = g->w + gi * g->w_stride;
#if defined(QUANT_AVX2)
            __m256 v[TILE_X];
            if (nc == 4) x8_tile(type, grp, a, m0, 4, v);
            else if (nc == 3) x8_tile(type, grp, a, m0, 3, v);
            else if (nc == 2) x8_tile(type, grp, a, m0, 2, v);
            else x8_tile(type, grp, a, m0, 1, v);
            for (int c = 0; c < nc; c++) _mm256_storeu_ps(out[c], v[c]);
#else
            x8_tile_portable(type, grp, a, m0, nc, out);
#endif
            const int nr = g->N - gi * 8 < 8 ? (int)(g->N - gi * 8) : 8;
            store_rows(g, gi * 8, nr, m0, nc, out);
        }
    }
}

/* Work item `ch` (CHUNK weight rows) against activation rows [ma, mb), either layout, one
 * specialised copy per type. */
static void run_chunk(int type, int x8, const GemmArgs *g, const QActs *a, int64_t ch,
                      int64_t ma, int64_t mb, float *offsets) {
    if (x8) {
        const int64_t g0 = ch * (CHUNK / 8), groups = (g->N + 7) / 8;
        const int64_t g1 = g0 + CHUNK / 8 < groups ? g0 + CHUNK / 8 : groups;
        switch (type) {
        case GGML_Q4_0: x8_chunk(GGML_Q4_0, g, a, g0, g1, ma, mb); return;
        case GGML_Q4_1: x8_chunk(GGML_Q4_1, g, a, g0, g1, ma, mb); return;
        default: x8_chunk(GGML_Q8_0, g, a, g0, g1, ma, mb); return;
        }
    }
    const int64_t n0 = ch * CHUNK, n1 = n0 + CHUNK < g->N ? n0 + CHUNK : g->N;
    switch (type) {
    case GGML_Q4_0: gemm_chunk(GGML_Q4_0, g, a, n0, n1, ma, mb, offsets); return;
    case GGML_Q4_1: gemm_chunk(GGML_Q4_1, g, a, n0, n1, ma, mb, offsets); return;
    case GGML_Q8_0: gemm_chunk(GGML_Q8_0, g, a, n0, n1, ma, mb, offsets); return;
    case GGML_Q4_K: gemm_chunk(GGML_Q4_K, g, a, n0, n1, ma, mb, offsets); return;
    case GGML_Q5_K: gemm_chunk(GGML_Q5_K, g, a, n0, n1, ma, mb, offsets); return;
    default: gemm_chunk(GGML_Q6_K, g, a, n0, n1, ma, mb, offsets); return;
    }
}

/* Threads for `work` units of `unit_cost` bytes: one below ~64 KiB of traffic, where an
 * OpenMP fork/join costs more than it saves (cpu_ops.c's rule). */
static int pick_threads(int nthreads, int64_t work, int64_t unit_cost) {
    if (nthreads < 1) nthreads = 1;
    if (work * unit_cost < 65536) return 1;
    return work < nthreads ? (int)(work > 0 ? work : 1) : nthreads;
}

/* The pool (pool.c) the loader hands over; without it the OpenMP regions below run. */
typedef void (*pool_body)(void *ctx, int thread);
typedef void (*parallel_run_fn)(pool_body body, void *ctx, int nthreads);
static parallel_run_fn parallel_run;

void pagoda_quant_set_parallel_run(parallel_run_fn fn) { parallel_run = fn; }

/* One GEMM as pool jobs: rows to quantize, `qclaim` at a time, then (panel, chunk) items in
 * panel order, claimed `claim` consecutive items at a time by whichever thread comes next: a
 * thread streams a run of weight rows, and the shared counter moves a few dozen times per GEMM
 * rather than once per 16 rows or per activation row (its cache line going back and forth
 * between the cores each time: claimed row by row, the quantize job spent most of its time
 * there). */
typedef struct {
    int type, x8, x_bf16;
    const GemmArgs *g;
    const QActs *a;
    const char *x;
    int64_t x_stride, es, chunks, items, claim, qclaim;
    float *offsets; /* TILE_W * nb floats per thread */
    int failed; /* set by a job that could not allocate its scratch */
    _Alignas(64) int64_t next; /* the next item to claim, atomic, on a line of its own */
} GemmJob;

static void quantize_body(void *p, int thread) {
    GemmJob *j = p;
    const QActs *a = j->a;
    (void)thread;
    const int64_t M = j->g->M;
    for (;;) {
        const int64_t m0 = __atomic_fetch_add(&j->next, j->qclaim, __ATOMIC_RELAXED);
        if (m0 >= M) return;
        for (int64_t m = m0; m < m0 + j->qclaim && m < M; m++)
            quantize_row(j->x + m * j->x_stride * j->es, j->x_bf16, a->K, a->q + m * a->K,
                         a->d + m * a->nb, a->s + m * a->nb, a->qsum + m * a->nb);
    }
}

static void gemm_body(void *p, int thread) {
    GemmJob *j = p;
    float *offsets = j->offsets + (int64_t)thread * TILE_W * j->a->nb;
    for (;;) {
        const int64_t i0 = __atomic_fetch_add(&j->next, j->claim, __ATOMIC_RELAXED);
        if (i0 >= j->items) return;
        const int64_t i1 = i0 + j->claim < j->items ? i0 + j->claim : j->items;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t ma = i / j->chunks * PANEL, M = j->g->M;
            run_chunk(j->type, j->x8, j->g, j->a, i % j->chunks, ma,
                      ma + PANEL < M ? ma + PANEL : M, offsets);
        }
    }
}

#if defined(QUANT_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define QUANT_AMX 1
#include "quant_amx.h"
#endif

/* Whether the x8 GEMM's AMX path (quant_amx.h) runs here: built in and granted by the OS. */
int pagoda_quant_amx(void) {
#if defined(QUANT_AMX)
    return amx_usable();
#else
    return 0;
#endif
}

/* The activation row count from which Q8_0 x8 weights take the AMX path (Q4 from twice it);
 * returns the previous one, or -1 where there is none (tests and tuning: a huge count keeps the
 * vector tiles). */
int pagoda_quant_set_amx_min_rows(int rows) {
#if defined(QUANT_AMX)
    int old = quant_amx_min_rows;
    quant_amx_min_rows = rows < 1 ? 1 : rows;
    return old;
#else
    (void)rows;
    return -1;
#endif
}

/* y[M, N] (fp32, or bf16 when y_bf16) = x[M, K] (fp32, or bf16 when x_bf16) @ W^T + bias;
 * W [N, K] as rows of GGUF blocks `w_stride` bytes apart, or with `x8` in the x8 layout
 * (quant_x8.h), groups of 8 rows `w_stride` bytes apart; bias fp32 or NULL. */
int pagoda_quant_gemm(const void *x, int64_t x_stride, int x_bf16, const uint8_t *w,
                      int64_t w_stride, int type, int x8, const float *bias, void *y,
                      int64_t y_stride, int y_bf16, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int qk = block_elems(type), bytes = block_bytes(type);
    if (bytes == 0 || M < 0 || N < 0 || K <= 0 || K % qk || x_stride < K || y_stride < N ||
        w_stride < K / qk * bytes * (x8 ? 8 : 1) || (x8 && !x8_type(type)))
        return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t nb = K / 32;
    /* activations (q, d, s, qsum) then one offsets buffer per thread */
    int nt = pick_threads(nthreads, (N + CHUNK - 1) / CHUNK, CHUNK * K / 2 + M * K / 8);
#if defined(QUANT_AMX)
    /* Q4's integer tiles keep up below 64 rows (quant_amx.h) */
    const int amx = x8 && M >= quant_amx_min_rows * (type == GGML_Q8_0 ? 1 : 2) && amx_usable();
#else
    const int amx = 0;
#endif
    const int64_t mq = amx ? (M + 15) / 16 * 16 : M; /* the tiles read whole 16-row blocks */
    size_t act_bytes = (size_t)(mq * K + 3 * M * nb * 4 + 64) & ~(size_t)63;
    char *buf = aligned_alloc(64, act_bytes + (size_t)nt * TILE_W * nb * 4 + 64);
    if (!buf) return -1;
    float *scales = (float *)(buf + mq * K);
    QActs a = {(int8_t *)buf, scales, scales + M * nb, (int32_t *)(scales + 2 * M * nb), K, nb};
    GemmArgs g = {w, w_stride, bias, y, y_stride, y_bf16, M, N};
    const int64_t es = x_bf16 ? 2 : 4, chunks = (N + CHUNK - 1) / CHUNK;
    if (parallel_run && nt > 1) {
        const int64_t items = chunks * ((M + PANEL - 1) / PANEL);
        const int64_t claim = items / (8 * nt) > 1 ? items / (8 * nt) : 1; /* ~8 claims a thread */
        const int64_t qclaim = M / (4 * nt) > 1 ? M / (4 * nt) : 1;       /* ~4 claims a thread */
        GemmJob j = {type,  x8,    x_bf16, &g, &a, x, x_stride, es, chunks,
                     items, claim, qclaim, (float *)(buf + act_bytes), 0, 0};
        if (M >= 8) parallel_run(quantize_body, &j, nt);
        else quantize_body(&j, 0);
        j.next = 0;
#if defined(QUANT_AMX)
        if (amx) parallel_run(quant_amx_body, &j, nt);
        else
#endif
            parallel_run(gemm_body, &j, nt);
        free(buf);
        return j.failed ? -1 : 0;
    }
#if defined(QUANT_AMX)
    GemmJob amx_job = {type, x8, x_bf16, &g, &a, x, x_stride, es, chunks, 0, 1, 1, NULL, 0, 0};
#endif
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        float *offsets = (float *)(buf + act_bytes) + (int64_t)omp_get_thread_num() * TILE_W * nb;
#else
        float *offsets = (float *)(buf + act_bytes);
#endif
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row((const char *)x + m * x_stride * es, x_bf16, K, a.q + m * K,
                         a.d + m * nb, a.s + m * nb, a.qsum + m * nb);
        /* this thread's chunks, against panels of PANEL activation rows: the panel stays in
         * L2 while the thread's weights stream past it */
#ifdef _OPENMP
        const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int64_t tid = 0, nth = 1;
#endif
        const int64_t c0 = chunks * tid / nth, c1 = chunks * (tid + 1) / nth;
#if defined(QUANT_AMX)
        if (amx) quant_amx_body(&amx_job, (int)tid);
        else
#endif
            for (int64_t ma = 0; ma < M; ma += PANEL)
                for (int64_t ch = c0; ch < c1; ch++)
                    run_chunk(type, x8, &g, &a, ch, ma, ma + PANEL < M ? ma + PANEL : M, offsets);
    }
    free(buf);
#if defined(QUANT_AMX)
    if (amx && amx_job.failed) return -1;
#endif
    return 0;
}

int pagoda_quant_dequantize_rows(const uint8_t *w, int64_t w_stride, int type, int x8,
                                 const int64_t *ids, int64_t n, int64_t n_rows, int64_t K,
                                 float *out) {
    if (block_bytes(type) == 0 || K % block_elems(type) || (x8 && !x8_type(type))) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return -1;
    for (int64_t i = 0; i < n; i++) {
        if (x8) {
            const uint8_t *grp = w + ids[i] / 8 * w_stride;
            for (int64_t b = 0; b < K / 32; b++)
                for (int l = 0; l < 32; l++) {
                    int q;
                    float d, m;
                    x8_weight(type, grp, b, (int)(ids[i] % 8), l, &q, &d, &m);
                    out[i * K + b * 32 + l] = d * (float)q + m;
                }
            continue;
        }
        const uint8_t *row = w + ids[i] * w_stride;
        for (int64_t b = 0; b < K / 32; b++) {
            int8_t q[32];
            float dv[8], m;
            decode_q(type, row, b, q);
            sub_block_scales(type, row, b, dv, &m);
            for (int l = 0; l < 32; l++) out[i * K + b * 32 + l] = dv[l / 4] * (float)q[l] + m;
        }
    }
    return 0;
}
