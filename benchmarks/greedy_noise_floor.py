"""How far apart two correct int8-activation runs of the embedded GGUF model can be: Pagoda's
quantized path against itself with the token embeddings perturbed by one float32 ulp
(relative 2^-23, random sign), greedy over the 10 prompts of `cpu_vs_llamacpp.py`.

    python benchmarks/greedy_noise_floor.py [--tokens 32]

Each layer rounds its activations to int8 per block of 32; a difference in the last bit of a
float sum moves a value across a rounding step now and then, and through 30 layers the logits
part by as much as llama.cpp's and Pagoda's do (`cpu_vs_llamacpp.py`'s greedy comparison).
Prints how many of the prompts keep the same greedy tokens, and the logits' mean per-position
largest difference on the first prompt with its continuation.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]
from cpu_vs_llamacpp import PROMPTS  # noqa: E402
from model_testing import PagedRunner  # noqa: E402

from pagoda.config import ModelConfig, embedded_model_path  # noqa: E402
from pagoda.model.loader import get_model_config_dict, load_model  # noqa: E402
from pagoda.tokenizer import get_tokenizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    path = embedded_model_path()
    cfg = get_model_config_dict(path)
    model = load_model(
        ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=1024,
                    quantization="gguf")
    )  # fmt: skip
    embed = next(m for name, m in model.named_modules() if name.endswith("embed_tokens"))
    state = {"perturb": False, "gen": torch.Generator().manual_seed(0)}

    def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
        if not state["perturb"]:
            return out
        noise = torch.randn(out.shape, generator=state["gen"]).sign()
        return out * (1 + 2.0**-23 * noise)

    embed.register_forward_hook(hook)

    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return PagedRunner(model, cfg, num_blocks=1024 // 4 + 2).step(ids, 0).float()

    def greedy(ids: list[int]) -> list[int]:
        ids = list(ids)
        for _ in range(args.tokens):
            ids.append(int(logits(ids)[-1].argmax()))
        return ids

    tok = get_tokenizer(path)
    same = 0
    for i, text in enumerate(PROMPTS):
        prompt = tok.encode(text)
        state["perturb"] = False
        a = greedy(prompt)
        state["perturb"] = True
        b = greedy(prompt)
        same += a == b
        first = next((k - len(prompt) for k in range(len(a)) if a[k] != b[k]), None)
        print(f"prompt {i}: " + ("same" if first is None else f"first differs at token {first}"))
        if i == 0:
            state["perturb"] = False
            la = logits(a)
            state["perturb"] = True
            lb = logits(a)
            diff = (la - lb).abs().amax(-1).mean().item()
    print(f"greedy equal over {args.tokens} tokens: {same}/{len(PROMPTS)}")
    print(f"logits, mean over positions of the largest difference (prompt 0): {diff:.3f}")


if __name__ == "__main__":
    main()
