// 8-bit W8A8 GEMM on sm_90a: y[m, n] = ((float)(sum_k xq[m, k] wq[n, k]) * xs[m]) * ws[n]
// (+ bias[n]), int8 operands (INT8: products exact in int32) or float8 e4m3 ones (float32
// accumulators, added in the tensor cores' own precision across K: FP8 fast accumulation),
// the epilogue in float32 in the order of the Triton kernel (`scaled_mm_triton._epilogue`),
// y bf16 (BF16) or fp16.
//
// Warp-specialized, as CUTLASS's sm90 TMA GEMMs are: warpgroups 0..CONSUMERS-1 are the
// consumers, each taking 64 rows of x (the wgmma M side) against all BN weight rows of the CTA
// (its N side, m64nBNk32: s8 x s8 -> s32 or e4m3 x e4m3 -> f32); the warp after them is the producer (one thread
// issues every copy). A producer warp rather than a warpgroup leaves the registers for two
// CTAs of 128 x 128 an SM (288 threads, 113 registers each), so one CTA's epilogue and
// pipeline fill overlap the other's main loop.
// A K step is 128 inputs (one 128-byte row of each operand, the 128-byte swizzle's span): the
// producer copies a step's x tile [BM x 128] and weight tile [BN x 128] by the TMA unit (two
// tensor maps, 128-byte swizzle, rows past M or N and inputs past K zero-filled) into stage
// i % STAGES, completing on that stage's `full` mbarrier; each consumer warp waits for it,
// issues the step's four k32 wgmmas, commits, waits for the step before's wgmmas and then
// arrives on that step's `empty` mbarrier, which the producer waits on before refilling the
// stage. Both operands are K-major, as 8-bit wgmma requires; their descriptors are
// `swizzled_desc`'s (`wgmma_device.cuh`: 1024-byte atoms of 8 rows), a k32 step 32 bytes on.
//
// The CTA at blockIdx (x, y) covers x rows [BM x, +BM) and weight rows [BN y, +BN): CTAs next
// to each other share a weight tile, read from DRAM once and from L2 after.
//
// Thread-block clusters (CM x CN CTAs, sm_90): the CM CTAs of a cluster row (same weight
// rows) share their weight tile, read from L2 once for all of them: each copies BN / CM of its
// rows by a multicast TMA copy that lands in all CM CTAs' shared memory at the same offset and
// completes on each one's `full` mbarrier; likewise the CN CTAs of a cluster column share the x
// tile, BM / CN rows each (`w8a8_wgmma.choose_config` says where this is faster). So a CTA's `full` barrier counts bytes
// that its peers' copies bring, and a stage may be refilled only when the consumers of every
// CTA it lands in are done with it: each consumer warp arrives on the `empty` barrier of every
// CTA of the cluster. The cluster synchronizes after the barriers are initialized (a peer's
// copy may land first) and before any CTA exits (a peer may still arrive on its barriers).
//
// K split among a cluster (CK > 1, sm_90): the CK CTAs of a cluster (grid z, ranks 0..CK-1)
// take consecutive ranges of the tile's K steps, for layers whose tiles are too few to fill the
// SMs (a deep layer at a few hundred rows: down at 256 rows has 64 tiles of 128 x 128). Each
// ends with its accumulators in registers; ranks 1.. write theirs into their own shared memory
// (the pipeline's, free once their wgmmas end), and after a barrier across the cluster rank 0
// adds them to its own in rank order, read through distributed shared memory (no global
// workspace, no second kernel; int32 sums are exact, float ones added in a fixed order), then
// runs the epilogue alone. Not combined with the multicast clusters (CM = CN = 1).
//
// Epilogue: each consumer scales its accumulators, (acc * xs[m]) * ws[n] (+ bias[n]), writes
// them as 16-bit pairs into its 64 x BN tile in shared memory (the pipeline's, free once every
// consumer is past its last wgmma; rows padded 16 bytes so that a warp's pairs hit 32 banks),
// then stores the tile row by row in 16-byte pieces (N a multiple of 8).
//
// Compile-time constants (-D): INT8, BF16, BM (64 or 128), BN (64, 128 or 256), STAGES,
// HAS_BIAS, PDL, CTAS_PER_SM, CM and CN (the cluster's CTAs along x and y: 1, 2 or 4), CK
// (the K split, 1, 2 or 4; with CM = CN = 1).
// WGMMA(acc, desc_a, desc_b), the m64nBNk32 instruction, is defined before this source
// (`w8a8_wgmma.py` writes it for BN and the operands' type), as are the helpers of
// `w4a16_device.cuh` (mbarriers, bulk copies, clusters) and `wgmma_device.cuh`.

