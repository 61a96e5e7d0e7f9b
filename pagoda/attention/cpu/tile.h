/* One tile of the paged-attention kernel: up to LANES consecutive key positions of one KV head,
 * scored against NQ <= 4 query vectors and folded into their online-softmax state.
 *
 * Two implementations:
 *  - attend_tile: any dtype, fp32 arithmetic (q pre-scaled, K/V rows converted on load);
 *  - attend_tile_bf16dp (bf16 cache, head size a multiple of 32, CPUs with AVX512_BF16):
 *    q.k with vdpbf16ps straight from the bf16 rows (q stays bf16, unscaled: exact products),
 *    and p.v with vdpbf16ps on (p_t, p_t+1) pairs against rows t, t+1 interleaved, p rounded
 *    to bf16 as FlashAttention does for its second matmul; the accumulator then holds each
 *    32-element column block in unpack order (see bf16dp_column), undone when writing out.
 * Included by paged_attention.c only (one translation unit). */
#pragma once
#include "vec.h"

/* Column vectors of p.v accumulated at once: MAX_GROUP x PV_COLS accumulators and PV_COLS rows
 * of V fit the register file (32 zmm; 16 ymm / xmm). */
#define PV_COLS (VEC_REGS == 32 ? 4 : 2)

typedef struct {
    const char *krow[LANES]; /* key rows of this tile (lanes past the valid keys repeat lane 0) */
    const char *vrow[LANES];
    const char *next_krow[LANES]; /* the same rows of the next tile, prefetched meanwhile */
    const char *next_vrow[LANES];
    int es, d;
    float scale;    /* applied to the scores by the bf16dp path (its q is unscaled) */
    float soft_cap; /* > 0: scores become soft_cap * tanh(score / soft_cap) (Gemma 2) */
} Tile;

/* Prefetches row t of the next tile while this one is scored: blocks are scattered, so the
 * hardware prefetcher alone stalls at every block boundary. A few lines per key rather than a
 * burst per tile, which would fill the miss buffers and stall the core until memory answers. */
INLINE void prefetch_next(const Tile *tl, int t) {
    for (int off = 0; off < tl->d * tl->es; off += 64) {
        __builtin_prefetch(tl->next_krow[t] + off);
        __builtin_prefetch(tl->next_vrow[t] + off);
    }
}

/* Logit soft-capping (Gemma 2): cap * tanh(s / cap), with tanh(|x|) = (1 - e) / (1 + e) for
 * e = exp(-2|x|) <= 1 (the kernel's exp takes non-positive arguments) and the sign put back. */
INLINE vf soft_cap_scores(vf s, float cap) {
    const vf x = s * (1.0f / cap);
    const vi sign = (vi)x & (vi)splat(-0.0f);
    const vf ax = (vf)((vi)x & ~sign);
    const vf e = vexp_nonpos(ax * -2.0f);
    return (vf)((vi)((1.0f - e) / (1.0f + e) * cap) | sign);
}

/* The online-softmax step for one query vector: s holds its LANES scores, lanes outside
 * [nlo, nvalid) are masked (nlo > 0: keys before the sliding window). Raises the running max m
 * (rescaling l and the nacc floats of acc), returns p = exp(s - m) with masked lanes 0. The
 * caller adds p's sum to l. */
INLINE vf online_softmax(vf s, int nlo, int nvalid, float *m, float *l, float *acc, int nacc) {
    const vi valid = lanes_below(nvalid) & ~lanes_below(nlo);
    s = vselect(valid, s, splat(-INFINITY));
    const float mt = hmax(s);
    if (mt > *m) {
        const float alpha = *m == -INFINITY ? 0.0f : expf(*m - mt);
        *l *= alpha;
        for (int c = 0; c < nacc; c += LANES) {
            vf a;
            memcpy(&a, acc + c, sizeof a);
            a *= alpha;
            memcpy(acc + c, &a, sizeof a);
        }
        *m = mt;
    }
    return vselect(valid, vexp_nonpos(s - *m), splat(0.0f));
}

/* q: NQ fp32 vectors (pre-scaled, zero padded to C chunks of LANES); query i may see the keys
 * [nlo[i], nvalid[i]) of the tile (none when nvalid[i] <= nlo[i]). CC = 0: the chunk count is
 * only known at run time. */
