"""Helpers for the processes Pagoda starts (executor workers, grammar compile workers)."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator


@contextlib.contextmanager
def children_allowed() -> Iterator[None]:
    """Let a daemonic process (the serving engine core) start daemonic children: multiprocessing
    refuses it so that none outlive it; these are killed with it (daemonic too) or leave when it
    is gone (they watch their parent)."""
    me = multiprocessing.current_process()
    daemon = me.daemon
    if daemon:
        me.daemon = False
    try:
        yield
    finally:
        if daemon:
            me.daemon = True
