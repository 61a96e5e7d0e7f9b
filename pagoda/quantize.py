"""`pagoda quantize`: calibrate a model on text and write a quantized checkpoint (GPTQ,
AWQ or SmoothQuant W8A8; the methods are `pagoda.model.quantization.gptq`, `.awq` and
`.smoothquant`, which take token ids). This module tokenizes the calibration text; nothing
heavy (torch, the tokenizer) is imported until the command runs.

    pagoda quantize MODEL --output DIR [--method gptq|awq|w8a8] [--bits 4] [--group-size 128]
        [--act-order] [--sym] [--calibration-file FILE] [--num-samples 32] [--seq-len 512]
        [--smoothing-alpha 0.5]

A flag value that cannot make a checkpoint (a group size, sample count or window length below
one, an output path that is a file, a missing model or calibration file, a calibration file
without text, a flag of another method) ends the command with one `error: ...` line naming the
flag and exit code 2, before the model is loaded (`_settings`); so does a mixture-of-experts
model, whose experts the quantizers do not cover, and for AWQ and W8A8 a model whose decoder
layers have no norm before q/k/v or gate/up to fold the input scales into (OLMo 2's post-norms).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 128
DEFAULT_SMOOTHING_ALPHA = 0.5


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
    p.add_argument(
        "--output",
        "-o",
        required=True,
        help="directory for the checkpoint (created if missing; not an existing file)",
    )
    p.add_argument(
        "--method",
        choices=["gptq", "awq", "w8a8"],
        default="gptq",
        help="gptq (AutoGPTQ format), awq (activation-aware scales, AutoAWQ GEMM, 4-bit) or "
        "w8a8 (SmoothQuant int8 weights and activations, compressed-tensors format)",
    )
    # bits, group size and smoothing alpha default to None so that one given to a method
    # without it is refused (`_settings`), not ignored; the defaults are DEFAULT_*.
    p.add_argument(
        "--smoothing-alpha",
        type=float,
        default=None,
        help="w8a8: SmoothQuant's migration strength in [0, 1] (0: none, 1: all into the "
        f"weights; default {DEFAULT_SMOOTHING_ALPHA})",
    )
    p.add_argument(
        "--bits",
        type=int,
        default=None,
        choices=[4, 8],
        help=f"gptq: 4 or 8, awq: 4 only, w8a8: 8 only (default {DEFAULT_BITS}; w8a8: 8)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="gptq, awq: inputs per quantization group, a positive integer or -1 for one "
        f"group per row (default {DEFAULT_GROUP_SIZE}); w8a8 is per row",
    )
    p.add_argument("--act-order", action="store_true", help="gptq: columns by decreasing H diag")
    p.add_argument(
        "--sym",
        action="store_true",
        help="gptq: symmetric (every zero point 2**(bits-1), AutoGPTQ's sym=True); 8-bit "
        "symmetric layers run as Q8_0 blocks on a CPU, asymmetric ones dequantized",
    )
    p.add_argument("--calibration-file", default=None, help="text file (default: built-in)")
    p.add_argument(
        "--num-samples",
        type=int,
        default=32,
        help="calibration windows cut from the text, at least 1 (the whole text once if it is "
        "shorter than one window)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=512,
        help="tokens per calibration window, at least 1; windows longer than the model's "
        "max_position_embeddings are refused",
    )
    p.set_defaults(func=cmd_quantize)


@dataclass
class _Settings:
    """What `cmd_quantize` runs, from flags that passed `_settings`."""

    method: str
    model: str
    bits: int
    group_size: int
    smoothing_alpha: float
    sym: bool
    sequences: list[list[int]]


def _check_flags(args: argparse.Namespace, method: str, sym: bool) -> None:
    """ValueError, naming the flag, for a value no method can run or one of another method."""
    bits, group_size = args.bits, args.group_size
    alpha = getattr(args, "smoothing_alpha", None)
    if method == "awq" and ((bits is not None and bits != 4) or args.act_order or sym):
        raise ValueError(
            "pagoda quantize --method awq: AutoAWQ GEMM checkpoints are 4-bit with zero points, "
            f"without act-order (got --bits {bits or DEFAULT_BITS}"
            f"{' --act-order' if args.act_order else ''}{' --sym' if sym else ''})"
        )
    if method == "w8a8" and (args.act_order or sym):
        raise ValueError(
            "pagoda quantize --method w8a8: --act-order and --sym are GPTQ options (W8A8 "
            "weights are symmetric per output channel)"
        )
    if method == "w8a8" and bits is not None and bits != 8:
        raise ValueError(f"--bits {bits}: --method w8a8 quantizes to 8 bits (leave out --bits)")
    if method == "w8a8" and group_size is not None and group_size != -1:
        raise ValueError(
            f"--group-size {group_size}: --method w8a8 scales each output channel as a whole "
            "(leave out --group-size)"
        )
    if group_size is not None and group_size != -1 and group_size < 1:
        raise ValueError(
            f"--group-size must be a positive integer or -1 (one group per row), got {group_size}"
        )
    if alpha is not None:
        if method != "w8a8":
            raise ValueError(
                f"--smoothing-alpha is SmoothQuant's (--method w8a8), not --method {method}'s"
            )
        if not 0.0 <= alpha <= 1.0:  # NaN too
            raise ValueError(f"--smoothing-alpha must be in [0, 1], got {alpha}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be a positive integer, got {args.num_samples}")
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be a positive integer, got {args.seq_len}")


def _check_output(output: str, model: str) -> None:
    """ValueError, naming -o/--output, where `output` cannot become the checkpoint's directory:
    empty, an existing file, under a file, not writable, or the model's own directory."""
    if not output:
        raise ValueError("-o/--output is empty: pass a directory path for the checkpoint")
    if os.path.lexists(output) and not os.path.isdir(output):  # a dangling link too
        raise ValueError(
            f"-o/--output {output!r} is an existing file: pass a directory path for the "
            "checkpoint (it is created if missing)"
        )
    existing = os.path.abspath(output)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(
            f"-o/--output {output!r}: {existing!r} is a file, so no directory can be made there"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"-o/--output {output!r}: cannot write in {existing!r}")
    if os.path.isdir(model) and os.path.isdir(output) and os.path.samefile(model, output):
        raise ValueError(
            f"-o/--output {output!r} is the model's own directory: pass a new directory (the "
            "checkpoint would overwrite the model)"
        )


