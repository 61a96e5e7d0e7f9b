// Paged decode attention over an FP8 or a 16-bit KV cache with tensor-core dots (mma.sync
// m16n8k16: fp16 over an FP8 cache, the model's dtype over a bf16/fp16 cache).
//
// One CTA owns one (KV head, request, key segment); its warps take the segment's 16-key
// chunks in turn, each keeping its own online softmax, and merge through shared memory at the
// end. Each warp streams its chunks through a ring of STAGES shared-memory buffers with
// cp.async, so STAGES - 1 chunks per warp are in flight while it computes one: an fp8 key is
// half a bf16 one, and with one chunk in flight per warp the kernel read only ~2.4 TB/s (it
// waited on memory latency, as the Triton kernel does). The block table comes in 32 entries
// at a time, one per lane, and each chunk's block is shuffled out of them.
//
// Rows of the m16 tiles are the query heads of the KV head's group (G <= 8; rows 8-15 are
// zero), and the operands are laid out so that no lane needs another lane's bytes:
//   * Q K^T: the reduction runs over head dims, and which dim a k-slot of the mma holds is
//     free as long as q and K agree. Lane (g, t) holds dims [32t, 32t + 32) of key g (and
//     8 + g) in its B fragments, 32 contiguous bytes each: k-block kb, slot s <-> dim
//     32t + 4kb + s.
//     Each fp8 pair converts to an f16 pair with one `cvt.rn.f16x2.e4m3x2`.
//   * P V: the reduction runs over keys; the S accumulator of two n-tiles is already P's A
//     fragment (FlashAttention-2's register reuse). V's B fragment pairs keys (2t, 2t + 1)
//     of one dim: lane (g, t) loads dims [16g, 16g + 16) of keys 2t, 2t+1, 2t+8, 2t+9 (one
//     16-byte load each) and pairs their bytes with `prmt` before converting. n-tile j holds
//     dim 16g + j in column g, so the accumulator of lane (g, t) ends with dims 32t + j and
//     32t + 16 + j of query head g.
// Per 16 keys and warp: 16 + 16 mma, 48 conversions, 8 byte permutes, 8 16-byte loads.
// A 16-bit cache (KV16) needs no conversion: lane (g, t) reads 64 bytes of keys g and 8 + g,
// 32 bytes of keys 2t, 2t+1, 2t+8, 2t+9, and pairs V's halves with `prmt`.
//
// Compile-time constants (-D): G (queries per KV head, 1..8), WARPS, BLOCK_SIZE (a multiple
// of 16), E5M2 (0: e4m3), Q_BF16 (0: fp16 q and out), STAGES (>= 2, buffers per warp),
// KV16 (1: the cache holds q's dtype).
// Dynamic shared memory: WARPS * STAGES * CHUNK_BYTES (4096, or 8192 with KV16).

#define HEAD 128
#define NKB 8   // k-blocks of 16 head dims in Q K^T
#define NNT 16  // n-tiles of 8 head dims in P V
#if KV16
#define ROW_BYTES 256  // one key of one head
#else
#define ROW_BYTES 128
#endif
#define PIECES (ROW_BYTES / 16)        // 16-byte pieces of a row
#define CHUNK_BYTES (32 * ROW_BYTES)   // 16 keys of K, then of V
#define MMA_BF16 (KV16 && Q_BF16)      // dots in bf16 (else fp16)

typedef unsigned int u32;
typedef unsigned short u16;

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 x) {
  u32 r;
  u16 h = (u16)x;
#if E5M2
  asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(r) : "h"(h));
#else
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(h));
#endif
  return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// A pair of model-dtype q values (low half first) as an operand pair of the dots.
__device__ __forceinline__ u32 q_pair_operand(u32 w) {
#if Q_BF16 && !MMA_BF16
  return pack_f16x2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
#else
  return w;
#endif
}

__device__ __forceinline__ u16 f32_to_out(float x) {
  u16 r;
#if Q_BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
  return r;
}

