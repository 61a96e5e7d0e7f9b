// W4A16 GEMM for 17 rows and up on sm_90a: the 4-bit weights dequantized in registers straight
// into the A operand of wgmma, the activations the B operand from shared memory. Reads the
// packed layout of `pagoda/kernels/w4a16.py` as it is (qweight [N, K/8] u32, word j of a row
// holding input 8j + 2s in nibble s and 8j + 2s + 1 in nibble s + 4; scales [K/G, N] bf16 or
// fp16; zeros [K/G, N] u8).
//
// Swap-AB: the weight rows are wgmma's 64-row M side (one warpgroup each, WG of them a CTA),
// the activation rows its N side (BN of them a CTA, so each weight is unpacked once per BN
// rows). Every warpgroup runs all K steps of 128 inputs (one group: G is a multiple of 128):
// lane (g, t) of warp w loads 16 bytes of weight rows 16w + g and 16w + g + 8 (inputs
// [32t, 32t + 32) of the step: words 0..3), DEPTH steps ahead, into registers; makes each
// pair of nibbles two 16-bit floats 128 + q (bf16; 1024 + q for fp16) with one LOP3, then
// (q - z) exactly and (q - z) * s rounded once, by two packed FMAs; so the A fragment of
// chunk c = 2w + h (16 k-slots) is, as for mma.sync m16n8k16, registers (row g, slots 2t,
// 2t + 1), (row g + 8, same), (row g, slots 2t + 8, 2t + 9), (row g + 8, same), holding
// inputs 32t + 4c + {0, 1} and 32t + 4c + {2, 3}. Which input a k-slot holds is free as long
// as B agrees: the caller gathers x into that order once (`w4a16_wgmma.k_order`: position
// 16c + 8hi + 2t + e of a step holds input 32t + 4c + 2hi + e), so that B's k-slots are
// plain consecutive positions.
//
// B: a step's BN x 128 tile of x, in that k order, as two 64-input halves, each BN rows of 128
// bytes in the 128-byte-swizzled K-major layout wgmma reads (16-byte chunk c of row r at
// chunk c ^ (r % 8); 8-row atoms 1024 bytes apart). The caller writes x once per call in
// exactly these tiles (`w4a16_wgmma.tile_x`: xt [M tiles][K steps][BN x 128], rows past M
// zero), so a tile is one contiguous bulk copy (the TMA unit, no tensor map) that completes on
// its stage's mbarrier. STAGES stages, all of them ahead. Per step, each warp: wait for the
// step's tile (the mbarrier's phase), unpack this step's A (two register buffers: the wgmmas
// of the step before may still be reading the other), 8 wgmma m64nBNk16, commit, wait for all
// but this group (or, with one buffer, for this group too), then count itself done with the
// stage whose wgmmas have ended; the last warp to do so copies the tile STAGES steps on into
// it. No barrier spans the CTA, so its warpgroups drift apart and take the tensor cores in
// turn. A lane's scale and zero pointers step to the next group's row as its K steps cross a
// group boundary (no division).
//
// A CTA covers activation rows [BN * blockIdx.x, +BN), weight rows [64 * WG * blockIdx.y,
// +64 * WG) and K steps [steps_per_split * blockIdx.z, +steps_per_split). With more than one
// split (SPLIT 1), each CTA stores its fp32 tile to partial[split, m, n] and counts its
// arrival on the tile's counter; the last to arrive sums the splits in order (the same bits
// every call) with its threads over consecutive outputs, 8 a thread with their loads in flight
// together (its accumulators are dead by then: no spills at 256 rows), stores y and resets the
// counter (as `skinny_gemm.store_tile` does). With SPLIT 2 a tile's splits are the CTAs of a
// thread-block cluster (grid z, at most 8): splits 1.. leave their accumulators in their own
// shared memory (the stages', free once every warp's wgmmas have ended), and after a barrier
// across the cluster split 0 adds them to its own in split order through distributed shared
// memory (the same sums in the same order as SPLIT 1: the same bits) and stores y alone; no
// round trip through global memory, no counter.
//
// A CTA loads its first DEPTH steps of weights before `grid_wait` (a programmatic dependent of
// the x tiling kernel where PDL is on).
//
// Compile-time constants (-D): BF16 (0: fp16 x, bias and y), SCALES_BF16 (0: fp16 scales),
// BN (activation rows of a CTA: a multiple of 32 up to 256), WG (1, 2 or 4 warpgroups), STAGES,
// DEPTH (K steps of weights in flight per lane: 2 or 4), A_BUFFERS (2: a step's A fragments
// are unpacked while the step before's wgmmas run; 1: fewer registers, the step's wgmmas end
// before the next unpacking, other warpgroups keep the tensor cores busy), CTAS_PER_SM (the
// launch bound's minimum: 2 caps the registers at 128 a thread for 256 threads), HAS_BIAS,
// SPLIT (1: K split over blockIdx.z, partials through global memory; 2: over a cluster), PDL.
// WGMMA(acc, a0, a1, a2, a3, desc), the m64nBNk16 instruction with A from registers, is
// defined before this source (`w4a16_wgmma.py` writes it for BN), as are the helpers of
// `w4a16_device.cuh` and `wgmma_device.cuh`.

