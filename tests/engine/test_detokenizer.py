"""IncrementalDetokenizer: streamed text equals a full decode (the plain reference), multi-byte
characters are never split, and stop strings are found across tokens and never half-streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from pagoda.engine.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer import Tokenizer

TEXTS = [
    "你是一个AI助手。请回答：什么是机器学习？",
    "I ❤️ 🦙 emojis 👨‍👩‍👧 and 😀😀😀 ok",
    "The quick brown fox jumps over the lazy dog.\n\tdef f(x): return x",
]


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Say something."}]
    return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)


def sentencepiece_tokenizer() -> Tokenizer:
    """A tiny SentencePiece-style tokenizer: byte fallback, '▁' spaces, a stripped lead space."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁he", "▁hello", "▁world", "ll"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, [("▁", "h"), ("▁h", "e")],
                     unk_token="<unk>", fuse_unk=True, byte_fallback=True)  # fmt: skip
    backend = BackendTokenizer(bpe)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:3]])
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return Tokenizer(backend, special_tokens=special, add_bos_token=True)


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = []
    for i in range(0, len(ids), step):
        detok.update(ids[i : i + step])
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3])
def test_streaming_equals_full_decode(tok, prompt_ids, text: str, step: int) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_token_ids == ids


def test_split_emoji_is_held_back_until_complete(tok, prompt_ids) -> None:
    ids = tok.encode("a😀")
    assert len(ids) >= 3  # the emoji's 4 bytes span several byte-level tokens
    detok = IncrementalDetokenizer(tok, prompt_ids)
    seen = [(detok.update([i]), detok.output_text)[1] for i in ids]
    assert seen[:2] == ["a", "a"] and seen[-1] == "a😀"


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(
        alphabet=st.characters(blacklist_characters="\ufffd", blacklist_categories=("Cs",)),
        max_size=40,
    )
)
def test_streaming_property(tok, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"))
    deltas = stream(detok, ids)
    full, streamed = tok.decode(ids), "".join(deltas)
    # Equal to the full decode, except that bytes which never form a character at the very end
    # (a character the vocabulary cannot spell) are dropped, as vLLM does.
    assert full.startswith(streamed) and set(full[len(streamed) :]) <= {"\ufffd"}
    if full == text:
        assert streamed == text and not any("\ufffd" in d for d in deltas)


def test_sentencepiece_spacing_and_byte_fallback() -> None:
    sp = sentencepiece_tokenizer()
    prompt = sp.encode("hello")
    ids = sp.encode("hello world 你", add_special_tokens=False)
    assert "<0xE4>" in sp.convert_ids_to_tokens(ids)
    detok = IncrementalDetokenizer(sp, prompt)
    deltas = stream(detok, ids)
    # After a prompt, the first token's '▁' is a real space (vLLM's behaviour).
    expected = sp.decode(prompt + ids)[len(sp.decode(prompt)) :]
    assert "".join(deltas) == detok.output_text == expected == " hello world 你"
    assert not any("\ufffd" in d for d in deltas)
    no_prompt = IncrementalDetokenizer(sp, [])
    stream(no_prompt, ids)
    assert no_prompt.output_text == sp.decode(ids) == "hello world 你"


def test_stop_string_spanning_tokens(tok, prompt_ids) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    for include, expected in ((False, "The quick brown "), (True, "The quick brown fox jum")):
        detok = IncrementalDetokenizer(
            tok, prompt_ids, stop=["nothing", "fox jum"], include_stop_str_in_output=include
        )
        stops = [detok.update([i]) for i in ids]
        hit = next(n for n, s in enumerate(stops) if s is not None)
        assert stops[hit] == "fox jum" and detok.stop_reason == "fox jum"
        assert "fox jum" in tok.decode(ids[: hit + 1]) and "fox jum" not in tok.decode(ids[:hit])
        assert detok.output_text == expected
        assert detok.get_next_output_text(finished=True, delta=False) == expected


@pytest.mark.parametrize("step", [1, 3, 100])
def test_stop_strings_wait_for_min_tokens(tok, prompt_ids, step: int) -> None:
    # As vLLM: a stop string ending within the first min_tokens tokens' text does not stop
    # (it stopped at once, so the output was shorter than min_tokens asked); one ending past
    # them does, also when one update crosses min_tokens.
    ids = tok.encode("the cat sat on the mat and the cat ran")
    first = next(n for n in range(len(ids)) if "cat" in tok.decode(ids[: n + 1]))
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["cat"], min_tokens=first + 1)
    stops = [detok.update(ids[i : i + step]) for i in range(0, len(ids), step)]
    assert [s for s in stops if s] == ["cat"]
    assert detok.output_text == "the cat sat on the mat and the "


def test_earliest_stop_string_wins(tok, prompt_ids) -> None:
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["dog", "lazy"])
    assert detok.update(tok.encode("the lazy dog")) == "lazy"
    assert detok.output_text == "the "


def test_stop_string_is_never_streamed_in_part(tok, prompt_ids) -> None:
    text = "one two three four five six seven eight"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["five six"])
    streamed = ""
    for i in ids:
        stop = detok.update([i])
        finished = stop is not None
        streamed += detok.get_next_output_text(finished=finished, delta=True)
        if not finished:
            # Held back: the last len("five six") - 1 characters.
            assert streamed == detok.output_text[: max(len(detok.output_text) - 7, 0)]
            assert detok.get_next_output_text(finished=False, delta=False) == streamed
        else:
            break
    assert streamed == "one two three four "


def test_special_tokens_kept_or_skipped(tok, prompt_ids) -> None:
    ids = tok.encode("hi<|im_end|>")
    skipped = IncrementalDetokenizer(tok, prompt_ids)
    stream(skipped, ids)
    assert skipped.output_text == "hi"
    kept = IncrementalDetokenizer(
        tok, prompt_ids, skip_special_tokens=False, spaces_between_special_tokens=False
    )
    stream(kept, ids)
    assert kept.output_text == "hi<|im_end|>"
    spaced = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=False)
    stream(spaced, ids)
    assert spaced.output_text == "hi <|im_end|>"


def test_decode_window_stays_small(tok, prompt_ids, monkeypatch) -> None:
    """O(new tokens) per update: only a few ids are decoded, however long the output."""
    ids = tok.encode("The quick brown fox jumps over the lazy dog. 你好，世界！😀 " * 100)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    sizes: list[int] = []
    original = tok.decode
    monkeypatch.setattr(tok, "decode", lambda x, **kw: (sizes.append(len(x)), original(x, **kw))[1])
    for i in ids:
        detok.update([i])
    assert len(ids) > 1000 and max(sizes) <= 12
    assert detok.output_text == original(ids)
