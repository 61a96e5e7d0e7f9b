// W4A16 for decode batches (up to 8 * M_TILES activation rows) with tensor-core dots
// (mma.sync m16n8k16), reading the packed layout of `pagoda/kernels/w4a16.py` as it is:
// qweight [N, K/8] u32, word j of a row holding input 8j + 2s in nibble s and 8j + 2s + 1 in
// nibble s + 4 (s = 0..3); scales [K/G, N] bf16 or fp16; zeros [K/G, N] u8.
//
// Swap-AB: the weight rows are the mma's 16-row A side, the activation rows its 8-column B
// side (B columns past M repeat row M - 1: a B column reaches only its own output column, and
// columns past M are never stored). A CTA owns 16 * ROW_TILES weight rows and all of K; its
// warps take K steps of 128 inputs in turn (warp w: steps w, w + WARPS, ...), DEPTH steps
// per batch, every load of a batch issued before the first use, straight from global memory
// into registers (no shared memory: each weight byte is used once, by the lane that loads it).
// A CTA's 16 * ROW_TILES rows are one contiguous block of qweight; with L2_PREFETCH the copy
// engine is asked for all of it at the CTA's start (registers bound how many bytes the loads
// alone keep in flight).
// The warps' fp32 tiles are summed through shared memory at the end (in warp order), so no
// partial leaves the CTA and no second pass is needed.
//
// Which input each k-slot of an mma holds is free as long as A and B agree. Lane (g, t)
// loads 16 bytes of rows g and g + 8 of its 16-row tile: inputs [32t, 32t + 32) of the K
// step, words w = 0..3. Word w gives mma 2w its slots (pair 0, pair 1) and mma 2w + 1 its
// slots (pair 2, pair 3): pair s of a word is inputs 8j + 2s, 8j + 2s + 1, which is
// (w >> 4s) & 0x000f000f, turned into two 16-bit floats OFFSET + q by OR-ing the exponent
// bits in (one LOP3) and into q - z exactly by one packed subtract of OFFSET + z (or, with
// SUM_MMA, the zero point applied to the product). B's lane
// (g, t) then needs x[row g][32t + 8w, +8): one 16-byte load per word, whose 32-bit parts
// are exactly pairs 0..3. So no lane needs another lane's bytes and nothing is shuffled.
// Per K step and lane: 2 * ROW_TILES 16-byte weight loads, 4 * M_TILES 16-byte x loads (x
// is small and stays in L1/L2), 16 * ROW_TILES LOP3 + SUB pairs, 8 * ROW_TILES * M_TILES mma,
// then the group's scale on the step's fp32 product (G a multiple of 128, so a K step lies in
// one group).
//
// Compile-time constants (-D): BF16 (0: fp16 x, bias and y), SCALES_BF16 (0: fp16 scales),
// M_TILES (1, 2, 4 or 8), ROW_TILES (1 or 2), WARPS, DEPTH (K steps per warp and batch),
// HAS_PERM (act order: input k of the packed layout is x[:, perm[k]]), HAS_BIAS, L2_PREFETCH
// (1: the CTA's weight rows are prefetched into L2 at its start, sm_90), SUM_MMA (1: no
// per-weight zero-point subtract; the zero point is applied to the product with the sums of
// x that an mma of all-ones A gives), X_EARLY (1: a step's x loads all before its first mma;
// up to 16 rows), PDL (1: launched as a programmatic dependent of the kernel before it, sm_90:
// see `grid_wait`), SC_RING (with BULK: the scales and zero points come through the ring; N a
// multiple of 16), PRODUCER (with BULK; 0: no producer warp, the consumers refill the ring),
// MIN_WARPS (with BULK; > 0: registers for that many resident warps an SM, see MIN_CTAS),
// SC_PREFETCH (with BULK and PRODUCER, without SC_RING: the producer asks for the CTA's scale
// and zero-point rows into L2 at its start), SPLITS (with BULK: a tile's K steps split among a
// cluster of that many CTAs, grid y; sm_90), GROUP_STEPS (K steps a group: G / STEP, a
// compile-time constant so that a step's group is a shift, not a division; 0 for one group),
// SILU_MUL (with BULK and ROW_TILES 2, without SC_RING: the layer is a merged
// gate_up projection, rows [0, N/2) gate and [N/2, N) up; a CTA's row tile 0 is 16 gate rows,
// its row tile 1 the same 16 up rows, and y [M, N/2] is silu(gate) * up: the activation in
// the epilogue, no gate_up output and no second kernel), SC_EARLY (with BULK: a consumer loads
// its first step's scales and zero points before waiting for the kernel before, which they do
// not depend on, so that only x's load follows that wait).
// The helpers of `w4a16_device.cuh` are put before this source.

