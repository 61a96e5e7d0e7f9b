"""Compile the CUDA W4A16 decode kernel (`pagoda/kernels/w4a16_gemv.cu`) for sm_90 with nvcc,
no GPU needed, and print its registers, spills and the instruction mix of its K-step loop
(the consumer loop: the backward branch with the fewest instructions per tensor-core MMA), per
K step of a warp. Counting is not timing (fewer instructions a step made the GEMV 2-9% faster
on an H100, but two steps an iteration with fewer still ran slower): measure on the GPU.

    python benchmarks/gemv_sass.py                               # gate_up's 1-row rule config
    python benchmarks/gemv_sass.py --m 16 --n 6144 --k 4096      # the rule's config there
    python benchmarks/gemv_sass.py --config 2,4,2,0,1,1,1,2,8,1,0,1,20 --define SILU_MUL=1

nvcc from --nvcc, else $CUDA_HOME/bin/nvcc, else the PATH; cuobjdump from Triton's bundle.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pagoda.kernels import w4a16, w4a16_gemv  # noqa: E402
from pagoda.kernels.w4a16_gemv import GemvConfig, m_tiles  # noqa: E402


def tool(name: str, given: str | None) -> str:
    import triton

    candidates = [given] if given else []
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", name))
    candidates.append(shutil.which(name) or "")
    candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin", name))
    candidates.append(f"/usr/local/cuda/bin/{name}")
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise SystemExit(f"no {name}: pass --nvcc or set CUDA_HOME")


def loop_mix(sass: str) -> tuple[int, collections.Counter]:
    """The K-step loop's instructions and HMMA count: of the loops (backward branches) that
    hold MMAs, the one with the fewest instructions per MMA."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    index = {a: i for i, (a, _) in enumerate(ins)}
    best = None
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in index:
            body = ins[index[int(m.group(1), 16)] : i + 1]
            mmas = sum("HMMA" in t for _, t in body)
            if mmas and (best is None or len(body) / mmas < len(best[0]) / best[1]):
                best = (body, mmas)
    if best is None:
        raise SystemExit("no loop with MMAs in the SASS")
    body, mmas = best
    ops = collections.Counter(
        (t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for _, t in body
    )
    return mmas, ops


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=1, help="activation rows (the rule's config)")
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument(
        "--config",
        default=None,
        help="GemvConfig fields, comma-separated: all of them, or FIELD=INT items on the rule's",
    )
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, after the rest")
    ap.add_argument("--nvcc", default=None)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--sass", default=None, help="write the SASS here")
    args = ap.parse_args(argv)
    items = args.config.split(",") if args.config else []
    if items and "=" not in items[0]:
        cfg = GemvConfig(*(int(v) for v in items))
    else:  # the rule's config, FIELD=INT items replacing its fields
        cfg = w4a16.gemv_config(args.m, args.n, args.k, args.group)
        if cfg is None:
            raise SystemExit(f"the rule takes no CUDA GEMV at m={args.m}")
        cfg = cfg._replace(**{f: int(v) for f, v in (item.split("=", 1) for item in items)})
    mt = m_tiles(args.m)
    group_steps = w4a16_gemv.group_steps(args.group, args.k)
    d = w4a16_gemv.defines(True, True, mt, cfg, False, False, group_steps, False)
    d |= {name: int(value) for name, value in (item.split("=", 1) for item in args.define)}
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "gemv.cu")
        with open(src, "w") as f:
            f.write(w4a16_gemv.source())
        cubin = os.path.join(tmp, "gemv.cubin")
        cmd = [tool("nvcc", args.nvcc), "-arch=sm_90", "-cubin", "-O3", "-Xptxas", "-v"]
        cmd += [f"-D{k}={v}" for k, v in d.items()] + ["-o", cubin, src]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(built.stderr[-2000:])
        sass = subprocess.run(
            [tool("cuobjdump", None), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    regs = re.search(r"Used (\d+) registers", built.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", built.stderr)
    mmas, ops = loop_mix(sass)
    per_step = cfg.row_tiles * mt * 8 + (mt * 8 if cfg.sum_mma else 0)
    steps = mmas / per_step
    total = sum(ops.values())
    print(f"{cfg} M_TILES={mt}")
    print(
        f"registers {regs.group(1) if regs else '?'}, spilled {spill.group(1) if spill else '?'}"
        f" / {spill.group(2) if spill else '?'} bytes (stores / loads); loop: {total}"
        f" instructions for {steps:g} K step(s): {total / steps:.0f} a step"
    )
    for op, count in ops.most_common(args.top):
        print(f"{count / steps:8.1f}  {op}")
    return {"config": list(cfg), "per_step": total / steps, "ops": dict(ops)}


if __name__ == "__main__":
    main()
