"""The Hugging Face tokenizer calls that code written for vLLM makes on `LLM.get_tokenizer()`.

vLLM's `LLM.get_tokenizer()` returns a transformers tokenizer, so user code calls `tok(texts)`,
`tokenize`, `get_vocab`, `batch_decode`, `convert_tokens_to_ids("<|im_end|>")` and expects what
transformers' `PreTrainedTokenizerFast` returns. This module owns those methods:
`HFTokenizerMixin` gives them to `pagoda.tokenizer.Tokenizer`, from its `backend` (a
`tokenizers.Tokenizer`), `decode`, special-token ids and `model_max_length`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as BackendTokenizer

# transformers' model_max_length for a tokenizer whose config names none.
VERY_LARGE_INTEGER = int(1e30)


class BatchEncoding(dict):
    """What `tokenizer(text)` returns: `input_ids` and `attention_mask`, read as keys or as
    attributes (`enc.input_ids`), as transformers' `BatchEncoding`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def id_list(ids: Any) -> list[int]:
    """Token ids as a list: one id (an int, a 0-d tensor or array) or any iterable of them."""
    if getattr(ids, "ndim", None) == 0 or not isinstance(ids, Iterable):
        return [int(ids)]
    return [int(i) for i in ids]


class HFTokenizerMixin:
    """transformers' tokenizer methods, with its defaults; the class mixing it in provides
    `backend`, `decode`, `unk_token_id`, `pad_token_id`, `all_special_ids`, `model_max_length`
    and `padding_side`."""

    backend: BackendTokenizer
    unk_token_id: int | None
    pad_token_id: int | None
    model_max_length: int
    padding_side: str
    all_special_ids: list[int]
    decode: Callable[..., str]

    def __call__(
        self,
        text: str | Sequence[str],
        add_special_tokens: bool = True,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_attention_mask: bool = True,
    ) -> BatchEncoding:
        """Encode one text or a batch: `input_ids` (and `attention_mask`), padded on
        `padding_side` with `pad_token_id` when `padding` ("longest"/True, or "max_length"),
        cut to `max_length` (else `model_max_length`) when `truncation`, as tensors when
        `return_tensors` is "pt" or "np"."""
        single = isinstance(text, str)
        if not single and not (
            isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)
        ):
            raise ValueError(
                f"text must be a string or a list of strings, got {type(text).__name__}"
            )
        texts = [text] if single else list(text)
        if truncation in (None, False, "do_not_truncate"):
            encodings = self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        else:
            encodings = self._truncated(texts, add_special_tokens, max_length)
        ids = [e.ids for e in encodings]
        mask = [[1] * len(i) for i in ids]
        if padding not in (False, "do_not_pad"):
            ids, mask = self._pad(ids, mask, padding, max_length)
        out = BatchEncoding(input_ids=ids)
        if return_attention_mask:
            out["attention_mask"] = mask
        if return_tensors is not None:
            return BatchEncoding({k: _as_tensor(v, return_tensors) for k, v in out.items()})
        return BatchEncoding({k: v[0] for k, v in out.items()}) if single else out

    def _truncated(
        self, texts: list[str], add_special_tokens: bool, max_length: int | None
    ) -> list[Encoding]:
        """The texts cut on the right to `max_length` tokens (`model_max_length` if None), the
        special tokens the post-processor adds included, as transformers cuts them."""
        limit = self.model_max_length if max_length is None else max_length
        specials = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        encodings = self.backend.encode_batch(texts, add_special_tokens=False)
        for e in encodings:
            e.truncate(max(limit - specials, 0))
        if not add_special_tokens:
            return encodings
        return [self.backend.post_process(e, add_special_tokens=True) for e in encodings]

    def _pad(
        self,
        ids: list[list[int]],
        mask: list[list[int]],
        padding: bool | str,
        max_length: int | None,
    ) -> tuple[list[list[int]], list[list[int]]]:
        if padding == "max_length":
            if max_length is None:
                raise ValueError("padding='max_length' needs max_length")
            width = max_length
        elif padding in (True, "longest"):
            width = max(map(len, ids), default=0)
        else:
            raise ValueError(
                f"padding must be True, 'longest', 'max_length' or False, got {padding!r}"
            )
        if self.pad_token_id is None:
            raise ValueError("Asking to pad but the tokenizer has no padding token (pad_token)")
        padded_ids, padded_mask = [], []
        for i, m in zip(ids, mask):
            n = max(width - len(i), 0)
            if self.padding_side == "left":
                padded_ids.append([self.pad_token_id] * n + i)
                padded_mask.append([0] * n + m)
            else:
                padded_ids.append(i + [self.pad_token_id] * n)
                padded_mask.append(m + [0] * n)
        return padded_ids, padded_mask

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        """The tokens of `text` as strings (transformers' default: no special tokens added)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self.backend.get_vocab(with_added_tokens=True)

    @cached_property
    def max_token_id(self) -> int:
        """The largest token id, added tokens included (vLLM's tokenizers' `max_token_id`:
        the largest id of `get_vocab()`, or of the base vocabulary's size if that is more)."""
        base = self.backend.get_vocab_size(with_added_tokens=False) - 1
        return max(max(self.get_vocab().values(), default=-1), base)

    def batch_decode(
        self,
        sequences: Iterable[Any],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> list[str]:
        return [
            self.decode(
                s,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=clean_up_tokenization_spaces,
            )
            for s in sequences
        ]

    def convert_ids_to_tokens(
        self, ids: int | Iterable[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        """One id -> its token (None past the vocabulary); a list -> a list, without the
        special tokens when `skip_special_tokens`."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(i) for i in id_list(ids) if i not in skip]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        """One token -> its id (`unk_token_id`, None where there is none, for a token not in
        the vocabulary); a list -> a list. `stop_token_ids=[tok.convert_tokens_to_ids(...)]`"""
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: str) -> int | None:
        i = self.backend.token_to_id(token)
        return self.unk_token_id if i is None else i


def _as_tensor(rows: list[list[int]], kind: str) -> Any:
    if len({len(r) for r in rows}) > 1:
        raise ValueError(
            "the texts have different lengths: pass padding=True to return them as one tensor"
        )
    if kind == "pt":
        import torch

        return torch.tensor(rows, dtype=torch.long)
    if kind == "np":
        import numpy as np

        return np.array(rows, dtype=np.int64)
    raise ValueError(f"return_tensors must be 'pt', 'np' or None, got {kind!r}")
