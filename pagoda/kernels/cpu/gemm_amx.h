/* The AMX tile path of the packed bf16 GEMM (gemm.h), for CPUs with AMX-BF16 (amx.h).
 *
 * The packed layout is already AMX's: a panel's [K2][16][2] block is, 16 pairs of K at a time,
 * a B tile, contiguous, so tiles load straight from the packed weight; only the last pairs of a
 * K that is not a multiple of 32 go through a zeroed copy (the tile would read past the panel).
 * A step is 32 rows x 32 columns (two A tiles of x rows, two B tiles of panels, four
 * accumulator tiles: all eight tiles) over the whole of K, then the accumulators go through
 * memory to the epilogue (bias added in fp32, one rounding, like the register tiles). x is read
 * in place when K is a multiple of 32; otherwise (and for the last block of fewer than 16 rows)
 * from a zero-padded copy, so a tile never reads past a row or the last row. Threads split the
 * panels in pairs, as the register path splits them in tiles; each pair's weights stay in L2
 * while all the row blocks of a chunk of x pass. Without the OS's grant the register path runs.
 * Included by gemm.h when the build has -mamx-tile -mamx-bf16 (pagoda/utils/cpu_build.py adds
 * them on CPUs with AMX). */
#pragma once
#include "amx.h"

/* Row counts from which gemm_packed takes the tiles (`pagoda_gemm_set_amx_min_rows`); below
 * it the register tiles stream the weights as fast and need no configuration. */
static int amx_min_rows = 8;

typedef struct {
    const GemmArgs *g;
    const uint16_t *x; /* x rows for the tiles: in place, or the padded copy */
    int64_t xs; /* their stride in elements */
    const uint16_t *x_tail; /* the last rows (fewer than 16) padded to 16, or NULL */
    int64_t m_full; /* rows in whole 16-row blocks of `x` */
    int64_t kb; /* K blocks of 32 */
} AmxArgs;

/* The 16 rows of tile row block `m0` (a multiple of 16): in `x`, or the padded tail. */
INLINE const uint16_t *amx_rows(const AmxArgs *a, int64_t m0) {
    return m0 < a->m_full ? a->x + m0 * a->xs : a->x_tail;
}

/* Accumulator tile `acc` (16 x 16 fp32 in memory) to rows [m0, m0 + 16) and the panel's
 * columns of y, bias added, rows past M skipped. */
static void amx_store(const GemmArgs *g, const float *acc, int64_t m0, int64_t p) {
    const int64_t n = p * GEMM_PANEL;
    const __mmask16 mk = tail_mask16(g->N - n);
    const __m512 b = gemm_bias16(g, n, mk);
    for (int r = 0; r < AMX_ROWS && m0 + r < g->M; r++)
        gemm_store16(g, m0 + r, n, mk, _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b));
}

/* Rows [m0, m0 + 16 * MA) by panels [p, p + NB) over all of K; MA, NB in {1, 2} are
 * compile-time constants at every call site. `b_tail[j]`: panel p + j's last K block, zero
 * padded, when K2 is not a multiple of 16. */
INLINE void amx_block(const AmxArgs *a, int64_t m0, int64_t p, const int MA, const int NB,
                      const uint16_t *b_tail[2]) {
    const GemmArgs *g = a->g;
    const int64_t K2 = (g->K + 1) / 2, panel = K2 * 2 * GEMM_PANEL;
    const uint16_t *w0 = g->w + p * panel;
    const int64_t xs0 = m0 < a->m_full ? a->xs : a->kb * AMX_KB;
    const int64_t xs1 = m0 + AMX_ROWS < a->m_full ? a->xs : a->kb * AMX_KB;
    float acc[4][AMX_ROWS * 16] __attribute__((aligned(64)));
    amx_product(amx_rows(a, m0), xs0, MA > 1 ? amx_rows(a, m0 + AMX_ROWS) : NULL, xs1, w0,
                w0 + panel, a->kb, K2 % (AMX_KB / 2) != 0, b_tail[0], b_tail[1], MA, NB, acc);
    for (int i = 0; i < MA; i++)
        for (int j = 0; j < NB; j++) amx_store(g, acc[i * NB + j], m0 + i * AMX_ROWS, p + j);
}

