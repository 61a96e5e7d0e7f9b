/* llama.cpp's CPU arithmetic, op for op, for a Llama model kept in its GGUF blocks (Q4_1, Q8_0):
 * the ggml numerics mode (`pagoda.model.models.llama_ggml`). Each function computes what the
 * ggml CPU backend computes for that op in the same order of fp32 operations, so the logits, and
 * with them greedy outputs, come out bit for bit as llama.cpp's (same GGUF file, f16 KV cache,
 * flash attention off, its defaults). The reference is ggml as llama-cpp-python 0.3.36 vendors
 * it, built by GCC for the CPU it runs on: the SIMD width of that build decides some summation
 * orders and the exp approximation, so every op that depends on it takes a `variant`,
 * GN_AVX512 (a build with AVX512F/DQ: 16-lane vectors) or GN_AVX2 (AVX2 + FMA: 8 lanes).
 *
 * What ggml computes, and so what this file emulates, lane by lane:
 * - matrix products with quantized weights (`ggml_vec_dot_q4_1_q8_1`, `_q8_0_q8_0`, and
 *   llamafile's tinyBLAS_Q0_AVX, which computes the same): the activation row is quantized per
 *   32 values (Q8_1 / Q8_0: d = amax / 127 stored as fp16, q = round(x * (127 / amax)), Q8_1's
 *   s = fp16(d * sum q)); each block's 32 products are summed as 8 int32 lanes of 4, each lane
 *   accumulated over blocks in fp32 by fma(d_w * d_x, lane, acc); the 8 lanes are summed by a
 *   halving tree, and Q4_1's min term (sum of m_w * s_x, in block order) is added last;
 * - RMSNorm: squares summed in double, scale = 1 / sqrtf(mean + eps), y = x * scale * w;
 * - RoPE (normal mode, adjacent pairs): angles by theta *= theta_scale from theta = position,
 *   cosf / sinf from the C library, the rotation with GCC's contraction of a*b - c*d;
 * - attention without flash attention over an f16 cache: q rounded to f16, scores by
 *   `ggml_vec_dot_f16` (one query row: 4 accumulators of a vector each, pairwise reduced) or by
 *   tinyBLAS (prompt rows: one accumulator per output), softmax of score * scale with the causal
 *   mask (ggml's vector exp, chunk sums by a halving tree added in double), the weights rounded
 *   to f16 and multiplied by V the same two ways;
 * - SwiGLU: x / (1 + exp(-x)) * up with ggml's vector exp.
 * Keys past the causal limit (ggml computes them over a cache padded to 256 cells and masks
 * them) enter every sum as exact zeros, which change nothing, so only keys 0..position are read.
 *
 * fp32 operations are written out one by one and built without contraction (the pragmas below,
 * GCC's or clang's), so the compiler fuses nothing ggml does not fuse. Entry points return 0, or -1 for arguments
 * they do not handle. */
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

#define GN_ABI 3
#define GN_AVX512 0
#define GN_AVX2 1
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define MAX_LANES 16

int gn_abi(void) { return GN_ABI; }

static float h2f(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}

static uint16_t f2h(float f) { /* round to nearest even, as F16C's vcvtps2ph with imm 0 */
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}

static float rd_h(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
}

/* v[0..n) summed by halving: v[i] += v[i + n/2], ..., down to one value (GCC's
 * _mm512_reduce_add_ps for 16 lanes; hsum_float_8 and tinyBLAS's hsum for 8). */
static float halving_sum(float *v, int n) {
    for (int h = n / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) v[i] = v[i + h] + v[i];
    return v[0];
}

/* GGML_F32x8_REDUCE's last step: the two 128-bit halves added, then two horizontal adds. */
static float hadd_sum8(const float *v) {
    const float t0 = v[0] + v[4], t1 = v[1] + v[5], t2 = v[2] + v[6], t3 = v[3] + v[7];
    return (t0 + t1) + (t2 + t3);
}

static int lanes_of(int variant) { return variant == GN_AVX512 ? 16 : 8; }

/* Work on Pagoda's thread pool (parallel.h; the loader hands over its entry point), else in an
 * OpenMP region. Each item's arithmetic does not depend on who runs it. */
void gn_set_parallel_run(parallel_run_fn fn) { parallel_run = fn; }

/* ------------------------------------------------------------------------------------------ */
/* Quantized matrix products */

typedef struct {
    uint16_t d, s; /* fp16; s only for Q8_1 */
    int8_t q[32];
} ActBlock;

