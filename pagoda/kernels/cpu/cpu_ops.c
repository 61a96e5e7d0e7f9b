/* CPU ops of a Llama block: the bf16 GEMM of the linear layers on pre-packed weights (gemm.h),
 * the skinny GEMM on plain weights for decode (gemv.h: float32 models, unpacked weights) and
 * the element-wise ops between them, each one pass over its rows in a single call: residual
 * add + RMSNorm, SiLU-and-mul, and neox-style RoPE in place on q and k.
 *
 * The element-wise ops round where the torch references in `pagoda.kernels.reference` round
 * (bf16 models: the residual sum, the normalised value, silu's output; statistics and RoPE in
 * fp32), so they agree with them to one bf16 ulp. Rows are addressed by a stride (in elements),
 * so views into a fused projection's output (q and k inside qkv) need no copy. Large inputs
 * (prefill) are split over threads by rows (the pool, pool.c, or OpenMP: simd.h's
 * parallel_range); a decode's few rows run on the calling thread, where a fork/join would cost
 * more than the work. Every entry point returns 0, or -1
 * for arguments it does not handle (the Python side checks first; this is a last guard).
 *
 * One source for every ISA level (simd.h): the build helper compiles it once per level with
 * that level's -m flags, and the vector code becomes AVX-512, AVX2 or baseline SSE2 / NEON. */
#include "gemm.h"
#include "gemv.h"

#define PAGODA_CPU_OPS_ABI 5

int pagoda_cpu_ops_abi(void) { return PAGODA_CPU_OPS_ABI; }

/* The pool's pagoda_parallel_run (pool.c), or NULL for OpenMP regions (simd.h). */
void pagoda_cpu_ops_set_parallel_run(parallel_run_fn fn) { parallel_run = fn; }

/* The ISA level the library was compiled for (simd.h), so the loader can check it got the
 * build it asked for. */
int pagoda_cpu_ops_isa(void) { return PAGODA_ISA; }

/* x, w and bias share the dtype `dt`; y is that dtype, or fp32 when `y_fp32`. */
int pagoda_gemv(const void *x, int64_t x_stride, const void *w, const void *bias, void *y,
                int64_t y_stride, int y_fp32, int64_t M, int64_t N, int64_t K, int dt,
                int nthreads) {
    if ((dt != DT_F32 && dt != DT_BF16) || M < 0 || N < 0 || K <= 0 || x_stride < K ||
        y_stride < N)
        return -1;
    GemvArgs a = {x, x_stride, w, bias, y, y_stride, y_fp32, M, N, K};
    if (M > 0 && N > 0) gemv(&a, dt, nthreads);
    return 0;
}

/* bf16 x and bias against a weight packed by `pack_weight` (gemm.h); y bf16, or fp32 when
 * `y_fp32`. */
int pagoda_gemm_packed(const void *x, int64_t x_stride, const void *w_packed, const void *bias,
                       void *y, int64_t y_stride, int y_fp32, int64_t M, int64_t N, int64_t K,
                       int nthreads) {
    if (M < 0 || N < 0 || K <= 0 || x_stride < K || y_stride < N) return -1;
    GemmArgs a = {x, x_stride, NULL, 0, w_packed, bias, y, y_stride, y_fp32, M, N, K};
    if (M > 0 && N > 0) return gemm_packed(&a, nthreads) == 0 ? 0 : -2;
    return 0;
}

/* Whether the packed GEMM's AMX tiles (gemm_amx.h) run here: built in and granted by the OS. */
int pagoda_gemm_amx(void) {
#if HAVE_AMX
    return amx_usable();
#else
    return 0;
#endif
}

/* The row count from which the packed GEMM takes the AMX tiles; returns the previous one, or
 * -1 where there are no tiles (for tests and tuning: a huge count keeps the register path). */
int pagoda_gemm_set_amx_min_rows(int rows) {
#if HAVE_AMX
    int old = amx_min_rows;
    amx_min_rows = rows < 1 ? 1 : rows;
    return old;
#else
    (void)rows;
    return -1;
#endif
}

/* ---- RMSNorm (Zhang & Sennrich, 2019) with the residual add fused ---------------------- */
/* With `res`: res <- x + res (rounded to the dtype), out <- w * norm(res). Without: out <- w *
 * norm(x). `out` may be `x` (in place). The weight has its own dtype `w_dt`. */
