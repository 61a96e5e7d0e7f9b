"""`pagoda.tokenizer.Tokenizer` against transformers (the oracle) on the embedded GGUF, a tiny
SentencePiece-style GGUF and a tiny tokenizer.json directory."""

from __future__ import annotations

import json
from datetime import datetime

import gguf
import numpy as np
import pytest
from model_testing import hf_tokenizer

from pagoda.config import embedded_model_path
from pagoda.tokenizer import Tokenizer, get_tokenizer

TEXTS = [
    "Hello world",
    "你是一个AI助手。请回答：什么是机器学习？",
    "def f(x):\n    return x**2  # square\n\tpass",
    "I ❤️ 🦙 emojis 👨‍👩‍👧 ok",
    "  leading and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "don't I'm we'll 12345 3.14159",
    "a\n\n\nb   c",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi! 你好"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(tok: Tokenizer, ref, text: str) -> None:
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
            ids, skip_special_tokens=skip
        )


def test_gguf_special_tokens(tok: Tokenizer, ref) -> None:
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.vocab_size == len(ref) == 49152
    assert set(ref.all_special_ids) <= set(tok.all_special_ids)
    assert set(range(17)) == set(tok.all_special_ids)  # every control token of the file
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # add_bos_token false
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


@pytest.mark.parametrize(
    "messages",
    [MESSAGES[:2], MESSAGES, MESSAGES[1:2]],
    ids=["system_user", "multi_turn", "no_system"],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, ref, messages, add_generation_prompt) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == ref.apply_chat_template(messages, tokenize=False, **kwargs)
    expected_ids = ref.apply_chat_template(messages, tokenize=True, **kwargs)
    if not isinstance(expected_ids, list):
        expected_ids = expected_ids["input_ids"]
    assert tok.apply_chat_template(messages, tokenize=True, **kwargs) == expected_ids
    if add_generation_prompt:
        assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_helpers(tok: Tokenizer) -> None:
    template = (
        "{{ messages | tojson }}|{{ strftime_now('%Y') }}|{{ bos_token }}"
        "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}"
    )
    msgs = [{"role": "user", "content": "é", "tool_calls": None}]
    text = tok.apply_chat_template(
        msgs, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    # None-valued keys dropped; tojson does not escape non-ASCII; globals available.
    assert text == f'[{{"role": "user", "content": "é"}}]|{datetime.now().year}|<|im_start|>'
    with pytest.raises(ValueError, match="one message only"):
        tok.apply_chat_template(
            msgs * 2, chat_template=template, tokenize=False, add_generation_prompt=True
        )


def test_continue_final_message(tok: Tokenizer) -> None:
    msgs = [*MESSAGES[:2], {"role": "assistant", "content": "The answer"}]
    text = tok.apply_chat_template(
        msgs, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\nThe answer")


def test_model_without_chat_template_raises(tmp_path) -> None:
    make_tokenizer_dir(tmp_path, chat_template=None)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )


def test_spaces_between_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    spaced = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == "<|im_start|> user\nhi <|im_end|>"


# ---- a SentencePiece-style ("llama") GGUF ---------------------------------------------------

PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "t", "▁h", "▁he", "▁hel", "▁hell", "▁hello",
          "▁w", "▁wo", "▁wor", "▁worl", "▁world", "ll", "he", "lo", "▁t", "▁th", "th", "▁a", "at"]  # fmt: skip


def write_llama_gguf(path: str) -> None:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES + ["<|user|>"]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(PIECES) + [4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(PIECES))] + [0.0]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(CHATML)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(path)
    tok = Tokenizer.from_gguf(path)
    ref = hf_tokenizer(str(tmp_path), gguf_file="tiny.gguf")
    for text in [
        "hello world",
        " hello  world",
        "hello<|user|>at the world",
        "héllo 你 world",
        "hello</s>",
        "",
    ]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == tok.bos_token_id == 1  # SentencePiece files add bos by default
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            )
    # Characters outside the vocabulary fall back to their UTF-8 bytes.
    assert tok.convert_ids_to_tokens(tok.encode("你", add_special_tokens=False))[1:] == [
        "<0xE4>",
        "<0xBD>",
        "<0xA0>",
    ]
    assert tok.decode(tok.encode("hello 你"), skip_special_tokens=True) == "hello 你"


# ---- a tokenizer.json directory ---------------------------------------------------------------


def make_tokenizer_dir(
    path, chat_template: str | None = CHATML, jinja_file: str | None = None, **config_extra
) -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(
        ["hello world, the quick brown fox jumps over the lazy dog"] * 20, trainer
    )
    backend.save(str(path / "tokenizer.json"))
    eos = {"__type": "AddedToken", "content": "<|im_end|>", "special": True, "lstrip": False,
           "rstrip": False, "normalized": False, "single_word": False}  # fmt: skip
    config = {"bos_token": "<|im_start|>", "eos_token": eos, "add_bos_token": True, **config_extra}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<|endoftext|>"}))
    if jinja_file is not None:
        (path / "chat_template.jinja").write_text(jinja_file)


def test_tokenizer_json_dir_matches_transformers(tmp_path) -> None:
    make_tokenizer_dir(tmp_path)
    tok, ref = Tokenizer.from_pretrained(tmp_path), hf_tokenizer(str(tmp_path))
    for text in ["hello world", "the lazy fox<|im_end|> 你好 🦙", ""]:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (1, 2, 0)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    msgs = MESSAGES[:2]
    assert tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_clean_up_tokenization_spaces_from_config(tmp_path) -> None:
    make_tokenizer_dir(tmp_path, clean_up_tokenization_spaces=True)
    tok, ref = Tokenizer.from_pretrained(tmp_path), hf_tokenizer(str(tmp_path))
    ids = tok.encode("hello , world .")
    # Ignored for BPE vocabularies, as transformers does; applied when asked for explicitly.
    assert tok.decode(ids) == ref.decode(ids) == "hello , world ."
    assert tok.decode(ids, clean_up_tokenization_spaces=True) == "hello, world."


