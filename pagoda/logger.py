"""The `pagoda` logger: one stderr handler, level from PAGODA_LOGGING_LEVEL (default INFO)."""

from __future__ import annotations

import logging

from pagoda import envs

_FORMAT = "%(levelname)s %(asctime)s %(name)s] %(message)s"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger("pagoda")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(envs.PAGODA_LOGGING_LEVEL)
        root.propagate = False
    return logging.getLogger(name)
