"""Draft-model speculative decoding: the embedded model drafting for itself has every draft
accepted (positions line up) and the same greedy output; a random draft of the same vocabulary
changes nothing but the acceptance; seeded sampling keeps the target's distribution with a
different tiny model as the draft, and the draft runner's requests (kept from plain data, sent
again whole after a rejection) match the shadows; the draft's cache is released with its
requests, also on aborts and preemption; a draft with another vocabulary is refused."""

from __future__ import annotations

from collections import Counter

import pytest
from model_testing import Tally
from spec_testing import tiny_model

from pagoda import LLM, SamplingParams
from pagoda.config import embedded_model_path

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fib(n):", "Hi"]


def _llm(spec: dict | None, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    llm = LLM(dtype="float32", seed=0, speculative_config=spec, **kwargs)
    llm.llm_engine.stat_logger = Tally()
    return llm


def _tokens(llm: LLM, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _check_draft_runner_requests(llm: LLM, monkeypatch) -> list[int]:
    """After every draft step, the draft runner's copy of each shadow it ran must equal the
    shadow (tokens and block table); returns [steps checked]."""
    proposer = llm.llm_engine.proposer
    runner = proposer.executor.model_runner
    run, checked = proposer._run, [0]

    def checked_run(shadows, counts):
        out = run(shadows, counts)
        for shadow in shadows:
            state = runner.requests.requests[shadow.request_id]
            assert state.all_token_ids == shadow.all_token_ids
            assert state.block_ids == proposer.kv.get_block_ids(shadow.request_id)
        checked[0] += 1
        return out

    monkeypatch.setattr(proposer, "_run", checked_run)
    return checked


def _assert_released(llm: LLM) -> None:
    proposer = llm.llm_engine.proposer
    proposer.release(set())  # as the next step would, with nothing running
    assert not proposer.shadows
    assert proposer.kv.num_free_blocks == proposer.kv.num_total_blocks


@pytest.fixture(scope="module")
def plain() -> LLM:
    return _llm(None)


def test_the_target_as_its_own_draft_has_every_draft_accepted(plain) -> None:
    spec = _llm({"model": embedded_model_path(), "num_speculative_tokens": 4})
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (40, 23, 31, 5)]
    assert _tokens(spec, params) == _tokens(plain, params)
    tally = spec.llm_engine.stat_logger
    assert tally.drafts > 10 and tally.accepted == tally.draft_tokens
    _assert_released(spec)


def test_a_random_draft_changes_only_the_acceptance(plain, tmp_path, monkeypatch) -> None:
    vocab = plain.llm_engine.model_config.hf_config["vocab_size"]
    draft = tiny_model(tmp_path, vocab=vocab, seed=3, max_len=512)
    spec = _llm({"model": draft, "num_speculative_tokens": 3}, max_num_batched_tokens=16)
    checked = _check_draft_runner_requests(spec, monkeypatch)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=20, stop=["."]),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.2, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=2),
    ]
    assert _tokens(spec, params) == _tokens(plain, params)
    tally = spec.llm_engine.stat_logger
    assert tally.draft_tokens > 20 and tally.accepted < tally.draft_tokens
    assert checked[0] > 10
    _assert_released(spec)


def test_aborts_and_preemption_release_the_draft_cache(plain) -> None:
    # A target cache of 8 blocks for 4 requests preempts; an abort mid-way frees its shadow.
    spec = _llm(
        {"model": embedded_model_path(), "num_speculative_tokens": 3},
        num_gpu_blocks_override=8,
        block_size=16,
        max_model_len=128,
    )
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = spec.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    for _ in range(6):
        engine.step()
    engine.abort_request("1")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    want = _tokens(plain, params)
    for rid, tokens in outs.items():
        if rid != "1":
            assert tokens == want[int(rid)]
    assert engine.num_preemptions_total > 0
    _assert_released(spec)


def test_sampling_keeps_the_target_distribution(tmp_path) -> None:
    target = tiny_model(tmp_path / "target", seed=0)
    draft = tiny_model(tmp_path / "draft", seed=1, sharpness=0.2)  # another, sharper model
    n = 3000
    samples = {}
    for name, spec in (("plain", None), ("draft", {"model": draft, "num_speculative_tokens": 3})):
        llm = LLM(
            target,
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=64,
            max_num_seqs=128,
            speculative_config=spec,
        )
        llm.llm_engine.stat_logger = tally = Tally()
        params = [
            SamplingParams(temperature=1.0, max_tokens=4, seed=i, ignore_eos=True) for i in range(n)
        ]
        prompt = {"prompt_token_ids": [1, 2, 3, 1, 2]}
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        samples[name] = [list(o.outputs[0].token_ids) for o in outs]
    assert 0 < tally.accepted < tally.draft_tokens and tally.drafts > n
    for pos in range(4):
        p = Counter(s[pos] for s in samples["plain"])
        q = Counter(s[pos] for s in samples["draft"])
        tv = 0.5 * sum(abs(p[t] - q[t]) for t in range(8)) / n
        assert tv < 0.045, (pos, tv, p, q)


def test_a_draft_with_another_vocabulary_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        _llm({"model": tiny_model(tmp_path, vocab=8, max_len=512), "num_speculative_tokens": 2})
