"""Pagoda's Llama-family models against `transformers` on tiny random checkpoints.

Each checkpoint is written by `save_pretrained` (safetensors), loaded by Pagoda, and run as a
prefill followed by decode steps through a paged KV cache with scattered blocks; every step's
float32 logits must match the Hugging Face forward over the same tokens, and greedy
continuations must be identical.
"""

from __future__ import annotations

import pytest
import torch
from model_testing import TINY_CASES, TINY_CONFIG, PagedRunner, make_tiny_checkpoint

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model

SMALL = TINY_CONFIG
CASES = TINY_CASES


def load_pagoda(path, dtype: str = "float32"):
    hf_config = get_model_config_dict(str(path))
    mc = ModelConfig(model=str(path), hf_config=hf_config, dtype=dtype, max_model_len=256)
    return load_model(mc, "cpu")


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, case):
    overrides = CASES[case][2]
    hf = make_tiny_checkpoint(tmp_path, case)
    model = load_pagoda(tmp_path)
    cfg = get_model_config_dict(str(tmp_path))
    runner = PagedRunner(model, {**SMALL, **overrides, **cfg})

    prompt = torch.randint(
        0, SMALL["vocab_size"], (11,), generator=torch.Generator().manual_seed(1)
    )
    tokens = prompt.tolist()
    logits = [runner.step(tokens, 0)]
    for _ in range(6):  # greedy decode through the cache
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step(tokens[-1:], len(tokens) - 1))
    ours = torch.cat(logits)  # logits at positions 0 .. len(tokens) - 1

    with torch.no_grad():
        ref = hf(torch.tensor(tokens)[None]).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
    ref_greedy = hf.generate(prompt[None], max_new_tokens=7, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ]
    ours_greedy = tokens[len(prompt) :] + [int(logits[-1][-1].argmax())]
    assert ours_greedy == ref_greedy.tolist()


def test_chunked_prefill_matches_one_shot(tmp_path):
    overrides = CASES["qwen3"][2]
    make_tiny_checkpoint(tmp_path, "qwen3")
    model = load_pagoda(tmp_path)
    cfg = {**SMALL, **overrides}
    prompt = torch.randint(0, SMALL["vocab_size"], (23,)).tolist()
    one_shot = PagedRunner(model, cfg).step(prompt, 0)
    chunked = PagedRunner(model, cfg, seed=5)
    parts = [chunked.step(prompt[a:b], a) for a, b in ((0, 7), (7, 8), (8, 23))]
    assert (torch.cat(parts) - one_shot).abs().max().item() < 1e-4


def test_bfloat16_model_stays_close_to_float32(tmp_path):
    overrides = CASES["llama_gqa_tied_llama3_rope"][2]
    make_tiny_checkpoint(tmp_path, "llama_gqa_tied_llama3_rope")
    cfg = {**SMALL, **overrides}
    prompt = torch.randint(0, SMALL["vocab_size"], (16,)).tolist()
    ref = PagedRunner(load_pagoda(tmp_path), cfg).step(prompt, 0)
    bf16 = load_pagoda(tmp_path, "bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    runner = PagedRunner(bf16, cfg)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    out = runner.step(prompt, 0)
    assert out.dtype == torch.float32
    assert (out - ref).abs().max().item() < 0.1 * ref.abs().max().item()
