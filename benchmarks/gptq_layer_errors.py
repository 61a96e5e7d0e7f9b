"""Per linear layer, the output error of GPTQ vs round-to-nearest on held-out text: GPTQ
calibrated on one text, both measured with the Hessian of another (the full-precision model's
activations, no sequential pass), as the ratio GPTQ / RTN per layer.

    python benchmarks/gptq_layer_errors.py --calibration-file FILE [--eval-file FILE]
        [--bits 4] [--group-size 128] [--damp 0.01 0.1]
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "model")]

from calibration_testing import collect_hessians  # noqa: E402

from pagoda.config import ModelConfig, embedded_model_path  # noqa: E402
from pagoda.model.layers.linear import LinearBase  # noqa: E402
from pagoda.model.loader import get_model_config_dict, load_model  # noqa: E402
from pagoda.model.quantization.gptq import (  # noqa: E402
    calibration_sequences,
    gptq_quantize,
    output_error,
    rtn,
)
from pagoda.tokenizer import get_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--calibration-file", required=True)
    p.add_argument("--eval-file", default=os.path.join(os.path.dirname(__file__), "README.md"))
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--damp", type=float, nargs="+", default=[0.01, 0.1])
    args = p.parse_args()
    model_path = args.model or embedded_model_path()
    tok = get_tokenizer(model_path)
    cfg = get_model_config_dict(model_path)
    mc = ModelConfig(model=model_path, hf_config=cfg, dtype="float32", max_model_len=1024)
    model = load_model(mc, "cpu")
    with open(args.calibration_file, encoding="utf-8") as f:
        calib = calibration_sequences(tok.encode(f.read()), 32, 512)
    with open(args.eval_file, encoding="utf-8") as f:
        held_out = calibration_sequences(tok.encode(f.read()), 8, 512)
    h_calib = collect_hessians(model, cfg, calib)
    h_eval = collect_hessians(model, cfg, held_out)
    for damp in args.damp:
        ratios = []
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            w = module.weight.data
            base = output_error(w, rtn(w, args.bits, args.group_size), h_eval[name])
            res = gptq_quantize(w, h_calib[name], args.bits, args.group_size, percdamp=damp)
            ratios.append((output_error(w, res.dequantized, h_eval[name]) / base, name))
        ratios.sort()
        median, (worst, worst_name) = ratios[len(ratios) // 2][0], ratios[-1]
        print(
            f"damp {damp}: {len(ratios)} layers, GPTQ / RTN held-out error median {median:.2f}, "
            f"worst {worst:.2f} ({worst_name}), GPTQ worse in {sum(r > 1 for r, _ in ratios)}"
        )


if __name__ == "__main__":
    main()
