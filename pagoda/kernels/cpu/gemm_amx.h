/* The AMX tile path of the packed bf16 GEMM (gemm.h), for CPUs with AMX-BF16 (Intel Xeon from
 * Sapphire Rapids on). A tdpbf16ps multiplies a 16 x 32 bf16 tile of x by a 16 x 16 pair tile of
 * the weights into a 16 x 16 fp32 accumulator tile: 16K multiply-adds in one instruction, ~8x
 * what vdpbf16ps does on 512-bit registers, so from a few dozen rows up the GEMM is bound by
 * loads instead of multiplies.
 *
 * The packed layout is already AMX's: a panel's [K2][16][2] block is, 16 pairs of K at a time,
 * a B tile of 16 rows (pairs of K) by 64 bytes (16 columns x (k, k+1)), contiguous, rows 64
 * bytes apart. So tiles load straight from the packed weight; only the last pairs of a K that
 * is not a multiple of 32 go through a zeroed copy (the tile would read past the panel).
 *
 * A step is 32 rows x 32 columns (two A tiles of x rows, two B tiles of panels, four
 * accumulator tiles: all eight tiles), over the whole of K, then the accumulators go through
 * memory to the epilogue (bias added in fp32, one rounding, like the register tiles). x is read
 * in place when K is a multiple of 32; otherwise (and for the last block of fewer than 16 rows)
 * from a zero-padded copy, so a tile never reads past a row or the last row. Threads split the
 * panels in pairs, as the register path splits them in tiles; each pair's weights stay in L2
 * while all the row blocks of a chunk of x pass.
 *
 * Linux hands out AMX state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM);
 * `amx_usable` asks once, and without it the register path runs. Every thread loads the tile
 * configuration at the start of its range and releases it at the end. Included by gemm.h when
 * the build has -mamx-tile -mamx-bf16 (pagoda/utils/cpu_build.py adds them on CPUs with AMX). */
#pragma once
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_ROWS 16 /* rows of an A or accumulator tile */
#define AMX_KB 32 /* K values of an A tile (64 bytes a row), 16 pairs of a B tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Row counts from which gemm_packed takes the tiles (`pagoda_gemm_set_amx_min_rows`); below
 * it the register tiles stream the weights as fast and need no configuration. */
static int amx_min_rows = 8;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

static int amx_usable(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxConfig;

/* Tiles 0-3: accumulators (rows x 16 fp32); 4, 5: x rows (16 x 32 bf16); 6, 7: weight pairs
 * (16 pairs x 16 columns x 2 bf16). All 16 rows by 64 bytes. */
static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&c);
}

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
    __m512 b = _mm512_setzero_ps();
    if (g->bias) {
        __m256i h = _mm256_maskz_loadu_epi16(mk, g->bias + n);
        b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    for (int r = 0; r < AMX_ROWS && m0 + r < g->M; r++) {
        __m512 s = _mm512_add_ps(_mm512_loadu_ps(acc + r * 16), b);
        int64_t off = (m0 + r) * g->y_stride + n;
        if (g->y_fp32) _mm512_mask_storeu_ps((float *)g->y + off, mk, s);
        else _mm256_mask_storeu_epi16((uint16_t *)g->y + off, mk, (__m256i)_mm512_cvtneps_pbh(s));
    }
}

/* Rows [m0, m0 + 16 * MA) by panels [p, p + NB) over all of K; MA, NB in {1, 2} are
 * compile-time constants at every call site (tile numbers must be immediates). `b_tail[j]`:
 * panel p + j's last K block, zero padded, when K2 is not a multiple of 16. */
INLINE void amx_block(const AmxArgs *a, int64_t m0, int64_t p, const int MA, const int NB,
                      const uint16_t *b_tail[2]) {
    const GemmArgs *g = a->g;
    const int64_t K2 = (g->K + 1) / 2, panel = K2 * 2 * GEMM_PANEL;
    const uint16_t *w0 = g->w + p * panel, *w1 = w0 + panel;
    const uint16_t *x0 = amx_rows(a, m0), *x1 = MA > 1 ? amx_rows(a, m0 + AMX_ROWS) : x0;
    const int64_t xs0 = m0 < a->m_full ? a->xs : a->kb * AMX_KB;
    const int64_t xs1 = m0 + AMX_ROWS < a->m_full ? a->xs : a->kb * AMX_KB;
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MA > 1) _tile_zero(2);
    if (MA > 1 && NB > 1) _tile_zero(3);
    for (int64_t kb = 0; kb < a->kb; kb++) {
        const int tail = (kb + 1) * (AMX_KB / 2) > K2;
        const uint16_t *b0 = tail ? b_tail[0] : w0 + kb * AMX_KB * GEMM_PANEL;
        const uint16_t *b1 = tail ? b_tail[1] : w1 + kb * AMX_KB * GEMM_PANEL;
        _tile_loadd(4, x0 + kb * AMX_KB, xs0 * 2);
        _tile_loadd(6, b0, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(7, b1, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (MA > 1) {
            _tile_loadd(5, x1 + kb * AMX_KB, xs1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    float acc[AMX_ROWS * 16] __attribute__((aligned(64)));
    _tile_stored(0, acc, 64);
    amx_store(g, acc, m0, p);
    if (NB > 1) {
        _tile_stored(1, acc, 64);
        amx_store(g, acc, m0, p + 1);
    }
    if (MA > 1) {
        _tile_stored(2, acc, 64);
        amx_store(g, acc, m0 + AMX_ROWS, p);
    }
    if (MA > 1 && NB > 1) {
        _tile_stored(3, acc, 64);
        amx_store(g, acc, m0 + AMX_ROWS, p + 1);
    }
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
