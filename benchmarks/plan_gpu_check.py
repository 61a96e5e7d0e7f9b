"""What the engine plans for GPU memory at start-up, for `pagoda plan` to be checked against.

Starts the engine once per configuration (each in its own process, so one's memory does not
count in the next), reads the `MemoryPlan` its model runner logged and writes every field to
one JSON file: `tests/test_plan.py` compares `pagoda plan`'s numbers with these. An "80 GiB"
configuration runs on the larger GPU at gpu_memory_utilization scaled so that the budget is
what 0.9 of 80 GiB would be (the weights, activations, graphs and CUDA context are the same).

    python benchmarks/plan_gpu_check.py --out DIR [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = os.path.join(HERE, "presets")
GiB = 2**30

# name -> (preset or "awq:<preset>", GPU size in GiB (None: the whole GPU), engine arguments)
CONFIGS: dict[str, tuple[str, float | None, dict]] = {
    "llama-3-8b-bf16": ("llama-3-8b", None, {}),
    "llama-3-8b-bf16-80g": ("llama-3-8b", 80, {}),
    "llama-3-8b-fp8": ("llama-3-8b", None, {"kv_cache_dtype": "fp8"}),
    "llama-3-8b-fp8-80g": ("llama-3-8b", 80, {"kv_cache_dtype": "fp8"}),
    "llama-3-8b-awq": ("awq:llama-3-8b", None, {}),
    "llama-3-8b-awq-80g": ("awq:llama-3-8b", 80, {}),
    "llama-3-8b-bf16-big-batch": (
        "llama-3-8b", None, {"max_num_batched_tokens": 8192, "max_num_seqs": 512}
    ),
    "llama-3-8b-bf16-eager": ("llama-3-8b", None, {"enforce_eager": True}),
    "llama-3.2-1b-bf16": ("llama-3.2-1b", None, {}),
    "qwen2.5-7b-bf16": ("qwen2.5-7b", None, {}),
}  # fmt: skip


def write_random_awq(preset: str, out_dir: str, group: int = 128) -> str:
    """An AWQ (4-bit GEMM, zero points) checkpoint of `preset`'s shape with random values."""
    import torch
    from safetensors.torch import save_file

    cfg = json.load(open(os.path.join(PRESETS, preset, "config.json")))
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(0)
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, h, generator=g).half() * 0.02,
        "model.norm.weight": torch.ones(h, dtype=torch.float16),
    }
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = torch.randn(vocab, h, generator=g).half() * 0.02
    shapes = {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd),
              "self_attn.v_proj": (h, kv * hd), "self_attn.o_proj": (heads * hd, h),
              "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}  # fmt: skip
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.float16)
        for name, (k, n) in shapes.items():
            t[p + name + ".qweight"] = torch.randint(-(2**31), 2**31 - 1, (k, n // 8),
                                                     dtype=torch.int32, generator=g)  # fmt: skip
            t[p + name + ".qzeros"] = torch.full((k // group, n // 8), 0x88888888 - 2**32,
                                                 dtype=torch.int32)  # fmt: skip
            t[p + name + ".scales"] = torch.full((k // group, n), 1e-3, dtype=torch.float16)
    cfg = dict(cfg, torch_dtype="float16")
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                  "zero_point": True, "version": "gemm"}  # fmt: skip
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    save_file(t, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def child(spec: str) -> None:
    """Start the engine for one configuration and print its memory plan as JSON."""
    import torch

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    name, model, gib, kwargs = json.loads(spec)
    total = torch.cuda.mem_get_info()[1]
    util = 0.9 if gib is None else 0.9 * gib * GiB / total
    dummy = model.endswith(".json")
    args = EngineArgs(model=model, load_format="dummy" if dummy else "auto",
                      skip_tokenizer_init=True, gpu_memory_utilization=util,
                      disable_log_stats=True, **kwargs)  # fmt: skip
    start = time.perf_counter()
    engine = LLMEngine(args.create_engine_config(), log_stats=False)
    plan = engine.executor.model_runner.memory_plan
    fields = {k: getattr(plan, k) for k in plan.__dataclass_fields__}
    print("PLAN " + json.dumps({"name": name, "gpu_gib": gib, "engine_args": kwargs,
                                "model": os.path.relpath(model, HERE), "start_s":
                                time.perf_counter() - start, **fields}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    for name, (preset, gib, kwargs) in CONFIGS.items():
        if args.only and name not in args.only:
            continue
        if preset.startswith("awq:"):
            model = write_random_awq(preset[4:], f"/tmp/awq-{preset[4:]}")
        else:
            model = os.path.join(PRESETS, preset, "config.json")
        spec = json.dumps([name, model, gib, kwargs])
        proc = subprocess.run([sys.executable, __file__, "--out", args.out, "--child", spec],
                              capture_output=True, text=True)  # fmt: skip
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PLAN ")]
        if proc.returncode or not lines:
            print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(lines[-1][5:]))
        r = results[-1]
        print(f"{name}: {r['num_blocks']} blocks, weights {r['weights_bytes'] / GiB:.2f} GiB, "
              f"act {r['activation_bytes'] / GiB:.2f}, graphs {r['cuda_graph_bytes'] / GiB:.2f}, "
              f"non-torch {r['non_torch_bytes'] / GiB:.2f} ({r['start_s']:.0f} s)", flush=True)  # fmt: skip
        path = os.path.join(args.out, "engine_memory_plans.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
