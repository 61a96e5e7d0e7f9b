"""The tensor-parallel worker's message loop (`multiproc_worker._serve`) with a stand-in
worker: on CUDA it launches a step that is already queued behind the one in flight before
answering that one, answers a step as soon as its tokens are sampled when nothing is queued,
and keeps its answers in the order of the driver's messages; on a CPU each step is answered
before the next one is read."""

from __future__ import annotations

import pickle
import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from pagoda.executor.multiproc_worker import _serve


class _Future:
    def __init__(self, name: str, log: list[str], ready: threading.Event) -> None:
        self.name, self.log, self.ready = name, log, ready

    def done(self) -> bool:
        return self.ready.is_set()

    def get(self) -> str:
        self.ready.wait(5)
        self.log.append(f"answer {self.name}")
        return f"out {self.name}"


class _Worker:
    def __init__(self, device: str) -> None:
        self.rank = 0
        self.runner = SimpleNamespace(device=SimpleNamespace(type=device))
        self.log: list[str] = []
        self.ready: dict[str, threading.Event] = {}

    def launch_step(self, name: str) -> _Future:
        self.log.append(f"launch {name}")
        event = self.ready.setdefault(name, threading.Event())
        return _Future(name, self.log, event)

    def call(self, method: str, args: tuple) -> str:
        self.log.append(f"call {method}")
        return f"result {method}"


def _start(worker: _Worker):
    driver, end = Pipe()
    thread = threading.Thread(target=_serve, args=(worker, end), daemon=True)
    return driver, thread


def _send(driver, method: str, *args) -> None:
    driver.send_bytes(pickle.dumps((method, args)))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_queued_step_is_launched_before_the_one_in_flight_is_answered(device) -> None:
    worker = _Worker(device)
    for name in ("a", "b"):
        worker.ready[name] = threading.Event()
    driver, thread = _start(worker)
    _send(driver, "execute_step", "a")
    _send(driver, "execute_step", "b")  # async scheduling: b is sent before a's answer
    thread.start()
    time.sleep(0.2)
    worker.ready["a"].set()
    assert driver.recv() == ("ok", "out a")
    worker.ready["b"].set()
    assert driver.recv() == ("ok", "out b")
    _send(driver, "shutdown")
    thread.join(5)
    if device == "cuda":
        assert worker.log[:3] == ["launch a", "launch b", "answer a"]
    else:  # a launch on a CPU computes the step: answer it before reading the next
        assert worker.log[:3] == ["launch a", "answer a", "launch b"]
    assert not thread.is_alive()


def test_a_finished_step_is_answered_without_waiting_for_the_next_message() -> None:
    worker = _Worker("cuda")
    worker.ready["a"] = threading.Event()
    driver, thread = _start(worker)
    thread.start()
    _send(driver, "execute_step", "a")
    time.sleep(0.1)
    assert not driver.poll(0)  # still running on the device
    worker.ready["a"].set()
    assert driver.poll(5) and driver.recv() == ("ok", "out a")  # nothing else was sent
    _send(driver, "shutdown")
    thread.join(5)
    assert not thread.is_alive()


def test_a_call_is_answered_after_the_step_before_it() -> None:
    worker = _Worker("cuda")
    worker.ready["a"] = threading.Event()
    driver, thread = _start(worker)
    _send(driver, "execute_step", "a")
    _send(driver, "initialize_kv_cache", 10)
    thread.start()
    time.sleep(0.1)
    worker.ready["a"].set()
    assert driver.recv() == ("ok", "out a")
    assert driver.recv() == ("ok", "result initialize_kv_cache")
    _send(driver, "shutdown")
    thread.join(5)
    assert worker.log == ["launch a", "answer a", "call initialize_kv_cache"]
