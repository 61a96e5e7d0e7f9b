/* AVX-512 helpers of the CPU ops: 16-lane loads/stores of fp32 or bf16 rows (masked for
 * tails), rounding through bf16, and a vectorised exp. Included by cpu_ops.c only (one
 * translation unit). The ops need AVX512F/BW and AVX512_BF16 (vdpbf16ps, vcvtneps2bf16):
 * without them this file stops the build, and the Python side falls back to torch. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512BF16__)
#error "pagoda's CPU ops need AVX512F, AVX512BW and AVX512_BF16 (build with -march=native)"
#endif

#define INLINE static inline __attribute__((always_inline))

enum { DT_F32 = 0, DT_BF16 = 1 };

INLINE __mmask16 tail_mask16(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

INLINE __mmask32 tail_mask32(int64_t n) {
    return n >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1u);
}

/* 16 values (fewer under `m`, the rest zero) of an fp32 or bf16 row, widened to fp32. */
INLINE __m512 load16(const void *p, int dt, __mmask16 m) {
    if (dt == DT_BF16) {
        __m256i h = _mm256_maskz_loadu_epi16(m, p);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(m, p);
}

/* Store 16 fp32 values as the row's dtype, rounding to nearest even for bf16. */
INLINE void store16(void *p, __m512 v, int dt, __mmask16 m) {
    if (dt == DT_BF16) _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
    else _mm512_mask_storeu_ps(p, m, v);
}

/* v rounded to the dtype and widened back: where torch's bf16 op would round an intermediate. */
INLINE __m512 round_to(__m512 v, int dt) {
    if (dt != DT_BF16) return v;
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* exp(x), Cephes expf (range reduction by ln 2, degree-6 polynomial, ~1 ulp); scalef takes
 * the 2^n step, so large |x| saturates to inf / 0 instead of wrapping. */
INLINE __m512 vexp(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* Threads for `work` units of roughly `unit_cost` bytes touched: one thread below ~64 KiB of
 * traffic, where OpenMP's fork/join would cost more than it saves. */
INLINE int pick_threads(int nthreads, int64_t work, int64_t unit_cost) {
    if (nthreads < 1) nthreads = 1;
    if (work * unit_cost < 65536) return 1;
    return work < nthreads ? (int)(work > 0 ? work : 1) : nthreads;
}
