// Device helpers of the CUDA W4A16 kernels (`w4a16_gemv.cu`, `w4a16_wgmma.cu`) and of the W8A8
// one (`w8a8_wgmma.cu`), put before each source by its Python side. BF16 (0: fp16 x, bias and
// y) and PDL are defined before it.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#if BF16
#define MAGIC 0x43004300u  // bf16 128.0 in both halves: OR-ing q into the mantissa gives 128 + q
#define OFFSET 128.f
#else
#define MAGIC 0x64006400u  // fp16 1024.0
#define OFFSET 1024.f
#endif

template <bool IS_BF16>
__device__ __forceinline__ float to_f32(u16 v) {
  if (IS_BF16) return __uint_as_float(((u32)v) << 16);
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
  return r;
}

__device__ __forceinline__ u16 from_f32(float v) {
  u16 r;
#if BF16
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
#else
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(v));
#endif
  return r;
}

// Weights are read once: no L1 allocation, first out of L2.
__device__ __forceinline__ uint4 ld_weights(const uint4* p, unsigned long long policy) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p), "l"(policy));
  return r;
}

__device__ __forceinline__ uint4 ld_nc_v4(const void* p) {
  uint4 r;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ u32 ld_nc_u16(const u16* p) {
  unsigned short r;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 ld_nc_u8(const u8* p) {
  unsigned short r;
  asm("ld.global.nc.u8 %0, [%1];" : "=h"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ u32 part(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}

// mbarriers and bulk copies (the TMA unit without a tensor map; sm_90), on shared-memory
// addresses (`smem_addr`).
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

// The barrier's current phase also waits for `bytes` more of bulk copies.
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// `bytes` from global `src` to shared `dst`, completing on `bar`.
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// The same with an L2 cache policy (`createpolicy`).
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar,
                                          unsigned long long policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}

// Thread-block clusters (sm_90): a barrier across the cluster's threads, and shared-memory
// operations on the cluster's CTA `rank` (its address of the same variable by `mapa`).
__device__ __forceinline__ void cluster_sync() {
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ u32 cluster_addr(u32 addr, u32 rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

__device__ __forceinline__ void ld_cluster_to(int& v, u32 addr) {
  asm volatile("ld.shared::cluster.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
}

__device__ __forceinline__ void ld_cluster_to(float& v, u32 addr) {
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
}

// A tile's K split among the `ranks` CTAs of a cluster (the W8A8 and W4A16 wgmma kernels):
// each of the THREADS threads holds N accumulators; ranks 1.. leave theirs in their own shared
// memory at `part` (accumulator j of thread tid at word j * THREADS + tid: a warp's 32 words
// consecutive, no bank conflicts), and after a barrier across the cluster (release / acquire)
// rank 0 adds them to its own in rank order, read through distributed shared memory; a second
// barrier keeps the others' shared memory until it has. Every thread of every CTA of the
// cluster calls it. True for rank 0, which goes on to the epilogue alone.
template <int THREADS_, int N, typename T>
__device__ __forceinline__ bool cluster_sum(T (&acc)[N], T* part, int tid, u32 rank, u32 ranks) {
  if (rank > 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) part[j * THREADS_ + tid] = acc[j];
  }
  cluster_sync();
  if (rank == 0) {
    for (u32 r = 1; r < ranks; ++r) {
      const u32 peer = cluster_addr(smem_addr(part + tid), r);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        T v;
        ld_cluster_to(v, peer + 4u * (j * THREADS_));
        acc[j] += v;
      }
    }
  }
  cluster_sync();
  return rank == 0;
}

// One arrival on the mbarrier at `bar` of CTA `rank`. Release at CTA scope, as CUTLASS's
// cluster barriers arrive: what it orders are this warp's reads of shared memory by wgmma,
// complete before the arrival (`wgmma_wait`); at cluster scope the release fences this
// thread's memory operations GPU-wide, ~0.5 us an arrival (a K step's worth).
__device__ __forceinline__ void mbar_arrive_at(u32 bar, u32 rank) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr(bar, rank))
               : "memory");
}

// PDL (compiled in where PDL is 1): the kernel may start while the one before it in the stream
// is still running. The weights, scales and zero points never change, so a CTA loads its first
// ones before `grid_wait`; x (the kernel before may be writing it) and y (it may still be
// reading that memory) come after. `launch_dependents` then lets the next such kernel start
// its own loads while this one finishes. Both are no-ops in a launch without the attribute.
__device__ __forceinline__ void grid_wait() {
#if PDL && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if PDL && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
