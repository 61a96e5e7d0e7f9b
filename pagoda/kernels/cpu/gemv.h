/* Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M small, bf16 or fp32, on
 * plain (unpacked) weights: float32 models, and bf16 weights that were not packed.
 *
 * At decode the weights stream from DRAM once per step and the few activation rows sit in L1,
 * so the product is memory bound: the kernel's job is to read each weight byte once, at full
 * bandwidth, with little fixed cost per call. Each thread takes a contiguous run of W's rows
 * (one sequential stream for the hardware prefetcher, plus a software prefetch further ahead)
 * and walks it in tiles of GEMV_R rows; a tile is multiplied against every x row (in groups of
 * up to GEMV_MT, while the tile stays in L1) with fp32 FMAs on VL-wide vectors. bf16 rows are
 * read as 32-bit lanes of (k, k+1) pairs and split into an fp32 vector of the even and one of
 * the odd elements (a shift, a mask), the same split for W and x, so the lane-wise products are
 * exact and the sums fp32 like torch's. Each (row, x) accumulator is reduced horizontally once
 * at the end of the tile, the bias added in fp32, and the result stored as bf16 (round to
 * nearest even) or fp32 (the logits). */
#pragma once
#include "simd.h"

#define GEMV_R 4
#if VEC_BYTES == 64
#define GEMV_MT 4 /* 16 accumulators of 32 zmm */
#else
#define GEMV_MT 2 /* 8 accumulators of 16 ymm / xmm */
#endif
/* How far ahead of the current tile the weight stream is prefetched, in bytes. */
#define GEMV_PREFETCH 4096

typedef struct {
    const void *x;
    int64_t x_stride;
    const void *w;
    const void *bias;
    void *y;
    int64_t y_stride;
    int y_fp32;
    int64_t M, N, K;
} GemvArgs;

/* VL 32-bit lanes at p: a plain load, or with `tail` the n_bytes (< VEC_BYTES) left in the
 * row, the rest read as zero. */
INLINE vu gemv_load(const char *p, int64_t n_bytes, const int tail) {
    vu u;
    if (!tail) {
        memcpy(&u, p, sizeof u);
    } else {
        char buf[VEC_BYTES] __attribute__((aligned(VEC_BYTES))) = {0};
        memcpy(buf, p, (size_t)n_bytes);
        memcpy(&u, buf, sizeof u);
    }
    return u;
}

/* One step of K (VEC_BYTES of each row at byte offset `off`, of `bytes` in a row) for a tile's
 * accumulators; `tail`: the last, partial step. */
INLINE void gemv_step(vf acc[GEMV_R][GEMV_MT], const char *x, int64_t xs, const char *w,
                      int64_t ws, int64_t off, int64_t bytes, const int DT, const int R,
                      const int MT, int prefetch, const int tail) {
    vu xv[GEMV_MT];
    for (int m = 0; m < MT; m++) xv[m] = gemv_load(x + m * xs + off, bytes - off, tail);
    for (int r = 0; r < R; r++) {
        if (prefetch) __builtin_prefetch(w + r * ws + off + GEMV_PREFETCH);
        const vu wv = gemv_load(w + r * ws + off, bytes - off, tail);
        if (DT == DT_BF16) {
            const vf wl = bf16_lo(wv), wh = bf16_hi(wv);
            for (int m = 0; m < MT; m++) {
                acc[r][m] += wl * bf16_lo(xv[m]);
                acc[r][m] += wh * bf16_hi(xv[m]);
            }
        } else {
            for (int m = 0; m < MT; m++) acc[r][m] += (vf)wv * (vf)xv[m];
        }
    }
}

/* Rows [n0, n0 + R) of W against x rows [m0, m0 + MT). DT, R and MT are compile-time
 * constants at every call site, so the accumulators live in registers. */
INLINE void gemv_tile(const GemvArgs *a, int64_t n0, int64_t m0, const int DT, const int R,
                      const int MT, int prefetch) {
    const int64_t es = DT == DT_BF16 ? 2 : 4, bytes = a->K * es;
    const char *w = (const char *)a->w + n0 * bytes;
    const char *x = (const char *)a->x + m0 * a->x_stride * es;
    const int64_t xs = a->x_stride * es;
    vf acc[GEMV_R][GEMV_MT];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MT; m++) acc[r][m] = splat(0.0f);
    int64_t off = 0;
    for (; off + VEC_BYTES <= bytes; off += VEC_BYTES)
        gemv_step(acc, x, xs, w, bytes, off, bytes, DT, R, MT, prefetch, 0);
    if (off < bytes) gemv_step(acc, x, xs, w, bytes, off, bytes, DT, R, MT, 0, 1);
    for (int m = 0; m < MT; m++) {
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[r][m]);
            int64_t n = n0 + r, row = (m0 + m) * a->y_stride;
            if (a->bias)
                s += DT == DT_BF16 ? bf16_to_f32(((const uint16_t *)a->bias)[n])
                                   : ((const float *)a->bias)[n];
            if (DT != DT_BF16 || a->y_fp32) ((float *)a->y)[row + n] = s;
            else ((uint16_t *)a->y)[row + n] = f32_to_bf16(s);
        }
    }
}

/* W rows [n0, n0 + R) against all of x, GEMV_MT x rows at a time (the tile stays in L1). */
INLINE void gemv_rows(const GemvArgs *a, int64_t n0, const int DT, const int R, int prefetch) {
    int64_t m0 = 0;
    for (; m0 + GEMV_MT <= a->M; m0 += GEMV_MT)
        gemv_tile(a, n0, m0, DT, R, GEMV_MT, prefetch && m0 == 0);
    switch (a->M - m0) {
    case 1: gemv_tile(a, n0, m0, DT, R, 1, prefetch && m0 == 0); break;
    case 2: if (GEMV_MT > 2) gemv_tile(a, n0, m0, DT, R, 2, prefetch && m0 == 0); break;
    case 3: if (GEMV_MT > 3) gemv_tile(a, n0, m0, DT, R, 3, prefetch && m0 == 0); break;
    default: break;
    }
}

static void gemv_range(const GemvArgs *a, int dt, int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    if (dt == DT_BF16) {
        for (; n + GEMV_R <= n_end; n += GEMV_R) gemv_rows(a, n, DT_BF16, GEMV_R, 1);
        for (; n < n_end; n++) gemv_rows(a, n, DT_BF16, 1, 0);
    } else {
        for (; n + GEMV_R <= n_end; n += GEMV_R) gemv_rows(a, n, DT_F32, GEMV_R, 1);
        for (; n < n_end; n++) gemv_rows(a, n, DT_F32, 1, 0);
    }
}

typedef struct {
    const GemvArgs *a;
    int dt;
} GemvJob;

/* Tiles [begin, end) of GEMV_R weight rows. */
static void gemv_tiles(void *p, int64_t begin, int64_t end) {
    const GemvJob *j = p;
    const int64_t n_end = end * GEMV_R < j->a->N ? end * GEMV_R : j->a->N;
    gemv_range(j->a, j->dt, begin * GEMV_R, n_end);
}

static void gemv(const GemvArgs *a, int dt, int nthreads) {
    /* N in runs of whole tiles */
    int64_t tiles = (a->N + GEMV_R - 1) / GEMV_R;
    int nt = pick_threads(nthreads, tiles, GEMV_R * a->K * (dt == DT_BF16 ? 2 : 4));
    GemvJob j = {a, dt};
    parallel_range(gemv_tiles, &j, tiles, 1, nt);
}
