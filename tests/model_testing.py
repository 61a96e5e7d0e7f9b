"""Tiny random checkpoints written by `transformers`, for tests of loaders, models and runners;
`hf_tokenizer`, transformers' tokenizer of a folder or GGUF (the tokenizer tests' oracle).

`make_tiny_checkpoint(path, "qwen3")` saves a two-layer model (safetensors + config.json) whose
norms and biases are perturbed away from HF's 1/0 initialisation, and returns the HF model as
the numerical reference. `PagedRunner` drives a model one sequence at a time through a paged KV
cache with shuffled blocks, without the model runner; `assert_two_ranks_match_one(path)` runs a
checkpoint's forward at tensor parallelism 2 (two processes over gloo) against one rank. `Tally`
stands in for an engine's stat
logger and sums its speculative-decoding counts. Needs `transformers` (a test dependency).
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.attention.metadata import AttentionMetadata
from pagoda.metrics.stats import IterationStats

TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_GEMMA_ATTN_CAP, _GEMMA_FINAL_CAP = 1.0, 2.0
# name -> (transformers config class, model class, overrides of TINY_CONFIG)
TINY_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama_gqa_tied_llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE, rope_theta=500000.0),
    ),
    "llama_untied_linear_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    ),
    "llama_mqa_attention_bias": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # A window shorter than the test prompts: the backends and the KV cache manager drop keys.
    "mistral_sliding_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # Local layer 0 (window 8), global layer 1; caps low enough to change the logits.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=_GEMMA_ATTN_CAP,
            final_logit_softcapping=_GEMMA_FINAL_CAP,
            initializer_range=0.1,
        ),
    ),
    # LongRoPE with its long factors (the context, 256, exceeds the original 64), partial
    # rotary (12 of 16 dims), a sliding window on every layer.
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            head_dim=16,
            pad_token_id=0,
            eos_token_id=1,
            sliding_window=24,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 64,
                # Equal: transformers picks them per forward by its length, Pagoda once.
                "short_factor": [1.0 + 0.5 * i for i in range(6)],
                "long_factor": [1.0 + 0.5 * i for i in range(6)],
            },
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            initializer_range=0.1,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Mixture of experts: 4 experts, top 2, softmax over the chosen logits.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    # 8 experts of 32, top 3 of the softmax renormalized; layer 1 a dense MLP (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # 8 experts of 32, top 4 (Qwen1.5-MoE-A2.7B's 60 experts pick 4), a shared expert of 64;
    # layer 1 a dense MLP of intermediate_size 96.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
}


def make_tiny_checkpoint(path: Any, case: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    import transformers

    config_cls, model_cls, case_overrides = TINY_CASES[case]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**TINY_CONFIG, **case_overrides, **overrides})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path))
    return model


class PagedRunner:
    """Drives a Pagoda model one sequence at a time through a paged cache with shuffled blocks."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: dict[str, Any],
        num_blocks: int = 64,
        seed: int = 0,
        block_size: int = 4,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`cache_dtype`: the KV cache's (default: the model's)."""
        self.model = model
        self.block_size = block_size
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        shape = (2, num_blocks, self.block_size, cfg["num_key_value_heads"], head_dim)
        dtype = cache_dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(cfg["num_hidden_layers"])]
        g = torch.Generator().manual_seed(seed)
        self.block_table = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()

    def step(self, tokens: list[int], start: int) -> torch.Tensor:
        """Compute `tokens` at positions start.. (cache holds 0..start-1) -> logits [n, V]."""
        n = len(tokens)
        pos = torch.arange(start, start + n)
        bt = torch.tensor(self.block_table, dtype=torch.int32)
        slots = bt[pos // self.block_size].long() * self.block_size + pos % self.block_size
        md = AttentionMetadata(
            num_actual_tokens=n,
            slot_mapping=slots,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([start + n], dtype=torch.int32),
            block_tables=bt[None],
            max_query_len=n,
            max_seq_len=start + n,
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(tokens), pos, self.kv_caches, md)
            return self.model.compute_logits(hidden)


def hf_tokenizer(path: str, **kwargs: Any) -> Any:
    """transformers' tokenizer of a folder (or of a GGUF in it: gguf_file=...)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


class Tally:
    """Stands in for the engine's stat logger: sums the speculative-decoding counts."""

    def __init__(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = 0

    def record(self, sched: object, it: IterationStats) -> None:
        self.drafts += it.num_drafts
        self.draft_tokens += it.num_draft_tokens
        self.accepted += it.num_accepted_tokens


def load_float32(path: Any) -> Any:
    """The checkpoint at `path` loaded by Pagoda in float32 (64 positions)."""
    from pagoda.config import ModelConfig
    from pagoda.model.loader import get_model_config_dict, load_model

    cfg = get_model_config_dict(str(path))
    return load_model(
        ModelConfig(model=str(path), hf_config=cfg, dtype="float32", max_model_len=64)
    )


def _prefill_and_decode(model: Any, cfg: dict[str, Any]) -> torch.Tensor:
    runner = PagedRunner(model, cfg, num_blocks=32)
    prompt = list(range(3, 20))
    return torch.cat([runner.step(prompt, 0), runner.step([7], len(prompt))])


def _two_rank_worker(rank: int, path: str, init_file: str, result_file: str) -> None:
    import torch.distributed as dist

    from pagoda.model.parallel import set_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    set_tensor_parallel(rank, 2)
    model = load_float32(path)
    cfg = dict(model.config)
    cfg["num_key_value_heads"] = model.model.layers[0].self_attn.num_kv_heads
    logits = _prefill_and_decode(model, cfg)
    if rank == 0:
        torch.save(logits, result_file)
    dist.destroy_process_group()


def assert_two_ranks_match_one(path: Any) -> None:
    """A prefill and a decode step of the checkpoint at `path`: the logits of two tensor-parallel
    ranks (processes over gloo, each loading its shards) within 1e-4 of one rank's."""
    import os

    import torch.multiprocessing as mp

    model = load_float32(path)
    ref = _prefill_and_decode(model, dict(model.config))
    result = os.path.join(path, "tp.pt")
    mp.spawn(_two_rank_worker, args=(str(path), os.path.join(path, "init"), result), nprocs=2)
    assert (torch.load(result) - ref).abs().max().item() < 1e-4
