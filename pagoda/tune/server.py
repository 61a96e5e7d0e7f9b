"""One server per trial of `pagoda tune`: started in its own process group with the trial's
flags, waited for on /health, and stopped with everything it spawned (the engine core, its
workers) however the tuner ends: normally, on an error, or on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def knob_flags(knobs: dict[str, Any]) -> list[str]:
    """{"max_num_seqs": 64, "enable_prefix_caching": False, ...} as vLLM-named flags."""
    out: list[str] = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            out += [flag, str(value)]
    return out


class TrialServer:
    """`base_cmd + knob flags + --port P`, its output in `log_path`."""

    def __init__(self, base_cmd: list[str], knobs: dict[str, Any], log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*base_cmd, *knob_flags(knobs), "--port", str(self.port)]
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stop() ends all of it
        )  # fmt: skip

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ValueError(
                    f"the server exited with code {self.proc.returncode} at start "
                    f"({' '.join(self.cmd)}): {self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise ValueError(f"the server was not ready in {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 600) -> str:
        self._log.flush()
        with open(self.log_path, "rb") as f:
            text = f.read().decode(errors="replace")
        return " ".join(text[-n:].split())

    def stop(self) -> None:
        """SIGTERM to the group (the server drains nothing: no request is left), then SIGKILL
        for whatever is still there after 10 s."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core if it outlived the server
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()


def default_server_cmd(model: str | None) -> list[str]:
    """`pagoda serve`'s module, its queue unbounded so that every trial serves every request
    (the admission bound is a policy, not a performance knob; the report says so)."""
    cmd = [sys.executable, "-m", "pagoda.entrypoints.openai.api_server"]
    if model:
        cmd += ["--model", model]
    return cmd + ["--max-waiting-requests", "-1"]
