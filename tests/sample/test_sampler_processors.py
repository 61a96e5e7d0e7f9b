"""Each sampling knob of the batched sampler against the plain per-row reference."""

from __future__ import annotations

import pytest
import torch
from sampler_ref import make_md, ref_probs, ref_processed_logits

from pagoda.sample import logits_processors as lp
from pagoda.sample.sampler import Sampler, apply_logits_processors, compute_random_probs
from pagoda.sampling_params import SamplingParams as SP

V = 64


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 2


def _history(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (length + i,), generator=g).tolist() for i in range(n)]


def _batched_probs(logits, params, prompts, outputs) -> torch.Tensor:
    """The sampler's distribution for each row (all rows random)."""
    md = make_md(params, V, prompts, outputs)
    x = apply_logits_processors(logits.clone(), md)
    return compute_random_probs(x, md)


PARAMS = [
    SP(temperature=1.0),
    SP(temperature=0.7, top_k=5),
    SP(temperature=1.3, top_p=0.8),
    SP(temperature=0.9, top_k=10, top_p=0.7),
    SP(temperature=1.0, min_p=0.2),
    SP(temperature=0.8, min_p=0.05, top_k=20, top_p=0.9),
    SP(temperature=1.0, top_k=V),  # top_k == vocab keeps everything
    SP(temperature=0.5, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=-0.3),
    SP(temperature=1.0, logit_bias={3: 5.0, 7: -100.0}, top_p=0.95),
    SP(temperature=1.0, allowed_token_ids=[1, 5, 9, 40], top_k=3),
]


def test_random_row_distributions_match_reference():
    logits = _logits(len(PARAMS))
    prompts, outputs = _history(len(PARAMS), 5, 1), _history(len(PARAMS), 7, 2)
    probs = _batched_probs(logits, PARAMS, prompts, outputs)
    for i, p in enumerate(PARAMS):
        ref = ref_probs(logits[i], p, prompts[i], outputs[i])
        assert torch.equal(probs[i] > 0, ref > 0), f"row {i}: kept tokens differ ({p})"
        torch.testing.assert_close(probs[i].double(), ref, atol=1e-5, rtol=1e-4)


def test_penalties_match_per_row_python():
    params = [
        SP(temperature=0.0, repetition_penalty=1.3),
        SP(temperature=1.0, frequency_penalty=0.7),
        SP(temperature=1.0, presence_penalty=1.1),
        SP(temperature=0.0),  # no penalty: untouched
        SP(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=2.0),
    ]
    logits = _logits(len(params), seed=3)
    prompts, outputs = _history(len(params), 10, 4), _history(len(params), 12, 5)
    outputs[0] = []  # first step: repetition penalty over the prompt alone
    outputs[1] = []  # nothing generated yet: no frequency penalty
    md = make_md(params, V, prompts, outputs)
    got = apply_logits_processors(logits.clone(), md)
    for i, p in enumerate(params):
        ref = ref_processed_logits(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(got[i].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], logits[3])
    # Greedy rows pick the argmax of the penalised logits.
    out = Sampler()(logits, md)
    for i in (0, 3, 4):
        assert out.sampled_token_ids[i] == int(got[i].argmax())


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(8, seed=6)
    greedy = logits.argmax(dim=-1).tolist()
    for p in (SP(temperature=1.5, top_k=1), SP(temperature=1.5, top_p=1e-6)):
        md = make_md([p] * 8, V)
        for _ in range(5):
            assert Sampler()(logits, md).sampled_token_ids == greedy


def test_min_p_log_space_matches_softmax_threshold():
    x = _logits(6, seed=7)
    x[2, :10] = float("-inf")
    min_p = torch.tensor([0.0, 0.01, 0.1, 0.5, 0.9, 1.0])
    got = lp.apply_min_p(x.clone(), min_p)
    probs = x.softmax(dim=-1)
    ref = x.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    assert torch.equal(got, ref)
    assert torch.isfinite(got[0]).sum() == V  # min_p = 0 keeps everything
    assert torch.isfinite(got[5]).sum() == 1  # min_p = 1 keeps only the top token


def test_top_k_top_p_ties_at_threshold_are_kept():
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0]])
    got = lp.apply_top_k_top_p(x.clone(), torch.tensor([2]), None)
    assert torch.isfinite(got).tolist() == [[False, True, True, True, False]]


def test_sort_values_ascending_matches_torch_sort():
    x = _logits(5, seed=8)
    x[1, 3] = float("-inf")
    x[4, :] = 0.5
    assert torch.equal(lp.sort_values_ascending(x), torch.sort(x, dim=-1).values)
    # Non-float32 inputs take the torch.sort path.
    xb = x.to(torch.bfloat16)
    assert torch.equal(lp.sort_values_ascending(xb), torch.sort(xb, dim=-1).values)