#define STEP 128
#define ROWS (64 * WG)
#define THREADS (128 * WG)
#define HALF_BYTES (BN * 128)          // one 64-input half of a step's x tile
#define STAGE_BYTES (2 * HALF_BYTES)  // a step's x tile
#define STAGE_ELEMS (STAGE_BYTES / 2)
#define SUM_OUTPUTS 8  // outputs a thread of the split-K sum takes at once
#define SUM_SPLITS 4   // splits whose loads it issues together

#if BF16
#define ONE2 0x3f803f80u
#else
#define ONE2 0x3c003c00u
#endif
#define NEG_ZERO2 0x80008000u

// A scale as x's 16-bit type, in both halves of a word.
__device__ __forceinline__ u32 scale2(u32 raw) {
#if SCALES_BF16 == BF16
  return raw * 0x10001u;
#else
#if SCALES_BF16
  const float f = __uint_as_float(raw << 16);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)raw));
#endif
  return (u32)from_f32(f) * 0x10001u;
#endif
}

// Pair s of a word (nibbles s and s + 4: two consecutive inputs) as (q - z) * scale in two
// 16-bit floats: zoff = MAGIC | z in both halves, s2 the scale in both halves.
template <int S>
__device__ __forceinline__ u32 weight_pair(u32 w, u32 zoff, u32 s2) {
  u32 v, r;
  asm("lop3.b32 %0, %1, 0x000f000f, %2, 0xea;" : "=r"(v) : "r"(w >> (4 * S)), "r"(MAGIC));
#if BF16
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(ONE2), "r"(zoff ^ NEG_ZERO2));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(v) : "r"(r), "r"(s2), "r"(NEG_ZERO2));
#else
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(v), "r"(zoff));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(v) : "r"(r), "r"(s2));
#endif
  return v;
}

// A warp's lane 0 counts the warp done with a stage; the count before it (acq_rel: the last
// to count sees every other warp's reads of the stage done).
__device__ __forceinline__ u32 count_release(u32 counter) {
  u32 old;
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;"
               : "=r"(old)
               : "r"(counter)
               : "memory");
  return old;
}

// What k-chunk j (16 inputs) of a tile adds to its descriptor: the chunk's byte offset / 16 in
// the start address field (shared memory ends below 256 KB: the 14-bit field never carries).
#define B_CHUNK(j) ((unsigned long long)((((j) >> 2) * HALF_BYTES + ((j) & 3) * 32) >> 4))

// @WGMMA@

