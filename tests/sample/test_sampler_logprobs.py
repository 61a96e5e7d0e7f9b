"""Sample and prompt logprobs against torch.log_softmax and a sort for the ranks."""

from __future__ import annotations

import pytest
import torch
from sampler_ref import make_md

from pagoda.sample.sampler import Sampler, compute_prompt_logprobs
from pagoda.sampling_params import SamplingParams as SP

V = 200


def _expected(raw: torch.Tensor, token: int, k: int) -> dict[int, tuple[float, int]]:
    """{token: (logprob, rank)} for `token` and the top k, ranks from a descending sort."""
    logprobs = torch.log_softmax(raw.double(), dim=-1)
    order = torch.argsort(logprobs, descending=True).tolist()
    rank = {t: r + 1 for r, t in enumerate(order)}
    wanted = [token] + order[:k]
    return {t: (logprobs[t].item(), rank[t]) for t in wanted}


def _assert_logprobs_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for t, (value, rank) in want.items():
        assert got[t][1] == rank, f"token {t}: rank {got[t][1]} != {rank}"
        assert got[t][0] == pytest.approx(value, abs=1e-5)


def test_sample_logprobs_are_raw_and_ranked():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g) * 3
    params = [
        SP(temperature=0.0, logprobs=3),
        SP(temperature=1.0, logprobs=5, repetition_penalty=1.5, presence_penalty=1.0),
        SP(temperature=0.7, top_k=40),  # no logprobs
        SP(temperature=2.0, logprobs=0),  # only the sampled token
        SP(temperature=0.0, logprobs=20, logit_bias={7: 50.0}),  # sampled token far down
        SP(temperature=1.0, logprobs=1, min_p=0.1),
    ]
    outputs = [[1, 2, 3]] * 6
    out = Sampler()(logits, make_md(params, V, prompts=[[4, 5]] * 6, outputs=outputs))
    assert out.logprobs[2] is None
    assert out.sampled_token_ids[4] == 7
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        # From the raw logits: penalties, bias and temperature do not change them.
        want = _expected(logits[i], out.sampled_token_ids[i], p.logprobs)
        _assert_logprobs_equal(out.logprobs[i], want)
    assert len(out.logprobs[3]) == 1
    assert len(out.logprobs[4]) == 21  # top 20 plus the biased token outside them


def test_logprobs_of_bf16_logits_use_float32():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, V, generator=g) * 3).to(torch.bfloat16)
    out = Sampler()(logits, make_md([SP(temperature=0.0, logprobs=2)] * 2, V))
    for i in range(2):
        want = _expected(logits[i].float(), out.sampled_token_ids[i], 2)
        _assert_logprobs_equal(out.logprobs[i], want)


def test_prompt_logprobs_match_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, V, generator=g) * 2
    targets = torch.randint(0, V, (9,), generator=g).tolist()
    for k in (0, 1, 4):
        got = compute_prompt_logprobs(logits, targets, k)
        assert len(got) == 9
        for i in range(9):
            _assert_logprobs_equal(got[i], _expected(logits[i], targets[i], k))
        # Chunking rows does not change anything.
        assert compute_prompt_logprobs(logits, targets, k, chunk_size=2) == got


def test_prompt_logprobs_bad_lengths_raise():
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(torch.zeros(3, V), [1, 2], 1)


def test_logprob_token_ids_report_those_ids_in_place_of_the_top_k():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, V, generator=g) * 3
    params = [
        SP(temperature=0.0, logprob_token_ids=[5, 199, 0, 42]),
        SP(temperature=1.0, logprobs=3),  # a top-k row beside them
        SP(temperature=0.8, logprob_token_ids=[17], repetition_penalty=1.3),
        SP(temperature=0.0),  # no logprobs
        SP(temperature=0.0, logprobs=2, logprob_token_ids=[9, 9]),  # a repeated id: one entry
    ]
    out = Sampler()(logits, make_md(params, V, outputs=[[1, 17]] * 5))
    assert out.logprobs[3] is None
    _assert_logprobs_equal(out.logprobs[1], _expected(logits[1], out.sampled_token_ids[1], 3))
    for i in (0, 2, 4):
        token = out.sampled_token_ids[i]
        ids = params[i].logprob_token_ids
        want = _expected(logits[i], token, 0)  # the sampled token's logprob and rank
        everything = _expected(logits[i], token, V)
        want.update({t: everything[t] for t in ids})  # raw logprobs and true ranks of the ids
        _assert_logprobs_equal(out.logprobs[i], want)
        assert list(out.logprobs[i]) == list(dict.fromkeys([token, *ids]))  # vLLM's order
