"""AsyncLLM against the fake engine: the engine thread, cancellation, the waiting bound, drain."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.exceptions import EngineDeadError, EngineDrainingError, EngineOverloadedError
from pagoda.sampling_params import RequestOutputKind, SamplingParams


def _params(**kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(output_kind=RequestOutputKind.DELTA, **kw)


async def _collect(llm: AsyncLLM, rid: str, **kw) -> list:
    return [o async for o in llm.generate("hi", _params(**kw), rid)]


def test_generate_streams_deltas_and_only_the_engine_thread_touches_the_engine():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    try:
        outs = asyncio.run(_collect(llm, "r1", max_tokens=5))
        assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 5
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert "".join(o.outputs[0].text for o in outs) == "defgh"  # len("<s>hi")=3 -> 'd'...
        assert engine.engine_thread_ids == {llm._thread.ident}
        assert threading.get_ident() not in engine.engine_thread_ids
    finally:
        llm.shutdown()


def test_rejected_request_raises_value_error_and_engine_keeps_running():
    llm = AsyncLLM(FakeEngine(max_model_len=3))
    try:
        with pytest.raises(ValueError, match="maximum context length"):
            asyncio.run(_collect(llm, "long"))
        llm.engine.model_config.max_model_len = 64
        assert len(asyncio.run(_collect(llm, "ok", max_tokens=2))) == 2
    finally:
        llm.shutdown()


def test_closing_the_iterator_aborts_and_frees_kv_blocks():
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)

    async def main() -> None:
        gen = llm.generate("hello", _params(max_tokens=1000), "r1")
        async for _ in gen:
            assert engine.kv_cache_usage > 0
            break
        await gen.aclose()
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_usage == 0.0
        assert llm.num_in_flight == 0
    finally:
        llm.shutdown()


def test_cancelled_task_aborts_its_request():
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)

    async def main() -> None:
        task = asyncio.ensure_future(_collect(llm, "r1", max_tokens=1000))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):
            if not engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert not engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_waiting_bound_raises_overloaded():
    # One running slot, a bound of 2 waiting: the 4th concurrent request is refused.
    engine = FakeEngine(max_num_seqs=1, step_delay=0.02)
    llm = AsyncLLM(engine, max_waiting_requests=2)

    async def main() -> list:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.ensure_future(_collect(llm, f"r{i}", max_tokens=20)))
            await asyncio.sleep(0.05)  # let the engine thread pick each one up
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        results = asyncio.run(main())
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) == 1 and isinstance(errors[0], EngineOverloadedError)
        assert sum(isinstance(r, list) and r[-1].finished for r in results) == 3
    finally:
        llm.shutdown()


def test_drain_finishes_running_requests_and_refuses_new_ones():
    llm = AsyncLLM(FakeEngine(step_delay=0.01))

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


def test_engine_failure_reaches_callers():
    engine = FakeEngine()

    def boom():
        raise RuntimeError("device lost")

    engine.step = boom
    llm = AsyncLLM(engine)
    try:
        with pytest.raises(EngineDeadError, match="device lost"):
            asyncio.run(_collect(llm, "r1"))
        time.sleep(0.05)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_collect(llm, "r2"))
    finally:
        llm.shutdown()


def test_abort_from_elsewhere_ends_the_stream_with_finish_reason_abort():
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)

    async def main() -> list:
        outs = []
        async for o in llm.generate("hi", _params(max_tokens=1000, n=2), "r1"):
            outs.append(o)
            if len(outs) == 2:
                await llm.abort("r1")
        return outs

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished
        assert [c.finish_reason for c in outs[-1].outputs] == ["abort", "abort"]
        assert len(outs) < 10 and not engine.has_unfinished_requests()
    finally:
        llm.shutdown()


def test_a_stop_string_found_in_the_front_end_aborts_the_request_in_the_core():
    engine = FakeEngine(step_delay=0.005)
    aborted: list[list[str]] = []
    abort = engine.abort_requests
    engine.abort_requests = lambda ids: (aborted.append(list(ids)), abort(ids))[1]
    llm = AsyncLLM(engine)
    try:
        # Greedy after "hi" (3 tokens with BOS) is "defgh...": "f" stops it at the third token.
        outs = asyncio.run(_collect(llm, "r", max_tokens=100, stop=["f"]))
        assert "".join(o.outputs[0].text for o in outs if o.outputs) == "de"
        assert outs[-1].outputs[0].finish_reason == "stop"
        deadline = time.monotonic() + 5
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted == [["r"]] and not engine.has_unfinished_requests()
        assert engine.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_n_samples_fan_in_to_one_stream():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    try:
        outs = asyncio.run(_collect(llm, "r", max_tokens=3, n=3, temperature=1.0, seed=5))
        texts = {i: "" for i in range(3)}
        for o in outs:
            for c in o.outputs:
                texts[c.index] += c.text
        assert outs[-1].finished and all(len(t) == 3 for t in texts.values())
        again = asyncio.run(_collect(llm, "r2", max_tokens=3, n=1, temperature=1.0, seed=6))
        assert "".join(o.outputs[0].text for o in again) == texts[1]  # sample i: seed + i
    finally:
        llm.shutdown()
