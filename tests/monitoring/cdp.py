"""Headless Chromium driven over the DevTools protocol with aiohttp's websocket client (no
browser-automation package): start it, open a page, evaluate script, collect console errors
and exceptions, take a screenshot. Flags as this machine's notes say: no sandbox (root), no GPU,
no background networking (the network is closed), a fresh profile."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--hide-scrollbars", "--remote-debugging-port=0"]  # fmt: skip


class Browser:
    def __init__(self, profile: Path, width: int = 1440, height: int = 900) -> None:
        assert CHROMIUM, "chromium is not installed"
        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Page:
    """The browser's first page target, with its console errors collected as they come."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.ids = ws, itertools.count(1)
        self.errors: list[str] = []
        self.pending: dict[int, asyncio.Future] = {}
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data and data["id"] in self.pending:
                self.pending.pop(data["id"]).set_result(data)
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                self.errors.append(" ".join(str(a.get("value", a.get("description")))
                                            for a in params.get("args", [])))  # fmt: skip
            elif method == "Runtime.exceptionThrown":
                self.errors.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                self.errors.append(params["entry"].get("text", "") + " " +
                                   params["entry"].get("url", ""))  # fmt: skip

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        i = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def evaluate(self, expression: str) -> Any:
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                            awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def screenshot(self, path: Path) -> Path:
        r = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(r["data"]))
        return path


async def open_page(session: aiohttp.ClientSession, browser: Browser) -> Page:
    async with session.get(f"http://127.0.0.1:{browser.port}/json/list") as r:
        targets = await r.json(content_type=None)
    url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
    ws = await session.ws_connect(url, max_msg_size=0)
    page = Page(ws)
    for domain in ("Page", "Runtime", "Log", "Network"):
        await page.send(f"{domain}.enable")
    return page
