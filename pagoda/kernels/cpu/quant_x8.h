/* The "x8" layout of Q4_0 / Q4_1 / Q8_0 weights and its GEMM tile. Included by quant_gemm.c.
 *
 * Eight weight rows are interleaved block by block, with exactly the bytes of their GGUF
 * blocks: per 32-weight block b of a group of 8 rows,
 *     d[8] fp16 | m[8] fp16 (Q4_1 only) | qs
 * where qs is 4 (Q4) or 8 (Q8_0) vectors of 32 bytes, vector j holding bytes 4j..4j+3 of each
 * of the 8 rows' qs. For Q4 a byte carries weight i (low nibble) and weight i + 16 (high), so
 * the low nibbles of vector j are weights 4j..4j+3 of every row and the high nibbles weights
 * 16 + 4j.. . One x8 block thus feeds eight integer dot products at once, lane r of a
 * `vpmaddubsw` / `vpdpbusd` result belonging to row r, with 4 bytes of the activation
 * broadcast to all lanes: no horizontal sums, and one fp32 scale step per block for 8 rows.
 * Rows past N in the last group are zero blocks (d = 0). */
#pragma once
#include "quant_blocks.h"

INLINE int x8_type(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0;
}

INLINE int x8_qs_offset(int type) { return type == GGML_Q4_1 ? 32 : 16; }

/* Weight l of row r in block b of a group (`grp` points at the group's first block), with the
 * row's scale and offset: w = d * q + m. */
INLINE void x8_weight(int type, const uint8_t *grp, int64_t b, int r, int l, int *q, float *d,
                      float *m) {
    const uint8_t *blk = grp + b * 8 * block_bytes(type), *qs = blk + x8_qs_offset(type);
    *d = fp16_to_fp32(blk + 2 * r);
    if (type == GGML_Q8_0) {
        *q = ((const int8_t *)qs)[32 * (l / 4) + 4 * r + l % 4];
        *m = 0.0f;
        return;
    }
    const int i = l % 16; /* the byte holding weight l: i = 4j + t, j = i / 4 */
    const uint8_t byte = qs[32 * (i / 4) + 4 * r + i % 4];
    *q = l < 16 ? byte & 0x0F : byte >> 4;
    *m = type == GGML_Q4_1 ? fp16_to_fp32(blk + 16 + 2 * r) : -8.0f * *d;
}

#if defined(QUANT_AVX2)
INLINE __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* out[c] (8 rows of the group) = group . activation row m0 + c, c < NC. */
INLINE void x8_tile(const int type, const uint8_t *grp, const QActs *a, int64_t m0, const int NC,
                    __m256 out[4]) {
    const int64_t nb = a->nb, K = a->K;
    const int bb = 8 * block_bytes(type);
    __m256 acc[4];
    for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = grp + b * bb, *qs = blk + x8_qs_offset(type);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
        __m256i w[8];
        if (type != GGML_Q8_0) {
            const __m256i low4 = _mm256_set1_epi8(0x0F);
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                w[j] = _mm256_and_si256(v, low4);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            }
        }
        for (int c = 0; c < NC; c++) {
            const int8_t *xq = a->q + (m0 + c) * K + b * 32;
            __m256i i32;
            if (type == GGML_Q8_0) { /* signed: |w| times x with w's sign */
                i32 = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
                    __m256i xs = _mm256_sign_epi8(bcast4(xq + 4 * j), v);
#if defined(QUANT_VNNI)
                    i32 = _mm256_dpbusd_epi32(i32, _mm256_sign_epi8(v, v), xs);
#else
                    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), xs);
                    i32 = _mm256_add_epi32(i32, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
                }
            } else {
#if defined(QUANT_VNNI)
                i32 = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) i32 = _mm256_dpbusd_epi32(i32, w[j], bcast4(xq + 4 * j));
#else
                /* 4-bit weights: 8 pair sums of at most 2 * 15 * 127 each fit in int16 */
                __m256i s16 = _mm256_maddubs_epi16(w[0], bcast4(xq));
                for (int j = 1; j < 8; j++)
                    s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], bcast4(xq + 4 * j)));
                i32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
            }
            const float *dx = a->d + (m0 + c) * nb, *sx = a->s + (m0 + c) * nb;
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32),
                                     _mm256_mul_ps(dw, _mm256_broadcast_ss(dx + b)), acc[c]);
            if (type == GGML_Q4_1) {
                const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16)));
                acc[c] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + b), acc[c]);
            } else if (type == GGML_Q4_0) {
                const __m256 mw = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
                acc[c] = _mm256_fmadd_ps(mw, _mm256_broadcast_ss(sx + b), acc[c]);
            }
        }
    }
    for (int c = 0; c < NC; c++) out[c] = acc[c];
}
#if defined(QUANT_VNNI512)
/* 4 bytes at p in every 32-bit lane by one broadcast load (`vpbroadcastd` from memory),
 * not a load into a general register and a register-to-vector broadcast: the 512-bit tile
 * issues one per weight vector and activation row, and the register form made the
 * quantized layers 12-15% slower (`benchmarks/cpu_quant_gemm_bench.py`). */
