"""How fast the W4A16 GEMV's weight ring can stream at all: its copy pattern with no
arithmetic, against a plain read of the same bytes and the GEMV itself (the rule's config, one
activation row), for the Llama-3-8B layers. Cold weights (copies cycled past L2), CUDA graphs.

    python ring_copy.py            # on a GPU (sm_90)

Copy modes, each a CTA of one producer warp and WARPS consumer warps streaming ROWS rows of
`row_bytes` bytes, CHUNK_BYTES of each row a stage, STAGES stages:
  rows    one bulk copy per row and stage (the GEMV's pattern: ROWS pieces `row_bytes` apart)
  packed  the same copies, of a layout where a stage's rows are contiguous (a repack)
  one     one bulk copy per stage of that contiguous layout
Consumers wait for each stage, read it from shared memory 16 bytes a lane (with READ) and
release it.
"""

import functools
import os
import sys

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../../../.."
sys.path[:0] = [ROOT, ROOT + "/benchmarks"]

import torch  # noqa: E402

from pagoda.kernels import cuda_launch  # noqa: E402

HEADER = open(ROOT + "/pagoda/kernels/w4a16_device.cuh").read()

SOURCE = r"""
#define PITCH (MODE == 0 ? CHUNK_BYTES + 64 : CHUNK_BYTES)
#define STAGE_BYTES (ROWS * PITCH)
extern "C" __global__ void __launch_bounds__((WARPS + 1) * 32)
    ring_copy(const unsigned char* __restrict__ w, u32* out, int row_bytes) {
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  extern __shared__ __align__(128) unsigned char ring_bytes[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = row_bytes / CHUNK_BYTES;
  const unsigned char* block = w + (long long)blockIdx.x * ROWS * row_bytes;
  if (threadIdx.x == 0) {
    for (int st = 0; st < STAGES; ++st) {
      mbar_init(smem_addr(&full[st]), 1);
      mbar_init(smem_addr(&empty[st]), WARPS);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == WARPS) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int c = 0; c < chunks; ++c) {
      const int st = c % STAGES;
      if (c >= STAGES) mbar_wait(smem_addr(&empty[st]), ((c / STAGES) - 1) & 1);
      if (lane == 0) mbar_expect_tx(smem_addr(&full[st]), ROWS * CHUNK_BYTES);
      __syncwarp();
      const u32 dst = smem_addr(ring_bytes + st * STAGE_BYTES);
#if MODE == 0
      if (lane < ROWS)
        bulk_load(dst + lane * PITCH, block + (long long)lane * row_bytes + c * CHUNK_BYTES,
                  CHUNK_BYTES, smem_addr(&full[st]), policy);
#elif MODE == 1
      if (lane < ROWS)
        bulk_load(dst + lane * PITCH, block + (c * ROWS + lane) * CHUNK_BYTES, CHUNK_BYTES,
                  smem_addr(&full[st]), policy);
#else
      if (lane == 0)
        bulk_load(dst, block + c * ROWS * CHUNK_BYTES, ROWS * CHUNK_BYTES, smem_addr(&full[st]),
                  policy);
#endif
    }
  } else {
    u32 acc = 0;
    for (int c = 0; c < chunks; ++c) {
      const int st = c % STAGES;
      mbar_wait(smem_addr(&full[st]), (c / STAGES) & 1);
#if READ
      const unsigned char* stage = ring_bytes + st * STAGE_BYTES;
      for (int i = warp * 32 + lane; i < ROWS * CHUNK_BYTES / 16; i += WARPS * 32) {
        const int r = i / (CHUNK_BYTES / 16), col = i % (CHUNK_BYTES / 16);
        const uint4 v = *reinterpret_cast<const uint4*>(stage + r * PITCH + col * 16);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
#endif
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty[st]));
    }
    if (acc == 0x12345678u) out[0] = acc;
  }
}
"""

PLAIN_SOURCE = r"""
// A plain streaming read: each thread 16-byte loads, grid-stride.
extern "C" __global__ void __launch_bounds__(256) plain_read(const uint4* __restrict__ w,
                                                             u32* out, int n16) {
  u32 acc = 0;
  for (int i = blockIdx.x * 256 + threadIdx.x; i < n16; i += gridDim.x * 256) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(w + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;
}
"""

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COLD_BYTES = 400e6
# The GEMV with chunks of (K steps, stages) in place of the rule's: whole rows (one chunk) too.
ALTERNATES = {
    "qkv": ((32, 1), (8, 4)), "o": ((32, 1), (8, 4)), "gate_up": ((16, 2), (32, 1)),
    "down": ((32, 2), (56, 2), (112, 1)),
}  # fmt: skip  # copies cycled: each launch reads bytes not in L2


def graph_time(launches: list, reps: int = 5) -> float:
    """Microseconds a launch, the launches captured in one CUDA graph (best of reps)."""
    for f in launches[:2]:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in launches:
            f()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / len(launches))
    return best


