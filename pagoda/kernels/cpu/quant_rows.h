/* The GEMM tile of weights in the GGUF file's own layout ("rows": each output row its blocks,
 * every type, the k-quants included). Included by quant_gemm.c, after QActs and the ISA macros.
 * A tile is NR weight rows x NC activation rows; each 32-weight sub-block is decoded once
 * (quant_blocks.h) and used for the NC activation rows, its integer dot product reduced
 * horizontally at the end of the row. The x8 layout (quant_x8.h) is faster where it applies. */
#pragma once
#include "quant_blocks.h"

/* sum_b m[b] * s[b]: the block offsets of one weight row against one activation row. */
INLINE float offset_dot(const float *m, const float *s, int64_t nb) {
    float total = 0.0f;
    int64_t b = 0;
#if defined(QUANT_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(s + b), acc);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    total = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; b < nb; b++) total += m[b] * s[b];
    return total;
}

#if defined(QUANT_AVX2)
INLINE float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* Eight int32 lanes, lane k = sum of u[4k..4k+3] * s[4k..4k+3] (u unsigned, s signed). */
INLINE __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(QUANT_VNNI)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* Lane scales of a sub-block as a register (sub_block_scales, without the round trip). */
INLINE __m256 scales_avx2(int type, const uint8_t *row, int64_t b, float *m) {
    if (type == GGML_Q8_0 || type == GGML_Q4_0 || type == GGML_Q4_1) {
        const uint8_t *blk = row + b * block_bytes(type);
        float d = fp16_to_fp32(blk);
        *m = type == GGML_Q4_1 ? fp16_to_fp32(blk + 2) : (type == GGML_Q4_0 ? -8.0f * d : 0.0f);
        return _mm256_set1_ps(d);
    }
    float dv[8];
    sub_block_scales(type, row, b, dv, m);
    return _mm256_loadu_ps(dv);
}

/* out[r][c] = row r of W (NR of them from w) . activation row m0 + c (NC of them). */
INLINE void tile(const int type, const uint8_t *w, int64_t w_stride, const int NR, const QActs *a,
                 int64_t m0, const int NC, float out[TILE_W][TILE_X], float *offsets) {
    const int64_t nb = a->nb, K = a->K;
    const int sgn = type_is_signed(type);
    __m256 acc[TILE_W][TILE_X];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i wq[TILE_W], wa[TILE_W];
        __m256 dv[TILE_W];
        for (int r = 0; r < NR; r++) {
            const uint8_t *row = w + r * w_stride;
            float m;
            wq[r] = decode_q_avx2(type, row, b);
            dv[r] = scales_avx2(type, row, b, &m);
            if (sgn) wa[r] = _mm256_sign_epi8(wq[r], wq[r]); /* |w|, unsigned */
            else offsets[r * nb + b] = m;
        }
        for (int c = 0; c < NC; c++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a->q + (m0 + c) * K + b * 32));
            const __m256 dx = _mm256_broadcast_ss(a->d + (m0 + c) * nb + b);
            for (int r = 0; r < NR; r++) {
                __m256i i = sgn ? dot_u8s8(wa[r], _mm256_sign_epi8(x, wq[r])) : dot_u8s8(wq[r], x);
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dv[r], dx), acc[r][c]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++) {
            out[r][c] = hsum8(acc[r][c]);
            if (!sgn) out[r][c] += offset_dot(offsets + r * nb, a->s + (m0 + c) * nb, nb);
        }
}
#else
/* Portable: the same sums with plain C (the compiler may vectorise the inner loops). */
INLINE void tile(const int type, const uint8_t *w, int64_t w_stride, const int NR, const QActs *a,
                 int64_t m0, const int NC, float out[TILE_W][TILE_X], float *offsets) {
    const int64_t nb = a->nb, K = a->K;
    float acc[TILE_W][TILE_X] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        int8_t wq[TILE_W][32];
        float dv[TILE_W][8];
        for (int r = 0; r < NR; r++) {
            decode_q(type, w + r * w_stride, b, wq[r]);
            sub_block_scales(type, w + r * w_stride, b, dv[r], offsets + r * nb + b);
        }
        for (int c = 0; c < NC; c++) {
            const int8_t *x = a->q + (m0 + c) * K + b * 32;
            const float dx = a->d[(m0 + c) * nb + b];
            for (int r = 0; r < NR; r++) {
                float blk = 0.0f;
                for (int l = 0; l < 8; l++) {
                    int32_t lane = 0;
                    for (int t = 0; t < 4; t++) lane += (int32_t)wq[r][4 * l + t] * x[4 * l + t];
                    blk += (float)lane * dv[r][l];
                }
                acc[r][c] += blk * dx;
            }
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < NC; c++)
            out[r][c] = acc[r][c] + (type_is_signed(type)
                                         ? 0.0f
                                         : offset_dot(offsets + r * nb, a->s + (m0 + c) * nb, nb));
}
#endif