INLINE void attend_tile(const Tile *tl, const int dt, const int NQ, const int CC,
                        float *const *q, float *const *acc, float *m, float *l,
                        const int *nlo, const int *nvalid) {
    const int es = tl->es, d = tl->d;
    const int C = CC ? CC : (d + LANES - 1) / LANES;
    int nmax = 0;
    for (int i = 0; i < NQ; i++) nmax = nvalid[i] > nmax ? nvalid[i] : nmax;
    if (nmax <= 0) return;

    vf part[MAX_GROUP][LANES];
    for (int t = 0; t < LANES; t++) {
        vf k[MAX_CHUNKS];
        k[0] = load_chunk(tl->krow[t], dt, es, 0, d);
        for (int c = 1; c < C; c++) k[c] = load_chunk(tl->krow[t], dt, es, c, d);
        prefetch_next(tl, t);
        for (int i = 0; i < NQ; i++) {
            vf s, qc;
            memcpy(&s, q[i], sizeof s);
            s *= k[0];
            for (int c = 1; c < C; c++) {
                memcpy(&qc, q[i] + c * LANES, sizeof qc);
                s += qc * k[c];
            }
            part[i][t] = s;
        }
    }

    float p[MAX_GROUP][LANES] __attribute__((aligned(64)));
    for (int i = 0; i < NQ; i++) {
        vf e = splat(0.0f);
        if (nvalid[i] > nlo[i]) {
            vf s = reduce_keys(part[i]);
            if (tl->soft_cap > 0.0f) s = soft_cap_scores(s, tl->soft_cap);
            e = online_softmax(s, nlo[i], nvalid[i], m + i, l + i, acc[i], C * LANES);
            l[i] += hsum(e);
        }
        memcpy(p[i], &e, sizeof e);
    }

    /* out += p v, PV_COLS vectors of columns at a time so the accumulators stay in registers. */
    for (int c0 = 0; c0 < C; c0 += PV_COLS) {
        const int nc = C - c0 < PV_COLS ? C - c0 : PV_COLS;
        vf a[MAX_GROUP][PV_COLS];
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < nc; c++) memcpy(&a[i][c], acc[i] + (c0 + c) * LANES, sizeof(vf));
        for (int t = 0; t < nmax; t++) {
            vf v[PV_COLS];
            for (int c = 0; c < nc; c++) v[c] = load_chunk(tl->vrow[t], dt, es, c0 + c, d);
            for (int i = 0; i < NQ; i++) {
                const float pt = p[i][t];
                for (int c = 0; c < nc; c++) a[i][c] += pt * v[c];
            }
        }
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < nc; c++) memcpy(acc[i] + (c0 + c) * LANES, &a[i][c], sizeof(vf));
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16DP 1

/* Where accumulator float j of 32-element column block b sits in the row: unpacklo/hi_epi16
 * of rows t, t+1 pair elements 0-3 (lo) and 4-7 (hi) of each 128-bit lane. */
INLINE int bf16dp_column(int j) {
    const int block = j / 32, half = (j / 16) % 2, lane128 = (j % 16) / 4;
    return block * 32 + lane128 * 8 + half * 4 + j % 4;
}

/* q: NQ raw bf16 rows (unscaled); acc in bf16dp_column order. CC = head_size / 32 or 0. */
INLINE void attend_tile_bf16dp(const Tile *tl, const int NQ, const int CC,
                               const uint16_t *const *q, float *const *acc, float *m, float *l,
                               const int *nlo, const int *nvalid) {
    const int C = CC ? CC : tl->d / 32; /* 32 bf16 per zmm */
    int nmax = 0;
    for (int i = 0; i < NQ; i++) nmax = nvalid[i] > nmax ? nvalid[i] : nmax;
    if (nmax <= 0) return;

    vf part[MAX_GROUP][LANES];
    for (int t = 0; t < LANES; t++) {
        __m512i k[MAX_CHUNKS / 2];
        for (int c = 0; c < C; c++) k[c] = _mm512_loadu_si512(tl->krow[t] + c * 64);
        prefetch_next(tl, t);
        for (int i = 0; i < NQ; i++) {
            __m512 s = _mm512_setzero_ps();
            for (int c = 0; c < C; c++)
                s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(q[i] + c * 32),
                                     (__m512bh)k[c]);
            part[i][t] = (vf)s;
        }
    }

    /* p in bf16, as (p_2j, p_2j+1) pairs; l sums the rounded p so the weights stay normalised. */
    uint32_t pp[MAX_GROUP][LANES / 2] __attribute__((aligned(64)));
    for (int i = 0; i < NQ; i++) {
        __m256i pb = _mm256_setzero_si256();
        if (nvalid[i] > nlo[i]) {
            vf s = reduce_keys(part[i]) * tl->scale;
            if (tl->soft_cap > 0.0f) s = soft_cap_scores(s, tl->soft_cap);
            vf e = online_softmax(s, nlo[i], nvalid[i], m + i, l + i, acc[i], C * 32);
            pb = (__m256i)_mm512_cvtneps_pbh((__m512)e);
            l[i] += hsum((vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16));
        }
        _mm256_store_si256((__m256i *)pp[i], pb);
    }

    const int npairs = (nmax + 1) / 2; /* row 2j+1 past nmax has p = 0 and a valid address */
    for (int c0 = 0; c0 < C; c0 += 2) {
        const int nc = C - c0 < 2 ? C - c0 : 2;
        __m512 a[MAX_GROUP][4];
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < 2 * nc; c++) a[i][c] = _mm512_loadu_ps(acc[i] + c0 * 32 + c * 16);
        for (int j = 0; j < npairs; j++) {
            __m512i v[4];
            for (int c = 0; c < nc; c++) {
                const __m512i x = _mm512_loadu_si512(tl->vrow[2 * j] + (c0 + c) * 64);
                const __m512i y = _mm512_loadu_si512(tl->vrow[2 * j + 1] + (c0 + c) * 64);
                v[2 * c] = _mm512_unpacklo_epi16(x, y);
                v[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
            }
            for (int i = 0; i < NQ; i++) {
                const __m512bh pij = (__m512bh)_mm512_set1_epi32((int)pp[i][j]);
                for (int c = 0; c < 2 * nc; c++)
                    a[i][c] = _mm512_dpbf16_ps(a[i][c], pij, (__m512bh)v[c]);
            }
        }
        for (int i = 0; i < NQ; i++)
            for (int c = 0; c < 2 * nc; c++) _mm512_storeu_ps(acc[i] + c0 * 32 + c * 16, a[i][c]);
    }
}
#else
#define HAVE_BF16DP 0
#endif
