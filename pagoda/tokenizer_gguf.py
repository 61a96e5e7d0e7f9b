"""GGUF `tokenizer.*` metadata -> a `tokenizers.Tokenizer`, as transformers' GGUF converter does.

This module owns building the fast-tokenizer backend a GGUF file describes: byte-level BPE for
`tokenizer.ggml.model == "gpt2"` (with the split regex named by `tokenizer.ggml.pre`), and
SentencePiece-style BPE with byte fallback for `"llama"` (merges from the file, or derived from
the scores), plus the control and user-defined added tokens. `pagoda.tokenizer.Tokenizer.from_gguf`
wraps the result; building it here keeps the engine free of transformers, which alone would blow
the cold-start budget.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4

# `tokenizer.ggml.pre` -> split regex, for vocabularies whose merges were learned on a split other
# than GPT-2's (same table as transformers' GGUF converter; unlisted names keep GPT-2's split).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the spelling of byte-level BPE tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens,
    best score first (transformers' `generate_merges`, kept in the same stable order)."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def build_gguf_tokenizer(path_or_reader: Any) -> tuple[BackendTokenizer, dict[str, Any]]:
    """The backend a GGUF file's `tokenizer.*` metadata describes, and the keyword arguments of
    `pagoda.tokenizer.Tokenizer` (special tokens, add_bos/add_eos, chat template, path,
    model_max_length)."""
    from pagoda.model.loader.gguf import GGUFReader

    reader = (
        path_or_reader if isinstance(path_or_reader, GGUFReader) else GGUFReader(path_or_reader)
    )
    md = reader.metadata
    kind, tokens = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(
            f"GGUF file {reader.path} has no tokenizer.ggml.tokens: pass --tokenizer DIR"
        )
    if not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"GGUF file {reader.path}: tokenizer.ggml.tokens must be strings")
    token_types = [int(t) for t in md.get("tokenizer.ggml.token_type", ())]
    merges = md.get("tokenizer.ggml.merges")
    if merges is not None and not all(isinstance(m, str) and " " in m for m in merges):
        raise ValueError(
            f"GGUF file {reader.path}: tokenizer.ggml.merges must be strings of two tokens "
            "separated by a space"
        )
    special = {}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        special[f"{role}_token"] = tokens[i] if i is not None and i < len(tokens) else None
    add_bos = md.get("tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        if not merges:  # BPE without merges encodes every text byte by byte: garbage in
            raise ValueError(
                f"GGUF file {reader.path} has no tokenizer.ggml.merges, which a 'gpt2' (BPE) "
                "tokenizer needs: convert the model again, or pass --tokenizer DIR"
            )
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens not spelled in the byte alphabet (added tokens written as plain text) are
        # respelled byte by byte, so the BPE model can hold them.
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
            for i, t in enumerate(tokens)
        }
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="")
        backend = BackendTokenizer(bpe)
        split = _PRE_TOKENIZER_SPLITS.get(md.get("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel.
        is_control = lambda t: set(t) <= alphabet  # noqa: E731
    elif kind == "llama":
        vocab = {t: i for i, t in enumerate(tokens)}
        if merges:
            pairs = [tuple(m.split(" ", 1)) for m in merges]
        else:
            scores = md.get("tokenizer.ggml.scores")
            if scores is None:
                raise ValueError(f"GGUF file {reader.path} has neither merges nor scores")
            pairs = _generate_merges(vocab, dict(zip(tokens, (float(s) for s in scores))))
        unk = special["unk_token"]
        bpe = models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
        backend = BackendTokenizer(bpe)
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False
        )
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos = True if add_bos is None else add_bos  # llama.cpp's default for SentencePiece
        is_control = lambda t: True  # noqa: E731
    else:
        raise ValueError(
            f"GGUF file {reader.path} has tokenizer.ggml.model={kind!r}; Pagoda builds 'gpt2' "
            "and 'llama' tokenizers: pass --tokenizer DIR with a tokenizer.json instead"
        )
    typed = list(zip(tokens, token_types))
    control = [t for t, k in typed if k == _TOKEN_TYPE_CONTROL and is_control(t)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in typed if k == _TOKEN_TYPE_USER_DEFINED and t in vocab]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend, dict(
        special_tokens=special,
        add_bos_token=bool(add_bos),
        add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=md.get("tokenizer.chat_template"),
        name_or_path=reader.path,
        # What a Hugging Face checkpoint's tokenizer_config.json says: the model's context.
        model_max_length=md.get(f"{md.get('general.architecture')}.context_length"),
    )
