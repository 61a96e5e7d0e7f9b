"""Helpers for the processes Pagoda starts (executor workers, grammar compile workers, the
server's preprocessing workers)."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import threading
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


@contextlib.contextmanager
def born_ignoring_sigint() -> Iterator[None]:
    """Processes started inside ignore SIGINT from their first instruction. A spawned worker
    imports torch and Pagoda before its entry point can ignore Ctrl-C itself (the parent decides
    when workers stop), and a Ctrl-C in those seconds printed a KeyboardInterrupt traceback from
    each. An ignored signal stays ignored across exec, and Python installs its KeyboardInterrupt
    handler only where SIGINT is at its default. Only the main thread can set a handler: from
    another this is a no-op. A Ctrl-C to this process within (a spawn, milliseconds) is lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.SIG_DFL)