/* quantize_row_q8_1 / q8_0 (AVX2 code, which the AVX-512 build uses too) of one row. */
static void quantize_acts(const float *x, int64_t K, ActBlock *out) {
    for (int64_t b = 0; b < K / 32; b++) {
        const float *v = x + b * 32;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) {
            const float a = fabsf(v[l]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.f;
        const float id = amax != 0.0f ? 127.f / amax : 0.0f;
        int sum = 0;
        for (int l = 0; l < 32; l++) {
            float r = rintf(v[l] * id); /* _mm256_round_ps(_MM_ROUND_NEAREST): ties to even */
            int qi = (int)r;
            qi = qi > 127 ? 127 : (qi < -128 ? -128 : qi); /* packs saturate */
            out[b].q[l] = (int8_t)qi;
            sum += qi;
        }
        out[b].d = f2h(d);
        out[b].s = f2h(d * (float)sum);
    }
}

static int block_bytes(int type) { return type == GGML_Q4_1 ? 20 : 34; }

/* One weight row (its GGUF blocks) against one quantized activation row. */
static float vec_dot(int type, const uint8_t *row, const ActBlock *a, int64_t nb) {
    float acc[8] = {0};
    float summs = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * block_bytes(type);
        int32_t lane[8];
        float dd;
        if (type == GGML_Q4_1) {
            summs += rd_h(blk + 2) * h2f(a[b].s); /* exact product: fused or not, the same */
            dd = rd_h(blk) * h2f(a[b].d);
            const uint8_t *qs = blk + 4;
            for (int k = 0; k < 8; k++) {
                int32_t s = 0;
                for (int e = 4 * k; e < 4 * k + 4; e++) {
                    const int qw = e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4);
                    s += qw * a[b].q[e];
                }
                lane[k] = s;
            }
        } else {
            dd = rd_h(blk) * h2f(a[b].d);
            const int8_t *qs = (const int8_t *)(blk + 2);
            for (int k = 0; k < 8; k++) {
                int32_t s = 0;
                for (int e = 4 * k; e < 4 * k + 4; e++) s += qs[e] * a[b].q[e];
                lane[k] = s;
            }
        }
        for (int k = 0; k < 8; k++) acc[k] = fmaf(dd, (float)lane[k], acc[k]);
    }
    return halving_sum(acc, 8) + summs;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Eight int32 lanes, lane k = sum of u[4k..4k+3] * s[4k..4k+3] (u unsigned, s signed): exact,
 * so ggml's VNNI and maddubs builds give the same integers. */
static inline __m256i lane_dots(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* vec_dot in vectors: ggml's own AVX2 code, the same bits as the lane loop above. */
static float vec_dot_avx2(int type, const uint8_t *row, const ActBlock *a, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float summs = 0.0f;
    const int bb = block_bytes(type);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        const __m256i qy = _mm256_loadu_si256((const __m256i *)a[b].q);
        const float dd = rd_h(blk) * h2f(a[b].d);
        __m256i xy;
        if (type == GGML_Q4_1) {
            summs += rd_h(blk + 2) * h2f(a[b].s);
            const __m128i t = _mm_loadu_si128((const __m128i *)(blk + 4));
            const __m256i qx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t),
                                                _mm256_set1_epi8(15));
            xy = lane_dots(qx, qy);
        } else {
            const __m256i qx = _mm256_loadu_si256((const __m256i *)(blk + 2));
            xy = lane_dots(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dd), _mm256_cvtepi32_ps(xy), acc);
    }
    float v[8];
    _mm256_storeu_ps(v, acc);
    return halving_sum(v, 8) + summs;
}
#define VEC_DOT vec_dot_avx2
#else
#define VEC_DOT vec_dot
#endif

const char *gn_isa(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

/* y[m, n] = W[n] . x[m] for M rows of x (row stride ldx) and N weight rows: Q4_1 against Q8_1
 * activations, Q8_0 against Q8_0. W in the GGUF layout, w_stride bytes a row. */
typedef struct {
    int type;
    const uint8_t *w;
    int64_t w_stride, nb, K, ldx, ldy, M;
    const float *x;
    ActBlock *acts;
    float *y;
} LinearJob;

static void quantize_items(void *p, int64_t m0, int64_t m1) {
    LinearJob *j = p;
    for (int64_t m = m0; m < m1; m++) quantize_acts(j->x + m * j->ldx, j->K, j->acts + m * j->nb);
}

static void dot_items(void *p, int64_t n0, int64_t n1) {
    LinearJob *j = p;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < j->M; m++)
            j->y[m * j->ldy + n] =
                VEC_DOT(j->type, j->w + n * j->w_stride, j->acts + m * j->nb, j->nb);
}

