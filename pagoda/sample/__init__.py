"""Sampling: turn a step's logits into token ids and logprobs (see `pagoda.sample.sampler`)."""

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.sampler import (
    Sampler,
    SamplerOutput,
    SamplerTensors,
    compute_prompt_logprobs,
    compute_prompt_token_id_logprobs,
)

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplerTensors",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "compute_prompt_token_id_logprobs",
]