extern "C" __global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
    pagoda_w4a16_wgmma(u16* __restrict__ y, const u16* __restrict__ xt,
                       const u32* __restrict__ qweight, const u16* __restrict__ scales,
                       const u8* __restrict__ zeros, const u16* __restrict__ bias,
                       float* __restrict__ partial, int* __restrict__ counters, int M, int N,
                       int K, int G, int stride_y, int steps_per_split) {
  extern __shared__ unsigned char smem_raw[];  // STAGES x tiles, 1024-aligned below
#if SPLIT == 1
  __shared__ int last_split;
#endif
  __shared__ __align__(8) unsigned long long full[STAGES];  // a stage's x tile has landed
  __shared__ u32 released[STAGES];                           // warps done with a stage
  const u32 tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.x * BN, n0 = blockIdx.y * ROWS;
  const int steps = K / STEP;
  const int s_begin = blockIdx.z * steps_per_split;
  const int nsteps = min(steps, s_begin + steps_per_split) - s_begin;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));

  // This lane's weight rows (past N: row N - 1, never stored), their scales and zeros.
  const int row0 = min(n0 + 16 * warp + g, N - 1), row1 = min(n0 + 16 * warp + g + 8, N - 1);
  const uint4* wrow0 =
      reinterpret_cast<const uint4*>(qweight + (long long)row0 * (K / 8)) + t + 4 * s_begin;
  const uint4* wrow1 =
      reinterpret_cast<const uint4*>(qweight + (long long)row1 * (K / 8)) + t + 4 * s_begin;
  const int group_steps = G / STEP;
  int group_left = group_steps - s_begin % group_steps;  // K steps left in the current group
  const long long group_off = (long long)(s_begin / group_steps) * N;
  const u16 *sc0 = scales + group_off + row0, *sc1 = scales + group_off + row1;
  const u8 *zp0 = zeros + group_off + row0, *zp1 = zeros + group_off + row1;

  // Called for i = 0, 1, 2, ... in turn: each call moves the rows' pointers one K step on.
  uint4 wv[DEPTH][2];
  u32 sc[DEPTH][2], zp[DEPTH][2];
  auto load_weights = [&](int i, uint4(&wv_)[2], u32(&sc_)[2], u32(&zp_)[2]) {
    if (i < nsteps) {
      wv_[0] = ld_weights(wrow0, policy);
      wv_[1] = ld_weights(wrow1, policy);
      sc_[0] = ld_nc_u16(sc0);
      sc_[1] = ld_nc_u16(sc1);
      zp_[0] = ld_nc_u8(zp0);
      zp_[1] = ld_nc_u8(zp1);
      wrow0 += 4;
      wrow1 += 4;
      if (--group_left == 0) {
        group_left = group_steps;
        sc0 += N, sc1 += N, zp0 += N, zp1 += N;
      }
    }
  };
  // Step i's x tile into stage i % STAGES: one bulk copy by one thread.
  const u16* xsrc = xt + ((long long)blockIdx.x * steps + s_begin) * STAGE_ELEMS;
  const u32 full0 = smem_addr(full), released0 = smem_addr(released);
  auto load_x = [&](int i) {
    const int stage = i % STAGES;
    mbar_expect_tx(full0 + 8 * stage, STAGE_BYTES);
    bulk_load(tiles + stage * STAGE_BYTES, xsrc + (long long)i * STAGE_ELEMS, STAGE_BYTES,
              full0 + 8 * stage);
  };
  // After step i's wgmmas are done in every warp, the last warp to say so refills its stage
  // with step i + STAGES.
  auto release = [&](int i) {
    __syncwarp();
    if (lane == 0) {
      const u32 counter = released0 + 4 * (i % STAGES);
      if (count_release(counter) == 4 * WG - 1) {
        released[i % STAGES] = 0;
        if (i + STAGES < nsteps) load_x(i + STAGES);
      }
    }
  };
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      released[s] = 0;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) load_weights(d, wv[d], sc[d], zp[d]);
  grid_wait();  // xt is written by the kernel before (`tile_x`)
  launch_dependents();
  if (tid == 0)
    for (int i = 0; i < STAGES && i < nsteps; ++i) load_x(i);

  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  u32 a[A_BUFFERS][8][4];

  for (int i0 = 0; i0 < nsteps; i0 += DEPTH) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int i = i0 + d;
      if (i < nsteps) {
        mbar_wait(full0 + 8 * (i % STAGES), (i / STAGES) & 1);

        u32(&ab)[8][4] = a[d % A_BUFFERS];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const u32 zoff = MAGIC | (zp[d][h] * 0x10001u), s2 = scale2(sc[d][h]);
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const u32 word = part(wv[d][h], w);
            ab[2 * w][h] = weight_pair<0>(word, zoff, s2);
            ab[2 * w][2 + h] = weight_pair<1>(word, zoff, s2);
            ab[2 * w + 1][h] = weight_pair<2>(word, zoff, s2);
            ab[2 * w + 1][2 + h] = weight_pair<3>(word, zoff, s2);
          }
        }
        load_weights(i + DEPTH, wv[d], sc[d], zp[d]);

        const unsigned long long desc = swizzled_desc(tiles + (i % STAGES) * STAGE_BYTES);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 8; ++j)
          WGMMA(acc, ab[j][0], ab[j][1], ab[j][2], ab[j][3], desc + B_CHUNK(j));
        wgmma_commit();
        wgmma_wait<A_BUFFERS - 1>();  // with one buffer its wgmmas end before it is rewritten
        if (i >= A_BUFFERS - 1) release(i - (A_BUFFERS - 1));  // its wgmmas are done
      }
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // read after the wait

  // acc[4c + i]: weight row 16 warp + g + 8 (i / 2), activation row 8c + 2t + i % 2.
