"""Speculative decoding: proposers of draft tokens that the target model verifies in one step.

The scheduler schedules a request's drafts (`Request.spec_token_ids`) as extra tokens, the
model runner samples the target at every draft position and keeps the drafts up to the first
one the target's sample disagrees with, plus that sample (`StepOutputFuture.get`): for a
deterministic proposer this is exact rejection sampling, so the output distribution is the
target model's. The engine asks the proposer for drafts before each step (`LLMEngine`).
"""

from pagoda.spec_decode.draft_model import DraftModelProposer
from pagoda.spec_decode.ngram import NgramProposer

__all__ = ["DraftModelProposer", "NgramProposer"]
