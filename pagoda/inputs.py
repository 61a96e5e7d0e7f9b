"""Prompt types for `LLM.generate` (vLLM's `TextPrompt` / `TokensPrompt`, also importable from
`pagoda`): typed dicts, so a plain `{"prompt": ...}` or `{"prompt_token_ids": [...]}` is the
same prompt."""

from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the tokenizer's special tokens)."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):  # (typing.NotRequired needs Python 3.11)
    """A prompt given as token ids; `prompt`, when given, is only reported back as
    `RequestOutput.prompt`."""

    prompt: str


# What LLM.generate takes for one prompt: a string, a list of token ids or one of the dicts.
PromptType = str | list[int] | TextPrompt | TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