int gn_linear(int type, const uint8_t *w, int64_t w_stride, int64_t N, int64_t K,
              const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int nthreads) {
    if ((type != GGML_Q4_1 && type != GGML_Q8_0) || K % 32 != 0 || M < 0 || N < 0) return -1;
    const int64_t nb = K / 32;
    ActBlock *acts = malloc((size_t)(M * nb + 1) * sizeof(ActBlock));
    if (!acts) return -1;
    LinearJob j = {type, w, w_stride, nb, K, ldx, ldy, M, x, acts, y};
    parallel_range(quantize_items, &j, M, 8, M >= 16 ? nthreads : 1);
    parallel_range(dot_items, &j, N, 16, nthreads);
    free(acts);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Norm, RoPE, activation */

/* y[m] = rms_norm(x[m]) * w (ggml_compute_forward_rms_norm_f32, fused with the mul or not). */
int gn_rms_norm(const float *x, int64_t ldx, const float *w, float eps, int64_t M, int64_t K,
                float *y, int64_t ldy) {
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        double sum = 0.0;
        for (int64_t i = 0; i < K; i++) sum += (double)(xr[i] * xr[i]);
        const float mean = (float)(sum / (double)K);
        const float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t i = 0; i < K; i++) y[m * ldy + i] = xr[i] * scale * w[i];
    }
    return 0;
}

/* RoPE in place on T rows of `heads` heads of D values (row stride ldx), each head in Hugging
 * Face order (rotary halves [0, D/2) and [D/2, D): Pagoda un-permutes the GGUF's Q/K rows), with
 * ggml's normal-mode arithmetic for the pair (i, i + D/2), which is its pair (2i, 2i + 1).
 * `contraction`: how the compiler fused x0*c - x1*s and x0*s + x1*c: 0 none, 1 the first
 * product of each (fma(x0, c, -(x1*s)), fma(x0, s, x1*c)), 2 the second. */
int gn_rope(float *x, int64_t ldx, const int64_t *pos, int64_t T, int heads, int D,
            float freq_base, int contraction) {
    if (D % 2 != 0 || D > 1024) return -1;
    const float theta_scale = powf(freq_base, -2.0f / (float)D);
    for (int64_t t = 0; t < T; t++) {
        float cs[512], sn[512];
        float theta = (float)pos[t];
        for (int i = 0; i < D / 2; i++) {
            cs[i] = cosf(theta) * 1.0f;
            sn[i] = sinf(theta) * 1.0f;
            theta *= theta_scale;
        }
        for (int h = 0; h < heads; h++) {
            float *v = x + t * ldx + (int64_t)h * D;
            for (int i = 0; i < D / 2; i++) {
                const float x0 = v[i], x1 = v[i + D / 2], c = cs[i], s = sn[i];
                float r0, r1;
                if (contraction == 1) {
                    r0 = fmaf(x0, c, -(x1 * s));
                    r1 = fmaf(x0, s, x1 * c);
                } else if (contraction == 2) {
                    r0 = fmaf(-x1, s, x0 * c);
                    r1 = fmaf(x1, c, x0 * s);
                } else {
                    r0 = x0 * c - x1 * s;
                    r1 = x0 * s + x1 * c;
                }
                v[i] = r0;
                v[i + D / 2] = r1;
            }
        }
    }
    return 0;
}

