// W4A16 GEMM on sm_90a, warp-specialized: a dequantizing warpgroup unpacks each 4-bit weight
// of the CTA's tile once into shared memory, and consumer warpgroups multiply it by wgmma with
// both operands from shared memory, so that every activation row of the tile shares one
// unpacking (in `w4a16_wgmma.cu` each warpgroup unpacks its own A operand in registers, once per
// tile of activation rows, and the unpacking shares the warps' issue slots with the MMAs).
// Reads the packed layout of `pagoda/kernels/w4a16.py` as it is (qweight [N, K/8] u32, word j of
// a row holding input 8j + 2s in nibble s and 8j + 2s + 1 in nibble s + 4; scales [K/G, N]
// bf16 or fp16; zeros [K/G, N] u8).
//
// Swap-AB, as `w4a16_wgmma.cu`: the weight rows are wgmma's 64-row M side, the activation rows
// its N side. A stage is 64 inputs (one 128-byte row of 16-bit values, the 128-byte swizzle's
// span): the x tile [BN x 64] (written once per call by `w4a16_wgmma.tile_x` in natural k
// order: a 128-input step's two halves are two consecutive stages, each one contiguous bulk
// copy) and WM weight tiles [64 x 64], both K-major in the 128-byte-swizzled layout (16-byte
// chunk c of row r at chunk c ^ (r % 8), 8-row atoms 1024 bytes apart).
//
// The last warpgroup dequantizes: thread d takes 16-byte unit d % 2 (words 4 (d % 2) .. +3:
// 32 inputs) of a stage's slice of weight row d / 2 in each of the WM 64-row blocks, loaded
// DEPTH stages ahead into registers (the weights and their scales and zeros never change: the
// first DEPTH stages load before `grid_wait`); per stage it waits until the consumers are done
// with the stage, (thread 0) copies the x tile into it, makes each word's four nibble pairs
// (q - z) * s as in `w4a16_wgmma.cu` (`weight_pair`) and stores them as one 16-byte chunk (the
// 8 threads of a quarter warp take 4 rows of the same alignment mod 4 and both units: 8
// different chunks, no bank conflict), then fences its stores for the async proxy and arrives
// on the stage's `full` mbarrier (which also waits for the copy's bytes). Consumer warpgroup c
// (WM x WN of them) multiplies weight block c / WN by activation rows [(c % WN) BN / WN, +BN /
// WN): per stage it waits on `full`, issues four m64n(BN/WN)k16 wgmmas, commits, waits for the
// stage before's and arrives on that stage's `empty` mbarrier.
//
// A CTA covers activation rows [BN blockIdx.x, +BN), weight rows [64 WM blockIdx.y, +64 WM) and
// stages [stages_per_split blockIdx.z, +stages_per_split); with more than one split each CTA
// stores its fp32 tile to partial[split, m, n] and the last to arrive sums the splits in order
// (every thread of the CTA, the dequantizing ones too), as `w4a16_wgmma.cu` does.
//
// Compile-time constants (-D): BF16 (0: fp16 x, bias and y), SCALES_BF16 (0: fp16 scales), BN
// (activation rows of a CTA, BN / WN a multiple of 8 up to 256), WM (64-row weight blocks: 1 or
// 2), WN (consumer warpgroups along the activation rows: 1 or 2), STAGES, DEPTH (stages of
// weights a dequantizing thread has in flight in registers; with RING, of scales and zeros
// only), RING (0, or stages of packed weights a thread copies ahead by cp.async into a ring in
// shared memory after the tiles: WM x 16 bytes a thread and stage), A_REGS (1: the consumers
// read the weight tile into registers by ldmatrix and multiply with A from registers, so that
// the dequantizing threads' stores need no fence for the async proxy), CTAS_PER_SM (the
// launch bound's minimum),
// HAS_BIAS, SPLIT, PDL. WGMMA(acc, desc_a, desc_b), the m64n(BN/WN)k16 instruction with both
// operands from shared memory, and WGMMA_RS(acc, a0, a1, a2, a3, desc_b), the same with A from
// registers, are defined before this source (`w4a16_ws.py` writes them), as are
// the helpers of `w4a16_device.cuh`, `wgmma_device.cuh` and `w4a16_unpack.cuh`.

#define KS 64  // inputs a stage
#define CONSUMERS (WM * WN)
#define THREADS (128 * (CONSUMERS + 1))
#define NW (BN / WN)                // activation rows of a consumer's wgmma
#define X_BYTES (BN * 128)          // a stage's x tile
#define A_BYTES (64 * 128)          // a stage's tile of one 64-row weight block
#define STAGE_BYTES (X_BYTES + WM * A_BYTES)
#define ROWS (64 * WM)
#define SUM_OUTPUTS 8  // outputs a thread of the split-K sum takes at once
#define SUM_SPLITS 4   // splits whose loads it issues together
static_assert(NW % 8 == 0 && NW <= 256, "a consumer's rows: whole 8-row atoms, wgmma's N");

// @WGMMA@

