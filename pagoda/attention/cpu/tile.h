/* One tile of the paged-attention kernel: up to TILE_KEYS consecutive key positions of one KV
 * head, scored against NQ <= 4 query vectors and folded into their online-softmax state.
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

/* Whether a multiply-add is one instruction (no register for the product). */
#if defined(__FMA__) || defined(__AVX512F__) || defined(__aarch64__)
#define HAVE_FMA 1
#else
#define HAVE_FMA 0
#endif

/* The widest block of nq x n accumulator vectors (n a power of two <= n_max, or n_max itself)
 * that fits the register file beside its nq + 1 operands (the query chunks and a key chunk, or
 * the broadcast p's and a value chunk). A block that spills makes every FMA a load and a store.
 * Constant-folded when nq and n_max are compile-time constants. */
INLINE int fit_block(int nq, int n_max) {
    int n = n_max;
    while (n > 1 && nq * n + nq + 1 + !HAVE_FMA > VEC_REGS) n /= 2;
    return n;
}

/* Key positions in a tile: one vector of scores per query with AVX-512, two with AVX2, four in
 * the portable build. Over one vector, so that the work each tile pays once (the max, the
 * rescale check, loading and storing the accumulators, setting the tile up) is spread over more
 * keys, and the dependent steps of its two score vectors overlap. */
#define TILE_KEYS 16
#define TILE_VECS (TILE_KEYS / LANES)

typedef struct {
    const char *k, *v; /* this KV head's row of slot 0 in the K and V caches */
    /* Byte offset of each key's row from k and v (keys past the valid ones repeat key 0). */
    int64_t row[TILE_KEYS];
    const char *next_k, *next_v; /* the same for the next tile, prefetched meanwhile */
    int64_t next_row[TILE_KEYS];
    int d;
    float scale;    /* applied to the scores by the bf16dp path (its q is unscaled) */
    float soft_cap; /* > 0: scores become soft_cap * tanh(score / soft_cap) (Gemma 2) */
} Tile;

/* Prefetches row t of the next tile while this one is scored: blocks are scattered, so the
 * hardware prefetcher alone stalls at every block boundary. A few lines per key rather than a
 * burst per tile, which would fill the miss buffers and stall the core until memory answers.
 * Into L2 (prefetcht1), not L1: an L1 prefetch holds one of the core's few L1 miss buffers
 * until memory answers, so a tile's rows in flight left too few for the demand loads, and the
 * kernel streamed scattered blocks at about half the rate it reaches with L2 prefetches
 * (`benchmarks/cpu_attention_bench.py`); the rows then come from L2 when the tile reads them. */
INLINE void prefetch_next(const Tile *tl, int t, int row_bytes) {
    for (int off = 0; off < row_bytes; off += 64) {
        __builtin_prefetch(tl->next_k + tl->next_row[t] + off, 0, 2);
        __builtin_prefetch(tl->next_v + tl->next_row[t] + off, 0, 2);
    }
}

/* Logit soft-capping (Gemma 2): cap * tanh(s / cap), with tanh(|x|) = (1 - e) / (1 + e) for
 * e = exp(-2|x|) <= 1 (the kernel's exp takes non-positive arguments) and the sign put back.
 * Out of line: only some models take this path, and inlined it would grow every tile body. */
static __attribute__((noinline)) vf soft_cap_scores(vf s, float cap) {
    const vf x = s * (1.0f / cap);
    const vi sign = (vi)x & (vi)splat(-0.0f);
    const vf ax = (vf)((vi)x & ~sign);
    const vf e = vexp_nonpos(ax * -2.0f);
    return (vf)((vi)((1.0f - e) / (1.0f + e) * cap) | sign);
}

/* dst[0 .. LANES) += x */
INLINE void add_to(float *dst, vf x) {
    vf a;
    memcpy(&a, dst, sizeof a);
    a += x;
    memcpy(dst, &a, sizeof a);
}

/* The online-softmax step for one query vector, in stages so that a tile's queries can run
 * each stage side by side (their chains of dependent instructions then overlap):
 *  - mask_scores: lanes of the scores s outside [nlo, nvalid) become -inf (nlo > 0: keys before
 *    the sliding window);
 *  - raise_max: when the tile's max mt exceeds the running max m, raises m, rescaling the
 *    LANES partial sums of l and the nacc floats of acc;
 *  - softmax_weights: p = exp(s - m), masked lanes 0, which the caller adds to l lane by lane
 *    (l is summed once, at the end). */
INLINE vf mask_scores(vf s, int nlo, int nvalid) {
    return vselect(lanes_below(nvalid) & ~lanes_below(nlo), s, splat(-INFINITY));
}

