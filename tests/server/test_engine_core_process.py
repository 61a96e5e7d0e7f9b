"""AsyncLLM with its engine core in a child process (what `pagoda serve` runs), against the fake
engine built in that child: streaming, refusals, aborts that free KV blocks, the waiting bound,
drain, engine death (an exception and a silent crash), stats for /metrics, and no orphan
process after shutdown or after the parent is killed."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from fake_engine import FakeEngine, crashing_engine, failing_engine, misconfigured_engine

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.exceptions import EngineDeadError, EngineDrainingError, EngineOverloadedError
from pagoda.sampling_params import RequestOutputKind, SamplingParams


def _params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **kw)


async def _collect(llm: AsyncLLM, rid: str, prompt: str = "hi", **kw) -> list:
    return [o async for o in llm.generate(prompt, _params(**kw), rid)]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists": count it as gone (only its parent's wait is missing).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_exists(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def llm():
    """One engine core process for the tests that leave it healthy."""
    hooked: list = []
    llm = AsyncLLM(
        engine_factory=functools.partial(FakeEngine, step_delay=0.005, max_num_seqs=1),
        max_waiting_requests=2,
        stats_hooks=[lambda e: hooked.append(e.last_iteration_stats)],
    )
    llm.hooked = hooked
    yield llm
    llm.shutdown()


def test_outputs_come_from_another_process(llm):
    outs = asyncio.run(_collect(llm, "r1", max_tokens=5))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 5
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].text for o in outs) == "defgh"  # as in the threaded engine
    # The front end keeps the prompt (only token ids cross the pipe): it is on every output.
    assert all(o.prompt_token_ids == outs[0].prompt_token_ids != [] for o in outs)
    child = llm._core.process
    assert child.is_alive() and child.pid != os.getpid()
    # The front end answers from its own copies of the tokenizer and the configs.
    assert llm.tokenizer.decode([ord("a")]) == "a"
    assert llm.model_config.max_model_len == 128
    assert llm.engine.config.cache_config.block_size == 16


def test_reports_carry_the_cores_token_ids_only():
    """What crosses the pipe: the core's plain outputs (token ids, finish reasons), never text,
    a prompt or a RequestOutput; the front end keeps those."""
    import pickle

    from pagoda.core.outputs import EngineCoreOutput, EngineCoreRequest
    from pagoda.engine.engine_core import AddRequest, EngineCoreLoop, Stop

    core = FakeEngine()
    prompt = list(range(1, 120))
    request = EngineCoreRequest("a", prompt, SamplingParams(max_tokens=3), time.time(), None, 3)
    commands = [[AddRequest([request])]]

    def get_commands(block: bool) -> list:
        if commands:
            return commands.pop(0)
        return [] if core.has_unfinished_requests() else [Stop()]

    reports: list = []
    EngineCoreLoop(core, get_commands, reports.append).run()
    outs = [o for r in reports for o in r.outputs]
    assert all(type(o) is EngineCoreOutput for o in outs)
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
    assert outs[-1].finish_reason == "length"
    assert all(len(pickle.dumps(r.outputs)) < 400 for r in reports)  # no 119-token prompt


def test_refused_request_is_a_value_error_and_the_core_keeps_serving(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(_collect(llm, "long", prompt="x" * 200))
    assert len(asyncio.run(_collect(llm, "ok", max_tokens=2))) == 2
    assert llm.num_in_flight == 0 and llm._num_pending_adds == 0


def test_a_request_that_does_not_pickle_is_refused_and_the_sender_lives(llm):
    """An AddRequest that cannot be pickled to the child (here a JSON schema nested past the
    recursion limit, which the HTTP server refuses earlier) fails that request alone: it once
    killed the thread that sends every request to the core, and all generation hung."""
    from pagoda.sampling_params import StructuredOutputsParams

    schema: dict = {"type": "string"}
    for _ in range(2000):
        schema = {"anyOf": [schema]}
    params = _params(max_tokens=2)
    params.structured_outputs = StructuredOutputsParams(json=schema)  # no copy: none to overrun
    with pytest.raises(ValueError, match="could not be passed to the engine core"):
        asyncio.run(asyncio.wait_for(_one(llm, "deep", params), 30))  # a hang, before
    assert llm._core._sender.is_alive()
    assert len(asyncio.run(_collect(llm, "after", max_tokens=2))) == 2
    assert llm.num_in_flight == 0 and llm._num_pending_adds == 0


async def _one(llm: AsyncLLM, rid: str, params: SamplingParams) -> list:
    return [o async for o in llm.generate("hi", params, rid)]


def test_closing_the_iterator_aborts_and_frees_kv_blocks(llm):
    async def main() -> None:
        gen = llm.generate("hello", _params(max_tokens=1000), "long-1")
        async for _ in gen:
            break
        assert llm.engine.kv_cache_usage > 0
        await gen.aclose()
        for _ in range(200):
            s = llm.engine.last_scheduler_stats
            if s.num_running_reqs == 0 and s.kv_cache_usage == 0:
                return
            await asyncio.sleep(0.01)

    asyncio.run(main())
    s = llm.engine.last_scheduler_stats
    assert s.num_running_reqs == 0 and s.num_waiting_reqs == 0 and s.kv_cache_usage == 0.0
    assert llm.num_in_flight == 0 and not llm._streams


def test_abort_from_elsewhere_ends_the_stream_with_finish_reason_abort(llm):
    async def main() -> list:
        outs = []
        async for o in llm.generate("hi", _params(max_tokens=1000, n=2), "ab-1"):
            outs.append(o)
            if len(outs) == 2:
                await llm.abort("ab-1")
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs) < 20
    assert [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]


def test_waiting_bound_raises_overloaded(llm):
    # One running slot, a bound of 2 waiting: the 4th concurrent request is refused.
    async def main() -> list:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.ensure_future(_collect(llm, f"w{i}", max_tokens=40)))
            await asyncio.sleep(0.05)  # let the core take each one up
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], EngineOverloadedError)
    assert sum(isinstance(r, list) and r[-1].finished for r in results) == 3


def test_stats_hooks_see_every_step(llm):
    before = len(llm.hooked)
    asyncio.run(_collect(llm, "m1", max_tokens=3))
    its = llm.hooked[before:]
    assert sum(it.num_generation_tokens for it in its) == 3
    assert sum(len(it.time_to_first_tokens_iter) for it in its) == 1


def test_drain_finishes_running_requests_then_shutdown_reaps_the_child():
    llm = AsyncLLM(engine_factory=functools.partial(FakeEngine, step_delay=0.01))
    child = llm._core.process

    async def main() -> tuple:
        running = asyncio.ensure_future(_collect(llm, "r1", max_tokens=20))
        await asyncio.sleep(0.05)
        drained = asyncio.ensure_future(llm.drain(timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(EngineDrainingError):
            await _collect(llm, "late")
        return await running, await drained

    try:
        outs, drained = asyncio.run(main())
        assert drained and outs[-1].finished
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 20
    finally:
        llm.shutdown()
    assert not child.is_alive() and child.exitcode == 0
    assert not llm.is_running


def test_shutdown_tells_unfinished_callers():
    llm = AsyncLLM(engine_factory=functools.partial(FakeEngine, step_delay=0.01))

    async def main() -> None:
        task = asyncio.ensure_future(_collect(llm, "r1", max_tokens=10_000))
        await asyncio.sleep(0.1)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineDrainingError):
            await task

    asyncio.run(main())
    assert llm._core.process.exitcode == 0


@pytest.mark.parametrize(
    "factory, needle", [(failing_engine, "device lost"), (crashing_engine, "code 3")]
)
def test_engine_death_reaches_callers(factory, needle):
    llm = AsyncLLM(engine_factory=factory)
    try:
        with pytest.raises(EngineDeadError, match=needle):
            asyncio.run(_collect(llm, "r1"))
        time.sleep(0.05)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(llm, "r2"))
    finally:
        llm.shutdown()
    assert not llm._core.process.is_alive()


def test_engine_construction_error_is_raised_by_the_constructor():
    with pytest.raises(ValueError, match="lower --max-model-len"):
        AsyncLLM(engine_factory=misconfigured_engine)


def test_child_exits_when_the_parent_is_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import functools, sys, time
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from fake_engine import FakeEngine
        from pagoda.engine.async_llm import AsyncLLM
        if __name__ == "__main__":
            llm = AsyncLLM(engine_factory=functools.partial(FakeEngine, step_delay=0.01))
            print(llm._core.process.pid, flush=True)
            time.sleep(60)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert _pid_exists(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert _wait_gone(child_pid), "the engine core outlived its killed parent"
    finally:
        parent.kill()


def test_a_cpu_server_prefills_in_small_chunks_and_runs_few_requests_unless_told_otherwise():
    from pagoda.config import DEFAULT_MAX_NUM_SEQS
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.serving_engine import (
        SERVING_CPU_MAX_NUM_BATCHED_TOKENS,
        SERVING_CPU_SEQS_PER_CORE,
        serving_engine_args,
    )
    from pagoda.worker.model_runner import num_cpu_threads

    args = serving_engine_args(EngineArgs(device="cpu"))
    assert args.max_num_batched_tokens == SERVING_CPU_MAX_NUM_BATCHED_TOKENS
    assert args.max_num_seqs == SERVING_CPU_SEQS_PER_CORE * num_cpu_threads()
    given = EngineArgs(device="cpu", max_num_batched_tokens=4096, max_num_seqs=256)
    assert serving_engine_args(given).max_num_batched_tokens == 4096
    assert serving_engine_args(given).max_num_seqs == 256
    whole = EngineArgs(device="cpu", enable_chunked_prefill=False)
    assert serving_engine_args(whole).max_num_batched_tokens is None
    gpu = serving_engine_args(EngineArgs(device="cuda"))
    assert gpu.max_num_batched_tokens is None and gpu.max_num_seqs is None
    # Offline (LLM, bench throughput) keeps vLLM's default.
    config = EngineArgs(device="cpu")._scheduler_config(2048, async_scheduling=False)
    assert config.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_process_core_streams_exactly_what_the_thread_core_streams():
    """The engine core process is the fast path; the thread is its plain reference."""

    async def run(llm: AsyncLLM) -> list:
        async def one(rid: str, **kw) -> list:
            # Everything but the timestamps (RequestMetrics), which differ from run to run.
            outs = [o async for o in llm.generate("abc", _params(**kw), rid)]
            return [dataclasses.replace(o, metrics=None) for o in outs]

        return await asyncio.gather(
            one("greedy", max_tokens=6),
            one("sampled", max_tokens=5, temperature=1.0, seed=7, n=2),
            one("logprobs", max_tokens=4, logprobs=2, prompt_logprobs=1, stop=["f"]),
        )

    in_thread = AsyncLLM(FakeEngine())
    in_process = AsyncLLM(engine_factory=FakeEngine)
    try:
        assert asyncio.run(run(in_process)) == asyncio.run(run(in_thread))
    finally:
        in_thread.shutdown()
        in_process.shutdown()


def test_default_waiting_bound_is_a_quarter_of_the_batch_within_the_kv_cache():
    from pagoda.engine.serving_engine import default_max_waiting_requests

    assert default_max_waiting_requests(8, 46592, 8192) == 2  # a 2-core CPU server
    assert default_max_waiting_requests(256, 894480, 8192) == 64  # Llama-3-8B on an H200
    assert default_max_waiting_requests(256, 3 * 8192, 8192) == 3  # the KV cache binds
    assert default_max_waiting_requests(2, 100, 8192) == 1  # never 0 by default
