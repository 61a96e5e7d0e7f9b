/* Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small, bf16 or fp32.
 *
 * At decode the weights stream from DRAM once per step and the few activation rows sit in L1,
 * so the product is memory bound: the kernel's job is to read each weight byte once, at full
 * bandwidth, with little fixed cost per call. Each thread takes a contiguous run of W's rows
 * (one sequential stream for the hardware prefetcher, plus a software prefetch further ahead)
 * and walks it in tiles of GEMV_R rows; a tile is multiplied against every x row (in groups of
 * up to 4, while the tile stays in L1) with vdpbf16ps: pairs of bf16 products summed into
 * fp32 lanes, so the accumulation is fp32 like torch's (fp32 weights: plain FMAs). Each
 * (row, x) accumulator is reduced horizontally once at the end of the tile, the bias added in
 * fp32, and the result stored as bf16 (round to nearest even) or fp32 (the logits). */
#pragma once
#include "simd.h"

#define GEMV_R 4
/* How far ahead of the current tile the weight stream is prefetched, in bf16 elements (8 KiB). */
#define GEMV_PREFETCH 4096

typedef struct {
    const void *x;
    int64_t x_stride;
    const void *w;
    const void *bias;
    void *y;
    int64_t y_stride;
    int y_fp32;
    int64_t M, N, K;
} GemvArgs;

/* One step of K (32 bf16 / 16 fp32 values at byte offset `off`) for a tile's accumulators;
 * `tail` masks the loads past K (they read zeros), the main loop's full steps load plainly. */
INLINE void gemv_step(__m512 acc[GEMV_R][4], const char *x, int64_t xs, const char *w, int64_t ws,
                      int64_t off, const int DT, const int R, const int MT, int64_t tail,
                      int prefetch) {
    if (DT == DT_BF16) {
        __mmask32 mk = tail_mask32(tail);
        __m512bh xv[4];
        for (int m = 0; m < MT; m++)
            xv[m] = tail ? (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * xs + off)
                         : (__m512bh)_mm512_loadu_si512(x + m * xs + off);
        for (int r = 0; r < R; r++) {
            if (prefetch) _mm_prefetch(w + r * ws + off + GEMV_PREFETCH, _MM_HINT_T0);
            __m512bh wv = tail ? (__m512bh)_mm512_maskz_loadu_epi16(mk, w + r * ws + off)
                               : (__m512bh)_mm512_loadu_si512(w + r * ws + off);
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
        }
    } else {
        __mmask16 mk = tail_mask16(tail);
        __m512 xv[4];
        for (int m = 0; m < MT; m++)
            xv[m] = tail ? _mm512_maskz_loadu_ps(mk, x + m * xs + off)
                         : _mm512_loadu_ps(x + m * xs + off);
        for (int r = 0; r < R; r++) {
            if (prefetch) _mm_prefetch(w + r * ws + off + GEMV_PREFETCH, _MM_HINT_T0);
            __m512 wv = tail ? _mm512_maskz_loadu_ps(mk, w + r * ws + off)
                             : _mm512_loadu_ps(w + r * ws + off);
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
        }
    }
}

/* Rows [n0, n0 + R) of W against x rows [m0, m0 + MT). DT, R and MT are compile-time
 * constants at every call site, so the accumulators live in registers. bf16 steps 32 values of
 * K per vdpbf16ps; fp32 (float32 models) 16 per FMA. */
INLINE void gemv_tile(const GemvArgs *a, int64_t n0, int64_t m0, const int DT, const int R,
                      const int MT, int prefetch) {
    const int64_t K = a->K, es = DT == DT_BF16 ? 2 : 4, step = DT == DT_BF16 ? 32 : 16;
    const char *w = (const char *)a->w + n0 * K * es;
    const char *x = (const char *)a->x + m0 * a->x_stride * es;
    const int64_t xs = a->x_stride * es, ws = K * es;
    __m512 acc[GEMV_R][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + step <= K; k += step) gemv_step(acc, x, xs, w, ws, k * es, DT, R, MT, 0, prefetch);
    if (k < K) gemv_step(acc, x, xs, w, ws, k * es, DT, R, MT, K - k, 0);
    for (int m = 0; m < MT; m++) {
        for (int r = 0; r < R; r++) {
            float s = _mm512_reduce_add_ps(acc[r][m]);
            int64_t n = n0 + r, row = (m0 + m) * a->y_stride;
            if (a->bias) {
                if (DT == DT_BF16) {
                    uint32_t u = (uint32_t)((const uint16_t *)a->bias)[n] << 16;
                    float b;
                    memcpy(&b, &u, 4);
                    s += b;
                } else {
                    s += ((const float *)a->bias)[n];
                }
            }
            if (DT != DT_BF16 || a->y_fp32) ((float *)a->y)[row + n] = s;
            else ((uint16_t *)a->y)[row + n] = f32_to_bf16(s);
        }
    }
}

/* W rows [n0, n0 + R) against all of x, 4 x rows at a time (the tile stays in L1). */
INLINE void gemv_rows(const GemvArgs *a, int64_t n0, const int DT, const int R, int prefetch) {
    int64_t m0 = 0;
    for (; m0 + 4 <= a->M; m0 += 4) gemv_tile(a, n0, m0, DT, R, 4, prefetch && m0 == 0);
    switch (a->M - m0) {
    case 1: gemv_tile(a, n0, m0, DT, R, 1, prefetch && m0 == 0); break;
    case 2: gemv_tile(a, n0, m0, DT, R, 2, prefetch && m0 == 0); break;
    case 3: gemv_tile(a, n0, m0, DT, R, 3, prefetch && m0 == 0); break;
    default: break;
    }
}

static void gemv_range(const GemvArgs *a, int dt, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    if (dt == DT_BF16) {
        for (; n + GEMV_R <= n_end; n += GEMV_R) gemv_rows(a, n, DT_BF16, GEMV_R, 1);
        for (; n < n_end; n++) gemv_rows(a, n, DT_BF16, 1, 0);
    } else {
        for (; n + GEMV_R <= n_end; n += GEMV_R) gemv_rows(a, n, DT_F32, GEMV_R, 1);
        for (; n < n_end; n++) gemv_rows(a, n, DT_F32, 1, 0);
    }
}

static void gemv(const GemvArgs *a, int dt, int nthreads) {
    /* Split N into one contiguous run per thread, in whole tiles. */
    int64_t tiles = (a->N + GEMV_R - 1) / GEMV_R;
    int nt = pick_threads(nthreads, tiles, GEMV_R * a->K * (dt == DT_BF16 ? 2 : 4));
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        int64_t begin = tiles * t / T * GEMV_R, end = tiles * (t + 1) / T * GEMV_R;
        if (end > a->N) end = a->N;
        if (begin < end) gemv_range(a, dt, begin, end);
    }
}
