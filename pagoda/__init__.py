"""Pagoda: an LLM inference and serving engine.

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=20))[0].outputs[0].text)

`LLM` is imported lazily so that `import pagoda` (and the torch-free core) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagoda import envs
from pagoda.inputs import PromptType, TextPrompt, TokensPrompt
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import (
    RepetitionDetectionParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

# Before anything imports torch (libgomp reads it when loaded); the imports above do not.
envs.set_openmp_wait_policy()

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "Logprob",
    "PromptType",
    "RepetitionDetectionParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    if name == "LLMEngine":
        from pagoda.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "EngineArgs":
        from pagoda.engine.arg_utils import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