INLINE __m512i bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* The scales d and offsets m of two groups' blocks b0 (lanes 0-7) and b1 (8-15): the values
 * x16_tile and the AMX path (quant_amx.h) both apply, so they give the same bits. */
INLINE void x16_scales(const int type, const uint8_t *b0, const uint8_t *b1, __m512 *dw,
                       __m512 *mw) {
    *dw = _mm512_cvtph_ps(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)b0)),
        _mm_loadu_si128((const __m128i *)b1), 1));
    *mw = type == GGML_Q4_1 ? _mm512_cvtph_ps(_mm256_inserti128_si256(
                                  _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 16))),
                                  _mm_loadu_si128((const __m128i *)(b1 + 16)), 1))
                            : _mm512_mul_ps(*dw, _mm512_set1_ps(-8.0f));
}

/* Two groups (16 weight rows) at once with 512-bit vectors, the lower half of each vector
 * group `grp`, the upper half the group `gstride` bytes further (0: the same group twice,
 * for a last odd group), against up to 8 activation rows. Per block and activation row, 8
 * `vpdpbusd` on 512 bytes of weights where the 256-bit tile takes 8 on 256: half the
 * instructions per product, the weights unpacked once for 8 rows instead of 4. Q8_0's signed
 * weights go in as w + 128 (AVX-512 has no `vpsignb`) and 128 * sum(q) comes off the integer
 * dot. Every lane computes the integers and fp32 steps the 256-bit tile computes for its row,
 * in the same order, so both give the same bits. */
INLINE void x16_tile(const int type, const uint8_t *grp, int64_t gstride, const QActs *a,
                     int64_t m0, const int NC, __m512 out[8]) {
    const int64_t nb = a->nb, K = a->K;
    const int bb = 8 * block_bytes(type), qo = x8_qs_offset(type);
    const __m512i low4 = _mm512_set1_epi8(0x0F), bias8 = _mm512_set1_epi8((char)0x80);
    __m512 acc[8];
    for (int c = 0; c < NC; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = grp + b * bb, *b1 = b0 + gstride;
        __m512 dw, mw;
        x16_scales(type, b0, b1, &dw, &mw);
        __m512i w[8];
        for (int j = 0; j < (type == GGML_Q8_0 ? 8 : 4); j++) {
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + qo + 32 * j))),
                _mm256_loadu_si256((const __m256i *)(b1 + qo + 32 * j)), 1);
            if (type == GGML_Q8_0) {
                w[j] = _mm512_xor_si512(v, bias8); /* w + 128 as an unsigned byte */
            } else {
                w[j] = _mm512_and_si512(v, low4);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            }
        }
        for (int c = 0; c < NC; c++) {
            const int8_t *xq = a->q + (m0 + c) * K + b * 32;
            /* two chains of four: the integer sum is the same in any order */
            __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4_512(xq));
            __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[4], bcast4_512(xq + 16));
            for (int j = 1; j < 4; j++) {
                i0 = _mm512_dpbusd_epi32(i0, w[j], bcast4_512(xq + 4 * j));
                i1 = _mm512_dpbusd_epi32(i1, w[j + 4], bcast4_512(xq + 4 * j + 16));
            }
            __m512i i32 = _mm512_add_epi32(i0, i1);
            if (type == GGML_Q8_0)
                i32 = _mm512_sub_epi32(i32, _mm512_set1_epi32(128 * a->qsum[(m0 + c) * nb + b]));
            const float dx = a->d[(m0 + c) * nb + b];
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_mul_ps(dw, _mm512_set1_ps(dx)),
                                     acc[c]);
            if (type != GGML_Q8_0)
                acc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->s[(m0 + c) * nb + b]), acc[c]);
        }
    }
    for (int c = 0; c < NC; c++) out[c] = acc[c];
}
#endif
#else
/* Portable x8 tile: out[c][r] for the 8 rows of a group (see quant_x8.h). */
static void x8_tile_portable(int type, const uint8_t *grp, const QActs *a, int64_t m0, int nc,
                             float out[TILE_X][8]) {
    const int64_t nb = a->nb, K = a->K;
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < 8; r++) out[c][r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int8_t q[8][32];
        float d[8], m[8];
        for (int r = 0; r < 8; r++)
            for (int l = 0; l < 32; l++) {
                int v;
                x8_weight(type, grp, b, r, l, &v, &d[r], &m[r]);
                q[r][l] = (int8_t)v;
            }
        for (int c = 0; c < nc; c++) {
            const int8_t *x = a->q + (m0 + c) * K + b * 32;
            const float dx = a->d[(m0 + c) * nb + b], sx = a->s[(m0 + c) * nb + b];
            for (int r = 0; r < 8; r++) {
                int32_t dot = 0;
                for (int l = 0; l < 32; l++) dot += (int32_t)q[r][l] * x[l];
                out[c][r] += (float)dot * (d[r] * dx) + m[r] * sx;
            }
        }
    }
}
#endif