INLINE void raise_max(float mt, float *m, float *l, float *acc, int nacc) {
    if (mt <= *m) return;
    const float alpha = *m == -INFINITY ? 0.0f : expf(*m - mt);
    for (int c = 0; c < nacc; c += LANES) {
        vf a;
        memcpy(&a, acc + c, sizeof a);
        a *= alpha;
        memcpy(acc + c, &a, sizeof a);
    }
    vf lv;
    memcpy(&lv, l, sizeof lv);
    lv *= alpha;
    memcpy(l, &lv, sizeof lv);
    *m = mt;
}

/* `masked`: s may hold masked lanes (a fully masked s gives 0 whatever m is). */
INLINE vf softmax_weights(vf s, float m, int masked) {
    const vf e = vexp_nonpos(s - m);
    return masked ? vselect(s != splat(-INFINITY), e, splat(0.0f)) : e;
}

/* s[i][t] += chunk c of q[i] . chunk c of key row t, for NQ queries and KB keys. */
INLINE void score_chunk(vf (*s)[LANES], float *const *q, const char *const *krow, int c,
                        int partial, const int dt, const int NQ, const int KB, int d) {
    const int es = dt_size(dt);
    vf qc[MAX_GROUP];
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) memcpy(&qc[i], q[i] + c * LANES, sizeof(vf));
#pragma GCC unroll 16
    for (int t = 0; t < KB; t++) {
        const vf k = load_chunk(krow[t], dt, es, c, d, partial);
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++) s[i][t] += qc[i] * k;
    }
}

/* Column chunks [c0, c0 + nc) of acc[i] += sum over the tile's first nkeys keys t of
 * p[i][t] v_t, for NQ queries; nc <= PC, and the loops run PC times so that they unroll. */
INLINE void pv_columns(const Tile *tl, const float (*p)[TILE_KEYS], float *const *acc, int nkeys,
                       int c0, int nc, int partial, const int dt, const int NQ, const int PC,
                       int d) {
    const int es = dt_size(dt);
    vf a[MAX_GROUP][MAX_CHUNKS];
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++)
#pragma GCC unroll 16
        for (int c = 0; c < PC; c++) {
            a[i][c] = splat(0.0f); /* stays so past nc */
            if (c < nc) memcpy(&a[i][c], acc[i] + (c0 + c) * LANES, sizeof(vf));
        }
    for (int t = 0; t < nkeys; t++) {
        const char *vrow = tl->v + tl->row[t];
        vf pt[MAX_GROUP];
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++) pt[i] = splat(p[i][t]);
#pragma GCC unroll 16
        for (int c = 0; c < PC; c++) {
            if (c >= nc) break;
            const vf v = load_chunk(vrow, dt, es, c0 + c, d, partial);
#pragma GCC unroll 4
            for (int i = 0; i < NQ; i++) a[i][c] += pt[i] * v;
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++)
#pragma GCC unroll 16
        for (int c = 0; c < PC; c++)
            if (c < nc) memcpy(acc[i] + (c0 + c) * LANES, &a[i][c], sizeof(vf));
}

/* q: NQ fp32 vectors (pre-scaled, zero padded to whole chunks of LANES); query i may see the
 * keys [nlo[i], nvalid[i]) of the tile (none when nvalid[i] <= nlo[i]). CC: the head size in
 * chunks, or 0 when it is only known at run time (and may end with a partial chunk).
 *
 * Both products run in blocks of accumulators sized to the register file (fit_block), every
 * loop over a block unrolled so that its vectors live in registers:
 *  - q.k: KB keys x NQ queries at a time, one partial-sum vector each, loading each chunk of q
 *    once per KB keys and each key chunk once for all NQ queries; a block's sums are folded by
 *    the first levels of the reduce_keys tree right away, the blocks' results by the rest;
 *  - p.v: PC column chunks x NQ queries at a time, p broadcast from memory, each value chunk
 *    loaded once for all NQ queries.
 * The softmax step between them runs each of its stages for all NQ queries before the next, so
 * that the queries' chains of dependent instructions overlap. A partial last chunk is done on
 * its own after the whole ones, so that the hot loops stay free of its element-wise loads. */