/* ggml_v_expf of the AVX-512 build, one lane. */
static float expf_avx512(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    if (fabsf(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                              fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    return ldexpf(j, (int)n); /* _mm512_scalef_ps: j * 2^floor(n), n whole */
}

static float bits_f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t f_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ggml_v_expf of the AVX2 build, one lane. */
static float expf_avx2(float x) {
    const float r = 0x1.8p23f;
    const float z = fmaf(x, 0x1.715476p+0f, r);
    const float n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    const uint32_t e = f_bits(z) << 23;
    const float k = bits_f(e + f_bits(1.0f));
    const float u = b * b;
    const float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                              fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                         u, 0x1.ffffecp-1f * b);
    if (!(fabsf(n) > 126.0f)) return fmaf(j, k, k);
    const uint32_t g = n <= 0.0f ? 0x82000000u : 0u;
    const float s1 = bits_f(g + 0x7f000000u), s2 = bits_f(e - g);
    if (fabsf(n) > 192.0f) return s1 * s1;
    return fmaf(s2, j, s2) * s1;
}

static float vexp(int variant, float x) {
    return variant == GN_AVX512 ? expf_avx512(x) : expf_avx2(x);
}

/* y[m, i] = silu(gate) * up with gate = gu[m, i], up = gu[m, I + i] (ggml_vec_swiglu_f32;
 * a tail shorter than a vector uses the C library's expf, as ggml's scalar loop does). */
int gn_swiglu(int variant, const float *gu, int64_t ldgu, int64_t M, int64_t I, float *y,
              int64_t ldy) {
    const int64_t vec_end = I - I % lanes_of(variant);
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gu + m * ldgu, *u = g + I;
        for (int64_t i = 0; i < I; i++) {
            const float x = g[i];
            const float e = i < vec_end ? vexp(variant, 0.0f - x) : expf(-x);
            y[m * ldy + i] = x / (1.0f + e) * u[i];
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Attention */

/* Lane sums of one accumulator vector per the build: GCC's _mm512_reduce_add_ps (halving) for
 * AVX-512; GGML_F32x8_REDUCE's horizontal adds for AVX2's ggml_vec_dot_f16 (`hadd`), else the
 * halving hsum of tinyBLAS and the softmax. */
static float lane_sum(int variant, float *v, int hadd) {
    if (variant == GN_AVX512) return halving_sum(v, 16);
    return hadd ? hadd_sum8(v) : halving_sum(v, 8);
}

/* The 4 x L accumulators of ggml_vec_dot_f16 reduced: pairwise (0+2, 1+3, then the two), then
 * across lanes; the result widened to double, as ggml returns it (no tail: whole steps only). */
static float dot_f16_reduce(int variant, float acc[4][MAX_LANES]) {
    const int L = lanes_of(variant);
    float v[MAX_LANES];
    for (int l = 0; l < L; l++) v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    return (float)(double)lane_sum(variant, v, 1);
}

typedef struct {
    int variant, H, KVH, D, block_size;
    const float *q;
    int64_t ldq, blk_stride, tok_stride, head_stride, bt_stride, ldo, cap;
    const uint16_t *kc, *vc;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    float scale, *out;
} AttnJob;

/* One (query row, head): scores, softmax, weighted V, each in ggml's order of operations. */
static void attend_one(const AttnJob *j, int64_t th, float *w, float *acc) {
    const int L = lanes_of(j->variant), D = j->D, H = j->H;
    const int64_t t = th / H;
    const int h = (int)(th % H), kvh = h / (H / j->KVH);
    int r = 0;
    while (j->query_start_loc[r + 1] <= t) r++;
    const int64_t qlen = j->query_start_loc[r + 1] - j->query_start_loc[r];
    const int64_t pos = j->seq_lens[r] - qlen + (t - j->query_start_loc[r]);
    const int prompt = qlen > 1, nk = (int)(pos + 1);
    /* slots of the V accumulators: a key's lane (tinyBLAS), or its (vector, lane) of a dot step */
    const int slots = prompt ? L : 4 * L;
    const int32_t *bt = j->block_tables + r * j->bt_stride;
    /* q rounded to f16 (ggml's vec_dot_type), in ggml's order: its 2i is ours i, 2i+1 ours
     * i + D/2 (Pagoda un-permutes the GGUF's Q/K rows to rotate-half order) */
    float qg[1024], kg[1024];
    const float *qr = j->q + t * j->ldq + (int64_t)h * D;
    for (int i = 0; i < D / 2; i++) {
        qg[2 * i] = h2f(f2h(qr[i]));
        qg[2 * i + 1] = h2f(f2h(qr[i + D / 2]));
    }
    float mx = -INFINITY;
    for (int k = 0; k < nk; k++) {
        const uint16_t *kr = j->kc + (int64_t)bt[k / j->block_size] * j->blk_stride +
                             (k % j->block_size) * j->tok_stride + kvh * j->head_stride;
        for (int i = 0; i < D / 2; i++) {
            kg[2 * i] = h2f(kr[i]);
            kg[2 * i + 1] = h2f(kr[i + D / 2]);
        }
        float s;
        if (prompt) { /* tinyBLAS: one accumulator a lane, over the row */
            float a[MAX_LANES] = {0};
            for (int i = 0; i < D; i += L)
                for (int l = 0; l < L; l++) a[l] = fmaf(kg[i + l], qg[i + l], a[l]);
            s = lane_sum(j->variant, a, 0);
        } else { /* ggml_vec_dot_f16: 4 accumulators over steps of 4 vectors */
            float a[4][MAX_LANES] = {{0}};
            for (int i = 0; i < D; i += 4 * L)
                for (int v = 0; v < 4; v++)
                    for (int l = 0; l < L; l++)
                        a[v][l] = fmaf(kg[i + v * L + l], qg[i + v * L + l], a[v][l]);
            s = dot_f16_reduce(j->variant, a);
        }
        w[k] = s * j->scale; /* + the mask's 0 */
        mx = w[k] > mx ? w[k] : mx;
    }
    /* softmax: exp by whole vectors (masked lanes give 0), each vector's sum added in double */
    double sum = 0.0;
    for (int c = 0; c < nk; c += L) {
        float chunk[MAX_LANES];
        for (int l = 0; l < L; l++) {
            chunk[l] = c + l < nk ? vexp(j->variant, w[c + l] - mx) : 0.0f;
            if (c + l < nk) w[c + l] = chunk[l];
        }
        sum += (double)lane_sum(j->variant, chunk, 0);
    }
    const float inv = (float)(1.0 / sum);
    /* out = V^T w with w rounded to f16: each (slot, dim) accumulates its keys in key order,
     * which is ggml's order for every output dim (V's rows run along the keys) */
    for (int i = 0; i < slots * D; i++) acc[i] = 0.0f;
    for (int k = 0; k < nk; k++) {
        const float wk = h2f(f2h(w[k] * inv));
        const uint16_t *vr = j->vc + (int64_t)bt[k / j->block_size] * j->blk_stride +
                             (k % j->block_size) * j->tok_stride + kvh * j->head_stride;
        float *a = acc + (int64_t)(k % slots) * D;
        for (int d = 0; d < D; d++) a[d] = fmaf(h2f(vr[d]), wk, a[d]);
    }
    float *o = j->out + t * j->ldo + (int64_t)h * D;
    for (int d = 0; d < D; d++) {
        if (prompt) {
            float a[MAX_LANES];
            for (int l = 0; l < L; l++) a[l] = acc[l * D + d];
            o[d] = lane_sum(j->variant, a, 0);
        } else {
            float a[4][MAX_LANES];
            for (int v = 0; v < 4; v++)
                for (int l = 0; l < L; l++) a[v][l] = acc[(v * L + l) * D + d];
            o[d] = dot_f16_reduce(j->variant, a);
        }
    }
}

/* A run of (query row, head) items, with its scratch: scores (cap) and V accumulators. */
static void attend_items(void *p, int64_t i0, int64_t i1) {
    const AttnJob *j = p;
    float *w = malloc((size_t)(j->cap + 64 * j->D) * sizeof(float));
    if (!w) abort(); /* a few KB */
    for (int64_t i = i0; i < i1; i++) attend_one(j, i, w, w + j->cap);
    free(w);
}

/* Attention of every query row over the paged f16 cache ([blocks, block_size, kv_heads, D],
 * strides in elements), causal, `scale` applied to the scores: out[t, h*D + d]. q: [T, H*D] in
 * Hugging Face order (row stride ldq), RoPE applied, like the cached keys. A request whose
 * step has more than one query row is a prompt evaluated in one batch (tinyBLAS products),
 * one row a decode step (ggml_vec_dot_f16); keys past a request's position are masked in ggml,
 * exact zeros in its sums, and not read here. */
int gn_attention(int variant, const float *q, int64_t ldq, int H, int KVH, int D,
                 const uint16_t *kc, const uint16_t *vc, int64_t blk_stride, int64_t tok_stride,
                 int64_t head_stride, const int32_t *block_tables, int64_t bt_stride,
                 const int32_t *query_start_loc, const int32_t *seq_lens, int num_reqs,
                 int block_size, float scale, float *out, int64_t ldo, int nthreads) {
    const int L = lanes_of(variant);
    if (H % KVH != 0 || D % (4 * L) != 0 || D > 1024 || num_reqs < 1) return -1;
    int64_t cap = 0;
    for (int r = 0; r < num_reqs; r++) cap = seq_lens[r] > cap ? seq_lens[r] : cap;
    cap = (cap + 63) / 64 * 64;
    AttnJob j = {variant, H,  KVH,          D,          block_size, q,           ldq,
                 blk_stride, tok_stride, head_stride, bt_stride, ldo, cap, kc,
                 vc,      block_tables, query_start_loc, seq_lens, scale, out};
    parallel_range(attend_items, &j, query_start_loc[num_reqs] * H, 1, nthreads);
    return 0;
}
