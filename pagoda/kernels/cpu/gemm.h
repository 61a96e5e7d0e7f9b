/* Register-blocked bf16 GEMM on pre-packed weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * W is packed once at load time (`pagoda.kernels.cpu.gemm.pack_weight`) into 16-column
 * panels, VNNI style: [ceil(N/16)][ceil(K/2)][16][2], zero padded. One 64-byte load then
 * holds the (k, k+1) pair of 16 output columns, the operand vdpbf16ps multiplies by a
 * broadcast (x[m][k], x[m][k+1]) pair, adding both products into 16 fp32 lanes. A tile of
 * GEMM_MR x rows by GEMM_NV panels (6 x 64 outputs: 24 zmm accumulators) walks the whole of
 * K, so the accumulators never leave registers and each output is rounded once (bias added in
 * fp32 first, like F.linear's). No reduction across lanes is needed, unlike the dot-product
 * GEMV of gemv.h, which is why this kernel keeps ~95% of the vdpbf16ps peak from 16 rows up.
 *
 * Threads split N in whole panels (even shares whatever N is); each walks its panels in tiles
 * of GEMM_NV, and every tile across all x rows (in chunks that stay in L2) while the tile's
 * weights sit in L1/L2. The weights stream from DRAM at decode: the first row block of each
 * tile prefetches its panels GEMM_PREFETCH bytes ahead, so the next tile's data arrive while
 * this one computes. */
#pragma once
#include "simd.h"

#define GEMM_MR 6
#define GEMM_NV 4
#define GEMM_PANEL 16
#ifndef GEMM_PREFETCH /* (overridable for tuning builds) */
#define GEMM_PREFETCH 2048
#endif
/* x bytes per row chunk: the chunk stays in L2 (1 MiB on Zen 4/5) while the tiles pass. */
#ifndef GEMM_X_CHUNK_BYTES
#define GEMM_X_CHUNK_BYTES (256 << 10)
#endif


typedef struct {
    const uint16_t *x; /* bf16 [M, K], rows x_stride elements apart */
    int64_t x_stride;
    const uint16_t *w; /* packed bf16 [P][K2][16][2] */
    const uint16_t *bias; /* bf16 [N] or NULL */
    void *y; /* bf16 or fp32 [M, N], rows y_stride elements apart */
    int64_t y_stride;
    int y_fp32;
    int64_t M, N, K;
} GemmArgs;

/* One pair step of K for a tile: NV panel loads, MR broadcasts, MR x NV vdpbf16ps. `odd`:
 * the last pair of an odd K, which has one real value; W's padding there is zero, and x's
 * must be too (the value past the row could be inf or NaN). Prefetches: `near`, the tile's
 * own panels GEMM_PREFETCH bytes ahead into L1; `next`, the same line of the next tile's
 * panels set in `next_mask`, into L2. */
INLINE void gemm_step(__m512 acc[GEMM_MR][GEMM_NV], const uint16_t *wp, int64_t panel,
                      const uint16_t *x, int64_t xs, const int MR, const int NV, int near,
                      const uint16_t *next, unsigned next_mask, const int odd) {
    __m512bh wv[GEMM_NV];
    for (int v = 0; v < NV; v++) {
        if (near) _mm_prefetch((const char *)(wp + v * panel) + GEMM_PREFETCH, _MM_HINT_T0);
        wv[v] = (__m512bh)_mm512_loadu_si512(wp + v * panel);
    }
    for (int v = 0; v < GEMM_NV; v++)
        if (next_mask >> v & 1) _mm_prefetch((const char *)(next + v * panel), _MM_HINT_T1);
    for (int m = 0; m < MR; m++) {
        uint32_t pair;
        if (odd) pair = x[m * xs];
        else memcpy(&pair, x + m * xs, 4);
        __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)pair);
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xb);
    }
}

/* Rows [m0, m0 + MR) against panels [p0, p0 + NV); MR and NV are compile-time constants at
 * every call site, so acc lives in registers. */