def test_logit_bias_forces_a_token():
    logits = _logits(4, seed=9)
    bias = {11: 100.0}
    params = [
        SP(temperature=0.0, logit_bias=bias),
        SP(temperature=1.0, logit_bias=bias),
        SP(temperature=1.0, top_p=0.5, logit_bias=bias),
        SP(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    md = make_md(params, V)
    for _ in range(5):
        out = Sampler()(logits, md).sampled_token_ids
        assert out[:3] == [11, 11, 11]
        assert out[3] == int(logits[3].topk(2).indices[1])


def test_allowed_token_ids_restrict_sampling():
    logits = _logits(2, seed=10)
    allowed = [2, 17, 33, 60]
    params = [
        SP(temperature=0.0, allowed_token_ids=allowed),
        SP(temperature=2.0, allowed_token_ids=allowed),
    ]
    md = make_md(params, V)
    seen = set()
    for _ in range(200):
        out = Sampler()(logits, md).sampled_token_ids
        assert out[0] == max(allowed, key=lambda t: logits[0, t].item())
        assert out[1] in allowed
        seen.add(out[1])
    assert len(seen) > 1  # really sampled, not collapsed to one token


def test_min_tokens_blocks_stop_tokens_until_reached():
    eos, stop = 5, 9
    logits = torch.zeros(3, V)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    params = []
    for _ in range(3):
        p = SP(temperature=0.0, min_tokens=3, stop_token_ids=[stop])
        p.all_stop_token_ids = {eos, stop}  # the engine adds the tokenizer's eos
        params.append(p)
    outputs = [[1], [1, 2], [1, 2, 3]]  # below, below, at min_tokens
    out = Sampler()(logits, make_md(params, V, outputs=outputs)).sampled_token_ids
    assert out[0] not in (eos, stop) and out[1] not in (eos, stop)
    assert out[2] == eos


def test_min_tokens_yields_to_constraints_that_allow_only_stop_tokens():
    # allowed_token_ids of stop tokens only (or a grammar that can only end): min_tokens
    # would leave no token at all; the stop tokens stay, the other rows are banned as before.
    eos, stop = 5, 9
    logits = _logits(3, seed=12)
    params = [
        SP(temperature=0.0, min_tokens=3, allowed_token_ids=[eos, stop]),
        SP(temperature=1.0, min_tokens=3, allowed_token_ids=[eos]),
        SP(temperature=0.0, min_tokens=3, allowed_token_ids=[eos, 20]),
    ]
    for p in params:
        p.all_stop_token_ids = {eos, stop}
    outputs = [[1], [1], [1]]
    md = make_md(params, V, outputs=outputs)
    x = apply_logits_processors(logits.clone(), md)
    for i, p in enumerate(params):
        torch.testing.assert_close(
            x[i].double(), ref_processed_logits(logits[i], p, [], outputs[i]), rtol=0, atol=1e-6
        )
    out = Sampler()(logits, md).sampled_token_ids
    assert out[0] == max((eos, stop), key=lambda t: logits[0, t].item())
    assert out[1] == eos and out[2] == 20


def test_penalty_rows_subset_leaves_other_rows_untouched():
    params = [SP(temperature=0.0), SP(temperature=0.0, presence_penalty=2.0), SP(temperature=0.0)]
    logits = _logits(3, seed=11)
    outputs = [[int(logits[i].argmax())] for i in range(3)]
    out = Sampler()(logits, make_md(params, V, outputs=outputs)).sampled_token_ids
    assert out[0] == outputs[0][0] and out[2] == outputs[2][0]
    expected = logits[1].clone()
    expected[outputs[1][0]] -= 2.0
    assert out[1] == int(expected.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_input_logits_are_not_modified(dtype):
    logits = _logits(len(PARAMS), seed=12).to(dtype)
    before = logits.clone()
    Sampler()(logits, make_md(PARAMS, V, outputs=_history(len(PARAMS), 3, 13)))
    assert torch.equal(logits, before)


def test_min_p_applies_before_top_p_as_in_vllm():
    # probs 0.5/0.3/0.1/0.05/0.05: min_p 0.15 keeps 3 tokens (renormalised 0.56/0.33/0.11), then
    # top_p 0.85 keeps 2. Top-p first (HF order) would keep 3.
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]]).log()
    p = SP(temperature=1.0, min_p=0.15, top_p=0.85)
    probs = compute_random_probs(logits.clone(), make_md([p], 5))
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.equal(ref_probs(logits[0], p, [], []) > 0, probs[0] > 0)
