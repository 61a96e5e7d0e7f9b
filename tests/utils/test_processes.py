"""Workers started under `born_ignoring_sigint` ignore Ctrl-C from their first instruction
(before their entry point runs, while they import torch), and the parent's handler is back
after."""

from __future__ import annotations

import contextlib
import multiprocessing
import signal

from pagoda.utils.processes import born_ignoring_sigint


def _report_sigint(conn) -> None:
    conn.send(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)


def test_children_started_within_ignore_sigint_from_birth() -> None:
    ctx = multiprocessing.get_context("spawn")
    before = signal.getsignal(signal.SIGINT)
    for ignoring in (True, False):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_report_sigint, args=(child,))
        with born_ignoring_sigint() if ignoring else contextlib.nullcontext():
            proc.start()
        assert parent.poll(60) and parent.recv() is ignoring
        proc.join(10)
    assert signal.getsignal(signal.SIGINT) is before
