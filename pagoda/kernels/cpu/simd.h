/* Vector helpers of the CPU ops, one source for every ISA level: `vf` is VL floats as a GCC
 * vector extension (a zmm with AVX-512, a ymm with AVX2, an xmm / NEON q register in the
 * portable build), so the same code compiles to each level's instructions. Loads and stores
 * widen bf16 to fp32 by a 16-bit shift and round back to nearest even (vcvtneps2bf16 where
 * AVX512_BF16 has it); tails go through a zeroed buffer so nothing past a row is read. The
 * level is what the compiler's -m flags (pagoda/utils/cpu_build.py) make available:
 * AVX512_BF16 also gets the vdpbf16ps GEMM of gemm_bf16dp.h. Included by cpu_ops.c only (one
 * translation unit). */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* The level this translation unit was compiled for, as pagoda_cpu_ops_isa() reports it:
 * 0 portable, 1 avx2, 2 avx512, 3 avx512_bf16 (the index into build.ISA_LEVELS). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PAGODA_ISA 3
#define HAVE_BF16DP 1
#define VEC_BYTES 64
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGODA_ISA 2
#define VEC_BYTES 64
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGODA_ISA 1
#define VEC_BYTES 32
#else
#define PAGODA_ISA 0
#define VEC_BYTES 16
#endif
#ifndef HAVE_BF16DP
#define HAVE_BF16DP 0
#endif

#define VL (VEC_BYTES / 4) /* fp32 lanes per vector */
#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VEC_BYTES)));
typedef uint32_t vu __attribute__((vector_size(VEC_BYTES)));
typedef int32_t vi __attribute__((vector_size(VEC_BYTES)));
typedef uint16_t vh __attribute__((vector_size(VEC_BYTES / 2)));

enum { DT_F32 = 0, DT_BF16 = 1 };

/* x in every lane: a plain broadcast (x - 0 is x for every x, so the compiler drops the
 * subtraction; `(vf){0} + x` would stay an add, since 0 + -0 is +0). */
INLINE vf splat(float x) { return x - (vf){0}; }

/* bf16 bits in the high half of each 32-bit lane: the fp32 value. */
INLINE vf bf16_hi(vu u) { return (vf)(u & 0xffff0000u); }
/* bf16 bits in the low half: shifted up into place. */
INLINE vf bf16_lo(vu u) { return (vf)(u << 16); }

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

/* VL fp32 values rounded to bf16, nearest even (NaNs stay NaN). */
INLINE vh f32_to_bf16_v(vf v) {
#if HAVE_BF16DP
    return (vh)_mm512_cvtneps_pbh((__m512)v);
#else
    vu u = (vu)v;
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    r = (r & ~nan) | (((u >> 16) | 0x40u) & nan);
    return __builtin_convertvector(r, vh);
#endif
}

/* VL bf16 values widened to fp32 (one vpmovzxwd where the ISA has it: GCC splits the generic
 * conversion into halves). */
INLINE vf widen_bf16(vh h) {
#if VEC_BYTES == 64
    return bf16_lo((vu)_mm512_cvtepu16_epi32((__m256i)h));
#elif VEC_BYTES == 32
    return bf16_lo((vu)_mm256_cvtepu16_epi32((__m128i)h));
#else
    return bf16_lo(__builtin_convertvector(h, vu));
#endif
}

/* VL values of an fp32 or bf16 row, widened to fp32. */
INLINE vf load_vec(const void *p, int dt) {
    if (dt == DT_BF16) {
        vh h;
        memcpy(&h, p, sizeof h);
        return widen_bf16(h);
    }
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void store_vec(void *p, vf v, int dt) {
    if (dt == DT_BF16) {
        vh h = f32_to_bf16_v(v);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &v, sizeof v);
    }
}

/* The first n (< VL) values of a row, the rest zero; and their store. */
INLINE vf load_part(const void *p, int dt, int64_t n) {
    const int es = dt == DT_BF16 ? 2 : 4;
    char buf[VEC_BYTES] __attribute__((aligned(VEC_BYTES))) = {0};
    memcpy(buf, p, (size_t)(n * es));
    return load_vec(buf, dt);
}

