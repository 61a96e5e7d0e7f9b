/* A Llama-family decoder stack run in one call on CPU: what `LlamaModel.forward` does for the
 * decoder layers and the final norm, with the same kernels in the same order, minus the Python
 * and torch dispatch between them (at decode on a small model that dispatch, ~10 calls a layer,
 * costs as much as the arithmetic). A step's rows may be decodes and prompt chunks alike: the
 * attention work items say which query rows see which keys.
 *
 * The kernels stay in their own libraries (cpu_ops.c, quant_gemm.c, paged_attention.c); the
 * loader hands their entry points over as function pointers, so this file holds no arithmetic.
 * Per layer, with R the residual stream and X the layer's input:
 *
 *     X, R  = rms_norm(X + R) * input_norm      (layer 0: R = X, X = rms_norm(X) * w)
 *     QKV   = X @ Wqkv^T (+ b)                   q/k RMSNorm per head where the model has it
 *     rope(q, k); cache[slot] = k, v; A = paged_attention(q, cache)
 *     O     = A @ Wo^T (+ b);  O, R = rms_norm(O + R) * post_norm
 *     D     = silu_and_mul(O @ Wgate_up^T) @ Wdown^T
 *
 * and after the last layer X = rms_norm(D + R) * final_norm. A linear layer is up to four
 * parts side by side in its output (a fused layer whose shards differ in GGUF type), each a
 * quantized GEMM, a packed bf16 GEMM or the skinny GEMM on a plain weight; a layer may read its
 * inputs through a permutation (a GPTQ act-order layer's, inputs sorted by group). */
#include <stdint.h>
#include <string.h>

typedef int (*quant_gemm_fn)(const void *x, int64_t x_stride, int x_bf16, const uint8_t *w,
                             int64_t w_stride, int type, int x8, const float *bias, void *y,
                             int64_t y_stride, int y_bf16, int64_t M, int64_t N, int64_t K,
                             int nthreads);
typedef int (*gemv_fn)(const void *x, int64_t x_stride, const void *w, const void *bias, void *y,
                       int64_t y_stride, int y_fp32, int64_t M, int64_t N, int64_t K, int dt,
                       int nthreads);
typedef int (*gemm_packed_fn)(const void *x, int64_t x_stride, const void *w, const void *bias,
                              void *y, int64_t y_stride, int y_fp32, int64_t M, int64_t N,
                              int64_t K, int nthreads);
typedef int (*rms_norm_fn)(const void *x, int64_t x_stride, void *res, int64_t res_stride,
                           const void *w, void *out, int64_t out_stride, int64_t rows,
                           int64_t cols, float eps, int dt, int w_dt, int nthreads);
typedef int (*silu_and_mul_fn)(const void *x, int64_t x_stride, void *out, int64_t out_stride,
                               int64_t rows, int64_t d, int dt, int nthreads);
typedef int (*rope_fn)(const int64_t *positions, void *q, int64_t q_stride, int num_heads, void *k,
                       int64_t k_stride, int num_kv_heads, int head_size, int rot,
                       const float *cos_sin_cache, int64_t max_position, int64_t tokens, int dt,
                       int nthreads);
typedef int (*attention_fn)(void *out, const void *q, int64_t q_stride_token,
                            int64_t q_stride_head, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, int64_t block_table_stride,
                            const int32_t *seq_lens, const int32_t *query_start_loc,
                            const int32_t *items, int32_t num_items, int32_t num_heads,
                            int32_t num_kv_heads, int32_t head_size, int32_t block_size,
                            int32_t dtype, int32_t cache_dtype, float scale, float k_scale,
                            float v_scale, int32_t sliding_window, float soft_cap,
                            int32_t num_threads);
typedef int (*write_kv_fn)(const void *k, const void *v, int64_t row_stride, int32_t dtype,
                           void *k_cache, void *v_cache, int32_t cache_dtype, const int64_t *slots,
                           int64_t rows, int64_t width, float k_scale, float v_scale);

enum { DT_F32 = 0, DT_BF16 = 1 };
enum { PART_QUANT = 0, PART_PACKED = 1, PART_GEMV = 2 };
#define MAX_PARTS 4

