"""GPU fidelity of the fast path: Triton attention + fused ops + CUDA graphs (decode and mixed
steps) against the plain-torch reference path, on the same dummy weights, and memory planning on
a real device (mixed-step graphs in detail: test_cuda_graph_mixed_gpu.py).

The model is the Llama-3.2-1B shape cut to 4 layers (32 query / 8 KV heads of 64, llama3 RoPE,
tied 128k vocabulary). Random weights give nearly flat logits, so in bf16 the rounding
differences between two correct implementations flip near-ties of the argmax: exact greedy
equality is checked in float32 (where they do not), and bf16 is checked on teacher-forced
logits (both paths fed the same tokens) within bf16 tolerance, plus the greedy choice wherever
the reference's top-2 margin exceeds the observed error. CUDA graphs vs eager run the same
kernels and must agree as tightly. Marked `gpu`: `pytest tests/worker -m gpu`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from test_model_runner import Driver, req

from pagoda.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PRESET = Path(__file__).parents[2] / "benchmarks/presets/llama-3.2-1b/config.json"
MAX_LEN = 512
PROMPTS = [
    [(7 * i + 3) % 128000 for i in range(n)] for n in (3, 17, 40, 77, 130)
]  # lengths: a few blocks of 16, some partial


def exact_sdpa():
    """The reference's attention in plain float32 math (the fused SDPA kernels may use TF32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def hf_config() -> dict:
    cfg = json.loads(PRESET.read_text())
    cfg["num_hidden_layers"] = 4
    return cfg


def make_runner(
    dtype: str,
    backend: str = "triton",
    enforce_eager: bool = False,
    num_blocks: int | None = 512,
    **cache_kwargs,
) -> ModelRunner:
    config = EngineConfig(
        model_config=ModelConfig(
            model=str(PRESET),
            hf_config=hf_config(),
            dtype=dtype,
            max_model_len=MAX_LEN,
            load_format="dummy",
            skip_tokenizer_init=True,
        ),
        cache_config=CacheConfig(block_size=16, num_gpu_blocks_override=num_blocks, **cache_kwargs),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=MAX_LEN, max_model_len=MAX_LEN
        ),
        device_config=DeviceConfig(
            device="cuda", attention_backend=backend, enforce_eager=enforce_eager
        ),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


def release(*runners: ModelRunner) -> None:
    for r in runners:
        r.model = r.kv_caches = r.cuda_graphs = None
    gc.collect()
    torch.cuda.empty_cache()


def count_replays(runner: ModelRunner) -> list:
    """The keys of every graph replay from now on: a decode batch size (int) or a mixed
    graph's (num_tokens, num_reqs)."""
    keys: list = []
    replay = runner.cuda_graphs.replay

    def counted(key):
        keys.append(key)
        return replay(key)

    runner.cuda_graphs.replay = counted
    return keys


def decode_replays(keys: list) -> int:
    return sum(isinstance(k, int) for k in keys)


def teacher_forced_logits(runner: ModelRunner, prompts, steps: int = 6) -> torch.Tensor:
    """Logits [1 + steps, len(prompts), vocab]: after the prompts, then after each of `steps`
    decode steps that feed the same fixed tokens whatever the model picks."""
    logits: list[torch.Tensor] = []
    compute = runner.model.compute_logits

    def record(hidden):
        out = compute(hidden)
        logits.append(out.clone())
        return out

    runner.model.compute_logits = record
    try:
        vocab = runner.model_config.vocab_size
        reqs = [req(f"t{i}", p) for i, p in enumerate(prompts)]
        driver = Driver(runner)
        plan = [(r, len(r.prompt_token_ids)) for r in reqs]
        for step in range(steps + 1):
            driver.step(plan)
            for i, r in enumerate(reqs):  # overwrite the sampled token with the forced one
                r.output_token_ids[-1] = r.all_token_ids[-1] = (1000 * step + 37 * i) % vocab
            plan = [(r, 1) for r in reqs]
    finally:
        del runner.model.compute_logits
    return torch.stack(logits)


