"""`SamplingMetadata`: one step's sampling parameters as batched tensors on the model's device.

Built once per step by the model runner from the per-row `SamplingParams`, token histories and
generators (`SamplingMetadata.from_requests`). Everything the sampler needs is prepared here on the
host and copied to the device without waiting on it (pinned memory, `non_blocking`), so sampling
never stalls the GPU queue. Each knob is stored only for the rows that use it (an index tensor of
those rows plus compact per-row values), and is `None` when no row uses it: the sampler skips a
knob entirely when its tensors are absent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.sample.bad_words import banned_tokens
from pagoda.sampling_params import SamplingParams


def to_device_tensor(
    data: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A host list/array as a tensor on `device`; on CUDA the copy is pinned and asynchronous,
    because a pageable host-to-device copy waits for every kernel already queued."""
    t = torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    t = t.to(dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _pad_token_ids(rows: list[Sequence[int]], pad_id: int) -> np.ndarray:
    """[len(rows), max_len] int64, right-padded with `pad_id` (scattered into a spare column)."""
    max_len = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max_len), pad_id, dtype=np.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = r
    return out


def _rows_or_none(rows: list[int], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of `rows`, or None when they are all `num_rows` rows in order."""
    if len(rows) == num_rows:
        return None
    return to_device_tensor(rows, torch.int64, device)


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool

    # Random sampling, over the rows with temperature > 0 ("random rows", in batch order).
    random_rows: torch.Tensor | None = None  # [R] int64 batch rows; None: every row
    temperature: torch.Tensor | None = None  # [R] float32
    # Min-p, over the random rows that use it (indices into the random rows).
    min_p_rows: torch.Tensor | None = None  # [M] int64; None: every random row
    min_p: torch.Tensor | None = None  # [M] float32; None when no row uses min_p
    # Top-k / top-p, over the random rows that use either (indices into the random rows).
    top_k_top_p_rows: torch.Tensor | None = None  # [S] int64; None: every random row
    top_k: torch.Tensor | None = None  # [S] int64, vocab_size where unused; None: no top-k
    top_p: torch.Tensor | None = None  # [S] float32, 1.0 where unused; None: no top-p
    # Index into the random rows -> the seeded request's generator; the others use the default.
    generators: dict[int, torch.Generator] = field(default_factory=dict)

    # Penalties, over the rows that have any (None: no row has one).
    penalty_rows: torch.Tensor | None = None  # [P] int64 batch rows; None: every row
    prompt_token_ids: torch.Tensor | None = None  # [P, max_prompt_len], pad vocab_size
    output_token_ids: torch.Tensor | None = None  # [P, max_output_len], pad vocab_size
    repetition_penalties: torch.Tensor | None = None  # [P] float32; None: none != 1
    frequency_penalties: torch.Tensor | None = None  # [P] float32
    presence_penalties: torch.Tensor | None = None  # [P] float32

    # Sparse (row, token id) pairs, as [2, N] int64.
    allowed_rows: torch.Tensor | None = None  # [A] rows restricted by allowed_token_ids
    allowed_token_index: torch.Tensor | None = None  # [2, N] their allowed (row, token) pairs
    bad_words_index: torch.Tensor | None = None  # [2, N] (row, token) pairs bad_words ban now
    logit_bias_index: torch.Tensor | None = None  # [2, N]
    logit_bias_values: torch.Tensor | None = None  # [N] float32
    min_tokens_index: torch.Tensor | None = None  # [2, N] stop tokens banned until min_tokens

    # Logprobs (of the raw logits), over the rows that ask for them.
    num_logprobs: list[int | None] = field(default_factory=list)  # per batch row
    logprob_rows: list[int] = field(default_factory=list)  # batch rows with logprobs set
    logprob_rows_tensor: torch.Tensor | None = None  # [L] int64; None: every row
    max_num_logprobs: int | None = None  # the top-k width (rows with logprob_token_ids: 0)
    # logprob_token_ids: batch row -> its ids (rows ascending), for the rows that set them; they
    # report these ids in place of a top-k.
    logprob_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprob_token_id_rows: torch.Tensor | None = None  # [T] int64 indices into the L rows
    logprob_token_ids_tensor: torch.Tensor | None = None  # [T, max ids] int64, padded with 0

    @property
    def no_penalties(self) -> bool:
        return self.penalty_rows is None and self.output_token_ids is None

    @property
    def no_logits_processing(self) -> bool:
        """True when nothing changes the raw logits before the greedy/random choice."""
        return (
            self.no_penalties
            and self.allowed_token_index is None
            and self.bad_words_index is None
            and self.logit_bias_index is None
            and self.min_tokens_index is None
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Whole batch greedy with nothing to process or report: argmax of the raw logits."""
        return self.all_greedy and self.no_logits_processing and self.max_num_logprobs is None

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Batch one step's per-row parameters; row i of the logits belongs to params[i]."""
        device = torch.device(device)
        n = len(params)
        for name, value in (
            ("prompt_token_ids", prompt_token_ids),
            ("output_token_ids", output_token_ids),
            ("generators", generators),
        ):
            if len(value) != n:
                raise ValueError(f"{name} must have one entry per row ({n}), got {len(value)}")
        if n == 0:
            raise ValueError("params must not be empty: there is nothing to sample")

        random_rows = [i for i, p in enumerate(params) if not p.sampling_type_greedy]
        md = cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            all_random=len(random_rows) == n,
        )
        for p in params:
            if (
                p.logit_bias
                or p.allowed_token_ids
                or p.min_tokens
                or p._bad_words_token_ids
                or p.logprob_token_ids
            ):
                p.validate_token_ids(vocab_size)
                bad = [t for t in p.all_stop_token_ids if not 0 <= t < vocab_size]
                if p.min_tokens and bad:
                    raise ValueError(
                        f"all_stop_token_ids has ids outside the vocabulary [0, {vocab_size}): "
                        f"{bad[:5]}"
                    )

        if random_rows:
            md._set_random_sampling(params, random_rows, generators, device)
        md._set_penalties(params, prompt_token_ids, output_token_ids, device)
        md._set_sparse_processors(params, output_token_ids, device)

        md.num_logprobs = [p.num_logprobs for p in params]
        md.logprob_rows = [i for i, k in enumerate(md.num_logprobs) if k is not None]
        if md.logprob_rows:
            md.logprob_token_ids = {
                i: params[i].logprob_token_ids
                for i in md.logprob_rows
                if params[i].logprob_token_ids
            }
            md.max_num_logprobs = max(
                0 if i in md.logprob_token_ids else params[i].logprobs or 0 for i in md.logprob_rows
            )
            md.logprob_rows_tensor = _rows_or_none(md.logprob_rows, n, device)
            if md.logprob_token_ids:
                md._set_logprob_token_ids(device)
        return md

    def _set_logprob_token_ids(self, device: torch.device) -> None:
        position = {row: j for j, row in enumerate(self.logprob_rows)}
        rows = [position[row] for row in self.logprob_token_ids]
        self.logprob_token_id_rows = _rows_or_none(rows, len(self.logprob_rows), device)
        ids = _pad_token_ids(list(self.logprob_token_ids.values()), 0)
        self.logprob_token_ids_tensor = to_device_tensor(ids, torch.int64, device)

    def _set_random_sampling(
        self,
        params: list[SamplingParams],
        random_rows: list[int],
        generators: list[torch.Generator | None],
        device: torch.device,
    ) -> None:
        rp = [params[i] for i in random_rows]
        self.random_rows = _rows_or_none(random_rows, self.num_rows, device)
        self.temperature = to_device_tensor([p.temperature for p in rp], torch.float32, device)
        min_p_rows = [j for j, p in enumerate(rp) if p.min_p > 0.0]
        if min_p_rows:
            self.min_p_rows = _rows_or_none(min_p_rows, len(rp), device)
            self.min_p = to_device_tensor([rp[j].min_p for j in min_p_rows], torch.float32, device)
        # top_k >= vocab_size keeps everything, so treat it as unset (no sort needed).
        use_k = [0 < p.top_k < self.vocab_size for p in rp]
        use_p = [p.top_p < 1.0 for p in rp]
        sorted_rows = [j for j in range(len(rp)) if use_k[j] or use_p[j]]
        if sorted_rows:
            self.top_k_top_p_rows = _rows_or_none(sorted_rows, len(rp), device)
            if any(use_k):
                ks = [rp[j].top_k if use_k[j] else self.vocab_size for j in sorted_rows]
                self.top_k = to_device_tensor(ks, torch.int64, device)
            if any(use_p):
                self.top_p = to_device_tensor(
                    [rp[j].top_p for j in sorted_rows], torch.float32, device
                )
        for j, row in enumerate(random_rows):
            g = generators[row]
            if g is None:
                continue
            if g.device.type != device.type:
                raise ValueError(
                    f"generators[{row}] is on {g.device} but the logits are on {device}: "
                    "create each seeded request's generator on the model's device"
                )
            self.generators[j] = g

    def _set_penalties(
        self,
        params: list[SamplingParams],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
        device: torch.device,
    ) -> None:
        rows = [
            i
            for i, p in enumerate(params)
            if p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
        ]
        if not rows:
            return
        pp = [params[i] for i in rows]
        pad = self.vocab_size
        self.penalty_rows = _rows_or_none(rows, self.num_rows, device)
        self.output_token_ids = to_device_tensor(
            _pad_token_ids([output_token_ids[i] for i in rows], pad), torch.int64, device
        )
        self.frequency_penalties = to_device_tensor(
            [p.frequency_penalty for p in pp], torch.float32, device
        )
        self.presence_penalties = to_device_tensor(
            [p.presence_penalty for p in pp], torch.float32, device
        )
        if any(p.repetition_penalty != 1.0 for p in pp):
            # Only rows with a repetition penalty need their prompt (the others are all padding).
            prompts = [
                prompt_token_ids[i] if p.repetition_penalty != 1.0 else () for i, p in zip(rows, pp)
            ]
            self.prompt_token_ids = to_device_tensor(
                _pad_token_ids(prompts, pad), torch.int64, device
            )
            self.repetition_penalties = to_device_tensor(
                [p.repetition_penalty for p in pp], torch.float32, device
            )

    def _set_sparse_processors(
        self,
        params: list[SamplingParams],
        output_token_ids: list[Sequence[int]],
        device: torch.device,
    ) -> None:
        allowed_rows: list[int] = []
        allowed: list[tuple[int, int]] = []
        bias: list[tuple[int, int]] = []
        bias_values: list[float] = []
        banned: list[tuple[int, int]] = []
        bad_words: list[tuple[int, int]] = []
        for i, p in enumerate(params):
            if p.allowed_token_ids:
                allowed_rows.append(i)
                allowed.extend((i, t) for t in set(p.allowed_token_ids))
            # The field, not its property: a property call per row per step costs ~6x more.
            if p._bad_words_token_ids:
                bans = banned_tokens(p._bad_words_token_ids, output_token_ids[i])
                bad_words.extend((i, t) for t in bans)
            if p.logit_bias:
                bias.extend((i, t) for t in p.logit_bias)
                bias_values.extend(p.logit_bias.values())
            if len(output_token_ids[i]) < p.min_tokens:
                banned.extend((i, t) for t in p.all_stop_token_ids)
        if allowed_rows:
            self.allowed_rows = to_device_tensor(allowed_rows, torch.int64, device)
            self.allowed_token_index = to_device_tensor(allowed, torch.int64, device).T
        if bad_words:
            self.bad_words_index = to_device_tensor(bad_words, torch.int64, device).T
        if bias:
            self.logit_bias_index = to_device_tensor(bias, torch.int64, device).T
            self.logit_bias_values = to_device_tensor(bias_values, torch.float32, device)
        if banned:
            self.min_tokens_index = to_device_tensor(banned, torch.int64, device).T
