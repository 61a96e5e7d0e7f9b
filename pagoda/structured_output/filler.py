"""`MaskFiller`: fills a step's bitmask rows on a worker thread, so that the step loop can stop
waiting for a constraint too slow to apply.

xgrammar fills a row without holding the GIL, and nothing can interrupt it. Most constraints
fill a row in microseconds, but an ambiguous one can take seconds: `([^a]{1,50}[^b]{1,50}){1,50}`
as a regex took 0.66 s a token at first and 18 s a token after six, over the embedded model's
49,152 tokens (2-core AMD EPYC). Filled on the step loop, as before, it delayed every request
in the batch by as much. Here one worker thread fills the rows one after another while the loop
waits; a row that takes longer than its request's `budget_s` is given up on: its request is
reported (the engine ends it with an error) and the rows after it go to a new worker. The
abandoned fill runs to its end on its thread, into a scratch row nobody reads, and the thread
exits then. One such request thus costs the others one step longer by its budget, and a core
until xgrammar returns; the serving loop refuses new structured requests (503) while
PAGODA_GRAMMAR_MAX_ABANDONED such fills still run (`num_running_abandoned`), so that a flood of
them cannot take every core.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from typing import Any

import numpy as np


def too_slow_message(what: str, budget_s: float) -> str:
    """The error of a request whose constraint is too slow to apply."""
    return (
        f"the structured_outputs constraint took longer than {budget_s * 1e3:g} ms {what} "
        "(PAGODA_GRAMMAR_MASK_BUDGET_MS): simplify it"
    )


class _Batch:
    """Rows `start:` of one step's bitmask, filled in order by one worker. The step loop reads
    which row is being filled since when, and may give the batch up (`abandoned`): the worker
    then writes nothing more into the bitmask."""

    def __init__(self, states: list[Any], bitmask: np.ndarray, start: int) -> None:
        self.states, self.bitmask, self.start = states, bitmask, start
        self.lock = threading.Lock()
        self.row = -1  # the row being filled (`filling`) or last filled, -1 before the first
        self.started = 0.0  # when its fill started (time.monotonic())
        self.filling = False
        self.over_budget: list[int] = []  # rows filled, but later than their budget allows
        self.abandoned = False
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        scratch = np.empty((1, self.bitmask.shape[1]), dtype=self.bitmask.dtype)
        try:
            for row in range(self.start, len(self.states)):
                with self.lock:
                    if self.abandoned:
                        return
                    self.row, self.started, self.filling = row, time.monotonic(), True
                self.states[row].fill_bitmask(scratch, 0)
                with self.lock:
                    if self.abandoned:
                        return
                    self.filling = False
                    # Late, though the step loop did not see it (its thread was not running).
                    if time.monotonic() - self.started > self.states[row].budget_s:
                        self.over_budget.append(row)
                    self.bitmask[row] = scratch[0]
        except BaseException as e:  # noqa: BLE001 - raised again on the step loop
            self.error = e
        finally:
            self.done.set()


class _Worker:
    """A thread that runs batches until it is given `None`, or one of its batches is given up
    on (its thread is then the abandoned fill's)."""

    def __init__(self) -> None:
        self.batches: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="pagoda-grammar-mask", daemon=True).start()

    def _run(self) -> None:
        while (batch := self.batches.get()) is not None:
            batch.run()
            if batch.abandoned:
                return


class MaskFiller:
    def __init__(self) -> None:
        self._worker: _Worker | None = None
        self.num_abandoned = 0  # fills given up on (each left running on its own thread)
        self._abandoned: list[_Batch] = []  # those given up on, until their fill returns

    @property
    def num_running_abandoned(self) -> int:
        """Fills given up on that still run (each keeps a core busy until xgrammar returns)."""
        self._abandoned = [b for b in self._abandoned if not b.done.is_set()]
        return len(self._abandoned)

    def fill(self, states: list[Any], bitmask: np.ndarray) -> list[int]:
        """Fill row i of `bitmask` with `states[i].fill_bitmask`, waiting for each at most its
        `states[i].budget_s` seconds. Returns the rows that took longer than their budget (given
        up on, or late: their contents are undefined); raises what a fill raised."""
        slow: list[int] = []
        start = 0
        while start < len(states):
            if self._worker is None:
                self._worker = _Worker()
                # Its thread ends with this filler (an engine dropped), not with the process.
                weakref.finalize(self, self._worker.batches.put, None)
            batch = _Batch(states, bitmask, start)
            self._worker.batches.put(batch)
            row = self._wait(batch)
            slow += batch.over_budget
            if row is None:
                break
            slow.append(row)
            self.num_abandoned += 1
            self._abandoned.append(batch)
            self._worker = None  # its thread ends with the abandoned fill
            start = row + 1
        return sorted(slow)

    def _wait(self, batch: _Batch) -> int | None:
        """Wait for `batch` to finish (None) or for one of its rows to run past its budget: that
        row, the batch given up on."""
        while True:
            with batch.lock:
                row, started, filling = batch.row, batch.started, batch.filling
                if filling and time.monotonic() - started > batch.states[row].budget_s:
                    batch.abandoned = True
                    return row
            if filling:
                timeout = started + batch.states[row].budget_s - time.monotonic()
            else:  # between rows, or not started yet (a busy machine): no fill is timed
                following = batch.start if row < 0 else min(row + 1, len(batch.states) - 1)
                timeout = batch.states[following].budget_s
            if batch.done.wait(max(timeout, 0.0) if math.isfinite(timeout) else None):
                if batch.error is not None:
                    raise batch.error
                return None

    def close(self) -> None:
        """End the worker thread (a fill in progress finishes first)."""
        if self._worker is not None:
            self._worker.batches.put(None)
            self._worker = None
