/* Register-blocked bf16 GEMM on pre-packed weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
 *
 * W is packed once at load time (`pagoda.kernels.cpu.gemm.pack_weight`) into 16-column
 * panels, VNNI style: [ceil(N/16)][ceil(K/2)][16][2], zero padded, the same layout at every
 * ISA level. Each 32-bit lane of a panel row holds one output column's (k, k+1) pair:
 *  - AVX512_BF16 (gemm_bf16dp.h): vdpbf16ps takes the pair as it is;
 *  - every other level: the lane's high half *is* w[k+1] as an fp32 (mask the low half off)
 *    and its low half shifted up 16 bits is w[k], so one load, an AND and a shift give two
 *    vectors of fp32 weights, each multiplied by a broadcast x value with an FMA (x is widened
 *    to fp32 once per call, zero padded to even K). A tile of GEMM_MR rows by GEMM_NV panels
 *    walks the whole of K with its accumulators in registers, and each output is rounded once
 *    (bias added in fp32 first, like F.linear's). Tiles are sized to the register file: AVX2
 *    4 rows x 16 columns (8 ymm accumulators, 4 weight vectors, 2 broadcasts of 16 registers),
 *    AVX-512 6 x 48 (18 zmm accumulators of 32), portable 2 x 16.
 *
 * Threads split N in whole panels (even shares whatever N is); each walks its panels in tiles
 * of GEMM_NV, and every tile across all x rows (in chunks that stay in L2) while the tile's
 * weights sit in L1/L2. The weights stream from DRAM at decode: the first row block of each
 * tile prefetches its panels GEMM_PREFETCH bytes ahead (and, with vdpbf16ps, the next tile's
 * panels into L2), so the next data arrive while this tile computes. */
#pragma once
#include "simd.h"

#define GEMM_PANEL 16
#define GEMM_PV (GEMM_PANEL / VL) /* vectors per panel row */
#if defined(GEMM_MR) && defined(GEMM_NV) /* (overridable for tuning builds) */
#elif HAVE_BF16DP
#define GEMM_MR 6
#define GEMM_NV 4
#elif PAGODA_ISA == 2
#define GEMM_MR 6
#define GEMM_NV 3
#elif PAGODA_ISA == 1
#define GEMM_MR 4
#define GEMM_NV 1
#else
#define GEMM_MR 2
#define GEMM_NV 1
#endif
#ifndef GEMM_PREFETCH /* (overridable for tuning builds) */
#define GEMM_PREFETCH 2048
#endif
/* x bytes per row chunk: the chunk stays in L2 (512 KiB on Zen 3, 1 MiB on Zen 4/5) while the
 * tiles pass. */
#ifndef GEMM_X_CHUNK_BYTES
#define GEMM_X_CHUNK_BYTES (256 << 10)
#endif

typedef struct {
    const uint16_t *x; /* bf16 [M, K], rows x_stride elements apart (the vdpbf16ps tile) */
    int64_t x_stride;
    const float *xf; /* x in fp32, rows xf_stride apart, zero padded to even K (FMA tiles) */
    int64_t xf_stride;
    const uint16_t *w; /* packed bf16 [P][K2][16][2] */
    const uint16_t *bias; /* bf16 [N] or NULL */
    void *y; /* bf16 or fp32 [M, N], rows y_stride elements apart */
    int64_t y_stride;
    int y_fp32;
    int64_t M, N, K;
} GemmArgs;

#if HAVE_BF16DP
#include "gemm_bf16dp.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include "gemm_amx.h"
#endif
#else
/* Rows [m0, m0 + MR) against panels [p0, p0 + NV): per pair of K, each panel's PV vectors of
 * (k, k+1) lanes are split into fp32 w[k] and w[k+1] once, then each row adds
 * w[k] * x[m][k] + w[k+1] * x[m][k+1] to its accumulators. A tile of one or two rows (decode)
 * keeps the w[k+1] products in accumulators of their own, so no accumulator waits on two
 * dependent FMAs a step. MR and NV are compile-time constants at every call site, so acc
 * lives in registers. */