// D (rows g, g+8) += A (a1 = a3 = 0: rows 8-15 empty) * B. z2, z3 carry the empty rows.
__device__ __forceinline__ void mma(float& d0, float& d1, float& z2, float& z3, u32 a0, u32 a2,
                                    u32 b0, u32 b1) {
  asm volatile(
#if MMA_BF16
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
#else
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
#endif
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d0), "+f"(d1), "+f"(z2), "+f"(z3)
      : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ld_stream(const unsigned char* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(u32 smem_addr, const unsigned char* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A chunk's rows keep their 16-byte pieces XOR-swizzled by row (piece k of row r at
// k ^ (r & 7)), so the 8 lanes of each shared-memory phase below read 8 different bank groups
// (with 128-byte rows; 256-byte rows still meet 2-way conflicts, which the reads can afford).
__device__ __forceinline__ int swz(int row, int piece) {
  return row * ROW_BYTES + 16 * (piece ^ (row & 7));
}

__device__ __forceinline__ u32 word(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
    pagoda_paged_decode(u16* out, const u16* q, const unsigned char* k_cache,
                        const unsigned char* v_cache, const int* block_tables,
                        const int* seq_lens, const int* query_start_loc, const float* k_scale,
                        const float* v_scale, float* segm_out, float* segm_max, float* segm_sum,
                        double qk_scale_d, int num_heads, int stride_q_tok, int stride_q_head,
                        int stride_o_tok, int stride_o_head, int stride_c_blk, int stride_c_slot,
                        int stride_c_head, int stride_bt) {
#if __CUDA_ARCH__ >= 900
  // A kernel launched as its programmatic dependent (the o_proj W4A16 GEMV, the segment
  // reduce) may start now; it waits for this one's end before reading the output. This one,
  // itself launched as a dependent where PDL is on (`pdl_enabled`), waits for the kernel
  // before it (the RoPE + cache write) before reading or writing anything. Both are no-ops in
  // a plain launch.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int kv_head = blockIdx.x, req = blockIdx.y, segm = blockIdx.z, nsegm = gridDim.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tok = query_start_loc[req];
  if (query_start_loc[req + 1] == tok) return;  // a request with no query rows
  const int seq_len = seq_lens[req];
  const int num_chunks = (seq_len + 15) >> 4;
  const int per_segm = (num_chunks + nsegm - 1) / nsegm;
  const int c_lo = segm * per_segm;
  const int c_hi = min(c_lo + per_segm, num_chunks);
  const float qk_scale = (float)qk_scale_d * k_scale[0];  // log2 domain, K's scale folded in

  // Q's A fragments: a0 = dims 32t + 4kb + {0, 1}, a2 = + {2, 3} of query head g.
  u32 qa0[NKB], qa2[NKB];
  if (g < G) {
    const uint4* qp = (const uint4*)(q + (long long)tok * stride_q_tok +
                                     (long long)(kv_head * G + g) * stride_q_head + 32 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // 8 model-dtype values = 2 k-blocks per load
      const uint4 w = qp[i];
      qa0[2 * i] = q_pair_operand(w.x);
      qa2[2 * i] = q_pair_operand(w.y);
      qa0[2 * i + 1] = q_pair_operand(w.z);
      qa2[2 * i + 1] = q_pair_operand(w.w);
    }
  } else {
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) qa0[kb] = qa2[kb] = 0u;
  }

  float acc[NNT][2];  // [j][0]: dim 32t + j, [j][1]: dim 32t + 16 + j of head g
#pragma unroll
  for (int j = 0; j < NNT; ++j) acc[j][0] = acc[j][1] = 0.f;
  float z2 = 0.f, z3 = 0.f;  // the empty rows 8-15 of every accumulator
  float m_i = NEG_INF, l_i = 0.f;  // l_i: this lane's share of row g's sum

  const int* bt_row = block_tables + (long long)req * stride_bt;
  const long long head_off = (long long)kv_head * stride_c_head;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* ring = smem + warp * (STAGES * CHUNK_BYTES);
  const u32 ring_s = (u32)__cvta_generic_to_shared(ring);
  // Iteration i of this warp handles chunk c_lo + warp + i * WARPS.
  const int n_iter = c_hi - c_lo - warp > 0 ? (c_hi - c_lo - warp + WARPS - 1) / WARPS : 0;
  int bt_reg = 0, bt_base = -64;  // lane L holds the block of iteration bt_base + L

  auto issue = [&](int i) {  // start the copies of iteration i's chunk into its stage
    if (i < n_iter) {
      if (i >= bt_base + 32) {
        bt_base = i;
        const int ci = c_lo + warp + (i + lane) * WARPS;
        bt_reg = ci < c_hi ? bt_row[(ci << 4) / BLOCK_SIZE] : 0;
      }
      const int blk = __shfl_sync(0xffffffffu, bt_reg, i - bt_base);
      const int c = c_lo + warp + i * WARPS;
      const long long base = (long long)blk * stride_c_blk +
                             (long long)((c << 4) % BLOCK_SIZE) * stride_c_slot + head_off;
      const u32 st = ring_s + (i % STAGES) * CHUNK_BYTES;
      const int piece = lane % PIECES;
#pragma unroll
      for (int r = 0; r < 16 * PIECES / 32; ++r) {
        const int row = lane / PIECES + (32 / PIECES) * r;
        const long long off = base + (long long)row * stride_c_slot + 16 * piece;
        cp_async16(st + swz(row, piece), k_cache + off);
        cp_async16(st + 16 * ROW_BYTES + swz(row, piece), v_cache + off);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the count uniform
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);

  for (int i = 0; i < n_iter; ++i) {
    cp_async_wait<STAGES - 2>();  // iteration i's copies (this lane's) are done
    __syncwarp();                 // ... and every lane's; stage (i - 1) % STAGES is free
    issue(i + STAGES - 1);
    const int pos0 = (c_lo + warp + i * WARPS) << 4;
    const unsigned char* kst = ring + (i % STAGES) * CHUNK_BYTES;
    const unsigned char* vst = kst + 16 * ROW_BYTES;
    // K: keys g and 8 + g, dims [32t, 32t + 32); V: keys 2t, 2t+1, 2t+8, 2t+9, dims [16g, 16g+16).
    constexpr int KP = PIECES / 4, VP = PIECES / 8;  // pieces per lane and key
    uint4 kk[2 * KP], vv[4 * VP];
#pragma unroll
    for (int p = 0; p < KP; ++p) {
      kk[p] = *(const uint4*)(kst + swz(g, KP * t + p));
      kk[KP + p] = *(const uint4*)(kst + swz(8 + g, KP * t + p));
    }
#pragma unroll
    for (int p = 0; p < VP; ++p) {
      vv[p] = *(const uint4*)(vst + swz(2 * t, VP * g + p));
      vv[VP + p] = *(const uint4*)(vst + swz(2 * t + 1, VP * g + p));
      vv[2 * VP + p] = *(const uint4*)(vst + swz(2 * t + 8, VP * g + p));
      vv[3 * VP + p] = *(const uint4*)(vst + swz(2 * t + 9, VP * g + p));
    }
    // S = Q K^T for keys 0-7 (s0) and 8-15 (s1) of the chunk.
    float s0a = 0.f, s0b = 0.f, s1a = 0.f, s1b = 0.f;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) {
#if KV16  // dims 32t + 4kb + {0, 1} and {2, 3}: words 2kb, 2kb + 1 of the lane's 64 bytes
      const u32 b00 = word(kk[kb >> 1], (2 * kb) & 3), b01 = word(kk[kb >> 1], (2 * kb + 1) & 3);
      const u32 b10 = word(kk[KP + (kb >> 1)], (2 * kb) & 3);
      const u32 b11 = word(kk[KP + (kb >> 1)], (2 * kb + 1) & 3);
#else  // dims 32t + 4kb + {0..3}: word kb of the lane's 32 bytes, two fp8 pairs
      const u32 w0 = word(kk[kb >> 2], kb & 3), w1 = word(kk[KP + (kb >> 2)], kb & 3);
      const u32 b00 = fp8x2_to_f16x2(w0), b01 = fp8x2_to_f16x2(w0 >> 16);
      const u32 b10 = fp8x2_to_f16x2(w1), b11 = fp8x2_to_f16x2(w1 >> 16);
#endif
      mma(s0a, s0b, z2, z3, qa0[kb], qa2[kb], b00, b01);
      mma(s1a, s1b, z2, z3, qa0[kb], qa2[kb], b10, b11);
    }
    // Lane (g, t) holds keys 2t, 2t + 1, 8 + 2t, 9 + 2t of row g.
    const int p0 = pos0 + 2 * t;
    float x0 = p0 < seq_len ? s0a * qk_scale : NEG_INF;
    float x1 = p0 + 1 < seq_len ? s0b * qk_scale : NEG_INF;
    float x2 = p0 + 8 < seq_len ? s1a * qk_scale : NEG_INF;
    float x3 = p0 + 9 < seq_len ? s1b * qk_scale : NEG_INF;
    float mx = fmaxf(fmaxf(x0, x1), fmaxf(x2, x3));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_i, mx);  // finite: key pos0 < seq_len is in the chunk
    const float alpha = exp2f(m_i - m_new);
    x0 = exp2f(x0 - m_new);
    x1 = exp2f(x1 - m_new);
    x2 = exp2f(x2 - m_new);
    x3 = exp2f(x3 - m_new);
    l_i = l_i * alpha + ((x0 + x1) + (x2 + x3));
    m_i = m_new;
#if MMA_BF16
    const u32 pa0 = pack_bf16x2(x0, x1), pa2 = pack_bf16x2(x2, x3);
#else
    const u32 pa0 = pack_f16x2(x0, x1), pa2 = pack_f16x2(x2, x3);
#endif
    // Keys past the end read stale slots of the same block: zero their V (NaN * 0 = NaN).
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
#pragma unroll
    for (int p = 0; p < VP; ++p) {
      if (p0 >= seq_len) vv[p] = zero;
      if (p0 + 1 >= seq_len) vv[VP + p] = zero;
      if (p0 + 8 >= seq_len) vv[2 * VP + p] = zero;
      if (p0 + 9 >= seq_len) vv[3 * VP + p] = zero;
    }
#pragma unroll
    for (int j = 0; j < NNT; ++j) {  // dim 16g + j of keys (2t, 2t + 1) and (2t + 8, 2t + 9)
      acc[j][0] *= alpha;
      acc[j][1] *= alpha;
#if KV16  // dim j is half (j & 1) of word j >> 1
      const int w = j >> 1, p = w >> 2;
      const u32 sel = (j & 1) ? 0x7632 : 0x5410;
      const u32 b0 = __byte_perm(word(vv[p], w & 3), word(vv[VP + p], w & 3), sel);
      const u32 b1 = __byte_perm(word(vv[2 * VP + p], w & 3), word(vv[3 * VP + p], w & 3), sel);
#else  // dim j is byte (j & 3) of word j >> 2: pair the bytes, then convert
      const int w = j >> 2;
      const u32 sel = (j & 2) ? 0x7362 : 0x5140, sh = (j & 1) * 16;
      const u32 b0 = fp8x2_to_f16x2(__byte_perm(word(vv[0], w), word(vv[1], w), sel) >> sh);
      const u32 b1 = fp8x2_to_f16x2(__byte_perm(word(vv[2], w), word(vv[3], w), sel) >> sh);
#endif
      mma(acc[j][0], acc[j][1], z2, z3, pa0, pa2, b0, b1);
    }
  }
  l_i += __shfl_xor_sync(0xffffffffu, l_i, 1);
  l_i += __shfl_xor_sync(0xffffffffu, l_i, 2);

  // Merge the warps: each writes (max, sum, acc) of its rows, then every thread combines a
  // slice of 8 consecutive dims of one row. Dim d of a row lives at [d / 32][d % 32] of
  // 33-float rows, so the 32 lanes' stores of one j fall in 32 different banks.
  // The merge area reuses the ring once every warp is done with it.
  cp_async_wait<0>();
  __syncthreads();
  float(*sm_m)[8] = (float(*)[8])smem;
  float(*sm_l)[8] = (float(*)[8])(smem + WARPS * 8 * 4);
  float(*sm_acc)[8][4][33] = (float(*)[8][4][33])(smem + WARPS * 16 * 4);
  if (t == 0) {
    sm_m[warp][g] = m_i;
    sm_l[warp][g] = l_i;
  }
#pragma unroll
  for (int j = 0; j < NNT; ++j) {
    sm_acc[warp][g][t][j] = acc[j][0];
    sm_acc[warp][g][t][16 + j] = acc[j][1];
  }
  __syncthreads();
  const float vs = v_scale[0];
  for (int slice = threadIdx.x; slice < G * (HEAD / 8); slice += WARPS * 32) {
    const int row = slice / (HEAD / 8), d0 = (slice % (HEAD / 8)) * 8;
    float m_all = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, sm_m[w][row]);
    float l_all = 0.f, o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float e = sm_m[w][row] == NEG_INF ? 0.f : exp2f(sm_m[w][row] - m_all);
      l_all += sm_l[w][row] * e;
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] += sm_acc[w][row][d0 >> 5][(d0 & 31) + i] * e;
    }
    const int head = kv_head * G + row;
    if (nsegm > 1) {
      const long long r = ((long long)tok * num_heads + head) * nsegm + segm;
      if (d0 == 0) {
        segm_max[r] = m_all;
        segm_sum[r] = l_all;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) segm_out[r * HEAD + d0 + i] = o[i] * vs;
    } else {
      const float inv = l_all > 0.f ? vs / l_all : 0.f;
      u32 packed[4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        packed[i] = (u32)f32_to_out(o[2 * i] * inv) | ((u32)f32_to_out(o[2 * i + 1] * inv) << 16);
      uint4 o4;
      o4.x = packed[0];
      o4.y = packed[1];
      o4.z = packed[2];
      o4.w = packed[3];
      *(uint4*)(out + (long long)tok * stride_o_tok + (long long)head * stride_o_head + d0) = o4;
    }
  }
}