#define ROWS (16 * ROW_TILES)
#if SILU_MUL && (!BULK || ROW_TILES != 2 || SC_RING)
#error "SILU_MUL needs BULK, ROW_TILES 2 and no SC_RING"
#endif
#define SUB_ZERO (!SUM_MMA)  // the zero point subtracted from every weight
#define STEP 128  // inputs per K step
#define GROUP_OF(s) (GROUP_STEPS ? (s) / GROUP_STEPS : 0)  // the group of K step s

// Pair s of a word (nibbles s and s + 4) as two 16-bit floats: OFFSET + q, and with SUB
// q - z exactly (zoff = OFFSET + z in both halves).
template <int S, bool SUB>
__device__ __forceinline__ u32 pair(u32 w, u32 zoff) {
  u32 v, r;
  asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(v) : "r"(w >> (4 * S)), "r"(MAGIC));
  if (!SUB) return v;
#if BF16  // v * 1 - zoff (bf16x2 sub needs sm_90, fma sm_80)
  asm("fma.rn.bf16x2 %0, %1, %2, %3;"
      : "=r"(r)
      : "r"(v), "r"(0x3f803f80u), "r"(zoff ^ 0x80008000u));
#else
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(zoff));
#endif
  return r;
}

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm(
#if BF16
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
#else
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
#endif
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// x[row][k0 + 8w, +8) for lane (g, t)'s B fragment.
__device__ __forceinline__ uint4 load_x(const u16* __restrict__ xrow, const int* __restrict__ perm,
                                        int k) {
#if HAS_PERM
  const uint4 p0 = ld_nc_v4(perm + k), p1 = ld_nc_v4(perm + k + 4);
  uint4 r;
  r.x = ld_nc_u16(xrow + p0.x) | (ld_nc_u16(xrow + p0.y) << 16);
  r.y = ld_nc_u16(xrow + p0.z) | (ld_nc_u16(xrow + p0.w) << 16);
  r.z = ld_nc_u16(xrow + p1.x) | (ld_nc_u16(xrow + p1.y) << 16);
  r.w = ld_nc_u16(xrow + p1.z) | (ld_nc_u16(xrow + p1.w) << 16);
  return r;
#else
  return ld_nc_v4(xrow + k);
#endif
}

// Lane row g's x rows: row 8 mt + g for B tile mt (past M: row M - 1, see the header).
__device__ __forceinline__ void x_rows(const u16* (&xrow)[M_TILES], const u16* __restrict__ x,
                                       int M, int stride_x, int g) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) xrow[mt] = x + (long long)min(8 * mt + g, M - 1) * stride_x;
}

// The kernel's parameters (both variants below).
#define GEMV_PARAMS                                                                          \
  u16 *__restrict__ y, const u16 *__restrict__ x, const u32 *__restrict__ qweight,           \
      const u16 *__restrict__ scales, const u8 *__restrict__ zeros,                          \
      const int *__restrict__ perm, const u16 *__restrict__ bias, int M, int N, int K,        \
      int stride_x, int stride_y

// A warp's fp32 tiles into its slot of the CTA's partials.
__device__ __forceinline__ void write_partial(float (&red)[ROW_TILES * M_TILES * 4][32],
                                              const float (&acc)[ROW_TILES][M_TILES][4],
                                              int lane) {
#pragma unroll
  for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[(rt * M_TILES + mt) * 4 + i][lane] = acc[rt][mt][i];
}