INLINE void attend_tile(const Tile *tl, const int dt, const int NQ, const int CC,
                        float *const *q, float *const *acc, float *m, float *l,
                        const int *nlo, const int *nvalid) {
    const int d = CC ? CC * LANES : tl->d;
    const int CW = d / LANES, C = (d + LANES - 1) / LANES; /* whole chunks, all chunks */
    int nmax = 0, full = 1; /* full: every query sees every key of the tile (no masking) */
    for (int i = 0; i < NQ; i++) {
        nmax = nvalid[i] > nmax ? nvalid[i] : nmax;
        full &= nlo[i] <= 0 && nvalid[i] >= TILE_KEYS;
    }
    if (nmax <= 0) return;

    const int KB = fit_block(NQ, LANES); /* keys scored at once */
    vf part[MAX_GROUP][TILE_KEYS];       /* per query: TILE_KEYS / KB blocks of KB keys */
    for (int t0 = 0; t0 < TILE_KEYS; t0 += KB) {
        const char *krow[LANES];
        vf s[MAX_GROUP][LANES];
#pragma GCC unroll 16
        for (int t = 0; t < KB; t++) krow[t] = tl->k + tl->row[t0 + t];
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++)
#pragma GCC unroll 16
            for (int t = 0; t < KB; t++) s[i][t] = splat(0.0f);
        for (int c = 0; c < CW; c++) score_chunk(s, q, krow, c, 0, dt, NQ, KB, d);
        if (CW < C) score_chunk(s, q, krow, CW, 1, dt, NQ, KB, d);
#pragma GCC unroll 16
        for (int t = 0; t < KB; t++) prefetch_next(tl, t0 + t, d * dt_size(dt));
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++) {
            reduce_keys(s[i], KB, 1);
            part[i][t0 / KB] = s[i][0];
        }
    }

    /* The tile's scores: vector j of query i holds keys j LANES + lane. Each optional step is a
     * loop of its own, so that the compiler need not copy the others for each case. */
    vf sc[MAX_GROUP][TILE_VECS];
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++)
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECS; j++) {
            vf *blocks = part[i] + j * (LANES / KB);
            reduce_keys(blocks, LANES / KB, KB);
            sc[i][j] = blocks[0];
        }
    if (tl->soft_cap > 0.0f)
        for (int i = 0; i < NQ; i++)
            for (int j = 0; j < TILE_VECS; j++) sc[i][j] = soft_cap_scores(sc[i][j], tl->soft_cap);
    if (!full)
        for (int i = 0; i < NQ; i++)
            for (int j = 0; j < TILE_VECS; j++)
                sc[i][j] = mask_scores(sc[i][j], nlo[i] - j * LANES, nvalid[i] - j * LANES);
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) {
        vf top = sc[i][0];
#pragma GCC unroll 4
        for (int j = 1; j < TILE_VECS; j++) top = vmax(top, sc[i][j]);
        raise_max(hmax(top), m + i, l + i * LANES, acc[i], C * LANES);
    }
    float p[MAX_GROUP][TILE_KEYS] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) {
        vf sum = splat(0.0f);
#pragma GCC unroll 4
        for (int j = 0; j < TILE_VECS; j++) {
            const vf e = softmax_weights(sc[i][j], m[i], !full);
            sum += e;
            memcpy(p[i] + j * LANES, &e, sizeof e);
        }
        add_to(l + i * LANES, sum);
    }

    /* out += p v. Without CC the blocks are at most 4 chunks (what AVX2 fits for NQ >= 2; more
     * would only lengthen the compile) and the last whole one may be narrower. */
    const int PC = fit_block(NQ, CC ? CC : 4); /* column chunks accumulated at once */
    for (int c0 = 0; c0 < CW; c0 += PC) {
        const int nc = CC || CW - c0 >= PC ? PC : CW - c0;
        pv_columns(tl, p, acc, nmax, c0, nc, 0, dt, NQ, PC, d);
    }
    if (CW < C) pv_columns(tl, p, acc, nmax, CW, 1, 1, dt, NQ, 1, d);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16DP 1
_Static_assert(TILE_KEYS == LANES, "the bf16dp tile is one vector of keys");

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
        for (int c = 0; c < C; c++) k[c] = _mm512_loadu_si512(tl->k + tl->row[t] + c * 64);
        prefetch_next(tl, t, tl->d * 2);
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
            reduce_keys(part[i], LANES, 1);
            vf s = part[i][0] * tl->scale;
            if (tl->soft_cap > 0.0f) s = soft_cap_scores(s, tl->soft_cap);
            s = mask_scores(s, nlo[i], nvalid[i]);
            raise_max(hmax(s), m + i, l + i * LANES, acc[i], C * 32);
            const vf e = softmax_weights(s, m[i], 1);
            pb = (__m256i)_mm512_cvtneps_pbh((__m512)e);
            add_to(l + i * LANES, (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16));
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
                const __m512i x = _mm512_loadu_si512(tl->v + tl->row[2 * j] + (c0 + c) * 64);
                const __m512i y = _mm512_loadu_si512(tl->v + tl->row[2 * j + 1] + (c0 + c) * 64);
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