def assert_close_logits(got: torch.Tensor, ref: torch.Tensor, rel_rms: float, rel_max: float):
    err = (got - ref).float()
    scale = ref.float().pow(2).mean().sqrt()
    assert err.pow(2).mean().sqrt() <= rel_rms * scale, (err.pow(2).mean().sqrt(), scale)
    max_err = err.abs().max()
    assert max_err <= rel_max * ref.abs().max(), (max_err, ref.abs().max())
    # Greedy choices agree wherever the reference is decided by more than the row's error.
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > 2 * err.abs().amax(dim=-1)
    assert decided.float().mean() > 0.2
    assert torch.equal(got.argmax(-1)[decided], ref.argmax(-1)[decided])


def test_fp32_fast_path_greedy_equals_torch_reference():
    fast = make_runner("float32")
    ref = make_runner("float32", backend="torch", enforce_eager=True)
    assert fast.cuda_graphs is not None and ref.cuda_graphs is None
    replays = count_replays(fast)
    for batch in ([PROMPTS[2]], PROMPTS):  # batch 1, and 5 padded to the graph of 8
        with exact_sdpa():
            want = Driver(ref).generate([req(f"r{i}", p) for i, p in enumerate(batch)], 10)
        got = Driver(fast).generate([req(f"f{i}", p) for i, p in enumerate(batch)], 10)
        assert got == want
    assert decode_replays(replays) >= 2 * 9  # every decode step of both batches replayed a graph
    assert len(replays) - decode_replays(replays) >= 2  # and the prefill steps a mixed graph
    release(fast, ref)


def test_bf16_fast_path_logits_within_tolerance_of_torch_reference():
    fast = make_runner("bfloat16")
    ref = make_runner("bfloat16", backend="torch", enforce_eager=True)
    got, want = teacher_forced_logits(fast, PROMPTS), teacher_forced_logits(ref, PROMPTS)
    # bf16 keeps 8 bits: each of the ~30 rounded ops of a layer adds ~0.4% noise.
    assert_close_logits(got, want, rel_rms=0.03, rel_max=0.15)
    release(fast, ref)


def test_bf16_cuda_graphs_match_eager():
    graphs = make_runner("bfloat16")
    eager = make_runner("bfloat16", enforce_eager=True)
    replays = count_replays(graphs)
    for batch in (PROMPTS[:4], PROMPTS[:3]):  # exactly a bucket (4), and padded (3 -> 4)
        got, want = teacher_forced_logits(graphs, batch), teacher_forced_logits(eager, batch)
        diff = (got - want).abs().max().item()
        print(f"batch {len(batch)}: graphs vs eager max |logit diff| {diff:.3g}")
        assert_close_logits(got, want, rel_rms=0.01, rel_max=0.05)
    # Per batch: the prefill step replays a mixed graph, the 6 decode steps decode graphs.
    assert decode_replays(replays) == 2 * 6 and replays[0] == (192, 4) and replays[7] == (64, 4)
    release(graphs, eager)


def test_memory_plan_sizes_the_cache_from_gpu_memory_utilization():
    runner = make_runner("bfloat16", num_blocks=None, gpu_memory_utilization=0.3)
    plan = runner.memory_plan
    params = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    print(plan.summary(), f"graphs measured {runner.cuda_graphs.memory_bytes / 2**30:.3f} GiB")
    assert abs(plan.weights_bytes - params) < 0.05 * params
    assert plan.activation_bytes > 0 and plan.cuda_graph_bytes > 0
    assert runner.num_blocks == plan.num_blocks > 1000
    used = plan.weights_bytes + plan.activation_bytes + plan.cuda_graph_bytes
    assert used + plan.non_torch_bytes + plan.kv_cache_bytes <= plan.budget_bytes
    assert runner.cuda_graphs.memory_bytes <= plan.cuda_graph_bytes  # the reserve held
    release(runner)


def test_settings_that_cannot_fit_fail_at_start():
    with pytest.raises(ValueError, match="weights take .*--gpu-memory-utilization"):
        make_runner("bfloat16", num_blocks=None, gpu_memory_utilization=0.002)
    gc.collect()
    with pytest.raises(ValueError, match="max_model_len=512.*--max-model-len"):
        make_runner("bfloat16", num_blocks=None, kv_cache_memory_bytes=1 << 20)
    gc.collect()
    torch.cuda.empty_cache()
