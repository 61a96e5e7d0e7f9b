/* The quantized GEMM's AMX-INT8 path (CPUs with AMX, amx.h) for x8 weights (Q4_0, Q4_1,
 * Q8_0) at batch: Q8_0 from `quant_amx_min_rows` activation rows, Q4 from twice that.
 *
 * It computes what x16_tile (quant_x8.h) computes, bit for bit: per 32-weight block the exact
 * integer dot of the int8 activations with the block's weights, then the same two fp32 steps
 * in the same order (acc += float(dot) * (d_w * d_x); acc += m_w * s_x for Q4), so a request's
 * logits do not depend on how many rows its step carried. Only the integer dots move to the
 * tiles: one tdpbsud (tdpbssd for Q8_0's signed weights) takes 16 activation rows x 16 weight
 * rows x 32 values, where the 512-bit tile issues 8 vpdpbusd and a broadcast per activation
 * row. The scales stay on vectors: per block the 16 x 16 dots go through memory to 16 rows of
 * fmadds, which bound the path (~1 instruction a cycle, the store of each block's dots and
 * their loads in between).
 *
 * The x8 layout is already AMX's B-tile layout: vector j of a group's block holds, for each of
 * its 8 rows, 4 consecutive weights (4j..4j+3; Q4's high nibbles 16 + 4j..), i.e. one B-tile
 * row of 4 K values by 8 weight rows. Two groups side by side make a 16-column B row, so each
 * thread copies a panel's blocks (two groups; Q4's nibbles split into rows 0-3 and 4-7) once
 * into 512-byte B tiles and runs every activation block past them. The A tile is 16 rows of a
 * block of the quantized activations, read in place (the buffer is padded to whole 16-row
 * blocks). Included by quant_gemm.c. */
#pragma once
#include "amx.h"

/* Activation rows from which Q8_0 takes the tiles, Q4 from 2x (`pagoda_quant_set_amx_min_rows`).
 * Per block the scales cost what they cost the vector tiles, so the tiles gain what the integer
 * dots cost there: on 2 cores of a Xeon with AMX (model shapes 576-3072 x 576-1536), Q8_0
 * 1.0-1.3x at 16 rows and 1.2-1.4x from 64 (a 49152-row LM head 0.83x at 16, 1.2x at 64), Q4_1
 * 0.7-1.04x at 24-48 rows (its vector tile unpacks nibbles once for 8 rows and takes 8
 * vpdpbusd a block) and 1.0-1.17x from 64 (`python benchmarks/cpu_quant_gemm_bench.py`). */
static int quant_amx_min_rows = 32;

/* Tile 0: dots (16 activation rows x 16 weight rows, int32); 1: activations (16 rows x 32
 * int8); 2: weights (8 rows of 4 K values x 16 weight rows). */
static void quant_amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    c.rows[0] = 16, c.colsb[0] = 64;
    c.rows[1] = 16, c.colsb[1] = 32;
    c.rows[2] = 8, c.colsb[2] = 64;
    _tile_loadconfig(&c);
}

/* Panel p's blocks (groups 2p and 2p + 1, or 2p twice for a last odd group, as x16_tile
 * takes it) into B tiles of 8 x 64 bytes, one per block. */
static void quant_amx_panel(const int type, const GemmArgs *g, int64_t nb, int64_t p,
                            uint8_t *tiles) {
    const int64_t groups = (g->N + 7) / 8, bb = 8 * block_bytes(type);
    const uint8_t *g0 = g->w + 2 * p * g->w_stride;
    const uint8_t *g1 = 2 * p + 1 < groups ? g0 + g->w_stride : g0;
    const int qo = x8_qs_offset(type);
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q0 = g0 + b * bb + qo, *q1 = g1 + b * bb + qo;
        uint8_t *t = tiles + b * 512;
        for (int j = 0; j < (type == GGML_Q8_0 ? 8 : 4); j++) {
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q0 + 32 * j))),
                _mm256_loadu_si256((const __m256i *)(q1 + 32 * j)), 1);
            if (type == GGML_Q8_0) {
                _mm512_store_si512(t + 64 * j, v);
                continue;
            }
            _mm512_store_si512(t + 64 * j, _mm512_and_si512(v, low4));
            _mm512_store_si512(t + 64 * (4 + j), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
        }
    }
}