#define BK 128
#if INT8
typedef int acc_t;
#else
typedef float acc_t;
#endif
#define CONSUMERS (BM / 64)
#define THREADS (128 * CONSUMERS + 32)
#define OUT_ROW_BYTES (2 * BN + 16)  // a row of a consumer's output tile in shared memory
#define A_BYTES (BM * BK)
#define STAGE_BYTES ((BM + BN) * BK)
#define SHARE (CM * CN)         // CTAs of a cluster sharing tiles by multicast
#define CLUSTER (CM * CN * CK)  // CTAs of a cluster
#if CK > 1 && SHARE > 1
#error "a K split is not combined with multicast clusters"
#endif
#define X_SLICE (BM / CN)  // x rows a CTA copies for its cluster column
#define W_SLICE (BN / CM)  // weight rows a CTA copies for its cluster row
static_assert(X_SLICE % 8 == 0 && W_SLICE % 8 == 0, "slices of whole 1024-byte swizzle atoms");
static_assert(CONSUMERS * 64 * OUT_ROW_BYTES <= STAGES * STAGE_BYTES,
              "the output tiles reuse the pipeline's shared memory");
static_assert(CK == 1 || (BN / 2) * 128 * CONSUMERS * 4 <= STAGES * STAGE_BYTES,
              "a K split's partial accumulators reuse the pipeline's shared memory");

// The same into shared `dst` of every CTA of the cluster in `mask` (by rank), completing on the
// `bar` at the same offset in each.
__device__ __forceinline__ void tma_multicast(u32 dst, const TensorMap* map, int k, int row,
                                              u32 bar, u16 mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(k), "r"(row), "r"(bar), "h"(mask)
      : "memory");
}

// (acc * xs) * ws (+ b), each operation rounded (no FMA contraction under --use_fast_math).
__device__ __forceinline__ float scaled(acc_t acc, float xs, float ws, float b) {
  const float v = __fmul_rn(__fmul_rn((float)acc, xs), ws);
#if HAS_BIAS
  return __fadd_rn(v, b);
#else
  return v;
#endif
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
  return (u32)from_f32(lo) | ((u32)from_f32(hi) << 16);
}

// @WGMMA@

extern "C" __global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
    pagoda_w8a8_wgmma(const __grid_constant__ TensorMap x_map,
                      const __grid_constant__ TensorMap w_map, u16* __restrict__ y,
                      const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                      const u16* __restrict__ bias, int M, int N, int K, int stride_y) {
  extern __shared__ unsigned char smem_raw[];  // STAGES x (x tile, weight tile), 1024-aligned
  __shared__ __align__(8) unsigned long long full[STAGES];   // a stage's tiles have landed
  __shared__ __align__(8) unsigned long long empty[STAGES];  // every consumer warp is done
  __shared__ float ws_tile[BN], bias_tile[BN];  // the CTA's weight rows' scales and bias
  const u32 tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
#if CK > 1  // this CTA's K steps: [s0, s0 + steps) of rank blockIdx.z's range (none past K)
  const int all_steps = (K + BK - 1) / BK, per_rank = (all_steps + CK - 1) / CK;
  const int s0 = blockIdx.z * per_rank, steps = max(0, min(per_rank, all_steps - s0));
#else
  const int s0 = 0, steps = (K + BK - 1) / BK;
#endif
  const u32 full0 = smem_addr(full), empty0 = smem_addr(empty);
  if (tid == 0) {
    prefetch_tensor_map(&x_map);
    prefetch_tensor_map(&w_map);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, 4 * CONSUMERS * SHARE);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
#if SHARE > 1
  cluster_sync();  // every CTA's barriers initialized before any copy lands on them
#else
  __syncthreads();
#endif

  if (warp == 4 * CONSUMERS) {  // the producer warp: one thread copies
    if (lane == 0) {
      // Where a cluster shares a tile (CM or CN > 1, known at compile time) this CTA copies
      // its slice into every CTA of its cluster row (weights) or column (x).
      const int rx = blockIdx.x % CM, ry = blockIdx.y % CN;  // rank rx + CM ry
      const u16 w_mask = (u16)(((1u << CM) - 1u) << (CM * ry));  // the cluster row
      u16 x_mask = 0;                                             // the cluster column
      for (int r = 0; r < CN; ++r) x_mask |= (u16)(1u << (rx + CM * r));
      auto load_w = [&](u32 stage, int i, u32 bar) {
        if (CM > 1)
          tma_multicast(stage + A_BYTES + rx * W_SLICE * BK, &w_map, (s0 + i) * BK,
                        n0 + rx * W_SLICE, bar, w_mask);
        else
          tma_load(stage + A_BYTES, &w_map, (s0 + i) * BK, n0, bar);
      };
      auto load_x = [&](u32 stage, int i, u32 bar) {
        if (CN > 1)
          tma_multicast(stage + ry * X_SLICE * BK, &x_map, (s0 + i) * BK, m0 + ry * X_SLICE,
                        bar, x_mask);
        else
          tma_load(stage, &x_map, (s0 + i) * BK, m0, bar);
      };
      // The weights never change: the first stages' weight tiles load before the kernel
      // before this one (which writes x and its scales) has ended.
      for (int i = 0; i < STAGES && i < steps; ++i) {
        mbar_expect_tx(full0 + 8 * i, STAGE_BYTES);
        load_w(tiles + i * STAGE_BYTES, i, full0 + 8 * i);
      }
      grid_wait();
      launch_dependents();
      for (int i = 0; i < steps; ++i) {
        const int s = i % STAGES;
        const u32 stage = tiles + s * STAGE_BYTES, bar = full0 + 8 * s;
        if (i >= STAGES) {
          mbar_wait(empty0 + 8 * s, (i / STAGES - 1) & 1);
          mbar_expect_tx(bar, STAGE_BYTES);
          load_w(stage, i, bar);
        }
        load_x(stage, i, bar);
      }
    }
#if CK > 1
    __syncwarp();
    cluster_sync();  // the consumers' two barriers across the cluster (below)
    cluster_sync();
#elif CLUSTER > 1
    __syncwarp();
    cluster_sync();  // no CTA exits while a peer may still arrive on its barriers
#endif
    return;
  }

  for (int i = tid; i < BN; i += 128 * CONSUMERS) {  // read by the epilogue, after a barrier
    const int n = min(n0 + i, N - 1);  // past N: never stored
    ws_tile[i] = w_scale[n];
#if HAS_BIAS
    bias_tile[i] = to_f32<BF16>(bias[n]);
#else
    bias_tile[i] = 0.f;
#endif
  }
  grid_wait();  // x_scale is written by the kernel before; y may still be read by it
  const int c = warp / 4, wq = warp & 3;  // consumer warpgroup, its warp
  acc_t acc[BN / 2];
#pragma unroll
  for (int j = 0; j < BN / 2; ++j) acc[j] = 0;
  for (int i = 0; i < steps; ++i) {
    const int s = i % STAGES;
    mbar_wait(full0 + 8 * s, (i / STAGES) & 1);
    const u32 stage = tiles + s * STAGE_BYTES;
    const unsigned long long da = swizzled_desc(stage + c * 64 * BK),
                             db = swizzled_desc(stage + A_BYTES);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BK / 32; ++kk) WGMMA(acc, da + 2 * kk, db + 2 * kk);
    wgmma_commit();
    wgmma_wait<1>();  // the step before's wgmmas are done: its stage is free
    if (i > 0) {
      __syncwarp();
#if SHARE > 1
      if (lane < SHARE) mbar_arrive_at(empty0 + 8 * ((i - 1) % STAGES), lane);
#else
      if (lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % STAGES));
#endif
    }
  }
  wgmma_wait<0>();
