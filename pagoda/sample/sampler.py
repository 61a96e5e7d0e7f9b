"""The sampler: one step's logits `[num_rows, vocab]` in, one token id (and logprobs) per row out.

It follows vLLM v1's `Sampler`: logprobs come from the raw logits (log_softmax in float32, before
any processing: the sampled token's, then the top-k or a request's own `logprob_token_ids`);
then allowed_token_ids, bad_words, min_tokens, logit_bias and penalties; greedy
rows take the argmax (`greedy_argmax`: a two-stage Triton kernel on CUDA); random rows get
temperature, min_p, top-k/top-p and are sampled with the exponential race (argmax of probs /
Exponential(1) noise, i.e. the Gumbel-max trick), which needs no host sync. A seeded request
draws its noise from its own generator, so its tokens do not depend on the rest of the batch.
`Sampler.sample_on_device` queues all of that on the logits' device; `SamplerTensors.tolist` is
the one place the host waits. A batch that is all greedy with nothing to process or report
takes a plain argmax of the raw logits (`is_plain_greedy`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagoda.kernels import triton_available
from pagoda.sample import logits_processors as lp
from pagoda.sample.metadata import SamplingMetadata, to_device_tensor

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplerTensors",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "compute_prompt_token_id_logprobs",
]

# {token_id: (logprob, rank)}: the top-k tokens plus the chosen one; rank is 1-based.
LogprobsDict = dict[int, tuple[float, int]]


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row
    logprobs: list[LogprobsDict | None]  # per row; None when the row's params.num_logprobs is None


@dataclass
class SamplerTensors:
    """The sampler's results still on the device (no sync has happened yet)."""

    sampled_token_ids: torch.Tensor  # [num_rows] int64
    # Over md.logprob_rows; column 0 is the sampled token, then the top max_num_logprobs.
    logprob_token_ids: torch.Tensor | None = None  # [L, 1 + K] int64
    logprobs: torch.Tensor | None = None  # [L, 1 + K] float32
    sampled_token_ranks: torch.Tensor | None = None  # [L] int64
    # Over the rows of md.logprob_token_ids: the logprobs and ranks of their token ids.
    token_id_logprobs: torch.Tensor | None = None  # [T, max ids] float32
    token_id_ranks: torch.Tensor | None = None  # [T, max ids] int64

    def to_host_async(self) -> SamplerTensors:
        """Copies of the tensors in pinned host memory, queued without waiting: read them after
        the stream has passed this point (an event). On a CPU, the tensors themselves."""
        if not self.sampled_token_ids.is_cuda:
            return self

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        return SamplerTensors(
            sampled_token_ids=host(self.sampled_token_ids),
            logprob_token_ids=host(self.logprob_token_ids),
            logprobs=host(self.logprobs),
            sampled_token_ranks=host(self.sampled_token_ranks),
            token_id_logprobs=host(self.token_id_logprobs),
            token_id_ranks=host(self.token_id_ranks),
        )

    def tolist(self, md: SamplingMetadata) -> SamplerOutput:
        sampled = self.sampled_token_ids.tolist()
        logprobs: list[LogprobsDict | None] = [None] * md.num_rows
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids.tolist()
            values = self.logprobs.tolist()
            ranks = self.sampled_token_ranks.tolist()
            custom = md.logprob_token_ids
            for j, row in enumerate(md.logprob_rows):
                k = 0 if row in custom else md.num_logprobs[row]
                logprobs[row] = _logprobs_dict(ids[j], values[j], ranks[j], k)
            if self.token_id_logprobs is not None:
                # After the sampled token, as vLLM orders them (it keeps its place if listed).
                id_values, id_ranks = self.token_id_logprobs.tolist(), self.token_id_ranks.tolist()
                for t, (row, token_ids) in enumerate(custom.items()):
                    entry = logprobs[row]
                    for c, token_id in enumerate(token_ids):
                        entry[token_id] = (id_values[t][c], id_ranks[t][c])
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _logprobs_dict(ids: list[int], values: list[float], rank: int, k: int) -> LogprobsDict:
    # The chosen token first, then the top-k by position (which wins if the chosen one is in it,
    # as in vLLM).
    out = {ids[0]: (values[0], rank)}
    for r in range(k):
        out[ids[1 + r]] = (values[1 + r], r + 1)
    return out