INLINE void gemm_tile(const GemmArgs *a, int64_t m0, int64_t p0, const int MR, const int NV,
                      int near, unsigned next_mask) {
    (void)next_mask;
    enum { J = GEMM_NV * GEMM_PV };
    const int split = MR <= 2;
    const int64_t K2 = (a->K + 1) / 2, panel = K2 * 2 * GEMM_PANEL, xs = a->xf_stride;
    const uint16_t *w = a->w + p0 * panel;
    const float *x = a->xf + m0 * xs;
    vf acc[GEMM_MR][J], acc_hi[2][J];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < NV * GEMM_PV; j++) acc[m][j] = acc_hi[m % 2][j] = splat(0.0f);
    for (int64_t p = 0; p < K2; p++) {
        const uint16_t *wp = w + p * 2 * GEMM_PANEL;
        vf lo[J], hi[J];
        for (int v = 0; v < NV; v++) {
            if (near) __builtin_prefetch((const char *)(wp + v * panel) + GEMM_PREFETCH);
            for (int j = 0; j < GEMM_PV; j++) {
                vu u;
                memcpy(&u, wp + v * panel + j * 2 * VL, sizeof u);
                lo[v * GEMM_PV + j] = bf16_lo(u);
                hi[v * GEMM_PV + j] = bf16_hi(u);
            }
        }
        for (int m = 0; m < MR; m++) {
            const vf x0 = splat(x[m * xs + 2 * p]), x1 = splat(x[m * xs + 2 * p + 1]);
            for (int j = 0; j < NV * GEMM_PV; j++) {
                acc[m][j] += lo[j] * x0;
                if (split) acc_hi[m][j] += hi[j] * x1;
                else acc[m][j] += hi[j] * x1;
            }
        }
    }
    for (int v = 0; v < NV; v++)
        for (int j = 0; j < GEMM_PV; j++) {
            const int64_t n = (p0 + v) * GEMM_PANEL + j * VL;
            if (n >= a->N) break;
            const vf b = a->bias ? load_at((const char *)a->bias, DT_BF16, n, a->N) : splat(0.0f);
            for (int m = 0; m < MR; m++) {
                char *row = (char *)a->y + (m0 + m) * a->y_stride * (a->y_fp32 ? 4 : 2);
                vf s = acc[m][v * GEMM_PV + j] + b;
                if (split) s += acc_hi[m][v * GEMM_PV + j];
                store_at(row, s, a->y_fp32 ? DT_F32 : DT_BF16, n, a->N);
            }
        }
}
#endif
#ifndef HAVE_AMX
#define HAVE_AMX 0
#endif

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
    switch (m_end - m) { /* the rows left over, fewer than GEMM_MR */
    case 1: gemm_tile(a, m, p0, 1, NV, near, mask); break;
    case 2: if (GEMM_MR > 2) gemm_tile(a, m, p0, 2, NV, near, mask); break;
    case 3: if (GEMM_MR > 3) gemm_tile(a, m, p0, 3, NV, near, mask); break;
    case 4: if (GEMM_MR > 4) gemm_tile(a, m, p0, 4, NV, near, mask); break;
    case 5: if (GEMM_MR > 5) gemm_tile(a, m, p0, 5, NV, near, mask); break;
    default: break;
    }
}

/* One thread's panels [p_begin, p_end) against all rows, a row chunk at a time. */
static void gemm_range(const GemmArgs *a, int64_t p_begin, int64_t p_end) {
    const int64_t row_bytes = HAVE_BF16DP ? 2 * a->K : 4 * a->xf_stride;
    int64_t chunk = GEMM_X_CHUNK_BYTES / row_bytes / GEMM_MR * GEMM_MR;
    if (chunk < GEMM_MR) chunk = GEMM_MR;
    for (int64_t m0 = 0; m0 < a->M; m0 += chunk) {
        int64_t m1 = m0 + chunk < a->M ? m0 + chunk : a->M;
        int64_t p = p_begin;
        for (; p + GEMM_NV <= p_end; p += GEMM_NV) {
            int64_t next = p_end - p - GEMM_NV;
            gemm_panels(a, m0, m1, p, GEMM_NV, next < GEMM_NV ? (int)next : GEMM_NV);
        }
        switch (p_end - p) { /* the panels left over, fewer than GEMM_NV */
        case 1: if (GEMM_NV > 1) gemm_panels(a, m0, m1, p, 1, 0); break;
        case 2: if (GEMM_NV > 2) gemm_panels(a, m0, m1, p, 2, 0); break;
        case 3: if (GEMM_NV > 3) gemm_panels(a, m0, m1, p, 3, 0); break;
        default: break;
        }
    }
}

/* Row r of x into fp32 scratch, zero padded to an even length. */
static void widen_row(const GemmArgs *a, float *dst, int64_t r) {
    const uint16_t *src = a->x + r * a->x_stride;
    for (int64_t k = 0; k < a->K; k++) dst[k] = bf16_to_f32(src[k]);
    for (int64_t k = a->K; k < a->xf_stride; k++) dst[k] = 0.0f;
}

static void widen_rows(void *a, int64_t begin, int64_t end) {
    const GemmArgs *g = a;
    for (int64_t r = begin; r < end; r++) widen_row(g, (float *)g->xf + r * g->xf_stride, r);
}

static void gemm_panel_run(void *a, int64_t begin, int64_t end) { gemm_range(a, begin, end); }

/* Returns -1 when the fp32 copy of x cannot be allocated. */
static int gemm_packed(GemmArgs *a, int nthreads) {
    const int64_t panels = (a->N + GEMM_PANEL - 1) / GEMM_PANEL;
    const int64_t panel_bytes = GEMM_PANEL * 2 * ((a->K + 1) / 2) * 2;
    float *xf = NULL;
    int nt = pick_threads(nthreads, panels, panel_bytes + 32 * a->M * GEMM_PANEL);
#if HAVE_AMX
    if (a->M >= amx_min_rows && amx_usable()) return gemm_packed_amx(a, nt);
#endif
    if (!HAVE_BF16DP) {
        a->xf_stride = (a->K + 1) / 2 * 2;
        xf = (float *)malloc((size_t)(a->M * a->xf_stride) * sizeof(float));
        if (xf == NULL) return -1;
        a->xf = xf;
        parallel_range(widen_rows, a, a->M, 1, nt);
    }
    parallel_range(gemm_panel_run, a, panels, 1, nt);
    free(xf);
    return 0;
}