extern "C" __global__ void __launch_bounds__(THREADS, CTAS_PER_SM)
    pagoda_w4a16_ws(u16* __restrict__ y, const u16* __restrict__ xt,
                    const u32* __restrict__ qweight, const u16* __restrict__ scales,
                    const u8* __restrict__ zeros, const u16* __restrict__ bias,
                    float* __restrict__ partial, int* __restrict__ counters, int M, int N, int K,
                    int G, int stride_y, int stages_per_split) {
  extern __shared__ unsigned char smem_raw[];  // STAGES x (x tile, WM weight tiles), aligned
#if SPLIT
  __shared__ int last_split;
#endif
  __shared__ __align__(8) unsigned long long full[STAGES];   // x copied, weights stored
  __shared__ __align__(8) unsigned long long empty[STAGES];  // every consumer warp is done
  const u32 tiles = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.x * BN, n0 = blockIdx.y * ROWS;
  const int stages = K / KS;
  const int s_begin = blockIdx.z * stages_per_split;
  const int nsteps = min(stages, s_begin + stages_per_split) - s_begin;
  const u32 full0 = smem_addr(full), empty0 = smem_addr(empty);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 128 + 1);  // the dequantizing threads and the copy's bytes
      mbar_init(empty0 + 8 * s, 4 * CONSUMERS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp >= 4 * CONSUMERS) {  // the dequantizing warpgroup
    const int d = tid - 128 * CONSUMERS, unit = d & 1, r = d >> 1;
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    // This thread's rows (past N: row N - 1, never stored), their scales and zeros.
    const uint4* wp[WM];
    const u16* sp[WM];
    const u8* zp[WM];
    const int group_stages = G / KS;
    int group_left = group_stages - s_begin % group_stages;  // stages left in the group
    const long long group_off = (long long)(s_begin / group_stages) * N;
#pragma unroll
    for (int q = 0; q < WM; ++q) {
      const int row = min(n0 + 64 * q + r, N - 1);
      wp[q] = reinterpret_cast<const uint4*>(qweight + (long long)row * (K / 8)) + unit +
              2 * s_begin;
      sp[q] = scales + group_off + row;
      zp[q] = zeros + group_off + row;
    }
#if RING
    uint4 wv[1][WM];  // this stage's, read back from the ring
#else
    uint4 wv[DEPTH][WM];
#endif
    u32 sc[DEPTH][WM], zr[DEPTH][WM];
    // Called for i = 0, 1, 2, ... in turn: each call moves the pointers one stage on.
    auto load_weights = [&](int i, uint4(&wv_)[WM], u32(&sc_)[WM], u32(&zr_)[WM]) {
      if (i < nsteps) {
#pragma unroll
        for (int q = 0; q < WM; ++q) {
#if !RING
          wv_[q] = ld_weights(wp[q], policy);
          wp[q] += 2;
#endif
          sc_[q] = ld_nc_u16(sp[q]);
          zr_[q] = ld_nc_u8(zp[q]);
        }
        if (--group_left == 0) {
          group_left = group_stages;
#pragma unroll
          for (int q = 0; q < WM; ++q) sp[q] += N, zp[q] += N;
        }
      }
    };
#if RING
    // Slot j % RING of the ring holds this thread's 16-byte units of stage j (one per weight
    // block), copied RING - 1 stages ahead; one commit group a stage, empty past the last.
    const u32 ring0 = tiles + STAGES * STAGE_BYTES + 16 * d;
    auto copy_weights = [&](int i) {
      if (i < nsteps) {
#pragma unroll
        for (int q = 0; q < WM; ++q) {
          asm volatile(
              "cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(
                  ring0 + ((i % RING) * WM + q) * 2048),
              "l"(wp[q]), "l"(policy)
              : "memory");
          wp[q] += 2;
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int j = 0; j < RING - 1; ++j) copy_weights(j);
#endif
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) load_weights(j, wv[RING ? 0 : j], sc[j], zr[j]);
    grid_wait();  // xt is written by the kernel before (`tile_x`)
    launch_dependents();
    const u16* xsrc = xt + ((long long)blockIdx.x * stages + s_begin) * (X_BYTES / 2);
    // Where this thread's chunks go in a weight tile: row r, chunk 4 unit + u at its swizzle.
    const u32 row_off = r * 128, sw = r & 7;
    for (int i0 = 0; i0 < nsteps; i0 += DEPTH) {
#pragma unroll
      for (int j = 0; j < DEPTH; ++j) {
        const int i = i0 + j;
        if (i < nsteps) {
          const int s = i % STAGES;
          const u32 stage = tiles + s * STAGE_BYTES, bar = full0 + 8 * s;
          if (i >= STAGES) mbar_wait(empty0 + 8 * s, (i / STAGES - 1) & 1);
          if (d == 0) {
            mbar_expect_tx(bar, X_BYTES);
            bulk_load(stage, xsrc + (long long)i * (X_BYTES / 2), X_BYTES, bar);
          }
#if RING
          copy_weights(i + RING - 1);
          asm volatile("cp.async.wait_group %0;" ::"n"(RING - 1) : "memory");
#pragma unroll
          for (int q = 0; q < WM; ++q) {
            const u32 at = ring0 + ((i % RING) * WM + q) * 2048;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(wv[0][q].x), "=r"(wv[0][q].y), "=r"(wv[0][q].z), "=r"(wv[0][q].w)
                         : "r"(at)
                         : "memory");
          }
#endif
#pragma unroll
          for (int q = 0; q < WM; ++q) {
            const u32 zoff = MAGIC | (zr[j][q] * 0x10001u), s2 = scale2(sc[j][q]);
            const u32 block = stage + X_BYTES + q * A_BYTES + row_off;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              const u32 word = part(wv[RING ? 0 : j][q], u);
              const u32 dst = block + (((4 * unit + u) ^ sw) << 4);
              asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst),
                           "r"(weight_pair<0>(word, zoff, s2)), "r"(weight_pair<1>(word, zoff, s2)),
                           "r"(weight_pair<2>(word, zoff, s2)), "r"(weight_pair<3>(word, zoff, s2))
                           : "memory");
            }
          }
          load_weights(i + DEPTH, wv[RING ? 0 : j], sc[j], zr[j]);
          // The stores are read by wgmma (the async proxy): fenced before the arrival.
