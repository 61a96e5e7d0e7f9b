"""`bad_words` on the logits: the batched sampler against vLLM's per-row rule (`sampler_ref`)."""

from __future__ import annotations

import math

import torch
from sampler_ref import make_md, ref_bad_words_bans, ref_processed_logits

from pagoda.sample.bad_words import banned_tokens
from pagoda.sample.sampler import Sampler, apply_logits_processors
from pagoda.sampling_params import SamplingParams as SP

V = 64


def _sp(words: list[list[int]], temperature: float = 0.0) -> SP:
    """SamplingParams as the engine hands them on, bad_words already tokenized."""
    return SP(temperature=temperature, _bad_words_token_ids=words)


def _processed(logits, params, outputs) -> torch.Tensor:
    return apply_logits_processors(logits.clone(), make_md(params, V, outputs=outputs))


def test_a_one_token_word_is_always_banned():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[:, 7] = 50.0  # every row's argmax, unbanned
    params = [_sp([[7]]), _sp([[7]]), SP(temperature=0.0)]
    outputs = [[], [1, 2, 7], [1]]
    x = _processed(logits, params, outputs)
    assert x[0, 7] == x[1, 7] == -math.inf
    assert torch.equal(x[2], logits[2])  # a row without bad_words is untouched
    out = Sampler()(logits, make_md(params, V, outputs=outputs)).sampled_token_ids
    second = logits[0].clone()
    second[7] = -math.inf
    assert out[0] == int(second.argmax()) and out[2] == 7


def test_a_word_of_several_tokens_bans_its_last_only_right_after_its_prefix():
    word = [3, 4, 5]
    cases = {  # output -> is 5 banned next
        (): False,  # nothing generated: the prefix cannot be there
        (3,): False,
        (4,): False,  # only part of the prefix
        (3, 4): True,
        (9, 9, 3, 4): True,
        (3, 4, 9): False,  # the prefix, but not last
        (4, 3): False,
        (3, 4, 5): False,  # the whole word is out already; 5 is not next after 4, 5
    }
    params = [_sp([word]) for _ in cases]
    outputs = [list(o) for o in cases]
    logits = torch.zeros(len(cases), V)
    x = _processed(logits, params, outputs)
    for i, (out, banned) in enumerate(cases.items()):
        assert (x[i, 5] == -math.inf) == banned, out
        assert x[i, 3] == x[i, 4] == 0.0  # the prefix's tokens never are
        assert (x[i] == -math.inf).sum() == banned


def test_a_prefix_in_the_prompt_bans_nothing():
    # Only generated tokens count (vLLM passes the output tokens, not the prompt).
    params = [SP(temperature=0.0, repetition_penalty=1.0, _bad_words_token_ids=[[3, 4]])]
    md = make_md(params, V, prompts=[[1, 2, 3]], outputs=[[]])
    x = apply_logits_processors(torch.zeros(1, V), md)
    assert not torch.isinf(x).any()


def test_several_words_and_rows_match_vllms_rule():
    g = torch.Generator().manual_seed(5)
    words = [[10], [11, 12], [20, 21, 22], [11, 13], [30, 31, 32, 33], [40, 12]]
    params, outputs = [], []
    for i in range(24):
        n = int(torch.randint(0, 6, (1,), generator=g))
        out = torch.randint(0, V, (n,), generator=g).tolist()
        if i % 3 == 0 and n:  # end the output on some word's prefix
            w = words[int(torch.randint(0, len(words), (1,), generator=g))]
            out = out + w[:-1]
        chosen = [words[j] for j in torch.randperm(len(words), generator=g)[: 1 + i % 4]]
        params.append(_sp(chosen, temperature=0.0 if i % 2 else 0.8) if i % 5 else SP())
        outputs.append(out)
    logits = torch.randn(len(params), V, generator=g)
    x = _processed(logits, params, outputs)
    hits = 0
    for i, p in enumerate(params):
        ref = ref_processed_logits(logits[i], p, [], outputs[i])
        torch.testing.assert_close(x[i].double(), ref, rtol=0, atol=0)
        bans = ref_bad_words_bans(p.bad_words_token_ids or [], outputs[i])
        assert set(banned_tokens(p.bad_words_token_ids or [], outputs[i])) == bans
        hits += any(len(w) > 1 and w[-1] in bans for w in p.bad_words_token_ids or [])
    assert hits >= 3  # multi-token words really were banned after their prefixes


def test_bad_words_compose_with_allowed_token_ids_and_logit_bias():
    params = [
        SP(temperature=0.0, allowed_token_ids=[1, 2, 3], _bad_words_token_ids=[[2]]),
        SP(temperature=0.0, logit_bias={4: 100.0}, _bad_words_token_ids=[[9, 4]]),
    ]
    outputs = [[5], [1, 9]]
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    x = _processed(logits, params, outputs)
    for i, p in enumerate(params):
        ref = ref_processed_logits(logits[i], p, [], outputs[i])
        torch.testing.assert_close(x[i].double(), ref, rtol=0, atol=0)
    assert x[1, 4] == -math.inf  # a bias does not lift the ban
    out = Sampler()(logits, make_md(params, V, outputs=outputs)).sampled_token_ids
    assert out[0] in (1, 3) and out[1] != 4
