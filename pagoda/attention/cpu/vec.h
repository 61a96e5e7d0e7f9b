/* Vector helpers for the paged-attention kernel: 16-float vectors as GCC vector extensions
 * (AVX-512, AVX2 or NEON from one source), fp16/bf16 conversions, horizontal reductions and a
 * vectorised exp. Included by paged_attention.c only (one translation unit). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16
#define MAX_CHUNKS 16 /* head_size <= 256 */
#define MAX_GROUP 4   /* query vectors scored together against one K/V tile */

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define INLINE static inline __attribute__((always_inline))

/* ---- scalar conversions (tails and fallbacks) -------------------------------------------- */
INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
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
}

static uint16_t f32_to_f16(float f) {
#if defined(__F16C__) || defined(__AVX512F__)
    return (uint16_t)_cvtss_sh(f, 0);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (a < 0x38800000u) {                                   /* subnormal half */
        float af;
        memcpy(&af, &a, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(af * 16777216.0f));
    }
    a += 0xfffu + ((a >> 13) & 1u) - (112u << 23);
    return (uint16_t)(sign | (a >> 13));
#endif
}

INLINE float load_scalar(const void *p, int dt, int i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

INLINE void store_scalar(void *p, int dt, int i, float x) {
    if (dt == DT_F32) ((float *)p)[i] = x;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((uint16_t *)p)[i] = f32_to_f16(x);
}

/* ---- vector helpers ---------------------------------------------------------------------- */
INLINE vf splat(float x) { return (vf){0} + x; }

INLINE vf vmax(vf a, vf b) {
    vi m = a < b;
    return (vf)(((vi)a & ~m) | ((vi)b & m));
}

INLINE vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

INLINE vf load16(const void *p, int dt) {
    if (dt == DT_F32) {
        vf v;
        memcpy(&v, p, sizeof v);
        return v;
    }
    if (dt == DT_BF16) {
        vh h;
        memcpy(&h, p, sizeof h);
        return (vf)(__builtin_convertvector(h, vu) << 16);
    }
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1));
    vf v;
    memcpy(&v, &lo, 32);
    memcpy((char *)&v + 32, &hi, 32);
    return v;
#else
    float t[LANES];
    for (int i = 0; i < LANES; i++) t[i] = f16_to_f32(((const uint16_t *)p)[i]);
    vf v;
    memcpy(&v, t, sizeof v);
    return v;
#endif
}

/* Chunk c (16 elements) of a row of `d` elements; the tail chunk of an odd head size is read
 * element by element so nothing past the row is touched. */
INLINE vf load_chunk(const char *row, int dt, int es, int c, int d) {
    if ((c + 1) * LANES <= d) return load16(row + (size_t)c * LANES * es, dt);
    float t[LANES] = {0};
    for (int i = c * LANES; i < d; i++) t[i - c * LANES] = load_scalar(row, dt, i);
    vf v;
    memcpy(&v, t, sizeof v);
    return v;
}

INLINE float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

INLINE float hmax(vf v) {
    v = vmax(v, __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = vmax(v, __builtin_shuffle(v, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = vmax(v, __builtin_shuffle(v, (vi){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return v[0];
}

/* p[t] holds 16 partial sums of key t's dot product; returns r with r[t] = sum(p[t]).
 * A transpose-and-add tree: each level halves the vectors and doubles the keys per vector. */
INLINE vf reduce16(const vf *p) {
    /* Level k pairs up vectors holding 2^(k-1) keys each and adds the halves that belong to
     * the same key; the index vectors pick those halves out of the pair (a | b). */
    const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const vi hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const vi lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const vi hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const vi lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const vi hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = __builtin_shuffle(p[2 * j], p[2 * j + 1], lo1) +
               __builtin_shuffle(p[2 * j], p[2 * j + 1], hi1);
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shuffle(a[2 * j], a[2 * j + 1], lo2) +
               __builtin_shuffle(a[2 * j], a[2 * j + 1], hi2);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shuffle(b[2 * j], b[2 * j + 1], lo3) +
               __builtin_shuffle(b[2 * j], b[2 * j + 1], hi3);
    return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, ~1 ulp).
 * Inputs below -87 return ~1e-38 instead of 0; masked lanes are zeroed by the caller. */
INLINE vf vexp_nonpos(vf x) {
    x = vmax(x, splat(-87.0f));
    vf t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds to nearest int */
    vi n = (vi)t - 0x4b400000;
    vf fx = t - 12582912.0f;
    x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    vf z = x * x;
    vf y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * z + x + 1.0f;
    return y * (vf)((n + 127) << 23);
}
