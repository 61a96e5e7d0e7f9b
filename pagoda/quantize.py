"""`pagoda quantize`: calibrate a model on text and write a quantized checkpoint (GPTQ,
AWQ or SmoothQuant W8A8; the methods are `pagoda.model.quantization.gptq`, `.awq` and
`.smoothquant`, which take token ids). This module tokenizes the calibration text; nothing
heavy (torch, the tokenizer) is imported until the command runs.

    pagoda quantize MODEL --output DIR [--method gptq|awq|w8a8] [--bits 4] [--group-size 128]
        [--act-order] [--sym] [--calibration-file FILE] [--num-samples 32] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_quantize_args(sub: Any) -> None:
    """`pagoda quantize` on the subparsers `sub`."""
    p = sub.add_parser(
        "quantize",
        help="quantize a model with GPTQ, AWQ or SmoothQuant W8A8 into a GPTQ / AutoAWQ / "
        "compressed-tensors checkpoint",
    )
    p.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf (default: embedded)"
    )
    p.add_argument("--output", "-o", required=True, help="directory for the checkpoint")
    p.add_argument(
        "--method",
        choices=["gptq", "awq", "w8a8"],
        default="gptq",
        help="gptq (AutoGPTQ format), awq (activation-aware scales, AutoAWQ GEMM, 4-bit) or "
        "w8a8 (SmoothQuant int8 weights and activations, compressed-tensors format)",
    )
    p.add_argument(
        "--smoothing-alpha",
        type=float,
        default=0.5,
        help="w8a8: SmoothQuant's migration strength (0: none, 1: all into the weights)",
    )
    p.add_argument("--bits", type=int, default=4, choices=[4, 8], help="awq: 4 only")
    p.add_argument("--group-size", type=int, default=128, help="-1: one group per row")
    p.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing H diag")
    p.add_argument(
        "--sym",
        action="store_true",
        help="gptq: symmetric (every zero point 2**(bits-1), AutoGPTQ's sym=True); 8-bit "
        "symmetric layers run as Q8_0 blocks on a CPU, asymmetric ones dequantized",
    )
    p.add_argument("--calibration-file", default=None, help="text file (default: built-in)")
    p.add_argument("--num-samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.set_defaults(func=cmd_quantize)


def cmd_quantize(args: argparse.Namespace) -> int:
    from pagoda.config import embedded_model_path
    from pagoda.model.quantization.gptq import (
        BUILTIN_CALIBRATION,
        calibration_sequences,
        quantize_model,
    )
    from pagoda.tokenizer import get_tokenizer

    method = getattr(args, "method", "gptq")
    sym = getattr(args, "sym", False)
    if method == "awq" and (args.bits != 4 or args.act_order or sym):
        print(
            "pagoda quantize --method awq: AutoAWQ GEMM checkpoints are 4-bit with zero points, "
            f"without act-order (got --bits {args.bits}{' --act-order' if args.act_order else ''}"
            f"{' --sym' if sym else ''})",
            file=sys.stderr,
        )
        return 2
    if method == "w8a8" and (args.act_order or sym):
        print(
            "pagoda quantize --method w8a8: --act-order and --sym are GPTQ options (W8A8 "
            "weights are symmetric per output channel)",
            file=sys.stderr,
        )
        return 2
    model = args.model or embedded_model_path()
    if args.calibration_file:
        with open(args.calibration_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = BUILTIN_CALIBRATION
    ids = get_tokenizer(model).encode(text)
    sequences = calibration_sequences(ids, args.num_samples, args.seq_len)
    if method == "awq":
        from pagoda.model.quantization.awq import quantize_model_awq

        errors = quantize_model_awq(model, args.output, sequences, args.bits, args.group_size)
    elif method == "w8a8":
        from pagoda.model.quantization.smoothquant import quantize_model_w8a8

        errors = quantize_model_w8a8(model, args.output, sequences, args.smoothing_alpha)
        ours = sum(e[0] for e in errors.values()) / len(errors)
        plain = sum(e[1] for e in errors.values()) / len(errors)
        print(
            f"W8A8 int8 (SmoothQuant, alpha {args.smoothing_alpha}): {len(errors)} linear layers, "
            f"{sum(len(s) for s in sequences)} calibration tokens; relative output error "
            f"{ours:.2e} (without smoothing: {plain:.2e}); wrote {args.output}"
        )
        return 0
    else:
        errors = quantize_model(
            model, args.output, sequences, args.bits, args.group_size, args.act_order, sym=sym
        )
    ours = sum(e[0] for e in errors.values()) / len(errors)
    rtn_mean = sum(e[1] for e in errors.values()) / len(errors)
    print(
        f"{method.upper()} {args.bits}-bit, group {args.group_size}: {len(errors)} linear layers, "
        f"{sum(len(s) for s in sequences)} calibration tokens; relative output error "
        f"{ours:.2e} (round-to-nearest: {rtn_mean:.2e}); wrote {args.output}"
    )
    return 0