def _on_rows(
    x: torch.Tensor, rows: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Apply `fn` to the given rows of `x` only (all of them when `rows` is None), in place."""
    if rows is None:
        out = fn(x)
        if out is not x:
            x.copy_(out)
        return x
    # x[rows], not index_select: the latter is ~30x slower on CPU (torch 2.x).
    return x.index_copy_(0, rows, fn(x[rows]))


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Everything that can change the greedy choice, in vLLM v1's order, in place."""
    if md.allowed_token_index is not None:
        lp.apply_allowed_token_ids(logits, md.allowed_rows, md.allowed_token_index)
    if md.bad_words_index is not None:
        lp.apply_token_bans(logits, md.bad_words_index)
    if md.min_tokens_index is not None:
        lp.apply_min_tokens(logits, md.min_tokens_index)
    if md.logit_bias_index is not None:
        lp.apply_logit_bias(logits, md.logit_bias_index, md.logit_bias_values)
    if md.output_token_ids is not None:
        _on_rows(
            logits,
            md.penalty_rows,
            lambda x: lp.apply_penalties(
                x,
                md.prompt_token_ids,
                md.output_token_ids,
                md.repetition_penalties,
                md.frequency_penalties,
                md.presence_penalties,
            ),
        )
    return logits


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from `probs` [rows, vocab] (need not be normalised), no host sync.

    argmax_i p_i / E_i with E_i ~ Exponential(1) picks i with probability p_i / sum(p) (the
    exponential race). E = -log(U), U ~ Uniform[0, 1); the edge draws are harmless: U = 0 gives
    E = inf (that token cannot win) and U = 1 would give E = 0 (p / log U = +inf, never the
    argmin). Seeded rows draw their own noise, so it is the same in any batch.
    """
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.uniform_()
    for i, generator in generators.items():
        noise[i].uniform_(generator=generator)
    # p / log(U) = -p / E: the race's winner is its argmin (saves negating the noise).
    return probs.div_(noise.log_()).argmin(dim=-1)


def compute_random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, min_p, top-k/top-p, softmax; `logits` holds only the random rows (edited in
    place). The result is the distribution each random row samples from (rejection sampling for
    speculative decoding needs it too)."""
    lp.apply_temperature(logits, md.temperature)
    if md.min_p is not None:
        _on_rows(logits, md.min_p_rows, lambda x: lp.apply_min_p(x, md.min_p))
    if md.top_k is not None or md.top_p is not None:
        _on_rows(
            logits,
            md.top_k_top_p_rows,
            lambda x: lp.apply_top_k_top_p(x, md.top_k, md.top_p),
        )
    return logits.softmax(dim=-1)


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.float32).log_softmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of `token_ids` [rows] and of the top `num_logprobs` tokens of each row.

    Returns ids [rows, 1 + k] and logprobs [rows, 1 + k] (column 0: the given token) and the
    given token's 1-based rank [rows], counted as vLLM does: the number of tokens whose logprob
    is >= its own.
    """
    token_ids = token_ids[:, None]
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    ids = torch.cat([token_ids, top_ids], dim=1)
    values = torch.cat([token_logprobs, top_logprobs], dim=1)
    return ids, values, ranks


def gather_token_id_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [rows, n] of `token_ids` [rows, n] in `logprobs` [rows, vocab], and their 1-based
    ranks counted as `gather_logprobs` counts the sampled token's (the tokens whose logprob is
    >= theirs), found by binary search in each row sorted once."""
    values = logprobs.gather(1, token_ids)
    ascending = logprobs.sort(dim=-1).values
    ranks = logprobs.shape[1] - torch.searchsorted(ascending, values, side="left")
    return values, ranks


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1): the first maximal index of each row of [rows, vocab]. On CUDA the
    two-stage Triton kernel (`pagoda.kernels.argmax`; torch reduces a row with one thread block,
    ~26 µs for a 128k vocabulary on an H200); on CPU numpy's, many times faster than torch's
    reduction on the few rows of a decode step; torch.argmax elsewhere and as the reference.
    Both give the first maximal index, a NaN counting as the maximum."""
    if logits.is_cuda and triton_available():
        from pagoda.kernels.argmax import argmax_supported, argmax_triton

        if argmax_supported(logits):
            return argmax_triton(logits)
    elif logits.device.type == "cpu" and logits.dtype is torch.float32 and logits.dim() == 2:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row of a step's logits (see the module docstring for the order)."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        return self.sample_on_device(logits, md).tolist(md)

    def sample_on_device(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerTensors:
        if logits.dim() != 2 or logits.shape[0] != md.num_rows:
            raise ValueError(
                f"logits must be [num_rows={md.num_rows}, vocab], got {tuple(logits.shape)}"
            )
        if logits.shape[1] != md.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[1]} columns but SamplingMetadata was built with "
                f"vocab_size={md.vocab_size}: pass the logits' width as vocab_size"
            )
        if md.is_plain_greedy:
            return SamplerTensors(sampled_token_ids=greedy_argmax(logits))
        return self.sample_reference(logits, md)

    def sample_reference(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerTensors:
        """The general path (also the reference for the plain-greedy fast path)."""
        # A float32 copy: the caller's logits stay untouched and processing happens in place.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            # From the raw logits, before anything below edits them (vLLM's "raw_logprobs").
            rows = md.logprob_rows_tensor
            raw_logprobs = compute_logprobs(logits if rows is None else logits[rows])

        apply_logits_processors(logits, md)
        if md.all_random:
            sampled = random_sample(compute_random_probs(logits, md), md.generators)
        else:
            sampled = greedy_argmax(logits)
            if not md.all_greedy:
                random_logits = logits[md.random_rows]
                probs = compute_random_probs(random_logits, md)
                sampled.index_copy_(0, md.random_rows, random_sample(probs, md.generators))

        out = SamplerTensors(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            rows_sampled = (
                sampled if md.logprob_rows_tensor is None else sampled[md.logprob_rows_tensor]
            )
            out.logprob_token_ids, out.logprobs, out.sampled_token_ranks = gather_logprobs(
                raw_logprobs, rows_sampled, md.max_num_logprobs
            )
            if md.logprob_token_ids_tensor is not None:
                rows = md.logprob_token_id_rows
                lp = raw_logprobs if rows is None else raw_logprobs[rows]
                out.token_id_logprobs, out.token_id_ranks = gather_token_id_logprobs(
                    lp, md.logprob_token_ids_tensor
                )
        return out


def compute_prompt_token_id_logprobs(
    logits: torch.Tensor, token_ids: np.ndarray
) -> list[list[float]]:
    """Per row of `logits` [N, vocab]: the logprobs of that row's `token_ids` [N, num_ids]
    (vLLM's raw logprobs: log_softmax of the model's logits), -inf where an id is -1 (padding)."""
    ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64)).to(logits.device)
    pad = ids < 0
    values = compute_logprobs(logits).gather(1, ids.clamp_min(0))
    return values.masked_fill_(pad, float("-inf")).tolist()


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: list[int], k: int, chunk_size: int = 1024
) -> list[LogprobsDict]:
    """Per row of `logits` [N, vocab]: {token: (logprob, rank)} for the target and the top k.

    Row i predicts `target_token_ids[i]` (the next prompt token). Done in chunks of rows so a
    long prompt does not need a [N, vocab] float32 copy at once.
    """
    n = logits.shape[0]
    if len(target_token_ids) != n:
        raise ValueError(
            f"target_token_ids must have one id per logits row ({n}), got {len(target_token_ids)}"
        )
    if k < 0:
        raise ValueError(f"prompt_logprobs must be >= 0, got {k}")
    targets = to_device_tensor(target_token_ids, torch.int64, logits.device)
    out: list[LogprobsDict] = []
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        logprobs = compute_logprobs(logits[start:end])
        ids, values, ranks = gather_logprobs(logprobs, targets[start:end], k)
        ids_l, values_l, ranks_l = ids.tolist(), values.tolist(), ranks.tolist()
        out.extend(_logprobs_dict(ids_l[j], values_l[j], ranks_l[j], k) for j in range(end - start))
    return out