def _read_calibration_file(path: str) -> str:
    """The text of --calibration-file `path`; ValueError, naming the flag, where there is none."""
    if not path:
        raise ValueError("--calibration-file is empty: pass a text file (or leave it out)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"--calibration-file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"--calibration-file {path!r} is a directory, not a text file") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--calibration-file {path!r} is not UTF-8 text ({e.reason})") from None
    except OSError as e:
        raise ValueError(f"--calibration-file {path!r}: cannot read it ({e.strerror})") from None
    if not text.strip():
        raise ValueError(
            f"--calibration-file {path!r} has no text to calibrate on (it is empty or only "
            "whitespace)"
        )
    return text


def _settings(args: argparse.Namespace) -> _Settings:
    """The flags checked (flag values first, then the paths, then the calibration text), the
    defaults filled in and the calibration text cut into windows; ValueError naming the flag
    for a value that cannot make a checkpoint. Loads no model, only its config and tokenizer."""
    from pagoda.config import embedded_model_path
    from pagoda.model.loader import get_model_config_dict
    from pagoda.model.quantization.checkpoint import check_not_moe
    from pagoda.model.quantization.gptq import BUILTIN_CALIBRATION, calibration_sequences
    from pagoda.tokenizer import get_tokenizer

    method = getattr(args, "method", "gptq")
    sym = getattr(args, "sym", False)
    _check_flags(args, method, sym)
    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(
            f"model {args.model!r} not found: pass a local Hugging Face directory or a .gguf "
            "file (or leave MODEL out for the embedded model)"
        )
    model = embedded_model_path() if args.model is None else args.model
    _check_output(args.output, model)
    hf_config = get_model_config_dict(model)  # a directory without config.json etc. refused
    check_not_moe(hf_config, method)
    if method in ("awq", "w8a8"):
        from pagoda.model.quantization.awq import check_config_scales_fold

        check_config_scales_fold(hf_config, method)
    if args.calibration_file is not None:
        text = _read_calibration_file(args.calibration_file)
        source = f"--calibration-file {args.calibration_file!r}"
    else:
        text, source = BUILTIN_CALIBRATION, "the built-in calibration text"
    ids = get_tokenizer(model).encode(text)
    if not ids:
        raise ValueError(f"{source} has no tokens to calibrate on")
    sequences = calibration_sequences(ids, args.num_samples, args.seq_len)
    max_len = int(hf_config.get("max_position_embeddings") or 2048)
    longest = max(len(s) for s in sequences)
    if longest > max_len:
        raise ValueError(
            f"--seq-len {args.seq_len}: calibration windows of {longest} tokens are longer than "
            f"the model's max_position_embeddings ({max_len}); pass --seq-len {max_len} or less"
        )
    if method == "w8a8":
        bits, group_size = 8, -1
    else:
        bits = DEFAULT_BITS if args.bits is None else args.bits
        group_size = DEFAULT_GROUP_SIZE if args.group_size is None else args.group_size
    alpha = getattr(args, "smoothing_alpha", None)
    alpha = DEFAULT_SMOOTHING_ALPHA if alpha is None else alpha
    return _Settings(method, model, bits, group_size, alpha, sym, sequences)


def cmd_quantize(args: argparse.Namespace) -> int:
    # The flags are checked here, not left to `run_command`, so that a caller of `args.func`
    # gets exit code 2 too; nothing is loaded or written before they pass.
    try:
        s = _settings(args)
    except ValueError as e:
        from pagoda.cli import report_user_error, user_error_message

        return report_user_error(user_error_message(e) or str(e))
    from pagoda.model.quantization.gptq import quantize_model

    sequences = s.sequences
    if s.method == "awq":
        from pagoda.model.quantization.awq import quantize_model_awq

        errors = quantize_model_awq(s.model, args.output, sequences, s.bits, s.group_size)
    elif s.method == "w8a8":
        from pagoda.model.quantization.smoothquant import quantize_model_w8a8

        errors = quantize_model_w8a8(s.model, args.output, sequences, s.smoothing_alpha)
        ours = sum(e[0] for e in errors.values()) / len(errors)
        plain = sum(e[1] for e in errors.values()) / len(errors)
        print(
            f"W8A8 int8 (SmoothQuant, alpha {s.smoothing_alpha}): {len(errors)} linear layers, "
            f"{sum(len(q) for q in sequences)} calibration tokens; relative output error "
            f"{ours:.2e} (without smoothing: {plain:.2e}); wrote {args.output}"
        )
        return 0
    else:
        errors = quantize_model(
            s.model, args.output, sequences, s.bits, s.group_size, args.act_order, sym=s.sym
        )
    ours = sum(e[0] for e in errors.values()) / len(errors)
    rtn_mean = sum(e[1] for e in errors.values()) / len(errors)
    print(
        f"{s.method.upper()} {s.bits}-bit, group {s.group_size}: {len(errors)} linear layers, "
        f"{sum(len(q) for q in sequences)} calibration tokens; relative output error "
        f"{ours:.2e} (round-to-nearest: {rtn_mean:.2e}); wrote {args.output}"
    )
    return 0
