"""Speculative decoding on a GPU (dummy weights, Triton attention over the verify rows, CUDA
graphs for the target, the draft model's own runner and KV cache on the device): greedy tokens
equal those without speculation, for n-gram drafts and for a draft model, and a draft model with
the target's weights gets its drafts accepted. Float32, where random weights' near-ties do not
flip between differently shaped products. Marked `gpu`: `pytest tests/spec_decode -m gpu`."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
import torch
from model_testing import Tally

from pagoda import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PRESET = Path(__file__).parents[2] / "benchmarks/presets/llama-3.2-1b/config.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    cfg = json.loads(PRESET.read_text())
    cfg["num_hidden_layers"] = 2
    path = tmp_path_factory.mktemp("llama-1b-2l")
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = []
    for n in (5, 40, 120, 300):
        motif = [rng.randrange(128000) for _ in range(rng.randint(3, 12))]
        # Repeats give the n-gram proposer something to match.
        prompts.append([rng.randrange(128000) for _ in range(n)] + motif * 4)
    return prompts


def _generate(model_dir: str, spec: dict | None) -> tuple[list[list[int]], Tally]:
    llm = LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        device="cuda",
        dtype="float32",
        seed=0,
        max_model_len=1024,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        kv_cache_memory_bytes=1 << 30,
        speculative_config=spec,
    )
    tally = Tally()
    llm.llm_engine.stat_logger = tally
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=12 + 5 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], tally


def test_speculation_keeps_greedy_tokens_on_the_gpu(model_dir) -> None:
    plain, _ = _generate(model_dir, None)
    assert [len(t) for t in plain] == [12 + 5 * i for i in range(4)]
    ngram, ngram_tally = _generate(
        model_dir,
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    assert ngram == plain
    assert ngram_tally.drafts > 0
    # The same dummy weights (same seed) make the draft model the target itself: its greedy
    # drafts are the target's tokens, so nearly all are accepted.
    draft, draft_tally = _generate(
        model_dir, {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    )
    assert draft == plain
    assert draft_tally.draft_tokens > 0
    assert draft_tally.accepted >= 0.9 * draft_tally.draft_tokens
