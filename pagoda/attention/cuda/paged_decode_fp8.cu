// Paged decode attention over an FP8 KV cache, fp16 tensor-core dots (mma.sync m16n8k16).
//
// One CTA owns one (KV head, request, key segment); its warps take the segment's 16-key
// chunks in turn, each keeping its own online softmax, and merge through shared memory at the
// end. Each warp streams its chunks through a ring of STAGES shared-memory buffers with
// cp.async, so STAGES - 1 chunks per warp are in flight while it computes one: an fp8 key is
// half a bf16 one, and with one chunk in flight per warp the kernel read only ~2.4 TB/s (it
// waited on memory latency, as the Triton kernel does). The block table comes in 32 entries
// at a time, one per lane, and each chunk's block is shuffled out of them. Rows of the m16 tiles are the query heads of the KV head's group (G <= 8; rows 8-15
// are zero), so the operands are laid out to need no shuffles:
//   * Q K^T: the reduction runs over head dims, and which dim a k-slot of the mma holds is
//     free as long as q and K agree. Lane (g, t) holds dims [32t, 32t + 32) of key g (and
//     8 + g) in its B fragments, one 32-byte load each: k-block kb, slot s <-> dim 32t+4kb+s.
//     Each fp8 pair converts to an f16 pair with one `cvt.rn.f16x2.e4m3x2`.
//   * P V: the reduction runs over keys; the S accumulator of two n-tiles is already P's A
//     fragment (FlashAttention-2's register reuse). V's B fragment pairs keys (2t, 2t + 1)
//     of one dim: lane (g, t) loads dims [16g, 16g + 16) of keys 2t, 2t+1, 2t+8, 2t+9 (one
//     16-byte load each) and pairs their bytes with `prmt` before converting. n-tile j holds
//     dim 16g + j in column g, so the accumulator of lane (g, t) ends with dims 32t + j and
//     32t + 16 + j of query head g.
// Per 16 keys and warp: 16 + 16 mma, 48 conversions, 8 byte permutes, 8 16-byte loads.
//
// Compile-time constants (-D): G (queries per KV head, 1..8), WARPS, BLOCK_SIZE (a multiple
// of 16), E5M2 (0: e4m3), Q_BF16 (0: fp16 q and out), STAGES (>= 2, buffers per warp),
// MIN_BLOCKS (0, or the CTAs per SM the registers must allow: __launch_bounds__).
// Dynamic shared memory: WARPS * STAGES * 4096 bytes.

#define HEAD 128
#define NKB 8   // k-blocks of 16 head dims in Q K^T
#define NNT 16  // n-tiles of 8 head dims in P V

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

