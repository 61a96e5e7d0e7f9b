/* Skinny bf16 GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small.
 *
 * At decode the weights stream from DRAM once per step and the few activation rows sit in L1,
 * so the product is memory bound: the kernel's job is to read each weight byte once, at full
 * bandwidth, with little fixed cost per call. Each thread takes a contiguous run of W's rows
 * (one sequential stream for the hardware prefetcher, plus a software prefetch further ahead)
 * and walks it in tiles of GEMV_R rows; a tile is multiplied against every x row (in groups of
 * up to 4, while the tile stays in L1) with vdpbf16ps: pairs of bf16 products summed into
 * fp32 lanes, so the accumulation is fp32 like torch's. Each (row, x) accumulator is reduced
 * horizontally once at the end of the tile, the bias added in fp32, and the result stored as
 * bf16 (round to nearest even) or fp32 (the logits). */
#pragma once
#include "simd.h"

#define GEMV_R 4
/* How far ahead of the current tile the weight stream is prefetched, in bf16 elements (8 KiB). */
#define GEMV_PREFETCH 4096

typedef struct {
    const uint16_t *x;
    int64_t x_stride;
    const uint16_t *w;
    const uint16_t *bias;
    void *y;
    int64_t y_stride;
    int y_fp32;
    int64_t M, N, K;
} GemvArgs;

/* Rows [n0, n0 + R) of W against x rows [m0, m0 + MT). R and MT are compile-time constants
 * at every call site, so the accumulators live in registers. */
INLINE void gemv_tile(const GemvArgs *a, int64_t n0, int64_t m0, const int R, const int MT,
                      int prefetch) {
    const int64_t K = a->K;
    const uint16_t *w = a->w + n0 * K;
    const uint16_t *x = a->x + m0 * a->x_stride;
    __m512 acc[GEMV_R][4];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh xv[4];
        for (int m = 0; m < MT; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * a->x_stride + k);
        for (int r = 0; r < R; r++) {
            if (prefetch) _mm_prefetch((const char *)(w + r * K + k + GEMV_PREFETCH), _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * K + k);
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
        }
    }
    if (k < K) { /* odd K: masked loads read zeros past the end */
        __mmask32 mk = tail_mask32(K - k);
        __m512bh xv[4];
        for (int m = 0; m < MT; m++)
            xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * a->x_stride + k);
        for (int r = 0; r < R; r++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, w + r * K + k);
            for (int m = 0; m < MT; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
        }
    }
    for (int m = 0; m < MT; m++) {
        for (int r = 0; r < R; r++) {
            float s = _mm512_reduce_add_ps(acc[r][m]);
            int64_t n = n0 + r, row = (m0 + m) * a->y_stride;
            if (a->bias) {
                uint32_t u = (uint32_t)a->bias[n] << 16;
                float b;
                memcpy(&b, &u, 4);
                s += b;
            }
            if (a->y_fp32) ((float *)a->y)[row + n] = s;
            else ((uint16_t *)a->y)[row + n] = f32_to_bf16(s);
        }
    }
}

/* W rows [n0, n0 + R) against all of x, 4 x rows at a time. */
INLINE void gemv_rows(const GemvArgs *a, int64_t n0, const int R, int prefetch) {
    int64_t m0 = 0;
    for (; m0 + 4 <= a->M; m0 += 4) gemv_tile(a, n0, m0, R, 4, prefetch && m0 == 0);
    switch (a->M - m0) {
    case 1: gemv_tile(a, n0, m0, R, 1, prefetch && m0 == 0); break;
    case 2: gemv_tile(a, n0, m0, R, 2, prefetch && m0 == 0); break;
    case 3: gemv_tile(a, n0, m0, R, 3, prefetch && m0 == 0); break;
    default: break;
    }
}

static void gemv_range(const GemvArgs *a, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    for (; n + GEMV_R <= n_end; n += GEMV_R) gemv_rows(a, n, GEMV_R, 1);
    for (; n < n_end; n++) gemv_rows(a, n, 1, 0);
}

static void gemv_bf16(const GemvArgs *a, int nthreads) {
    /* Split N into one contiguous run per thread, in whole tiles. */
    int64_t tiles = (a->N + GEMV_R - 1) / GEMV_R;
    int nt = pick_threads(nthreads, tiles, GEMV_R * a->K * 2);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        int64_t begin = tiles * t / T * GEMV_R, end = tiles * (t + 1) / T * GEMV_R;
        if (end > a->N) end = a->N;
        if (begin < end) gemv_range(a, begin, end);
    }
}