/* Panel pairs [begin, end): each pair against every row block, a chunk of x rows at a time. */
static void amx_range(void *ctx, int64_t begin, int64_t end) {
    const AmxArgs *a = ctx;
    const GemmArgs *g = a->g;
    const int64_t panels = (g->N + GEMM_PANEL - 1) / GEMM_PANEL, K2 = (g->K + 1) / 2;
    const int64_t panel = K2 * 2 * GEMM_PANEL, tail_pairs = K2 % (AMX_KB / 2);
    const int64_t m_blocks = (g->M + AMX_ROWS - 1) / AMX_ROWS;
    int64_t chunk = GEMM_X_CHUNK_BYTES / (a->kb * AMX_KB * 2) / (2 * AMX_ROWS) * 2;
    if (chunk < 2) chunk = 2;
    uint16_t tails[2][AMX_KB * GEMM_PANEL] __attribute__((aligned(64)));
    const uint16_t *b_tail[2] = {tails[0], tails[1]};
    amx_configure();
    for (int64_t c0 = 0; c0 < m_blocks; c0 += chunk) {
        const int64_t c1 = c0 + chunk < m_blocks ? c0 + chunk : m_blocks;
        for (int64_t q = begin; q < end; q++) {
            const int64_t p = 2 * q;
            const int nb = p + 1 < panels ? 2 : 1;
            if (tail_pairs) /* the last K block's pairs, zero padded to 16 */
                for (int j = 0; j < nb; j++) {
                    memset(tails[j], 0, sizeof tails[j]);
                    memcpy(tails[j], g->w + (p + j) * panel + (K2 - tail_pairs) * 2 * GEMM_PANEL,
                           tail_pairs * 2 * GEMM_PANEL * 2);
                }
            int64_t mb = c0;
            for (; mb + 2 <= c1; mb += 2) {
                if (nb == 2) amx_block(a, mb * AMX_ROWS, p, 2, 2, b_tail);
                else amx_block(a, mb * AMX_ROWS, p, 2, 1, b_tail);
            }
            if (mb < c1) {
                if (nb == 2) amx_block(a, mb * AMX_ROWS, p, 1, 2, b_tail);
                else amx_block(a, mb * AMX_ROWS, p, 1, 1, b_tail);
            }
        }
    }
    _tile_release();
}

typedef struct {
    const GemmArgs *g;
    uint16_t *dst;
    int64_t row0, stride;
} AmxPad;

/* Rows [row0 + begin, row0 + end) of x into the copy, zero padded to `stride`. */
static void amx_pad_rows(void *ctx, int64_t begin, int64_t end) {
    const AmxPad *p = ctx;
    for (int64_t r = begin; r < end; r++) {
        uint16_t *d = p->dst + r * p->stride;
        memcpy(d, p->g->x + (p->row0 + r) * p->g->x_stride, p->g->K * 2);
        memset(d + p->g->K, 0, (p->stride - p->g->K) * 2);
    }
}

/* The tile path; -1 when a copy of x cannot be allocated. */
static int gemm_packed_amx(const GemmArgs *g, int nt) {
    const int64_t panels = (g->N + GEMM_PANEL - 1) / GEMM_PANEL;
    const int64_t kb = (g->K + AMX_KB - 1) / AMX_KB, kp = kb * AMX_KB;
    AmxArgs a = {g, g->x, g->x_stride, NULL, g->M / AMX_ROWS * AMX_ROWS, kb};
    uint16_t *copy = NULL;
    if (g->K % AMX_KB) { /* every row padded: tiles read whole 32-value blocks */
        const int64_t rows = (g->M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
        copy = (uint16_t *)malloc((size_t)(rows * kp) * 2);
        if (copy == NULL) return -1;
        AmxPad pad = {g, copy, 0, kp};
        parallel_range(amx_pad_rows, &pad, g->M, 16, nt);
        memset(copy + g->M * kp, 0, (size_t)((rows - g->M) * kp) * 2);
        a.x = copy, a.xs = kp, a.m_full = rows;
    } else if (a.m_full < g->M) { /* the last rows only */
        copy = (uint16_t *)calloc((size_t)(AMX_ROWS * kp), 2);
        if (copy == NULL) return -1;
        AmxPad pad = {g, copy, a.m_full, kp};
        amx_pad_rows(&pad, 0, g->M - a.m_full);
        a.x_tail = copy;
    }
    parallel_range(amx_range, &a, (panels + 1) / 2, 1, nt);
    free(copy);
    return 0;
}
