/* GGUF (ggml) weight blocks, decoded 32 weights at a time for the integer dot products of
 * quant_gemm.c. Included by quant_gemm.c only (one translation unit).
 *
 * Every supported type is read as "sub-blocks" of 32 consecutive weights of a row, each
 * w_j = dv[j / 4] * q_j + m: q_j small integers, dv a per-lane scale (8 lanes of 4 weights,
 * so Q6_K's two 16-weight scales fit), m a per-sub-block offset (0 for symmetric types).
 * The "signed" types (Q8_0, Q6_K) give q in [-128, 127]; the others q in [0, 63] with the
 * offset in m, which the caller applies once per block through the activations' block sums.
 * Layouts follow ggml-common.h: Q8_0 {d; qs[32]}, Q4_0 {d; qs[16]}, Q4_1 {d; m; qs[16]}
 * (weight j < 16 the low nibble of qs[j], j >= 16 the high nibble of qs[j - 16]), and the
 * 256-weight k-quants Q4_K {d; dmin; scales[12]; qs[128]}, Q5_K {d; dmin; scales[12];
 * qh[32]; qs[128]}, Q6_K {ql[128]; qh[64]; scales[16]; d}, with d / m / dmin fp16. */
#pragma once
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13,
       GGML_Q6_K = 14 };

/* Weights per block and bytes per block of a type; 0 for a type this file does not read. */
INLINE int block_elems(int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ? 256 : 32;
}

INLINE int block_bytes(int type) {
    switch (type) {
    case GGML_Q4_0: return 18;
    case GGML_Q4_1: return 20;
    case GGML_Q8_0: return 34;
    case GGML_Q4_K: return 144;
    case GGML_Q5_K: return 176;
    case GGML_Q6_K: return 210;
    default: return 0;
    }
}

INLINE int type_is_signed(int type) { return type == GGML_Q8_0 || type == GGML_Q6_K; }

INLINE float fp16_to_fp32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13); /* inf / NaN */
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
INLINE void k4_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Scale and offset of sub-block `b` (32 weights) of a row: lane scales dv[8] and m. The
 * quantized values come from decode_q (portable) or decode_q_avx2. */
INLINE void sub_block_scales(int type, const uint8_t *row, int64_t b, float dv[8], float *m) {
    const uint8_t *blk;
    float d;
    int sc, mn;
    switch (type) {
    case GGML_Q8_0:
    case GGML_Q4_0:
    case GGML_Q4_1:
        blk = row + b * block_bytes(type);
        d = fp16_to_fp32(blk);
        *m = type == GGML_Q4_1 ? fp16_to_fp32(blk + 2) : (type == GGML_Q4_0 ? -8.0f * d : 0.0f);
        for (int l = 0; l < 8; l++) dv[l] = d;
        return;
    case GGML_Q4_K:
    case GGML_Q5_K:
        blk = row + (b >> 3) * block_bytes(type);
        k4_scale_min(blk + 4, (int)(b & 7), &sc, &mn);
        d = fp16_to_fp32(blk) * (float)sc;
        *m = -fp16_to_fp32(blk + 2) * (float)mn;
        for (int l = 0; l < 8; l++) dv[l] = d;
        return;
    default: { /* GGML_Q6_K: two 16-weight scales per sub-block */
        blk = row + (b >> 3) * 210;
        const int j = (int)(b & 7), half = j >> 2, k = j & 3;
        const int8_t *scales = (const int8_t *)(blk + 192) + 8 * half + 2 * k;
        d = fp16_to_fp32(blk + 208);
        for (int l = 0; l < 4; l++) dv[l] = d * (float)scales[0];
        for (int l = 4; l < 8; l++) dv[l] = d * (float)scales[1];
        *m = 0.0f;
        return;
    }
    }
}

/* The 32 quantized values of sub-block `b` of a row (see the file comment for their range). */
INLINE void decode_q(int type, const uint8_t *row, int64_t b, int8_t q[32]) {
    const uint8_t *blk;
    switch (type) {
    case GGML_Q8_0:
        memcpy(q, row + b * 34 + 2, 32);
        return;
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = row + b * block_bytes(type) + (type == GGML_Q4_1 ? 4 : 2);
        for (int l = 0; l < 16; l++) {
            q[l] = (int8_t)(qs[l] & 0x0F);
            q[l + 16] = (int8_t)(qs[l] >> 4);
        }
        return;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const int j = (int)(b & 7), shift = 4 * (j & 1);
        blk = row + (b >> 3) * block_bytes(type);
        const uint8_t *qs = blk + (type == GGML_Q4_K ? 16 : 48) + 32 * (j >> 1);
        for (int l = 0; l < 32; l++) {
            int v = (qs[l] >> shift) & 0x0F;
            if (type == GGML_Q5_K) v |= ((blk[16 + l] >> j) & 1) << 4;
            q[l] = (int8_t)v;
        }
        return;
    }
    default: { /* GGML_Q6_K */
        blk = row + (b >> 3) * 210;
        const int j = (int)(b & 7), half = j >> 2, k = j & 3;
        const uint8_t *ql = blk + 64 * half + 32 * (k & 1), *qh = blk + 128 + 32 * half;
        for (int l = 0; l < 32; l++) {
            int lo = (ql[l] >> (4 * (k >> 1))) & 0x0F, hi = (qh[l] >> (2 * k)) & 3;
            q[l] = (int8_t)((lo | (hi << 4)) - 32);
        }
        return;
    }
    }
}

#if defined(__AVX2__)
/* decode_q in one register: byte l holds weight l of the sub-block. */
INLINE __m256i decode_q_avx2(int type, const uint8_t *row, int64_t b) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *blk;
    switch (type) {
    case GGML_Q8_0:
        return _mm256_loadu_si256((const __m256i *)(row + b * 34 + 2));
    case GGML_Q4_0:
    case GGML_Q4_1: {
        const uint8_t *qs = row + b * block_bytes(type) + (type == GGML_Q4_1 ? 4 : 2);
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m256i both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
        return _mm256_and_si256(both, low4);
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        const int j = (int)(b & 7);
        blk = row + (b >> 3) * block_bytes(type);
        const uint8_t *qs = blk + (type == GGML_Q4_K ? 16 : 48) + 32 * (j >> 1);
        __m256i v = _mm256_loadu_si256((const __m256i *)qs);
        v = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (j & 1)), low4);
        if (type == GGML_Q5_K) {
            __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
            __m256i bit = _mm256_set1_epi8((char)(1 << j));
            h = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit); /* 0xFF where set */
            v = _mm256_or_si256(v, _mm256_and_si256(h, _mm256_set1_epi8(16)));
        }
        return v;
    }
    default: { /* GGML_Q6_K */
        blk = row + (b >> 3) * 210;
        const int j = (int)(b & 7), half = j >> 2, k = j & 3;
        __m256i lo = _mm256_loadu_si256((const __m256i *)(blk + 64 * half + 32 * (k & 1)));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * half));
        lo = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * (k >> 1)), low4);
        hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * k), _mm256_set1_epi8(3));
        __m256i v = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        return _mm256_sub_epi8(v, _mm256_set1_epi8(32));
    }
    }
}
#endif
