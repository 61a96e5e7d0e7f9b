"""vLLM's `vllm.logprobs` names: the logprobs containers, defined in `pagoda.outputs`."""

from pagoda.outputs import (
    FlatLogprobs,
    Logprob,
    LogprobsOnePosition,
    PromptLogprobs,
    SampleLogprobs,
    create_prompt_logprobs,
    create_sample_logprobs,
)

__all__ = [
    "FlatLogprobs",
    "Logprob",
    "LogprobsOnePosition",
    "PromptLogprobs",
    "SampleLogprobs",
    "create_prompt_logprobs",
    "create_sample_logprobs",
]
