"""`SamplingParams` refuses, with a ValueError that starts with the field's name, every value the
engine could not run: no request may get past it and then fail inside an engine step."""

from __future__ import annotations

import json

import numpy as np
import pytest
from model_testing import TINY_CONFIG

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import (
    MAX_LOGPROB_TOKEN_IDS,
    MAX_LOGPROBS,
    MAX_N,
    RequestOutputKind,
)


def _refused(field: str, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, True, 1.5, "7"])
def test_seed_outside_signed_64_bits_is_refused(seed) -> None:
    # 2**64 used to pass here and raise inside torch.Generator.manual_seed in engine.step().
    _refused("seed", seed=seed)


def test_extreme_seeds_sample_with_n_children(tmp_path) -> None:
    # The engine seeds the i-th of n samples with seed + i: from either end of the accepted range
    # that stays within what torch.Generator.manual_seed takes.
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=64,
        kv_cache_memory_bytes=1 << 20,
    )
    for seed in (2**63 - 1, -(2**63), -1):
        params = SamplingParams(seed=seed, n=MAX_N, max_tokens=2)
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0]
        assert len(out.outputs) == MAX_N and all(len(c.token_ids) == 2 for c in out.outputs)


def test_n_is_bounded() -> None:
    assert SamplingParams(n=MAX_N).n == MAX_N
    assert str(MAX_N) in _refused("n", n=MAX_N + 1)
    _refused("n", n=0)
    _refused("n", n=2.0)


@pytest.mark.parametrize("value", [float("inf"), 1e308, 2.5, float("nan"), -0.1, "0.5", None])
def test_temperature_is_a_finite_number_in_0_2(value) -> None:
    # A huge finite temperature rounds to inf in float32 and turns masked logits into NaN.
    _refused("temperature", temperature=value)


def test_temperature_bounds_are_accepted() -> None:
    assert SamplingParams(temperature=2).temperature == 2.0
    # Any finite positive repetition_penalty, as vLLM and transformers take.
    assert SamplingParams(repetition_penalty=3.5).repetition_penalty == 3.5
    assert SamplingParams(temperature=0).sampling_type_greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", float("nan")),
        ("top_p", float("inf")),
        ("min_p", float("nan")),
        ("presence_penalty", float("inf")),
        ("frequency_penalty", float("-inf")),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("top_k", -2),
        ("top_k", 1.5),
        ("max_tokens", "16"),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
        ("logprobs", False),
        ("prompt_logprobs", 10**30),
        ("stop", 5),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("allowed_token_ids", ["a"]),
        ("allowed_token_ids", []),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {" 5 ": 1.0}),  # int() takes these three; a token id is plain digits
        ("logit_bias", {"5_0": 1.0}),
        ("logit_bias", {"\u0665": 1.0}),
        ("logit_bias", {1.5: 1.0}),
        ("logit_bias", {1: float("inf")}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", {1: "2"}),
        ("logit_bias", [1, 2]),
        ("output_kind", 1),
        ("ignore_eos", "no"),
        ("detokenize", None),
        ("skip_special_tokens", [1]),
        ("include_stop_str_in_output", "false"),
        ("stream_interval", 0),
        ("stream_interval", 2.0),
        ("stream_interval", True),
        ("skip_reading_prefix_cache", "no"),
        ("logprob_token_ids", [-1]),
        ("logprob_token_ids", [1.0]),
        ("logprob_token_ids", [True]),
        ("logprob_token_ids", "12"),
        ("logprob_token_ids", list(range(129))),  # MAX_LOGPROB_TOKEN_IDS is 128
        ("repetition_detection", 3),
        ("repetition_detection", {"max_pattern_size": 2, "min_count": 3, "size": 1}),
        ("repetition_detection", {"max_pattern_size": "2", "min_count": 3}),
    ],
)
def test_bad_value_raises_value_error_naming_the_field(field, value) -> None:
    _refused(field, **{field: value})


def test_stop_strings_need_detokenize() -> None:
    _refused("stop", stop=["x"], detokenize=False)
    SamplingParams(stop_token_ids=[3], detokenize=False)  # token ids need no text


def test_min_tokens_above_max_tokens_is_refused() -> None:
    _refused("min_tokens", min_tokens=5, max_tokens=4)


