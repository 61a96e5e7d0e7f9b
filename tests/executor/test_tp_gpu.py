"""Tensor parallelism on two CUDA GPUs (NCCL): the tiny GQA Llama generates the same tokens at
tensor_parallel_size=2 as on one GPU, greedy (with logprobs and prompt logprobs, through chunked
prefill and preemption) and seeded sampling, with and without async scheduling, with CUDA graphs
and eagerly. GPU-marked: it needs two GPUs and is skipped elsewhere."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from tp_testing import GREEDY, PROMPTS, SEEDED, generated_tokens, tiny_checkpoint, tp_llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict:
    llm = tp_llm(checkpoint, 1)
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    out = {"greedy": greedy, "seeded": generated_tokens(llm, SEEDED)}
    del llm
    gc.collect()
    return out


@pytest.mark.parametrize(
    "async_scheduling,enforce_eager", [(False, False), (True, False), (False, True)]
)
def test_tp2_on_two_gpus_matches_one_gpu(
    checkpoint, reference, async_scheduling, enforce_eager
) -> None:
    # Each rank replays its CUDA graphs (NCCL all-reduces captured in them), or runs eagerly.
    llm = tp_llm(checkpoint, 2, async_scheduling=async_scheduling, enforce_eager=enforce_eager)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        for got, want in zip(outs, reference["greedy"]):
            assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
            # NCCL sums the partial products in another order: logprobs agree closely.
            for lp_got, lp_want in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
                for tok, entry in lp_want.items():
                    assert math.isclose(lp_got[tok].logprob, entry.logprob, abs_tol=1e-3)
            assert len(got.prompt_logprobs) == len(want.prompt_logprobs)
        assert generated_tokens(llm, SEEDED) == reference["seeded"]
    finally:
        del llm
        gc.collect()
