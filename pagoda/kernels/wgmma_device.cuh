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
