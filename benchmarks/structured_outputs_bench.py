"""Per-step cost of structured outputs on the CPU (embedded model, a batch of 8 requests under a
JSON schema): the bitmask fill (engine), the mask on the logits (runner) and the matchers'
accept, against the whole decode step of the same batch without constraints. A/B interleaved,
three rounds, medians.

    python benchmarks/structured_outputs_bench.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "structured"))

from test_structured_engine import SCHEMA  # noqa: E402

import pagoda.structured_output.backend_xgrammar as backend  # noqa: E402
import pagoda.structured_output.manager as manager  # noqa: E402
import pagoda.worker.model_runner as model_runner  # noqa: E402
from pagoda import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SECONDS = {"fill": 0.0, "apply": 0.0, "accept": 0.0}


def _timed(owner: type, name: str, key: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SECONDS[key] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def _run(llm: LLM, structured: bool) -> tuple[list[float], dict[str, float]]:
    for key in SECONDS:
        SECONDS[key] = 0.0
    params = SamplingParams(
        temperature=0.8,
        seed=1,
        max_tokens=48,
        ignore_eos=not structured,
        structured_outputs=StructuredOutputsParams(json=SCHEMA) if structured else None,
    )
    engine = llm.llm_engine
    for i in range(8):
        engine.add_request(
            f"{structured}-{time.time()}-{i}", f"Person {i} as JSON:", params.clone()
        )
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps, dict(SECONDS)


def main() -> None:
    _timed(manager.StructuredOutputManager, "grammar_bitmask", "fill")
    _timed(model_runner.ModelRunner, "_apply_grammar_bitmask", "apply")
    _timed(backend.GrammarState, "accept_token", "accept")
    llm = LLM(dtype="float32", max_model_len=512, seed=0)
    _run(llm, True), _run(llm, False)  # warm-up
    for _ in range(3):
        for structured in (True, False):
            steps, seconds = _run(llm, structured)
            decode_ms = statistics.median(steps[1:]) * 1e3  # the first step is the prefill
            parts = "  ".join(f"{k} {v / len(steps) * 1e3:.3f}" for k, v in seconds.items())
            label = "structured" if structured else "free      "
            print(f"{label} median decode step {decode_ms:.2f} ms  per step ms: {parts}")


if __name__ == "__main__":
    main()
