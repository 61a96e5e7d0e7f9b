"""Bad flags of `pagoda bench serve` and `pagoda bench throughput` end in one `error:` line and
exit code 2 before any slow work: before the prompts are built or the server is asked anything
(an address where nothing listens shows it), before the engine starts."""

from __future__ import annotations

import pytest

from pagoda.cli import main

NOWHERE = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]  # discard: nothing listens


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--request-rate", "0"],
            "--request-rate must be positive, or inf for all at once, got 0.0",
        ),
        (["--request-rate", "4", "-1"], "--request-rate must be positive, or inf for all at once"),
        (["--request-rate", "nan"], "--request-rate must be positive"),
        (["--burstiness", "0"], "--burstiness must be a positive number, got 0.0"),
        (["--burstiness", "inf"], "--burstiness must be a positive number, got inf"),
        (["--metric-percentiles", "50,101"], "--metric-percentiles takes comma-separated numbers"),
        (["--metric-percentiles", "p99"], "--metric-percentiles takes comma-separated numbers"),
        (["--random-output-len", "0"], "--random-output-len must be >= 1, got 0"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["--max-concurrency", "0"], "--max-concurrency must be >= 1, got 0"),
        (["--random-range-ratio", "1"], "--random-range-ratio must be in [0, 1)"),
        (["--goodput", "ttft:nan"], "is not a positive number of ms"),
        (["--dataset-name", "lognormal", "--lognormal-output-mean", "nan"], "--lognormal-*-mean"),
        (["--result-filename", "/no/such/dir/r.json"], "the folder /no/such/dir does not exist"),
        (["--plot", "/no/such/dir/p.png"], "the folder /no/such/dir does not exist"),
    ],
)
def test_bench_serve_refuses_a_bad_flag_before_asking_the_server(capsys, flags, message):
    assert main([*NOWHERE, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
        (["--num-prompts", "-1"], "--num-prompts must be >= 1, got -1"),
        (["--output-json", "/no/such/dir/x.json"], "the folder /no/such/dir does not exist"),
        (["--input-len", "x"], "a length range must be N or LO:HI"),
        (["--temperature", "nan"], "temperature must be"),
    ],
)
def test_bench_throughput_refuses_a_bad_flag_before_the_engine_starts(
    capsys, monkeypatch, flags, message
):
    import pagoda.entrypoints.llm as llm

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(llm, "LLM", no_engine)
    assert main(["bench", "throughput", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert message in err
