"""The sampler on a CUDA device: no host sync before the final `.tolist()`, same answers as CPU."""

from __future__ import annotations

import pytest
import torch
from sampler_ref import make_md, ref_probs

from pagoda.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_logits_processors,
    compute_random_probs,
)
from pagoda.sampling_params import SamplingParams as SP

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

V = 1000
MIXED = [
    SP(temperature=0.0, logprobs=3),
    SP(temperature=1.0, top_p=0.9, seed=3),
    SP(temperature=0.7, top_k=20, min_p=0.05, repetition_penalty=1.2),
    SP(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.2, logit_bias={5: 2.0}),
    # Row 4 has 5 output tokens (`_inputs`): min_tokens above that keeps stop tokens 2 and 500 banned.
    SP(temperature=1.0, allowed_token_ids=[1, 2, 3, 500], min_tokens=8, logprobs=1),
    # Row 5's bad words (set by `_inputs`) ban its two best tokens: one word of one token, one
    # whose prefix is the row's last output token.
    SP(temperature=0.0),
]


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, V, generator=g) * 3
    prompts = [torch.randint(0, V, (30,), generator=g).tolist() for _ in range(n)]
    outputs = [torch.randint(0, V, (i + 1,), generator=g).tolist() for i in range(n)]
    for p in MIXED:
        p.all_stop_token_ids = {2, 500}
    best, second = logits[5].topk(2).indices.tolist()
    MIXED[5]._bad_words_token_ids = [[best], [outputs[5][-1], second], [4, 4, 4]]
    return logits, prompts, outputs


def test_no_host_sync_before_tolist():
    logits, prompts, outputs = _inputs(len(MIXED))
    dev = torch.device("cuda")
    logits = logits.to(dev)
    gens = [torch.Generator(device=dev).manual_seed(p.seed) if p.seed else None for p in MIXED]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = SamplingMetadata.from_requests(MIXED, prompts, outputs, gens, V, dev)
        tensors = Sampler().sample_on_device(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = tensors.tolist(md)
    assert len(out.sampled_token_ids) == len(MIXED)
    assert out.sampled_token_ids[4] in (1, 3)  # allowed, stop tokens banned by min_tokens


def test_cuda_matches_cpu():
    logits, prompts, outputs = _inputs(len(MIXED))
    md_cpu = make_md(MIXED, V, prompts, outputs)
    md_gpu = make_md(MIXED, V, prompts, outputs, device="cuda")
    cpu = Sampler()(logits, md_cpu)
    gpu = Sampler()(logits.cuda(), md_gpu)
    for i in (0, 3, 5):  # greedy rows
        assert gpu.sampled_token_ids[i] == cpu.sampled_token_ids[i]
    assert gpu.sampled_token_ids[5] == logits[5].topk(3).indices[2]  # the best two are banned
    lp_cpu = apply_logits_processors(logits.clone(), md_cpu)
    lp_gpu = apply_logits_processors(logits.cuda(), md_gpu)
    torch.testing.assert_close(lp_gpu.cpu(), lp_cpu)
    rows = [1, 2, 4]
    sub = SamplingMetadata.from_requests(
        [MIXED[i] for i in rows],
        [prompts[i] for i in rows],
        [outputs[i] for i in rows],
        [None] * 3,
        V,
        torch.device("cuda"),
    )
    probs = compute_random_probs(lp_gpu[rows].clone(), sub).cpu()
    for j, i in enumerate(rows):
        ref = ref_probs(logits[i], MIXED[i], prompts[i], outputs[i])
        assert torch.equal(probs[j] > 0, ref > 0)
        torch.testing.assert_close(probs[j].double(), ref, atol=1e-5, rtol=1e-4)


def test_cuda_seeded_request_is_independent_of_batch():
    dev = torch.device("cuda")
    seeded = SP(temperature=1.0, top_p=0.95, seed=11)
    logits = torch.randn(3, V, device=dev) * 2

    def run(params, row):
        gens = [None] * len(params)
        gens[row] = torch.Generator(device=dev).manual_seed(11)
        md = make_md(params, V, generators=gens, device="cuda")
        x = logits[: len(params)].clone()
        x[row] = logits[0]
        return [Sampler()(x, md).sampled_token_ids[row] for _ in range(8)]

    alone = run([seeded], 0)
    assert run([SP(temperature=1.0), SP(temperature=0.0), seeded], 2) == alone


def test_cuda_logprob_token_ids_match_cpu_without_host_sync():
    """Rows asking for `logprob_token_ids` beside top-k rows: the device path (a sort of those
    rows for true ranks) gives the CPU's ids, values and ranks, and waits for nothing before
    `.tolist()`."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, V, generator=g) * 3
    params = [
        SP(temperature=0.0, logprob_token_ids=[5, 999, 0, 42]),
        SP(temperature=0.0, logprobs=3),
        SP(temperature=0.0, logprob_token_ids=[17], repetition_penalty=1.3),
        SP(temperature=0.0),
        SP(temperature=0.0, logprobs=2, logprob_token_ids=[9, 9]),
    ]
    outputs = [[1, 17]] * len(params)
    cpu = Sampler()(logits, make_md(params, V, outputs=outputs))
    dev = torch.device("cuda")
    x = logits.to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = make_md(params, V, outputs=outputs, device="cuda")
        tensors = Sampler().sample_on_device(x, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gpu = tensors.tolist(md)
    assert gpu.sampled_token_ids == cpu.sampled_token_ids
    for row_cpu, row_gpu in zip(cpu.logprobs, gpu.logprobs):
        if row_cpu is None:
            assert row_gpu is None
            continue
        assert list(row_gpu) == list(row_cpu)
        for t, (value, rank) in row_cpu.items():
            assert row_gpu[t][1] == rank
            assert row_gpu[t][0] == pytest.approx(value, abs=1e-4)
