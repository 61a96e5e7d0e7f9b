// Device helpers of the wgmma kernels (`w4a16_wgmma.cu`, `w8a8_wgmma.cu`; sm_90a), put after
// `w4a16_device.cuh` before each source by its Python side.

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// The descriptor of a K-major tile at `tile` (1024-aligned, rows of 128 bytes in the 128-byte
// swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)): start address, leading offset 16
// (unused by the swizzled layout), stride 1024 bytes between 8-row atoms, 128-byte swizzle.
// Shared memory ends below 256 KB, so adding a chunk's byte offset / 16 to it never carries
// out of the 14-bit address field.
__device__ __forceinline__ unsigned long long swizzled_desc(u32 tile) {
  return (unsigned long long)((tile & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) |
         (1ull << 62);
}

// A CUtensorMap (`cuda_launch.tensor_map`), passed as a __grid_constant__ parameter.
struct __align__(64) TensorMap {
  unsigned long long opaque[16];
};

// Box (k, row) of `map` into shared `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load(u32 dst, const TensorMap* map, int k, int row, u32 bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(k), "r"(row), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(map))
               : "memory");
}