// A pair of model-dtype values (low half first) as an f16 pair.
__device__ __forceinline__ u32 q_pair_to_f16x2(u32 w) {
#if Q_BF16
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
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
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

#define CHUNK_BYTES 4096  // 16 keys x 128 fp8 of K, then of V

__device__ __forceinline__ void cp_async16(u32 smem_addr, const unsigned char* gmem) {
#if L2_HINT == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
#elif L2_HINT == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr), "l"(gmem));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// A chunk's 128-byte rows keep their 16-byte pieces XOR-swizzled by row (piece k of row r at
// k ^ (r & 7)), so the 8 lanes of each shared-memory phase below read 8 different bank groups.
__device__ __forceinline__ int swz(int row, int piece) { return row * 128 + 16 * (piece ^ (row & 7)); }

__device__ __forceinline__ u32 word(const uint4& x, int i) {
  return i == 0 ? x.x : i == 1 ? x.y : i == 2 ? x.z : x.w;
}

#if MIN_BLOCKS
#define BOUNDS __launch_bounds__(WARPS * 32, MIN_BLOCKS)
#else
#define BOUNDS __launch_bounds__(WARPS * 32)
#endif

extern "C" __global__ void BOUNDS
    pagoda_paged_decode_fp8(u16* out, const u16* q, const unsigned char* k_cache,
                            const unsigned char* v_cache, const int* block_tables,
                            const int* seq_lens, const int* query_start_loc,
                            const float* k_scale, const float* v_scale, float* segm_out,
                            float* segm_max, float* segm_sum, double qk_scale_d, int num_heads,
                            int stride_q_tok, int stride_q_head, int stride_o_tok,
                            int stride_o_head, int stride_c_blk, int stride_c_slot,
                            int stride_c_head, int stride_bt) {
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
      qa0[2 * i] = q_pair_to_f16x2(w.x);
      qa2[2 * i] = q_pair_to_f16x2(w.y);
      qa0[2 * i + 1] = q_pair_to_f16x2(w.z);
      qa2[2 * i + 1] = q_pair_to_f16x2(w.w);
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
      const int piece = lane & 7;
#pragma unroll
      for (int r4 = 0; r4 < 4; ++r4) {
        const int row = (lane >> 3) + 4 * r4;
        const long long off = base + (long long)row * stride_c_slot + 16 * piece;
        cp_async16(st + swz(row, piece), k_cache + off);
        cp_async16(st + 2048 + swz(row, piece), v_cache + off);
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
    const unsigned char* vst = kst + 2048;
    uint4 kk[4], vv[4];
    kk[0] = *(const uint4*)(kst + swz(g, 2 * t));  // key g, dims 32t ..
    kk[1] = *(const uint4*)(kst + swz(g, 2 * t + 1));
    kk[2] = *(const uint4*)(kst + swz(8 + g, 2 * t));  // key 8 + g
    kk[3] = *(const uint4*)(kst + swz(8 + g, 2 * t + 1));
    vv[0] = *(const uint4*)(vst + swz(2 * t, g));  // keys 2t, 2t+1, 2t+8, 2t+9, dims 16g ..
    vv[1] = *(const uint4*)(vst + swz(2 * t + 1, g));
    vv[2] = *(const uint4*)(vst + swz(2 * t + 8, g));
    vv[3] = *(const uint4*)(vst + swz(2 * t + 9, g));
    // S = Q K^T for keys 0-7 (s0) and 8-15 (s1) of the chunk.
    float s0a = 0.f, s0b = 0.f, s1a = 0.f, s1b = 0.f;
#pragma unroll
    for (int kb = 0; kb < NKB; ++kb) {
      const u32 w0 = word(kk[kb >> 2], kb & 3);
      const u32 w1 = word(kk[2 + (kb >> 2)], kb & 3);
      mma(s0a, s0b, z2, z3, qa0[kb], qa2[kb], fp8x2_to_f16x2(w0), fp8x2_to_f16x2(w0 >> 16));
      mma(s1a, s1b, z2, z3, qa0[kb], qa2[kb], fp8x2_to_f16x2(w1), fp8x2_to_f16x2(w1 >> 16));
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
    const u32 pa0 = pack_f16x2(x0, x1), pa2 = pack_f16x2(x2, x3);
    // Keys past the end read stale slots of the same block: zero their V (NaN * 0 = NaN).
    uint4 v0 = vv[0], v1 = vv[1], v8 = vv[2], v9 = vv[3];
    uint4 zero;
    zero.x = zero.y = zero.z = zero.w = 0u;
    if (p0 >= seq_len) v0 = zero;
    if (p0 + 1 >= seq_len) v1 = zero;
    if (p0 + 8 >= seq_len) v8 = zero;
    if (p0 + 9 >= seq_len) v9 = zero;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const u32 a = word(v0, w), b = word(v1, w), c8 = word(v8, w), c9 = word(v9, w);
      const u32 lo_ab = __byte_perm(a, b, 0x5140), hi_ab = __byte_perm(a, b, 0x7362);
      const u32 lo_cd = __byte_perm(c8, c9, 0x5140), hi_cd = __byte_perm(c8, c9, 0x7362);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * w + jj;
        acc[j][0] *= alpha;
        acc[j][1] *= alpha;
        const u32 ab = jj < 2 ? lo_ab : hi_ab, cd = jj < 2 ? lo_cd : hi_cd;
        const int sh = (jj & 1) * 16;
        mma(acc[j][0], acc[j][1], z2, z3, pa0, pa2, fp8x2_to_f16x2(ab >> sh),
            fp8x2_to_f16x2(cd >> sh));
      }
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