def test_chat_template_jinja_file_takes_priority(tmp_path) -> None:
    make_tokenizer_dir(tmp_path, jinja_file="{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template(MESSAGES[1:2], tokenize=False, add_generation_prompt=True)
    assert text == "Hi! 你好!"


def test_get_tokenizer_picks_by_path(tmp_path) -> None:
    assert get_tokenizer(embedded_model_path()).eos_token_id == 2
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    make_tokenizer_dir(hf_dir)
    assert get_tokenizer(str(hf_dir)).encode("hello") == Tokenizer.from_pretrained(hf_dir).encode(
        "hello"
    )
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_llama_gguf(str(gguf_dir / "m.gguf"))
    assert get_tokenizer(str(gguf_dir)).bos_token_id == 1
    with pytest.raises(ValueError, match="does not exist"):
        get_tokenizer(str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="tokenizer.json"):
        get_tokenizer(str(empty))


def test_lone_surrogate_is_a_clear_value_error() -> None:
    from pagoda.config import embedded_model_path
    from pagoda.tokenizer import get_tokenizer

    with pytest.raises(ValueError, match="not valid Unicode"):
        get_tokenizer(embedded_model_path()).encode("bad \ud800 text")


# ---- the token count's lower bound (a prompt too long, refused before tokenizing) ------------

# Characters that stress the bound: the control characters SmolLM2's vocabulary lacks (the
# BPE drops them), runs of spaces and newlines (its longest tokens), several-byte characters,
# a special token, a letter the SentencePiece file spells only in bytes.
_BOUND_ALPHABET = ["a", "b", " ", "\n", "\t", "\x13", "\x04", "é", "你", "🦙", "\U00050000",
                   "#", "=", "<|im_start|>", "<|user|>", "hello", " world", "Ġ", "▁"]  # fmt: skip


def _random_texts(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(int(rng.integers(1, 60))):
            piece = _BOUND_ALPHABET[int(rng.integers(len(_BOUND_ALPHABET)))]
            parts.append(piece * int(rng.choice([1, 1, 3, 40, 200])))
        texts.append("".join(parts))
    return texts


def test_min_num_tokens_never_exceeds_the_tokens(tok: Tokenizer, tmp_path) -> None:
    gguf_path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(gguf_path)
    make_tokenizer_dir(tmp_path)
    tokenizers = {
        "embedded byte-level GGUF": tok,
        "SentencePiece GGUF": Tokenizer.from_gguf(gguf_path),
        "tokenizer.json": Tokenizer.from_pretrained(tmp_path),
    }
    for name, t in tokenizers.items():
        assert t._length_bound is not None, name
        for text in _random_texts(0, 300) + TEXTS:
            for special in (True, False):
                n = len(t.encode(text, add_special_tokens=special))
                assert t.min_num_tokens(text) <= n, (name, text[:80])
    # Tight where the text is the vocabulary's longest token over and over (81 characters).
    assert tok._length_bound == (81, "\x04\x06\x13\x14\x16\x1d")
    text = ("\n" + " " * 80) * 1000
    assert tok.min_num_tokens(text) == len(tok.encode(text, add_special_tokens=False)) == 1000
    # The characters the BPE drops count for nothing: 10^6 of them are no token at all.
    assert tok.min_num_tokens("a" + "\x13" * 10**6) == 1 == len(tok.encode("a" + "\x13" * 10**6))


def test_min_num_tokens_is_zero_where_characters_can_vanish() -> None:
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    def backend(model, normalizer=None, pre_tokenizer=None) -> Tokenizer:
        b = BackendTokenizer(model)
        b.normalizer, b.pre_tokenizer = normalizer, pre_tokenizer
        return Tokenizer(b)

    vocab = {"[UNK]": 0, "a": 1, "b": 2, " ": 3}
    vanishing = [
        backend(models.WordPiece(vocab, unk_token="[UNK]")),  # a whole word can be one [UNK]
        backend(models.BPE(vocab, [], unk_token="[UNK]", fuse_unk=True)),  # a run: one [UNK]
        backend(models.BPE(vocab, [])),  # unknown characters dropped
        backend(models.BPE(vocab, [], unk_token="[UNK]"), normalizers.Strip()),
        backend(models.BPE(vocab, [], unk_token="[UNK]"), None, pre_tokenizers.Whitespace()),
    ]
    for t in vanishing:
        assert t.min_num_tokens("c" * 1000 + " " * 1000) == 0
    kept = backend(models.BPE(vocab, [], unk_token="[UNK]"), normalizers.NFC())
    text = "e\u0301" * 100  # NFC makes each pair one character: 100 tokens, not 200
    assert kept.min_num_tokens(text) <= len(kept.encode(text)) == 100


def test_the_canonical_decomposition_bound_holds_for_this_unicode() -> None:
    # NFC / NFKC turn at most this many characters into one (tokenizer._NORMALIZER_SHRINK).
    import sys
    import unicodedata

    from pagoda.tokenizer import _NORMALIZER_SHRINK

    longest = max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
                  if not 0xD800 <= c < 0xE000)  # fmt: skip
    assert _NORMALIZER_SHRINK["NFC"] == _NORMALIZER_SHRINK["NFKC"] == longest == 4