#if BULK && SPLITS > 1
// SPLITS: the K steps of a tile split among a cluster of SPLITS CTAs (blockIdx.y, on
// different SMs), whose partial tiles rank 0 sums through distributed shared memory.
// `*p` in the shared memory of the cluster's CTA `rank`.
__device__ __forceinline__ float ld_cluster(const float* p, u32 rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];"
               : "=f"(v)
               : "r"(cluster_addr(smem_addr(p), rank))
               : "memory");
  return v;
}
#endif

// Element (j, l) of every warp's partials (and every split's), summed in order.
__device__ __forceinline__ float sum_partials(const float (&red)[WARPS][ROW_TILES * M_TILES * 4][32],
                                              int j, int l) {
  float sum = 0.f;
#if BULK && SPLITS > 1  // every split's warps, in rank order (rank r: blockIdx.y = r)
#pragma unroll
  for (int r = 0; r < SPLITS; ++r)
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += ld_cluster(&red[w][j][l], r);
#else
#pragma unroll
  for (int w = 0; w < WARPS; ++w) sum += red[w][j][l];
#endif
  return sum;
}

// The warps' partials summed in warp order (+ bias) into y, by the CTA's `threads` threads.
// Element (j, l) of the tile: lane l's C register j % 4 of tile j / 4 = (rt, mt): row
// 16 rt + l / 4 + 8 (j % 4 / 2), column 8 mt + 2 (l % 4) + j % 2.
__device__ __forceinline__ void reduce_store(const float (&red)[WARPS][ROW_TILES * M_TILES * 4][32],
                                             u16* __restrict__ y, const u16* __restrict__ bias,
                                             int n0, int M, int N, int stride_y, int threads) {
#if SILU_MUL  // row tile 0 gate rows n0.., row tile 1 the same up rows: y = silu(gate) * up
  for (int e = threadIdx.x; e < M_TILES * 4 * 32; e += threads) {
    const int j = e / 32, l = e % 32;  // j: (0, mt, i); j + 4 * M_TILES: (1, mt, i)
    const int mt = j / 4, i = j % 4;
    const int row = n0 + l / 4 + 8 * (i / 2);
    const int col = 8 * mt + 2 * (l % 4) + (i % 2);
    if (col < M) {
      float gate = sum_partials(red, j, l), up = sum_partials(red, j + 4 * M_TILES, l);
#if HAS_BIAS
      gate += to_f32<BF16>(bias[row]);
      up += to_f32<BF16>(bias[N / 2 + row]);
#endif
      y[(long long)col * stride_y + row] = from_f32(gate / (1.f + __expf(-gate)) * up);
    }
  }
#else
  for (int e = threadIdx.x; e < ROW_TILES * M_TILES * 4 * 32; e += threads) {
    const int j = e / 32, l = e % 32;
    const int rt = j / (4 * M_TILES), mt = (j / 4) % M_TILES, i = j % 4;
    const int row = n0 + 16 * rt + l / 4 + 8 * (i / 2);
    const int col = 8 * mt + 2 * (l % 4) + (i % 2);
    if (row < N && col < M) {
      float sum = sum_partials(red, j, l);
#if HAS_BIAS
      sum += to_f32<BF16>(bias[row]);
#endif
      y[(long long)col * stride_y + row] = from_f32(sum);
    }
  }
#endif
}

// One K step of a warp: its weights wv (rows g and g + 8 of each row tile), their scales and
// zero points, and x from x_at(w, mt) (B tile mt's inputs for word w, asked at word w's turn;
// x_first() runs once before the first), added to acc. Two accumulator chains per tile (words
// 0, 2 and 1, 3): half the mma dependency; the group's scale applied to the step's fp32
// product.
template <typename XFirst, typename XAt>
__device__ __forceinline__ void step_product(float (&acc)[ROW_TILES][M_TILES][4],
                                             const uint4 (&wv)[ROW_TILES][2],
                                             const u32 (&sc)[ROW_TILES][2],
                                             const u32 (&zp)[ROW_TILES][2], XFirst x_first,
                                             XAt x_at) {
  float tmp[2][ROW_TILES][M_TILES][4];
#if SUM_MMA
  float xs[2][M_TILES][4];
#endif
  u32 zoff[ROW_TILES][2];
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
#if SUM_MMA
        xs[c][mt][i] = 0.f;
#endif
#pragma unroll
        for (int rt = 0; rt < ROW_TILES; ++rt) tmp[c][rt][mt][i] = 0.f;
      }
