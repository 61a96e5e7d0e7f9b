"""Repetition detection: the n-gram check over token lists (against a brute-force reference),
vLLM's validation messages, and the scheduler ending a repeating request with finish_reason
"repetition"."""

from __future__ import annotations

import random
import re

import pytest
from core_testing import check_block_invariants, make_request, make_scheduler

from pagoda.core.outputs import ModelRunnerOutput
from pagoda.repetition_detection import RepetitionDetectionParams, check_sequence_repetition

P = RepetitionDetectionParams


@pytest.mark.parametrize(
    "tokens,params,repeats",
    [
        ([], P(2, 0, 2), False),
        ([1, 2, 1, 2, 1, 2], P(2, 0, 3), True),
        ([1, 2, 1, 2, 1, 2], P(2, 0, 4), False),  # only 3 repeats
        ([1, 2, 1, 2, 1], P(2, 0, 2), True),  # "2 1" twice at the end
        ([1, 2, 1, 2, 1], P(2, 0, 3), False),
        ([9, 1, 2, 3, 1, 2, 3], P(3, 0, 2), True),
        ([9, 1, 2, 3, 1, 2, 3], P(2, 0, 2), False),  # the 3-gram is past max_pattern_size
        ([1, 2, 3, 1, 2, 3, 4], P(3, 0, 2), False),  # the output must end with the repeats
        ([5, 5, 5], P(2, 0, 3), True),  # a 1-gram: min_pattern_size 0 means 1
        ([5, 5, 5], P(2, 2, 2), False),  # 1-grams not looked for; "5 5" twice needs 4
        ([5, 5, 5, 5], P(2, 2, 2), True),
        ([5, 5, 5, 5], P(0, 0, 0), False),  # off
    ],
)
def test_output_ending_with_a_repeated_ngram_is_detected(tokens, params, repeats):
    assert check_sequence_repetition(tokens, params) is repeats


def _brute_force(tokens: list[int], params: RepetitionDetectionParams) -> bool:
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        n = size * params.min_count
        if params.max_pattern_size and len(tokens) >= n:
            if tokens[-n:] == tokens[-size:] * params.min_count:
                return True
    return False


def test_detection_matches_brute_force_on_random_outputs():
    rng = random.Random(0)
    found = 0
    for _ in range(3000):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
        hi = rng.randrange(0, 6)
        params = P(hi, rng.randrange(0, hi + 1), rng.randrange(2, 5))
        want = _brute_force(tokens, params)
        assert check_sequence_repetition(tokens, params) is want, (tokens, params)
        found += want
    assert 100 < found < 2900  # both answers were exercised


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(max_pattern_size=-1),
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
            "max_pattern_size. Set both to 0 to disable repetitive pattern detection.",
        ),
        (
            dict(max_pattern_size=2, min_pattern_size=3, min_count=2),
            "max_pattern_size, min_pattern_size must be >=0",
        ),
        (
            dict(max_pattern_size=2, min_count=1),
            "min_count must be >= 2 to detect repetitive patterns in engine output. If you do "
            "not wish to detect repetitive patterns, set max_pattern_size to 0.",
        ),
        (dict(max_pattern_size=2.0, min_count=2), "repetition_detection.max_pattern_size must"),
        (dict(max_pattern_size=2, min_count=True), "repetition_detection.min_count must"),
    ],
)
def test_bad_params_are_refused_with_vllms_messages(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        RepetitionDetectionParams(**kwargs)


def test_disabled_params_are_accepted():
    assert not RepetitionDetectionParams().enabled
    assert not RepetitionDetectionParams(min_count=1).enabled  # as vLLM: off, not refused


def _run(sched, tokens: dict[str, list[int]]):
    """Feed each request its next token from `tokens` until all finish; their last outputs."""
    last = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sampled = {}
        for req in sched.scheduled_requests(out):
            rid = req.request_id
            if out.num_computed_tokens[rid] + out.num_scheduled_tokens[rid] >= req.num_tokens:
                sampled[rid] = [tokens[rid][req.num_output_tokens]]
        for r in sched.update_from_output(out, ModelRunnerOutput(list(sampled), sampled)):
            if r.finished:
                last[r.request_id] = r
        check_block_invariants(sched)
    return last


def test_scheduler_ends_a_repeating_request_with_finish_reason_repetition():
    loop = [4, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # "1 2 3" repeats from token 2
    rd = RepetitionDetectionParams(max_pattern_size=3, min_count=3)
    sched = make_scheduler()
    sched.add_request(make_request("rep", [7, 8], 16, repetition_detection=rd))
    sched.add_request(make_request("min", [7, 8], 16, repetition_detection=rd, min_tokens=12))
    sched.add_request(make_request("off", [7, 8], 16))
    cap = RepetitionDetectionParams(max_pattern_size=3, min_count=5)  # repeats at the 16th
    sched.add_request(make_request("cap", [7, 8], 16, repetition_detection=cap))
    sched.add_request(make_request("eos", [7, 8], 16, repetition_detection=rd, eos_token_id=3))
    requests = {r.request_id: r for r in sched.waiting}
    done = _run(sched, dict.fromkeys(["rep", "min", "off", "cap", "eos"], loop))
    assert done["rep"].finish_reason == "repetition"
    assert done["rep"].stop_reason == "repetition_detected"
    assert requests["rep"].output_token_ids == loop[:10]  # the 3rd "1 2 3" ends at token 10
    assert requests["min"].output_token_ids == loop[:12]  # not before min_tokens
    assert done["min"].finish_reason == "repetition"
    assert done["off"].finish_reason == "length" and requests["off"].num_output_tokens == 16
    assert done["cap"].finish_reason == "length"  # the length cap wins on the same token
    assert done["eos"].finish_reason == "stop" and requests["eos"].output_token_ids == loop[:4]
