"""Programmatic dependent launch (PDL) for the Triton kernels between the GEMMs of a decode
step (RMSNorm, SiLU-and-mul, RoPE + cache write, the attention's segment reduce): launched with
`launch_pdl=True` where `pagoda.kernels.pdl_enabled`, each starts while the kernel before it
is still running (its launch and prologue hidden behind that kernel's tail), waits for that
kernel to end before it reads or writes anything but constant weights, and at its own start
lets the next kernel launch the same way (the W4A16 GEMV loads its first weights then)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """The first statement of a kernel launched with launch_pdl=PDL (after loads of constant
    weights only): let the next kernel launch, then wait for the one before to end."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