#pragma unroll
  for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) zoff[rt][h] = MAGIC | (zp[rt][h] * 0x10001u);
  x_first();
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint4 xw[M_TILES];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) xw[mt] = x_at(w, mt);
#if SUM_MMA
    // The sums of x over the step, in the accumulator's layout (every row the same): an mma
    // of all-ones A. The zero point is then applied to the product:
    // sum (q - z) x = sum (OFFSET + q) x - (OFFSET + z) sum x.
    const u32 one = BF16 ? 0x3f803f80u : 0x3c003c00u;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      mma(xs[w & 1][mt], one, one, one, one, xw[mt].x, xw[mt].y);
      mma(xs[w & 1][mt], one, one, one, one, xw[mt].z, xw[mt].w);
    }
#endif
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt) {
      const u32 lo = part(wv[rt][0], w), hi = part(wv[rt][1], w);
      const u32 l0 = pair<0, SUB_ZERO>(lo, zoff[rt][0]);
      const u32 h0 = pair<0, SUB_ZERO>(hi, zoff[rt][1]);
      const u32 l1 = pair<1, SUB_ZERO>(lo, zoff[rt][0]);
      const u32 h1 = pair<1, SUB_ZERO>(hi, zoff[rt][1]);
      const u32 l2 = pair<2, SUB_ZERO>(lo, zoff[rt][0]);
      const u32 h2 = pair<2, SUB_ZERO>(hi, zoff[rt][1]);
      const u32 l3 = pair<3, SUB_ZERO>(lo, zoff[rt][0]);
      const u32 h3 = pair<3, SUB_ZERO>(hi, zoff[rt][1]);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        mma(tmp[w & 1][rt][mt], l0, h0, l1, h1, xw[mt].x, xw[mt].y);
        mma(tmp[w & 1][rt][mt], l2, h2, l3, h3, xw[mt].z, xw[mt].w);
      }
    }
  }
#pragma unroll
  for (int rt = 0; rt < ROW_TILES; ++rt) {
    const float s_lo = to_f32<SCALES_BF16>((u16)sc[rt][0]);
    const float s_hi = to_f32<SCALES_BF16>((u16)sc[rt][1]);
#if SUM_MMA
    const float z_lo = (float)zp[rt][0] + OFFSET, z_hi = (float)zp[rt][1] + OFFSET;
#endif
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = tmp[0][rt][mt][i] + tmp[1][rt][mt][i];
#if SUM_MMA
        v[i] -= (i < 2 ? z_lo : z_hi) * (xs[0][mt][i] + xs[1][mt][i]);
#endif
      }
      acc[rt][mt][0] += s_lo * v[0];
      acc[rt][mt][1] += s_lo * v[1];
      acc[rt][mt][2] += s_hi * v[2];
      acc[rt][mt][3] += s_hi * v[3];
    }
  }
}

#if !BULK
extern "C" __global__ void __launch_bounds__(WARPS * 32)
    pagoda_w4a16_gemv(GEMV_PARAMS) {
  __shared__ float red[WARPS][ROW_TILES * M_TILES * 4][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * ROWS;
  const int steps = K / STEP;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));

  // Rows g and g + 8 of each row tile (past N: row N - 1, never stored); 16 bytes at 16t.
  const uint4* wrow[ROW_TILES][2];
  int nrow[ROW_TILES][2];
#pragma unroll
  for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      nrow[rt][h] = min(n0 + 16 * rt + 8 * h + g, N - 1);
      wrow[rt][h] = reinterpret_cast<const uint4*>(qweight + (long long)nrow[rt][h] * (K / 8)) + t;
    }
