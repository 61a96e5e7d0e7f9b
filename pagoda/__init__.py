"""Pagoda: an LLM inference and serving engine.

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    print(llm.generate("Hello", SamplingParams(max_tokens=20))[0].outputs[0].text)

`LLM` is imported lazily so that `import pagoda` (and the torch-free core) stays light.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads (torch's and the CPU kernels': one libgomp) sleep as soon as a parallel region
# ends instead of spinning for it to be handed new work. Spinning threads take the cores the
# working ones and any other process need: on a 2-core machine with one other busy process,
# decoding 16 sequences ran at 9.5 output tok/s spinning and 50 sleeping (on an idle machine
# sleeping costs single-stream decode about a quarter: OMP_WAIT_POLICY=ACTIVE for a dedicated
# one). libgomp reads this when it is loaded, so it must be set before torch is imported; a
# value the user set (or GOMP_SPINCOUNT) is kept.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

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
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
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