def test_numbers_are_normalized() -> None:
    p = SamplingParams(
        n=np.int64(2),
        temperature=np.float32(0.5),
        top_k=-1,
        seed=np.int64(-5),
        logprobs=True,
        logit_bias={"3": 1, 4: -2.5},
        stop="x",
        stop_token_ids=(7,),
    )
    assert type(p.n) is int and p.n == 2
    assert type(p.temperature) is float and p.temperature == 0.5
    assert p.top_k == 0 and p.seed == -5 and p.logprobs == 1  # vLLM reads logprobs=True as 1
    assert p.logit_bias == {3: 1.0, 4: -2.5}
    assert p.stop == ["x"] and p.stop_token_ids == [7]
    assert p.output_kind is RequestOutputKind.CUMULATIVE


def test_logprob_token_ids_set_num_logprobs_as_vllm() -> None:
    ids = list(range(MAX_LOGPROB_TOKEN_IDS))
    p = SamplingParams(logprob_token_ids=ids)
    assert p.logprobs is None and p.num_logprobs == MAX_LOGPROB_TOKEN_IDS
    assert SamplingParams(logprob_token_ids=(5, 7)).logprob_token_ids == [5, 7]
    assert SamplingParams(logprobs=2, logprob_token_ids=[5, 7]).num_logprobs == 2
    assert SamplingParams(logprobs=3).num_logprobs == 3 and SamplingParams().num_logprobs is None
    empty = SamplingParams(logprob_token_ids=[])  # asks for nothing, as vLLM's num_logprobs
    assert empty.logprob_token_ids is None and empty.num_logprobs is None
    # Both set: logprobs must be their number (vLLM's rule).
    assert "logprobs must equal" in _refused(
        "logprob_token_ids", logprobs=1, logprob_token_ids=[5, 7]
    )


def test_logprob_token_ids_outside_the_vocabulary_are_refused() -> None:
    p = SamplingParams(logprob_token_ids=[0, 99])
    p.validate_token_ids(100)
    p = SamplingParams(logprob_token_ids=[0, 100, 7])
    with pytest.raises(ValueError, match=r"^logprob_token_ids .*\[0, 100\).*\[100\]"):
        p.validate_token_ids(100)


def test_repetition_detection_from_a_dict_or_params() -> None:
    from pagoda import RepetitionDetectionParams

    p = SamplingParams(repetition_detection={"max_pattern_size": 4, "min_count": 3})
    assert p.repetition_detection == RepetitionDetectionParams(4, 0, 3)
    same = RepetitionDetectionParams(max_pattern_size=4, min_count=3)
    assert SamplingParams(repetition_detection=same).repetition_detection is same
    assert SamplingParams().repetition_detection is None
    # vLLM's message, whatever way it is given.
    with pytest.raises(ValueError, match="^min_count must be >= 2 to detect"):
        SamplingParams(repetition_detection={"max_pattern_size": 4})


def test_skip_reading_prefix_cache_defaults_as_vllm() -> None:
    assert SamplingParams().skip_reading_prefix_cache is False
    assert SamplingParams(prompt_logprobs=0).skip_reading_prefix_cache is True
    assert SamplingParams(skip_reading_prefix_cache=True).skip_reading_prefix_cache is True
    p = SamplingParams(prompt_logprobs=1, skip_reading_prefix_cache=False)
    assert p.skip_reading_prefix_cache is False


def test_seed_minus_one_means_no_seed() -> None:
    # As vLLM (and OpenAI clients' convention): -1 is "no seed"; Pagoda seeded with -1, so
    # every such request sampled the same tokens.
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2


def test_from_optional_and_extra_args() -> None:
    # vLLM's SamplingParams.from_optional: None takes the default, logit_bias is clamped.
    p = SamplingParams.from_optional(n=None, temperature=None, top_p=None, max_tokens=5,
                                     logit_bias={"5": 200.0})  # fmt: skip
    assert (p.n, p.temperature, p.top_p, p.max_tokens) == (1, 1.0, 1.0, 5)
    assert p.logit_bias == {5: 100.0}
    assert SamplingParams(extra_args={"plugin": 1}).clone().extra_args == {"plugin": 1}
    _refused("extra_args", extra_args=[1])


@pytest.mark.parametrize("value", ["word", ["ok", 3], {"a": 1}, 5, [None]])
def test_bad_words_must_be_a_list_of_strings(value) -> None:
    _refused("bad_words", bad_words=value)


def test_bad_words_refuse_an_empty_string_and_drop_duplicates() -> None:
    _refused("bad_words", bad_words=["fine", ""])
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]
    assert SamplingParams().bad_words == [] and SamplingParams().bad_words_token_ids is None