/* The structs mirror ctypes.Structure classes in decoder.py: change both together. */
typedef struct {
    int32_t kind, ggml_type, x8, pad;
    const void *w;
    int64_t w_stride; /* bytes between rows (groups of 8 rows with x8) of a quantized weight */
    const void *bias; /* fp32 for a quantized part, the model dtype otherwise; or NULL */
    int64_t col, n;   /* the part's first output column and its column count */
} Part;

typedef struct {
    int32_t num_parts, pad;
    int64_t n, k;
    const int64_t *perm; /* [k] or NULL: the layer reads x[:, perm] (GPTQ act order) */
    Part parts[MAX_PARTS];
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const void *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL unless present */
    void *k_cache, *v_cache; /* [num_blocks * block_size, num_kv_heads, head_size] each, in
                              * the cache dtype (the model dtype, 16 bits under float32, or
                              * fp8 e5m2 holding k / k_scale, v / v_scale) */
    int32_t sliding_window;
    float k_scale, v_scale;
    int32_t pad;
} Layer;

typedef struct {
    quant_gemm_fn quant_gemm;
    gemv_fn gemv;
    gemm_packed_fn gemm_packed;
    rms_norm_fn rms_norm;
    silu_and_mul_fn silu_and_mul;
    rope_fn rope;
    attention_fn attention;
    write_kv_fn write_kv;
    const Layer *layers;
    const void *final_norm;
    const float *cos_sin;
    int64_t max_position;
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_size, inter, rot, block_size;
    int32_t dt, norm_dt, cache_dt, pad;
    float eps, scale;
} Decoder;

typedef struct {
    int64_t rows;
    const int64_t *positions, *slots; /* [rows] */
    const int32_t *block_tables, *seq_lens, *query_start_loc, *items;
    int64_t block_table_stride;
    int32_t num_items, threads, attention_threads, pad;
    /* Buffers, `rows` rows each: x (in: the embeddings; out: the final hidden states),
     * residual, qkv, attn, gate_up (2 * inter columns; its first `inter` take silu_and_mul's
     * output, which the down projection reads with the row stride of gate_up) */
    void *x, *residual, *qkv, *attn, *gate_up;
    void *gathered; /* rows * (the largest k of a layer with perm) elements, or NULL */
} Step;

/* y [rows, lin->n] = x [rows, lin->k] (rows x_stride elements apart) @ W^T (+ bias); with
 * lin->perm, x[:, perm] gathered into `gathered` first. */
static int linear(const Decoder *d, const Linear *lin, const void *x, int64_t x_stride, void *y,
                  int64_t rows, int nthreads, void *gathered) {
    const int64_t es = d->dt == DT_BF16 ? 2 : 4;
    if (lin->perm != NULL) {
        if (gathered == NULL) return -1;
        for (int64_t r = 0; r < rows; r++) {
            const char *src = (const char *)x + r * x_stride * es;
            char *dst = (char *)gathered + r * lin->k * es;
            if (es == 2)
                for (int64_t j = 0; j < lin->k; j++)
                    ((uint16_t *)dst)[j] = ((const uint16_t *)src)[lin->perm[j]];
            else
                for (int64_t j = 0; j < lin->k; j++)
                    ((uint32_t *)dst)[j] = ((const uint32_t *)src)[lin->perm[j]];
        }
        x = gathered;
        x_stride = lin->k;
    }
    for (int i = 0; i < lin->num_parts; i++) {
        const Part *p = &lin->parts[i];
        char *out = (char *)y + p->col * es;
        int rc;
        if (p->kind == PART_QUANT)
            rc = d->quant_gemm(x, x_stride, d->dt == DT_BF16, p->w, p->w_stride, p->ggml_type, p->x8,
                               p->bias, out, lin->n, d->dt == DT_BF16, rows, p->n, lin->k,
                               nthreads);
        else if (p->kind == PART_PACKED)
            rc = d->gemm_packed(x, x_stride, p->w, p->bias, out, lin->n, 0, rows, p->n, lin->k,
                                nthreads);
        else
            rc = d->gemv(x, x_stride, p->w, p->bias, out, lin->n, 0, rows, p->n, lin->k, d->dt,
                         nthreads);
        if (rc != 0) return rc;
    }
    return 0;
}

