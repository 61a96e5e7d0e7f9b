/* Vector helpers for the paged-attention kernel: native-width float vectors as GCC vector
 * extensions (LANES = 16 with AVX-512, 8 with AVX2, 4 in the portable SSE2 / NEON build, from
 * one source), fp16/bf16 conversions, horizontal reductions and a vectorised exp. A vector is
 * kept at the register's width: GCC keeps a wider one in memory and lowers its comparisons and
 * permutations element by element. Included by paged_attention.c only (one translation unit). */
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

#if defined(__AVX512F__)
#define LANES 16
#define VEC_REGS 32
#elif defined(__AVX__)
#define LANES 8
#define VEC_REGS 16
#else
#define LANES 4
#define VEC_REGS 16
#endif
#define MAX_CHUNKS (256 / LANES) /* head_size <= 256 */
#define MAX_GROUP 4              /* query vectors scored together against one K/V tile */

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));

/* DT_E5M2: an fp8 cache (e5m2), read only: its byte is the top half of an fp16. */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_E5M2 = 3 };

#define INLINE static inline __attribute__((always_inline))

INLINE int dt_size(int dt) { return dt == DT_F32 ? 4 : dt == DT_E5M2 ? 1 : 2; }

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

/* fp32 -> fp8 e5m2, as torch converts (c10's fp8e5m2_from_fp32_value): round to nearest even,
 * 65536 and over become inf, NaN stays NaN. */
static uint8_t f32_to_e5m2(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (u >= 143u << 23) {
        r = u > 255u << 23 ? 0x7f : 0x7c;
    } else if (u < 113u << 23) { /* a subnormal e5m2: let the fp32 adder round */
        float a, b;
        const uint32_t dm = 134u << 23;
        memcpy(&a, &u, 4);
        memcpy(&b, &dm, 4);
        a += b;
        memcpy(&u, &a, 4);
        r = (uint8_t)(u - dm);
    } else {
        const uint32_t odd = (u >> 21) & 1u;
        u += ((uint32_t)(15 - 127) << 23) + 0xfffffu + odd;
        r = (uint8_t)(u >> 21);
    }
    return (uint8_t)(r | (sign >> 24));
}

INLINE float load_scalar(const void *p, int dt, int i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_E5M2) return f16_to_f32((uint16_t)(((const uint8_t *)p)[i] << 8));
    return f16_to_f32(((const uint16_t *)p)[i]);
}

INLINE void store_scalar(void *p, int dt, int i, float x) {
    if (dt == DT_F32) ((float *)p)[i] = x;
    else if (dt == DT_BF16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((uint16_t *)p)[i] = f32_to_f16(x);
}

/* ---- vector helpers ---------------------------------------------------------------------- */
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

INLINE vf splat(float x) { return x - (vf){0}; } /* a broadcast: x - 0 is x for every x */

INLINE vf vmax(vf a, vf b) {
    vi m = a < b;
    return (vf)(((vi)a & ~m) | ((vi)b & m));
}

INLINE vf vselect(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); }

/* Lanes [0, n) all ones, the rest zero (n in [0, LANES]). */
INLINE vi lanes_below(int n) {
    static const int32_t ramp[2 * LANES] = {[0 ... LANES - 1] = -1};
    vi m;
    memcpy(&m, ramp + LANES - (n < 0 ? 0 : n > LANES ? LANES : n), sizeof m);
    return m;
}

INLINE float hsum(vf v) {
    float t[LANES];
    memcpy(t, &v, sizeof t);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

INLINE float hmax(vf v) {
    float t[LANES];
    memcpy(t, &v, sizeof t);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] = t[i + w] > t[i] ? t[i + w] : t[i];
    return t[0];
}

/* One level of the transpose-and-add tree of reduce_keys: a and b each hold g keys' partial
 * sums (LANES / g lanes a key); the result holds their 2g keys, each key's lanes summed in
 * pairs. PAIRg for g = 1, 2, 4, 8. The levels that shuffle within 128-bit lanes (cheap) come
 * first and the ones that cross them last; in between a key's lanes are spread over the vector,
 * and the last level leaves key t in lane t. */
