"""N-gram speculative decoding through the engine: the output is the target model's. Greedy
outputs (with stops, max_tokens, penalties, bad_words, logprobs) equal those without speculation on the
embedded model while drafts are accepted; seeded random sampling on a tiny model keeps the
target's token distribution; the configuration is checked (vLLM's dict, the legacy arguments,
the CLI flag) and the acceptance shows in the Prometheus counters."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest
from model_testing import Tally
from spec_testing import tiny_model

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.sample.bad_words import banned_tokens

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
PROMPTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps "
    "over the lazy dog. the quick brown fox",
    "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
]


def _llm(spec: dict | None, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(dtype="float32", seed=0, speculative_config=spec, **kwargs)


def _run(llm: LLM, params) -> list[tuple]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def engines():
    plain, spec = _llm(None), _llm(SPEC)
    tally = Tally()
    spec.llm_engine.stat_logger = tally
    return plain, spec, tally


def test_greedy_outputs_equal_and_drafts_are_accepted(engines) -> None:
    plain, spec, tally = engines
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 33, 48, 7)]
    before = tally.accepted
    assert _run(spec, params) == _run(plain, params)
    assert tally.accepted - before >= 10  # the repetitive prompts get drafts accepted
    assert tally.draft_tokens >= tally.accepted and tally.drafts > 0


def test_stops_penalties_and_logprobs_match(engines) -> None:
    plain, spec, _ = engines
    cases = [
        SamplingParams(temperature=0.0, max_tokens=30, stop=["lazy"]),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[28]),
        SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=3),
    ]
    for params in cases:
        assert _run(spec, params) == _run(plain, params), params
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3)
    a = plain.generate(PROMPTS, params, use_tqdm=False)
    b = spec.generate(PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            for t in lx:
                assert abs(lx[t].logprob - ly[t].logprob) < 1e-3


def test_bad_words_match(engines) -> None:
    # Each verifying row bans after the drafts before it, as the step without drafts would:
    # the n-gram drafts propose the banned words' tokens right after their prefixes.
    plain, spec, tally = engines
    words = ["4, 5", "lazy dog", "Paris", " b"]
    params = SamplingParams(temperature=0.0, max_tokens=30, bad_words=words)
    before = tally.accepted
    got = _run(spec, params)
    assert got == _run(plain, params)
    assert got != _run(plain, SamplingParams(temperature=0.0, max_tokens=30))
    params.update_from_tokenizer(spec.get_tokenizer())
    for ids, _, _, _ in got:  # (" lazy dogs" is no ban's token sequence: it may come)
        assert not any(
            t in banned_tokens(params.bad_words_token_ids, ids[:i]) for i, t in enumerate(ids)
        )
    assert tally.accepted - before >= 10


def _sample(model: str, spec: dict | None, n: int) -> tuple[list[list[int]], Tally]:
    llm = LLM(
        model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=128,
        speculative_config=spec,
    )
    tally = Tally()
    llm.llm_engine.stat_logger = tally
    prompt = {"prompt_token_ids": [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]}
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, seed=i, ignore_eos=True) for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], tally


def test_random_sampling_keeps_the_target_distribution(tmp_path) -> None:
    # Seeded requests over 8 tokens: n-gram drafts ([3, 1, 2] after the prompt) are proposed
    # at most steps and accepted only as often as the target samples them, so each position's
    # token distribution is the same with and without speculation; a verifier that kept a
    # token sampled after a rejected draft (a wrong context) moves whole tenths of the mass.
    model, n = tiny_model(tmp_path), 3000
    plain, _ = _sample(model, None, n)
    spec, tally = _sample(model, {**SPEC, "num_speculative_tokens": 3}, n)
    assert tally.drafts > n // 2 and 0 < tally.accepted < tally.draft_tokens
    for pos in range(4):
        p, q = Counter(s[pos] for s in plain), Counter(s[pos] for s in spec)
        tv = 0.5 * sum(abs(p[t] - q[t]) for t in range(8)) / n
        assert tv < 0.045, (pos, tv, p, q)  # two samples of 3000: ~0.02 apart by chance
    assert all(len(s) == 4 for s in spec)


def test_configuration() -> None:
    with pytest.raises(ValueError, match="not supported yet"):
        LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="unsupported key"):
        LLM(speculative_config={**SPEC, "draft_model_max_len": 1})
    for draft_tp in (2, True, "1"):  # the draft runs on one device: only 1 is honest
        with pytest.raises(ValueError, match="draft_tensor_parallel_size .* not supported"):
            LLM(speculative_config={**SPEC, "draft_tensor_parallel_size": draft_tp})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(speculative_config={**SPEC, "prompt_lookup_min": 4})
    with pytest.raises(ValueError, match="'model'"):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="'model'"):
        LLM(speculative_config={**SPEC, "model": "/some/draft"})
    # vLLM's older arguments, as in the seeds' samples (speculative_max_model_len is ignored).
    llm = LLM(
        speculative_model="[ngram]",
        num_speculative_tokens=3,
        ngram_prompt_lookup_max=2,
        speculative_max_model_len=4096,
        max_model_len=256,
    )
    proposer = llm.llm_engine.proposer
    assert (proposer.k, proposer.min_n, proposer.max_n) == (3, 2, 2)
    assert not llm.llm_engine.async_scheduling


def test_cli_flag() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    config = EngineArgs.from_cli_args(args).speculative_config
    assert config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "{not json"])


def test_prometheus_counts_drafts_and_accepted_tokens(engines) -> None:
    from prometheus_client import CollectorRegistry

    from pagoda.metrics.prometheus import PrometheusStatLogger

    _, spec, _ = engines
    metrics = PrometheusStatLogger("m", 512, registry=CollectorRegistry())
    engine = spec.llm_engine
    engine.add_request("p", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20))
    while engine.has_unfinished_requests():
        engine.step()
        metrics.record(engine)
    text = metrics.render().decode()
    accepted = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("pagoda:spec_decode_num_accepted_tokens_total")
    ]
    assert accepted and accepted[0] > 0
