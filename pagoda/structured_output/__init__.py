"""Structured outputs (vLLM's `StructuredOutputsParams`): JSON schema, JSON object, regex,
choice and EBNF grammar constraints, compiled by xgrammar, applied as a next-token bitmask.

Where each piece runs, as in vLLM: the engine (`StructuredOutputManager`, in the scheduler's
process) owns the compiled grammars and one matcher per request, fills the bitmask rows of a
step's structured requests after `schedule()` and hands it to the runner in the
`SchedulerOutput`; the runner masks those rows' logits before sampling
(`pagoda.sample.bitmask`), so penalties, temperature, top-k/p and logprobs all see the masked
logits; the scheduler feeds every appended token to the request's matcher and stops the request
when the grammar terminates. Nothing imports xgrammar until a request asks for it.
"""

from pagoda.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager"]