#define CHECK(call)                                                                                \
    do {                                                                                           \
        const int rc_ = (call);                                                                    \
        if (rc_ != 0) return rc_;                                                                  \
    } while (0)

/* A position outside the rotary table (the only error a valid model's step can meet). */
#define ROPE_POSITION_ERROR (-100)

/* Returns 0, ROPE_POSITION_ERROR, or the first non-zero code a kernel returned. */
int pagoda_decoder_run(const Decoder *d, const Step *s) {
    const int64_t M = s->rows, H = d->hidden, hd = d->head_size, dt = d->dt;
    const int64_t es = dt == DT_BF16 ? 2 : 4;
    const int64_t q_cols = (int64_t)d->num_heads * hd, kv_cols = (int64_t)d->num_kv_heads * hd;
    const int64_t qkv_cols = q_cols + 2 * kv_cols, gu_cols = 2 * (int64_t)d->inter;
    const int nt = s->threads;
    char *x = s->x, *res = s->residual, *qkv = s->qkv, *attn = s->attn, *gu = s->gate_up;
    if (M <= 0) return 0;
    for (int l = 0; l < d->num_layers; l++) {
        const Layer *L = &d->layers[l];
        if (l == 0) {
            memcpy(res, x, (size_t)(M * H * es));
            CHECK(d->rms_norm(x, H, NULL, 0, L->input_norm, x, H, M, H, d->eps, dt, d->norm_dt,
                              nt));
        } else {
            CHECK(d->rms_norm(x, H, res, H, L->input_norm, x, H, M, H, d->eps, dt, d->norm_dt,
                              nt));
        }
        CHECK(linear(d, &L->qkv, x, H, qkv, M, nt, s->gathered));
        if (L->q_norm != NULL) { /* per head, in place: rows of head_size */
            for (int64_t t = 0; t < M; t++) {
                char *row = qkv + t * qkv_cols * es;
                CHECK(d->rms_norm(row, hd, NULL, 0, L->q_norm, row, hd, d->num_heads, hd, d->eps,
                                  dt, d->norm_dt, 1));
                CHECK(d->rms_norm(row + q_cols * es, hd, NULL, 0, L->k_norm, row + q_cols * es, hd,
                                  d->num_kv_heads, hd, d->eps, dt, d->norm_dt, 1));
            }
        }
        if (d->rope(s->positions, qkv, qkv_cols, d->num_heads, qkv + q_cols * es, qkv_cols,
                    d->num_kv_heads, (int)hd, d->rot, d->cos_sin, d->max_position, M, (int)dt,
                    nt) != 0)
            return ROPE_POSITION_ERROR; /* layer 0 fails before any cache write */
        CHECK(d->write_kv(qkv + q_cols * es, qkv + (q_cols + kv_cols) * es, qkv_cols, (int32_t)dt,
                          L->k_cache, L->v_cache, d->cache_dt, s->slots, M, kv_cols,
                          L->k_scale, L->v_scale));
        CHECK(d->attention(attn, qkv, qkv_cols, hd, L->k_cache, L->v_cache, s->block_tables,
                           s->block_table_stride, s->seq_lens, s->query_start_loc, s->items,
                           s->num_items, d->num_heads, d->num_kv_heads, (int32_t)hd,
                           d->block_size, (int32_t)dt, d->cache_dt, d->scale, L->k_scale,
                           L->v_scale, L->sliding_window, 0.0f, s->attention_threads));
        CHECK(linear(d, &L->o, attn, q_cols, x, M, nt, s->gathered));
        CHECK(d->rms_norm(x, H, res, H, L->post_norm, x, H, M, H, d->eps, dt, d->norm_dt, nt));
        CHECK(linear(d, &L->gate_up, x, H, gu, M, nt, s->gathered));
        CHECK(d->silu_and_mul(gu, gu_cols, gu, gu_cols, M, d->inter, (int)dt, nt));
        CHECK(linear(d, &L->down, gu, gu_cols, x, M, nt, s->gathered));
    }
    return d->rms_norm(x, H, res, H, d->final_norm, x, H, M, H, d->eps, dt, d->norm_dt, nt);
}

int pagoda_decoder_abi(void) { return 5; }