INLINE void store_part(void *p, vf v, int dt, int64_t n) {
    const int es = dt == DT_BF16 ? 2 : 4;
    char buf[VEC_BYTES] __attribute__((aligned(VEC_BYTES)));
    store_vec(buf, v, dt);
    memcpy(p, buf, (size_t)(n * es));
}

/* Values [c, c + VL) of a row of n, clipped to the row. */
INLINE vf load_at(const char *row, int dt, int64_t c, int64_t n) {
    const int es = dt == DT_BF16 ? 2 : 4;
    return c + VL <= n ? load_vec(row + c * es, dt) : load_part(row + c * es, dt, n - c);
}

INLINE void store_at(char *row, vf v, int dt, int64_t c, int64_t n) {
    const int es = dt == DT_BF16 ? 2 : 4;
    if (c + VL <= n) store_vec(row + c * es, v, dt);
    else store_part(row + c * es, v, dt, n - c);
}

/* v rounded to the dtype and widened back: where torch's bf16 op would round an intermediate. */
INLINE vf round_to(vf v, int dt) {
    if (dt != DT_BF16) return v;
    return widen_bf16(f32_to_bf16_v(v));
}

typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* The sum of v's lanes: halves added down to 4 lanes (register extracts, no trip through
 * memory), then those 4. */
INLINE float hsum(vf v) {
    vf4 q;
#if VL >= 8
    vf8 o;
#if VL == 16
    vf8 a, b;
    memcpy(&a, &v, 32);
    memcpy(&b, (const char *)&v + 32, 32);
    o = a + b;
#else
    memcpy(&o, &v, 32);
#endif
    vf4 c, d;
    memcpy(&c, &o, 16);
    memcpy(&d, (const char *)&o + 16, 16);
    q = c + d;
#else
    memcpy(&q, &v, 16);
#endif
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* min(max(x, lo), hi): vmaxps / vminps where the ISA has them, else by masks (C has no ?: on
 * vectors). */
INLINE vf vclamp(vf x, float lo, float hi) {
#if VEC_BYTES == 64
    return (vf)_mm512_min_ps(_mm512_max_ps((__m512)x, (__m512)splat(lo)), (__m512)splat(hi));
#elif VEC_BYTES == 32
    return (vf)_mm256_min_ps(_mm256_max_ps((__m256)x, (__m256)splat(lo)), (__m256)splat(hi));
#else
    vi below = x < lo, above = x > hi;
    vi r = ((vi)x & ~below) | ((vi)splat(lo) & below);
    return (vf)((r & ~above) | ((vi)splat(hi) & above));
#endif
}

/* 1 / d: the ISA's reciprocal estimate and one Newton step (~2 ulp, a third of a division's
 * time on Zen 3), or a division where there is none. */
INLINE vf vrecip(vf d) {
#if VEC_BYTES == 64
    vf r = (vf)_mm512_rcp14_ps((__m512)d);
#elif VEC_BYTES == 32
    vf r = (vf)_mm256_rcp_ps((__m256)d);
#else
    return 1.0f / d;
#endif
#if VEC_BYTES >= 32
    return r * (2.0f - d * r);
#endif
}

/* exp(x), Cephes expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp). x is clamped to
 * [-87.3, 88.3], where 2^n stays a normal float, so large |x| gives ~1e-38 / ~2e38 rather
 * than 0 / inf. */
INLINE vf vexp(vf x) {
    x = vclamp(x, -87.3f, 88.3f);
    vf t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: rounds to nearest int */
    vi n = (vi)t - 0x4b400000;
    vf fx = t - 12582912.0f;
    x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    vf y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    return y * (vf)((n + 127) << 23);
}

/* Threads for `work` units of roughly `unit_cost` bytes touched: one thread below ~64 KiB of
 * traffic, where a fork/join would cost more than it saves. */
INLINE int pick_threads(int nthreads, int64_t work, int64_t unit_cost) {
    if (nthreads < 1) nthreads = 1;
    if (work * unit_cost < 65536) return 1;
    return work < nthreads ? (int)(work > 0 ? work : 1) : nthreads;
}

#include "parallel.h"
