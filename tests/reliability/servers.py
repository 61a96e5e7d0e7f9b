"""Server processes for the fault suite: the real `pagoda serve` stack on the embedded model, or
on the fake engine (`fake_server.py`: the same app, admission, restarts and drain, with an
engine that needs no model), each with its log captured to a file the tests read."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`cmd` (its port and log appended), started in its own process group; `wait_ready`
    polls /health until it answers 200."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.headers = {"Authorization": f"Bearer {KEY}"}

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready in {timeout} s: {self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if not (line.startswith(name + "{") or line.startswith(name + " ")):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def engine_core_pid(self) -> int:
        """The engine core process (the one spawned child running the engine)."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for pid in f.read().split():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        cmd = c.read()
                    if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                        return int(pid)
        raise RuntimeError("no engine core process found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()


def real_server(log_path: Path, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    cmd = [
        sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--api-key", KEY,
        "--served-model-name", "smol", "--uvicorn-log-level", "warning", "--disable-log-stats",
        *flags,
    ]  # fmt: skip
    return ServerProcess(cmd, log_path, env)


def fake_server(log_path: Path, *flags: str) -> ServerProcess:
    cmd = [sys.executable, str(HERE / "fake_server.py"), "--api-key", KEY, *flags]
    return ServerProcess(cmd, log_path)