/* Block b's fp32 steps for rows [m0, m0 + 16) from its 16 x 16 dots, as x16_tile takes them. */
INLINE void quant_amx_scale(const int type, const GemmArgs *g, const QActs *a, const uint8_t *grp,
                            int64_t gstride, int64_t b, int64_t m0, const int32_t *dots,
                            __m512 acc[16]) {
    const int64_t nb = a->nb, bb = 8 * block_bytes(type);
    const uint8_t *b0 = grp + b * bb;
    __m512 dw, mw;
    x16_scales(type, b0, b0 + gstride, &dw, &mw);
    for (int r = 0; r < 16; r++) {
        const int64_t m = m0 + r;
        if (m >= g->M) break; /* the padding rows past M */
        const __m512i i32 = _mm512_load_si512(dots + 16 * r);
        const float dx = a->d[m * nb + b];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
                                 acc[r]);
        if (type != GGML_Q8_0) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[m * nb + b]), acc[r]);
    }
}

/* Activation rows [m0, m0 + 16) against panel p, whose B tiles are `tiles`: x16_tile's
 * accumulators, then stored with the bias (store16). Software-pipelined: block b's dots are
 * computed and stored while the vectors apply block b - 1's scales, so neither the tiles nor
 * the store-to-load round trip through memory wait on the other. */
INLINE void quant_amx_block(const int type, const GemmArgs *g, const QActs *a, int64_t p,
                            const uint8_t *tiles, int64_t m0) {
    const int64_t nb = a->nb, K = a->K, groups = (g->N + 7) / 8;
    const int64_t gstride = 2 * p + 1 < groups ? g->w_stride : 0;
    const uint8_t *grp = g->w + 2 * p * g->w_stride;
    int32_t dots[2][16 * 16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b <= nb; b++) {
        if (b < nb) {
            _tile_zero(0);
            _tile_loadd(1, a->q + m0 * K + b * 32, K);
            _tile_loadd(2, tiles + b * 512, 64);
            if (type == GGML_Q8_0) _tile_dpbssd(0, 1, 2);
            else _tile_dpbsud(0, 1, 2);
            _tile_stored(0, dots[b & 1], 64);
        }
        if (b > 0) quant_amx_scale(type, g, a, grp, gstride, b - 1, m0, dots[(b - 1) & 1], acc);
    }
    const int64_t left = g->N - p * 16;
    const int nr = left < 16 ? (int)left : 16;
    for (int r = 0; r < 16 && m0 + r < g->M; r++) store16(g, p * 16, nr, m0 + r, acc[r]);
}

/* Claims panels one at a time: its B tiles, then every activation block past them. */
static void quant_amx_body(void *p, int thread) {
    GemmJob *j = p;
    const GemmArgs *g = j->g;
    const QActs *a = j->a;
    (void)thread;
    uint8_t *tiles = aligned_alloc(64, (size_t)(a->nb * 512));
    if (!tiles) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const int64_t panels = ((g->N + 7) / 8 + 1) / 2;
    quant_amx_configure();
    for (;;) {
        const int64_t q = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (q >= panels) break;
        quant_amx_panel(j->type, g, a->nb, q, tiles);
        for (int64_t m0 = 0; m0 < g->M; m0 += 16) {
            switch (j->type) {
            case GGML_Q4_0: quant_amx_block(GGML_Q4_0, g, a, q, tiles, m0); break;
            case GGML_Q4_1: quant_amx_block(GGML_Q4_1, g, a, q, tiles, m0); break;
            default: quant_amx_block(GGML_Q8_0, g, a, q, tiles, m0); break;
            }
        }
    }
    _tile_release();
    free(tiles);
}