#if L2_PREFETCH && __CUDA_ARCH__ >= 900
  // The CTA's rows are one contiguous block of qweight: warp 0 asks the copy engine to bring
  // all of it into L2 at once (4 KiB pieces, one per lane in turn), so the whole block is in
  // flight from the start without holding registers, and the loads below mostly hit L2.
  if (warp == 0) {
    const char* block = reinterpret_cast<const char*>(qweight + (long long)n0 * (K / 8));
    const int bytes = min(ROWS, N - n0) * (K / 2);
    for (int off = 4096 * lane; off < bytes; off += 4096 * 32)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(block + off),
                   "r"(min(4096, bytes - off))
                   : "memory");
  }
#endif
  const u16* xrow[M_TILES];
  x_rows(xrow, x, M, stride_x, g);

  float acc[ROW_TILES][M_TILES][4];
#pragma unroll
  for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][mt][i] = 0.f;

  // A batch: DEPTH K steps of this warp from s0, every load issued before the first use.
  uint4 wv[DEPTH][ROW_TILES][2];
  u32 sc[DEPTH][ROW_TILES][2], zp[DEPTH][ROW_TILES][2];
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int s = s0 + d * WARPS;
      if (s < steps) {
        const int grp = GROUP_OF(s);
#pragma unroll
        for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            wv[d][rt][h] = ld_weights(wrow[rt][h] + 4 * s, policy);
            sc[d][rt][h] = ld_nc_u16(scales + grp * N + nrow[rt][h]);
            zp[d][rt][h] = ld_nc_u8(zeros + grp * N + nrow[rt][h]);
          }
      }
    }
  };
  auto use_batch = [&](int s0) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int s = s0 + d * WARPS;
      if (s < steps) {
        auto x_load = [&](int w, int mt) {
          return load_x(xrow[mt], perm, s * STEP + 32 * t + 8 * w);
        };
#if X_EARLY && M_TILES <= 2  // all of the step's x loads before the first mma
        uint4 xv[4][M_TILES];
        auto x_first = [&] {
#pragma unroll
          for (int w = 0; w < 4; ++w)
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) xv[w][mt] = x_load(w, mt);
        };
        step_product(acc, wv[d], sc[d], zp[d], x_first, [&](int w, int mt) { return xv[w][mt]; });
#else
        step_product(acc, wv[d], sc[d], zp[d], [] {}, x_load);
#endif
      }
    }
  };
#if PDL
  load_batch(warp);  // the first batch's weights before the kernel before this one is done
  grid_wait();
  launch_dependents();
  use_batch(warp);
  for (int s0 = warp + WARPS * DEPTH; s0 < steps; s0 += WARPS * DEPTH) {
#else
  for (int s0 = warp; s0 < steps; s0 += WARPS * DEPTH) {
#endif
    load_batch(s0);
    use_batch(s0);
  }

  write_partial(red[warp], acc, lane);
  __syncthreads();
  reduce_store(red, y, bias, n0, M, N, stride_y, WARPS * 32);
}
#endif  // !BULK

