"""Batched logits processors: each one edits a float32 `[rows, vocab]` logits tensor in place.

The sampler applies them in vLLM v1's order: allowed_token_ids, bad_words, min_tokens, logit_bias
and the penalties change which token is greedy; temperature, min_p, top-k and top-p only reshape
the distribution of randomly sampled rows. None of them reads a value back to the host, so on a GPU
they queue without a sync. Masked tokens get -inf. Top-k, top-p and min-p are done with one
per-row threshold ("keep logits >= t"), found from one ascending sort of the values, so ties at
the threshold are kept (as vLLM's top-k does).
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def apply_allowed_token_ids(
    logits: torch.Tensor, allowed_rows: torch.Tensor, allowed_token_index: torch.Tensor
) -> torch.Tensor:
    """Mask every token of `allowed_rows` except the (row, token) pairs of the index."""
    rows, tokens = allowed_token_index[0], allowed_token_index[1]
    keep = logits[rows, tokens]
    logits.index_fill_(0, allowed_rows, _NEG_INF)
    logits[rows, tokens] = keep
    return logits


def apply_token_bans(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Ban the (row, token) pairs of `index` [2, N] (bad_words), whatever is left, as vLLM."""
    # The value as a device tensor: `logits[i, j] = -inf` copies a host scalar (a host sync).
    return logits.index_put_((index[0], index[1]), logits.new_full((1,), _NEG_INF))


def apply_min_tokens(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Ban the (row, token) pairs of `index` [2, N]: stop tokens before a row's min_tokens.
    A row left with no token at all (its allowed_token_ids or grammar allow only stop tokens)
    keeps them: a request's constraints outrank its minimum length, and a row of only -inf
    would sample a token nothing allows."""
    rows, tokens = index[0], index[1]
    kept = logits[rows, tokens]
    # The value as a device tensor: `logits[i, j] = -inf` copies a host scalar (a host sync).
    logits.index_put_((rows, tokens), logits.new_full((1,), _NEG_INF))
    empty = torch.isneginf(logits[rows]).all(dim=-1)
    return logits.index_put_((rows, tokens), torch.where(empty, kept, logits[rows, tokens]))


def apply_logit_bias(
    logits: torch.Tensor, index: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """Add `values` [N] at the (row, token) pairs of `index` [2, N] (OpenAI logit_bias)."""
    return logits.index_put_((index[0], index[1]), values, accumulate=True)


def _flat_scatter_index(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Flat positions in a [rows * vocab + 1] buffer of `token_ids` [rows, L] padded with
    vocab_size; the padding goes to the spare last element.

    This is vLLM's [rows, vocab + 1] scatter buffer laid out so that the part kept is one
    contiguous [rows, vocab] view: slicing a column off a [rows, vocab + 1] tensor leaves a
    strided view that makes every later elementwise op ~10x slower on CPU.
    """
    rows = token_ids.shape[0]
    offsets = torch.arange(rows, device=token_ids.device)[:, None] * vocab_size
    flat = torch.where(token_ids == vocab_size, rows * vocab_size, token_ids + offsets)
    return flat.reshape(-1)


def _scatter_per_row(
    buffer: torch.Tensor, index: torch.Tensor, values: torch.Tensor, num: int, add: bool
) -> None:
    """buffer[index[j]] = (or +=) values[row of j], for the flat index of [rows, num] ids."""
    src = values.repeat_interleave(num)
    if add:
        buffer.scatter_add_(0, index, src)
    else:
        buffer.scatter_(0, index, src)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor | None,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Repetition (HF/vLLM: over prompt and output tokens, divide positive logits, multiply
    negative ones), then frequency and presence penalties (OpenAI: over output tokens,
    `logit -= frequency * count + presence * (count > 0)`). Returns the penalised logits.

    Token ids are [rows, L] padded with vocab_size and scattered into a buffer with a spare
    element for the padding (see `_flat_scatter_index`), so ragged rows need no mask. The
    per-row penalty values are scattered directly (presence with `scatter_`, which lands once
    per distinct token; frequency with `scatter_add_`, once per occurrence), which leaves one
    dense subtraction instead of building counts and masks.
    """
    rows, vocab_size = logits.shape
    n = rows * vocab_size
    out_index = _flat_scatter_index(output_token_ids, vocab_size)
    out_len = output_token_ids.shape[1]
    if repetition_penalties is not None and prompt_token_ids is not None:
        factor = torch.ones(n + 1, dtype=logits.dtype, device=logits.device)
        prompt_index = _flat_scatter_index(prompt_token_ids, vocab_size)
        _scatter_per_row(
            factor, prompt_index, repetition_penalties, prompt_token_ids.shape[1], False
        )
        _scatter_per_row(factor, out_index, repetition_penalties, out_len, False)
        factor = factor[:n].view(rows, vocab_size)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    penalty = torch.zeros(n + 1, dtype=logits.dtype, device=logits.device)
    _scatter_per_row(penalty, out_index, presence_penalties, out_len, False)
    _scatter_per_row(penalty, out_index, frequency_penalties, out_len, True)
    return logits.sub_(penalty[:n].view(rows, vocab_size))


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits.div_(temperature[:, None])


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens with prob < min_p * max prob (Nguyen et al. 2024, "min-p sampling").

    Done in logit space, `logit < max_logit + log(min_p)`, which needs no softmax; min_p = 0
    gives a -inf threshold, so such rows are untouched.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def sort_values_ascending(x: torch.Tensor) -> torch.Tensor:
    """Each row's values in ascending order (indices are not needed for a threshold).

    On CPU numpy's SIMD sort of values is ~25x faster than torch.sort (which always builds
    indices); on GPUs torch.sort is fast. Both put NaN last.
    """
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.sort(x.detach().contiguous().numpy(), axis=-1))
    return torch.sort(x, dim=-1).values


def top_k_top_p_threshold(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Per-row threshold [rows, 1]: the smallest logit that top-k then top-p keep.

    top_k [rows] int64 in [1, vocab] (vocab: unset); top_p [rows] in (0, 1] (1: unset). As in
    vLLM, top-p is taken over the distribution left after top-k: sorted ascending, the tokens
    whose cumulative probability is <= 1 - top_p are dropped, always keeping the largest.
    """
    vocab_size = logits.shape[1]
    sorted_logits = sort_values_ascending(logits)
    threshold = sorted_logits[:, :1]
    if top_k is not None:
        threshold = sorted_logits.gather(1, (vocab_size - top_k.clamp(1, vocab_size))[:, None])
    if top_p is not None:
        if top_k is not None:
            sorted_logits.masked_fill_(sorted_logits < threshold, _NEG_INF)
        cum_probs = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
        # cum_probs rows are non-decreasing: count the entries <= 1 - top_p by binary search.
        num_dropped = torch.searchsorted(cum_probs, (1.0 - top_p)[:, None], right=True)
        p_threshold = sorted_logits.gather(1, num_dropped.clamp_(max=vocab_size - 1))
        # Rows with top_p == 1 keep the top-k threshold (cumsum rounding must not drop tokens).
        threshold = torch.where(
            top_p[:, None] < 1.0, torch.maximum(p_threshold, threshold), threshold
        )
    return threshold


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    threshold = top_k_top_p_threshold(logits, top_k, top_p)
    return logits.masked_fill_(logits < threshold, _NEG_INF)
