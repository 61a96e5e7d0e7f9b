"""The embedded SmolLM2-135M GGUF through Pagoda vs transformers' dequantized float32 model.

Both read the same Q4_1/Q8_0 file; transformers dequantizes with the `gguf` package, Pagoda with
its own reader, so this checks the reader, the weight mapping (q/k un-permutation, tied
embeddings) and the model together on a real 30-layer network, through the paged cache.
"""

from __future__ import annotations

import os

import pytest
import torch
from model_testing import PagedRunner

from pagoda.config import ModelConfig, embedded_model_path
from pagoda.model.loader import get_model_config_dict, load_model

pytestmark = pytest.mark.slow

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 2],  # arbitrary ids, some special
    [504, 3458, 282, 4649, 314],
    list(range(1000, 1040)),
]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32
    ).eval()
    cfg = get_model_config_dict(path)
    ours = load_model(ModelConfig(model=path, hf_config=cfg, dtype="float32", max_model_len=512))
    return hf, ours, cfg


@pytest.mark.parametrize("prompt", PROMPTS, ids=["special", "short", "long"])
def test_logits_and_greedy_continuation_match_transformers(models, prompt):
    hf, ours, cfg = models
    runner = PagedRunner(ours, cfg, num_blocks=128)
    tokens = list(prompt)
    logits = [runner.step(tokens, 0)]
    for _ in range(7):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step(tokens[-1:], len(tokens) - 1))
    ours_logits = torch.cat(logits)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].float()
    delta = (ours_logits - ref).abs().max().item()
    print(f"prompt of {len(prompt)} tokens: max |dlogit| = {delta:.2e}")
    assert delta < 1e-2
    greedy_ref = hf.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2
    )[0, len(prompt) :].tolist()
    assert tokens[len(prompt) :] + [int(logits[-1][-1].argmax())] == greedy_ref