#if SPLIT == 1
  const long long split_size = (long long)M * N;
#pragma unroll
  for (int c = 0; c < BN / 8; ++c)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = n0 + 16 * warp + g + 8 * (i >> 1), m = m0 + 8 * c + 2 * t + (i & 1);
      if (n < N && m < M) partial[blockIdx.z * split_size + (long long)m * N + n] = acc[4 * c + i];
    }
  __threadfence();
  __syncthreads();
  int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
  if (tid == 0) last_split = atomicAdd(counter, 1) == (int)gridDim.z - 1;
  __syncthreads();
  if (!last_split) return;
  __threadfence();
  // The last CTA sums the tile's splits in split order (the same bits every call), SUM_OUTPUTS
  // outputs a thread at a time (consecutive threads, consecutive outputs), the loads of up to
  // SUM_SPLITS splits of all of them in flight together. Summed one output at a time, a
  // thread waited a load latency per split and output (64 for down at 256 rows: 4 warpgroups,
  // 2 splits).
  for (int base = tid; base < BN * ROWS; base += THREADS * SUM_OUTPUTS) {
    long long at[SUM_OUTPUTS];
    bool ok[SUM_OUTPUTS];
    float v[SUM_OUTPUTS];
#pragma unroll
    for (int u = 0; u < SUM_OUTPUTS; ++u) {
      const int idx = base + u * THREADS;
      const int m = m0 + idx / ROWS, n = n0 + idx % ROWS;
      ok[u] = idx < BN * ROWS && n < N && m < M;
      at[u] = (long long)m * N + n;
      v[u] = 0.f;
    }
    for (int z0 = 0; z0 < (int)gridDim.z; z0 += SUM_SPLITS) {
      float p[SUM_SPLITS][SUM_OUTPUTS];
#pragma unroll
      for (int dz = 0; dz < SUM_SPLITS; ++dz)
#pragma unroll
        for (int u = 0; u < SUM_OUTPUTS; ++u)
          p[dz][u] = ok[u] && z0 + dz < (int)gridDim.z
                         ? __ldcg(partial + (z0 + dz) * split_size + at[u])
                         : 0.f;
#pragma unroll
      for (int dz = 0; dz < SUM_SPLITS; ++dz)
        if (z0 + dz < (int)gridDim.z)
#pragma unroll
          for (int u = 0; u < SUM_OUTPUTS; ++u) v[u] += p[dz][u];
    }
#pragma unroll
    for (int u = 0; u < SUM_OUTPUTS; ++u)
      if (ok[u]) {
        const int idx = base + u * THREADS;
        const int m = m0 + idx / ROWS, n = n0 + idx % ROWS;
#if HAS_BIAS
        v[u] += to_f32<BF16>(bias[n]);
#endif
        y[(long long)m * stride_y + n] = from_f32(v[u]);
      }
  }
  if (tid == 0) *counter = 0;  // for the next launch (or graph replay)
#else
#if SPLIT == 2  // split 0 adds the others' partial sums (in the stages), then stores y alone
  __syncthreads();  // every warp's wgmmas have ended: the stages are free
  float* part = reinterpret_cast<float*>(smem_raw + (tiles - smem_addr(smem_raw)));
  if (!cluster_sum<THREADS>(acc, part, tid, blockIdx.z, gridDim.z)) return;
#endif
#pragma unroll
  for (int c = 0; c < BN / 8; ++c)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int n = n0 + 16 * warp + g + 8 * (i >> 1), m = m0 + 8 * c + 2 * t + (i & 1);
      if (n < N && m < M) {
        float v = acc[4 * c + i];
#if HAS_BIAS
        v += to_f32<BF16>(bias[n]);
#endif
        y[(long long)m * stride_y + n] = from_f32(v);
      }
    }
#endif
}
