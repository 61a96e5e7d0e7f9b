/* The quantized GEMM's AMX path (CPUs with AMX-BF16, amx.h), for x8 weights (Q4_0, Q4_1,
 * Q8_0) from `quant_amx_min_rows` activation rows up: prefill and large decode batches.
 *
 * There the integer tiles (quant_x8.h) are bound by their instruction count, ~1 multiply-add
 * in 8 of a vpdpbusd's lane a cycle once the nibbles are unpacked and each 32-weight block's
 * scales applied, while AMX's tdpbf16ps does 16K multiply-adds an instruction. So each thread
 * dequantizes 32 weight rows at a time (two panels of 16 rows, four x8 groups) into the packed
 * bf16 layout of gemm.h (w = d * q + m in fp32, rounded once to bf16), and multiplies every
 * activation row by them with the tiles; the dequantization costs ~one pass over the weights
 * per call, which many rows amortize, and the weights stay quantized in memory. The
 * activations are rounded to bf16 instead of quantized to int8 per block: a finer rounding
 * (8 significant bits against int8's relative step of 1/127 of the block's largest value).
 *
 * Dequantizing one x8 block (8 rows x 32 weights): vector j of its qs holds bytes 4j..4j+3 of
 * each row, lane 4r + t, i.e. weights 4j + t of row r (Q4's low nibbles and Q8_0's bytes; Q4's
 * high nibbles are weights 16 + 4j + t). Widened to 16 fp32 lanes per 4 rows, scaled by the
 * row's d and offset by its m (lanes 4r..4r+3 share a row), rounded to bf16, the 8 dwords are
 * each one row's (k, k+1) pair: even dwords the pair 4j / 2 of rows r..r+3, odd ones the next
 * pair, each 16 contiguous bytes of a panel's pair row. Included by quant_gemm.c. */
#pragma once
#include "amx.h"

/* Activation rows from which the x8 GEMM takes this path (`pagoda_quant_set_amx_min_rows`). */
static int quant_amx_min_rows = 40;

/* Lanes 4r..4r+3 of the result hold v[r + first] (r < 4): a row's value for its 4 weights. */
INLINE __m512 quad_spread(__m256 v, int first) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_set1_epi32(first));
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(v));
}

/* 16 widened weights (lanes 4r + t: rows row0 + r, weights base + t of the block) into the
 * panel: w = q * d + m, rounded to bf16, dwords split into the two pair rows. */
INLINE void dequant_quad(uint16_t *panel_block, __m512i q, __m512 d, __m512 m, int base,
                         int row0) {
    const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(w);
    const __m256i s = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    uint16_t *pair = panel_block + (int64_t)(base / 2) * 32 + 2 * row0;
    _mm_storeu_si128((__m128i *)pair, _mm256_castsi256_si128(s));
    _mm_storeu_si128((__m128i *)(pair + 32), _mm256_extracti128_si256(s, 1));
}

/* x8 group `grp` (8 weight rows, nb blocks) into rows [row0, row0 + 8) of a packed panel
 * ([K2][16][2] bf16). */
static void dequant_group(const int type, const uint8_t *grp, int64_t nb, uint16_t *panel,
                          int row0) {
    const int bb = 8 * block_bytes(type), vecs = type == GGML_Q8_0 ? 8 : 4;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * bb, *qs = blk + x8_qs_offset(type);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256 m = _mm256_setzero_ps();
        if (type == GGML_Q4_1) m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
        else if (type == GGML_Q4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        const __m512 d0 = quad_spread(d, 0), d1 = quad_spread(d, 4);
        const __m512 m0 = quad_spread(m, 0), m1 = quad_spread(m, 4);
        uint16_t *pb = panel + b * 16 * 32; /* the block's 16 pair rows of 32 values */
        for (int j = 0; j < vecs; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            if (type == GGML_Q8_0) {
                dequant_quad(pb, _mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)), d0, m0, 4 * j,
                             row0);
                dequant_quad(pb, _mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)), d1, m1,
                             4 * j, row0 + 4);
                continue;
            }
            const __m256i low4 = _mm256_set1_epi8(0x0F);
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            dequant_quad(pb, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)), d0, m0, 4 * j, row0);
            dequant_quad(pb, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)), d1, m1, 4 * j,
                         row0 + 4);
            dequant_quad(pb, _mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)), d0, m0, 16 + 4 * j,
                         row0);
            dequant_quad(pb, _mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)), d1, m1,
                         16 + 4 * j, row0 + 4);
        }
    }
}

