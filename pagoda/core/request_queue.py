"""The waiting queues of the scheduler: first come first served, or by priority (torch-free).

This module owns the order in which waiting requests are admitted. Both queues have the same
interface (`add`, `prepend`, `peek`, `pop`, `remove`, `len`, iteration in admission order);
`prepend` is where a preempted request goes back: the front under "fcfs", its priority's place
under "priority" (as vLLM v1's `request_queue.py`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from pagoda.core.request import Request


class FCFSRequestQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Waiting requests as a heap on (priority, arrival_time, request_id): lowest first."""

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    # A preempted request's place is set by its priority and arrival, not by the preemption.
    prepend = add

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


RequestQueue = FCFSRequestQueue | PriorityRequestQueue


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue of a scheduling policy ("fcfs" or "priority")."""
    return PriorityRequestQueue() if policy == "priority" else FCFSRequestQueue()
