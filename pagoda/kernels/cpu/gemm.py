"""The bf16 GEMM on pre-packed weights (`gemm.h`): packing, unpacking and the product.

A linear layer's `[N, K]` bf16 weight is packed once after loading into 16-column panels,
`[ceil(N/16), ceil(K/2), 16, 2]` (zero padded): each 32-bit lane holds one column's (k, k+1)
pair, the operand layout of `vdpbf16ps`; the other ISA levels split the same lane into two fp32
values by a mask and a shift, so one layout serves every level. The packed tensor replaces the
plain one (one copy in memory) and carries the logical shape as `packed_shape`; the plain
layout is `unpack_weight`'s copy, for the torch reference path.

Dispatch: packed layers take this kernel for every row count, F.linear never (so no plain
copy is kept). Measured on a 2-core Zen 5 (avx512_bf16, no AMX), weights cycled through more
than the L3 as at decode (`python benchmarks/cpu_ops_bench.py --rows ...`), speedup of the
packed kernel over oneDNN's F.linear:

    M rows        1     8    16    32    64   128   256   512  2048
    960x576     2.3x  2.6x  2.5x  2.3x  2.5x  1.9x  1.6x  1.3x  1.2x
    3072x576    2.6x  2.9x  2.9x  2.7x  2.0x  1.6x  1.3x  1.2x  1.2x
    576x1536    2.4x  2.1x  2.1x  1.8x  2.1x  1.6x  1.4x  1.2x  1.2x
    49152x576   2.1x  2.5x  2.5x  2.3x  1.6x  1.5x  1.1x  1.2x   (LM head)

~950 GFLOP/s from 256 rows up and 700-830 at 32 (the vdpbf16ps peak of two cores is ~950).
On a Zen 3 (avx2: a 4-row x 16-column FMA tile), one thread, the machine shared with other
work (`--threads 1 --stat min`): 35-59 GFLOP/s from 8 to 64 rows (86-90 with the weights in
L2 and the core to itself), 1.1-3.0x torch's float32 F.linear and 4-7x its bf16 one (which
runs at ~9 GFLOP/s there). On an AVX512_BF16 Xeon the avx512 level's FMA tile (210-235
GFLOP/s on two cores) outran vdpbf16ps (150-170); on the Zen 5 above vdpbf16ps's ~950 is past
what two cores' FMAs can reach (~600), which is why avx512_bf16 keeps it.

On a CPU with AMX-BF16 the packed layout is also AMX's B-tile layout, and from 8 rows
(`amx_min_rows()`) the product runs on AMX tiles (`gemm_amx.h`; `$PAGODA_CPU_AMX=0` leaves them out). On 2
cores of an Intel Xeon with AMX (`python benchmarks/cpu_ops_bench.py`, and the two paths alone,
interleaved): 1.3-1.5x the register tiles at 8 rows, 2.1-2.7x at 16, 6.5-8.6x at 256 (1.25-1.5
TFLOP/s) and up to 1.8 TFLOP/s at 2048 rows, where the register tiles hold ~190-210 GFLOP/s;
at 1-4 rows the two stream the weights alike (0.85-1.05x), so the register tiles keep them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.cpu.ops import _check, _lib, cpu_ops_available, gemm_operands

PANEL = 16  # output columns per packed panel: one zmm (two ymm) of fp32 accumulators


def packing_supported(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight, and the C ops built: what `pack_weight` takes."""
    return (
        weight.dim() == 2
        and weight.dtype is torch.bfloat16
        and weight.device.type == "cpu"
        and weight.numel() > 0
        and cpu_ops_available()
    )


def pack_weight(weight: torch.Tensor) -> nn.Parameter:
    """[N, K] -> the packed [ceil(N/16), ceil(K/2), 16, 2] parameter (`packed_shape` = (N, K)):
    element (n, k) lands at [n // 16, k // 2, n % 16, k % 2]. It replaces the plain weight in
    the module (`module.weight = pack_weight(module.weight.data)`)."""
    n, k = weight.shape
    panels, pairs = -(-n // PANEL), -(-k // 2)
    padded = F.pad(weight, (0, 2 * pairs - k, 0, panels * PANEL - n))
    packed = padded.view(panels, PANEL, pairs, 2).transpose(1, 2).contiguous()
    param = nn.Parameter(packed, requires_grad=False)
    param.packed_shape = (n, k)
    return param


def is_packed(weight: torch.Tensor) -> bool:
    return getattr(weight, "packed_shape", None) is not None


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight of a packed one (a copy)."""
    n, k = packed.packed_shape
    panels, pairs = packed.shape[:2]
    return packed.transpose(1, 2).reshape(panels * PANEL, 2 * pairs)[:n, :k].contiguous()


def packed_linear_supported(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """bf16 CPU x [..., K] for a packed weight of K inputs (else F.linear's shape error)."""
    return (
        x.dtype is torch.bfloat16
        and x.device.type == "cpu"
        and x.shape[-1] == packed.packed_shape[1]
        and cpu_ops_available()
    )


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x @ W.T (+ bias) for x [..., K] and W packed by `pack_weight`: [..., N] in bf16, or
    float32 (`out_dtype`, for logits); fp32 accumulation, one rounding at the end."""
    n, k = packed.packed_shape
    x2, out, bias = gemm_operands(x, n, k, bias, out_dtype)
    rc = _lib().pagoda_gemm_packed(
        x2.data_ptr(),
        max(x2.stride(0), k),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        n,
        out_dtype is torch.float32,
        x2.shape[0],
        n,
        k,
        torch.get_num_threads(),
    )
    _check(rc, "pagoda_gemm_packed")
    return out


def amx_active() -> bool:
    """Whether the packed GEMM runs AMX tiles here (`gemm_amx.h`): a CPU with AMX-BF16, a
    compiler that knows it, `$PAGODA_CPU_AMX` not 0 and the OS's grant."""
    return cpu_ops_available() and bool(_lib().pagoda_gemm_amx())


def set_amx_min_rows(rows: int) -> int:
    """Row count from which the packed GEMM takes the AMX tiles (gemm_amx.h's `amx_min_rows`,
    8 by default); returns the previous one, or -1 where the build has no tiles. For tests and
    tuning: a huge count keeps the register tiles for every call."""
    return _lib().pagoda_gemm_set_amx_min_rows(rows)


def amx_min_rows() -> int:
    """The row count from which the packed GEMM takes the AMX tiles now (-1: no tiles)."""
    rows = set_amx_min_rows(1)
    if rows > 0:
        set_amx_min_rows(rows)
    return rows


def packed_copy(module: nn.Module) -> torch.Tensor | None:
    """A packed copy of `module.weight`, made at first use and kept as `module.packed_weight`,
    for a weight that must also stay plain: the LM head, which a tied embedding shares and
    `ParallelLMHead.compute_logits` (the reference, tensor parallelism) reads. None where
    `packing_supported` says no. The copy is not refreshed if the weight changes in place."""
    packed = getattr(module, "packed_weight", None)
    if packed is None or packed.packed_shape != tuple(module.weight.shape):
        if not packing_supported(module.weight):
            return None
        packed = pack_weight(module.weight.detach())
        # Not a registered parameter: the checkpoint's tensor is module.weight.
        module.__dict__["packed_weight"] = packed
    return packed