/* Panel p (groups 2p, 2p + 1; rows past the last group zero) into `panel`. */
static void dequant_panel(const int type, const GemmArgs *g, int64_t nb, int64_t p,
                          uint16_t *panel) {
    const int64_t groups = (g->N + 7) / 8;
    for (int h = 0; h < 2; h++) {
        if (2 * p + h < groups) {
            dequant_group(type, g->w + (2 * p + h) * g->w_stride, nb, panel, 8 * h);
            continue;
        }
        for (int64_t k2 = 0; k2 < nb * 16; k2++) memset(panel + k2 * 32 + 16 * h, 0, 16 * 2);
    }
}

typedef struct {
    int type;
    const GemmArgs *g;
    const uint16_t *xb; /* activations in bf16, [ceil(M / 16) * 16][K], padding rows zero */
    int64_t K, panels, items;
    uint16_t *scratch; /* per thread: two panels */
    _Alignas(64) int64_t next; /* the next panel pair to claim, atomic */
} QuantAmxJob;

/* Claims panel pairs one at a time: dequantizes the pair, then every row block against it. */
static void quant_amx_body(void *p, int thread) {
    QuantAmxJob *j = p;
    const GemmArgs *g = j->g;
    const int64_t K = j->K, nb = K / 32, blocks = (g->M + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t *w0 = j->scratch + (int64_t)thread * 2 * K * 16, *w1 = w0 + K * 16;
    float acc[4][AMX_ROWS * 16] __attribute__((aligned(64)));
    amx_configure();
    for (;;) {
        const int64_t q = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (q >= j->items) break;
        const int64_t p = 2 * q;
        const int two = p + 1 < j->panels;
        dequant_panel(j->type, g, nb, p, w0);
        if (two) dequant_panel(j->type, g, nb, p + 1, w1);
        for (int64_t mb = 0; mb < blocks; mb += 2) {
            const uint16_t *x0 = j->xb + mb * AMX_ROWS * K, *x1 = x0 + AMX_ROWS * K;
            const int ma = mb + 1 < blocks ? 2 : 1, nbk = two ? 2 : 1;
            if (ma == 2 && two) amx_product(x0, K, x1, K, w0, w1, nb, 0, NULL, NULL, 2, 2, acc);
            else if (ma == 2) amx_product(x0, K, x1, K, w0, w1, nb, 0, NULL, NULL, 2, 1, acc);
            else if (two) amx_product(x0, K, x1, K, w0, w1, nb, 0, NULL, NULL, 1, 2, acc);
            else amx_product(x0, K, x1, K, w0, w1, nb, 0, NULL, NULL, 1, 1, acc);
            for (int i = 0; i < ma; i++)
                for (int c = 0; c < nbk; c++) {
                    const int64_t n0 = (p + c) * 16, left = g->N - n0;
                    const int nr = left < 16 ? (int)left : 16;
                    for (int r = 0; r < AMX_ROWS; r++) {
                        const int64_t m = (mb + i) * AMX_ROWS + r;
                        if (m >= g->M) break;
                        store16(g, n0, nr, m, _mm512_load_ps(acc[i * nbk + c] + r * 16));
                    }
                }
        }
    }
    _tile_release();
}

/* y = x @ W^T through the tiles; -1 when memory runs out. */
static int quant_gemm_amx(const int type, const GemmArgs *g, const void *x, int64_t x_stride,
                          int x_bf16, int64_t K, int nt) {
    const int64_t rows = (g->M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    const int64_t panels = (g->N + 15) / 16;
    uint16_t *xb = aligned_alloc(64, (size_t)(rows * K * 2 + (int64_t)nt * 2 * K * 16 * 2));
    if (!xb) return -1;
    for (int64_t m = 0; m < g->M; m++) {
        uint16_t *dst = xb + m * K;
        if (x_bf16) {
            memcpy(dst, (const uint16_t *)x + m * x_stride, K * 2);
            continue;
        }
        const float *src = (const float *)x + m * x_stride;
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(dst + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
    }
    memset(xb + g->M * K, 0, (size_t)((rows - g->M) * K * 2));
    QuantAmxJob j = {type, g, xb, K, panels, (panels + 1) / 2, xb + rows * K, 0};
    if (parallel_run && nt > 1) {
        parallel_run(quant_amx_body, &j, nt);
    } else {
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
#ifdef _OPENMP
            quant_amx_body(&j, omp_get_thread_num());
#else
            quant_amx_body(&j, 0);
#endif
        }
    }
    free(xb);
    return 0;
}