INLINE void gemm_tile(const GemmArgs *a, int64_t m0, int64_t p0, const int MR, const int NV,
                      int near, unsigned next_mask) {
    const int64_t K = a->K, K2 = (K + 1) / 2, panel = K2 * 2 * GEMM_PANEL, xs = a->x_stride;
    const uint16_t *w = a->w + p0 * panel;
    const uint16_t *x = a->x + m0 * xs, *next = w + NV * panel;
    __m512 acc[GEMM_MR][GEMM_NV];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < NV; v++) acc[m][v] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p < K / 2; p++)
        gemm_step(acc, w + p * 2 * GEMM_PANEL, panel, x + 2 * p, xs, MR, NV, near,
                  next + p * 2 * GEMM_PANEL, next_mask, 0);
    if (K & 1)
        gemm_step(acc, w + p * 2 * GEMM_PANEL, panel, x + 2 * p, xs, MR, NV, 0,
                  next + p * 2 * GEMM_PANEL, next_mask, 1);
    for (int v = 0; v < NV; v++) {
        const int64_t n = (p0 + v) * GEMM_PANEL;
        __mmask16 mk = tail_mask16(a->N - n);
        __m512 b = a->bias ? load16(a->bias + n, DT_BF16, mk) : _mm512_setzero_ps();
        for (int m = 0; m < MR; m++) {
            __m512 s = _mm512_add_ps(acc[m][v], b);
            int64_t off = (m0 + m) * a->y_stride + n;
            if (a->y_fp32) _mm512_mask_storeu_ps((float *)a->y + off, mk, s);
            else store16((uint16_t *)a->y + off, s, DT_BF16, mk);
        }
    }
}

/* The next tile's panels row block `b` of `blocks` prefetches: those v with v % blocks == b. */
INLINE unsigned gemm_next_mask(int64_t b, int64_t blocks, unsigned all) {
    unsigned mask = 0;
    for (int v = 0; v < GEMM_NV; v++)
        if (v % blocks == b) mask |= 1u << v;
    return mask & all;
}

/* Panels [p0, p0 + NV) against x rows [m_begin, m_end), GEMM_MR rows at a time, while the
 * next tile's `next_nv` panels are prefetched: row block b takes the panels v with
 * v % blocks == b, so the stream from DRAM spreads over the whole tile's compute instead of
 * stalling its first block. */
INLINE void gemm_panels(const GemmArgs *a, int64_t m_begin, int64_t m_end, int64_t p0,
                        const int NV, int next_nv) {
    const int64_t blocks = (m_end - m_begin + GEMM_MR - 1) / GEMM_MR;
    const unsigned all = (1u << next_nv) - 1u;
    int64_t m = m_begin, b = 0;
    for (; m + GEMM_MR <= m_end; m += GEMM_MR, b++)
        gemm_tile(a, m, p0, GEMM_MR, NV, m == m_begin, gemm_next_mask(b, blocks, all));
    int near = m == m_begin;
    unsigned mask = gemm_next_mask(b, blocks, all);
    switch (m_end - m) {
    case 1: gemm_tile(a, m, p0, 1, NV, near, mask); break;
    case 2: gemm_tile(a, m, p0, 2, NV, near, mask); break;
    case 3: gemm_tile(a, m, p0, 3, NV, near, mask); break;
    case 4: gemm_tile(a, m, p0, 4, NV, near, mask); break;
    case 5: gemm_tile(a, m, p0, 5, NV, near, mask); break;
    default: break;
    }
}

/* One thread's panels [p_begin, p_end) against all rows, a row chunk at a time. */
static void gemm_range(const GemmArgs *a, int64_t p_begin, int64_t p_end) {
    int64_t chunk = GEMM_X_CHUNK_BYTES / (2 * a->K) / GEMM_MR * GEMM_MR;
    if (chunk < GEMM_MR) chunk = GEMM_MR;
    for (int64_t m0 = 0; m0 < a->M; m0 += chunk) {
        int64_t m1 = m0 + chunk < a->M ? m0 + chunk : a->M;
        int64_t p = p_begin;
        for (; p + GEMM_NV <= p_end; p += GEMM_NV) {
            int64_t next = p_end - p - GEMM_NV;
            gemm_panels(a, m0, m1, p, GEMM_NV, next < GEMM_NV ? (int)next : GEMM_NV);
        }
        switch (p_end - p) {
        case 1: gemm_panels(a, m0, m1, p, 1, 0); break;
        case 2: gemm_panels(a, m0, m1, p, 2, 0); break;
        case 3: gemm_panels(a, m0, m1, p, 3, 0); break;
        default: break;
        }
    }
}

static void gemm_packed(const GemmArgs *a, int nthreads) {
    const int64_t panels = (a->N + GEMM_PANEL - 1) / GEMM_PANEL;
    const int64_t panel_bytes = GEMM_PANEL * 2 * ((a->K + 1) / 2) * 2;
    int nt = pick_threads(nthreads, panels, panel_bytes + 32 * a->M * GEMM_PANEL);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        int t = 0, T = 1;
#endif
        int64_t begin = panels * t / T, end = panels * (t + 1) / T;
        if (begin < end) gemm_range(a, begin, end);
    }
}
