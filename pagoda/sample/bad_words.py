"""`bad_words`: which tokens a row may not sample next, by vLLM's rule (its
`v1/sample/ops/bad_words.py`), on the host.

A bad word is a token sequence (`SamplingParams.bad_words_token_ids`). Its last token is banned
when the tokens the request generated last equal the ones before it, so a one-token word is
always banned and a longer one only right after its prefix. Only generated tokens count, as in
vLLM: a prefix at the end of the prompt bans nothing (nor does a prefix longer than the output
so far); a speculative row counts the drafts before it as generated. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence


def banned_tokens(bad_words_token_ids: Sequence[Sequence[int]], past: Sequence[int]) -> list[int]:
    """The tokens `bad_words_token_ids` ban after the generated tokens `past` (in the words'
    order; a token may repeat)."""
    out: list[int] = []
    n = len(past)
    for word in bad_words_token_ids:
        k = len(word) - 1  # the prefix's length
        if k == 0:
            out.append(word[0])
        elif k <= n and all(past[n - k + i] == word[i] for i in range(k)):
            out.append(word[k])
    return out