def test_bad_words_tokenize_with_and_without_a_leading_space(tok) -> None:
    # As vLLM's update_from_tokenizer: the word as given (leading whitespace stripped), and with
    # one leading space where that is another first token and as many tokens.
    p = SamplingParams(bad_words=["Paris", "  hello", "unbelievability"])
    p.update_from_tokenizer(tok)
    expected = []
    for word in ("Paris", "hello", "unbelievability"):
        plain = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert p.bad_words_token_ids == expected
    assert [tok.encode(" Paris", add_special_tokens=False)] == [expected[1]]  # both forms kept
    assert len(expected) >= 4
    clone = p.clone()
    assert clone.bad_words_token_ids == expected and clone == p


@pytest.mark.parametrize(
    "words,needle",
    [
        ([" "], "at least one token"),
        ([f"w{i}" for i in range(200)], "the most is 128"),
        (["x" * 5000], "tokens; the most is 1024"),
    ],
)
def test_bad_words_refused_by_the_tokenizer_name_the_field(tok, words, needle) -> None:
    p = SamplingParams(bad_words=words)
    with pytest.raises(ValueError, match=needle) as e:
        p.update_from_tokenizer(tok)
    assert str(e.value).startswith("bad_words")


def test_prompt_logprob_token_ids_are_padded_to_an_int32_array() -> None:
    p = SamplingParams(prompt_logprob_token_ids=[[5, 7], [9]], prompt_logprob_start=3)
    assert p.prompt_logprob_token_ids.dtype == np.int32
    assert p.prompt_logprob_token_ids.tolist() == [[5, 7], [9, -1]]
    assert p.prompt_logprob_start == 3
    assert p.skip_reading_prefix_cache is True  # vLLM's default with them, as prompt_logprobs
    q = SamplingParams(prompt_logprob_token_ids=np.array([[1, 2]], dtype=np.int64))
    assert q.prompt_logprob_token_ids.dtype == np.int32 and q.prompt_logprob_start is None
    assert q.clone().prompt_logprob_token_ids.tolist() == [[1, 2]]
    # Equality compares the arrays' values (the dataclass's own == raised on them).
    assert q == SamplingParams(prompt_logprob_token_ids=[[1, 2]]) and q.clone() == q
    assert q != SamplingParams(prompt_logprob_token_ids=[[1, 3]])
    assert q != SamplingParams(prompt_logprob_token_ids=[[1, 2, -1]])
    assert q != SamplingParams() and SamplingParams(seed=1) != SamplingParams(seed=2)


_IDS = "^prompt_logprob_token_ids "


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompt_logprob_token_ids": []}, _IDS + "must be a non-empty integer array of shape"),
        ({"prompt_logprob_token_ids": [[]]}, _IDS + "must be a non-empty integer array"),
        ({"prompt_logprob_token_ids": [1, 2]}, _IDS + "must be a non-empty integer array"),
        ({"prompt_logprob_token_ids": np.zeros((2, 2), np.float32)}, _IDS + "must be a non-empty"),
        ({"prompt_logprob_token_ids": [[1.5]]}, _IDS + "must contain integer token ids"),
        ({"prompt_logprob_token_ids": [[True]]}, _IDS + "must contain integer token ids"),
        ({"prompt_logprob_token_ids": [[-2]]}, _IDS + "must hold token ids, -1 padding a row"),
        ({"prompt_logprob_token_ids": [[1] * 21]}, _IDS + "has 21 token ids a row; the most is 20"),
        ({"prompt_logprob_token_ids": [[2**40]]}, _IDS + "has token ids outside any vocabulary"),
        (
            {"prompt_logprob_token_ids": [[1]], "prompt_logprob_start": -1},
            "^prompt_logprob_start must be an integer >= 0",
        ),
        ({"prompt_logprob_start": 2}, "^prompt_logprob_start requires prompt_logprob_token_ids"),
    ],
)
def test_bad_prompt_logprob_token_ids_raise_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_logprob_token_ids_outside_the_vocabulary_are_refused() -> None:
    p = SamplingParams(prompt_logprob_token_ids=[[5, -1], [100, 3]])
    with pytest.raises(ValueError, match=r"^prompt_logprob_token_ids .*\[100\]"):
        p.validate_token_ids(100)
    p.validate_token_ids(101)
