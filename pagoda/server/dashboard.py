"""`GET /dashboard`: the Grafana dashboard's panels drawn in the browser from `/metrics`.

One self-contained HTML page (uPlot, vendored from the npm registry with its MIT licence in
`static/`, and `static/dashboard.js` inlined), so it needs no internet and one request. The
page's script polls `/metrics`, which is open, so it holds no key. The page itself is behind
the API key like every route but /health and /metrics; a browser cannot send a bearer token
when it opens a URL, so `BasicAuthForDashboard` answers a keyless request for it with a Basic
challenge (the browser asks for a user name, any, and a password, the API key) and hands
the password on as the bearer token that `APIKeyAuth` checks.
"""

from __future__ import annotations

import base64
import functools
from importlib import resources
from typing import Any

UPLOT = "uPlot-1.6.32"


@functools.cache
def dashboard_html() -> str:
    static = resources.files("pagoda.server") / "static"

    def read(name: str) -> str:
        return (static / name).read_text(encoding="utf-8")

    # </script> cannot occur inside the inlined scripts: uPlot's minified code has none.
    return (
        read("dashboard.html")
        .replace("/*UPLOT_CSS*/", read(f"{UPLOT}.min.css"))
        .replace("/*UPLOT_JS*/", read(f"{UPLOT}.iife.min.js"))
        .replace("/*DASHBOARD_JS*/", read("dashboard.js"))
    )


class BasicAuthForDashboard:
    """For GET /dashboard only: `Authorization: Basic user:KEY` becomes `Bearer KEY`, and no
    Authorization header at all gets 401 with a Basic challenge (the browser's login prompt)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/dashboard":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
        auth = dict(scope["headers"]).get(b"authorization")
        if auth is None:
            from pagoda.server.middleware import send_error

            await send_error(send, 401, "The dashboard needs the API key (as the password)",
                             {"WWW-Authenticate": 'Basic realm="pagoda", charset="UTF-8"'})  # fmt: skip
            return
        scheme, _, value = auth.strip().partition(b" ")
        if scheme.lower() == b"basic":
            try:
                decoded = base64.b64decode(value.strip(), validate=True).decode()
                auth = b"Bearer " + decoded.partition(":")[2].encode()
            except (ValueError, UnicodeDecodeError):
                auth = b""  # APIKeyAuth refuses it
        scope = {**scope, "headers": [*headers, (b"authorization", auth)]}
        await self.app(scope, receive, send)
