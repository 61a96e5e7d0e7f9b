"""`ForwardTimer`: the seconds one step's model forward pass took, for detailed request traces
(`--collect-detailed-traces model|all`, `gen_ai.latency.time_in_model_forward`).

On a CPU the host's clock around the call: its kernels run as they are called. On CUDA a pair
of timing events around the launches, read once the step's output has been waited for, when
the end event has passed; a step that samples nothing is not otherwise waited for, so reading
it waits for its end event (as vLLM says of detailed traces, they may block).
"""

from __future__ import annotations

import time

import torch


class ForwardTimer:
    """Started at construction, before the forward pass is launched; `stop()` after it."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._elapsed = 0.0
        if device.type == "cuda":
            self._events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
            self._events[0].record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._events is not None:
            self._events[1].record()
        else:
            self._elapsed = time.perf_counter() - self._start

    def seconds(self) -> float:
        if self._events is None:
            return self._elapsed
        start, end = self._events
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
