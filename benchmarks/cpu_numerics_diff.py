"""How far apart three computations of the same GGUF model land on one context: Pagoda's
quantized kernels, llama.cpp's arithmetic (`PAGODA_CPU_NUMERICS=ggml`, bit for bit llama.cpp's
logits) and the dequantized float32 model, over a float16 KV cache. Prints, for each pair, the
largest and mean absolute logit difference over the context's positions and how often the top
token agrees.

    python benchmarks/cpu_numerics_diff.py [--model PATH.gguf] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)


def main() -> None:
    from model_testing import PagedRunner  # one sequence through a paged cache

    from pagoda.config import ModelConfig, embedded_model_path
    from pagoda.kernels.cpu.ggml_numerics import default_variant
    from pagoda.model.loader import get_model_config_dict, load_model
    from pagoda.model.quantization.gptq import BUILTIN_CALIBRATION
    from pagoda.tokenizer import get_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    path = args.model or embedded_model_path()
    cfg = get_model_config_dict(path)
    ids = get_tokenizer(path).encode(BUILTIN_CALIBRATION * 4)[: args.tokens]
    logits = {}
    for name, quantization in (("pagoda", "gguf"), ("ggml", "gguf"), ("dequantized", None)):
        config = ModelConfig(
            model=path, hf_config=cfg, dtype="float32", max_model_len=len(ids) + 16,
            quantization=quantization,
        )  # fmt: skip
        model = load_model(config)
        if name == "ggml":
            model.enable_ggml_numerics(default_variant() or "avx2")
        runner = PagedRunner(model, cfg, num_blocks=len(ids) // 4 + 4, cache_dtype=torch.float16)
        with torch.no_grad():
            logits[name] = runner.step(ids, 0)
    print(f"{len(ids)} positions of {os.path.basename(path)}")
    for a, b in (("pagoda", "ggml"), ("pagoda", "dequantized"), ("ggml", "dequantized")):
        d = (logits[a] - logits[b]).abs()
        top = (logits[a].argmax(1) == logits[b].argmax(1)).float().mean().item()
        print(
            f"  {a} vs {b}: max {d.max().item():.3f}, mean {d.mean().item():.3f}, "
            f"top token equal {100 * top:.1f}%"
        )


if __name__ == "__main__":
    main()
