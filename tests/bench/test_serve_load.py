"""`pagoda bench serve`'s load: gamma arrivals (burstiness), a sweep of rates with its table,
results and plot, defaults by the server's device, and a run without httpx (the plain install:
aiohttp and the standard library only), and a --model the server does not serve."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.bench.load import DEVICE_DEFAULTS, apply_device_defaults, arrival_gaps

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))

from servers import ServerProcess  # noqa: E402

FAKE = Path(__file__).parents[1] / "reliability" / "fake_server.py"


def test_arrivals_have_the_rate_and_the_burstiness_asked_for():
    poisson = arrival_gaps(4001, 20.0, 1.0, seed=1)[1:]
    bursty = arrival_gaps(4001, 20.0, 0.25, seed=1)[1:]
    even = arrival_gaps(4001, 20.0, 8.0, seed=1)[1:]
    for gaps in (poisson, bursty, even):
        assert statistics.mean(gaps) == pytest.approx(0.05, rel=0.1)
    cv = [statistics.stdev(g) / statistics.mean(g) for g in (bursty, poisson, even)]
    assert cv[0] > 1.5 and 0.9 < cv[1] < 1.1 and cv[2] < 0.5  # CV of gamma: 1/sqrt(shape)
    assert arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="burstiness"):
        arrival_gaps(3, 1.0, 0.0, 0)


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    log = tmp_path_factory.mktemp("fake") / "server.log"
    s = ServerProcess([sys.executable, str(FAKE), "--step-delay", "0.002"], log).wait_ready(60)
    yield s
    s.stop()


def test_defaults_follow_the_servers_device(fake):
    args = argparse.Namespace(num_prompts=None, random_input_len=32, random_output_len=None)
    assert apply_device_defaults(args, fake.url, {}) == "cpu"  # no GPU memory in its /metrics
    cpu = DEVICE_DEFAULTS["cpu"]
    assert (args.num_prompts, args.random_input_len, args.random_output_len) == (
        cpu["num_prompts"], 32, cpu["random_output_len"])  # fmt: skip


def test_a_rate_sweep_without_httpx_saves_each_rate_and_plots(fake, tmp_path):
    argv = ["bench", "serve", "--base-url", fake.url, "--num-prompts", "8",
            "--random-input-len", "12", "--random-output-len", "4", "--ignore-eos",
            "--request-rate", "40", "inf", "--burstiness", "0.5", "--goodput", "ttft:5000",
            "--result-dir", str(tmp_path), "--result-filename", "r.json",
            "--plot", str(tmp_path / "sweep.png")]  # fmt: skip
    code = ("import sys; sys.modules['httpx'] = None  # as after `pip install -e .`\n"
            "from pagoda.cli import main; sys.exit(main(sys.argv[1:]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Request rate sweep" in out.stdout and "Burstiness (gamma shape):" in out.stdout
    for rate in ("40.0", "inf"):
        res = json.loads((tmp_path / f"r-{rate}qps.json").read_text())
        assert res["completed"] == 8 and res["burstiness"] == 0.5
        assert res["request_rate"] == (float(rate) if rate != "inf" else "inf")
        assert {"p50_ttft_ms", "p90_tpot_ms", "p99_itl_ms", "p99_e2el_ms"} <= set(res)
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_a_model_the_server_does_not_serve_is_named_with_the_served_ones(fake, capsys):
    from pagoda.bench.load import get_json

    served = get_json(f"{fake.url}/v1/models")["data"][0]["id"]
    argv = ["bench", "serve", "--base-url", fake.url, "--num-prompts", "2", "--model", "nope"]
    from pagoda.cli import main

    assert main(argv) == 2
    # It said "The server has no tokenizer", then "cannot find the vocabulary size".
    assert capsys.readouterr().err == (
        f"error: --model 'nope' is not served by {fake.url}: it serves {served!r}\n"
    )
