"""Grammar compile workers as `pagoda serve` runs them: children of the engine core process
(the fake engine with a real structured-outputs manager), killed when a compile runs past
PAGODA_GRAMMAR_COMPILE_TIMEOUT_S, and never left behind: not after a shutdown, not when the
engine core or the front end above it is killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from fake_engine import structured_engine

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.exceptions import EngineDeadError
from pagoda.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)"),
]
pytest.importorskip("xgrammar")

SLOW_CHOICE = [f"option number {i} of many" for i in range(20_000)]  # ~5 s to compile
SLOWER_CHOICE = [f"option number {i} of many" for i in range(50_000)]  # ~30 s


def _params(**so) -> SamplingParams:
    return SamplingParams(
        max_tokens=2,
        output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=StructuredOutputsParams(**so),
    )


async def _generate(llm: AsyncLLM, rid: str, params: SamplingParams) -> list:
    return [o async for o in llm.generate("hi", params, rid)]


def _children(pid: int) -> list[int]:
    """The processes `pid` started (multiprocessing's), alive or zombies."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return [c for c in out if _running(c)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_a_compile_past_its_timeout_kills_its_worker_and_the_next_is_served(monkeypatch):
    """Before, the refused compile kept one of the engine core's two compile threads, and a
    core, until xgrammar returned (30 s for a choice of 50,000): two such requests and every
    structured request after them waited, then was refused too. Now the worker is killed at
    the timeout, the next constraint compiles in the worker started in its place, and a
    shutdown leaves no worker behind."""
    monkeypatch.setenv("PAGODA_GRAMMAR_COMPILE_TIMEOUT_S", "1.5")  # the core inherits it
    llm = AsyncLLM(engine_factory=structured_engine)
    core = llm._core.process.pid
    try:
        assert asyncio.run(_generate(llm, "warm", _params(regex="[ab]+")))[-1].finished
        (worker,) = _children(core)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="longer than 1.5 s to compile"):
            asyncio.run(_generate(llm, "slow", _params(choice=SLOW_CHOICE)))
        assert time.monotonic() - t0 < 4.0
        assert not _running(worker), "the compile worker runs on past the timeout"
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        assert asyncio.run(_generate(llm, "next", _params(json=schema)))[-1].finished
        workers = _children(core)
        assert len(workers) == 1 and worker not in workers
    finally:
        llm.shutdown()
    assert _wait(lambda: not any(map(_running, [core, *workers])), 5), "left behind"


def test_a_compile_worker_ends_with_its_killed_engine_core():
    """The engine core killed (OOM killer, kill -9) mid-compile: its worker, busy in xgrammar,
    sees its parent gone and exits."""
    llm = AsyncLLM(engine_factory=structured_engine)
    core = llm._core.process.pid
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            asyncio.run(_generate(llm, "slow", _params(choice=SLOWER_CHOICE)))
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    client = threading.Thread(target=slow)
    try:
        client.start()
        assert _wait(lambda: len(_children(core)) == 1, 10)
        (worker,) = _children(core)
        time.sleep(3.0)  # started (it imports torch, as xgrammar does), and compiling
        os.kill(core, signal.SIGKILL)
        assert _wait(lambda: not _running(worker), 3), "the compile worker outlived its core"
        client.join(10)
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    finally:
        llm.shutdown()


def test_no_compile_worker_outlives_a_killed_front_end(tmp_path):
    """`pagoda serve` killed: its engine core reads the end of its pipe and exits, and takes its
    compile workers with it."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from fake_engine import structured_engine
        from pagoda.engine.async_llm import AsyncLLM
        from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
        if __name__ == "__main__":
            llm = AsyncLLM(engine_factory=structured_engine)
            print(llm._core.process.pid, flush=True)
            so = StructuredOutputsParams(choice=["option %d" % i for i in range(50_000)])
            async def slow():
                async for _ in llm.generate("hi", SamplingParams(structured_outputs=so), "s"):
                    pass
            asyncio.run(slow())
        """
    )
    path = tmp_path / "front_end.py"
    path.write_text(script)
    front = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        core = int(front.stdout.readline())
        assert _wait(lambda: len(_children(core)) == 1, 30)
        (worker,) = _children(core)
        time.sleep(2.0)
        front.send_signal(signal.SIGKILL)
        front.wait(10)
        assert _wait(lambda: not _running(core) and not _running(worker), 10), "left behind"
    finally:
        front.kill()