/* Pass 1 over a row: h = x (+ res, rounded and written back to res), returns sum(h^2) as
 * lanes. */
INLINE vf rms_sum_squares(const char *x, char *res, int64_t cols, const int dt) {
    const int es = dt == DT_BF16 ? 2 : 4;
    vf ss = splat(0.0f);
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) {
        vf v = load_vec(x + c * es, dt);
        if (res) {
            v = round_to(v + load_vec(res + c * es, dt), dt);
            store_vec(res + c * es, v, dt);
        }
        ss += v * v;
    }
    if (c < cols) {
        vf v = load_part(x + c * es, dt, cols - c);
        if (res) {
            v = round_to(v + load_part(res + c * es, dt, cols - c), dt);
            store_part(res + c * es, v, dt, cols - c);
        }
        ss += v * v;
    }
    return ss;
}

static void rms_norm_row(const char *x, char *res, const char *w, char *out, int64_t cols,
                         float eps, const int dt, int w_dt) {
    const int es = dt == DT_BF16 ? 2 : 4, ws = w_dt == DT_BF16 ? 2 : 4;
    const vf ss = rms_sum_squares(x, res, cols, dt);
    const vf rstd = splat(1.0f / sqrtf(hsum(ss) / (float)cols + eps));
    const char *h = res ? res : x;
    int64_t c = 0;
    for (; c + VL <= cols; c += VL) {
        vf v = round_to(load_vec(h + c * es, dt) * rstd, dt);
        store_vec(out + c * es, v * load_vec(w + c * ws, w_dt), dt);
    }
    if (c < cols) {
        vf v = round_to(load_part(h + c * es, dt, cols - c) * rstd, dt);
        store_part(out + c * es, v * load_part(w + c * ws, w_dt, cols - c), dt, cols - c);
    }
}

typedef struct {
    const char *x, *w;
    char *res, *out;
    int64_t x_stride, res_stride, out_stride, cols;
    float eps;
    int dt, w_dt;
} RmsNormJob;

static void rms_norm_rows(void *p, int64_t begin, int64_t end) {
    const RmsNormJob *j = p;
    const int64_t es = j->dt == DT_BF16 ? 2 : 4;
    for (int64_t r = begin; r < end; r++) {
        char *rr = j->res ? j->res + r * j->res_stride * es : NULL;
        const char *xr = j->x + r * j->x_stride * es;
        char *orow = j->out + r * j->out_stride * es;
        if (j->dt == DT_BF16) rms_norm_row(xr, rr, j->w, orow, j->cols, j->eps, DT_BF16, j->w_dt);
        else rms_norm_row(xr, rr, j->w, orow, j->cols, j->eps, DT_F32, j->w_dt);
    }
}

int pagoda_rms_norm(const void *x, int64_t x_stride, void *res, int64_t res_stride, const void *w,
                    void *out, int64_t out_stride, int64_t rows, int64_t cols, float eps, int dt,
                    int w_dt, int nthreads) {
    if ((dt != DT_F32 && dt != DT_BF16) || (w_dt != DT_F32 && w_dt != DT_BF16)) return -1;
    const int64_t es = dt == DT_BF16 ? 2 : 4;
    RmsNormJob j = {x, w, res, out, x_stride, res_stride, out_stride, cols, eps, dt, w_dt};
    parallel_range(rms_norm_rows, &j, rows, 1, pick_threads(nthreads, rows, cols * es * 3));
    return 0;
}

/* ---- SwiGLU's gate (Shazeer, 2020): out = silu(x[:, :d]) * x[:, d:] --------------------- */
INLINE vf silu_times(vf g, vf u, int dt) { return round_to(g * vrecip(vexp(-g) + 1.0f), dt) * u; }

static void silu_and_mul_row(const char *x, char *out, int64_t d, const int dt) {
    const int es = dt == DT_BF16 ? 2 : 4;
    const char *up = x + d * es;
    int64_t c = 0;
    for (; c + VL <= d; c += VL)
        store_vec(out + c * es, silu_times(load_vec(x + c * es, dt), load_vec(up + c * es, dt), dt),
                  dt);
    if (c < d) {
        vf g = load_part(x + c * es, dt, d - c), u = load_part(up + c * es, dt, d - c);
        store_part(out + c * es, silu_times(g, u, dt), dt, d - c);
    }
}

