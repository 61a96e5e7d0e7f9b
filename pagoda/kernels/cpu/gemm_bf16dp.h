/* The AVX512_BF16 tile of the packed GEMM (gemm.h): vdpbf16ps multiplies a broadcast
 * (x[m][k], x[m][k+1]) pair by a 64-byte load of the panel's (k, k+1) pairs for 16 output
 * columns, adding both products into 16 fp32 lanes, straight from the bf16 rows of x. A tile of
 * GEMM_MR x rows by GEMM_NV panels (6 x 64 outputs: 24 zmm accumulators) walks the whole of K,
 * so the accumulators never leave registers; no reduction across lanes is needed, which is why
 * it keeps ~95% of the vdpbf16ps peak from 16 rows up. Included by gemm.h when the build has
 * AVX512_BF16. */
#pragma once

INLINE __mmask16 tail_mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

/* The bias of columns [n, n + 16) widened to fp32 (zero without one, or past N by `mk`). */
INLINE __m512 gemm_bias16(const GemmArgs *a, int64_t n, __mmask16 mk) {
    if (!a->bias) return _mm512_setzero_ps();
    __m256i h = _mm256_maskz_loadu_epi16(mk, a->bias + n);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Row m of y, columns [n, n + 16) masked by `mk`: s in fp32, or rounded once to bf16. */
INLINE void gemm_store16(const GemmArgs *a, int64_t m, int64_t n, __mmask16 mk, __m512 s) {
    const int64_t off = m * a->y_stride + n;
    if (a->y_fp32) _mm512_mask_storeu_ps((float *)a->y + off, mk, s);
    else _mm256_mask_storeu_epi16((uint16_t *)a->y + off, mk, (__m256i)_mm512_cvtneps_pbh(s));
}

/* One pair step of K for a tile: NV panel loads, MR broadcasts, MR x NV vdpbf16ps. `odd`:
 * the last pair of an odd K, which has one real value; W's padding there is zero, and x's
 * must be too (the value past the row could be inf or NaN). Prefetches: `near`, the tile's
 * own panels GEMM_PREFETCH bytes ahead into L1; `next`, the same line of the next tile's
 * panels set in `next_mask`, into L2. */
INLINE void gemm_step_bf16dp(__m512 acc[GEMM_MR][GEMM_NV], const uint16_t *wp, int64_t panel,
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
        gemm_step_bf16dp(acc, w + p * 2 * GEMM_PANEL, panel, x + 2 * p, xs, MR, NV, near,
                         next + p * 2 * GEMM_PANEL, next_mask, 0);
    if (K & 1)
        gemm_step_bf16dp(acc, w + p * 2 * GEMM_PANEL, panel, x + 2 * p, xs, MR, NV, 0,
                         next + p * 2 * GEMM_PANEL, next_mask, 1);
    for (int v = 0; v < NV; v++) {
        const int64_t n = (p0 + v) * GEMM_PANEL;
        const __mmask16 mk = tail_mask16(a->N - n);
        const __m512 b = gemm_bias16(a, n, mk);
        for (int m = 0; m < MR; m++) gemm_store16(a, m0 + m, n, mk, _mm512_add_ps(acc[m][v], b));
    }
}
