"""Fixtures shared by test directories: `cpu_isa` runs a C CPU kernel test once per ISA level;
`tok` is the embedded model's tokenizer and `ref` transformers' reading of the same GGUF (the
tokenizer tests' oracle); `warnings` collects the warnings the `pagoda` loggers emit."""

from __future__ import annotations

import os

import pytest

from pagoda.attention.cpu import library
from pagoda.utils import cpu_build as build


def _clear_cpu_kernel_caches() -> None:
    from pagoda.kernels.cpu import ops

    ops.load_cpu_ops.cache_clear()
    ops.cpu_ops_available.cache_clear()
    library.load_library.cache_clear()


def _isa_params() -> list:
    supported, best = build.supported_isas(), build.best_isa()
    return [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                isa not in supported, reason=f"this CPU lacks {isa} (its best level: {best})"
            ),
        )
        for isa in build.ISA_LEVELS
    ]


@pytest.fixture(params=_isa_params())
def cpu_isa(request) -> str:
    """The test runs with the CPU kernels (ops and paged attention) built for each ISA level
    in turn, as `$PAGODA_CPU_ISA` forces it; levels this CPU lacks are skipped."""
    old = os.environ.get(build.ISA_ENV)
    os.environ[build.ISA_ENV] = request.param
    _clear_cpu_kernel_caches()
    try:
        yield request.param
    finally:
        if old is None:
            os.environ.pop(build.ISA_ENV, None)
        else:
            os.environ[build.ISA_ENV] = old
        _clear_cpu_kernel_caches()


@pytest.fixture(scope="session")
def tok():
    from pagoda.config import embedded_model_path
    from pagoda.tokenizer import Tokenizer

    return Tokenizer.from_gguf(embedded_model_path())


@pytest.fixture(scope="session")
def ref():
    from model_testing import hf_tokenizer

    from pagoda.config import embedded_model_path

    path = embedded_model_path()
    return hf_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))


@pytest.fixture
def warnings():
    """Warnings of the `pagoda` loggers (they do not propagate to the root logger)."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("pagoda").addHandler(handler)
    yield records
    logging.getLogger("pagoda").removeHandler(handler)
