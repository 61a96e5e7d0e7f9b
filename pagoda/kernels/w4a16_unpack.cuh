// Unpacking 4-bit weights into 16-bit A operands, for the W4A16 wgmma kernels
// (`w4a16_wgmma.cu`, `w4a16_ws.cu`), put after `w4a16_device.cuh` by their Python sides.
// BF16 (0: fp16) and SCALES_BF16 (0: fp16 scales) are defined before it.

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
