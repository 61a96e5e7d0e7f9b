"""The transformers tokenizer API on `pagoda.tokenizer.Tokenizer` (what `LLM.get_tokenizer()`
returns, where vLLM returns a transformers tokenizer), against transformers as the oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_testing import hf_tokenizer

from pagoda.config import embedded_model_path
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer
from pagoda.tokenizer_gguf import build_gguf_tokenizer

LONG = "The quick brown fox jumps over the lazy dog, again and again and again, all day long."


@pytest.fixture(scope="module")
def with_bos(tmp_path_factory) -> tuple[Tokenizer, object]:
    """The embedded tokenizer adding bos and eos to every text, with model_max_length 16, and
    transformers' reading of it saved."""
    backend, kwargs = build_gguf_tokenizer(embedded_model_path())
    kwargs.update(add_bos_token=True, add_eos_token=True)
    path = tmp_path_factory.mktemp("bos")
    Tokenizer(backend, **kwargs).save_pretrained(path, model_max_length=16)
    return Tokenizer.from_pretrained(path), hf_tokenizer(str(path))


@pytest.mark.parametrize("tokens", ["<|im_end|>", ["<|im_end|>", "Hello", "Ġworld"], "no-such"])
def test_convert_tokens_to_ids_takes_a_token_or_a_list(tok, ref, tokens) -> None:
    assert tok.convert_tokens_to_ids(tokens) == ref.convert_tokens_to_ids(tokens)


def test_convert_tokens_to_ids_gives_stop_token_ids(tok) -> None:
    params = SamplingParams(stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    assert params.stop_token_ids == [tok.eos_token_id] == [2]


@pytest.mark.parametrize("ids", [5, 19556, [1, 19556, 2], []])
@pytest.mark.parametrize("skip", [False, True])
def test_convert_ids_to_tokens_takes_an_id_or_a_list(tok, ref, ids, skip) -> None:
    if isinstance(ids, int):
        assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    else:
        expected = ref.convert_ids_to_tokens(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids, skip_special_tokens=skip) == expected


def test_decode_keeps_special_tokens_by_default(tok, ref) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == ref.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for one in (2, torch.tensor(2), np.int64(2)):
        assert tok.decode(one) == ref.decode(2) == "<|im_end|>"
    assert tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids)) == tok.decode(ids)
    batch = [ids, ids[1:3]]
    assert tok.batch_decode(batch) == ref.batch_decode(batch)
    skipped = ref.batch_decode(batch, skip_special_tokens=True)
    assert tok.batch_decode(batch, skip_special_tokens=True) == skipped


@pytest.mark.parametrize("text", ["hello world", ["hi", "hello there, world", LONG], LONG])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"add_special_tokens": False},
        {"truncation": True, "max_length": 5},
        {"truncation": True},  # to model_max_length
        {"truncation": True, "max_length": 5, "add_special_tokens": False},
        {"padding": True},
        {"padding": "max_length", "max_length": 30},
        {"padding": True, "truncation": True, "return_tensors": "pt"},
        {"padding": True, "truncation": True, "return_tensors": "np"},
    ],
)
def test_call_matches_transformers(with_bos, text, kwargs) -> None:
    tok, ref = with_bos
    got, expected = tok(text, **kwargs), ref(text, **kwargs)
    assert set(got) == set(expected) == {"input_ids", "attention_mask"}
    for key in got:
        if "return_tensors" in kwargs:
            assert type(got[key]) is type(expected[key])
            assert got[key].tolist() == expected[key].tolist()
        else:
            assert got[key] == expected[key]
    assert got.input_ids is got["input_ids"]


def test_call_pads_on_the_left_and_names_what_is_missing(with_bos) -> None:
    tok, ref = with_bos
    tok.padding_side = ref.padding_side = "left"
    try:
        assert tok(["hi", LONG], padding=True) == dict(ref(["hi", LONG], padding=True))
    finally:
        tok.padding_side = ref.padding_side = "right"
    with pytest.raises(ValueError, match="padding=True"):
        tok(["hi", LONG], return_tensors="pt")
    with pytest.raises(ValueError, match="string or a list of strings"):
        tok([1, 2])


def test_tokenize_vocab_and_lengths(tok, ref, with_bos) -> None:
    text = "Hello world <|im_end|> 你好"
    assert tok.tokenize(text) == ref.tokenize(text)
    assert tok.get_vocab() == ref.get_vocab()
    assert tok.vocab_size == ref.vocab_size == len(tok) == 49152
    # A GGUF file gives its context length (as a checkpoint's tokenizer_config.json does).
    assert tok.model_max_length == 8192
    assert with_bos[0].model_max_length == with_bos[1].model_max_length == 16
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tok, name) == getattr(ref, name)


def test_apply_chat_template_defaults_are_transformers(tok, ref) -> None:
    """Token ids, no generation prompt: what code written for vLLM's get_tokenizer() expects."""
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = ref.apply_chat_template(messages)
    if not isinstance(expected, list):  # transformers 5: a BatchEncoding (return_dict=True)
        expected = expected["input_ids"]
    assert tok.apply_chat_template(messages) == expected
    text = tok.decode(expected, skip_special_tokens=False)
    assert not text.endswith("<|im_start|>assistant\n")


def test_max_token_id_is_the_largest_id_of_the_vocabulary(tok, ref) -> None:
    # vLLM's tokenizers have it (its bad_words check reads it): the largest id of get_vocab().
    assert tok.max_token_id == max(ref.get_vocab().values()) == 49151
    assert tok.max_token_id == max(tok.get_vocab().values())