#if BULK
// BULK: the weights reach shared memory through the copy engine instead of registers. One
// extra warp (the producer) streams the CTA's rows a chunk of CHUNK K steps at a time into a
// ring of STAGES stages in dynamic shared memory (one cp.async.bulk per row and chunk,
// completing on the stage's `full` mbarrier); the WARPS consumer warps take the K steps in
// turn as above, read their 16-byte operands from the stage, and release it on its `empty`
// mbarrier. So the bytes in flight are bounded by shared memory, not by registers, and a
// consumer waits ~30 cycles for a weight instead of a global load's latency. A step's x is
// loaded one step ahead (registers), and so are its scales and zero points, or with SC_RING
// they come with the weights: the producer's lane i also copies step i of the chunk's scale
// and zero-point rows for the CTA (its group's ROWS of scales [K/G, N] and of zeros, two more
// bulk copies; N a multiple of 16, so every copy is whole 16-byte units), and a consumer
// reads its four of each from the stage (no global loads, 64-bit addresses or division in its
// loop for them). Rows of a stage are PITCH bytes apart, 64 more than a chunk's bytes: the 8
// lanes of each phase of a 16-byte shared load (rows g, g + 1, inputs 32t..) hit distinct
// banks. CHUNK is a multiple of WARPS (each consumer takes CHUNK / WARPS steps of a chunk).
// Without PRODUCER there is no producer warp (a fifth of the registers of a 4-warp CTA, so
// more CTAs an SM): warp 0 fills the first STAGES chunks, and the consumer that releases a
// stage last (a shared counter a stage, counted modulo WARPS) refills it with the chunk
// STAGES on, its 32 lanes issuing the copies the producer's would have.
#define PITCH (CHUNK * 64 + 64)
#define SC_OFFSET (ROWS * PITCH)                   // a stage's scales: [CHUNK][ROWS] 16-bit
#define ZP_OFFSET (SC_OFFSET + CHUNK * ROWS * 2)  // its zero points: [CHUNK][ROWS] u8
#define STAGE_BYTES (SC_RING ? ZP_OFFSET + CHUNK * ROWS : ROWS * PITCH)

// The CTA's scale and zero-point rows (one of each a group) asked into L2, so that the
// consumers' loads of them, a step ahead, wait for L2 rather than for memory: the 128-byte
// line of each row's start (the whole row where N is a multiple of 64). Not inlined: its
// registers stay out of the consumers' allocation.
// With `second` > 0 (SILU_MUL) the rows at n0 + second too.
__device__ __noinline__ void prefetch_group_rows(const u16* scales, const u8* zeros, int N,
                                                 int n0, int second, int grp_lo, int grp_hi,
                                                 int lane) {
  for (int grp = grp_lo + lane; grp <= grp_hi; grp += 32) {
    const long long at = (long long)grp * N + n0;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + at));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(zeros + at));
    if (second > 0) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + at + second));
      asm volatile("prefetch.global.L2 [%0];" ::"l"(zeros + at + second));
    }
  }
}

#define THREADS ((WARPS + PRODUCER) * 32)
// CTAs an SM the registers must allow (launch bounds): MIN_WARPS warps' worth where given,
// else without the producer 16 warps (at most 128 registers), with it 2 CTAs.
#if MIN_WARPS
#define MIN_CTAS (MIN_WARPS * 32 / THREADS > 1 ? MIN_WARPS * 32 / THREADS : 1)
#else
#define MIN_CTAS (M_TILES > 1 ? 1 : PRODUCER ? 2 : 16 / WARPS)
#endif

extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
    pagoda_w4a16_gemv(GEMV_PARAMS) {
  __shared__ float red[WARPS][ROW_TILES * M_TILES * 4][32];
  __shared__ __align__(8) unsigned long long full[STAGES];
#if PRODUCER
  __shared__ __align__(8) unsigned long long empty[STAGES];  // consumers done with the stage
#else
  __shared__ u32 released[STAGES];  // consumers done with the stage's chunks, in all
#endif
  extern __shared__ __align__(128) unsigned char ring_bytes[];  // dynamic: STAGES * STAGE_BYTES
  auto ring = reinterpret_cast<unsigned char(*)[STAGE_BYTES]>(ring_bytes);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // The last CTA's rows end at N (N >= ROWS): it repeats some of the CTA's before it, with the
  // same sums in the same order, so no row past N is ever read and a step's scales and zero
  // points of a lane are at fixed offsets from one address. Row tile rt's rows start RT_OFF
  // rows after the one before (with SILU_MUL: gate rows n0.., up rows N/2 + n0..).
#if SILU_MUL
  const int n0 = min(blockIdx.x * 16, N / 2 - 16), RT_OFF = N / 2;
#else
  const int n0 = min(blockIdx.x * ROWS, N - ROWS), RT_OFF = 16;
#endif
#if SPLITS > 1  // this CTA's K steps: [s0, s0 + steps) of split blockIdx.y (none past K)
  const int per_split = (K / STEP + SPLITS - 1) / SPLITS, s0 = blockIdx.y * per_split;
  const int steps = max(0, min(per_split, K / STEP - s0));
#else
  const int s0 = 0, steps = K / STEP;
#endif
  const int chunks = (steps + CHUNK - 1) / CHUNK;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(smem_addr(&full[st]), 1);
#if PRODUCER
      mbar_init(smem_addr(&empty[st]), WARPS);
#else
      released[st] = 0;
#endif
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  // Chunk c into stage c % STAGES, by a whole warp: lane r < ROWS copies row r of the CTA's
  // tiles, and with SC_RING lane i < the chunk's steps its step i's scales and zeros.
  auto fill = [&](int c) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    const int st = c % STAGES;
    const int nsteps = min(CHUNK, steps - c * CHUNK), bytes = nsteps * 64;
#if SC_RING
    if (lane == 0) mbar_expect_tx(smem_addr(&full[st]), ROWS * bytes + nsteps * ROWS * 3);
#else
    if (lane == 0) mbar_expect_tx(smem_addr(&full[st]), ROWS * bytes);
#endif
    __syncwarp();
    if (lane < ROWS) {
      const unsigned char* src = reinterpret_cast<const unsigned char*>(qweight) +
                                 (long long)(n0 + lane / 16 * RT_OFF + lane % 16) * (K / 2) +
                                 (s0 + c * CHUNK) * 64;
      bulk_load(smem_addr(ring[st] + lane * PITCH), src, bytes, smem_addr(&full[st]), policy);
    }
#if SC_RING
    if (lane < nsteps) {  // step c * CHUNK + lane's scales and zero points of the CTA's rows
      const long long at = (long long)GROUP_OF(s0 + c * CHUNK + lane) * N + n0;
      bulk_load(smem_addr(ring[st] + SC_OFFSET + lane * ROWS * 2), scales + at, ROWS * 2,
                smem_addr(&full[st]));
      bulk_load(smem_addr(ring[st] + ZP_OFFSET + lane * ROWS), zeros + at, ROWS,
                smem_addr(&full[st]));
    }
#endif
  };

