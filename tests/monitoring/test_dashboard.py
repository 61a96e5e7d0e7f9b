"""GET /dashboard: behind the API key (a browser sends it as Basic auth's password), one
self-contained page, and in a real headless Chromium every panel draws non-zero values from
/metrics under traffic, with no console error. The screenshot is kept (its path is printed)."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "reliability"))
sys.path.insert(0, str(HERE))

from cdp import CHROMIUM, Browser, open_page  # noqa: E402
from servers import ServerProcess  # noqa: E402
from traffic import Traffic, overload_once, restart_engine_once  # noqa: E402

KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, str(HERE / "monitored_fake_server.py"), "--api-key", KEY,
           "--served-model-name", "smol", "--uvicorn-log-level", "warning",
           "--max-num-seqs", "4", "--max-waiting-requests", "8",
           "--die-once-file", str(log.parent / "died")]  # fmt: skip
    s = ServerProcess(cmd, log).wait_ready(60)
    restart_engine_once(s.url, s.headers)
    yield s
    s.stop()


def test_the_dashboard_is_behind_the_api_key_and_needs_no_internet(server):
    r = httpx.get(server.url + "/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic ")
    assert httpx.get(server.url + "/dashboard", auth=("admin", "wrong")).status_code == 401
    page = httpx.get(server.url + "/dashboard", auth=("any", KEY))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(server.url + "/dashboard", headers=server.headers).text == page.text
    assert "uPlot" in page.text and "pagodaDashboard" in page.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)  # nothing fetched
    assert httpx.get(server.url + "/metrics").status_code == 200  # what the page polls: open
    assert "/dashboard" not in httpx.get(server.url + "/openapi.json", headers=server.headers).text


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is missing (Debian: apt-get install "
                    "chromium; .ci/run installs it)")  # fmt: skip
def test_every_panel_draws_in_headless_chromium(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chromium")
    # A burst once the page polls: admission rejections draw only while their rate is seen.
    burst = threading.Timer(6.0, overload_once, (server.url, server.headers))
    with Traffic(server.url, server.headers):
        burst.start()
        drawn, errors, shot = asyncio.run(_drive(server.url, tmp))
        burst.join()
    print(f"\ndashboard screenshot: {shot}")
    assert not errors, errors
    assert all(drawn.values()), f"panels without a non-zero value: {drawn}"
    assert len(drawn) == 15 and shot.stat().st_size > 20_000


async def _drive(url: str, tmp: Path) -> tuple[dict, list[str], Path]:
    browser = Browser(tmp / "profile")
    try:
        async with aiohttp.ClientSession() as session:
            page = await open_page(session, browser)
            # The browser sends the key as a bearer token (a person types it at the prompt).
            await page.send(
                "Network.setExtraHTTPHeaders", headers={"Authorization": f"Bearer {KEY}"}
            )
            await page.send("Page.navigate", url=url + "/dashboard")
            drawn: dict = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                await asyncio.sleep(1.0)
                drawn = (
                    await page.evaluate(
                        "window.pagodaDashboard ? window.pagodaDashboard.nonZero() : {}"
                    )
                    or {}
                )
                if drawn and all(drawn.values()):
                    break
            await asyncio.sleep(2.0)  # a few more polls: the lines, not single points
            shot = await page.screenshot(tmp / "dashboard.png")
            await page.ws.close()
            return drawn, page.errors, shot
    finally:
        browser.close()