def launcher(kernel, grid: int, block: int, smem: int, args: list):
    return lambda: cuda_launch.launch(kernel.func, (grid, 1, 1), block, smem, args, args[0].device)


def copies(nbytes: int) -> list[torch.Tensor]:
    count = max(2, int(COLD_BYTES // nbytes) + 1)
    return [
        torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda") for _ in range(count)
    ]


@functools.cache
def ring_kernel(mode: int, rows: int, chunk_bytes: int, stages: int, warps: int, read: int):
    d = dict(BF16=1, PDL=0, MODE=mode, ROWS=rows, CHUNK_BYTES=chunk_bytes, STAGES=stages,
             WARPS=warps, READ=read)  # fmt: skip
    pitch = chunk_bytes + 64 if mode == 0 else chunk_bytes
    smem = stages * rows * pitch
    k = cuda_launch.build(HEADER + SOURCE, "ring_copy", d, "ring_copy", smem)
    cuda_launch.fit_shared_carveout(k.func, (warps + 1) * 32, smem, torch.cuda.current_device())
    return k, smem


def main() -> None:
    from w4a16_bench import GROUP, packed_layer

    from pagoda.kernels.skinny_gemm import prepare
    from pagoda.kernels.w4a16 import choose_config, w4a16_linear

    prepare("cuda")
    print(torch.cuda.get_device_name(), flush=True)
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    plain = cuda_launch.build(HEADER + PLAIN_SOURCE, "plain_read", dict(BF16=1, PDL=0), "plain", 0)
    variants = [  # (mode, rows, chunk bytes, stages, warps, read)
        (0, 32, 512, 2, 4, 1), (0, 32, 512, 2, 4, 0), (1, 32, 512, 2, 4, 1),
        (2, 32, 512, 2, 4, 1), (0, 32, 512, 4, 4, 1), (2, 32, 512, 4, 4, 1),
        (0, 16, 1024, 2, 8, 1), (2, 16, 1024, 2, 8, 1), (0, 32, 1024, 2, 8, 1),
        (2, 32, 1024, 2, 8, 1), (2, 32, 2048, 2, 4, 1), (0, 32, 2048, 2, 4, 1),
        (0, 16, 2048, 2, 4, 1), (2, 16, 2048, 2, 4, 1), (0, 16, 3584, 2, 8, 1),
        (0, 16, 7168, 1, 8, 1), (2, 16, 3584, 2, 8, 1),
    ]  # fmt: skip
    names = {0: "rows", 1: "packed", 2: "one"}
    for layer, (n, k) in SHAPES.items():
        nbytes = n * k // 2
        bufs = copies(nbytes)
        line = [f"{layer:8s} {nbytes / 1e6:6.1f} MB"]
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        n16 = nbytes // 16

        for blocks in (sms * 4, sms * 8, sms * 16):
            us = graph_time([launcher(plain, blocks, 256, 0, [b, out, n16]) for b in bufs])
            line.append(f"plain x{blocks // sms}: {us:6.2f} us {nbytes / us / 1e6:5.2f} TB/s")
        print(" | ".join(line), flush=True)
        row_bytes = k // 2
        for v in variants:
            mode, rows, chunk_bytes, stages, warps, read = v
            if row_bytes % chunk_bytes or n % rows:
                continue
            kern, smem = ring_kernel(*v)

            grid, block = n // rows, (warps + 1) * 32
            us = graph_time([launcher(kern, grid, block, smem, [b, out, row_bytes]) for b in bufs])
            print(f"  {names[mode]:6s} rows {rows} chunk {chunk_bytes} B stages {stages} warps "
                  f"{warps} read {read}: {us:6.2f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)  # fmt: skip
        del bufs
        gen = torch.Generator(device="cuda").manual_seed(0)
        layers = [
            packed_layer(n, k, GROUP, "cuda", gen)
            for _ in range(max(2, int(COLD_BYTES // nbytes) + 1))
        ]
        x = torch.randn(1, k, generator=gen, device="cuda", dtype=torch.bfloat16)
        cfg = choose_config(1, n, k, GROUP, sms)
        us = graph_time([lambda lay=lay, x=x: w4a16_linear(x, *lay, GROUP) for lay in layers])
        qbytes = nbytes + (k // GROUP) * n * 3
        print(f"  gemv 1 row ({cfg}): {us:6.2f} us {qbytes / us / 1e6:5.2f} TB/s", flush=True)
        for chunk, stages in ALTERNATES[layer]:  # bigger copies a row: the same kernel
            alt = cfg._replace(chunk=chunk, stages=stages)
            us = graph_time(
                [
                    lambda lay=lay, x=x, c=alt: w4a16_linear(x, *lay, GROUP, config=c)
                    for lay in layers
                ]
            )
            print(f"  gemv chunk {chunk} stages {stages}: {us:6.2f} us "
                  f"{qbytes / us / 1e6:5.2f} TB/s", flush=True)  # fmt: skip
        del layers


if __name__ == "__main__":
    main()
