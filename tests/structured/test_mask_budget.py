"""The time budget of applying a constraint, with fake matchers (no model, no xgrammar): the step
loop waits for a mask no longer than the request's budget, fills the rows after a slow one,
never sees a late write from an abandoned fill, and a matcher slow to advance ends its request
with an error."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pagoda.structured_output.backend_xgrammar import GrammarState
from pagoda.structured_output.filler import MaskFiller


class FakeState:
    """Fills its row with `value` after `fill_s` seconds (time.sleep releases the GIL, as
    xgrammar does)."""

    def __init__(self, value: int, fill_s: float = 0.0, budget_s: float = 0.1) -> None:
        self.value, self.fill_s, self.budget_s = value, fill_s, budget_s

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        time.sleep(self.fill_s)
        bitmask[row] = self.value


def test_a_mask_past_its_budget_is_given_up_on_and_the_others_are_filled():
    filler = MaskFiller()
    states = [FakeState(1), FakeState(2, 0.6), FakeState(3), FakeState(4, 0.6), FakeState(5)]
    bitmask = np.zeros((5, 4), dtype=np.int32)
    t0 = time.monotonic()
    assert filler.fill(states, bitmask) == [1, 3]
    took = time.monotonic() - t0
    assert 0.2 <= took < 0.5, took  # two budgets of 0.1 s, not the two fills of 0.6 s
    assert bitmask[:, 0].tolist() == [1, 0, 3, 0, 5]
    assert filler.num_abandoned == 2
    time.sleep(0.7)  # the abandoned fills end: they write nothing into the step's bitmask
    assert bitmask[:, 0].tolist() == [1, 0, 3, 0, 5]
    # A new step is served by the worker that took over.
    threads = threading.active_count()
    bitmask[:] = 0
    assert filler.fill([FakeState(7), FakeState(8)], bitmask[:2]) == []
    assert bitmask[:2, 0].tolist() == [7, 8] and threading.active_count() == threads
    filler.close()


def test_normal_masks_are_filled_in_place_and_errors_reach_the_step_loop():
    filler = MaskFiller()
    bitmask = np.zeros((3, 2), dtype=np.int32)
    assert filler.fill([FakeState(i) for i in (4, 5, 6)], bitmask) == []
    assert bitmask[:, 1].tolist() == [4, 5, 6] and filler.num_abandoned == 0

    class Broken(FakeState):
        def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
            raise RuntimeError("xgrammar failed")

    with pytest.raises(RuntimeError, match="xgrammar failed"):
        filler.fill([FakeState(1), Broken(2)], bitmask[:2])
    filler.close()


class SlowMatcher:
    """xgrammar's GrammarMatcher as GrammarState uses it; accepting takes `accept_s`."""

    def __init__(self, accept_s: float) -> None:
        self.accept_s = accept_s

    def is_terminated(self) -> bool:
        return False

    def accept_token(self, token_id: int) -> bool:
        time.sleep(self.accept_s)
        return True


def test_a_matcher_slow_to_advance_ends_its_request_with_an_error():
    fast = GrammarState(SlowMatcher(0.0), budget_s=0.05)
    assert fast.accept_token(1) is False and fast.error is None
    slow = GrammarState(SlowMatcher(0.08), budget_s=0.05)
    assert slow.accept_token(1) is True
    assert "longer than 50 ms to advance" in slow.error
    assert "PAGODA_GRAMMAR_MASK_BUDGET_MS" in slow.error and not slow.rejected


def test_the_worker_thread_ends_with_its_filler():
    before = set(threading.enumerate())
    filler = MaskFiller()
    filler.fill([FakeState(1)], np.zeros((1, 1), dtype=np.int32))
    (worker,) = [t for t in threading.enumerate() if t not in before]
    del filler
    worker.join(2)
    assert not worker.is_alive()


def test_abandoned_fills_are_counted_until_they_return():
    """What admission control reads (PAGODA_GRAMMAR_MAX_ABANDONED): each fill given up on keeps
    a core until it returns, and counts as running until then."""
    filler = MaskFiller()
    bitmask = np.zeros((3, 1), dtype=np.int32)
    assert filler.fill([FakeState(1, 0.5), FakeState(2, 0.8), FakeState(3)], bitmask) == [0, 1]
    assert filler.num_running_abandoned == 2
    time.sleep(0.5)
    assert filler.num_running_abandoned == 1
    time.sleep(0.4)
    assert filler.num_running_abandoned == 0 and filler.num_abandoned == 2
    filler.close()
