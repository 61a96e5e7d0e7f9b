"""Does Triton 3.6's Hopper warp specialization run the 8-bit TMA GEMM, and is it faster?
Each variant in its own process (a fault poisons the CUDA context): host or device-side
tensor descriptors, PDL on or off, warp-specialized or not; timed against torch._scaled_mm
on gate_up (4096 -> 28672) and down (14336 -> 4096) at 256 and 512 rows."""

import json
import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _kernel(
    a_ptr,
    b_ptr,
    a_desc,
    b_desc,
    xs_ptr,
    ws_ptr,
    c_ptr,
    M,
    N,
    K,
    ACC_INT: tl.constexpr,
    IMPRECISE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DEVICE_DESC: tl.constexpr,
    WS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    if DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K]
        )
        b_desc = tl.make_tensor_descriptor(
            b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K]
        )
    num_pid_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if ACC_INT else tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES, warp_specialize=WS):
        a = a_desc.load([pid_m * BLOCK_M, k0])
        b = b_desc.load([pid_n * BLOCK_N, k0])
        acc = tl.dot(a, b.T, acc, out_dtype=acc.dtype, max_num_imprecise_acc=IMPRECISE)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    cn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    y = acc.to(tl.float32) * tl.load(xs_ptr + rm, mask=rm < M) * tl.load(ws_ptr + cn, mask=cn < N)
    tl.store(c_ptr + rm * N + cn, y.to(tl.bfloat16), mask=(rm < M) & (cn < N))
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _time(spec: dict, dt: torch.dtype, n: int, k: int, m: int) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randint(-100, 100, (m, k), device="cuda", generator=g, dtype=torch.int8)
    b = torch.randint(-100, 100, (n, k), device="cuda", generator=g, dtype=torch.int8)
    if dt != torch.int8:
        a, b = (a.float() / 4).to(dt), (b.float() / 4).to(dt)
    xs = torch.rand(m, 1, device="cuda") / 100
    ws = torch.rand(n, device="cuda") / 100
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bm, bn, bk, st = spec["tile"]
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bn, bk])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    is_int = dt == torch.int8

    def run():
        _kernel[grid](
            a,
            b,
            ad,
            bd,
            xs,
            ws,
            c,
            m,
            n,
            k,
            ACC_INT=is_int,
            IMPRECISE=None if is_int else bk,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            NUM_STAGES=st,
            DEVICE_DESC=spec["device_desc"],
            WS=spec["ws"],
            PDL=spec["pdl"],
            launch_pdl=spec["pdl"],
            num_warps=4,
        )

    run()
    torch.cuda.synchronize()
    ref = (a.float() @ b.float().T) * xs * ws
    err = float((c.float() - ref).norm() / ref.norm())
    us = triton.testing.do_bench(run, warmup=20, rep=200) * 1e3
    if is_int:
        lib = triton.testing.do_bench(lambda: torch._int_mm(a, b.T), warmup=20, rep=200)
    else:
        w_row = ws[None, :].contiguous()
        lib = triton.testing.do_bench(
            lambda: torch._scaled_mm(a, b.T, xs, w_row, out_dtype=torch.bfloat16),
            warmup=20,
            rep=200,
        )
    return round(us, 1), round(lib * 1e3, 1), f"{err:.1e}"


def one(spec: dict) -> dict:
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    dt = torch.int8 if spec["dtype"] == "int8" else torch.float8_e4m3fn
    out = {}
    for name, (n, k) in (("gate_up", (28672, 4096)), ("down", (4096, 14336))):
        for m in (256, 512):
            out[f"{name}@{m}"] = _time(spec, dt, n, k, m)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one(json.loads(sys.argv[1]))))
        sys.exit(0)
    for dtype in ("fp8", "int8"):
        for tile in ((128, 128, 128, 3), (128, 256, 128, 3)):
            for dd, ws, pdl in ((0, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1)):
                spec = dict(
                    dtype=dtype, tile=tile, device_desc=bool(dd), ws=bool(ws), pdl=bool(pdl)
                )
                try:
                    r = subprocess.run(
                        [sys.executable, __file__, json.dumps(spec)],
                        capture_output=True,
                        text=True,
                        timeout=40,
                    )
                    res = (
                        r.stdout.strip().splitlines()[-1]
                        if r.returncode == 0
                        else ("FAIL " + r.stderr.strip().splitlines()[-1][:200])
                    )
                except subprocess.TimeoutExpired:
                    res = "TIMEOUT (40 s)"
                print(dtype, tile, f"device_desc={dd} ws={ws} pdl={pdl}:", res, flush=True)
