"""A plain per-row sampler reference (float64, Python loops) that the batched sampler must match.

It follows the order vLLM v1 uses and `pagoda.sample` documents: allowed_token_ids, bad_words,
min_tokens, logit_bias, repetition/frequency/presence penalties; then greedy argmax, or temperature, min_p,
top-k, top-p and softmax.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from pagoda.sample.sampler import SamplingMetadata
from pagoda.sampling_params import SamplingParams


def ref_processed_logits(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Row `logits` [V] after everything that can change the greedy choice (float64)."""
    row = [float(x) for x in logits.tolist()]
    vocab = len(row)
    if p.allowed_token_ids:
        allowed = set(p.allowed_token_ids)
        row = [x if t in allowed else -math.inf for t, x in enumerate(row)]
    for t in ref_bad_words_bans(p.bad_words_token_ids or [], output):
        row[t] = -math.inf
    if len(output) < p.min_tokens:
        banned = [-math.inf if t in p.all_stop_token_ids else x for t, x in enumerate(row)]
        if any(x > -math.inf for x in banned):  # else the stop tokens are all it may take
            row = banned
    for t, b in (p.logit_bias or {}).items():
        row[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    counts = Counter(output)
    for t, c in counts.items():
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    assert len(row) == vocab
    return torch.tensor(row, dtype=torch.float64)


def ref_bad_words_bans(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's `_apply_bad_words_single_batch` as written there: a word's last token is banned
    when the output's last tokens are its prefix (a prefix longer than the output: never)."""
    banned = set()
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix_length = len(word) - 1
        actual = output[-prefix_length:] if prefix_length > 0 else []
        if actual == word[:prefix_length]:
            banned.add(word[-1])
    return banned


def ref_probs(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The distribution a random row samples from (float64 [V])."""
    row = ref_processed_logits(logits, p, prompt, output) / p.temperature
    probs = torch.softmax(row, dim=0)
    if p.min_p > 0:
        row[probs < p.min_p * probs.max()] = -math.inf
    order = sorted(range(len(row)), key=lambda t: -row[t].item())
    if 0 < p.top_k < len(row):
        for t in order[p.top_k :]:
            row[t] = -math.inf
    if p.top_p < 1.0:
        probs = torch.softmax(row, dim=0)
        mass_before = 0.0
        for t in order:
            # Keep a token while the mass of the tokens above it is still below top_p.
            if mass_before >= p.top_p:
                row[t] = -math.inf
            mass_before += probs[t].item()
    return torch.softmax(row, dim=0)


def make_md(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    device: str = "cpu",
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_requests(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        vocab,
        torch.device(device),
    )
