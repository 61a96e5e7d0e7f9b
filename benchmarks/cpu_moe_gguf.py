"""A mixture-of-experts GGUF on the CPU: a random Qwen3-MoE file (llama.cpp's qwen3moe layout,
written with the gguf package: by default hidden 1024, 8 experts of 1024 with top 2, 4 layers,
experts in Q4_0 and the other matrices in Q8_0), loaded as the engine loads it (float32: the
blocks kept), its experts' bytes, then single-stream decode (a 64-token prompt, 128 new tokens,
greedy, time of 129 tokens minus time of 1) and a 512-token prompt, medians of --repeats runs.

    python benchmarks/cpu_moe_gguf.py [--expert-type Q4_0|Q4_1|Q8_0] [--dense-type Q8_0]
    PAGODA_GGUF_QUANTIZED=0 python benchmarks/cpu_moe_gguf.py   # every block dequantized
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import pagoda  # noqa: F401 - sets the OpenMP wait policy before torch loads libgomp


def write_gguf(path: str, args: argparse.Namespace) -> None:
    """Random weights of std 0.02 (norms 1), quantized by the gguf package."""
    import gguf
    from gguf.quants import quantize

    qt = gguf.GGMLQuantizationType
    h, inter, e, layers = args.hidden, args.inter, args.experts, args.layers
    heads, kv, head_dim, vocab = h // 64, max(h // 256, 1), 64, 4096
    rng = np.random.default_rng(0)
    arch = "qwen3moe"
    w = gguf.GGUFWriter(path, arch)
    for key, value in {"context_length": 2048, "embedding_length": h, "block_count": layers,
                       "feed_forward_length": inter, "attention.head_count": heads,
                       "attention.head_count_kv": kv, "attention.key_length": head_dim,
                       "attention.value_length": head_dim, "expert_count": e,
                       "expert_used_count": args.top_k, "expert_feed_forward_length": inter,
                       "vocab_size": vocab}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 1e6)

    def add(name: str, shape: tuple[int, ...], ggml_type: str | None) -> None:
        if ggml_type is None:  # a norm (ones) or the router (float32)
            t = np.ones(shape, np.float32) if len(shape) == 1 else rng.standard_normal(shape)
            w.add_tensor(name, t.astype(np.float32))
            return
        t = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        w.add_tensor(name, quantize(t, qt[ggml_type]), raw_dtype=qt[ggml_type])

    add("token_embd.weight", (vocab, h), args.dense_type)
    add("output_norm.weight", (h,), None)
    add("output.weight", (vocab, h), args.dense_type)
    for i in range(layers):
        for norm, size in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", head_dim),
                           ("attn_k_norm", head_dim)):  # fmt: skip
            add(f"blk.{i}.{norm}.weight", (size,), None)
        add(f"blk.{i}.attn_q.weight", (heads * head_dim, h), args.dense_type)
        add(f"blk.{i}.attn_k.weight", (kv * head_dim, h), args.dense_type)
        add(f"blk.{i}.attn_v.weight", (kv * head_dim, h), args.dense_type)
        add(f"blk.{i}.attn_output.weight", (h, heads * head_dim), args.dense_type)
        add(f"blk.{i}.ffn_gate_inp.weight", (e, h), None)
        add(f"blk.{i}.ffn_gate_exps.weight", (e, inter, h), args.expert_type)
        add(f"blk.{i}.ffn_up_exps.weight", (e, inter, h), args.expert_type)
        add(f"blk.{i}.ffn_down_exps.weight", (e, h, inter), args.expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def held_mib(path: str) -> tuple[float, float]:
    """(the experts', the whole model's) parameter and buffer MiB, loaded as the engine does."""
    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    cfg = get_model_config_dict(path)
    mc = ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=256,
                     quantization="gguf")  # fmt: skip
    model = load_model(mc)

    def mib(m) -> float:
        return sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()]) / 2**20

    return sum(mib(layer.mlp.experts) for layer in model.model.layers), mib(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=1024, help="each expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--expert-type", default="Q4_0")
    p.add_argument("--dense-type", default="Q8_0")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from pagoda import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "moe.gguf")
        write_gguf(path, args)
        experts, total = held_mib(path)
        print(f"experts {experts:.1f} MiB, model {total:.1f} MiB")
        llm = LLM(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_batched_tokens=1024, enable_prefix_caching=False, seed=0)  # fmt: skip

        def seconds(prompt: list[int], n: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return time.perf_counter() - t0

        short, long = list(range(100, 164)), [(7 * j) % 4000 + 10 for j in range(512)]
        seconds(short, 8)
        decode = [128 / (seconds(short, 129) - seconds(short, 1)) for _ in range(args.repeats)]
        prefill = [512 / seconds(long, 1) for _ in range(args.repeats)]
    switch = f"PAGODA_GGUF_QUANTIZED={os.environ.get('PAGODA_GGUF_QUANTIZED', '1')}"
    print(
        f"{switch} experts {args.expert_type}, others {args.dense_type}: decode tok/s median "
        f"{statistics.median(decode):.1f} (runs {[round(r, 1) for r in decode]}); 512-token "
        f"prompt tok/s median {statistics.median(prefill):.1f}"
    )


if __name__ == "__main__":
    main()
