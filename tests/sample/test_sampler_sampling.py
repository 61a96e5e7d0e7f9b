"""Random sampling: frequencies, seeded reproducibility, the greedy fast path, input checks."""

from __future__ import annotations

import pytest
import torch
from sampler_ref import make_md, ref_probs

from pagoda.sample.sampler import Sampler, SamplingMetadata, random_sample
from pagoda.sampling_params import SamplingParams as SP

TINY_V = 6
TINY_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    kept = probs > 0
    assert counts[~kept].sum() == 0, "sampled a token with probability 0"
    expected = n * probs[kept]
    return float(((counts[kept] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    "params",
    [
        SP(temperature=1.0),
        SP(temperature=0.6),
        SP(temperature=2.0, top_k=4),
        SP(temperature=1.0, top_p=0.8),
        SP(temperature=1.5, min_p=0.1),
    ],
    ids=["t1", "t0.6", "topk", "topp", "minp"],
)
def test_sampled_frequencies_match_softmax(params):
    # 20000 draws as one batch of identical rows; chi-square with <= 5 degrees of freedom:
    # 30 is far past the 0.1% critical value (20.5), and the seed is fixed.
    torch.manual_seed(1234)
    n = 20000
    md = make_md([params] * n, TINY_V)
    out = Sampler()(TINY_LOGITS.expand(n, TINY_V).contiguous(), md).sampled_token_ids
    counts = torch.bincount(torch.tensor(out), minlength=TINY_V).double()
    probs = ref_probs(TINY_LOGITS, params, [], [])
    assert _chi_square(counts, probs) < 30.0


def test_exponential_race_samples_unnormalised_probs():
    torch.manual_seed(0)
    probs = torch.tensor([[0.2, 0.0, 0.6, 0.2]]).expand(20000, 4).contiguous() * 7.0
    out = random_sample(probs.clone(), {})
    counts = torch.bincount(out, minlength=4).double()
    assert _chi_square(counts, probs[0].double() / 7.0) < 30.0


def _run_steps(
    params: list[SP], seed_row: int, seed: int, vocab: int, steps: int, logits_seed: int
) -> list[int]:
    """Sample `steps` tokens for the batch, feeding each row's tokens back as its history;
    returns the token sequence of `seed_row`. Row logits depend only on (row's seed, step)."""
    generators = [None] * len(params)
    generators[seed_row] = torch.Generator().manual_seed(seed)
    outputs: list[list[int]] = [[] for _ in params]
    prompts = [[1, 2, 3] for _ in params]
    g = torch.Generator().manual_seed(logits_seed)
    seeded_logits = [torch.randn(vocab, generator=g) for _ in range(steps)]
    for step in range(steps):
        logits = torch.randn(len(params), vocab) * 3  # other rows: anything
        logits[seed_row] = seeded_logits[step]
        md = SamplingMetadata.from_requests(
            params, prompts, outputs, generators, vocab, torch.device("cpu")
        )
        for row, tok in enumerate(Sampler()(logits, md).sampled_token_ids):
            outputs[row].append(tok)
    return outputs[seed_row]


def test_seeded_request_is_independent_of_batch():
    vocab = 500
    seeded = SP(temperature=1.0, top_p=0.95, min_p=0.01, presence_penalty=0.5, seed=7)
    alone = _run_steps([seeded], 0, 7, vocab, steps=6, logits_seed=3)
    others = [
        SP(temperature=0.0),
        SP(temperature=0.8, top_k=5),
        SP(temperature=1.0, seed=99),
        SP(temperature=1.2, repetition_penalty=1.2, logprobs=2),
    ]
    for pos in (0, 2, 4):
        batch = others[:pos] + [seeded] + others[pos:]
        assert _run_steps(batch, pos, 7, vocab, steps=6, logits_seed=3) == alone
    # And the seed matters: another seed gives another sequence.
    assert _run_steps([seeded], 0, 8, vocab, steps=6, logits_seed=3) != alone


def test_plain_greedy_fast_path_matches_reference():
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(16, 1000, generator=g) * 4).to(dtype)
        md = make_md([SP(temperature=0.0)] * 16, 1000)
        assert md.is_plain_greedy
        sampler = Sampler()
        fast = sampler.sample_on_device(logits, md).sampled_token_ids
        ref = sampler.sample_reference(logits, md).sampled_token_ids
        assert torch.equal(fast, ref)
        assert torch.equal(fast, logits.float().argmax(dim=-1))


def test_fast_path_is_not_taken_when_something_must_be_processed():
    for p in (
        SP(temperature=0.0, logprobs=0),
        SP(temperature=0.0, presence_penalty=0.1),
        SP(temperature=0.0, logit_bias={1: 1.0}),
        SP(temperature=0.0, allowed_token_ids=[1]),
        SP(temperature=0.5),
    ):
        assert not make_md([p], 10).is_plain_greedy, p


def test_mixed_batch_greedy_rows_are_argmax():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 300, generator=g)
    params = [SP(temperature=0.0), SP(temperature=1.0)] * 3
    out = Sampler()(logits, make_md(params, 300)).sampled_token_ids
    for i in (0, 2, 4):
        assert out[i] == int(logits[i].argmax())


def test_bad_inputs_raise_value_error():
    p = [SP(), SP()]
    with pytest.raises(ValueError, match="generators"):
        SamplingMetadata.from_requests(p, [[], []], [[], []], [None], 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="params must not be empty"):
        SamplingMetadata.from_requests([], [], [], [], 10, torch.device("cpu"))
    with pytest.raises(ValueError, match="logit_bias"):
        make_md([SP(logit_bias={10: 1.0})], 10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        make_md([SP(allowed_token_ids=[3, 12])], 10)
    md = make_md(p, 10)
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler()(torch.zeros(2, 11), md)
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(3, 10), md)


def test_cpu_greedy_argmax_is_torch_argmax():
    """The numpy argmax CPU greedy steps take: first maximal index, ties and NaN included."""
    from pagoda.sample.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (6, 49152), generator=gen).float()  # many ties per row
    x[3, 100] = float("nan")
    x[4, 7] = x[4, 9000] = float("inf")
    for rows in (x, x[:1], x[:, :1000], x[2:5]):
        got = greedy_argmax(rows)
        assert got.dtype is torch.int64
        assert got.tolist() == rows.argmax(dim=-1).tolist()
