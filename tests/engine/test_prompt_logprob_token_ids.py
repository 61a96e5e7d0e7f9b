"""`SamplingParams.prompt_logprob_token_ids` / `prompt_logprob_start` end to end on the embedded
model: `RequestOutput.prompt_token_id_logprobs` as vLLM returns it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

PROMPT = "The capital of France is Paris, and the capital of Italy is"
IDS = [0, 28, 216, 5000, 49151]  # <|endoftext|>, ",", " ", " properly", the vocab's last


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=512, seed=0)


@pytest.fixture(scope="module")
def prompt(llm: LLM) -> list[int]:
    return llm.get_tokenizer().encode(PROMPT)


def _rows(prompt: list[int], start: int) -> list[list[int]]:
    """Row i: the true next token, some fixed ids, and -1 padding on every other row."""
    rows = []
    for i, p in enumerate(range(start, len(prompt) - 1)):
        row = [prompt[p + 1], *IDS[: 2 + i % 3]]
        rows.append(row if i % 2 else row + [-1])
    return rows


def _score(llm: LLM, prompt: list[int], params: SamplingParams):
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]


@pytest.mark.parametrize("start", [None, 4])
def test_scores_are_log_softmax_of_each_prompt_rows_logits(llm: LLM, prompt, start) -> None:
    rows = _rows(prompt, start or 0)
    params = SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=0,
        prompt_logprob_token_ids=rows, prompt_logprob_start=start,
    )  # fmt: skip
    out = _score(llm, prompt, params)
    got = out.prompt_token_id_logprobs
    width = max(map(len, rows))
    assert got.dtype == np.float32 and got.shape == (len(prompt) - 1 - (start or 0), width)
    # The reference: each prefix alone, its next-token logprobs of the same ids
    # (logprob_token_ids, checked against log_softmax of the model's logits in test_llm).
    first = start or 0
    prefixes = [{"prompt_token_ids": prompt[: p + 1]} for p in range(first, len(prompt) - 1)]
    refs = llm.generate(
        prefixes,
        [
            SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=[t for t in r if t >= 0])
            for r in rows
        ],
        use_tqdm=False,
    )
    for i, (row, ref) in enumerate(zip(rows, refs)):
        want = ref.outputs[0].logprobs[0]
        for j in range(width):
            t = row[j] if j < len(row) else -1
            if t == -1:  # padding, given or added to a short row
                assert got[i, j] == -math.inf
            else:
                assert got[i, j] == pytest.approx(want[t].logprob, abs=2e-4)
        # Column 0 is the true next prompt token: prompt_logprobs of the same request agree.
        true = prompt[first + i + 1]
        assert got[i, 0] == pytest.approx(
            out.prompt_logprobs[first + i + 1][true].logprob, abs=1e-5
        )


def test_chunked_prefill_and_a_prefix_cache_hit_give_the_same_scores(llm: LLM, prompt) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprob_token_ids=_rows(prompt, 2),
                            prompt_logprob_start=2)  # fmt: skip
    whole = _score(llm, prompt, params)
    assert _score(llm, prompt, params).num_cached_tokens == 0  # never read from the cache
    small = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=8, seed=0)
    chunked = _score(small, prompt, params)
    np.testing.assert_allclose(chunked.prompt_token_id_logprobs, whole.prompt_token_id_logprobs,
                               atol=2e-4)  # fmt: skip
    assert chunked.outputs[0].token_ids == whole.outputs[0].token_ids


def test_preemption_reports_each_row_once(prompt) -> None:
    # 8 blocks of 16 tokens cannot hold all the requests at once: some are preempted and
    # recompute their prompts.
    tiny = LLM(dtype="float32", max_model_len=96, num_gpu_blocks_override=8, seed=0)
    rows = _rows(prompt, 0)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            prompt_logprob_token_ids=rows)  # fmt: skip
    outs = tiny.generate([{"prompt_token_ids": prompt}] * 4, params, use_tqdm=False)
    assert tiny.llm_engine.num_preemptions_total > 0
    for o in outs:
        np.testing.assert_allclose(o.prompt_token_id_logprobs, outs[0].prompt_token_id_logprobs,
                                   atol=2e-4)  # fmt: skip


def test_n_samples_and_delta_outputs_carry_the_array_once(llm: LLM, prompt) -> None:
    rows = _rows(prompt, 0)
    want = _score(llm, prompt, SamplingParams(temperature=0, prompt_logprob_token_ids=rows))
    want = want.prompt_token_id_logprobs
    two = _score(llm, prompt, SamplingParams(n=2, seed=1, prompt_logprob_token_ids=rows))
    np.testing.assert_allclose(two.prompt_token_id_logprobs, want, atol=2e-4)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprob_token_ids=rows,
                            output_kind=RequestOutputKind.DELTA)  # fmt: skip
    engine.add_request("ptid-delta", {"prompt_token_ids": prompt}, params)
    arrays = []
    while engine.has_unfinished_requests():
        arrays += [o.prompt_token_id_logprobs for o in engine.step()]
    assert len(arrays) == 4 and arrays[1:] == [None] * 3
    np.testing.assert_allclose(arrays[0], want, atol=2e-4)


def test_requests_without_them_get_none(llm: LLM, prompt) -> None:
    assert _score(llm, prompt, SamplingParams(max_tokens=1)).prompt_token_id_logprobs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rows": 3}, r"^prompt_logprob_token_ids has 3 rows, but the prompt has 12 scored rows"),
        ({"rows": 12, "start": 1}, r"has 12 rows, but the prompt has 11 scored rows"),
        ({"rows": 1, "start": 12}, r"^prompt_logprob_start must be at most 11 .* got 12"),
        ({"rows": 12, "id": 49152}, r"^prompt_logprob_token_ids .*vocabulary.*\[49152\]"),
    ],
)
def test_bad_rows_are_a_value_error_and_the_engine_goes_on(
    llm: LLM, prompt, kwargs, message
) -> None:
    assert len(prompt) == 13
    ids = [[kwargs.get("id", 5)]] * kwargs["rows"]
    params = SamplingParams(prompt_logprob_token_ids=ids, prompt_logprob_start=kwargs.get("start"))
    with pytest.raises(ValueError, match=message):
        _score(llm, prompt, params)
    ok = SamplingParams(max_tokens=2, prompt_logprob_token_ids=[[5]] * 12)
    assert _score(llm, prompt, ok).prompt_token_id_logprobs.shape == (12, 1)
