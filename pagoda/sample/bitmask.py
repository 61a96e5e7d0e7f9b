"""Structured outputs' next-token bitmask applied to logits rows (xgrammar's layout: int32 words,
bit t % 32 of word t // 32 allows token t). Plain torch, so the runner never imports xgrammar;
`xgrammar.apply_token_bitmask_inplace` is the reference it is tested against."""

from __future__ import annotations

import torch

_BITS = {}


def _bit_positions(device: torch.device) -> torch.Tensor:
    bits = _BITS.get(device)
    if bits is None:
        bits = _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return bits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True: allowed). Columns past the mask's
    words * 32 are disallowed."""
    rows, words = bitmask.shape
    allowed = ((bitmask.unsqueeze(-1) >> _bit_positions(bitmask.device)) & 1).bool()
    allowed = allowed.view(rows, words * 32)
    if words * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(rows, vocab_size - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of `rows` [len(rows)] whose tokens `bitmask`
    [len(rows), words] disallows (row i of the mask is logits row rows[i])."""
    if not rows:
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if rows == list(range(rows[0], rows[0] + len(rows))):
        view = logits[rows[0] : rows[0] + len(rows)]
        view.masked_fill_(~allowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits.index_copy_(0, index, logits[index].masked_fill_(~allowed, float("-inf")))
