"""Newer model families end to end against `transformers`: Mistral with a sliding window, Gemma 2
(local/global layers, attention and final logit soft-caps) and Gemma 3 text (q/k norms, local
RoPE base), Phi-3 (fused checkpoint projections, partial LongRoPE, a window on every layer) and
the mixtures of experts Mixtral and Qwen3-MoE (routing, stacked experts, a dense layer), through `LLM` with batching, chunked prefill and prefix caching on, prompts longer
than any sliding window.

Each checkpoint is a tiny random model written by transformers' own class (float32,
safetensors). Greedy continuations must equal transformers' (`_hf_reference`), and the log-probability Pagoda
reports for each generated token must be within 1e-3 of the log-softmax of transformers'
logits over the same tokens; a second round of the same prompts (prefix-cache hits, blocks
freed behind the window) must give the same tokens.
"""

from __future__ import annotations

import pytest
import torch
from model_testing import make_tiny_checkpoint

from pagoda.model.loader import get_model_config_dict
from pagoda.model.loader.hf_config import layer_sliding_windows

PROMPT_LEN, MAX_TOKENS = 100, 12


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (70,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(3)]
    # Two prompts with a long common prefix (prefix-cache hits within the first round).
    prompts += [shared + torch.randint(0, vocab, (30 + i,), generator=gen).tolist() for i in (0, 5)]
    return prompts + [prompts[0][:37]]


def _hf_reference(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens of transformers' forward over the whole sequence at each step, and the
    log-softmax of its logits over the final sequence.

    Not `generate`: with a sliding window, transformers 5's `generate` scores the prompt
    differently from its own forward (0.004 apart on these checkpoints, even with
    use_cache=False), while its forward and `masking_utils`' window, keys (p - window, p], agree
    with Pagoda to 1e-7; the forward is the reference."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
    return tokens[len(prompt) :], torch.log_softmax(logits, -1)


@pytest.mark.parametrize(
    "case", ["mistral_sliding_window", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]
)
def test_engine_matches_transformers(tmp_path, case):

    hf = (
        make_tiny_checkpoint(tmp_path, case, sliding_window=16)
        if "sliding" in case
        else (make_tiny_checkpoint(tmp_path, case))
    )
    vocab = hf.config.vocab_size
    prompts = _prompts(vocab)
    llm = engine(tmp_path)
    windows = layer_sliding_windows(get_model_config_dict(str(tmp_path)))
    kv = llm.llm_engine.scheduler.kv_cache_manager
    # Blocks behind the window are freed only where every layer has one.
    assert kv.sliding_window == (windows[0] if all(windows) else None)
    assert_matches_transformers(llm, hf, prompts)


def engine(path):
    """An `LLM` on the checkpoint at `path` that batches several requests (the rest waiting),
    prefills the 100-token prompts in chunks and caches prefixes."""
    from pagoda import LLM

    return LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        block_size=8,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=8 << 20,
    )


def assert_matches_transformers(llm, hf, prompts: list[list[int]]) -> None:
    """Two rounds of greedy `prompts` (the second from the prefix cache) give transformers'
    tokens, the first with each token's logprob within 1e-3 of transformers'."""
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(inputs, params, use_tqdm=False)
    second = llm.generate(inputs, params, use_tqdm=False)  # prefix-cache hits
    for prompt, a, b in zip(prompts, first, second):
        ref_tokens, ref_logprobs = _hf_reference(hf, prompt)
        tokens = a.outputs[0].token_ids
        assert tokens == ref_tokens
        assert b.outputs[0].token_ids == ref_tokens
        for i, (tok, lp) in enumerate(zip(tokens, a.outputs[0].logprobs)):
            want = ref_logprobs[len(prompt) - 1 + i, tok].item()
            assert abs(lp[tok].logprob - want) < 1e-3, (i, lp[tok].logprob, want)


@pytest.mark.parametrize("max_position", [256, 64])
def test_longrope_table_matches_transformers(max_position):
    """Long factors and the attention factor when the context exceeds the original one (as
    transformers computes them for a forward that long), short factors and no scaling when not."""
    import transformers

    from pagoda.model.layers.rotary_embedding import get_rope

    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [1.0 + 0.7 * i for i in range(8)],
    }
    cfg = dict(
        hidden_size=128,
        num_attention_heads=4,
        num_hidden_layers=1,
        max_position_embeddings=max_position,
        original_max_position_embeddings=64,
        rope_parameters=rope,
    )
    hf_rope = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(
        transformers.Phi3Config(**cfg)
    )
    n = max_position  # past the original context only when max_position is
    cos, sin = hf_rope(torch.zeros(1, n, 32), torch.arange(n)[None])
    table = get_rope(cfg, 32).cos_sin_cache[:n]
    assert table.shape == (n, 16)  # half of the head rotated: 8 frequencies
    torch.testing.assert_close(table, torch.cat([cos[0, :, :8], sin[0, :, :8]], -1))
