"""Each token id's bytes, from Pagoda's own tokenizer: what a grammar backend matches against.

Byte-level BPE vocabularies (GPT-2 style, the embedded SmolLM2's) spell bytes with printable
characters; SentencePiece ones write a space as "▁" and odd bytes as "<0xNN>". Special tokens
(bos/eos/chat markers) and ids past the tokenizer's vocabulary (a model's padded embedding) get
empty bytes: a grammar never produces them, except the stop tokens that end a match. No torch,
no xgrammar.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    from pagoda.tokenizer_gguf import _bytes_to_unicode

    return {c: b for b, c in _bytes_to_unicode().items()}


def is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer decodes with the GPT-2 byte alphabet."""
    decoder = tokenizer.backend.decoder
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """`vocab_size` entries (the model's, which may exceed the tokenizer's): the bytes each
    token id stands for in generated text; b"" for special and unused ids."""
    backend = tokenizer.backend
    special = set(tokenizer.all_special_ids)
    added = backend.get_added_tokens_decoder()
    u2b = _unicode_to_bytes()
    byte_level = is_byte_level(tokenizer)
    out: list[bytes] = []
    for i in range(vocab_size):
        tok = backend.id_to_token(i)
        if tok is None or i in special or (i in added and added[i].special):
            out.append(b"")
        elif i in added:  # added tokens are written as plain text
            out.append(tok.encode())
        elif byte_level:
            if all(c in u2b for c in tok):
                out.append(bytes(u2b[c] for c in tok))
            else:
                out.append(tok.encode())
        elif m := _BYTE_TOKEN.match(tok):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(tok.replace("\u2581", " ").encode())
    return out
