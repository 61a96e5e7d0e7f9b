"""Keeping Python's full garbage collections short while an engine runs."""

from __future__ import annotations

import ctypes
import gc


def freeze_startup_heap() -> None:
    """Move every object alive after an engine's start-up out of the garbage collector's sight.

    The model, torch's modules and the tokenizer are hundreds of thousands of objects that live
    as long as the engine; without this each full collection walks them all: ~140 ms in the
    HTTP front end, where a burst of requests triggered one and stalled the event loop, and
    110-120 ms of an H200 sitting idle in the middle of an offline benchmark. vLLM freezes its heaps
    after start-up for the same reason. What an earlier engine of this process left frozen is
    unfrozen first, so that its cycles, if it is gone, are collected now and not kept forever.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    trim_c_heap()


def trim_c_heap() -> None:
    """Give the C heap's free pages back to the operating system (glibc's malloc_trim; a no-op
    elsewhere). Loading a model frees much (the GGUF header's strings, the sources of repacked
    weights) that glibc would otherwise keep resident: ~15 MB of a CPU server's engine core."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)