#if LANES == 16
#define PAIR1(a, b)                                                                                \
    (SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +                        \
     SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define PAIR2(a, b)                                                                                \
    (SHUF(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +                       \
     SHUF(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31))
#define PAIR4(a, b)                                                                                \
    (SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +                        \
     SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define PAIR8(a, b) PAIR4(a, b)
#elif LANES == 8
#define PAIR1(a, b) (SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15))
#define PAIR2(a, b) (SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15))
#define PAIR4(a, b) (SHUF(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(a, b, 4, 5, 6, 7, 12, 13, 14, 15))
#else
#define PAIR1(a, b) (SHUF(a, b, 0, 1, 4, 5) + SHUF(a, b, 2, 3, 6, 7))
#define PAIR2(a, b) (SHUF(a, b, 0, 2, 4, 6) + SHUF(a, b, 1, 3, 5, 7))
#endif

/* PAIRg(a, b); g is a constant wherever the tree is unrolled. */
INLINE vf pair_keys(vf a, vf b, int g) {
#if LANES >= 16
    if (g == 8) return PAIR8(a, b);
#endif
#if LANES >= 8
    if (g == 4) return PAIR4(a, b);
#endif
    return g == 2 ? PAIR2(a, b) : PAIR1(a, b);
}

/* p[0 .. n) each hold the partial sums of g keys' dot products (LANES / g lanes a key; n g <=
 * LANES keys in all, in order); folds them in place into p[0], which then holds each key's sum
 * over LANES / (n g) lanes (key t's whole sum in lane t when n g = LANES). A transpose-and-add
 * tree: each level halves the vectors and doubles the keys per vector, so the keys a q.k block
 * scores can be folded at once and the blocks' results folded further later. */
INLINE void reduce_keys(vf *p, int n, int g) {
    for (; n > 1; n /= 2, g *= 2)
#pragma GCC unroll 16
        for (int j = 0; j < n / 2; j++) p[j] = pair_keys(p[2 * j], p[2 * j + 1], g);
}

/* LANES values of an fp32, bf16 or fp16 row, widened to fp32. */
INLINE vf load_lanes(const void *p, int dt) {
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
#if LANES == 16
    if (dt == DT_E5M2)
        return (vf)_mm512_cvtph_ps(
            _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif LANES == 8 && defined(__F16C__)
    if (dt == DT_E5M2)
        return (vf)_mm256_cvtph_ps(
            _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float t[LANES];
    for (int i = 0; i < LANES; i++) t[i] = load_scalar(p, dt, i);
    vf v;
    memcpy(&v, t, sizeof v);
    return v;
#endif
}

/* LANES fp32 values narrowed to the row's dtype and stored: bf16 rounded to nearest even (as
 * torch rounds, a NaN quiet), fp16 by the CPU's conversion where it has one (round to nearest
 * even, as torch converts). */
INLINE void store_lanes(void *p, int dt, vf x) {
    if (dt == DT_F32) {
        memcpy(p, &x, sizeof x);
        return;
    }
    if (dt == DT_BF16) {
        const vu u = (vu)x, a = u & 0x7fffffffu;
        const vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const vu nan = (vu)(a > 0x7f800000u);
        const vh h = __builtin_convertvector((r & ~nan) | ((u >> 16 | 0x40u) & nan), vh);
        memcpy(p, &h, sizeof h);
        return;
    }
#if LANES == 16
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT));
#elif LANES == 8 && defined(__F16C__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
    float t[LANES];
    memcpy(t, &x, sizeof t);
    for (int i = 0; i < LANES; i++) ((uint16_t *)p)[i] = f32_to_f16(t[i]);
#endif
}

/* The tail chunk c (elements c LANES .. d - 1) of a row of d elements, zero padded and read
 * element by element so that nothing past the row is touched. Out of line: it is rare (a head
 * size LANES does not divide), and a call keeps its code out of the unrolled loops. */
static __attribute__((noinline)) vf load_tail(const char *row, int dt, int c, int d) {
    float t[LANES] = {0};
    for (int i = c * LANES; i < d; i++) t[i - c * LANES] = load_scalar(row, dt, i);
    vf v;
    memcpy(&v, t, sizeof v);
    return v;
}

/* Chunk c (LANES elements) of a row of d elements, widened to fp32; `partial`: the chunk runs
 * past d (load_tail). */
INLINE vf load_chunk(const char *row, int dt, int es, int c, int d, int partial) {
    return partial ? load_tail(row, dt, c, d) : load_lanes(row + (size_t)c * LANES * es, dt);
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
