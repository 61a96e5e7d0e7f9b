"""The ShareGPT-like log-normal mix of `pagoda bench serve` / `pagoda bench throughput`: its
means, its caps, and the same requests on both sides for one seed."""

from __future__ import annotations

import argparse
import random
import statistics

import pytest

from pagoda.bench.datasets import LognormalMix, TokenIdVocab, lognormal_dataset
from pagoda.bench.throughput import add_throughput_args, make_requests_from_args


def test_lognormal_lengths_have_the_requested_means_and_stay_under_the_caps():
    mix = LognormalMix(input_mean=226, output_mean=196, max_len=1 << 20)
    rng = random.Random(0)
    draws = [mix.draw(rng) for _ in range(20000)]
    assert statistics.mean(d[0] for d in draws) == pytest.approx(226, rel=0.05)
    assert statistics.mean(d[1] for d in draws) == pytest.approx(196, rel=0.05)
    capped = LognormalMix(max_len=512)
    for n_in, n_out in (capped.draw(rng) for _ in range(5000)):
        assert 4 <= n_in <= 256 and 4 <= n_out and n_in + n_out <= 512


def test_offline_and_served_token_id_requests_are_the_same():
    served = lognormal_dataset(TokenIdVocab(1000), 20, LognormalMix(max_len=300), seed=3)
    parser = argparse.ArgumentParser()
    add_throughput_args(parser)
    args = parser.parse_args(["--dataset-name", "lognormal", "--num-prompts", "20",
                              "--lognormal-max-len", "300"])  # fmt: skip
    args.seed = 3  # an engine flag in `pagoda bench throughput`
    offline = make_requests_from_args(args, 1000)
    assert offline == [(r.prompt, r.expected_output_len) for r in served]
    assert all(len(r.prompt) == r.prompt_len and max(r.prompt) < 1000 for r in served)


def test_bad_mix_is_a_value_error_naming_the_flag():
    with pytest.raises(ValueError, match="--lognormal"):
        LognormalMix(input_sigma=-1)
