"""`pagoda tune` on the fake-engine server (the real server stack, no model): the path per
goal, the report it writes, and that Ctrl-C leaves no server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda.cli import main
from pagoda.tune.report import serve_command
from pagoda.tune.runner import NGRAM, better, knob_path
from pagoda.tune.server import knob_flags

FAKE = f"{sys.executable} {Path(__file__).parent / 'reliability' / 'fake_server.py'}"
DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": 2048, "enable_prefix_caching": True}
SMALL = ["--server-cmd", FAKE, "--serve-args", "--max-model-len 1024", "--num-prompts", "6",
         "--input-len", "16", "--output-len", "4"]  # fmt: skip


def test_each_goal_walks_the_seeds_path():
    throughput = [k for k, _ in knob_path("throughput", DEFAULTS, "cpu", None)]
    assert throughput == ["max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype",
                          "enable_prefix_caching", "speculative_config"]  # fmt: skip
    latency = dict(knob_path("latency", DEFAULTS, "cpu", "/q"))
    assert latency["max_num_seqs"] == [64, 16] and latency["speculative_config"] == [NGRAM]
    assert latency["model"] == ["/q"]
    assert better("throughput", 1.06, 1.0) and not better("throughput", 1.04, 1.0)
    assert better("latency", -90.0, -100.0) and not better("latency", -97.0, -100.0)


def test_the_recommended_command_line():
    knobs = {"max_num_seqs": 64, "enable_prefix_caching": False, "speculative_config": NGRAM}
    assert knob_flags(knobs)[:3] == ["--max-num-seqs", "64", "--no-enable-prefix-caching"]
    assert serve_command("/m.gguf", knobs) == (
        "pagoda serve /m.gguf --max-num-seqs 64 --no-enable-prefix-caching --speculative-config "
        '\'{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}\''
    )


def test_tune_records_a_baseline_and_writes_its_report_within_the_budget(tmp_path, capsys):
    out = tmp_path / "t"
    rc = main(["tune", "--goal", "throughput", "--budget-minutes", "0.05", "--output-dir",
               str(out), *SMALL])  # fmt: skip
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "| 0 | baseline (defaults) | yes |" in report and "skipped: time budget" in report
    assert "    pagoda serve\n" in report  # nothing tried, nothing changed
    results = json.loads((out / "results.json").read_text())
    base = results["trials"][0]
    assert base["runs"][-1]["rate"] == float("inf") and len(base["runs"]) == 3
    assert all(r["completed"] == 6 and r["request_goodput"] is not None for r in base["runs"])
    pytest.importorskip("matplotlib")
    assert (out / "latency_vs_throughput.png").stat().st_size > 10_000


def test_bad_values_are_one_line_errors(capsys, tmp_path):
    assert main(["tune", "--goal", "latency", "--budget-minutes", "0"]) == 2
    assert "--budget-minutes must be a positive number" in capsys.readouterr().err
    for flag in ("--budget-minutes", "--slo-ttft-ms", "--slo-tpot-ms"):
        for value in ("inf", "nan"):  # inf overflowed int() after the output directory was made
            out_dir = tmp_path / f"{flag}{value}"
            argv = ["tune", "--goal", "latency", flag, value, "--output-dir", str(out_dir)]
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err == f"error: {flag} must be a positive number, got {value}\n"
            assert not out_dir.exists()
    assert main(["tune", "/no/such/model", "--goal", "latency"]) == 2
    assert "not found" in capsys.readouterr().err
    # Was a trial that could only fail, after the baseline's minutes.
    assert main(["tune", "--goal", "latency", "--quantized-model", "/no/such/awq"]) == 2
    assert capsys.readouterr().err == (
        "error: --quantized-model '/no/such/awq' not found: pass a local directory or .gguf file\n"
    )


def test_ctrl_c_stops_tune_and_its_server(tmp_path):
    cmd = [sys.executable, "-m", "pagoda.cli", "tune", "--goal", "latency", "--budget-minutes",
           "5", "--output-dir", str(tmp_path), *SMALL]  # fmt: skip
    # Ctrl-C as from a terminal, also when these tests run as a background job (which starts
    # its children with SIGINT ignored)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    pid = None
    try:
        for line in proc.stderr:  # the first trial's server
            if "server pid" in line:
                pid = int(line.split("server pid")[1])
                break
        assert pid is not None
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)  # the server's process group (server and engine core)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the server's process group {pid} outlived pagoda tune")


def test_ctrl_c_during_a_load_that_completes_anyway_still_stops_tune():
    """asyncio.run's own SIGINT handling cancels the load's task; a load that finishes anyway
    (the cancel landing as its last response arrives) would swallow the interrupt."""
    import asyncio

    from pagoda.tune.cli import interrupts_raise

    async def load() -> str:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(2)
        except asyncio.CancelledError:
            pass  # as a load whose requests all completed
        return "done"

    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_raise():
            asyncio.run(load())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: still ignored
        with interrupts_raise():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_run_past_the_budget_is_stopped():
    import asyncio

    from pagoda.tune.runner import Tuner, TuneSettings

    s = TuneSettings("throughput", [], "m", [], DEFAULTS, budget_s=-61.0, out_dir=".")
    tuner = Tuner(s, progress=lambda line: None)

    async def forever() -> None:
        await asyncio.sleep(3600)

    with pytest.raises(TimeoutError):
        tuner._within_budget(forever())
    s.budget_s = -59.9  # 0.1 s left: the run is cut at its deadline
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        tuner._within_budget(forever())
