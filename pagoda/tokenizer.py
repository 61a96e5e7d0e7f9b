"""The tokenizer: a `tokenizers.Tokenizer` built from a GGUF file or a Hugging Face directory.

This module owns turning text into token ids and back, the special tokens (bos/eos/unk/pad and
the added control tokens), and rendering chat templates with jinja2 the way transformers does
(sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `strftime_now`, a non-escaping
`tojson`). GGUF tokenizers are built by `pagoda.tokenizer_gguf`, as transformers' GGUF converter
does, so that the engine never imports transformers, which alone would blow the cold-start budget.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

from tokenizers import AddedToken, models, processors
from tokenizers import Tokenizer as BackendTokenizer

from pagoda.tokenizer_hf import VERY_LARGE_INTEGER, HFTokenizerMixin, id_list

_SPECIAL_ROLES = ("bos", "eos", "unk", "pad")
# Normalizers by the most input characters they can turn into one: none of these deletes a
# character. NFC/NFKC compose a character with the marks after it, at most the length of a
# canonical decomposition, 4 code points (e.g. U+1F82: alpha, psili, varia, ypogegrammeni).
_NORMALIZER_SHRINK = {"Prepend": 1, "NFD": 1, "NFKD": 1, "Lowercase": 1, "NFC": 4, "NFKC": 4}
# Pre-tokenizers that split or respell the text but drop none of it (a Split or Punctuation
# with behavior "Removed" does, and Whitespace, BertPreTokenizer, CharDelimiterSplit do).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts"}  # fmt: skip


def _post_processor(
    bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
) -> processors.TemplateProcessing:
    # add_bos/add_eos as transformers' `update_post_processor` expresses them.
    single = ([f"{bos}:0"] if bos is not None else []) + ["$A:0"]
    single += [f"{eos}:0"] if eos is not None else []
    pair = single + ([f"{bos}:1"] if bos is not None else []) + ["$B:1"]
    pair += [f"{eos}:1"] if eos is not None else []
    special = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class Tokenizer(HFTokenizerMixin):
    """Text <-> token ids for one model, plus its special tokens and chat template.

    The methods and defaults that transformers' tokenizers have (`decode` keeps special
    tokens unless told, `tok(text)`, `convert_tokens_to_ids`...) behave as there: this is
    what `LLM.get_tokenizer()` returns, where vLLM returns a transformers tokenizer."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        clean_up_tokenization_spaces: bool = False,
        name_or_path: str = "",
        model_max_length: int | None = None,
    ) -> None:
        self.backend = backend
        self.name_or_path = name_or_path
        # The longest input the model takes, from the tokenizer config (else transformers' huge
        # placeholder): what `tok(text, truncation=True)` cuts to.
        self.model_max_length = model_max_length or VERY_LARGE_INTEGER
        self.padding_side = "right"
        self.chat_template = chat_template
        # The clean-up was designed for WordPiece; transformers ignores it for BPE, where it
        # would delete real spaces before punctuation.
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces and not isinstance(
            backend.model, models.BPE
        )
        # bos_token / eos_token / unk_token / pad_token -> their text (None when the model has none).
        self.special_tokens_map: dict[str, str] = {
            f"{role}_token": tok
            for role in _SPECIAL_ROLES
            if (tok := (special_tokens or {}).get(f"{role}_token")) is not None
        }
        # Every special token decodes as itself and is never split, as transformers ensures.
        named = [
            AddedToken(t, special=True, normalized=False) for t in self.special_tokens_map.values()
        ]
        if named:
            backend.add_special_tokens(named)
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        ids = {r: backend.token_to_id(t) for r, t in self.special_tokens_map.items()}
        self.bos_token_id: int | None = ids.get("bos_token")
        self.eos_token_id: int | None = ids.get("eos_token")
        self.unk_token_id: int | None = ids.get("unk_token")
        self.pad_token_id: int | None = ids.get("pad_token")
        self.bos_token: str | None = self.special_tokens_map.get("bos_token")
        self.eos_token: str | None = self.special_tokens_map.get("eos_token")
        self.unk_token: str | None = self.special_tokens_map.get("unk_token")
        self.pad_token: str | None = self.special_tokens_map.get("pad_token")
        added = backend.get_added_tokens_decoder()
        self._added_token_ids = frozenset(added)
        self._special_ids = frozenset(i for i, t in added.items() if t.special) | {
            i for i in ids.values() if i is not None
        }

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos = self.special_tokens_map.get("bos_token") if add_bos else None
        eos = self.special_tokens_map.get("eos_token") if add_eos else None
        bos_id = self.backend.token_to_id(bos) if bos else None
        eos_id = self.backend.token_to_id(eos) if eos else None
        self.backend.post_processor = _post_processor(bos, bos_id, eos, eos_id)

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        from pagoda.tokenizer_gguf import build_gguf_tokenizer

        backend, kwargs = build_gguf_tokenizer(path_or_reader)
        return cls(backend, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ special_tokens_map.json,
        chat_template.jinja) from a Hugging Face model directory."""
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(
                f"{path} has no tokenizer.json: Pagoda needs a fast-tokenizer file (save one with "
                "transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`), or "
                "pass --tokenizer PATH, or --skip-tokenizer-init to take and return token ids only"
            )
        try:
            backend = BackendTokenizer.from_file(tokenizer_file)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(
                f"{tokenizer_file} is not a readable tokenizer ({e}); it may be truncated or "
                "corrupt: download it again"
            ) from None
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        special = {
            f"{role}_token": _token_text(
                config.get(f"{role}_token", special_map.get(f"{role}_token"))
            )
            for role in _SPECIAL_ROLES
        }
        chat_template = _config_chat_template(config.get("chat_template"), path)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()
        return cls(
            backend,
            special_tokens=special,
            # add_bos_token/add_eos_token are not read: tokenizer.json's post-processor decides,
            # as in transformers (v5) and vLLM.
            chat_template=chat_template,
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
            name_or_path=path,
            model_max_length=_int_or_none(config.get("model_max_length")),
        )

    def save_pretrained(
        self, path: str | os.PathLike[str], model_max_length: int | None = None
    ) -> None:
        """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) into
        the directory `path`, which `from_pretrained` (and transformers) read back to the same
        ids: how a checkpoint quantized from a GGUF file carries its tokenizer."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self.backend.save(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {
            **self.special_tokens_map,
            # What the saved post-processor does, for readers that look here (transformers v4).
            "add_bos_token": self._post_processor_adds(self.bos_token_id),
            "add_eos_token": self._post_processor_adds(self.eos_token_id),
            "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)

    def _post_processor_adds(self, token_id: int | None) -> bool:
        return token_id is not None and token_id in self.backend.encode("a").ids

    def min_num_tokens(self, text: str) -> int:
        """At least how many tokens `text` is (with or without special tokens), found without
        tokenizing it: 0 where this tokenizer gives no bound. How a prompt too long for any
        context is refused before the seconds (a megabyte) to minutes (100 MB) that a fast
        tokenizer takes over it, holding the GIL (`input_processor.check_prompt_text`)."""
        bound = self._length_bound
        if bound is None:
            return 0
        max_chars, vanishing = bound
        chars = len(text) - sum(text.count(c) for c in vanishing)
        return -(-chars // max_chars)

    @cached_property
    def _length_bound(self) -> tuple[int, str] | None:
        """(the most characters of text one token stands for, the characters that become no
        token at all), or None where this tokenizer has no such bound.

        A BPE token's text is one of its vocabulary's strings, and each of their characters
        spells at most one character of the text it came from: a byte (byte-level BPE), a
        character or "▁" for a space (SentencePiece), "<0xNN>" for a byte. That holds where no
        character can disappear on the way: a normalizer that deletes none (one that composes
        characters, NFC, is counted at its most), a pre-tokenizer that drops none, and every
        character reaching the model has a token (every byte does, or an unknown character is
        one unknown token, not fused with the next). A byte-level vocabulary without some
        bytes (SmolLM2's lacks six control characters: a BPE without an unknown token drops
        them) has its bound for the other characters, where only single-byte characters can
        vanish. Anything else (WordPiece, Unigram, a Strip normalizer...) has no bound here."""
        model = self.backend.model
        if not isinstance(model, models.BPE):
            return None
        shrink = _shrink_factor(self.backend.normalizer)
        pre = _component_state(self.backend.pre_tokenizer)
        if shrink is None or (pre is not None and not _keeps_characters(pre)):
            return None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        max_chars = shrink * max(map(len, vocab), default=1)
        if model.unk_token is not None and not model.fuse_unk:
            return max_chars, ""  # an unknown character is a token of its own
        if model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return max_chars, ""
        if pre is None or "ByteLevel" not in _pre_tokenizer_types(pre):
            return None  # unknown characters vanish, or a run of them is one token
        from pagoda.tokenizer_gguf import _bytes_to_unicode

        missing = [b for b, c in _bytes_to_unicode().items() if c not in vocab]
        # A character of several bytes vanishes only if its continuation bytes (0x80-0xBF) do;
        # one of them missing, or a normalizer that could make a missing one, is no bound.
        if missing and (
            self.backend.normalizer is not None or any(0x80 <= b < 0xC0 for b in missing)
        ):
            return None
        return max_chars, "".join(chr(b) for b in missing if b < 0x80)

    # ---- ids and text ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            # e.g. a lone surrogate ("\ud800", possible through JSON escapes): not valid UTF-8.
            if isinstance(text, str):
                raise ValueError(
                    "the text is not valid Unicode (it holds a lone surrogate)"
                ) from None
            raise ValueError(
                f"text to encode must be a string, got {type(text).__name__}"
            ) from None

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(
        self,
        ids: int | Iterable[int],
        skip_special_tokens: bool = False,
        spaces_between_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        """Token ids (or one id) -> text, special tokens kept unless `skip_special_tokens` (as
        transformers). `spaces_between_special_tokens` joins added tokens and the text around
        them with single spaces, as transformers' slow tokenizers (and vLLM) do;
        `clean_up_tokenization_spaces` defaults to the tokenizer config's value."""
        ids = id_list(ids)
        if spaces_between_special_tokens and not skip_special_tokens:
            text = self._decode_spaced(ids)
        else:
            text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return _clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def _decode_spaced(self, ids: list[int]) -> str:
        pieces, run = [], []
        for i in ids:
            if i in self._added_token_ids:
                if run:
                    pieces.append(self.backend.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self.backend.id_to_token(i))
            else:
                run.append(i)
        if run:
            pieces.append(self.backend.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    def is_special_id(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """bos/eos/unk/pad and every added token marked special (what decode skips)."""
        return sorted(self._special_ids)

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.backend.id_to_token(i) for i in self.all_special_ids]

    # ---- chat --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the chat template; token ids when `tokenize`. The defaults
        are transformers' (token ids, no generation prompt), which code written for vLLM's
        `LLM.get_tokenizer()` expects.

        The rendered text already holds the template's special tokens, so it is tokenized
        without adding bos/eos again (as transformers does).
        """
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a string, got {type(chat_template).__name__}")
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                f"The model {self.name_or_path or ''} has no chat template: pass one with "
                "chat_template=... (or --chat-template FILE), or use the completion API"
            )
        # Keys set to None are dropped: OpenAI clients send content=None, tool_calls=None, and
        # templates test for presence.
        chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are exclusive")
        import jinja2

        try:
            compiled = _compile_template(template)
        except ValueError as e:
            if chat_template is not None or not self.name_or_path:
                raise
            # The model's own template: say whose, and how to replace it.
            raise ValueError(
                f"{e} (the chat template of {self.name_or_path}: fix it, or pass another "
                "with chat_template=... or --chat-template FILE)"
            ) from None
        try:
            text = compiled.render(
                messages=chat,
                tools=tools,
                documents=kwargs.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens_map, **kwargs},
            )
        except (jinja2.exceptions.TemplateError, TypeError, AttributeError, KeyError) as e:
            # raise_exception() in a template rejects the conversation (e.g. roles that do not
            # alternate), and a message of a shape the template cannot render (a content of
            # parts where it adds strings) fails in it: the user's request to fix either way.
            raise ValueError(f"The chat template rejected the messages: {e}") from None
        if continue_final_message:
            # Cut after the final message's content so that generation continues it.
            final = chat[-1].get("content") if chat else None
            if not isinstance(final, str) or final.strip() not in text:
                raise ValueError("continue_final_message needs a final message with text content")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _component_state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's configuration, as tokenizer.json writes it."""
    return None if component is None else json.loads(component.__getstate__())


def _shrink_factor(normalizer: Any) -> int | None:
    """The most characters `normalizer` turns into one, or None where it may delete some."""
    state = _component_state(normalizer)
    if state is None:
        return 1
    factor = 1
    for step in state["normalizers"] if state["type"] == "Sequence" else [state]:
        kind = step["type"]
        if kind == "Replace":  # a fixed string by one no shorter ("▁" for " ")
            pattern = step["pattern"].get("String")
            if pattern is None or len(step["content"]) < len(pattern):
                return None
        elif kind in _NORMALIZER_SHRINK:
            factor *= _NORMALIZER_SHRINK[kind]
        else:
            return None
    return factor


def _pre_tokenizer_steps(state: dict[str, Any]) -> list[dict[str, Any]]:
    if state["type"] == "Sequence":
        return [step for s in state["pretokenizers"] for step in _pre_tokenizer_steps(s)]
    return [state]


def _pre_tokenizer_types(state: dict[str, Any]) -> set[str]:
    return {step["type"] for step in _pre_tokenizer_steps(state)}


def _keeps_characters(state: dict[str, Any]) -> bool:
    """Whether the pre-tokenizer of configuration `state` hands on every character."""
    return all(
        step["type"] in _KEEPING_PRE_TOKENIZERS and step.get("behavior") != "Removed"
        for step in _pre_tokenizer_steps(state)
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}")
    return data


def _config_chat_template(value: Any, path: str) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {"name", "template"}
    (the one named "default", else the first). Anything else is a ValueError naming the file:
    rendering it would fail later, on every chat request, with a message about Jinja."""
    if isinstance(value, list):
        if not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and "template" in t
            for t in value
        ):
            value = 0  # refused below
        else:
            named = {t["name"]: t["template"] for t in value}
            value = named.get("default", next(iter(named.values()), None))
    if value is not None and not isinstance(value, str):
        raise ValueError(
            f"{os.path.join(path, 'tokenizer_config.json')}: chat_template must be a string (or "
            f'a list of {{"name", "template"}} strings), got {value!r:.60}'
        )
    return value


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _clean_up_tokenization(text: str) -> str:
    # transformers' `clean_up_tokenization`, for tokenizers whose config asks for it.
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                     (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(old, new)
    return text


@lru_cache(maxsize=8)
def _compile_template(template: str) -> Any:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # jinja's own tojson HTML-escapes; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"The chat template is not valid jinja (line {e.lineno}): {e}") from None


def get_tokenizer(model: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of `model`: a .gguf file, or a Hugging Face directory with tokenizer.json
    (a directory holding one .gguf file and no tokenizer.json is read from that file)."""
    model = os.fspath(model)
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return Tokenizer.from_gguf(model)
        model = os.path.dirname(model) or "."  # e.g. a config.json path
    if os.path.isdir(model):
        ggufs = [f for f in os.listdir(model) if f.endswith(".gguf")]
        if not os.path.isfile(os.path.join(model, "tokenizer.json")) and len(ggufs) == 1:
            return Tokenizer.from_gguf(os.path.join(model, ggufs[0]))
        return Tokenizer.from_pretrained(model)
    raise ValueError(
        f"Tokenizer path {model} does not exist: pass a .gguf file or a model directory"
    )
