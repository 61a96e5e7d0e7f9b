"""The serving loop's grammar compiles (`GrammarCompilePool`): in a worker process that is killed
at the timeout, so a constraint too slow to compile stops costing a core when it is refused;
what comes back from a worker masks exactly as a grammar compiled in the engine; and, without
worker processes (threads), what runs on past its timeout is counted, and a compile no slot
was free to start in time is refused as busy."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.structured_output.backend_xgrammar import compile_constraint
from pagoda.structured_output.compile_pool import GrammarCompilePool, StructuredOutputsBusyError

# xgrammar takes ~5 s to compile this (2-core AMD EPYC); ordinary constraints take milliseconds.
SLOW_CHOICE = [f"option number {i} of many" for i in range(20_000)]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def _params(**so) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(**so))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie runs no more
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def manager():
    pytest.importorskip("xgrammar")
    from pagoda.config import embedded_model_path
    from pagoda.structured_output import StructuredOutputManager
    from pagoda.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(embedded_model_path())
    return StructuredOutputManager(tokenizer, len(tokenizer), tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def pool(manager):
    """One warm worker for the tests that leave it alive."""
    pool = GrammarCompilePool(manager, num_processes=1)
    yield pool
    pool.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_a_compile_past_its_timeout_is_refused_and_its_worker_killed(manager):
    """Before, the refused compile went on on its thread, a core busy until xgrammar returned;
    now its worker process is gone when the refusal comes, and the next constraint compiles in
    the worker started in its place."""
    pool = GrammarCompilePool(manager, num_processes=1)
    try:
        pool.submit(_params(regex="[ab]+"), 60).result(60)  # a warm worker
        (pid,) = pool.worker_pids()
        t0 = time.monotonic()
        future = pool.submit(_params(choice=SLOW_CHOICE), 1.0)
        with pytest.raises(ValueError, match="longer than 1 s to compile"):
            future.result(30)
        assert time.monotonic() - t0 < 3.0
        assert _gone(pid), "the worker that compiled past its timeout still runs"
        compiled = pool.submit(_params(json=SCHEMA), 60).result(60)
        assert compiled is not None and pool.worker_pids() not in ([], [pid])
        assert pool.num_runaway == 0
    finally:
        pool.close()
    assert all(_gone(p) for p in pool.worker_pids() + [pid])


def _masks_along(backend, compiled, tokens: list[int]) -> list[bytes]:
    """The next-token masks of `compiled` at each prefix of `tokens`."""
    matcher = backend.xgr.GrammarMatcher(compiled)
    bitmask = np.zeros((1, -(-backend.vocab_size // 32)), dtype=np.int32)
    masks = []
    for token in tokens:
        matcher.fill_next_token_bitmask(bitmask, 0)
        masks.append(bitmask.tobytes())
        assert matcher.accept_token(token)
    return masks


@pytest.mark.parametrize(
    "so, text",
    [
        ({"json": SCHEMA}, '{"name": "Ann", "age": 42}'),
        ({"regex": r"\(\d{3}\) \d{3}-\d{4}"}, "(555) 123-4567"),
        ({"choice": ["yes", "no", "maybe so"]}, "maybe so"),
        ({"grammar": 'root ::= "a" [0-9]+ ("," [0-9]+)*'}, "a12,3,45"),
    ],
)
def test_a_grammar_from_a_worker_masks_as_one_compiled_here(manager, pool, so, text):
    from_worker = pool.submit(_params(**so), 60).result(60)
    backend = manager.backend
    in_thread = compile_constraint(backend.compiler, StructuredOutputsParams(**so))
    tokens = manager.tokenizer.encode(text, add_special_tokens=False)
    masks = _masks_along(backend, from_worker, tokens)
    assert masks == _masks_along(backend, in_thread, tokens)
    assert len(set(masks)) > 1  # the masks do constrain


def test_an_invalid_constraint_is_a_value_error_and_the_worker_lives(pool):
    with pytest.raises(ValueError, match="invalid structured_outputs.regex"):
        pool.submit(_params(regex="(unclosed"), 60).result(60)
    (pid,) = pool.worker_pids()
    assert pool.submit(_params(regex="[xy]+"), 60).result(60) is not None
    assert pool.worker_pids() == [pid]


class SleepyManager:
    """A manager whose compiles sleep on the calling thread (as xgrammar, without the GIL)."""

    def __init__(self, compile_s: float) -> None:
        self.compile_s = compile_s
        self.validated: list[SamplingParams] = []
        self.lock = threading.Lock()

    def compile_worker_args(self) -> tuple:
        raise AssertionError("no worker processes here")

    def validate(self, params: SamplingParams) -> None:
        time.sleep(self.compile_s)
        with self.lock:
            self.validated.append(params)


def test_on_threads_a_compile_past_its_timeout_is_refused_and_counted_until_it_ends():
    """PAGODA_GRAMMAR_COMPILE_PROCESSES=0 (or an xgrammar that cannot read a grammar back): the
    compile runs on a thread, which nothing can stop; the request is refused at the deadline,
    and the compile counts as runaway until it returns."""
    pool = GrammarCompilePool(SleepyManager(0.6), num_processes=0)
    try:
        future = pool.submit(_params(regex="a+"), 0.2)
        time.sleep(0.3)
        pool.expire()
        with pytest.raises(ValueError, match="to compile"):
            future.result(0)
        assert pool.num_runaway == 1
        time.sleep(0.5)
        assert pool.num_runaway == 0
    finally:
        pool.close()


def test_a_compile_no_slot_could_start_in_time_is_refused_as_busy():
    manager = SleepyManager(0.5)
    pool = GrammarCompilePool(manager, num_processes=0)  # two threads
    try:
        first, second = (pool.submit(_params(regex=r), 10) for r in ("a+", "b+"))
        late = pool.submit(_params(regex="c+"), 0.2)
        time.sleep(0.3)
        pool.expire()
        with pytest.raises(StructuredOutputsBusyError, match="busy"):
            late.result(0)
        assert first.result(2) is None and second.result(2) is None
        # Identical constraints share one compile.
        same = [pool.submit(_params(regex="d+"), 10) for _ in range(3)]
        assert same[0] is same[1] is same[2]
        same[0].result(2)
        assert [p.structured_outputs.regex for p in manager.validated].count("d+") == 1
    finally:
        pool.close()
