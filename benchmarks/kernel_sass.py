"""Compile the decode attention kernel for an H100/H200 (sm_90) on any machine, no GPU needed,
and print the instruction mix of its KV loop from the SASS (Triton ships ptxas and cuobjdump).

The KV loop is the kernel's hot path: instructions per warp per tile, times warps, over the
tile's tokens gives the issue cost of one (token, KV head) pair, and the mix shows what a change
does (e.g. byte-wise shared-memory loads `LDS.U8` where Triton converts FP8 values after the
layout change for a dot). Counting is not timing: a variant that cut the FP8 loop from 2,272 to
1,710 instructions per warp ran 18% slower on the H200 (benchmarks/README.md says how to
reproduce both); measure there.

    python benchmarks/kernel_sass.py                                # FP8 e4m3, the defaults
    python benchmarks/kernel_sass.py --kv bf16 --tile 64 --warps 4  # bf16 decode
    python benchmarks/kernel_sass.py --top 40 --sass out.sass       # more rows, keep the SASS
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagoda.attention.triton.unified_attention import _unified_attention_kernel  # noqa: E402

KV_TYPES = {"bf16": "bf16", "e4m3": "fp8e4nv", "e5m2": "fp8e5"}


def signature(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, object]]:
    """Argument types and constexpr values of one decode launch (Llama-3-8B heads)."""
    quant = args.kv != "bf16"
    constexprs = {
        "NUM_HEADS": args.heads,
        "NUM_QUERIES_PER_KV": args.heads // args.kv_heads,
        "BLOCK_SIZE": args.block_size,
        "TILE_SIZE": args.tile,
        "HEAD_SIZE": args.head_size,
        "HEAD_SIZE_PADDED": triton.next_power_of_2(args.head_size),
        "BLOCK_Q": 16 // (args.heads // args.kv_heads),
        "BLOCK_M": 16,
        "NUM_SEGMENTS": 1,
        "IS_SPLIT": False,
        "KV_QUANT": quant,
        "DOT_PRECISION": "tf32",
        "FP16_DOTS": quant,
        "HEADS_FASTEST": False,
    }
    pointers = {"q_ptr": "*bf16", "kv_cache_ptr": f"*{KV_TYPES[args.kv]}"}
    types = {}
    for p in _unified_attention_kernel.params:
        if p.is_constexpr:
            if p.name not in constexprs:
                raise SystemExit(f"kernel_sass.py does not know constexpr {p.name}: add it")
            types[p.name] = "constexpr"
        elif p.name.endswith("_ptr"):
            types[p.name] = pointers.get(
                p.name,
                "*i32" if "lens" in p.name or "loc" in p.name or "tables" in p.name else "*fp32",
            )
        elif p.name.startswith("stride"):
            types[p.name] = "i64"
        else:
            types[p.name] = "fp32" if p.name == "qk_scale" else "i32"
    return types, constexprs


def compile_sass(args: argparse.Namespace) -> tuple[str, str]:
    types, constexprs = signature(args)
    # The runtime specializes 16-aligned pointers and strides: say so, as a launch would.
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, t) in enumerate(types.items())
        if t.startswith("*") or name.startswith("stride")
    }
    src = ASTSource(
        fn=_unified_attention_kernel, signature=types, constexprs=constexprs, attrs=attrs
    )
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": args.warps, "num_stages": args.stages},
    )
    cuobjdump = os.path.join(
        os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass, usage = (
            subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True, check=True)
            for flag in ("-sass", "-res-usage")
        )
    return sass.stdout, occupancy(usage.stdout, kernel.metadata.shared, args.warps)


def occupancy(res_usage: str, shared: int, warps: int) -> str:
    """Registers per thread, shared memory per program, and the programs (and warps) one SM
    holds by those two (65,536 registers in units of 8 per thread, 228 KB of shared memory of
    which 1 KB per program is reserved, at most 32 programs and 64 warps)."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", res_usage)
    regs, stack = int(m.group(1)), int(m.group(2))
    by_regs = 65536 // (-(-regs // 8) * 8 * 32 * warps)
    by_smem = 228 * 1024 // (shared + 1024)
    programs = min(by_regs, by_smem, 32, 64 // warps)
    return (
        f"{regs} registers a thread ({stack} B of stack: spills), {shared} B shared memory: "
        f"{programs} programs ({programs * warps} warps) per SM"
    )


def loop_mix(sass: str) -> tuple[int, dict[str, int]]:
    """(instructions, opcode -> count) of the code between the longest backward branch and its
    target: the KV loop."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    loop = None
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            if loop is None or addr - start > loop[1] - loop[0]:
                loop = (start, addr)
    if loop is None:
        raise SystemExit("no loop found in the SASS")
    mix: dict[str, int] = {}
    body = [text for addr, text in code if loop[0] <= addr <= loop[1]]
    for text in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        mix[op] = mix.get(op, 0) + 1
    return len(body), mix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", choices=sorted(KV_TYPES), default="e4m3")
    p.add_argument("--tile", type=int, default=128)
    p.add_argument("--warps", type=int, default=2)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--top", type=int, default=20, help="opcodes to list")
    p.add_argument("--sass", help="also write the whole SASS here")
    args = p.parse_args()
    sass, resources = compile_sass(args)
    print(resources)
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    n, mix = loop_mix(sass)
    per_pair = n * args.warps / args.tile
    print(
        f"KV loop: {n} instructions per warp per {args.tile}-token tile, {args.warps} warps: "
        f"{per_pair:.1f} warp-instructions per (token, KV head)"
    )
    for op, count in sorted(mix.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"  {count:6d}  {op}")


if __name__ == "__main__":
    main()