#if !A_REGS
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
          mbar_arrive(bar);
        }
      }
    }
  } else {  // a consumer warpgroup
    const int c = warp / 4;
    const int wm = c / WN, wn = c % WN;
    float acc[NW / 2];
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) acc[i] = 0.f;
    grid_wait();  // y may still be read by the kernel before
    launch_dependents();
#if A_REGS
    // Lane l's row of the weight tile for ldmatrix.x4 (matrix l / 8 of a k16 step: rows
    // 16 (warp % 4) + 8 ((l / 8) % 2) + l % 8, inputs 8 (l / 16) .. +8), so that its four
    // registers are the A fragment of m64k16 as wgmma takes it from registers.
    const int arow = 16 * (warp & 3) + 8 * ((lane >> 3) & 1) + (lane & 7);
    const u32 a_row = wm * A_BYTES + arow * 128, a_sw = arow & 7, a_half = lane >> 4;
    u32 a[2][KS / 16][4];  // two buffers: a stage's wgmmas may still read the one before
#endif
    for (int i0 = 0; i0 < nsteps; i0 += 2) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int i = i0 + b;
        if (i < nsteps) {
          const int s = i % STAGES;
          mbar_wait(full0 + 8 * s, (i / STAGES) & 1);
          const u32 stage = tiles + s * STAGE_BYTES;
          const unsigned long long db = swizzled_desc(stage + wn * NW * 128);
#if A_REGS
#pragma unroll
          for (int kk = 0; kk < KS / 16; ++kk) {
            const u32 at = stage + X_BYTES + a_row + (((2 * kk + a_half) ^ a_sw) << 4);
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                         : "=r"(a[b][kk][0]), "=r"(a[b][kk][1]), "=r"(a[b][kk][2]),
                           "=r"(a[b][kk][3])
                         : "r"(at)
                         : "memory");
          }
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < KS / 16; ++kk)
            WGMMA_RS(acc, a[b][kk][0], a[b][kk][1], a[b][kk][2], a[b][kk][3], db + 2 * kk);
#else
          const unsigned long long da = swizzled_desc(stage + X_BYTES + wm * A_BYTES);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < KS / 16; ++kk) WGMMA(acc, da + 2 * kk, db + 2 * kk);
#endif
          wgmma_commit();
          wgmma_wait<1>();  // the stage before's wgmmas are done: it is free
          if (i > 0) {
            __syncwarp();
            if (lane == 0) mbar_arrive(empty0 + 8 * ((i - 1) % STAGES));
          }
        }
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NW / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // after the wait

    // acc[4j + e] of warp w: weight row n0 + 64 wm + 16 w + g + 8 (e / 2), activation row
    // m0 + wn NW + 8j + 2t + e % 2.
    const int g = lane >> 2, t = lane & 3;
    const int nb = n0 + 64 * wm + 16 * (warp & 3) + g, mb = m0 + wn * NW + 2 * t;
#pragma unroll
    for (int j = 0; j < NW / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = nb + 8 * (e >> 1), m = mb + 8 * j + (e & 1);
        if (n < N && m < M) {
#if SPLIT
          partial[blockIdx.z * (long long)M * N + (long long)m * N + n] = acc[4 * j + e];
#else
          float v = acc[4 * j + e];
#if HAS_BIAS
          v += to_f32<BF16>(bias[n]);
#endif
          y[(long long)m * stride_y + n] = from_f32(v);
#endif
        }
      }
  }

#if SPLIT
  const long long split_size = (long long)M * N;
  __threadfence();
  __syncthreads();
  int* counter = counters + blockIdx.y * gridDim.x + blockIdx.x;
  if (tid == 0) last_split = atomicAdd(counter, 1) == (int)gridDim.z - 1;
  __syncthreads();
  if (!last_split) return;
  __threadfence();
  // The last CTA sums the tile's splits in split order (the same bits every call), every
  // thread SUM_OUTPUTS outputs at a time (consecutive threads, consecutive outputs), the loads
  // of up to SUM_SPLITS splits in flight together.
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
#endif
}