typedef struct {
    const char *x;
    char *out;
    int64_t x_stride, out_stride, d;
    int dt;
} SiluJob;

static void silu_and_mul_rows(void *p, int64_t begin, int64_t end) {
    const SiluJob *j = p;
    const int64_t es = j->dt == DT_BF16 ? 2 : 4;
    for (int64_t r = begin; r < end; r++) {
        const char *xr = j->x + r * j->x_stride * es;
        char *orow = j->out + r * j->out_stride * es;
        if (j->dt == DT_BF16) silu_and_mul_row(xr, orow, j->d, DT_BF16);
        else silu_and_mul_row(xr, orow, j->d, DT_F32);
    }
}

int pagoda_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride,
                        int64_t rows, int64_t d, int dt, int nthreads) {
    if (dt != DT_F32 && dt != DT_BF16) return -1;
    const int64_t es = dt == DT_BF16 ? 2 : 4;
    SiluJob j = {x, out, x_stride, out_stride, d, dt};
    parallel_range(silu_and_mul_rows, &j, rows, 1, pick_threads(nthreads, rows, d * es * 3));
    return 0;
}

/* ---- Rotary embedding (Su et al., 2021), GPT-NeoX / rotate_half layout ------------------ */
/* Heads of one token: the first `rot` dims of each head, halves (x1, x2), become
 * (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, rounded once to the dtype. */
static void rope_heads(char *x, int heads, int head_size, int rot, const float *cos_sin,
                       const int dt) {
    const int es = dt == DT_BF16 ? 2 : 4, half = rot / 2;
    for (int h = 0; h < heads; h++) {
        char *p = x + (int64_t)h * head_size * es, *p2 = p + (int64_t)half * es;
        for (int c = 0; c < half; c += VL) {
            vf x1 = load_at(p, dt, c, half), x2 = load_at(p2, dt, c, half);
            vf cs = load_at((const char *)cos_sin, DT_F32, c, half);
            vf sn = load_at((const char *)(cos_sin + half), DT_F32, c, half);
            store_at(p, x1 * cs - x2 * sn, dt, c, half);
            store_at(p2, x2 * cs + x1 * sn, dt, c, half);
        }
    }
}

typedef struct {
    const int64_t *positions;
    char *q, *k;
    int64_t q_stride, k_stride;
    int num_heads, num_kv_heads, head_size, rot, dt;
    const float *cos_sin;
} RopeJob;

static void rope_tokens(void *p, int64_t begin, int64_t end) {
    const RopeJob *j = p;
    const int64_t es = j->dt == DT_BF16 ? 2 : 4;
    for (int64_t t = begin; t < end; t++) {
        const float *cs = j->cos_sin + j->positions[t] * j->rot;
        char *qt = j->q + t * j->q_stride * es;
        char *kt = j->k ? j->k + t * j->k_stride * es : NULL;
        if (j->dt == DT_BF16) {
            rope_heads(qt, j->num_heads, j->head_size, j->rot, cs, DT_BF16);
            if (kt) rope_heads(kt, j->num_kv_heads, j->head_size, j->rot, cs, DT_BF16);
        } else {
            rope_heads(qt, j->num_heads, j->head_size, j->rot, cs, DT_F32);
            if (kt) rope_heads(kt, j->num_kv_heads, j->head_size, j->rot, cs, DT_F32);
        }
    }
}

int pagoda_rotary_embedding(const int64_t *positions, void *q, int64_t q_stride, int num_heads,
                            void *k, int64_t k_stride, int num_kv_heads, int head_size, int rot,
                            const float *cos_sin_cache, int64_t max_position, int64_t tokens,
                            int dt, int nthreads) {
    if ((dt != DT_F32 && dt != DT_BF16) || rot > head_size || rot % 2) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position) return -1;
    const int64_t es = dt == DT_BF16 ? 2 : 4;
    RopeJob j = {positions, q, k, q_stride, k_stride, num_heads, num_kv_heads, head_size, rot, dt,
                 cos_sin_cache};
    int nt = pick_threads(nthreads, tokens, (int64_t)(num_heads + num_kv_heads) * head_size * es);
    parallel_range(rope_tokens, &j, tokens, 1, nt);
    return 0;
}