#pragma unroll
  for (int j = 0; j < BN / 2; ++j)  // read after the wait
#if INT8
    asm volatile("" : "+r"(acc[j])::"memory");
#else
    asm volatile("" : "+f"(acc[j])::"memory");
#endif

  // acc[4j + e]: x row 16 wq + g + 8 (e / 2) of the warpgroup's 64, weight row 8j + 2t + e % 2.
  asm volatile("bar.sync 1, %0;" ::"n"(128 * CONSUMERS) : "memory");  // every wgmma has ended
#if CK > 1  // rank 0 adds the other ranks' partial sums (in the pipeline's shared memory), then
            // runs the epilogue alone
  acc_t* part = reinterpret_cast<acc_t*>(smem_raw + (tiles - smem_addr(smem_raw)));
  if (!cluster_sum<128 * CONSUMERS>(acc, part, tid, blockIdx.z, CK)) return;
#endif
  const int g = lane >> 2, t = lane & 3;
  const int row0 = 16 * wq + g;
  const int r0 = m0 + 64 * c + row0, r1 = r0 + 8;
  const float xs0 = r0 < M ? x_scale[r0] : 0.f, xs1 = r1 < M ? x_scale[r1] : 0.f;
  unsigned char* out = smem_raw + (tiles - smem_addr(smem_raw)) + c * 64 * OUT_ROW_BYTES;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int col = 8 * j + 2 * t;
    const float ws0 = ws_tile[col], ws1 = ws_tile[col + 1];
    const float b0 = bias_tile[col], b1 = bias_tile[col + 1];
    *reinterpret_cast<u32*>(out + row0 * OUT_ROW_BYTES + 2 * col) =
        pack2(scaled(acc[4 * j], xs0, ws0, b0), scaled(acc[4 * j + 1], xs0, ws1, b1));
    *reinterpret_cast<u32*>(out + (row0 + 8) * OUT_ROW_BYTES + 2 * col) =
        pack2(scaled(acc[4 * j + 2], xs1, ws0, b0), scaled(acc[4 * j + 3], xs1, ws1, b1));
  }
  if (c == 0)  // the warpgroup's tile is whole (a barrier of its own: ids known at compile time)
    asm volatile("bar.sync 2, 128;" ::: "memory");
  else
    asm volatile("bar.sync 3, 128;" ::: "memory");
  const int tig = tid & 127;
#pragma unroll
  for (int q = tig; q < 64 * (BN / 8); q += 128) {
    const int row = q / (BN / 8), col = 8 * (q % (BN / 8));
    const int m = m0 + 64 * c + row, n = n0 + col;
    if (m < M && n < N)
      *reinterpret_cast<uint4*>(y + (long long)m * stride_y + n) =
          *reinterpret_cast<const uint4*>(out + row * OUT_ROW_BYTES + 2 * col);
  }
#if SHARE > 1
  __syncwarp();
  cluster_sync();
#endif
}