#if PRODUCER
  if (warp == WARPS) {  // the producer
#if SC_PREFETCH && !SC_RING
    if (steps > 0)
      prefetch_group_rows(scales, zeros, N, n0, SILU_MUL ? RT_OFF : 0, GROUP_OF(s0),
                          GROUP_OF(s0 + steps - 1), lane);
#endif
    for (int c = 0; c < chunks; ++c) {
      const int st = c % STAGES;
      if (c >= STAGES) mbar_wait(smem_addr(&empty[st]), ((c / STAGES) - 1) & 1);
      fill(c);
    }
    grid_wait();  // before its share of the stores of y
  } else {
#else
  if (warp == 0)
    for (int c = 0; c < min(STAGES, chunks); ++c) fill(c);
  {
#endif
    const u16* xrow[M_TILES];
    x_rows(xrow, x, M, stride_x, g);
    float acc[ROW_TILES][M_TILES][4];
#pragma unroll
    for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[rt][mt][i] = 0.f;

    // Step s's x (with X_EARLY; else each word's x at its turn in the step: 16 * M_TILES
    // registers fewer) and without SC_RING its scales and zero points, loaded a step ahead.
    u32 sc[ROW_TILES][2], zp[ROW_TILES][2];
#if !X_EARLY
    typedef int XRegs;  // no x registers
    XRegs xv = 0;
#else
    typedef uint4 XRegs[4][M_TILES];
    XRegs xv;
#endif
    auto load_sc = [&](int s, u32(&sc_)[ROW_TILES][2], u32(&zp_)[ROW_TILES][2]) {
#if !SC_RING
      const int at = GROUP_OF(s0 + s) * N + n0 + g;  // row g's
#pragma unroll
      for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sc_[rt][h] = ld_nc_u16(scales + at + RT_OFF * rt + 8 * h);
          zp_[rt][h] = ld_nc_u8(zeros + at + RT_OFF * rt + 8 * h);
        }
#endif
    };
    auto load_xs = [&](int s, XRegs& xv_) {
#if X_EARLY
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
          xv_[w][mt] = load_x(xrow[mt], perm, (s0 + s) * STEP + 32 * t + 8 * w);
#endif
    };
    auto load_step = [&](int s, u32(&sc_)[ROW_TILES][2], u32(&zp_)[ROW_TILES][2], XRegs& xv_) {
      load_sc(s, sc_, zp_);
      load_xs(s, xv_);
    };
#if SC_EARLY  // the first step's scales and zero points while the kernel before ends
    if (warp < steps) load_sc(warp, sc, zp);
#endif
    grid_wait();  // x is written by the kernel before (the producer's weights are not)
    launch_dependents();
#if SC_EARLY
    if (warp < steps) load_xs(warp, xv);
#else
    if (warp < steps) load_step(warp, sc, zp, xv);
#endif
    // Step s (a K step of this warp: s % WARPS == warp) on the registers the step before
    // loaded, loading step s + WARPS's. (Two steps an iteration, with two sets of these
    // registers swapped instead of copied, ran 0-5% slower at 1-8 rows and 24% slower at 16,
    // with a loop body twice as long, on an H100.)
    for (int s = warp; s < steps; s += WARPS) {
      const int c = s / CHUNK, st = c % STAGES;
      u32 nsc[ROW_TILES][2], nzp[ROW_TILES][2];
      XRegs nxv;
      if (s + WARPS < steps) load_step(s + WARPS, nsc, nzp, nxv);
      if (s % CHUNK < WARPS) mbar_wait(smem_addr(&full[st]), (c / STAGES) & 1);  // its first
      uint4 wv[ROW_TILES][2];
#pragma unroll
      for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * rt + 8 * h + g;
          wv[rt][h] = *reinterpret_cast<const uint4*>(ring[st] + r * PITCH + (s % CHUNK) * 64 +
                                                      16 * t);
#if SC_RING
          sc[rt][h] = *reinterpret_cast<const u16*>(ring[st] + SC_OFFSET +
                                                    ((s % CHUNK) * ROWS + r) * 2);
          zp[rt][h] = ring[st][ZP_OFFSET + (s % CHUNK) * ROWS + r];
#endif
        }
      if (s % CHUNK >= CHUNK - WARPS) {  // this warp's last step of the chunk: done with it
        __syncwarp();
#if PRODUCER
        if (lane == 0) mbar_arrive(smem_addr(&empty[st]));
#else
        // The last of the WARPS to release it refills it. The count's release orders this
        // warp's reads of the stage before it, its acquire the others' before the copies.
        u32 done = 0;
        if (lane == 0)
          asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
                       : "=r"(done)
                       : "r"(smem_addr(&released[st]))
                       : "memory");
        if (__shfl_sync(0xffffffffu, done, 0) % WARPS == WARPS - 1 && c + STAGES < chunks) {
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          fill(c + STAGES);
        }
#endif
      }
#if X_EARLY
      step_product(acc, wv, sc, zp, [] {}, [&](int w, int mt) { return xv[w][mt]; });
#else
      step_product(acc, wv, sc, zp, [] {}, [&](int w, int mt) {
        return load_x(xrow[mt], perm, (s0 + s) * STEP + 32 * t + 8 * w);
      });
#endif
#if !SC_RING
#pragma unroll
      for (int rt = 0; rt < ROW_TILES; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          sc[rt][h] = nsc[rt][h];
          zp[rt][h] = nzp[rt][h];
        }
#endif
#if X_EARLY
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) xv[w][mt] = nxv[w][mt];
#endif
    }
    write_partial(red[warp], acc, lane);
  }
#if SPLITS > 1
  cluster_sync();  // every split's partial tiles written (release / acquire across the cluster)
  if (blockIdx.y == 0) reduce_store(red, y, bias, n0, M, N, stride_y, THREADS);
  cluster_sync();  // the other splits' shared memory kept until rank 0 has read it
#else
  __syncthreads();
  reduce_store(red, y, bias, n0, M, N, stride_y, THREADS);
#endif
}
#endif  // BULK
